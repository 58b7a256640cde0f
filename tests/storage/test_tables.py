"""Delta tables: canonical schemas, append/read, change feed, compaction, concurrency."""

from __future__ import annotations

import http.server
import json
import os
import posixpath
import random
import subprocess
import sys
import textwrap
import threading
import traceback
from datetime import UTC, datetime, timedelta

import deltalake.table
import duckdb
import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError

from flows.sql import VIEWS, connect, extension_paths
from storage import tables as tables_module
from storage.config import RunStore, StorageConfig
from storage.leases import SlotLease
from storage.schema import SchemaError
from storage.tables import TABLE_CONFIGURATION, TABLE_SCHEMAS, StaleOffsetError, Tables, one_row_per_step
from tasks.common import is_transient
from tests.conftest import free_port, readme_query
from tests.storage.s3_proxy import S3Proxy, proxying


def weight_row(version: int, tag: str | None = None) -> dict:
    return {
        "version": version,
        "step": version * 10,
        "parent": version - 1 if version else None,
        "path": f"weights/v{version:06d}",
        "num_consumed_shards": version,
        "created_at": datetime(2026, 1, 1, tzinfo=UTC),
        "tag": tag,
    }


def test_schemas_hold_the_agreed_columns():
    assert TABLE_SCHEMAS["shards"].names == [
        "shard_id", "kind", "path", "worker", "seq", "num_rows", "num_tokens",
        "min_version", "max_version", "committed_at", "crc32",
    ]  # fmt: skip
    assert TABLE_SCHEMAS["shards"].field("crc32").nullable  # null for shards committed before it
    assert TABLE_SCHEMAS["weights"].field("parent").nullable
    assert not TABLE_SCHEMAS["weights"].field("path").nullable
    assert TABLE_SCHEMAS["trajectories"].field("num_turns").type == pa.int16()
    assert TABLE_SCHEMAS["train_steps"].field("time").type == pa.timestamp("us", tz="UTC")


def test_read_of_a_table_never_written_is_empty_with_its_schema(store):
    table = Tables(store).read("train_steps")
    assert table.num_rows == 0
    assert table.schema.equals(TABLE_SCHEMAS["train_steps"])


def test_append_and_read_back_in_the_canonical_schema(store):
    tables = Tables(store)
    tables.append("weights", [weight_row(0), weight_row(1, tag="best")])
    loose = pa.table(
        {
            "version": pa.array([2], pa.int64()),
            "step": [20],
            "path": pa.array(["weights/v000002"], pa.large_string()),
            "num_consumed_shards": [3],
            "created_at": pa.array([datetime(2026, 1, 2)], pa.timestamp("ns")),
            "ignored": ["extra columns are dropped"],
        }
    )
    tables.append("weights", loose)
    table = tables.read("weights")
    assert table.schema.equals(TABLE_SCHEMAS["weights"])
    rows = sorted(table.to_pylist(), key=lambda row: row["version"])
    assert [row["version"] for row in rows] == [0, 1, 2]
    assert rows[0]["parent"] is None and rows[1]["parent"] == 0
    assert rows[1]["tag"] == "best" and rows[2]["tag"] is None
    assert rows[2]["path"] == "weights/v000002"
    assert rows[2]["created_at"] == datetime(2026, 1, 2, tzinfo=UTC)


def test_a_table_of_several_chunks_whose_columns_are_cast_is_appended(local_store):
    """A table built from several batches, a nullable column left out (added as one chunk
    of nulls): Arrow's cast rechunks its columns, and the float32 range check failed the
    append with a bare ``ValueError`` of pyarrow."""
    tables = Tables(local_store)
    rows = pa.Table.from_pylist([weight_row(version) for version in range(4)]).drop_columns(["tag"])
    rows = pa.Table.from_batches(rows.to_batches(max_chunksize=2))
    assert tables.append("weights", rows)
    assert sorted(tables.read("weights").column("version").to_pylist()) == [0, 1, 2, 3]


def test_bad_rows_are_refused_naming_table_and_column(store):
    tables = Tables(store)
    row = weight_row(0)
    del row["path"]
    with pytest.raises(SchemaError, match=r"'weights'.*'path'.*required"):
        tables.append("weights", [row])
    with pytest.raises(SchemaError, match="'weights'"):
        tables.append("weights", [weight_row(0) | {"version": "not a number"}])
    with pytest.raises(SchemaError, match=r"missing columns \['step'"):
        tables.append("weights", pa.table({"version": [1]}))
    with pytest.raises(ValueError, match="unknown table 'nope'"):
        tables.append("nope", [])
    assert tables.version("weights") is None


def test_a_read_of_a_column_the_table_lacks_is_refused_naming_the_table_and_its_columns(local_store):
    """Before the table is written as after: a typo is a caller's bug either way."""
    tables = Tables(local_store)
    refused = r"table 'weights' has no column 'versoin'; its columns are \['version', 'step'"
    with pytest.raises(ValueError, match=refused):
        tables.read("weights", columns=["version", "versoin"])
    tables.append("weights", [weight_row(0)])
    with pytest.raises(ValueError, match=refused):
        tables.read("weights", columns=["version", "versoin"])


def test_a_fraction_or_an_overflowing_int_given_to_an_integer_column_is_refused_not_changed(local_store):
    """pyarrow converts a Python float into an integer column by dropping its fraction (a
    ``count`` of 3.7 was stored as 3), where a table's float column is refused by the cast;
    and an int past int64 raised ``OverflowError``, not the :class:`SchemaError` promised."""
    tables = Tables(local_store)
    with pytest.raises(SchemaError, match=r"'weights'.*'num_consumed_shards'.*2\.5"):
        tables.append("weights", [weight_row(0) | {"num_consumed_shards": 2.5}])
    with pytest.raises(SchemaError, match=r"'weights'.*'parent'.*nan"):
        tables.append("weights", [weight_row(1) | {"parent": float("nan")}])
    with pytest.raises(SchemaError, match="'weights'"):
        tables.append("weights", [weight_row(0) | {"step": 2**70}])
    assert tables.version("weights") is None
    assert tables.append("weights", [weight_row(0) | {"num_consumed_shards": 2.0}])
    assert tables.read("weights").column("num_consumed_shards").to_pylist() == [2]


def test_a_number_beyond_float32s_range_is_refused_naming_its_row_not_stored_as_infinity(local_store):
    """Arrow converts a float64 of 1e39 into a float32 column as an infinity, without a word."""
    tables = Tables(local_store)
    rows = [eval_row(0.5), eval_row(-1e39), eval_row(float("inf"))]
    message = r"table 'evals': column 'reward', row 1: a number beyond float32's range"
    with pytest.raises(SchemaError, match=message):
        tables.append("evals", rows)
    with pytest.raises(SchemaError, match=message):
        tables.append("evals", pa.Table.from_pylist(rows))
    assert tables.version("evals") is None
    highest = float(np.finfo(np.float32).max)
    assert tables.append("evals", [eval_row(highest), eval_row(float("-inf"))])
    assert tables.read("evals").column("reward").to_pylist() == [highest, float("-inf")]


def test_a_string_given_for_a_list_column_is_refused_not_split_into_characters(local_store):
    """pyarrow reads a string as the sequence of its characters: ``trajectory_ids="arith-0"``
    was stored as ``['a', 'r', 'i', 't', 'h', '-', '0']``."""
    tables = Tables(local_store)
    rows = [
        step_row(1, None) | {"trajectory_ids": ["arith-0"]},
        step_row(2, None) | {"trajectory_ids": "arith-1"},
    ]
    with pytest.raises(
        SchemaError, match=r"table 'train_steps': column 'trajectory_ids' is a list but was given 'arith-1'"
    ):
        tables.append("train_steps", rows)
    assert tables.version("train_steps") is None
    assert tables.append("train_steps", rows[:1] + [step_row(2, None) | {"trajectory_ids": ("arith-1",)}])
    assert tables.read("train_steps").column("trajectory_ids").to_pylist() == [["arith-0"], ["arith-1"]]


@pytest.mark.parametrize("selected", [[2, 0], [0.5, 0.0]])
def test_a_table_column_of_numbers_for_a_boolean_one_is_refused_not_cast(local_store, selected):
    """Arrow casts 2 and 0.5 to True without a word; a row of dicts giving them is refused."""
    tables = Tables(local_store)
    rows = pa.Table.from_pylist([trajectory_row("a"), trajectory_row("b")]).drop_columns(["selected"])
    rows = rows.append_column("selected", pa.array(selected))
    with pytest.raises(
        SchemaError, match=r"table 'trajectories': column 'selected' has type (int64|double), expected bool"
    ):
        tables.append("trajectories", rows)
    assert tables.version("trajectories") is None


