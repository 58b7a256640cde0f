"""Shards: write, commit, poll, read back; quarantine of bad shards; unreachable stores."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import errno
import io
import itertools
import logging
import multiprocessing
import os
import pickle
import socket
import threading
import time
import types
import uuid
import zlib
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc
import pytest
import s3fs.core
from botocore.exceptions import EndpointConnectionError
from deltalake import write_deltalake
from deltalake.exceptions import DeltaError

from storage import shards as shard_module
from storage.config import RunStore, StorageConfig
from storage.schema import PROCESSED_SCHEMA, TRAJECTORY_SCHEMA, NewerSchemaError, SchemaError, cast, validate
from storage.shards import (
    COMPRESSION,
    MIN_SWEEP_AGE_S,
    SHARD_SCHEMAS,
    BackgroundShardWriter,
    ShardInfo,
    ShardReader,
    ShardWriter,
    abort_stale_uploads,
    quarantine_path,
    records_kept,
    sweep_uncommitted,
)
from storage.status import InUse
from storage.tables import Tables
from storage.weights import WeightStore
from tasks.common import is_transient
from tests.conftest import free_port
from tests.storage.foreign_shards import commit_foreign_file, first_version, ipc_bytes
from tests.storage.records import make_processed_table, make_record, make_table
from tests.storage.s3_proxy import S3Proxy, proxying


def ids_of(table: pa.Table) -> list[str]:
    return table.column("trajectory_id").to_pylist()


def test_records_flush_every_n_and_read_back_whole(store):
    writer = ShardWriter(store, "w0", flush_records=3)
    flushed = [writer.write(make_record(i)) for i in range(7)]
    assert [info is not None for info in flushed] == [False, False, True] * 2 + [False]
    last = writer.close()
    assert last.num_rows == 1 and last.seq == 2

    reader = ShardReader(store)
    shards, offset = reader.poll()
    assert [s.seq for s in shards] == [0, 1, 2]
    assert shards[0] == ShardInfo(
        shard_id="raw/w0/00000000",
        kind="raw",
        path="shards/raw/w0/00000000.arrow",
        worker="w0",
        seq=0,
        num_rows=3,
        num_tokens=3 * 24,
        min_version=0,
        max_version=2,
        crc32=zlib.crc32(store.fs.cat_file(store.path("shards/raw/w0/00000000.arrow"))),
    )
    tables = [reader.read(shard) for shard in shards]
    assert ids_of(pa.concat_tables(tables)) == [f"t{i}" for i in range(7)]
    assert tables[0].to_pylist() == make_table(0, 3).to_pylist()
    assert reader.poll(after=offset) == ([], offset)


def test_records_written_together_are_never_split_across_shards(store):
    writer = ShardWriter(store, "w0", flush_records=3)
    assert writer.write(make_record(0)) is None
    info = writer.write_many([make_record(i) for i in range(1, 5)])
    assert info.num_rows == 5
    writer.close()
    (shard,), _ = ShardReader(store).poll()
    assert ids_of(ShardReader(store).read(shard)) == [f"t{i}" for i in range(5)]


def test_a_shard_of_version_0_tokens_says_version_0_and_one_without_generated_tokens_says_none(local_store):
    writer = ShardWriter(local_store, "w0", flush_records=100)
    writer.write_many([make_record(0), make_record(5)])  # every generated token from version 0
    assert (lambda info: (info.min_version, info.max_version))(writer.flush()) == (0, 0)
    writer.write(make_record(1) | {"action_mask": [False] * 24, "versions": [-1] * 24})
    assert (lambda info: (info.min_version, info.max_version))(writer.flush()) == (-1, -1)


def test_poll_after_an_offset_lists_only_new_shards(store):
    writer = ShardWriter(store, "w0", flush_records=100)
    assert ShardReader(store).poll() == ([], -1)
    writer.write_table(make_table(0, 2))
    writer.flush()
    first, offset = ShardReader(store).poll()
    writer.write_table(make_table(2, 2))
    writer.flush()
    ShardWriter(store, "w1").close()  # nothing buffered: no shard
    second, _ = ShardReader(store).poll(after=offset)
    assert [s.seq for s in first] == [0] and [s.seq for s in second] == [1]
    assert ShardReader(store, kind="processed").poll()[0] == []


def test_time_based_flush_happens_on_the_next_write(store):
    patient = ShardWriter(store, "patient", flush_records=100, flush_seconds=3600)
    assert patient.write(make_record(0)) is None and patient.write(make_record(1)) is None
    eager = ShardWriter(store, "eager", flush_records=100, flush_seconds=0.05)
    assert eager.write(make_record(2)) is None
    time.sleep(0.1)
    info = eager.write(make_record(3))
    assert info is not None and info.num_rows == 2


def test_flush_if_due_commits_records_that_waited_with_no_write_after_them(store):
    patient = ShardWriter(store, "patient", flush_records=100, flush_seconds=3600)
    patient.write(make_record(0))
    assert patient.flush_if_due() is None
    eager = ShardWriter(store, "eager", flush_records=100, flush_seconds=0.05)
    assert eager.flush_if_due() is None  # nothing buffered
    eager.write(make_record(1))
    time.sleep(0.1)
    info = eager.flush_if_due()
    assert info is not None and info.num_rows == 1


def test_a_new_writer_resumes_after_the_last_committed_seq(store, caplog):
    with caplog.at_level(logging.WARNING, logger="storage.shards"):
        with ShardWriter(store, "w0", flush_records=1) as writer:
            writer.write(make_record(0))
            writer.write(make_record(1))
        with ShardWriter(store, "w0") as writer:
            writer.write(make_record(2))
    shards, _ = ShardReader(store).poll()
    assert [(s.worker, s.seq) for s in shards] == [("w0", 0), ("w0", 1), ("w0", 2)]
    assert "skipping" not in caplog.text  # each number tried was free: none taken twice
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(make_record(3))


def test_a_writer_numbers_its_shards_apart_from_other_kinds_and_workers_of_its_name(store):
    ShardWriter(store, "p", kind="processed").commit(make_processed_table(0, 1), seq=7)
    ShardWriter(store, "w1").write_table(make_table(0, 1))
    with ShardWriter(store, "w1", flush_records=1) as writer:
        writer.write(make_record(1))
    assert ShardWriter(store, "p").next_seq == 0
    assert ShardWriter(store, "w0").next_seq == 0
    assert ShardWriter(store, "w1").next_seq == 1


def test_two_writers_under_one_name_never_overwrite_each_others_shards(store, caplog):
    first, second = ShardWriter(store, "w0", flush_records=2), ShardWriter(store, "w0", flush_records=2)
    store.create_exclusive(store.path("shards/raw/w0/00000002.arrow"), b"a writer that died")
    # both started from seq 0: the second skips the number the first took, then the dead one's
    assert [first.write(make_record(i)) is not None for i in range(2)] == [False, True]
    with caplog.at_level(logging.WARNING, logger="storage.shards"):
        assert second.write_table(make_table(2, 2)).seq == 1
        assert first.write_table(make_table(4, 2)).seq == 3
    assert "another writer named 'w0'" in caplog.text and "00000002.arrow" in caplog.text
    assert (first.committed, second.committed) == (2, 1)

    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [s.seq for s in shards] == [0, 1, 3]
    assert [ids_of(reader.read(s)) for s in shards] == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"]]


def test_on_a_store_whose_refusal_names_no_condition_a_taken_number_is_still_skipped(s3_server, monkeypatch):
    # MinIO answers a failed If-None-Match with PreconditionFailed but no <Condition>, which
    # s3fs raises as a plain OSError (EINVAL): the writer must still take it for "exists"
    translate = s3fs.core.translate_boto_error

    def minio_like(error, *args, **kwargs):
        with contextlib.suppress(AttributeError, KeyError, TypeError):
            error.response["Error"].pop("Condition", None)
        return translate(error, *args, **kwargs)

    monkeypatch.setattr(s3fs.core, "translate_boto_error", minio_like)
    store = RunStore(s3_server.config(), f"run-{uuid.uuid4().hex[:12]}")
    store.create_exclusive(store.path("shards/raw/w0/00000000.arrow"), b"a writer that died")
    with pytest.raises(FileExistsError):
        store.create_exclusive(store.path("shards/raw/w0/00000000.arrow"), b"a second claim")
    writer = ShardWriter(store, "w0", flush_records=2)
    assert writer.write_table(make_table(0, 2)).seq == 1
    with pytest.raises(FileExistsError):  # the committed shard is never replaced either
        writer._upload(store.path(writer._path(1)), make_table(2, 2), exclusive=True)
    (shard,), _ = ShardReader(store).poll()
    assert ids_of(ShardReader(store).read(shard)) == ["t0", "t1"]


def test_a_failed_flush_keeps_its_records_and_the_retry_loses_and_repeats_none(store, monkeypatch):
    writer = ShardWriter(store, "w0", flush_records=100)
    writer.write_table(make_table(0, 3))

    def dropped(sink, table):  # the connection drops halfway through the file
        sink.write(b"ARROW1\0\0")
        raise OSError("connection dropped (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(shard_module, "_write_ipc", dropped)
        with pytest.raises(OSError, match="dropped"):
            writer.flush()
    assert not store.fs.exists(store.path("shards/raw/w0/00000000.arrow"))  # nothing left behind
    assert writer.flush().seq == 0  # so the retry takes the same number

    writer.write_table(make_table(3, 2))
    with monkeypatch.context() as patch:  # the commit may have landed: its file must stay
        patch.setattr(writer.tables, "append", lambda *args: (_ for _ in ()).throw(OSError("timed out")))
        with pytest.raises(OSError, match="timed out"):
            writer.flush()
    assert store.fs.exists(store.path("shards/raw/w0/00000001.arrow"))
    assert writer.flush().seq == 2

    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [s.seq for s in shards] == [0, 2]
    assert [ids_of(reader.read(s)) for s in shards] == [["t0", "t1", "t2"], ["t3", "t4"]]


def reply_lost(append):
    """``append`` that lands its commit, then raises as if the reply were lost."""

    def lost(*args):
        append(*args)
        raise TimeoutError("read timed out after the commit (injected)")

    return lost


def unreadable(*args):
    raise OSError("shards table unreadable (injected)")


def flush_unconfirmed(writer, patch) -> None:
    """Write ``t0``-``t2`` and commit them (``close`` for a background writer) through an
    append that lands but whose reply is lost, the ``shards`` table unreadable: the writer
    cannot tell whether the commit landed. The patches stay on ``patch``."""
    writer.write_table(make_table(0, 3))
    patch.setattr(writer.tables, "append", reply_lost(writer.tables.append))
    patch.setattr(writer.tables, "read", unreadable)
    with pytest.raises(OSError):
        (writer.close if isinstance(writer, BackgroundShardWriter) else writer.flush)()


def test_a_commit_that_lands_but_reports_an_error_counts_as_committed(store, monkeypatch):
    writer = ShardWriter(store, "w0", flush_records=100)
    writer.write_table(make_table(0, 3))
    append = writer.tables.append

    with monkeypatch.context() as patch:
        patch.setattr(writer.tables, "append", reply_lost(append))
        assert writer.flush().seq == 0
    assert writer.flush() is None  # nothing left to commit twice
    writer.write_table(make_table(3, 2))
    assert writer.flush().seq == 1

    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [ids_of(reader.read(s)) for s in shards] == [["t0", "t1", "t2"], ["t3", "t4"]]


@pytest.mark.parametrize("writer_class", [ShardWriter, BackgroundShardWriter])
def test_a_commit_that_cannot_be_confirmed_is_never_committed_twice(store, monkeypatch, writer_class, caplog):
    """The commit lands but its reply is lost, and the shards table cannot be read to check:
    the writer commits nothing until it can tell, then counts that commit and goes on."""
    committed = []
    writer = writer_class(store, "w0", flush_records=100, on_commit=committed.append)
    writer.write_table(make_table(0, 3))
    append = writer.tables.append

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="storage.shards"):
        patch.setattr(writer.tables, "append", reply_lost(append))
        patch.setattr(writer.tables, "read", unreadable)
        with pytest.raises(OSError):  # the lost reply, or (committing in the background) the doubt
            writer.close() if writer_class is BackgroundShardWriter else writer.flush()
        patch.setattr(writer.tables, "append", append)
        writer.write_table(make_table(3, 2))
        with pytest.raises(OSError, match="cannot tell whether shard raw/w0/00000000 was committed"):
            writer.close() if writer_class is BackgroundShardWriter else writer.flush()
    assert writer.tables.read("shards").num_rows == 1
    writer.close()

    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [ids_of(reader.read(s)) for s in shards] == [["t0", "t1", "t2"], ["t3", "t4"]]
    assert [info.seq for info in committed] == [0, 1] and writer.committed == 2
    assert writer.last_seq == 1 and "skipping" not in caplog.text  # goes on after the landed one


def test_an_unconfirmed_commit_found_landed_with_nothing_after_it_is_the_last_committed(store, monkeypatch):
    writer = ShardWriter(store, "w0", flush_records=100)
    with monkeypatch.context() as patch:
        flush_unconfirmed(writer, patch)
    assert writer.last_seq is None and writer.committed == 0
    assert writer.flush() is None  # nothing left but the rows that landed
    assert writer.last_seq == 0 and writer.committed == 1


@pytest.mark.parametrize("writer_class", [ShardWriter, BackgroundShardWriter])
def test_rows_behind_an_unconfirmed_commit_are_refused_once_and_none_is_lost(
    store, monkeypatch, writer_class
):
    """While a commit cannot be confirmed, a bad row written after it (in the unconfirmed
    rows' group) is refused once however often the flush retries, and the good rows written
    with it are committed once the table says the first commit landed."""
    writer = writer_class(store, "w0", flush_records=100)
    writer.write_many([make_record(i) | {"group_id": "g"} for i in range(3)])
    append = writer.tables.append

    flush = writer.close if writer_class is BackgroundShardWriter else writer.flush
    with monkeypatch.context() as patch:
        patch.setattr(writer.tables, "append", reply_lost(append))
        patch.setattr(writer.tables, "read", unreadable)
        with pytest.raises(OSError):
            flush()
        patch.setattr(writer.tables, "append", append)
        writer.write_table(make_table(3, 2))
        writer.write(bad_versions(9, group="g"))
        for _ in range(3):
            with pytest.raises(OSError, match="cannot tell"):
                flush()
    writer.close()

    assert writer.refused == 1
    assert quarantined_refusals(store, "w0")[0] == ["bad9"]
    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [ids_of(reader.read(s)) for s in shards] == [["t0", "t1", "t2"], ["t3", "t4"]]


@pytest.mark.parametrize("writer_class", [ShardWriter, BackgroundShardWriter])
def test_rows_of_a_landed_commit_are_not_committed_again_when_refusing_after_it_fails(
    store, monkeypatch, writer_class
):
    """An unconfirmed commit is found to have landed, then keeping a bad row aside fails:
    the retry commits only the rows written after that commit, never its rows again."""
    writer = writer_class(store, "w0", flush_records=100)
    writer.write_table(make_table(0, 3))
    append = writer.tables.append
    flush = writer.close if writer_class is BackgroundShardWriter else writer.flush
    with monkeypatch.context() as patch:
        patch.setattr(writer.tables, "append", reply_lost(append))
        patch.setattr(writer.tables, "read", unreadable)
        with pytest.raises(OSError):
            flush()
    writer.write_table(make_table(3, 2))
    writer.write(bad_versions(9))
    with monkeypatch.context() as patch:
        patch.setattr(
            store.fs,
            "pipe_file",
            lambda *args, **kwargs: (_ for _ in ()).throw(OSError("down (injected)")),
        )
        with pytest.raises(OSError, match="down"):
            flush()
    writer.close()

    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [ids_of(reader.read(s)) for s in shards] == [["t0", "t1", "t2"], ["t3", "t4"]]
    assert writer.refused == 1 and writer.committed == 2


def test_commit_writes_at_the_derived_number_and_a_retry_lands_under_it_again(store, monkeypatch):
    writer = ShardWriter(store, "p", kind="processed")
    with monkeypatch.context() as patch:  # the first attempt fails at its commit
        patch.setattr(writer.tables, "append", lambda *args: (_ for _ in ()).throw(OSError("timed out")))
        with pytest.raises(OSError, match="timed out"):
            writer.commit(make_processed_table(0, 3), seq=5)
    info = writer.commit(make_processed_table(0, 3), seq=5)
    assert (info.shard_id, info.path, info.num_rows) == (
        "processed/p/00000005",
        "shards/processed/p/00000005.arrow",
        3,
    )
    reader = ShardReader(store, kind="processed")
    (shard,), _ = reader.poll()
    assert shard == info and reader.read(shard).num_rows == 3
    assert writer.write_table(make_processed_table(3, 1)) is None and writer.flush().seq == 6
    writer.commit(make_processed_table(4, 1), seq=2)  # a lower number never takes the writer back
    assert writer.write_table(make_processed_table(5, 1)) is None and writer.flush().seq == 7


def test_a_failed_retry_of_a_commit_that_may_have_landed_leaves_its_file_in_place(store, monkeypatch):
    """A commit under a given number whose landing cannot be confirmed is retried, and the
    retry fails while writing: the file the landed commit lists must stay."""
    writer = ShardWriter(store, "p", kind="processed")
    append = writer.tables.append
    with monkeypatch.context() as patch:
        patch.setattr(writer.tables, "append", reply_lost(append))
        patch.setattr(writer.tables, "read", unreadable)
        with pytest.raises(TimeoutError):
            writer.commit(make_processed_table(0, 3), seq=5)

    def dropped(sink, table):
        sink.write(b"ARROW1\0\0")
        raise OSError("connection dropped (injected)")

    with monkeypatch.context() as patch:  # retried by a process that knows nothing of the doubt
        patch.setattr(shard_module, "_write_ipc", dropped)
        with pytest.raises(OSError, match="dropped"):
            ShardWriter(store, "p", kind="processed").commit(make_processed_table(0, 3), seq=5)
    reader = ShardReader(store, kind="processed")
    (shard,), _ = reader.poll()
    assert ids_of(reader.read(shard)) == ids_of(make_processed_table(0, 3))


def test_a_numbered_commit_retried_after_one_that_could_not_be_confirmed_is_listed_once(store, monkeypatch):
    """Shard 5's commit lands but its reply is lost while the shards table cannot be read, and
    its caller retries it under the same number, as :meth:`ShardWriter.commit` asks: the retry
    raises while the table still cannot say, then finds the commit landed and commits nothing
    again. Before, the retry appended a second row, and every poll listed shard 5 twice."""
    committed = []
    writer = ShardWriter(store, "p", kind="processed", on_commit=committed.append)
    append = writer.tables.append
    with monkeypatch.context() as patch:
        patch.setattr(writer.tables, "append", reply_lost(append))
        patch.setattr(writer.tables, "read", unreadable)
        with pytest.raises(TimeoutError):
            writer.commit(make_processed_table(0, 3), seq=5)
        patch.setattr(writer.tables, "append", append)
        with pytest.raises(OSError, match="cannot tell whether shard processed/p/00000005 was committed"):
            writer.commit(make_processed_table(0, 3), seq=5)
    info = writer.commit(make_processed_table(0, 3), seq=5)
    reader = ShardReader(store, kind="processed")
    shards, _ = reader.poll()
    assert shards == [info] and ids_of(reader.read(info)) == ids_of(make_processed_table(0, 3))
    assert committed == [info] and writer.committed == 1 and writer.last_seq == 5
    assert writer.write_table(make_processed_table(3, 1)) is None and writer.flush().seq == 6


def test_a_numbered_commit_that_cannot_be_confirmed_leaves_the_buffered_records_alone(store, monkeypatch):
    """``commit`` does not touch buffered records: its own doubt (the caller retries under the
    same number) never takes them for the rows of the commit that may have landed."""
    writer = ShardWriter(store, "p", kind="processed", flush_records=100)
    writer.write_table(make_processed_table(10, 2))
    append = writer.tables.append
    with monkeypatch.context() as patch:
        patch.setattr(writer.tables, "append", reply_lost(append))
        patch.setattr(writer.tables, "read", unreadable)
        with pytest.raises(TimeoutError):
            writer.commit(make_processed_table(0, 3), seq=5)
    info = writer.flush()
    assert ids_of(ShardReader(store, kind="processed").read(info)) == ids_of(make_processed_table(10, 2))


def hold_appends(writer: ShardWriter, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Hold each commit of ``writer`` at its log append: ``entered`` is set once one waits
    there, which goes on when ``release`` is set."""
    entered, release = threading.Event(), threading.Event()
    append = writer.tables.append

    def held(*args):
        entered.set()
        assert release.wait(30)
        append(*args)

    monkeypatch.setattr(writer.tables, "append", held)
    return entered, release


CALLER = contextvars.ContextVar("caller")


def test_a_background_flush_returns_before_its_commit_lands_and_close_waits_for_it(store, monkeypatch):
    heard: list[tuple[int, str | None, bool]] = []
    writer = BackgroundShardWriter(
        store,
        "w0",
        flush_records=2,
        on_commit=lambda info: heard.append(
            (info.seq, CALLER.get(None), threading.current_thread() is threading.main_thread())
        ),
    )
    entered, release = hold_appends(writer, monkeypatch)
    CALLER.set("rollout loop")
    assert [writer.write(make_record(i)) for i in range(2)] == [None, None]  # the flush is handed over
    assert entered.wait(30)
    assert (writer.committed, writer.unsaved_records, heard) == (0, 2, [])
    writer.write(make_record(2))  # buffering goes on while the commit is held
    release.set()
    writer.close()
    assert writer.committed == 2 and writer.unsaved_records == 0
    assert heard == [(0, "rollout loop", False), (1, "rollout loop", False)]
    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [ids_of(reader.read(s)) for s in shards] == [["t0", "t1"], ["t2"]]


def test_records_whose_background_commit_landed_are_no_longer_counted_unsaved(store):
    """A rollout worker publishes ``unsaved_records`` in its status: records whose commit had
    landed (``on_commit`` told of it) still counted there until the next flush settled it,
    ``flush_seconds`` later with no write after them."""
    heard = []
    writer = BackgroundShardWriter(
        store, "w0", flush_records=2, on_commit=lambda info: heard.append(writer.unsaved_records)
    )
    writer.write_table(make_table(0, 2))
    concurrent.futures.wait([writer._in_flight])
    assert writer.committed == 1 and heard == [0] and writer.unsaved_records == 0
    writer.close()


def test_a_background_commit_still_running_is_not_due_again_and_does_not_block_the_caller(store, monkeypatch):
    writer = BackgroundShardWriter(store, "w0", flush_records=2, flush_seconds=0.05)
    entered, release = hold_appends(writer, monkeypatch)
    writer.write_table(make_table(0, 2))
    assert entered.wait(30)
    time.sleep(0.1)  # the handed-over records have waited flush_seconds, their commit still runs
    timer = threading.Timer(20, release.set)  # ends the wait of a caller that blocks on the commit
    timer.start()
    assert writer.flush_if_due() is None
    assert not release.is_set()  # it returned without waiting on the commit
    release.set()
    timer.cancel()
    writer.close()
    assert writer.committed == 1


def fail_first_append(writer: ShardWriter, monkeypatch) -> None:
    """The first append of ``writer``'s commit log times out; the later ones land."""
    append = writer.tables.append
    failures = iter([OSError("timed out (injected)")])

    def flaky(*args):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        append(*args)

    monkeypatch.setattr(writer.tables, "append", flaky)


def test_a_failed_background_commit_loses_nothing_and_goes_into_the_next_shard(store, monkeypatch, caplog):
    writer = BackgroundShardWriter(store, "w0", flush_records=2)
    fail_first_append(writer, monkeypatch)
    for i in range(4):
        writer.write(make_record(i))
    writer.close()
    assert "commit of 2 records to a raw shard of w0 failed; they go into the next shard" in caplog.text
    reader = ShardReader(store)
    shards, _ = reader.poll()
    # the failed attempt's file stays (its commit may have landed), so the retry skips its number
    assert [s.seq for s in shards] == [1]
    assert ids_of(reader.read(shards[0])) == ["t0", "t1", "t2", "t3"]


def test_a_failed_background_commit_is_retried_when_due_with_no_write_after_it(store, monkeypatch):
    writer = BackgroundShardWriter(store, "w0", flush_records=100, flush_seconds=60)
    fail_first_append(writer, monkeypatch)
    skew, real = [0.0], time.monotonic
    monkeypatch.setattr(shard_module.time, "monotonic", lambda: real() + skew[0])
    writer.write(make_record(0))
    skew[0] += 60
    writer.flush_if_due()  # handed over; its commit fails
    concurrent.futures.wait([writer._in_flight])
    assert writer.committed == 0 and writer.unsaved_records == 1
    skew[0] += 60
    writer.flush_if_due()  # no record was written since: the failed one is due again
    concurrent.futures.wait([writer._in_flight])
    assert writer.committed == 1
    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [ids_of(reader.read(s)) for s in shards] == [["t0"]]
    writer.close()


@pytest.mark.parametrize("writer_class", [ShardWriter, BackgroundShardWriter])
def test_a_shard_its_before_commit_refuses_writes_nothing_and_keeps_its_records(store, writer_class):
    """A rollout worker's ``before_commit`` refuses once its name was taken: no file, no
    commit; the records stay, and are committed whole once (if ever) it lets them through."""
    refusing = True

    def before_commit() -> None:
        if refusing:
            raise RuntimeError("not this worker's name any more (injected)")

    writer = writer_class(store, "w0", flush_records=10, before_commit=before_commit)
    for i in range(3):
        writer.write(make_record(i))
    with pytest.raises(RuntimeError, match="injected"):
        writer.close()
    assert Tables(store).read("shards").num_rows == 0
    assert not store.fs.exists(store.path("shards/raw/w0"))
    refusing = False
    writer.close()
    shards, _ = ShardReader(store).poll()
    assert [ids_of(ShardReader(store).read(shard)) for shard in shards] == [["t0", "t1", "t2"]]


def test_a_background_commit_refused_as_in_use_is_raised_at_the_next_flush(store, caplog):
    """Not a storage error to retry into the next shard: the worker's name is another's, so
    the caller hears of it at once (records kept, nothing committed)."""

    def taken() -> None:
        raise InUse("rollout worker name 'w0' was taken over (injected)")

    writer = BackgroundShardWriter(store, "w0", flush_records=2, before_commit=taken)
    writer.write(make_record(0))
    writer.write(make_record(1))  # hands the shard to the commit thread
    with pytest.raises(InUse, match="injected"):
        writer.write(make_record(2))
        writer.write(make_record(3))
    assert writer.unsaved_records == 2 and "they go into the next shard" not in caplog.text
    assert Tables(store).read("shards").num_rows == 0


def uncommitted_files(store, worker: str = "w0") -> list[str]:
    return sorted(store.fs.glob(store.path("shards", "quarantine", "raw", worker, "uncommitted-*.arrow")))


def test_a_writer_whose_name_was_taken_sets_its_uncommitted_records_aside_when_abandoned(store, caplog):
    """The records of the refused commit and those buffered after it are kept whole in the
    quarantine, each named in the reason file; none reaches a shard, and the writer is closed."""
    taken = False

    def before_commit() -> None:
        if taken:
            raise InUse("rollout worker name 'w0' was taken over (injected)")

    writer = BackgroundShardWriter(store, "w0", flush_records=2, before_commit=before_commit)
    writer.write_many([make_record(0), make_record(1)])
    writer.flush()  # waits for that shard's commit
    writer.write(make_record(2))
    taken = True
    writer.write(make_record(3))  # hands records 2 and 3 to the commit thread, which is refused
    writer.write(make_record(4))
    with pytest.raises(InUse):
        writer.write(make_record(5))
    path, rows = writer.abandon("not committed: name taken (injected)")
    assert rows == 4 and writer.closed
    assert path.startswith("shards/quarantine/raw/w0/uncommitted-") and uncommitted_files(store) == [
        store.path(path)
    ]
    with store.fs.open(store.path(path), "rb") as source:
        kept = pa.ipc.open_file(source).read_all()
    assert ids_of(kept) == ["t2", "t3", "t4", "t5"]
    validate(kept)
    with store.fs.open(store.path(path + ".reason"), "r") as reason:
        assert reason.read().splitlines() == [
            f"trajectory 't{i}': not committed: name taken (injected)" for i in range(2, 6)
        ]
    shards, _ = ShardReader(store).poll()
    assert [ids_of(ShardReader(store).read(shard)) for shard in shards] == [["t0", "t1"]]
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(make_record(6))
    assert writer.abandon("not committed: name taken (injected)") is None  # nothing set aside twice
    assert uncommitted_files(store) == [store.path(path)]


@pytest.mark.parametrize("background", [False, True])
def test_an_abandoned_writer_whose_records_were_all_told_unwritten_sets_nothing_aside(store, background):
    """Every buffered record's writer was told it was not written (it sends them again): no
    file is left, not an empty one that ``treadle inspect`` would count."""
    kind = BackgroundShardWriter if background else ShardWriter
    writer = kind(store, "w0", flush_records=100)
    writer.write_many([make_record(0), make_record(1)])
    assert writer.abandon("name taken (injected)", left_out={"t0", "t1", "t9"}) is None
    assert writer.closed and uncommitted_files(store) == []
    assert ShardReader(store).poll()[0] == []


@pytest.mark.parametrize("background", [False, True])
def test_an_abandoned_writer_with_every_record_committed_sets_nothing_aside(store, background):
    kind = BackgroundShardWriter if background else ShardWriter
    writer = kind(store, "w0", flush_records=2)
    writer.write_many([make_record(0), make_record(1)])
    assert writer.abandon("name taken (injected)") is None
    assert writer.closed and uncommitted_files(store) == []
    shards, _ = ShardReader(store).poll()
    assert [ids_of(ShardReader(store).read(shard)) for shard in shards] == [["t0", "t1"]]


def store_down(*args, **kwargs):
    raise OSError("store down (injected)")


@pytest.mark.parametrize("writer_class", [ShardWriter, BackgroundShardWriter])
def test_an_abandon_tried_again_sets_aside_no_row_of_a_commit_it_found_landed(
    store, monkeypatch, writer_class
):
    """The abandon finds that an unconfirmed commit landed, then the store takes no file: the
    call made again sets aside only the rows written after that commit, not its rows too."""
    writer = writer_class(store, "w0", flush_records=100)
    with monkeypatch.context() as patch:
        flush_unconfirmed(writer, patch)
    writer.write_table(make_table(3, 2))
    with monkeypatch.context() as patch:
        patch.setattr(store.fs, "pipe_file", store_down)
        with pytest.raises(OSError, match="store down"):
            writer.abandon("name taken (injected)")
    path, rows = writer.abandon("name taken (injected)")
    with store.fs.open(store.path(path), "rb") as source:
        assert ids_of(pa.ipc.open_file(source).read_all()) == ["t3", "t4"]
    assert rows == 2 and uncommitted_files(store) == [store.path(path)]
    assert writer.committed == 1


@pytest.mark.parametrize("writer_class", [ShardWriter, BackgroundShardWriter])
def test_an_abandon_that_cannot_tell_whether_a_commit_landed_sets_its_rows_aside_saying_so(
    store, monkeypatch, writer_class
):
    """The ``shards`` table still cannot be read at the abandon: the rows of the commit that
    may have landed are set aside with the rest, each reason naming the shard they may be in."""
    writer = writer_class(store, "w0", flush_records=100)
    with monkeypatch.context() as patch:
        flush_unconfirmed(writer, patch)
        writer.write_table(make_table(3, 1))
        path, rows = writer.abandon("name taken (injected)")
    assert rows == 4
    with store.fs.open(store.path(path + ".reason"), "r") as reason:
        lines = reason.read().splitlines()
    assert [line.split(" (cannot tell")[0] for line in lines] == [
        f"trajectory 't{i}': name taken (injected); the first 3 may be in shard raw/w0/00000000"
        for i in range(4)
    ]


@pytest.mark.parametrize("writer_class", [ShardWriter, BackgroundShardWriter])
def test_an_abandon_whose_reason_file_the_store_refused_sets_each_record_aside_once(
    store, monkeypatch, writer_class
):
    """The store takes the records' file, then refuses its ``.reason`` file: the call made
    again leaves one file of those records, not a second beside the first."""
    writer = writer_class(store, "w0", flush_records=100)
    writer.write_table(make_table(0, 2))
    open_file = store.fs.open

    def reason_refused(path, *args, **kwargs):
        if path.endswith(".reason"):
            raise OSError("store down (injected)")
        return open_file(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(store.fs, "open", reason_refused)
        with pytest.raises(OSError, match="store down"):
            writer.abandon("name taken (injected)")
    path, rows = writer.abandon("name taken (injected)")
    assert rows == 2 and uncommitted_files(store) == [store.path(path)]
    with store.fs.open(store.path(path + ".reason"), "r") as reason:
        assert len(reason.read().splitlines()) == 2


def test_past_max_unsaved_records_a_flush_commits_in_the_callers_thread_and_raises(store, monkeypatch):
    writer = BackgroundShardWriter(store, "w0", flush_records=2, max_unsaved_records=3)
    down = OSError("endpoint unreachable (injected)")
    with monkeypatch.context() as patch:
        patch.setattr(writer.tables, "append", lambda *args: (_ for _ in ()).throw(down))
        writer.write_table(make_table(0, 2))  # fails on the commit thread
        with pytest.raises(OSError, match="unreachable"):
            writer.write_table(make_table(2, 2))  # 4 records would wait: committed here, and fails
        assert writer.unsaved_records == 4
        with pytest.raises(OSError, match="unreachable"):
            writer.close()
    writer.close()
    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [ids_of(reader.read(s)) for s in shards] == [["t0", "t1", "t2", "t3"]]
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(make_record(9))


def test_a_max_unsaved_records_of_0_is_kept_and_a_negative_one_refused(local_store, monkeypatch):
    """0 (no record waits for a retry on the commit thread) was taken as unset and became
    8 x flush_records, and a negative bound passed."""
    writer = BackgroundShardWriter(local_store, "w0", flush_records=2, max_unsaved_records=0)
    assert writer.max_unsaved_records == 0
    writer.close()
    with pytest.raises(ValueError, match="max_unsaved_records must be >= 0, got -1"):
        BackgroundShardWriter(local_store, "w1", max_unsaved_records=-1)


def test_a_store_outage_is_retried_at_growing_intervals_not_at_every_flush(store, monkeypatch):
    """Past ``max_unsaved_records`` a flush commits in the caller's thread (the event loop): a
    rollout worker's flusher calls ``flush_if_due`` every second, and each call ran a blocking
    commit against the unreachable store."""
    writer = BackgroundShardWriter(store, "w0", flush_records=2, flush_seconds=1, max_unsaved_records=3)
    clock, attempts = [0.0], []
    monkeypatch.setattr(shard_module.time, "monotonic", lambda: clock[0])

    def down(*args):
        attempts.append(clock[0])
        raise OSError("endpoint unreachable (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(writer.tables, "append", down)
        writer.write_table(make_table(0, 2))  # fails on the commit thread
        concurrent.futures.wait([writer._in_flight])
        with pytest.raises(OSError, match="unreachable"):
            writer.write_table(make_table(2, 2))  # past the bound: raised, records kept
        for _ in range(60):  # the flusher's minute
            clock[0] += 1
            with contextlib.suppress(OSError):
                writer.flush_if_due()
        assert writer.unsaved_records == 4
        gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
        assert len(attempts) <= 7 and gaps == sorted(gaps) and gaps[-1] > gaps[0], attempts
    clock[0] += 3600
    writer.flush_if_due()  # the store is back: committed at the next try
    assert writer.unsaved_records == 0
    writer.close()
    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [ids_of(reader.read(s)) for s in shards] == [["t0", "t1", "t2", "t3"]]


def hours_later(monkeypatch: pytest.MonkeyPatch, hours: float) -> None:
    """The sweep's clock runs ``hours`` ahead: every file looks that much older to it."""
    wall_clock = time.time
    monkeypatch.setattr(shard_module, "time", types.SimpleNamespace(time=lambda: wall_clock() + hours * 3600))


def test_sweeping_removes_only_old_files_no_commit_lists(store, monkeypatch):
    with ShardWriter(store, "w0", flush_records=2) as writer:
        writer.write_table(make_table(0, 2))
    leftovers = [
        "shards/raw/w0/00000007.arrow",
        "shards/tmp/raw/w0/00000003.arrow-5e1f",
        "shards/raw/w9/00000000.arrow",
    ]
    for path in [*leftovers, "shards/quarantine/raw/w8/00000000.arrow"]:
        store.create_exclusive(store.path(path), b"left behind")
    assert sweep_uncommitted(store, older_than_s=3600) == []  # all young: a writer may still commit
    hours_later(monkeypatch, 2)
    assert sweep_uncommitted(store, older_than_s=3600) == sorted(leftovers)
    assert not any(store.fs.exists(store.path(path)) for path in leftovers)
    assert store.fs.exists(store.path("shards/quarantine/raw/w8/00000000.arrow"))
    reader = ShardReader(store)
    (shard,), _ = reader.poll()
    assert ids_of(reader.read(shard)) == ["t0", "t1"]
    assert sweep_uncommitted(store, older_than_s=3600) == []


def test_sweeping_a_run_whose_shards_commit_is_empty_raises_and_deletes_nothing(store, monkeypatch):
    """A commit whose bytes a crash lost reads as committing nothing: its shard's file must
    not be taken for one whose commit never landed."""
    with ShardWriter(store, "w0", flush_records=2) as writer:
        writer.write_table(make_table(0, 2))
        writer.write_table(make_table(2, 2))
    version = Tables(store).version("shards")
    store.fs.pipe_file(store.path("tables", "shards", "_delta_log", f"{version:020d}.json"), b"")
    hours_later(monkeypatch, 2)
    with pytest.raises(DeltaError, match=f"table 'shards': its commit {version} is empty"):
        sweep_uncommitted(store, older_than_s=3600)
    assert store.fs.exists(store.path("shards/raw/w0/00000001.arrow"))


def test_sweeping_a_run_whose_shards_table_is_lost_keeps_every_shard_file(store, monkeypatch, caplog):
    """Without its commit log nothing says which shard files were committed: a sweep that
    took every one for a writer's leftover deleted the run's data."""
    with ShardWriter(store, "w0", flush_records=2) as writer:
        writer.write_table(make_table(0, 2))
        writer.write_table(make_table(2, 2))
    shard_files = sorted(store.fs.find(store.path("shards")))
    assert len(shard_files) == 2
    leftover = "shards/tmp/raw/w0/00000009.arrow-5e1f"
    store.create_exclusive(store.path(leftover), b"left behind")
    store.fs.rm(store.path("tables", "shards"), recursive=True)
    hours_later(monkeypatch, 2)
    with caplog.at_level(logging.WARNING, logger="storage.shards"):
        assert sweep_uncommitted(store, older_than_s=3600) == [leftover]
    assert sorted(store.fs.find(store.path("shards"))) == shard_files
    assert "has no shards table, so nothing says which of its 2 shard files were committed" in caplog.text


def test_two_sweeps_at_once_each_remove_what_the_other_did_not(local_store, monkeypatch):
    """A second sweep (maintain run from the CLI beside a deployment's) removes a file between
    this sweep's listing and its delete: this one goes on and reports only its own."""
    leftovers = [f"shards/tmp/raw/w0/{i:08d}.arrow-dead" for i in range(4)]
    for path in leftovers:
        local_store.create_exclusive(local_store.path(path), b"left behind")
    hours_later(monkeypatch, 2)
    find = local_store.fs.find

    def find_then_other_sweep_deletes(*args, **kwargs):
        found = find(*args, **kwargs)
        local_store.fs.rm_file(local_store.path(leftovers[1]))
        return found

    monkeypatch.setattr(local_store.fs, "find", find_then_other_sweep_deletes)
    assert sweep_uncommitted(local_store, older_than_s=3600) == sorted(leftovers[:1] + leftovers[2:])
    assert not any(local_store.fs.exists(local_store.path(path)) for path in leftovers)


@pytest.mark.parametrize("older_than_s", [0, 60, MIN_SWEEP_AGE_S - 1])
def test_sweeping_refuses_an_age_a_live_writer_could_still_commit_within(local_store, older_than_s):
    tables = Tables(local_store)
    writer = ShardWriter(local_store, "w0", tables=tables)
    commit = tables.append
    swept: list[str] = []

    def sweep_then_commit(name, rows):  # the sweep runs between the writer's file and its commit
        with pytest.raises(ValueError, match=f"older_than_s must be >= {MIN_SWEEP_AGE_S:.0f}"):
            swept.extend(sweep_uncommitted(local_store, older_than_s=older_than_s, tables=tables))
        return commit(name, rows)

    tables.append = sweep_then_commit
    writer.write_table(make_table(0, 5))
    info = writer.flush()
    assert swept == []
    assert ShardReader(local_store).read(info).num_rows == 5


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "w0\n", "a/b", ""])
def test_a_worker_name_that_is_not_a_folder_of_its_own_is_refused(local_store, name):
    # ".." would put the worker's shards in shards/, beside every kind's folder
    with pytest.raises(ValueError, match="worker must be a non-empty name"):
        ShardWriter(local_store, name)
    assert not local_store.fs.exists(local_store.path("shards"))


@pytest.mark.parametrize("kind", ["tmp", "quarantine"])
def test_a_kind_named_like_a_folder_the_shards_share_is_refused(local_store, kind):
    """A kind "tmp" kept its shards where writers keep their temp files (swept whatever their
    commits on a run whose shards table is lost), and a kind "quarantine" where bad shards go
    (counted as quarantined, never swept)."""
    for make in (
        lambda: ShardWriter(local_store, "w0", kind=kind, schema=TRAJECTORY_SCHEMA),
        lambda: ShardReader(local_store, kind=kind, schema=TRAJECTORY_SCHEMA),
    ):
        with pytest.raises(ValueError, match=f"kind {kind!r} names the folder of"):
            make()
    assert not local_store.fs.exists(local_store.path("shards"))


def test_records_that_do_not_fit_the_types_or_columns_are_refused_at_the_call(local_store):
    writer = ShardWriter(local_store, "w0", flush_records=10)
    writer.write(make_record(0))
    with pytest.raises(SchemaError, match="column 'tokens': cannot convert") as raised:
        writer.write(make_record(1) | {"tokens": ["a"] * 24})
    assert records_kept(raised.value) == 0  # refused at the call: none taken
    with pytest.raises(SchemaError, match="missing columns"):
        writer.write_table(make_table(1, 1).drop_columns(["status"]))
    info = writer.close()
    assert info.num_rows == 1


def bad_versions(index: int, group: str | None = None) -> dict:
    """A record whose action tokens carry a negative version, in ``group``."""
    return make_record(index) | {"trajectory_id": f"bad{index}", "versions": [-3] * 24, "group_id": group}


def quarantined_refusals(store: RunStore, worker: str) -> tuple[list[str], str]:
    """Trajectory ids in the refused-records files of ``worker`` and their reasons."""
    folder = store.path(quarantine_path(f"shards/raw/{worker}"))
    ids, reasons = [], ""
    for path in sorted(store.fs.glob(folder + "/refused-*.arrow")):
        with store.fs.open(path, "rb") as source:
            ids += ids_of(pa.ipc.open_file(source).read_all())
        with store.fs.open(path + ".reason", "r") as source:
            reasons += source.read()
    return ids, reasons


def test_rows_failing_validation_are_refused_with_their_group_at_the_flush_and_kept_aside(store, caplog):
    writer = ShardWriter(store, "w0", flush_records=10)
    writer.write(make_record(0))
    writer.write_many([bad_versions(1, group="g"), make_record(2) | {"group_id": "g"}])
    writer.write(bad_versions(3))
    writer.write(make_record(4) | {"group_id": "h"})
    info = writer.flush()
    assert writer.refused == 3
    assert ids_of(ShardReader(store).read(info)) == ["t0", "t4"]
    ids, reasons = quarantined_refusals(store, "w0")
    assert ids == ["bad1", "t2", "bad3"]
    assert "trajectory 'bad1': column 'versions': negative version on an action token" in reasons
    assert "trajectory 't2': refused with its group" in reasons
    assert "refused 3 of 5 raw records of w0" in caplog.text
    writer.write(bad_versions(5))
    assert writer.flush() is None  # nothing valid buffered: no shard
    assert ShardReader(store).poll()[0] == [info]
    assert sorted(quarantined_refusals(store, "w0")[0]) == ["bad1", "bad3", "bad5", "t2"]


def test_rows_with_blank_ids_are_refused_at_the_flush_and_named_by_their_row_when_the_id_is_blank(store):
    writer = ShardWriter(store, "w0", flush_records=10)
    writer.write_many(
        [
            make_record(0),
            make_record(1) | {"execution_id": "  "},
            make_record(2) | {"trajectory_id": "\t"},
            make_record(3) | {"task": ""},
            make_record(4),
        ]
    )
    info = writer.flush()
    assert ids_of(ShardReader(store).read(info)) == ["t0", "t4"]
    assert writer.refused == 3
    ids, reasons = quarantined_refusals(store, "w0")
    assert ids == ["t1", "\t", "t3"]
    assert reasons.splitlines() == [
        "trajectory 't1': column 'execution_id': id is whitespace only",
        "row 1 (trajectory id '\\t'): column 'trajectory_id': id is whitespace only",
        "trajectory 't3': column 'task': missing id",
    ]


def test_a_failed_commit_retries_the_admitted_rows_without_refusing_them_again(store, monkeypatch):
    writer = ShardWriter(store, "w0", flush_records=10)
    writer.write(make_record(0))
    writer.write(bad_versions(1))
    with monkeypatch.context() as patch:
        patch.setattr(
            writer.tables, "append", lambda *args: (_ for _ in ()).throw(OSError("down (injected)"))
        )
        with pytest.raises(OSError, match="down"):
            writer.flush()
    info = writer.flush()
    assert ids_of(ShardReader(store).read(info)) == ["t0"]
    assert writer.refused == 1
    assert quarantined_refusals(store, "w0")[0] == ["bad1"]


def test_refused_rows_that_cannot_be_kept_aside_fail_the_flush_and_lose_nothing(store, monkeypatch):
    """The store fails as refused rows are moved to the quarantine: the flush raises,
    every record stays buffered, and the retry refuses the bad row once and commits the rest."""
    writer = ShardWriter(store, "w0", flush_records=10)
    writer.write(make_record(0))
    writer.write(bad_versions(1))
    writer.write(make_record(2))
    with monkeypatch.context() as patch:
        patch.setattr(
            store.fs,
            "pipe_file",
            lambda *args, **kwargs: (_ for _ in ()).throw(OSError("down (injected)")),
        )
        with pytest.raises(OSError, match="down"):
            writer.flush()
    assert writer.refused == 0
    assert ShardReader(store).poll()[0] == []
    info = writer.flush()
    assert ids_of(ShardReader(store).read(info)) == ["t0", "t2"]
    assert writer.refused == 1
    assert quarantined_refusals(store, "w0")[0] == ["bad1"]


def test_a_background_writer_checks_rows_on_its_commit_thread_and_refuses_only_the_bad(store):
    checked_on: list[str] = []
    writer = BackgroundShardWriter(store, "w0", flush_records=3)
    admitted = writer._admitted

    def spy(table):
        checked_on.append(threading.current_thread().name)
        return admitted(table)

    writer._admitted = spy
    writer.write(make_record(0))
    writer.write(bad_versions(1))
    writer.write(make_record(2))  # the third record flushes
    writer.write_many([bad_versions(3), bad_versions(4)])
    writer.write(bad_versions(5))  # a shard of nothing valid: no commit
    writer.close()
    assert checked_on and all(name.startswith("shards-w0") for name in checked_on)
    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert [ids_of(reader.read(s)) for s in shards] == [["t0", "t2"]]
    assert writer.refused == 4 and writer.unsaved_records == 0
    assert sorted(quarantined_refusals(store, "w0")[0]) == ["bad1", "bad3", "bad4", "bad5"]


def test_processed_shards_keep_their_extra_columns(store):
    with ShardWriter(store, "p0", kind="processed", schema=PROCESSED_SCHEMA) as writer:
        writer.write_table(make_processed_table(0, 4))
    reader = ShardReader(store, kind="processed")
    (shard,), _ = reader.poll()
    assert shard.path == "shards/processed/p0/00000000.arrow"
    table = reader.read(shard)
    assert table.schema.equals(PROCESSED_SCHEMA, check_metadata=False)
    assert table.to_pylist() == make_processed_table(0, 4).to_pylist()
    with pytest.raises(ValueError, match="no default schema"):
        ShardWriter(store, "p0", kind="eval")
    with pytest.raises(ValueError, match="worker must be"):
        ShardWriter(store, "a/b")


def test_an_independent_reader_sees_a_compressed_arrow_file(store, request):
    with ShardWriter(store, "w0") as writer:
        writer.write_table(make_table(0, 5))
    (shard,), _ = ShardReader(store).poll()
    if store.config.is_s3:
        server = request.getfixturevalue("s3_server")
        key = store.path(shard.path).split("/", 1)[1]
        data = server.boto3_client().get_object(Bucket=server.bucket, Key=key)["Body"].read()
        source = pa.ipc.open_file(io.BytesIO(data))
    else:
        source = pa.ipc.open_file(pa.OSFile(store.path(shard.path)))
    table = source.read_all()
    assert table.to_pylist() == make_table(0, 5).to_pylist()
    assert table.schema.equals(TRAJECTORY_SCHEMA, check_metadata=False)
    assert source.get_batch(0).num_rows == 5
    assert COMPRESSION == "zstd"
    assert len(store.fs.cat_file(store.path(shard.path))) < len(ipc_bytes(make_table(0, 5)))


def test_bad_shards_are_quarantined_with_a_reason_and_reading_goes_on(store, caplog):
    good = ipc_bytes(make_table(0, 2))
    bad_lengths = make_table(0, 2).to_pylist()
    bad_lengths[1]["turn"] = [0] * 3
    cases = {
        "truncated": good[: len(good) // 2],
        "wrong schema": ipc_bytes(pa.table({"trajectory_id": ["a", "b"], "tokens": [[1], [2]]})),
        "mismatched lengths": ipc_bytes(pa.Table.from_pylist(bad_lengths, schema=TRAJECTORY_SCHEMA)),
        "repeated column": ipc_bytes(
            make_table(0, 2).rename_columns(
                ["progress" if n == "reward" else n for n in TRAJECTORY_SCHEMA.names]
            )
        ),
    }
    infos = {
        name: commit_foreign_file(store, seq, payload) for seq, (name, payload) in enumerate(cases.items())
    }
    with ShardWriter(store, "w0") as writer:
        writer.write_table(make_table(10, 2))

    reader = ShardReader(store)
    shards, _ = reader.poll()
    with caplog.at_level(logging.WARNING, logger="storage.shards"):
        results = {shard.shard_id: reader.read(shard) for shard in shards}
    assert ids_of(results["raw/w0/00000000"]) == ["t10", "t11"]
    expected_reasons = {
        "truncated": "cannot read the Arrow IPC file",
        "wrong schema": "schema differs from the canonical raw schema: missing ['execution_id'",
        "mismatched lengths": "trajectory 't1', column 'turn': has 3 entries but tokens has 24",
        "repeated column": "missing ['reward']; repeated ['progress']",
    }
    for name, info in infos.items():
        assert results[info.shard_id] is None
        assert not store.fs.exists(store.path(info.path))
        target = quarantine_path(info.path)
        assert target == f"shards/quarantine/raw/w9/{info.seq:08d}.arrow"
        assert store.fs.cat_file(store.path(target)) == cases[name]
        reason = store.fs.cat_file(store.path(target + ".reason")).decode()
        assert expected_reasons[name] in reason, reason
        assert any(info.shard_id in r.message and "quarantined" in r.message for r in caplog.records)
    # A second reader of the same commits finds the shard gone and says so.
    with caplog.at_level(logging.WARNING, logger="storage.shards"):
        assert reader.read(infos["truncated"]) is None
    assert "quarantined before" in caplog.records[-1].message


@pytest.mark.parametrize("kind", ["raw", "processed"])
def test_a_shard_of_the_first_record_version_reads_with_error_null_and_is_not_quarantined(store, kind):
    """A shard treadle wrote before the record had ``error`` (``trajectory/1``,
    ``processed/1``): read whole, with ``error`` null, by the processor's and the trainer's
    readers alike."""
    schema = SHARD_SCHEMAS[kind]
    current = make_table(0, 2) if kind == "raw" else make_processed_table(0, 2)
    info = commit_foreign_file(store, 0, ipc_bytes(first_version(current)), kind=kind)
    reader = ShardReader(store, kind=kind)
    table = reader.read(info)
    assert table is not None and table.schema.equals(schema, check_metadata=True)
    assert table.column("error").to_pylist() == [None, None]
    assert table.drop_columns(["error"]).equals(current.drop_columns(["error"]))
    assert not reader.quarantined(info)


def test_a_records_error_is_written_and_read_back(local_store):
    records = [
        make_record(0),
        make_record(1) | {"status": "env_error", "error": "sandbox died during run: exit 1"},
    ]
    with ShardWriter(local_store, "w0") as writer:
        writer.write_many(records)
    reader = ShardReader(local_store)
    (shard,) = reader.poll()[0]
    assert reader.read(shard).column("error").to_pylist() == [None, "sandbox died during run: exit 1"]


def test_a_shard_written_before_columns_were_added_reads_them_as_null(store):
    """A shard of an older treadle: no ``engine`` nor ``timing`` column (nullable now), and
    ``reward`` marked required: it reads whole in the canonical schema, not quarantined."""
    current = make_table(0, 2)
    old_fields = [
        field.with_nullable(False) if field.name == "reward" else field
        for field in TRAJECTORY_SCHEMA
        if field.name not in ("engine", "timing")
    ]
    old = pa.Table.from_arrays([current.column(f.name) for f in old_fields], schema=pa.schema(old_fields))
    info = commit_foreign_file(store, 0, ipc_bytes(old))
    table = ShardReader(store).read(info)
    assert table is not None and table.schema.equals(TRAJECTORY_SCHEMA)
    assert table.column("engine").null_count == table.column("timing").null_count == 2
    assert table.drop_columns(["engine", "timing"]).equals(current.drop_columns(["engine", "timing"]))
    assert not ShardReader(store).quarantined(info)


@pytest.mark.parametrize(
    "change, reason",
    [
        ("required column missing", "missing ['status', 'engine']"),
        ("column type changed", "reward: double (nullable=True) instead of float"),
        ("extra column", "unexpected ['score']"),
        ("required column was nullable", "task: string (nullable=True) instead of string (nullable=False)"),
    ],
)
def test_a_shard_whose_schema_differs_otherwise_is_still_quarantined(store, change, reason):
    table = make_table(0, 2).drop_columns(["engine"])
    if change == "required column missing":
        table = table.drop_columns(["status"])
    elif change == "column type changed":
        table = table.set_column(
            table.schema.get_field_index("reward"), "reward", pc.cast(table.column("reward"), pa.float64())
        )
    elif change == "extra column":
        table = table.append_column("score", pa.array([1.0, 2.0]))
    else:
        task = table.schema.get_field_index("task")
        table = table.cast(table.schema.set(task, table.schema.field(task).with_nullable(True)))
    info = commit_foreign_file(store, 0, ipc_bytes(table))
    reader = ShardReader(store)
    assert reader.read(info) is None and reader.quarantined(info)
    text = store.fs.cat_file(store.path(quarantine_path(info.path) + ".reason")).decode()
    assert reason in text, text


def test_a_committed_shard_with_blank_ids_is_quarantined_by_the_reader(store):
    records = make_table(0, 2).to_pylist()
    records[0]["trajectory_id"] = " "
    records[1]["prompt_id"] = "\n"
    info = commit_foreign_file(store, 0, ipc_bytes(pa.Table.from_pylist(records, schema=TRAJECTORY_SCHEMA)))
    reader = ShardReader(store)
    assert reader.read(info) is None
    assert reader.quarantined(info)
    reason = store.fs.cat_file(store.path(quarantine_path(info.path) + ".reason")).decode()
    assert reason == (
        "shard raw/w9/00000000: row 0 (trajectory id ' '), column 'trajectory_id': id is whitespace only; "
        "trajectory 't1', column 'prompt_id': id is whitespace only\n"
    )


def test_two_readers_of_one_bad_shard_both_go_on_and_one_quarantines_it(store, monkeypatch, caplog):
    """Reader B fetched the bad bytes before reader A moved the shard to quarantine."""
    good = ipc_bytes(make_table(0, 2))
    info = commit_foreign_file(store, 0, good[: len(good) // 2])
    first, second = ShardReader(store), ShardReader(store)
    assert first.read(info) is None
    fetched_before_the_move = pa.BufferReader(good[: len(good) // 2])
    monkeypatch.setattr(shard_module, "_open_ipc", lambda store, path: fetched_before_the_move)
    with caplog.at_level(logging.WARNING, logger="storage.shards"):
        assert second.read(info) is None
    assert "moved to quarantine by another reader" in caplog.records[-1].message
    assert first.quarantined(info) and second.quarantined(info)


def test_a_shard_whose_reason_cannot_be_written_is_still_quarantined_and_said_why(store, monkeypatch, caplog):
    """The shard was moved, then writing its ``.reason`` failed: the error went up through
    ``read`` and the reason was lost, and every later read said the committed shard's file was
    missing, as if it were gone."""
    good = ipc_bytes(make_table(0, 2))
    info = commit_foreign_file(store, 0, good[: len(good) // 2])
    real_open = store.fs.open

    def refusing_reasons(path, mode="rb", **kwargs):
        if path.endswith(".reason"):
            raise PermissionError(f"no writes to {path}")
        return real_open(path, mode, **kwargs)

    monkeypatch.setattr(store.fs, "open", refusing_reasons)
    reader = ShardReader(store)
    with caplog.at_level(logging.WARNING, logger="storage.shards"):
        assert reader.read(info) is None
        assert reader.read(info) is None
    first, second = (record.getMessage() for record in caplog.records)
    assert "cannot read the Arrow IPC file" in first and "no writes to" in first, first
    assert "quarantined before" in second, second
    assert reader.quarantined(info)
    assert store.fs.exists(store.path(quarantine_path(info.path)))


def test_a_flipped_bit_anywhere_in_a_shard_never_makes_read_raise(local_store):
    # without a checksum some flips go unnoticed (a token changes); the others must end in
    # quarantine, whatever part of Arrow they trip (a corrupt length once asked for 256 TiB)
    info = ShardWriter(local_store, "w0").commit(make_table(0, 40, num_tokens=64), seq=0)
    path = local_store.path(info.path)
    original = Path(path).read_bytes()
    reader = ShardReader(local_store)
    quarantined = 0
    for position in range(0, len(original), 7):
        flipped = bytearray(original)
        flipped[position] ^= 1 << position % 8
        Path(path).write_bytes(flipped)
        table = reader.read(info)
        if table is None:
            quarantined += 1
            assert reader.quarantined(info)
        else:
            assert table.num_rows == 40
    assert quarantined > 0


def test_a_failed_fetch_raises_and_leaves_the_shard_for_the_next_read(store, monkeypatch):
    with ShardWriter(store, "w0") as writer:
        writer.write_table(make_table(0, 2))
    reader = ShardReader(store)
    (shard,), _ = reader.poll()

    def timed_out(*args, **kwargs):
        raise TimeoutError("read timed out (injected)")

    with monkeypatch.context() as patch:
        if store.config.is_s3:
            patch.setattr(store.fs, "open", timed_out)
        else:
            patch.setattr(pa, "memory_map", timed_out)
        with pytest.raises(TimeoutError, match="injected"):
            reader.read(shard)
    assert ids_of(reader.read(shard)) == ["t0", "t1"]
    assert not store.fs.exists(store.path(quarantine_path(shard.path)))


class CutsAShardsBody(S3Proxy):
    """Passes every request on to the S3 server, but sends only the first half of the next
    shard file fetched (its whole length announced) and then closes the connection, as a
    connection dropped while a response streams."""

    cut = 0

    def relay(self) -> None:
        status, headers, body = self.forward()
        if self.command == "GET" and self.path.partition("?")[0].endswith(".arrow") and not self.cut:
            CutsAShardsBody.cut += 1
            self.close_connection = True
            self.answer(status, headers, body[: len(body) // 2], length=len(body))
            return
        self.answer(status, headers, body)


def test_a_connection_dropped_while_a_shard_streams_is_a_transient_error_and_leaves_the_shard(s3_server):
    """aiohttp raises a body cut short as ``ClientPayloadError``, neither an ``OSError`` nor a
    botocore error: the process and train tasks took it for a bug and failed at once rather
    than retrying their read."""
    config = s3_server.config()
    store = RunStore(config, f"run-{uuid.uuid4().hex[:12]}")
    with ShardWriter(store, "w0") as writer:
        writer.write_table(make_table(0, 2))
    CutsAShardsBody.cut = 0
    with proxying(CutsAShardsBody, s3_server.endpoint_url) as endpoint:
        cutting = config.model_copy(update={"endpoint_url": endpoint})
        reader = ShardReader(RunStore(cutting, store.run_id))
        (shard,), _ = reader.poll()
        with pytest.raises(Exception) as raised:
            reader.read(shard)
        assert CutsAShardsBody.cut == 1
        assert is_transient(raised.value), repr(raised.value)
        assert shard.path in str(raised.value)
        assert not reader.quarantined(shard)
        assert ids_of(reader.read(shard)) == ["t0", "t1"]


def test_an_unreachable_endpoint_fails_fast_with_a_clear_error():
    config = StorageConfig(
        root="s3://treadle-test/runs",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        access_key_id="k",
        secret_access_key="do-not-print-me",
        connect_timeout=1,
        retries=1,
    )
    store = RunStore(config, "run")
    started = time.monotonic()
    with pytest.raises(OSError) as info:
        ShardWriter(store, "w0")
    assert "127.0.0.1" in str(info.value)
    with pytest.raises(EndpointConnectionError, match="Could not connect to the endpoint URL"):
        store.fs.pipe_file(store.path("shards/x"), b"x")
    errors = [info.value]
    for reading in (ShardReader(store).poll, lambda: Tables(store).read("shards"), WeightStore(store).latest):
        with pytest.raises((OSError, EndpointConnectionError)) as info:
            reading()
        assert "127.0.0.1" in str(info.value)
        errors.append(info.value)
    assert time.monotonic() - started < 60
    assert not any("do-not-print-me" in f"{error} {error!r}" for error in errors)
    assert "do-not-print-me" not in repr(config)


@pytest.fixture
def silent_endpoint():
    """An endpoint on 127.0.0.1 that accepts connections and never answers (a stalled store)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for connection in held:
        connection.close()


def test_a_stalled_endpoint_fails_every_call_within_its_timeouts(silent_endpoint):
    """Reads, uploads (which wait for a "100 continue" answer) and Delta reads each raise once
    the configured timeouts and attempts are spent; before, s3fs repeated each botocore
    attempt five times (ten minutes to read LATEST) and an upload waited for ever."""
    config = StorageConfig(
        root="s3://treadle-test/runs",
        endpoint_url=silent_endpoint,
        access_key_id="k",
        secret_access_key="do-not-print-me",
        connect_timeout=1,
        read_timeout=1,
        retries=1,
    )
    store = RunStore(config, "run")
    started = time.monotonic()
    calls = {
        "read LATEST": WeightStore(store).latest,
        "upload": lambda: store.fs.pipe_file(store.path("shards/x"), b"x" * 1000),
        "poll": ShardReader(store).poll,
    }
    for name, call in calls.items():
        with pytest.raises(OSError) as info:
            call()
        assert "do-not-print-me" not in f"{info.value} {info.value!r}", name
    assert time.monotonic() - started < 60


def test_a_writer_or_reader_for_a_schema_that_is_not_canonical_is_refused_at_once(local_store):
    lacking = TRAJECTORY_SCHEMA.remove(TRAJECTORY_SCHEMA.get_field_index("status"))
    with pytest.raises(SchemaError, match=r"missing columns \['status'\]"):
        ShardWriter(local_store, "w0", schema=lacking)
    with pytest.raises(SchemaError, match=r"missing columns \['status'\]"):
        ShardReader(local_store, schema=lacking)


def test_a_local_shard_is_on_disk_before_its_commit_lands(local_store, monkeypatch):
    """Its file and the folder entry of its rename are flushed to disk before the commit: a
    power loss must not leave a committed shard empty (quarantined, its rows lost)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_append = os.fsync, os.replace, Tables.append

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(source: str, target: str) -> None:
        events.append(("rename", target))
        real_replace(source, target)

    def append(tables, name, rows):
        events.append(("commit", name))
        return real_append(tables, name, rows)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(Tables, "append", append)
    writer = ShardWriter(local_store, "w0", flush_records=2)
    info = writer.write_many([make_record(0), make_record(1)])
    path = local_store.path(info.path)
    renamed, committed = events.index(("rename", path)), events.index(("commit", "shards"))
    synced = {target for kind, target in events[:renamed] if kind == "fsync"}
    assert any(os.path.basename(target).startswith(os.path.basename(path) + "-") for target in synced)
    # the folder synced after the rename: its placeholder's entry synced before it is not the shard's
    assert ("fsync", os.path.dirname(path)) in events[renamed:committed]


def test_a_poll_from_the_start_orders_a_workers_shards_by_number_whatever_the_writers_clocks(
    local_store, monkeypatch
):
    """A worker restarted on a host whose clock is behind commits shard 1 with a time before
    shard 0's: read from the start (the log's snapshot), its shards still come in number order."""
    real = shard_module.datetime

    class Behind:
        @staticmethod
        def now(tz=None):
            return real.now(tz) - timedelta(seconds=10)

    with ShardWriter(local_store, "w0", flush_records=2) as writer:
        writer.write_table(make_table(0, 2))
        monkeypatch.setattr(shard_module, "datetime", Behind)
        writer.write_table(make_table(2, 2))
    committed = Tables(local_store).read("shards").sort_by("committed_at").column("seq").to_pylist()
    assert committed == [1, 0]
    shards, _ = ShardReader(local_store).poll()
    assert [shard.seq for shard in shards] == [0, 1]


def _flipped_yet_valid(payload: bytes, schema: pa.Schema) -> bytes:
    """``payload`` with the first single-bit flip (from its middle on) that still parses,
    validates and reads as different records: compression does not catch it."""
    original = pa.ipc.open_file(pa.BufferReader(payload)).read_all()
    for position in range(len(payload) // 2, len(payload)):
        flipped = bytearray(payload)
        flipped[position] ^= 1
        try:
            table = pa.ipc.open_file(pa.BufferReader(bytes(flipped))).read_all()
            table.validate(full=True)
            validate(cast(table, schema))
        except (pa.ArrowException, SchemaError, ValueError):
            continue
        if not table.equals(original):
            return bytes(flipped)
    raise AssertionError("no single-bit flip of the shard reads as valid records")


def test_a_reader_given_a_shard_of_another_kind_refuses_it_and_leaves_it_in_place(store):
    """A raw reader read a processed shard against the raw schema, found its extra columns
    and moved the good shard to quarantine, where its own kind's reader no longer found it."""
    with ShardWriter(store, "p0", kind="processed") as writer:
        writer.write_table(make_processed_table(0, 2))
    (shard,), _ = ShardReader(store, kind="processed").poll()
    with pytest.raises(ValueError, match="shard processed/p0/00000000 is a processed shard, not a raw one"):
        ShardReader(store).read(shard)
    reader = ShardReader(store, kind="processed")
    assert not reader.quarantined(shard) and reader.read(shard).num_rows == 2


@pytest.mark.parametrize("kind", ["raw", "processed"])
def test_a_shard_whose_bytes_changed_after_its_commit_is_quarantined_not_read(store, kind):
    table = make_table(0, 8) if kind == "raw" else make_processed_table(0, 8)
    with ShardWriter(store, "w0", kind=kind) as writer:
        writer.write_table(table)
    reader = ShardReader(store, kind=kind)
    [info], _ = reader.poll()
    path = store.path(info.path)
    store.fs.pipe_file(path, _flipped_yet_valid(store.fs.cat_file(path), reader.schema))

    assert reader.read(info) is None and reader.quarantined(info)
    reason = store.fs.cat_file(store.path(quarantine_path(info.path) + ".reason")).decode()
    assert f"shard {kind}/w0/00000000: its bytes changed since its commit (CRC-32 " in reason


def test_shards_committed_before_checksums_were_recorded_still_read(store):
    """A run begun by an older treadle: its ``shards`` table has no ``crc32`` column. Its
    shard reads unchecked, and the next commit adds the column and a checksum."""
    info = commit_foreign_file(store, 0, ipc_bytes(make_table(0, 2)))
    old_rows = Tables(store).read("shards").drop_columns(["crc32"])
    store.fs.rm(store.path("tables", "shards"), recursive=True)
    write_deltalake(Tables(store).uri("shards"), old_rows, storage_options=store.config.delta_options())
    with ShardWriter(store, "w0") as writer:
        writer.write_table(make_table(2, 2))

    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert {shard.worker: shard.crc32 is None for shard in shards} == {"w9": True, "w0": False}
    assert sorted(ids_of(pa.concat_tables(reader.read(shard) for shard in shards))) == [
        "t0",
        "t1",
        "t2",
        "t3",
    ]
    assert not reader.quarantined(info)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_shard_holding_other_than_its_committed_rows_is_quarantined_not_read(store, rows):
    """A shard committed (without a checksum) as 2 rows whose file holds another number."""
    info = commit_foreign_file(store, 0, ipc_bytes(make_table(0, rows)))
    reader = ShardReader(store)

    assert reader.read(info) is None and reader.quarantined(info)
    reason = store.fs.cat_file(store.path(quarantine_path(info.path) + ".reason")).decode()
    assert f"holds {rows} rows but its commit says 2" in reason


@pytest.mark.parametrize("extra_column", [True, False])
def test_a_shard_written_by_a_newer_treadle_is_refused_and_left_in_place(store, extra_column):
    """A shard whose schema names a later record version (a worker upgraded before this
    reader): reading it raises naming both versions, and the shard is neither read under
    the old meaning nor quarantined, so an upgraded reader still gets its rows."""
    table = make_table(0, 2)
    if extra_column:
        table = table.append_column("score", pa.array([1.0, 2.0]))
    newer = table.replace_schema_metadata({"treadle.schema": "trajectory/3"})
    info = commit_foreign_file(store, 0, ipc_bytes(newer))
    reader = ShardReader(store)
    with pytest.raises(SchemaError, match="raw/w9/00000000.*trajectory/3.*trajectory/2"):
        reader.read(info)
    assert not reader.quarantined(info)
    assert store.fs.cat_file(store.path(info.path)) == ipc_bytes(newer)


@pytest.mark.parametrize("kind", ["raw", "processed"])
def test_a_writer_refuses_records_of_a_newer_treadle_rather_than_writing_them_as_its_own(local_store, kind):
    """A table whose schema names a later record version (rows a newer treadle wrote, copied
    in by a tool): cast to this treadle's schema, its new columns would be dropped and its
    rows labelled with the old version, so that even an upgraded reader misread them."""
    table = make_table(0, 2) if kind == "raw" else make_processed_table(0, 2)
    named = table.schema.metadata[b"treadle.schema"].decode().partition("/")[0]
    newer = table.append_column("score", pa.array([1.0, 2.0])).replace_schema_metadata(
        {"treadle.schema": f"{named}/9"}
    )
    writer = ShardWriter(local_store, "w0", kind=kind, flush_records=1)
    with pytest.raises(NewerSchemaError, match=f"{named}/9 records, newer than this treadle's {named}/"):
        writer.write_table(newer)
    with pytest.raises(NewerSchemaError, match=f"{named}/9"):
        writer.commit(newer, seq=3)
    assert writer.flush() is None and ShardReader(local_store, kind=kind).poll()[0] == []


def _read_whole(store: RunStore, shard: ShardInfo) -> None:
    """Reads ``shard`` back whole (a failed assertion exits the process non-zero)."""
    assert ids_of(ShardReader(store).read(shard)) == ["t0", "t1"]


def test_a_forked_process_reads_shards_after_its_parent_summed_some(local_store):
    # a process forked later (a data loader's worker) inherits the checksum pool of a
    # parent that used it; deltalake refuses forked processes, so the child only reads
    writer = ShardWriter(local_store, "w0", flush_records=2)
    writer.write(make_record(0))
    shard = writer.write(make_record(1))
    _read_whole(local_store, shard)
    child = multiprocessing.get_context("fork").Process(target=_read_whole, args=(local_store, shard))
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked process hung reading a shard")
    assert child.exitcode == 0


def test_a_bad_shard_that_cannot_be_moved_to_quarantine_is_skipped_and_said_so(store, monkeypatch, caplog):
    """The move to quarantine failed (no permission, an S3 error): the error went up through
    ``read`` and stopped the consumer at the bad shard, every time it came back to it."""
    good = ipc_bytes(make_table(0, 2))
    bad = commit_foreign_file(store, 1, good[: len(good) // 2])
    with ShardWriter(store, "w0") as writer:
        writer.write_table(make_table(10, 2))

    def refused(source, target, **kwargs):
        raise PermissionError(f"no writes to {target} (injected)")

    monkeypatch.setattr(store.fs, "mv", refused)
    reader = ShardReader(store)
    shards, _ = reader.poll()
    with caplog.at_level(logging.WARNING, logger="storage.shards"):
        results = {shard.shard_id: reader.read(shard) for shard in shards}
        assert reader.read(bad) is None  # read again (a restart): skipped again, not raised
    assert results[bad.shard_id] is None
    assert ids_of(results["raw/w0/00000000"]) == ["t10", "t11"]
    messages = [record.getMessage() for record in caplog.records if bad.shard_id in record.getMessage()]
    assert len(messages) == 2
    for message in messages:
        assert "could not be moved to quarantine" in message and "no writes to" in message, message
        assert "cannot read the Arrow IPC file" in message, message
    assert store.fs.exists(store.path(bad.path)) and not reader.quarantined(bad)
    assert reader.unread_reason(bad) == "bad, left in place"  # what the trainer and processing record


def store_down_unreachable(*args):
    raise OSError("endpoint unreachable (injected)")


@pytest.mark.parametrize("writer_class", [ShardWriter, BackgroundShardWriter])
def test_a_write_whose_flush_fails_keeps_its_record_and_its_error_says_so(store, monkeypatch, writer_class):
    """The write buffered its record, then the flush it set off raised a plain store error:
    nothing told the caller that the record was taken, so one that wrote it again on the
    error had it committed twice."""
    background = writer_class is BackgroundShardWriter
    # past one unsaved record a background writer commits in the caller's thread, and raises
    writer = writer_class(store, "w0", flush_records=1, **({"max_unsaved_records": 1} if background else {}))
    with monkeypatch.context() as patch:
        patch.setattr(writer.tables, "append", store_down_unreachable)
        if background:
            writer.write(make_record(0))  # fails on the commit thread
        with pytest.raises(OSError, match="unreachable") as raised:
            writer.write(make_record(1))
    (note,) = raised.value.__notes__
    assert "the 1 record of this write is kept" in note and "do not write it again" in note, note
    assert records_kept(raised.value) == 1
    assert records_kept(pickle.loads(pickle.dumps(raised.value))) == 1  # sent to another process
    writer.close()
    reader = ShardReader(store)
    shards, _ = reader.poll()
    written = [tid for shard in shards for tid in ids_of(reader.read(shard))]
    assert written == (["t0", "t1"] if background else ["t1"])


def start_upload(store: RunStore, path: str) -> dict:
    """Start a multipart upload of ``path`` with one part sent, as s3fs does for a large
    shard, and leave it as a writer killed before completing it does; its listing."""
    bucket, key, _ = store.fs.split_path(store.path(path))
    upload = store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    store.fs.call_s3(
        "upload_part", Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024
    )
    listed = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)["Uploads"]
    return next(found for found in listed if found["UploadId"] == upload["UploadId"])


def uploads_of(store: RunStore) -> list[str]:
    bucket, prefix, _ = store.fs.split_path(store.path())
    listed = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
    return [upload["UploadId"] for upload in listed.get("Uploads", [])]


def test_incomplete_uploads_of_killed_writers_are_aborted_once_old_and_only_under_the_run(
    s3_server, monkeypatch
):
    """A writer killed during a multipart upload (a shard of 100 MiB or more) left its parts
    stored, and billed, for ever: nothing listed or removed them."""
    store = RunStore(s3_server.config(), f"run-{uuid.uuid4().hex[:12]}")
    beside = RunStore(s3_server.config(), store.run_id + "0")  # its prefix starts with this run's
    killed = start_upload(store, "shards/raw/w0/00000000.arrow")
    other = start_upload(beside, "shards/raw/w0/00000000.arrow")
    started = killed["Initiated"].timestamp()
    with pytest.raises(ValueError, match="older_than_s must be"):
        abort_stale_uploads(store, older_than_s=60)

    with monkeypatch.context() as patch:  # half an hour on: it may be a live writer's
        patch.setattr(shard_module, "time", types.SimpleNamespace(time=lambda: started + 1800))
        assert abort_stale_uploads(store, older_than_s=3600) == []
    assert uploads_of(store) == [killed["UploadId"]]

    monkeypatch.setattr(shard_module, "time", types.SimpleNamespace(time=lambda: started + 7200))
    assert abort_stale_uploads(store, older_than_s=3600) == ["shards/raw/w0/00000000.arrow"]
    assert uploads_of(store) == [] and uploads_of(beside) == [other["UploadId"]]
    assert abort_stale_uploads(store, older_than_s=3600) == []


@pytest.mark.parametrize(
    "refusal", [PermissionError("Access Denied"), OSError(errno.ENOSYS, "Not Implemented")]
)
def test_a_store_that_refuses_to_list_uploads_aborts_none_and_says_so(
    s3_server, monkeypatch, caplog, refusal
):
    """Credentials without the listing permission (or a store without multipart uploads) failed
    the maintain flow's step at every run, for an optional clean-up."""
    store = RunStore(s3_server.config(), f"run-{uuid.uuid4().hex[:12]}")
    call_s3 = store.fs.call_s3

    def refused(method, *args, **kwargs):
        if method == "list_multipart_uploads":
            raise refusal
        return call_s3(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "call_s3", refused)
    with caplog.at_level(logging.WARNING, logger="storage.shards"):
        assert abort_stale_uploads(store, older_than_s=MIN_SWEEP_AGE_S) == []
    assert any("cannot list the incomplete uploads" in message for message in caplog.messages)
    refusal = OSError("the store is down (injected)")
    with pytest.raises(OSError, match="down"):  # a store that is down is an error of the step
        abort_stale_uploads(store, older_than_s=MIN_SWEEP_AGE_S)


def test_aborting_stale_uploads_of_a_local_run_does_nothing(local_store):
    assert abort_stale_uploads(local_store, older_than_s=MIN_SWEEP_AGE_S) == []
