"""The process stage over a run's storage: every raw shard processed once, none skipped."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import write_deltalake

import rl.process_loop as process_loop
from rl.process_loop import ShardProcessor
from storage.schema import NewerSchemaError
from storage.shards import ShardReader, ShardWriter
from storage.status import InUse, ProcessOffset, ProcessOffsetBoard
from storage.tables import TABLE_CONFIGURATION, TABLE_SCHEMAS, StaleOffsetError, Tables
from tests.rl.test_processor import record
from tests.storage.foreign_shards import commit_foreign_file, first_version, ipc_bytes
from tests.storage.records import make_table
from tests.storage.test_tables import trajectory_row


def commit_raw_shards(store, ids: range) -> None:
    """One raw shard per trajectory ``t<i>``."""
    with ShardWriter(store, "w0", flush_records=1) as writer:
        for i in ids:
            writer.write(record(f"t{i}", f"e{i}", [1, 2, 3, 4], [False, False, True, True]))


def processed_ids(store) -> list[str]:
    reader = ShardReader(store, kind="processed")
    shards, _ = reader.poll()
    return sorted(tid for shard in shards for tid in reader.read(shard).column("trajectory_id").to_pylist())


def test_a_shard_whose_processing_raises_is_seen_again_and_the_ones_after_it_are_not_lost(
    local_store, monkeypatch
):
    commit_raw_shards(local_store, range(3))
    real = process_loop.process_shard
    failures = []

    def fails_once_on_the_second(table, *args, **kwargs):
        if kwargs["shard_id"].endswith("00000001") and not failures:
            failures.append(kwargs["shard_id"])
            raise RuntimeError("processing failed")
        return real(table, *args, **kwargs)

    monkeypatch.setattr(process_loop, "process_shard", fails_once_on_the_second)
    processor = ShardProcessor(local_store)
    with pytest.raises(RuntimeError):
        processor.poll()
    outcomes = processor.poll()
    assert [o.skipped for o in outcomes] == ["already processed", None, None]
    assert processed_ids(local_store) == ["t0", "t1", "t2"]
    assert processor.poll() == []


def test_an_append_that_landed_but_raised_is_not_appended_again(local_store):
    """The first shard's ``trajectories`` append lands and its reply is lost (it raises):
    the retry must find its rows in the table rather than append them twice."""
    commit_raw_shards(local_store, range(3))
    processor = ShardProcessor(local_store)
    real, lost = processor.tables.append, []

    def lands_then_raises(name, rows):
        real(name, rows)
        if name == "trajectories" and not lost:
            lost.append(rows)
            raise OSError("connection reset before the reply")

    processor.tables.append = lands_then_raises
    with pytest.raises(OSError, match="reply"):
        processor.poll()
    outcomes = processor.poll()
    assert [o.skipped for o in outcomes] == ["already processed", None, None]
    ids = Tables(local_store).read("trajectories").column("trajectory_id").to_pylist()
    assert sorted(ids) == ["t0", "t1", "t2"]


def test_a_twin_commit_that_landed_unconfirmed_is_not_committed_again(local_store):
    """The first twin's ``shards`` append lands, its reply is lost and the table cannot be
    read to confirm it: the retry must find the twin in the log rather than commit it a
    second time (a trainer would buffer its rows twice)."""
    commit_raw_shards(local_store, range(2))
    processor = ShardProcessor(local_store)
    real_append, real_read = processor.tables.append, processor.tables.read
    lost, blind = [], []

    def lands_then_raises(name, rows, once=None):
        appended = real_append(name, rows, once)
        if name == "shards" and not lost:
            lost.append(rows)
            blind.append(True)
            raise OSError("connection reset before the reply")
        return appended

    def unreadable_once(name, columns=None):
        if blind:
            blind.pop()
            raise OSError("storage unreachable")
        return real_read(name, columns)

    processor.tables.append, processor.tables.read = lands_then_raises, unreadable_once
    with pytest.raises(OSError, match="reply"):
        processor.poll()
    processor.poll()
    shards = Tables(local_store).read("shards", columns=["shard_id", "kind"]).to_pylist()
    twins = sorted(row["shard_id"] for row in shards if row["kind"] == "processed")
    assert twins == ["processed/w0/00000000", "processed/w0/00000001"]
    assert processed_ids(local_store) == ["t0", "t1"]
    ids = Tables(local_store).read("trajectories").column("trajectory_id").to_pylist()
    assert sorted(ids) == ["t0", "t1"]


def test_a_new_processor_starts_at_the_saved_offset_and_reads_no_table_whole(local_store, monkeypatch):
    """As the event-triggered deployment does, one processor per commit: each reads only
    the commits since the last one's offset, and neither table whole."""
    commit_raw_shards(local_store, range(2))
    assert len(ShardProcessor(local_store).poll()) == 2
    commit_raw_shards(local_store, range(2, 3))
    whole = []
    real_read, real_changes = Tables.read, Tables.changes

    def read(self, name, columns=None):
        whole.append(name)
        return real_read(self, name, columns)

    def changes(self, name, after=-1, identity=None):
        if after < 0:
            whole.append(name)
        return real_changes(self, name, after, identity)

    monkeypatch.setattr(Tables, "read", read)
    monkeypatch.setattr(Tables, "changes", changes)
    outcomes = ShardProcessor(local_store).poll()
    assert [(o.raw.shard_id, o.skipped) for o in outcomes] == [("raw/w0/00000002", None)]
    assert whole == []
    assert processed_ids(local_store) == ["t0", "t1", "t2"]