@pytest.mark.parametrize("moment", [1767225600, 1767225600.25, np.int64(1767225600)])
def test_a_number_given_for_a_timestamp_is_refused_not_read_as_microseconds(local_store, moment):
    """pyarrow reads a number as microseconds since 1970: ``time.time()`` in 2026 was stored
    as 1970-01-01 00:29:27 UTC (a float's fraction dropped)."""
    tables = Tables(local_store)
    with pytest.raises(
        SchemaError, match=r"table 'evals': column 'time' is a timestamp but was given .*1767225600"
    ):
        tables.append("evals", [eval_row(0.5) | {"time": moment}])
    assert tables.version("evals") is None


@pytest.mark.parametrize("type", [pa.int64(), pa.uint32()])
def test_a_table_column_of_numbers_for_a_timestamp_is_refused_not_read_as_microseconds(local_store, type):
    """Arrow casts an integer column to a timestamp as microseconds since 1970: a table of
    epoch seconds (``int(time.time())``) was stored as a moment of January 1st, 1970."""
    tables = Tables(local_store)
    rows = pa.Table.from_pylist([eval_row(0.5)]).drop_columns(["time"])
    rows = rows.append_column("time", pa.array([1767225600], type))
    with pytest.raises(
        SchemaError, match=rf"table 'evals': column 'time' has type {type}, expected timestamp\[us, tz=UTC\]"
    ):
        tables.append("evals", rows)
    assert tables.version("evals") is None


def eval_row(reward: float) -> dict:
    return {
        "version": 0,
        "env": "arith",
        "reward": reward,
        "count": 8,
        "time": datetime(2026, 1, 1, tzinfo=UTC),
    }


def test_changes_return_rows_of_later_commits_and_skip_compaction(store):
    tables = Tables(store)
    for version in range(4):
        tables.append("weights", [weight_row(version)])
    rows, offset = tables.changes("weights", after=0)
    assert rows.column("version").to_pylist() == [1, 2, 3]
    assert rows.column("_commit_version").to_pylist() == [1, 2, 3]
    assert offset == 3
    tables.optimize("weights")
    tables.append("weights", [weight_row(4)])
    rows, new_offset = tables.changes("weights", after=offset)
    assert rows.column("version").to_pylist() == [4]
    assert new_offset == tables.version("weights") == 5
    assert tables.changes("weights", after=new_offset)[0].num_rows == 0


def test_changes_after_a_version_the_table_never_reached_are_refused_naming_both(local_store):
    """A cursor past the table's latest version (kept from a table since recreated, or from
    another run) would read nothing forever: the read says so instead."""
    tables = Tables(local_store)
    for version in range(3):
        tables.append("weights", [weight_row(version)])
    with pytest.raises(StaleOffsetError, match=r"'weights'.*after version 7.*latest version is 2"):
        tables.changes("weights", after=7)
    local_store.fs.rm(local_store.path("tables", "weights"), recursive=True)
    with pytest.raises(StaleOffsetError, match=r"'weights'.*after version 2.*does not exist"):
        tables.changes("weights", after=2)
    rows, offset = tables.changes("weights")
    assert rows.num_rows == 0 and offset == -1


def test_a_table_made_by_its_first_append_has_the_change_feed_enabled(local_store):
    """Other readers of the change feed (Spark's ``readChangeFeed``) refuse a table
    whose metadata does not enable it, whichever append made the table."""
    tables = Tables(local_store)
    tables.append("weights", [weight_row(0)])
    tables.append("train_steps", [step_row(1, None)], once="step/1")
    for name in ("weights", "train_steps"):
        configuration = tables._open(name).metadata().configuration
        assert configuration.get("delta.enableChangeDataFeed") == "true", name


def test_changes_return_only_appended_rows_not_those_a_delete_removed(local_store):
    """An operator's DELETE (a bad row removed by hand) is a commit whose change feed holds
    the removed rows as deletes: a consumer of the appended rows must not take them again."""
    tables = Tables(local_store)
    for version in range(3):
        tables.append("weights", [weight_row(version)])
    _, offset = tables.changes("weights")
    DeltaTable(tables.uri("weights")).delete("version = 1")
    tables.append("weights", [weight_row(3)])
    rows, _ = tables.changes("weights", after=offset)
    assert rows.column("version").to_pylist() == [3]


def test_changes_read_the_change_feed_a_few_commits_at_a_time(store, monkeypatch):
    # deltalake reads the commit files of a change feed with the GIL held: a read of a long
    # range would stall every other thread of the process until all of them are read
    spans = []
    load_cdf = DeltaTable.load_cdf

    def recorded(self, **kwargs):
        spans.append((kwargs["starting_version"], kwargs["ending_version"]))
        return load_cdf(self, **kwargs)

    monkeypatch.setattr(DeltaTable, "load_cdf", recorded)
    tables = Tables(store)
    commits = 2 * tables_module.CDF_COMMITS + 2
    for version in range(commits):
        tables.append("weights", [weight_row(version)])
    rows, offset = tables.changes("weights", after=0)
    assert rows.column("version").to_pylist() == list(range(1, commits))
    assert rows.column("_commit_version").to_pylist() == list(range(1, commits))
    assert [first for first, _ in spans] == [1] + [last + 1 for _, last in spans[:-1]]
    assert spans[-1][1] == offset == commits - 1
    assert all(last - first < tables_module.CDF_COMMITS for first, last in spans)


def test_changes_from_the_start_read_the_snapshot_so_vacuum_cannot_break_them(store):
    # a restarted consumer polls from the start; the change feed of the first versions
    # reads data files that optimize + vacuum delete
    tables = Tables(store)
    for version in range(4):
        tables.append("weights", [weight_row(version)])
    tables.optimize("weights")
    assert tables.vacuum("weights", retention_hours=0)
    rows, offset = tables.changes("weights")
    assert sorted(rows.column("version").to_pylist()) == [0, 1, 2, 3]
    assert offset == tables.version("weights")
    assert rows.column("_commit_version").to_pylist() == [offset] * 4


def test_changes_after_a_version_whose_files_vacuum_removed_are_refused_saying_to_read_from_the_start(store):
    """A consumer whose offset is older than the vacuum's retention reads commits whose data
    files are gone: every retry fails alike, so the read says so, as a stale offset, not as a
    storage error a task retries."""
    tables = Tables(store)
    for version in range(4):
        tables.append("weights", [weight_row(version)])
    tables.optimize("weights")
    assert tables.vacuum("weights", retention_hours=0)
    with pytest.raises(
        StaleOffsetError, match=r"'weights'.*after version 1,.*removed by a vacuum.*after=-1"
    ) as raised:
        tables.changes("weights", after=1)
    assert not is_transient(raised.value)
    rows, _ = tables.changes("weights")
    assert sorted(rows.column("version").to_pylist()) == [0, 1, 2, 3]


def test_changes_after_a_version_whose_data_file_is_lost_though_listed_say_so_not_blame_a_vacuum(local_store):
    """A data file the log still lists, gone from the store (deleted by hand, a lost disk):
    the change feed was refused as an offset older than a vacuum's retention, telling the
    reader to read from the start, which fails alike on the same file."""
    tables = Tables(local_store)
    for version in range(3):
        tables.append("weights", [weight_row(version)])
    first = set(DeltaTable(tables.uri("weights"), version=0).file_uris())
    lost = next(uri for uri in tables._open("weights").file_uris() if uri not in first)
    os.remove(lost)
    with pytest.raises(
        FileNotFoundError, match=r"^table 'weights': its data file part-\S+ is missing"
    ) as raised:
        tables.changes("weights", after=0)
    assert posixpath.basename(lost) in str(raised.value) and "vacuum" not in str(raised.value)
    assert not is_transient(raised.value)


def test_a_reused_snapshot_is_loaded_again_after_snapshot_appends(store, monkeypatch):
    # a snapshot carried across commits goes over every commit since its load on each
    # append, so one Tables object must not carry it forever
    monkeypatch.setattr(tables_module, "SNAPSHOT_APPENDS", 3)
    tables = Tables(store)
    opens = []
    load = tables._open
    monkeypatch.setattr(tables, "_open", lambda name: opens.append(name) or load(name))
    opened_by = []
    for version in range(7):
        before = len(opens)
        tables.append("weights", [weight_row(version)])
        opened_by += [version] * (len(opens) - before)
    # append 0 creates the table; 1 loads a snapshot that serves 1-3; 4 loads one for 4-6
    assert opened_by == [0, 1, 4]
    assert sorted(Tables(store).read("weights").column("version").to_pylist()) == list(range(7))


def test_optimize_and_vacuum_keep_every_row(store):
    tables = Tables(store)
    for version in range(5):
        tables.append("weights", [weight_row(version)])
    metrics = tables.optimize("weights")
    assert metrics["numFilesRemoved"] == 5 and metrics["numFilesAdded"] == 1
    removed = tables.vacuum("weights", retention_hours=0)
    assert len(removed) == 5
    assert sorted(tables.read("weights").column("version").to_pylist()) == [0, 1, 2, 3, 4]


def test_vacuum_returns_only_the_files_it_deleted(store):
    """deltalake's vacuum (1.6) lists every file a commit removed whose retention has passed,
    deleted by an earlier vacuum or not: each maintain run reported the same files vacuumed
    again, until their entries leave the log (a week on)."""
    tables = Tables(store)
    for version in range(3):
        tables.append("weights", [weight_row(version)])
    compacted = {posixpath.basename(uri) for uri in tables._open("weights").file_uris()}
    tables.optimize("weights")
    assert sorted(tables.vacuum("weights", retention_hours=0)) == sorted(compacted)
    assert tables.vacuum("weights", retention_hours=0) == []
    tables.append("weights", [weight_row(3)])
    added = {posixpath.basename(uri) for uri in tables._open("weights").file_uris()}
    tables.optimize("weights")
    assert sorted(tables.vacuum("weights", retention_hours=0)) == sorted(added)
    assert sorted(tables.read("weights").column("version").to_pylist()) == [0, 1, 2, 3]


def test_vacuum_deletes_the_files_of_a_writer_killed_before_its_commit(store):
    """A writer or compaction killed between writing its data file and committing it leaves
    the file unlisted by any commit: vacuum takes it once past the retention, not before."""
    tables = Tables(store)
    for version in range(2):
        tables.append("weights", [weight_row(version)])
    committed = next(iter(tables._open("weights").file_uris()))
    orphan = store.path("tables", "weights", "part-00001-killed-writer-c000.zstd.parquet")
    store.fs.pipe(orphan, store.fs.cat(committed))

    assert tables.vacuum("weights", retention_hours=1) == []
    assert store.fs.exists(orphan)
    assert tables.vacuum("weights", retention_hours=0) == [posixpath.basename(orphan)]
    assert not store.fs.exists(orphan)
    assert sorted(tables.read("weights").column("version").to_pylist()) == [0, 1]


def test_two_processes_compacting_a_table_at_once_leave_each_row_once(store):
    """deltalake lets two compactions of the same files both commit, each with the rows
    rewritten, so the table holds them twice (checked here on the library itself); through
    ``Tables.optimize`` a process skips while another holds the compaction lease."""
    for version in range(6):
        Tables(store).append("weights", [weight_row(version)])
    first, second = Tables(store)._open("weights"), Tables(store)._open("weights")
    first.optimize.compact()
    second.optimize.compact()
    assert Tables(store).read("weights").num_rows == 12, "deltalake no longer duplicates: simplify the leases"

    other = RunStore(store.config, store.run_id + "-leased")
    tables = Tables(other)
    for version in range(6):
        tables.append("weights", [weight_row(version)])
    slot = tables_module.COMPACTION_SLOT_S
    now = 1_000_000 * slot + slot - 1  # the last second of a slot
    compacting = SlotLease(other, other.path(tables_module.COMPACTION_PREFIX, "weights"), slot)
    assert compacting.take(now)
    assert tables.optimize("weights", now=now) is None
    assert tables.optimize("weights", now=now + slot) is None, "the next slot is held too"
    compacting.renew(now + slot)  # still compacting: the holder renews into the slot after
    assert tables.optimize("weights", now=now + 2 * slot) is None
    compacting.release()
    assert tables.optimize("weights", now=now + 2 * slot)["numFilesRemoved"] == 6
    assert sorted(tables.read("weights").column("version").to_pylist()) == list(range(6))
    assert tables.optimize("weights", now=now + 2 * slot) is not None, (
        "a finished compaction releases its lease"
    )


def test_a_lease_left_by_a_holder_that_died_lapses_within_two_slots(local_store):
    folder, slot = local_store.path("status", "leases"), 10.0
    dead = SlotLease(local_store, folder, slot)
    assert dead.take(100.0)  # slots 10 and 11, never renewed or released
    assert not SlotLease(local_store, folder, slot).take(115.0)
    survivor = SlotLease(local_store, folder, slot)
    assert survivor.take(120.0)
    assert sorted(os.listdir(folder)) == ["12", "13"], "the dead holder's leases are deleted"


def test_a_lease_is_never_left_behind_by_a_failed_take_or_a_failed_delete(local_store, monkeypatch, caplog):
    folder, slot = local_store.path("status", "leases"), 10.0
    real_create, created = local_store.create_exclusive, []

    def second_create_fails(path, payload):
        if created:
            raise OSError("connection reset (injected)")
        created.append(path)
        real_create(path, payload)

    lease = SlotLease(local_store, folder, slot)
    monkeypatch.setattr(local_store, "create_exclusive", second_create_fails)
    with pytest.raises(OSError, match="injected"):
        lease.take(100.0)
    monkeypatch.undo()
    assert created and os.listdir(folder) == []

    assert lease.take(100.0)
    monkeypatch.setattr(
        local_store.fs, "rm", lambda path: (_ for _ in ()).throw(OSError("denied (injected)"))
    )
    lease.release()  # logged, not raised: the leases lapse within two slots
    assert "lapses within two slots" in caplog.text and lease.held == []


def test_a_lease_whose_create_reply_was_lost_is_still_taken(local_store):
    """s3fs retries a PUT whose reply was lost: the retry finds the lease it made itself."""
    folder, slot = local_store.path("status", "leases"), 10.0
    lease = SlotLease(local_store, folder, slot)
    os.makedirs(folder)
    local_store.create_exclusive(os.path.join(folder, "10"), lease.holder)
    assert lease.take(100.0)
    assert not SlotLease(local_store, folder, slot).take(100.0)
    lease.release()
    assert os.listdir(folder) == []


def test_a_lease_released_while_another_take_finds_it_is_taken(store, monkeypatch):
    """The holder deletes its lease between another's refused create and its read of the
    lease: that take creates it again, it does not fail on the missing lease."""
    folder, slot = store.path("status", "leases"), 10.0
    holder, taker = SlotLease(store, folder, slot), SlotLease(store, folder, slot)
    assert holder.take(100.0)
    real_create = store.create_exclusive

    def released_after_refusal(path, payload):
        try:
            real_create(path, payload)
        except FileExistsError:
            holder.release()
            raise

    monkeypatch.setattr(store, "create_exclusive", released_after_refusal)
    assert taker.take(100.0)
    monkeypatch.undo()
    assert not SlotLease(store, folder, slot).take(100.0)
    assert [posixpath.basename(p) for p in taker.held] == ["10", "11"]


def test_appends_compact_a_fragmented_table_and_readers_of_its_changes_notice_nothing(store, monkeypatch):
    monkeypatch.setattr(tables_module, "COMPACT_FILES", 5)
    tables = Tables(store)
    rows, offset = tables.changes("weights")
    seen = []
    for version in range(12):
        tables.append("weights", [weight_row(version)])
        rows, offset = tables.changes("weights", after=offset)
        seen += rows.column("version").to_pylist()
    assert seen == list(range(12))
    # compacted into one file at the 5th and the 9th append: 1 + 3 files
    assert len(tables._open("weights").file_uris()) == 4

    monkeypatch.setattr(tables_module, "SMALL_FILE_BYTES", 100)  # every file is big now
    for version in range(12, 20):
        tables.append("weights", [weight_row(version)])
    assert len(tables._open("weights").file_uris()) == 12, "files past the small size are not compacted"
    assert sorted(tables.read("weights").column("version").to_pylist()) == list(range(20))


def test_an_append_whose_compaction_fails_lands_once_and_says_so(local_store, monkeypatch, caplog):
    """The append has committed before it compacts: a failed compaction is logged, and the
    append reports success (raising would make its caller append the rows again)."""
    monkeypatch.setattr(tables_module, "COMPACT_FILES", 2)
    tables = Tables(local_store)

    def failing(self, name, now=None):
        raise OSError("store refused the compaction")

    monkeypatch.setattr(Tables, "optimize", failing)
    for version in range(4):
        assert tables.append("weights", [weight_row(version)])
    assert sorted(Tables(local_store).read("weights").column("version").to_pylist()) == [0, 1, 2, 3]
    assert "could not compact table weights" in caplog.text