def test_without_its_saved_offset_a_restarted_processor_processes_nothing_twice(local_store):
    commit_raw_shards(local_store, range(2))
    assert len(ShardProcessor(local_store).poll()) == 2
    local_store.fs.rm(ProcessOffsetBoard(local_store).path)
    commit_raw_shards(local_store, range(2, 3))
    outcomes = ShardProcessor(local_store).poll()
    assert [o.skipped for o in outcomes] == ["already processed", "already processed", None]
    assert processed_ids(local_store) == ["t0", "t1", "t2"]
    ids = Tables(local_store).read("trajectories").column("trajectory_id").to_pylist()
    assert sorted(ids) == ["t0", "t1", "t2"]


def test_a_long_lived_processor_remembers_only_the_last_polls_twins_and_processes_nothing_twice(local_store):
    """What it keeps to skip done shards does not grow with the run: no raw shard up to the
    offset is polled again. It keeps the twins committed since the last poll's read, as a
    processor started at the new offset would: a second commit row of the last raw shard
    (an append retried after its reply was lost) is still skipped."""
    commit_raw_shards(local_store, range(2))
    ShardProcessor(local_store).poll()
    local_store.fs.rm(ProcessOffsetBoard(local_store).path)
    processor = ShardProcessor(local_store)
    assert [o.skipped for o in processor.poll()] == ["already processed"] * 2
    assert (processor._twins, processor._recorded) == (set(), None)
    for i in range(2, 7):
        commit_raw_shards(local_store, range(i, i + 1))
        assert [o.skipped for o in processor.poll()] == [None]
        assert processor._twins == {("w0", i)}
    tables = Tables(local_store)
    shards = tables.read("shards")
    tables.append("shards", shards.filter(pc.equal(shards.column("shard_id"), "raw/w0/00000006")))
    assert [o.skipped for o in processor.poll()] == ["already processed"]
    assert processor.poll() == []
    assert (processor._twins, processor._recorded) == (set(), None)
    expected = [f"t{i}" for i in range(7)]
    assert processed_ids(local_store) == expected
    assert sorted(tables.read("trajectories").column("trajectory_id").to_pylist()) == expected
    twins = [row["shard_id"] for row in tables.read("shards").to_pylist() if row["kind"] == "processed"]
    assert sorted(twins) == [f"processed/w0/{i:08d}" for i in range(7)]


@pytest.mark.parametrize("offset", [10_000, 0])
def test_a_saved_offset_the_log_cannot_follow_falls_back_to_the_whole_log(
    local_store, offset, monkeypatch, caplog
):
    """An offset past the log (the run's storage replaced), or one whose following change
    files are gone (vacuumed), is dropped with a warning; nothing is lost or done twice."""
    commit_raw_shards(local_store, range(2))
    ShardProcessor(local_store).poll()
    ProcessOffsetBoard(local_store).publish(ProcessOffset(offset=offset, time=0.0))
    commit_raw_shards(local_store, range(2, 3))
    if offset == 0:
        real = Tables.changes

        def vacuumed(self, name, after=-1, identity=None):
            if after >= 0:
                raise FileNotFoundError("a change file of version 1 is gone")
            return real(self, name, after, identity)

        monkeypatch.setattr(Tables, "changes", vacuumed)
    outcomes = ShardProcessor(local_store).poll()
    assert [o.skipped for o in outcomes] == ["already processed", "already processed", None]
    assert "processing from the beginning of the log" in caplog.text
    assert processed_ids(local_store) == ["t0", "t1", "t2"]