def _duckdb_with_delta(store: RunStore, request: pytest.FixtureRequest) -> duckdb.DuckDBPyConnection:
    """duckdb with the delta and httpfs extensions loaded from their wheels' files (its
    own extension download needs the internet), and the S3 test server's secret when
    ``store`` is on it."""
    connection = duckdb.connect()
    for path in extension_paths():
        connection.execute(f"LOAD '{path}'")
    if store.config.is_s3:
        server = request.getfixturevalue("s3_server")
        connection.execute(
            "CREATE SECRET (TYPE s3, KEY_ID ?, SECRET ?, REGION ?, ENDPOINT ?, URL_STYLE 'path', USE_SSL false)",
            [
                server.access_key_id,
                server.secret_access_key,
                server.region,
                server.endpoint_url.removeprefix("http://"),
            ],
        )
    return connection


def test_duckdb_reads_the_delta_table(store, request):
    tables = Tables(store)
    tables.append("weights", [weight_row(0), weight_row(1, tag="best")])
    tables.append("weights", [weight_row(2)])
    connection = _duckdb_with_delta(store, request)
    rows = connection.execute(
        f"SELECT version, step, tag FROM delta_scan('{tables.uri('weights')}') ORDER BY version"
    ).fetchall()
    assert rows == [(0, 0, None), (1, 10, "best"), (2, 20, None)]


APPENDER = textwrap.dedent(
    """
    import json, os, sys
    from datetime import UTC, datetime
    from storage.config import RunStore, StorageConfig
    from storage.tables import Tables

    config, run_id, writer, count = json.loads(sys.argv[1])
    tables = Tables(RunStore(StorageConfig(**config), run_id))
    for i in range(count):
        tables.append("train_steps", [{
            "step": i, "version": writer, "policy_loss": 0.0, "value_loss": 0.0,
            "masked_fraction": 0.0, "mean_ratio": 1.0, "kl": 0.0, "staleness_mean": 0.0,
            "staleness_max": 0, "num_samples": 1, "num_tokens": 1, "tokens_per_s": 1.0,
            "reward_mean": 0.0, "dropped_stale": 0, "step_seconds": 0.1,
            "time": datetime.now(UTC), "extra": None,
        }])
    print("done", flush=True)
    os._exit(0)  # deltalake's runtime threads can abort an orderly interpreter exit
    """
)


def test_an_append_that_conflicts_on_every_attempt_raises_and_lands_nothing(local_store, monkeypatch):
    """A commit conflict that outlasts the retries is raised, not swallowed as "appended
    nothing": the caller must know its rows are not in the table."""
    tables = Tables(local_store)
    tables.append("weights", [weight_row(0)])
    attempts = []

    def conflicting(*args, **kwargs):
        attempts.append(1)
        raise CommitFailedError("conflict")

    monkeypatch.setattr(tables_module, "write_deltalake", conflicting)
    monkeypatch.setattr(tables_module.time, "sleep", lambda seconds: None)
    with pytest.raises(CommitFailedError):
        tables.append("weights", [weight_row(1)])
    assert len(attempts) == tables_module.COMMIT_ATTEMPTS
    monkeypatch.undo()
    assert tables.append("weights", [weight_row(1)])
    assert sorted(Tables(local_store).read("weights").column("version").to_pylist()) == [0, 1]


def unreachable_store() -> RunStore:
    """A run on an S3 endpoint where nothing listens (each request refused at once)."""
    config = StorageConfig(
        root="s3://bucket/runs",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        access_key_id="key",
        secret_access_key="secret",
        retries=0,
    )
    return RunStore(config, "run")


def test_a_storage_error_of_deltalake_is_raised_without_its_colour_codes():
    """deltalake colours the chain of causes of its storage errors with ANSI escape codes: a
    task retried on one logged it (Prefect logs the error's repr) with ``\\x1b[31m↳\\x1b[0m``
    between the causes. The causes are kept."""
    with pytest.raises(OSError) as raised:
        Tables(unreachable_store()).version("weights")
    assert "Connection refused" in str(raised.value)
    assert "\x1b" not in str(raised.value)


def test_a_retried_commit_conflict_is_logged_without_colour_codes(local_store, monkeypatch, caplog):
    """The log of a commit retried after a conflict quoted deltalake's error as it came, its
    colour codes with it."""
    store = unreachable_store()
    with pytest.raises(OSError) as raised:
        DeltaTable(Tables(store).uri("weights"), storage_options=store.config.delta_options())
    coloured = str(raised.value)
    assert "\x1b[" in coloured
    tables = Tables(local_store)
    tables.append("weights", [weight_row(0)])
    write = tables_module.write_deltalake
    conflicts = iter([CommitFailedError(coloured)])

    def conflicting_once(*args, **kwargs):
        for conflict in conflicts:
            raise conflict
        return write(*args, **kwargs)

    monkeypatch.setattr(tables_module, "write_deltalake", conflicting_once)
    monkeypatch.setattr(tables_module.time, "sleep", lambda seconds: None)
    with caplog.at_level("INFO", logger=tables_module.log.name):
        assert tables.append("weights", [weight_row(1)])
    # caplog.text has pytest's own removal of escape codes: the records are what the handlers get
    (logged,) = [record.getMessage() for record in caplog.records if "conflicted" in record.getMessage()]
    assert "conflicted (attempt 1)" in logged and "Connection refused" in logged
    assert "\x1b" not in logged


def test_an_append_whose_commit_landed_but_whose_checkpoint_failed_says_it_was_appended(local_store, caplog):
    """deltalake writes a checkpoint after every 100th commit, once the commit has landed: a
    failed checkpoint write (an S3 503) raised from the append although its rows were in the
    table, and the task's retry appended them again."""
    tables = Tables(local_store)
    write_deltalake(
        tables.uri("weights"),
        pa.Table.from_pylist([weight_row(0)], schema=TABLE_SCHEMAS["weights"]),
        configuration=TABLE_CONFIGURATION | {"delta.checkpointInterval": "2"},
    )
    os.makedirs(os.path.join(local_store.path("tables", "weights", "_delta_log"), "_last_checkpoint", "x"))
    assert tables.append("weights", [weight_row(1)], once="weights/1")
    assert sorted(tables.read("weights").column("version").to_pylist()) == [0, 1]
    assert "table weights: the append landed, but deltalake failed after its commit" in caplog.text


def test_two_processes_appending_at_once_lose_nothing(store):
    import json

    config = store.config.model_dump(mode="json")
    for key in ("access_key_id", "secret_access_key"):
        if getattr(store.config, key) is not None:
            config[key] = getattr(store.config, key).get_secret_value()
    count = 8
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", APPENDER, json.dumps([config, store.run_id, writer, count])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for writer in (0, 1)
    ]
    for process in writers:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0 and "done" in out, err[-3000:]
    table = Tables(store).read("train_steps")
    landed = sorted(zip(table.column("version").to_pylist(), table.column("step").to_pylist(), strict=True))
    assert landed == [(writer, step) for writer in (0, 1) for step in range(count)]
    assert Tables(store).version("train_steps") == 2 * count - 1


@pytest.mark.parametrize("table_exists", [False, True])
def test_rows_appended_once_by_two_writers_land_once(store, table_exists):
    """Each writer holds a snapshot loaded before the other's commit, as two processes that
    both found version 0's row missing do: the second's commit conflicts and its retry finds
    the row recorded."""
    first, second = Tables(store), Tables(store)
    if table_exists:
        first.append("weights", [weight_row(1)])
        second.append("weights", [weight_row(2)])  # first's snapshot is older than this commit
    assert second.append("weights", [weight_row(0, tag="base")], once="weights/v000000")
    assert not first.append("weights", [weight_row(0, tag="base")], once="weights/v000000")
    assert not Tables(store).append("weights", [weight_row(0)], once="weights/v000000")
    assert first.append("weights", [weight_row(3)], once="weights/v000003")
    versions = sorted(Tables(store).read("weights").column("version").to_pylist())
    assert versions == ([0, 1, 2, 3] if table_exists else [0, 3])


def test_rows_appended_once_land_once_when_the_table_is_created_while_the_writer_looks(store, monkeypatch):
    """A writer that found no table (a trainer starting before the base version's publisher
    wrote the run's first weights row) and another that creates it before the first writes."""
    first, second = Tables(store), Tables(store)
    open_table = Tables._open

    def open_before_the_other_commits(self, name):
        monkeypatch.setattr(Tables, "_open", open_table)
        table = open_table(self, name)
        assert second.append("weights", [weight_row(0, tag="base")], once="weights/v000000")
        return table

    monkeypatch.setattr(Tables, "_open", open_before_the_other_commits)
    assert not first.append("weights", [weight_row(0, tag="base")], once="weights/v000000")
    assert Tables(store).read("weights").column("version").to_pylist() == [0]


def test_rows_appended_once_land_once_when_another_writer_creates_the_table_during_the_create(
    local_store, monkeypatch
):
    """The other writer's create lands between this create's check for the table and its
    commit, which then fails with a commit conflict: the table is there, and the rows the
    other writer appended with the same id are found in it."""
    first, second = Tables(local_store), Tables(local_store)
    create = DeltaTable.create

    def created_by_the_other_meanwhile(*args, **kwargs):
        monkeypatch.setattr(DeltaTable, "create", create)
        assert second.append("weights", [weight_row(0, tag="base")], once="weights/v000000")
        raise CommitFailedError("Transaction failed: version already exists: 0")

    monkeypatch.setattr(DeltaTable, "create", created_by_the_other_meanwhile)
    assert not first.append("weights", [weight_row(0, tag="base")], once="weights/v000000")
    assert Tables(local_store).read("weights").column("version").to_pylist() == [0]


def step_row(step: int, value_loss: float | None) -> dict:
    """A ``train_steps`` row; ``value_loss`` None for a step with no critic (GRPO)."""
    return {
        "step": step, "version": 0, "policy_loss": 0.1, "value_loss": value_loss,
        "masked_fraction": 0.0, "mean_ratio": 1.0, "kl": 0.0, "staleness_mean": 0.0,
        "staleness_max": 0, "num_samples": 1, "num_tokens": 1, "tokens_per_s": 1.0,
        "reward_mean": 0.0, "dropped_stale": 0, "step_seconds": 0.1,
        "time": datetime(2026, 1, 1, tzinfo=UTC), "extra": None,
    }  # fmt: skip


def trajectory_row(trajectory_id: str) -> dict:
    """A ``trajectories`` row of a selected, one-turn trajectory."""
    return {
        "trajectory_id": trajectory_id, "execution_id": trajectory_id, "task": "arith",
        "prompt_id": "p0", "shard_id": "raw/w0/00000000", "reward": 1.0, "status": "ok",
        "num_tokens": 8, "num_action_tokens": 4, "num_train_tokens": 4, "num_turns": 1,
        "min_version": 0, "max_version": 0, "selected": True,
        "processed_at": datetime(2026, 1, 1, tzinfo=UTC),
    }  # fmt: skip


def older_train_steps(store: RunStore, schema: pa.Schema) -> str:
    """A ``train_steps`` table made by an older treadle whose schema was ``schema``, holding
    step 1; returns its URI."""
    uri = Tables(store).uri("train_steps")
    row = {name: value for name, value in step_row(1, 0.5).items() if name in schema.names}
    write_deltalake(
        uri,
        pa.Table.from_pylist([row], schema=schema),
        mode="append",
        configuration=TABLE_CONFIGURATION,
        storage_options=store.config.delta_options(),
    )
    return uri


def test_a_train_steps_table_created_with_value_loss_required_takes_steps_without_a_critic(store):
    """A run's table made before ``value_loss`` became nullable still marks it NOT NULL in
    its log: appends of null value losses (GRPO) land, old rows and the change feed stay."""
    schema = TABLE_SCHEMAS["train_steps"]
    assert schema.field("value_loss").nullable
    index = schema.get_field_index("value_loss")
    old_schema = schema.set(index, schema.field("value_loss").with_nullable(False))
    options = store.config.delta_options()
    uri = older_train_steps(store, old_schema)
    stale = DeltaTable(uri, storage_options=options)
    assert not stale.schema().fields[index].nullable

    tables = Tables(store)
    tables.append("train_steps", [step_row(2, None)])
    tables.append("train_steps", [step_row(3, None)])  # on the snapshot the first append left
    Tables(store).append("train_steps", [step_row(4, 0.25)])

    steps = Tables(store).read("train_steps").sort_by("step")
    assert steps.column("value_loss").to_pylist() == [0.5, None, None, 0.25]
    assert duckdb.sql("SELECT avg(value_loss) FROM steps").fetchone()[0] == pytest.approx(0.375)
    rows, _ = Tables(store).changes("train_steps", after=0)
    assert rows.column("step").to_pylist() == [2, 3, 4]
    operations = [commit["operation"] for commit in DeltaTable(uri, storage_options=options).history()]
    assert operations.count("CHANGE COLUMN") == 1
    # a writer that loaded the table before another one relaxed it gets a snapshot it can append with
    assert Tables(store)._upgrade("train_steps", stale).schema().fields[index].nullable


def test_a_table_made_before_a_column_was_added_reads_it_as_null_and_takes_appends_with_it(store, request):
    """A run begun by an older treadle whose ``train_steps`` had no ``extra`` column: its
    rows read with ``extra`` null, the first append adds the column (once), and reads, the
    change feed and duckdb see every row."""
    schema = TABLE_SCHEMAS["train_steps"]
    old_schema = schema.remove(schema.get_field_index("extra"))
    options = store.config.delta_options()
    uri = older_train_steps(store, old_schema)
    before = Tables(store).read("train_steps")
    assert before.schema == schema and before.column("extra").to_pylist() == [None]
    assert Tables(store).read("train_steps", columns=["extra", "step"]).to_pylist() == [
        {"extra": None, "step": 1}
    ]

    tables = Tables(store)
    tables.append("train_steps", [step_row(2, 0.25) | {"extra": '{"a": 1}'}])
    tables.append("train_steps", [step_row(3, None)])
    Tables(store).append("train_steps", [step_row(4, 0.125) | {"extra": '{"b": 2}'}])

    steps = Tables(store).read("train_steps").sort_by("step")
    assert steps.column("extra").to_pylist() == [None, '{"a": 1}', None, '{"b": 2}']
    assert steps.column("value_loss").to_pylist() == [0.5, 0.25, None, 0.125]
    rows, _ = Tables(store).changes("train_steps", after=0)
    assert rows.column("step").to_pylist() == [2, 3, 4]
    assert rows.column("extra").to_pylist() == ['{"a": 1}', None, '{"b": 2}']
    everything, _ = Tables(store).changes("train_steps")
    assert sorted(everything.column("step").to_pylist()) == [1, 2, 3, 4]
    scanned = _duckdb_with_delta(store, request).execute(
        f"SELECT count(*), count(extra) FROM delta_scan('{Tables(store).uri('train_steps')}')"
    )
    assert scanned.fetchone() == (4, 2)
    operations = [commit["operation"] for commit in DeltaTable(uri, storage_options=options).history()]
    assert operations.count("ADD COLUMN") == 1, operations


def test_a_train_steps_table_made_before_trajectory_ids_takes_steps_that_name_their_trajectories(
    store, request
):
    """A run begun before ``train_steps`` named each step's trajectories: the first append
    adds the list column, older rows read it as null, and duckdb joins the steps to the
    trajectories they trained on."""
    schema = TABLE_SCHEMAS["train_steps"]
    old_schema = schema.remove(schema.get_field_index("trajectory_ids"))
    older_train_steps(store, old_schema)
    Tables(store).append("train_steps", [step_row(2, 0.25) | {"trajectory_ids": ["a", "b"]}])
    Tables(store).append("trajectories", [trajectory_row("a"), trajectory_row("b"), trajectory_row("c")])

    steps = Tables(store).read("train_steps").sort_by("step")
    assert steps.column("trajectory_ids").to_pylist() == [None, ["a", "b"]]
    tables = {name: f"delta_scan('{Tables(store).uri(name)}')" for name in ("train_steps", "trajectories")}
    joined = _duckdb_with_delta(store, request).execute(
        f"SELECT s.step, t.trajectory_id FROM (SELECT step, unnest(trajectory_ids) AS id FROM "
        f"{tables['train_steps']}) s JOIN {tables['trajectories']} t ON t.trajectory_id = s.id ORDER BY 2"
    )
    assert joined.fetchall() == [(2, "a"), (2, "b")]


def test_the_views_over_a_train_steps_table_made_before_trajectory_ids_read_no_trajectories_trained(
    local_store,
):
    """A run whose ``train_steps`` table an older treadle made without ``trajectory_ids``, not
    appended to since: ``kept_steps`` reads its steps with the column null, and ``trained``
    answers no rows rather than fail."""
    schema = TABLE_SCHEMAS["train_steps"]
    older_train_steps(local_store, schema.remove(schema.get_field_index("trajectory_ids")))
    published_at = datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    Tables(local_store).append("weights", [weight_row(1) | {"step": 1, "created_at": published_at}])
    Tables(local_store).append("trajectories", [trajectory_row("a")])
    db = connect(local_store)
    assert db.execute("SELECT step, trajectory_ids FROM kept_steps").fetchall() == [(1, None)]
    assert db.execute("SELECT count(*) FROM trained").fetchall() == [(0,)]