def test_a_restarted_processor_does_not_report_a_quarantined_shard_again(local_store):
    commit_raw_shards(local_store, range(3))
    raw, _ = ShardReader(local_store).poll()
    path = local_store.path(raw[1].path)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)
    heard = []
    first = ShardProcessor(local_store, on_shard=heard.append).poll()
    assert [o.skipped for o in first] == [None, "quarantined", None]
    local_store.fs.rm(ProcessOffsetBoard(local_store).path)
    again = ShardProcessor(local_store, on_shard=heard.append).poll()
    assert [o.skipped for o in again] == ["already processed"] * 3
    assert [o.skipped for o in heard] == [None, "quarantined", None]


def test_a_raw_shard_whose_file_is_missing_is_reported_so_once(local_store):
    commit_raw_shards(local_store, range(3))
    raw, _ = ShardReader(local_store).poll()
    os.remove(local_store.path(raw[1].path))
    heard = []
    first = ShardProcessor(local_store, on_shard=heard.append).poll()
    assert [o.skipped for o in first] == [None, "file missing", None]
    assert first[1].processed.num_rows == 0  # its empty twin tells the trainer it was dealt with
    local_store.fs.rm(ProcessOffsetBoard(local_store).path)
    again = ShardProcessor(local_store, on_shard=heard.append).poll()
    assert [o.skipped for o in again] == ["already processed"] * 3
    assert [o.skipped for o in heard] == [None, "file missing", None]
    assert processed_ids(local_store) == ["t0", "t2"]


def test_a_restarted_processor_does_not_process_or_report_an_empty_raw_shard_again(local_store):
    """A raw shard without rows (committed by a writer given its numbers) gets an empty twin
    and no ``trajectories`` row: the twin alone says it is done."""
    with ShardWriter(local_store, "w0", numbers_given=True) as writer:
        writer.commit(make_table(0, 0), seq=0)
    commit_raw_shards(local_store, range(1, 2))
    heard = []
    first = ShardProcessor(local_store, on_shard=heard.append).poll()
    assert [(o.skipped, o.processed.num_rows) for o in first] == [(None, 0), (None, 1)]
    local_store.fs.rm(ProcessOffsetBoard(local_store).path)
    again = ShardProcessor(local_store, on_shard=heard.append).poll()
    assert [o.skipped for o in again] == ["already processed"] * 2
    assert [o.raw.shard_id for o in heard] == ["raw/w0/00000000", "raw/w0/00000001"]


def test_a_decode_returning_what_the_text_column_cannot_hold_is_escaped_or_left_empty(local_store, caplog):
    """A decoder's lone surrogate (``surrogateescape`` on bytes that are not UTF-8) or a
    result that is not a string would fail every append of the shard's ``trajectories``
    rows, and so hold back every later shard, poll after poll."""
    commit_raw_shards(local_store, range(3))

    texts = iter([b"\xff".decode("utf-8", "surrogateescape"), b"bytes", "text"])
    outcomes = ShardProcessor(local_store, decode=lambda ids: next(texts)).poll()
    assert [o.skipped for o in outcomes] == [None, None, None]
    rows = Tables(local_store).read("trajectories", columns=["trajectory_id", "text"]).to_pylist()
    assert sorted((row["trajectory_id"], row["text"]) for row in rows) == [
        ("t0", "\\udcff"),
        ("t1", None),
        ("t2", "text"),
    ]
    assert "t1 does not decode" in caplog.text