def test_an_older_table_whose_column_cannot_be_added_fails_the_append_with_that_error(
    local_store, monkeypatch
):
    """An ADD COLUMNS commit that fails while no other writer added the column is the
    append's error (not a later, vaguer schema mismatch), and the table is left as it was."""
    schema = TABLE_SCHEMAS["train_steps"]
    older_train_steps(local_store, schema.remove(schema.get_field_index("extra")))

    def refused(self, fields):
        raise DeltaError("store refused the ADD COLUMNS commit")

    monkeypatch.setattr(deltalake.table.TableAlterer, "add_columns", refused)
    with pytest.raises(DeltaError, match="store refused the ADD COLUMNS commit"):
        Tables(local_store).append("train_steps", [step_row(2, 0.25)])
    monkeypatch.undo()
    assert Tables(local_store).read("train_steps").column("step").to_pylist() == [1]


def test_a_table_lacking_a_required_column_is_refused_naming_it(local_store):
    schema = TABLE_SCHEMAS["train_steps"]
    old_schema = schema.remove(schema.get_field_index("reward_mean"))
    uri = Tables(local_store).uri("train_steps")
    old_row = {k: v for k, v in step_row(1, 0.5).items() if k != "reward_mean"}
    write_deltalake(uri, pa.Table.from_pylist([old_row], schema=old_schema), mode="append")
    with pytest.raises(SchemaError, match=r"lacks the required columns \['reward_mean'\]"):
        Tables(local_store).append("train_steps", [step_row(2, 0.25)])
    with pytest.raises(
        SchemaError, match=r"table 'train_steps' lacks the required columns \['reward_mean'\]"
    ):
        Tables(local_store).read("train_steps")
    assert DeltaTable(uri).version() == 0, "nothing committed"


def published(*versions: tuple[int, float]) -> pa.Table:
    """A ``weights`` table of versions given as (step, seconds into 2026 they were published),
    numbered from 1 in the order given."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    return pa.Table.from_pylist(
        [
            {"version": version, "step": step, "created_at": start + timedelta(seconds=second)}
            for version, (step, second) in enumerate(versions, 1)
        ]
    )


def test_a_table_holding_a_column_this_treadle_does_not_know_is_refused_naming_it(local_store):
    """A table a newer treadle (or another tool) added a column to failed every append with
    deltalake's ``Cannot cast schema, number of fields does not match: 7 vs 8``, naming neither
    the table nor the column; its rows still read."""
    schema = TABLE_SCHEMAS["evals"].append(pa.field("judge", pa.string()))
    uri = Tables(local_store).uri("evals")
    write_deltalake(
        uri, pa.Table.from_pylist([eval_row(0.5) | {"judge": "j1"}], schema=schema), mode="append"
    )
    with pytest.raises(
        SchemaError, match=r"table 'evals' has the columns \['judge'\] this treadle does not know"
    ):
        Tables(local_store).append("evals", [eval_row(0.25)])
    assert Tables(local_store).read("evals").column("reward").to_pylist() == [0.5]


def test_one_row_per_step_keeps_the_newest_row_of_a_step_logged_twice():
    """A restarted trainer logs steps 3 and 4 again after resuming from the version of step 2."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    logged = [(1, 0), (2, 1), (3, 2), (4, 3), (3, 10), (4, 11), (5, 12)]
    rows = [
        {"step": step, "version": 0, "time": start + timedelta(seconds=second), "policy_loss": float(second)}
        for step, second in logged
    ]
    steps = pa.Table.from_pylist(rows)
    weights = published((0, -1), (2, 1.5), (5, 13))
    kept = one_row_per_step(steps, weights)
    assert kept.column("step").to_pylist() == [1, 2, 3, 4, 5]
    assert kept.column("policy_loss").to_pylist() == [0.0, 1.0, 10.0, 11.0, 12.0]
    assert one_row_per_step(steps.slice(0, 0), weights).num_rows == 0


def test_one_row_per_step_drops_the_steps_a_dead_trainer_logged_after_the_version_resumed_from():
    """A trainer logs steps 1-5 and dies (its last version at step 3); the next resumes from
    step 3 and logs step 4 before the run ends. Its step 5 went into no weights: the rows are
    steps 1-4, as the query of ``treadle sql``'s ``kept_steps`` view gives them too."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    logged = [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (4, 10)]
    steps = pa.Table.from_pylist(
        [
            {
                "step": step,
                "version": 0,
                "time": start + timedelta(seconds=second),
                "policy_loss": float(second),
            }
            for step, second in logged
        ]
    )
    weights = published((0, -1), (3, 2.5), (4, 11))
    kept = one_row_per_step(steps, weights)
    assert kept.column("step").to_pylist() == [1, 2, 3, 4]
    assert kept.column("policy_loss").to_pylist() == [0.0, 1.0, 2.0, 10.0]
    connection = duckdb.connect()
    connection.register("train_steps", steps)
    connection.register("weights", weights)
    viewed = connection.execute(f"SELECT step, policy_loss FROM ({VIEWS['kept_steps']}) ORDER BY step")
    assert viewed.fetchall() == [(1, 0.0), (2, 1.0), (3, 2.0), (4, 10.0)]


def test_the_steps_a_dead_trainer_logged_after_its_last_version_are_dropped_when_none_takes_them_again(
    local_store,
):
    """A trainer publishes version 1 at step 2, logs steps 3 and 4 and dies; the next resumes
    from version 1 and stops before taking a step (its deadline had passed). Steps 3 and 4
    went into no weights: ``one_row_per_step`` and the ``kept_steps`` view keep steps 1 and 2."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    tables = Tables(local_store)
    tables.append("weights", [weight_row(0) | {"step": 0, "created_at": start}])
    tables.append(
        "train_steps", [step_row(step, 0.5) | {"time": start + timedelta(seconds=step)} for step in (1, 2)]
    )
    tables.append("weights", [weight_row(1) | {"step": 2, "created_at": start + timedelta(seconds=2.5)}])
    tables.append(
        "train_steps", [step_row(step, 0.5) | {"time": start + timedelta(seconds=step)} for step in (3, 4)]
    )
    kept = one_row_per_step(tables.read("train_steps"), tables.read("weights"))
    assert kept.column("step").to_pylist() == [1, 2]
    viewed = connect(local_store).execute("SELECT step FROM kept_steps ORDER BY step").fetchall()
    assert viewed == [(1,), (2,)]


def test_the_readmes_kept_steps_query_reads_a_step_whose_append_was_made_twice_once(store):
    """A trainer whose ``train_steps`` append raised although its commit landed appends the same
    rows again with its next step (``Trainer._log_step``): the rows are there twice, each pair
    with one time. ``one_row_per_step`` and the README's query over ``kept_steps`` read each
    step once."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [step_row(step, 0.5) | {"time": start + timedelta(seconds=step)} for step in (1, 2, 3)]
    tables = Tables(store)
    tables.append("train_steps", rows[:2])
    tables.append("train_steps", rows)
    tables.append("weights", [weight_row(0) | {"step": 3, "created_at": start + timedelta(seconds=4)}])
    assert one_row_per_step(tables.read("train_steps"), tables.read("weights")).column(
        "step"
    ).to_pylist() == [1, 2, 3]

    kept = connect(store).execute(readme_query("FROM kept_steps")).fetchall()

    assert [row[0] for row in kept] == [1, 2, 3]


def test_the_trained_view_reads_the_selected_row_of_a_trajectory_whose_id_its_shard_repeated(local_store):
    """A ``trajectory_id`` repeated within its shard has a second ``trajectories`` row, not
    selected (``duplicate_id``): a step that trained on it has one ``trained`` row, the selected one."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    tables = Tables(local_store)
    dropped = {"selected": False, "drop_reason": "duplicate_id", "text": "again"}
    tables.append("trajectories", [trajectory_row("a") | {"text": "trained"}, trajectory_row("a") | dropped])
    tables.append("train_steps", [step_row(1, 0.5) | {"trajectory_ids": ["a"], "time": start}])
    tables.append("weights", [weight_row(1) | {"step": 1, "created_at": start + timedelta(seconds=1)}])
    trained = connect(local_store).execute("SELECT step, trajectory_id, selected, text FROM trained")
    assert trained.fetchall() == [(1, "a", True, "trained")]