def test_a_processor_whose_role_is_taken_while_it_commits_a_twin_appends_none_of_its_rows(local_store):
    """The new holder meets the twin without its ``trajectories`` rows and makes them up: the
    rows of the one that lost the role would be the shard's second."""
    commit_raw_shards(local_store, range(1))
    holder = ["first"]

    def held_by(name):
        def require():
            if holder[0] != name:
                raise InUse(f"the role of {name} was taken")

        return require

    first = ShardProcessor(local_store, before_commit=held_by("first"))
    real_append = first.tables.append

    def taken_once_the_twin_lands(name, rows, *args):
        appended = real_append(name, rows, *args)
        if name == "shards" and holder == ["first"]:
            holder[0] = "second"
            second = ShardProcessor(local_store, before_commit=held_by("second"))
            assert [o.skipped for o in second.poll()] == [None]  # it makes up the missing rows
        return appended

    first.tables.append = taken_once_the_twin_lands
    with pytest.raises(InUse, match="role of first"):
        first.poll()
    assert Tables(local_store).read("trajectories").column("trajectory_id").to_pylist() == ["t0"]
    assert processed_ids(local_store) == ["t0"]


def test_a_raw_shard_of_a_newer_treadle_stops_the_processor_and_gets_no_twin(local_store):
    """A worker upgraded before the processor commits a shard of a later record version: the
    processor stops at it, naming it, rather than marking it processed with an empty twin
    (its rows would never reach the trainer, even once the processor is upgraded)."""
    commit_raw_shards(local_store, range(1))
    newer = make_table(5, 2).append_column("score", pa.array([1.0, 2.0]))
    info = commit_foreign_file(
        local_store, 1, ipc_bytes(newer.replace_schema_metadata({"treadle.schema": "trajectory/3"}))
    )
    processor = ShardProcessor(local_store)
    for _ in range(2):
        with pytest.raises(NewerSchemaError, match="raw/w9/00000001"):
            processor.poll()
    twins = ShardReader(local_store, kind="processed").poll()[0]
    assert [(twin.worker, twin.seq) for twin in twins] == [("w0", 0)]
    assert local_store.fs.exists(local_store.path(info.path))
    assert processed_ids(local_store) == ["t0"]


def test_the_rows_a_shard_drops_for_broken_links_or_keeps_without_their_parent_are_logged(
    local_store, caplog
):
    """The processor's per-row messages (where a branch's tokens contradict its declared
    parent, a parent not in the shard) reach the log: a user whose agent framework writes
    wrong ``branch_at`` values learns which rows and why, not only a count."""
    with ShardWriter(local_store, "w0", flush_records=3) as writer:
        writer.write(record("p", "e", [1, 2, 3, 4], [False, True, True, True]))
        writer.write(record("c", "e", [1, 2, 9, 5], [False, True, True, True], parent="p", branch_at=3))
        writer.write(record("orphan", "f", [1, 2, 3], [False, True, True], parent="gone", branch_at=2))
    with caplog.at_level("WARNING"):
        (outcome,) = ShardProcessor(local_store).poll()
    assert outcome.counters.dropped["prefix_mismatch"] == 1
    assert "raw/w0/00000000" in caplog.text
    assert "trajectory 'c': tokens before branch_at 3 differ from parent 'p' at 2" in caplog.text
    assert "trajectory 'orphan': parent 'gone' is not in its execution" in caplog.text


def test_a_run_begun_before_the_record_had_error_processes_on_with_the_reasons_of_new_rollouts(store):
    """A run the previous treadle began: a raw shard of ``trajectory/1`` not processed yet and
    a ``trajectories`` table without ``error``. The processor reads the old shard (``error``
    null, not quarantined) and a new one holding why its rollout failed; the table takes the
    column at the next append, older rows null, and the processed twins carry it."""
    old_info = commit_foreign_file(store, 0, ipc_bytes(first_version(make_table(0, 2, prefix="old"))))
    schema = TABLE_SCHEMAS["trajectories"]
    write_deltalake(
        Tables(store).uri("trajectories"),
        pa.Table.from_pylist(
            [trajectory_row("before")], schema=schema.remove(schema.get_field_index("error"))
        ),
        mode="append",
        configuration=TABLE_CONFIGURATION,
        storage_options=store.config.delta_options(),
    )
    assert Tables(store).columns("trajectories") == [n for n in schema.names if n != "error"]
    failed = record("t1", "e1", [1, 2, 3, 4], [False, False, True, True], reward=None, status="env_error")
    failed["error"] = "sandbox start_failed during init: bwrap cannot create namespaces"
    with ShardWriter(store, "w0") as writer:
        writer.write_many([record("t0", "e0", [1, 2, 3, 4], [False, False, True, True]), failed])

    outcomes = ShardProcessor(store).poll()
    assert sorted((o.raw.shard_id, o.skipped) for o in outcomes) == [
        ("raw/w0/00000000", None),
        (old_info.shard_id, None),
    ]
    assert not ShardReader(store).quarantined(old_info)
    rows = Tables(store).read("trajectories")
    errors = dict(
        zip(rows.column("trajectory_id").to_pylist(), rows.column("error").to_pylist(), strict=True)
    )
    assert errors == {
        "before": None,
        "old0": None,
        "old1": None,
        "t0": None,
        "t1": "sandbox start_failed during init: bwrap cannot create namespaces",
    }
    reader = ShardReader(store, kind="processed")
    twins = {shard.worker: reader.read(shard) for shard in reader.poll()[0]}
    assert twins["w9"].column("error").to_pylist() == [None, None]
    assert twins["w0"].column("trajectory_id").to_pylist() == ["t0"]  # an env_error is never trained on


def test_an_offset_save_that_fails_is_tried_again_a_save_interval_later_not_at_every_poll(
    local_store, monkeypatch, caplog
):
    """A store refusing the offset (an S3 outage, a status folder made read-only) is not
    asked again at each poll, twice a second while idle, with a warning each time: the next
    attempt waits ``SAVE_EVERY_S`` as a save that landed does."""
    commit_raw_shards(local_store, range(1))
    attempts = []

    def refused(self, offset):
        attempts.append(offset)
        raise OSError("status folder is read-only")

    monkeypatch.setattr(ProcessOffsetBoard, "publish", refused)
    processor = ShardProcessor(local_store)
    for _ in range(5):
        processor.poll()
    assert len(attempts) == 1
    assert len([r for r in caplog.records if "could not save the process offset" in r.getMessage()]) == 1


def test_a_saved_offset_of_a_recreated_shards_table_is_dropped_and_nothing_is_skipped(local_store, caplog):
    """The run's ``tables/`` and ``shards/`` deleted but ``status/`` kept: the new ``shards``
    log is past the saved offset, yet its first versions are no processor's; the saved offset
    names the table it was taken in, so it is dropped with a warning."""
    commit_raw_shards(local_store, range(3))
    processor = ShardProcessor(local_store)
    processor.poll()
    processor.save()
    assert ProcessOffsetBoard(local_store).read().offset == 2
    for folder in ("tables", "shards"):
        local_store.fs.rm(local_store.path(folder), recursive=True)
    commit_raw_shards(local_store, range(10, 20))
    outcomes = ShardProcessor(local_store).poll()
    assert [o.skipped for o in outcomes] == [None] * 10
    assert "was recreated" in caplog.text
    assert processed_ids(local_store) == sorted(f"t{i}" for i in range(10, 20))


def test_a_running_processor_whose_shards_table_is_recreated_stops_rather_than_skip(local_store):
    """Recreated under a running processor and grown past its offset, the new log is refused
    as an offset past the log is; the processor started next reads the new table whole."""
    commit_raw_shards(local_store, range(3))
    processor = ShardProcessor(local_store)
    processor.poll()
    processor.save()
    for folder in ("tables", "shards"):
        local_store.fs.rm(local_store.path(folder), recursive=True)
    commit_raw_shards(local_store, range(10, 20))
    with pytest.raises(StaleOffsetError, match="recreated"):
        processor.poll()
    assert len(ShardProcessor(local_store).poll()) == 10
    assert processed_ids(local_store) == sorted(f"t{i}" for i in range(10, 20))


def test_a_saved_offset_without_the_tables_identity_is_still_followed(local_store):
    """An offset saved by an older treadle names no table: it is followed as before."""
    commit_raw_shards(local_store, range(2))
    ShardProcessor(local_store).poll()
    ProcessOffsetBoard(local_store).publish(ProcessOffset(offset=1, time=0.0))
    commit_raw_shards(local_store, range(2, 3))
    outcomes = ShardProcessor(local_store).poll()
    assert [(o.raw.shard_id, o.skipped) for o in outcomes] == [("raw/w0/00000002", None)]