def test_a_trajectories_table_made_before_error_takes_rows_with_it_and_the_readmes_query_groups_them(store):
    """A run's ``trajectories`` table made before the record had ``error``: the next append
    adds the column (its older rows null), and the README's "why rollouts failed" query counts
    the failures by env, status and reason, the rows without one left out."""
    schema = TABLE_SCHEMAS["trajectories"]
    write_deltalake(
        Tables(store).uri("trajectories"),
        pa.Table.from_pylist([trajectory_row("old")], schema=schema.remove(schema.get_field_index("error"))),
        mode="append",
        configuration=TABLE_CONFIGURATION,
        storage_options=store.config.delta_options(),
    )
    start_failed = "sandbox start_failed during init: bwrap cannot create namespaces"
    failed = [
        trajectory_row("a") | {"status": "infra_error", "reward": None, "error": start_failed},
        trajectory_row("b") | {"status": "infra_error", "reward": None, "error": start_failed},
        trajectory_row("c") | {"task": "code", "status": "timeout", "reward": None, "error": "ran past 60 s"},
    ]
    Tables(store).append("trajectories", [*failed, trajectory_row("d")])

    rows = Tables(store).read("trajectories").sort_by("trajectory_id")
    assert rows.column("error").to_pylist() == [start_failed, start_failed, "ran past 60 s", None, None]
    answer = connect(store).execute(readme_query("GROUP BY task, status, error")).fetchall()
    assert answer == [("arith", "infra_error", start_failed, 2), ("code", "timeout", "ran past 60 s", 1)]


def test_a_store_error_that_echoes_the_credentials_is_raised_without_them(echoing_endpoint):
    """A flow's error reaches the Prefect API's logs and its state message: an error body in
    which the store echoes the key id and the session token must not carry them there."""
    config = StorageConfig(
        root="s3://bucket/runs",
        endpoint_url=echoing_endpoint,
        retries=0,
        access_key_id="AKIAKEYID123",
        secret_access_key="secret-456",
        session_token="session-token-789",
    )
    tables = Tables(RunStore(config, "r"))
    for call in (
        lambda: tables.version("weights"),
        lambda: tables.read("weights"),
        lambda: tables.append("weights", [weight_row(0)]),
    ):
        with pytest.raises(OSError) as raised:
            call()
        reported = "".join(traceback.format_exception(raised.value))
        assert "ExpiredToken" in reported, reported
        for secret in ("AKIAKEYID123", "secret-456", "session-token-789"):
            assert secret not in reported


class InstanceMetadata(http.server.BaseHTTPRequestHandler):
    """An EC2 instance metadata service whose role's temporary credentials are ``CREDENTIALS``."""

    CREDENTIALS = {
        "Code": "Success",
        "AccessKeyId": "ASIAINSTANCEROLE1234",
        "SecretAccessKey": "instance-secret-456",
        "Token": "instance-session-token-789",
        "Expiration": "2099-01-01T00:00:00Z",
    }

    def do_PUT(self):  # the IMDSv2 session token
        self._answer(b"imds-session")

    def do_GET(self):
        listing = self.path.rstrip("/").endswith("security-credentials")
        self._answer(b"role" if listing else json.dumps(self.CREDENTIALS).encode())

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_credentials_deltalake_finds_itself_are_masked_in_the_errors_that_echo_them(
    echoing_endpoint, monkeypatch
):
    """With no credentials in the config or the environment deltalake takes an instance's (or a
    pod's) role; the key id and session token AWS echoes went into the error unmasked, as only
    the config's and the environment's were known to be masked."""
    for variable in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(variable)
    metadata = http.server.ThreadingHTTPServer(("127.0.0.1", 0), InstanceMetadata)
    thread = threading.Thread(target=metadata.serve_forever)
    thread.start()
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{metadata.server_port}")
    try:
        config = StorageConfig(root="s3://bucket/runs", endpoint_url=echoing_endpoint, retries=0)
        with pytest.raises(OSError) as raised:
            Tables(RunStore(config, "r")).version("weights")
    finally:
        metadata.shutdown()
        thread.join()
        metadata.server_close()
    reported = "".join(traceback.format_exception(raised.value))
    assert "ExpiredToken" in reported, reported
    for secret in ("ASIAINSTANCEROLE1234", "instance-session-token-789", "instance-secret-456"):
        assert secret not in reported


class SlowDownOnDataFiles(S3Proxy):
    """Passes every request on to the S3 server, except, while ``refusing``, a GET of a Delta
    data file: that is answered as S3 answers a burst it throttles, 503 SlowDown, with a body
    that echoes the request's key id."""

    refusing = True

    def relay(self) -> None:
        if self.command == "GET" and self.path.partition("?")[0].endswith(".parquet") and self.refusing:
            key_id = self.headers.get("Authorization", "").partition("Credential=")[2].split("/")[0]
            body = f"<Error><Code>SlowDown</Code><AWSAccessKeyId>{key_id}</AWSAccessKeyId></Error>"
            self.answer(503, {}, body.encode())
            return
        self.answer(*self.forward())


def test_a_data_file_the_store_will_not_serve_is_a_transient_storage_error_naming_the_table(s3_server):
    """A 503 on a data file fails deltalake's scan with an ``ArrowInvalid`` (a ValueError):
    raised as such, a task took it for a bug and failed at once rather than retrying, and it
    carried the key id the store echoed. (The change feed of later commits is left to the
    next test: ``load_cdf`` holds the GIL while it waits, so this in-process proxy could not
    answer it.)"""
    config = s3_server.config()
    run_id = f"run-{os.urandom(6).hex()}"
    Tables(RunStore(config, run_id)).append("weights", [weight_row(0)])
    Tables(RunStore(config, run_id)).append("weights", [weight_row(1)])
    SlowDownOnDataFiles.refusing = True
    with proxying(SlowDownOnDataFiles, s3_server.endpoint_url) as endpoint:
        throttled = config.model_copy(update={"endpoint_url": endpoint, "retries": 0})
        tables = Tables(RunStore(throttled, run_id))
        assert tables.version("weights") == 1  # the log is served
        for call in (lambda: tables.read("weights"), lambda: tables.changes("weights")):
            with pytest.raises(OSError, match="table 'weights': cannot read its data files: .*503") as raised:
                call()
            assert is_transient(raised.value)
            reported = "".join(traceback.format_exception(raised.value))
            assert "SlowDown" in reported and s3_server.access_key_id not in reported, reported
        SlowDownOnDataFiles.refusing = False
        assert sorted(tables.read("weights").column("version").to_pylist()) == [0, 1]


def test_a_truncated_data_file_is_a_storage_error_naming_the_table(local_store):
    tables = Tables(local_store)
    tables.append("weights", [weight_row(0)])
    tables.append("weights", [weight_row(1)])
    folder = local_store.path("tables", "weights")
    for name in os.listdir(folder):
        if name.endswith(".parquet"):
            path = os.path.join(folder, name)
            os.truncate(path, os.path.getsize(path) // 2)
    for call in (
        lambda: tables.read("weights"),
        lambda: tables.changes("weights"),
        lambda: tables.changes("weights", after=0),
    ):
        with pytest.raises(OSError, match="table 'weights': cannot read its data files: "):
            call()


def test_a_truncated_commit_file_is_an_error_naming_the_table(local_store):
    tables = Tables(local_store)
    tables.append("weights", [weight_row(0)])
    tables.append("weights", [weight_row(1)])
    latest = local_store.path("tables", "weights", "_delta_log", f"{1:020d}.json")
    os.truncate(latest, os.path.getsize(latest) // 2)
    for call in (
        lambda: tables.version("weights"),
        lambda: tables.read("weights"),
        lambda: Tables(local_store).append("weights", [weight_row(2)]),
    ):
        with pytest.raises(DeltaError, match="table 'weights': cannot load its Delta log: "):
            call()
    assert tables.version("evals") is None  # the other tables are untouched


def test_an_empty_commit_file_reads_as_no_rows_and_check_log_names_the_table_and_version(store):
    tables = Tables(store)
    for version in range(3):
        tables.append("weights", [weight_row(version)])
    tables.check_log("weights")
    store.fs.pipe_file(store.path("tables", "weights", "_delta_log", f"{2:020d}.json"), b"")

    assert sorted(Tables(store).read("weights").column("version").to_pylist()) == [0, 1]  # silently
    Tables(store).append("weights", [weight_row(3)])  # lands as commit 3: commit 2 stays empty
    assert Tables(store).version("weights") == 3
    with pytest.raises(DeltaError, match=r"^table 'weights': its commit 2 is empty \(0 bytes"):
        Tables(store).check_log("weights")
    store.fs.pipe_file(store.path("tables", "weights", "_delta_log", f"{1:020d}.json"), b"")
    with pytest.raises(
        DeltaError, match=r"its commit 1 is empty \(0 bytes: lost in a crash\? and so are \[2\]\)"
    ):
        Tables(store).check_log("weights")
    Tables(store).check_log("evals")  # not created yet: nothing to check


def test_a_step_logged_at_the_microsecond_its_version_was_published_went_into_it():
    """A trainer logs a step, then publishes the version that holds it: on a coarse clock both
    read the same microsecond. ``one_row_per_step`` and the ``kept_steps`` view count the
    version as published after the step, so the step stays."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    steps = pa.Table.from_pylist(
        [step_row(step, None) | {"time": start + timedelta(seconds=step)} for step in (1, 2)]
    )
    weights = published((0, -1), (2, 2))
    assert one_row_per_step(steps, weights).column("step").to_pylist() == [1, 2]
    connection = duckdb.connect()
    connection.register("train_steps", steps)
    connection.register("weights", weights)
    viewed = connection.execute(f"SELECT step FROM ({VIEWS['kept_steps']}) ORDER BY step")
    assert viewed.fetchall() == [(1,), (2,)]


def test_a_step_logged_at_the_microsecond_two_versions_were_published_is_kept_once_published_in_the_lower():
    """Versions 2 and 3 published at the microsecond step 2 was logged (a coarse clock): the
    ``kept_steps`` view keeps step 2 once, published in version 2, the first to hold it."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    steps = pa.Table.from_pylist(
        [step_row(step, None) | {"time": start + timedelta(seconds=step)} for step in (1, 2)]
    )
    weights = published((0, -1), (2, 2), (3, 2))
    assert one_row_per_step(steps, weights).column("step").to_pylist() == [1, 2]
    connection = duckdb.connect()
    connection.register("train_steps", steps)
    connection.register("weights", weights)
    viewed = connection.execute(f"SELECT step, published_in FROM ({VIEWS['kept_steps']}) ORDER BY step")
    assert viewed.fetchall() == [(1, 2), (2, 2)]


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0]])
def test_of_rows_of_one_step_logged_at_one_microsecond_the_newest_version_stays_in_any_order(order):
    """Two different rows of step 2 logged at the same microsecond: neither is logged after the
    other, so both stayed in ``kept_steps``, and ``one_row_per_step`` kept whichever its input
    held last. Rows at one microsecond count as logged in the order of their step, then their
    version, then their policy loss: the row of the newest version stays, its policy loss the
    lower, whatever the order of the table's files."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [
        step_row(1, None) | {"time": start},
        step_row(2, None) | {"time": start + timedelta(seconds=1), "version": 1, "policy_loss": 0.2},
        step_row(2, None) | {"time": start + timedelta(seconds=1), "version": 0, "policy_loss": 0.9},
    ]
    steps = pa.Table.from_pylist([rows[i] for i in order], schema=TABLE_SCHEMAS["train_steps"])
    weights = published((0, -1), (2, 5))
    kept = one_row_per_step(steps, weights)
    assert kept.select(["step", "version"]).to_pylist() == [
        {"step": 1, "version": 0},
        {"step": 2, "version": 1},
    ]
    connection = duckdb.connect()
    connection.register("train_steps", steps)
    connection.register("weights", weights)
    viewed = connection.execute(f"SELECT step, version FROM ({VIEWS['kept_steps']}) ORDER BY step")
    assert viewed.fetchall() == [(1, 0), (2, 1)]


def test_of_rows_of_one_step_and_version_logged_at_one_microsecond_the_highest_policy_loss_stays():
    start = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [step_row(1, None) | {"time": start, "policy_loss": loss} for loss in (0.5, 0.7, 0.1)]
    steps = pa.Table.from_pylist(rows, schema=TABLE_SCHEMAS["train_steps"])
    weights = published((1, 1))
    assert one_row_per_step(steps, weights).column("policy_loss").to_pylist() == [pytest.approx(0.7)]
    connection = duckdb.connect()
    connection.register("train_steps", steps)
    connection.register("weights", weights)
    viewed = connection.execute(f"SELECT policy_loss FROM ({VIEWS['kept_steps']})").fetchall()
    assert viewed == [(pytest.approx(0.7),)]


@pytest.mark.parametrize("seed", range(20))
def test_the_kept_steps_view_keeps_the_rows_one_row_per_step_keeps(seed):
    """Random logs of restarted trainers, many rows and versions sharing a microsecond: the
    view (window functions over the tables) and ``one_row_per_step`` keep the same rows."""
    rng = random.Random(seed)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    moments = [start + timedelta(seconds=second) for second in range(8)]
    steps = pa.Table.from_pylist(
        [
            step_row(rng.randint(1, 6), None)
            | {
                "time": rng.choice(moments),
                "version": rng.randint(0, 2),
                "policy_loss": rng.choice([0.1, 0.2]),
            }
            for _ in range(rng.randint(0, 14))
        ],
        schema=TABLE_SCHEMAS["train_steps"],
    )
    weights = published(*((rng.randint(0, 6), rng.randint(0, 7)) for _ in range(rng.randint(1, 4))))
    key = ["step", "time", "version", "policy_loss"]
    kept = one_row_per_step(steps, weights).select(key).to_pylist()
    connection = duckdb.connect()
    connection.register("train_steps", steps)
    connection.register("weights", weights)
    viewed = connection.execute(f"SELECT {', '.join(key)} FROM ({VIEWS['kept_steps']}) ORDER BY step")
    assert viewed.to_arrow_table().to_pylist() == kept
    # published_in: the version published first at or after the step's time (the lowest of
    # those published at that one microsecond)
    publishes = weights.to_pylist()
    expected = []
    for row in kept:
        after = [w for w in publishes if w["created_at"] >= row["time"]]
        first = min((w["created_at"] for w in after), default=None)
        expected.append(min((w["version"] for w in after if w["created_at"] == first), default=None))
    viewed = connection.execute(f"SELECT published_in FROM ({VIEWS['kept_steps']}) ORDER BY step")
    assert [version for (version,) in viewed.fetchall()] == expected


class LosesACommitsReply(S3Proxy):
    """Passes every request on to the S3 server, but answers the first PUT of a Delta commit
    file, once the server has stored it, as S3 answers a request that failed (503): the
    client's retry of that conditional PUT then finds the commit there."""

    lost = 0

    def relay(self) -> None:
        status, headers, body = self.forward()
        if self.command == "PUT" and "/_delta_log/" in self.path and status == 200 and not self.lost:
            LosesACommitsReply.lost += 1
            status, headers, body = 503, {}, b"<Error><Code>SlowDown</Code></Error>"
        self.answer(status, headers, body)


def test_rows_appended_once_whose_commit_reply_was_lost_say_they_were_appended(s3_server):
    """The store client retries a commit PUT answered with a 5xx after it landed; the retry
    finds the commit there and deltalake, taking it for another writer's, finds its ``once``
    id in it: the conflict's retry then found the row recorded and said this call appended
    nothing, so a warm start that recorded its base version never announced it."""
    config = s3_server.config()
    run_id = f"run-{os.urandom(6).hex()}"
    Tables(RunStore(config, run_id)).append("weights", [weight_row(1)])
    LosesACommitsReply.lost = 0
    with proxying(LosesACommitsReply, s3_server.endpoint_url) as endpoint:
        proxied = config.model_copy(update={"endpoint_url": endpoint, "retries": 1})
        appended = Tables(RunStore(proxied, run_id)).append(
            "weights", [weight_row(0, tag="base")], once="weights/v000000"
        )
    assert LosesACommitsReply.lost == 1
    assert sorted(Tables(RunStore(config, run_id)).read("weights").column("version").to_pylist()) == [0, 1]
    assert appended
    assert not Tables(RunStore(config, run_id)).append("weights", [weight_row(0)], once="weights/v000000")


def test_rows_whose_commit_reply_was_lost_are_in_the_change_feed_once(s3_server):
    """The store client retries a commit PUT answered with a 5xx after it landed; deltalake
    takes the commit it finds for another writer's and commits the same data file again at
    the next version. A snapshot lists the file once, but the change feed read it from both
    commits: the processor and the trainer saw those rows twice."""
    config = s3_server.config()
    run_id = f"run-{os.urandom(6).hex()}"
    Tables(RunStore(config, run_id)).append("weights", [weight_row(1)])
    LosesACommitsReply.lost = 0
    with proxying(LosesACommitsReply, s3_server.endpoint_url) as endpoint:
        proxied = config.model_copy(update={"endpoint_url": endpoint, "retries": 1})
        assert Tables(RunStore(proxied, run_id)).append("weights", [weight_row(0)])
    assert LosesACommitsReply.lost == 1
    tables = Tables(RunStore(config, run_id))
    assert sorted(tables.read("weights").column("version").to_pylist()) == [0, 1]
    changed, latest = tables.changes("weights", after=0)
    assert changed.column("version").to_pylist() == [0]
    assert changed.column("_commit_version").to_pylist() == [1]
