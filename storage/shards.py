"""Arrow IPC shards of trajectory records, committed through the Delta ``shards`` table.

A writer buffers records, validates them once per shard (rows that fail are set aside in
the quarantine) and flushes them as one compressed Arrow IPC file at
``shards/<kind>/<worker>/<seq>.arrow``, then appends the shard's row, with the file's
CRC-32, to the ``shards`` table; a reader whose bytes do not match it quarantines the shard
(zstd frames carry no checksum: most flipped bits in a token id still parse). On S3 the file is one upload, visible only once complete; on a local folder it is
written to ``shards/tmp/…`` and renamed into place. Readers list shards only through the
table's commit log, so a shard is visible whole or not at all; a file left behind by a
writer that died before its commit is never listed.

The sequence number resumes from the shards committed before, and a flushed shard never
replaces an existing file: it is created exclusively (a conditional PUT on S3, an
``O_EXCL`` placeholder locally). A number whose file exists (a writer that died before its
commit, or a second writer started under the same worker name by mistake) is skipped with
a warning.

:class:`BackgroundShardWriter` commits on a thread of its own, for callers that must not
wait on storage (the event loop that runs the rollouts).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import logging
import os
import posixpath
import re
import time
import uuid
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.config import RunStore, create_on_s3, fsync_path
from storage.schema import (
    PROCESSED_SCHEMA,
    SCHEMA_KEY,
    TRAJECTORY_SCHEMA,
    NewerSchemaError,
    SchemaError,
    cast,
    check_columns,
    newer_record,
    row_name,
    rows_with_errors,
    to_table,
    validate,
)
from storage.status import InUse
from storage.tables import Tables

log = logging.getLogger(__name__)

SHARD_SCHEMAS: dict[str, pa.Schema] = {"raw": TRAJECTORY_SCHEMA, "processed": PROCESSED_SCHEMA}
"""Default record schema of each shard kind."""

COMPRESSION = "zstd"
"""Codec of the Arrow IPC buffers in every shard."""

BATCH_ROWS = 1024
"""Most rows per Arrow record batch inside a shard file."""

SMALL_CHUNK_ROWS = 64
"""Buffered pieces smaller than this on average are merged into one batch (``_merged``)."""

MIN_SWEEP_AGE_S = 3600.0
"""Youngest age (seconds) at which :func:`sweep_uncommitted` may delete an uncommitted
file. A writer's file waits for its ``shards`` commit, one Delta append (retries
included: seconds, a few minutes at worst); a file younger than this may still be
committed, and sweeping it would leave that commit pointing at nothing."""

MAX_RETRY_WAIT_S = 300.0
"""Longest wait (seconds; ``flush_seconds`` when longer) of a :class:`BackgroundShardWriter`
between tries of a commit that keeps failing: each failure doubles the wait, from
``flush_seconds``."""

NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$"
"""What a worker or shard kind name may hold (it names a folder of shards): not starting with
'.', so never ``.`` or ``..`` (``shards/raw/..`` is ``shards/``)."""
_NAME = re.compile(NAME_PATTERN)
_NO_VERSION = 2**32


def _start_sums() -> None:
    """Starts the pool that checksums a shard's bytes while its writer syncs them to disk or
    its reader decodes them. Run again in a forked child: the parent's pool came with it but
    not its threads, so what it was given would never run."""
    global _SUMS
    _SUMS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shard-crc")


_start_sums()
os.register_at_fork(after_in_child=_start_sums)


@dataclass(frozen=True)
class ShardInfo:
    """One committed shard: a row of the ``shards`` table. ``path`` is relative to the run;
    versions are over generated tokens (−1 when the shard has none); ``crc32`` is the CRC-32
    of its file's bytes (None for a shard committed before treadle recorded it)."""

    shard_id: str
    kind: str
    path: str
    worker: str
    seq: int
    num_rows: int
    num_tokens: int
    min_version: int
    max_version: int
    crc32: int | None = None


class RecordsKept(str):
    """The note a write adds to the error of the flush it set off (:meth:`ShardWriter.write_table`):
    its ``records`` were buffered and are kept, a later flush or ``close`` commits them. A
    note, not an error type of its own: the flush's error keeps its type (``InUse``, a
    transient ``OSError``) for the callers that catch it, and the retries that go by it."""

    records: int

    def __new__(cls, records: int) -> RecordsKept:
        what, them = (
            ("the 1 record of this write is", "it")
            if records == 1
            else (f"the {records} records of this write are", "them")
        )
        note = super().__new__(
            cls,
            f"{what} kept by the writer: a later flush or close commits {them} (abandon sets "
            f"{them} aside); do not write {them} again",
        )
        note.records = records
        return note

    def __getnewargs__(self) -> tuple[int]:  # unpickled (an error sent between processes) from its count
        return (self.records,)


def records_kept(error: BaseException) -> int:
    """How many records the write that raised ``error`` kept (its :class:`RecordsKept` note);
    0: it took none."""
    return sum(note.records for note in getattr(error, "__notes__", ()) if isinstance(note, RecordsKept))


class ShardWriter:
    """Buffers trajectory records and commits them as shards of at most a few
    ``flush_records`` rows, or whatever is buffered once ``flush_seconds`` have passed
    since the first buffered record (checked on each write).

    Each ``write``/``write_table`` is converted and cast at once: a record that does not
    fit the schema's types, or a table that lacks a column or names a later version of the
    record (:class:`NewerSchemaError`), raises :class:`SchemaError` at the call that gave
    it. The per-row checks (:func:`~storage.schema.validate`) run once per shard, when it is
    flushed (on the commit thread for :class:`BackgroundShardWriter`):
    run on single records, their tens of compute kernels cost over a millisecond a record,
    and each kernel gives up the GIL, so a thread that wrote records one by one waited on
    every busy thread of the process. A row that fails them is refused together with the
    rest of its group (same ``group_id``): those rows go to
    ``shards/quarantine/<kind>/<worker>/`` with a ``.reason`` file naming each trajectory
    (one whose id is blank by its row in that file) and what is wrong, are logged, counted
    in ``refused``, and never reach the shard; the other rows are committed.

    ``on_commit`` is called with each shard once its commit has landed; an exception it
    raises is logged, never taken for a failed commit. ``before_commit`` is called before
    each shard is written: an exception it raises fails that flush as a store error would
    (nothing written, records kept); a rollout worker refuses that way to commit once its
    name was taken by another worker. The writer reads the ``shards``
    table for its next number when it starts, unless ``numbers_given`` (its caller numbers
    every shard through :meth:`commit`): then at its first flush, if ever.
    """

    def __init__(
        self,
        store: RunStore,
        worker: str,
        kind: str = "raw",
        flush_records: int = 256,
        flush_seconds: float = 30.0,
        schema: pa.Schema | None = None,
        tables: Tables | None = None,
        on_commit: Callable[[ShardInfo], None] | None = None,
        numbers_given: bool = False,
        before_commit: Callable[[], None] | None = None,
    ):
        _check_name("worker", worker)
        _check_kind(kind)
        if flush_records < 1:
            raise ValueError(f"flush_records must be ≥ 1, got {flush_records}")
        if flush_seconds <= 0:
            raise ValueError(f"flush_seconds must be > 0, got {flush_seconds}")
        self.store = store
        self.worker = worker
        self.kind = kind
        self.flush_records = flush_records
        self.flush_seconds = flush_seconds
        self.schema = _schema_for(kind, schema)
        self.tables = tables or Tables(store)
        self.on_commit = on_commit
        self.before_commit = before_commit
        self._buffer: list[pa.Table] = []
        self._buffered_rows = 0
        self._first_buffered_at = 0.0
        self._closed = False
        self._committed = 0
        self.last_seq: int | None = None
        """Sequence number of the last shard this writer committed (None: none yet)."""
        self.refused = 0
        """Rows refused at a flush (see the class docstring)."""
        self._unsure: ShardInfo | None = None
        """A commit whose append raised while the ``shards`` table could not be read: it may
        have landed, so its records are not committed again until the table says."""
        self._unsure_numbered: dict[int, ShardInfo] = {}
        """The same for commits under a given number (:meth:`commit`), by number: a retry
        of one first looks for it."""
        # read now, so that a store that cannot be reached fails the writer's start
        self._seq = None if numbers_given else self._seq_from_table()

    @property
    def next_seq(self) -> int:
        """The number the next flushed shard tries (from the ``shards`` table)."""
        if self._seq is None:
            self._seq = self._seq_from_table()
        return self._seq

    @property
    def committed(self) -> int:
        """Shards this writer has committed."""
        return self._committed

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run: a write then raises, buffering nothing."""
        return self._closed

    def write(self, record: Mapping[str, Any]) -> ShardInfo | None:
        """Buffer one record; returns the shard it completed, if this write flushed one. An
        error means what :meth:`write_table`'s does."""
        return self.write_table(to_table([record], self.schema))

    def write_many(self, records: Sequence[Mapping[str, Any]]) -> ShardInfo | None:
        """Buffer ``records`` together: they land in one shard (a GRPO group must not be
        split, its advantages are taken over the whole group); returns the shard this
        write flushed, if any. An error means what :meth:`write_table`'s does."""
        return self.write_table(to_table(list(records), self.schema))

    def write_table(self, table: pa.Table) -> ShardInfo | None:
        """Buffer every row of ``table`` (never split across shards); returns the shard
        this write flushed, if any.

        What a write raises before its rows are buffered (a closed writer, a
        :class:`SchemaError`) took none of them. Once buffered they are kept, also when the
        flush this write set off raises (as :meth:`flush` keeps them, see there): that error
        carries a :class:`RecordsKept` note saying so (:func:`records_kept` reads it), and the
        caller must not write them again, or they would be committed twice; a later flush or
        ``close`` commits them (``abandon`` sets them aside).
        """
        if self._closed:
            raise RuntimeError(f"ShardWriter for {self.kind}/{self.worker} is closed")
        self._refuse_newer(table)
        table = cast(table, self.schema)
        if table.num_rows == 0:
            return None
        if not self._buffer:
            self._first_buffered_at = time.monotonic()
        self._buffer.append(table)
        self._buffered_rows += table.num_rows
        if self._buffered_rows >= self.flush_records or self._due():
            try:
                return self.flush()
            except Exception as exc:
                exc.add_note(RecordsKept(table.num_rows))
                raise
        return None

    def _refuse_newer(self, table: pa.Table) -> None:
        """Raise :class:`NewerSchemaError` when ``table``'s schema names a later version of
        this writer's record: cast to this treadle's schema, its rows would lose the columns
        added since and be labelled with the old version, for every reader to misread."""
        newer = newer_record(table.schema, self.schema)
        if newer is not None:
            own = self.schema.metadata[SCHEMA_KEY].decode()
            raise NewerSchemaError(
                f"{self.kind} records for {self.worker} are {newer} records, newer than this "
                f"treadle's {own}: upgrade treadle to write them"
            )

    def flush_if_due(self) -> ShardInfo | None:
        """Flush when the oldest buffered record has waited ``flush_seconds``: ``write``
        checks that only when called, so a caller whose writes can pause calls this on a timer."""
        return self.flush() if self._due() else None

    def _due(self) -> bool:
        return bool(self._buffer) and time.monotonic() - self._first_buffered_at >= self.flush_seconds

    def flush(self) -> ShardInfo | None:
        """Write and commit everything buffered as one shard (None when nothing is).

        On failure the buffer is kept and the next flush retries it: under the same number,
        or under the next one when the failed attempt got as far as the ``shards`` commit
        (its file stays). A commit that raised but is found in the ``shards`` table landed
        and counts as committed. When the table cannot be read either, nothing is committed
        again until it can: the next flush first looks for that commit, and raises while it
        still cannot tell (records kept), so no record is committed twice.
        """
        if not self._buffer:
            return None
        table = self._retryable(_merged(self._buffer), self._keep_buffered)
        if table.num_rows == 0:
            self._clear_buffer()
            return None
        info = self._commit_next(table)
        self._clear_buffer()
        self._announce(info)
        return info

    def _retryable(self, table: pa.Table, keep: Callable[[pa.Table], None]) -> pa.Table:
        """``table`` less the rows of an unconfirmed commit that landed and less the rows
        refused. ``keep`` is given what is left after each of the two, so a commit that
        fails retries only those rows: the landed ones are not committed again even when
        refusing raises, and nothing is refused twice."""
        table = self._without_landed(table)
        keep(table)
        table = self._admitted(table)
        keep(table)
        return table

    def _keep_buffered(self, table: pa.Table) -> None:
        self._buffer = [table]
        self._buffered_rows = table.num_rows

    def _admitted(self, table: pa.Table) -> pa.Table:
        """The rows of ``table`` that pass validation; a row that does not is refused with
        the rest of its group (quarantined, logged and counted)."""
        bad = rows_with_errors(table)
        if not bad:
            return table
        group_ids = table.column("group_id")
        groups = {group_ids[row].as_py() for row in bad} - {None}
        refused = np.zeros(table.num_rows, dtype=bool)
        refused[list(bad)] = True
        if groups:
            in_group = pc.is_in(group_ids, value_set=pa.array(sorted(groups), pa.string()))
            refused |= pc.fill_null(in_group, False).to_numpy(zero_copy_only=False)
        ids = table.column("trajectory_id").to_pylist()
        # a row with a blank id is named by its index in the quarantined file
        reasons = [
            f"{row_name(ids[row], position)}: "
            + ("; ".join(bad[row]) if row in bad else "refused with its group")
            for position, row in enumerate(np.flatnonzero(refused))
        ]
        target = self._quarantine(table.filter(pa.array(refused)), reasons, "refused")
        self.refused += len(reasons)
        log.error(
            "refused %d of %d %s records of %s that fail validation (kept in %s): %s",
            len(reasons),
            table.num_rows,
            self.kind,
            self.worker,
            self.store.url(target),
            "; ".join(reasons[:3]) + (f" (and {len(reasons) - 3} more)" if len(reasons) > 3 else ""),
        )
        return table.filter(pa.array(~refused))

    def _quarantine(self, table: pa.Table, reasons: list[str], what: str) -> str:
        """Keep rows no shard will hold (and why, a line per row) under the quarantine prefix,
        in ``<what>-<id>.arrow``; returns the run-relative path."""
        target = quarantine_path(
            posixpath.join("shards", self.kind, self.worker, f"{what}-{uuid.uuid4().hex}.arrow")
        )
        fs = self.store.fs
        if not self.store.config.is_s3:
            os.makedirs(posixpath.dirname(self.store.path(target)), exist_ok=True)
        # the reason first: a failure after the rows' file would have them set aside twice by the retry
        with fs.open(self.store.path(target + ".reason"), "w") as out:
            out.write("".join(f"{reason}\n" for reason in reasons))
        fs.pipe_file(self.store.path(target), _ipc_bytes(table).to_pybytes())
        return target

    def _clear_buffer(self) -> None:
        self._buffer = []
        self._buffered_rows = 0

    def _commit_next(self, table: pa.Table) -> ShardInfo:
        info = self._commit(table, self.next_seq, exclusive=True)
        self._seq = info.seq + 1
        return info

    def _announce(self, info: ShardInfo) -> None:
        if self.on_commit is None:
            return
        try:
            self.on_commit(info)
        except Exception:
            log.exception("on_commit failed for shard %s (the shard is committed)", info.shard_id)

    def commit(self, table: pa.Table, seq: int) -> ShardInfo:
        """Commit ``table`` at once as shard ``seq`` of this writer, even with no rows.

        For producers that derive the sequence number from their input (one processed
        shard per raw shard), so a retried commit lands under the same name; the caller
        must not commit the same ``seq`` twice. A retry of a commit of this writer whose
        landing could not be confirmed (the ``shards`` table unreadable) raises while it
        still cannot be, and commits nothing once the table shows it landed (returning that
        shard). Buffered records are not touched.
        """
        if self._closed:
            raise RuntimeError(f"ShardWriter for {self.kind}/{self.worker} is closed")
        self._refuse_newer(table)
        info = self._landed_before(seq) or self._commit(
            validate(cast(table, self.schema)), seq, exclusive=False
        )
        self._seq = None if self._seq is None else max(self._seq, seq + 1)
        self._announce(info)
        return info

    def _path(self, seq: int) -> str:
        return posixpath.join("shards", self.kind, self.worker, f"{seq:08d}.arrow")

    def _store(self, table: pa.Table, seq: int, exclusive: bool) -> tuple[int, int]:
        """Write ``table`` whole as shard ``seq``'s file; returns the number it landed under
        and the file's CRC-32. ``exclusive``: never over an existing file, skipping to the
        next free number. A write that fails leaves nothing behind, so a retry gets the same
        number."""
        while True:
            path = self.store.path(self._path(seq))
            try:
                if self.store.config.is_s3:
                    return seq, self._upload(path, table, exclusive)
                return seq, self._write_local(path, table, exclusive)
            except FileExistsError:
                if not exclusive:
                    raise
                log.warning(
                    "shard file %s exists: skipping to the next number (left by an attempt whose commit "
                    "failed or by a writer that died, or written by another writer named %r)",
                    self.store.url(self._path(seq)),
                    self.worker,
                )
                seq += 1

    def _upload(self, path: str, table: pa.Table, exclusive: bool) -> int:
        """Returns the CRC-32 of what was uploaded."""
        # built in memory, then one PUT (multipart when large) that is all or nothing, and
        # conditional on absence when exclusive
        payload = _ipc_bytes(table)
        data = payload.to_pybytes()
        create_on_s3(
            path, lambda: self.store.fs.pipe_file(path, data, mode="create" if exclusive else "overwrite")
        )
        return zlib.crc32(payload)

    def _write_local(self, path: str, table: pa.Table, exclusive: bool) -> int:
        """Returns the CRC-32 of what was written."""
        if exclusive:
            self.store.create_exclusive(path, b"claimed by a shard writer\n")
        name = f"{posixpath.basename(path)}-{uuid.uuid4().hex}"
        tmp = self.store.path("shards", "tmp", self.kind, self.worker, name)
        try:
            for folder in {posixpath.dirname(tmp), posixpath.dirname(path)}:
                os.makedirs(folder, exist_ok=True)
            with pa.OSFile(tmp, "wb") as sink:
                _write_ipc(sink, table)
            # summed from the page cache (not from a copy of the whole file in memory) while
            # it goes to disk: before its commit can land, as a power loss must not leave a
            # committed shard empty (it would be quarantined and its rows lost)
            with pa.memory_map(tmp, "rb") as written:
                summed = _SUMS.submit(zlib.crc32, written.read_buffer())
            fsync_path(tmp)
            crc = summed.result()
            os.replace(tmp, path)
            fsync_path(os.path.dirname(path))
            return crc
        except BaseException:
            for leftover in (tmp, path) if exclusive else (tmp,):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)
            raise

    def _commit(self, table: pa.Table, seq: int, exclusive: bool) -> ShardInfo:
        if self.before_commit is not None:
            self.before_commit()
        seq, crc = self._store(table, seq, exclusive)
        path = self._path(seq)
        info = ShardInfo(
            shard_id=f"{self.kind}/{self.worker}/{seq:08d}",
            kind=self.kind,
            path=path,
            worker=self.worker,
            seq=seq,
            num_rows=table.num_rows,
            **_token_stats(table),
            crc32=crc,
        )
        try:
            self.tables.append("shards", [asdict(info) | {"committed_at": datetime.now(UTC)}])
        except Exception as exc:
            landed = self._landed(info)
            if landed is None and exclusive:
                self._unsure = info
            elif landed is None:
                self._unsure_numbered[seq] = info
            if not landed:
                raise
            log.warning(
                "the commit of shard %s failed (%r) but landed: counted as committed", info.shard_id, exc
            )
        self._committed += 1
        self.last_seq = seq
        return info

    def _landed(self, info: ShardInfo) -> bool | None:
        """Whether ``info``'s row is in the ``shards`` table (an append can land and still
        fail, its reply lost); None when the table cannot be read either."""
        try:
            shards = self.tables.read("shards")
        except Exception as exc:
            log.warning("cannot tell whether shard %s was committed: %s", info.shard_id, exc)
            return None
        return info.shard_id in set(shards.column("shard_id").to_pylist())

    def _landed_before(self, seq: int) -> ShardInfo | None:
        """Shard ``seq`` when an earlier :meth:`commit` of it could not be confirmed and did
        land (counted as committed now); None when there was no such commit or it did not
        land. Raises while the ``shards`` table still cannot say."""
        info = self._unsure_numbered.get(seq)
        if info is None:
            return None
        landed = self._landed(info)
        if landed is None:
            raise OSError(
                f"cannot tell whether shard {info.shard_id} was committed (the shards table cannot be "
                "read); it is not committed again until it can"
            )
        del self._unsure_numbered[seq]
        if not landed:
            return None
        log.warning(
            "shard %s, whose commit could not be confirmed, did land: counted as committed", info.shard_id
        )
        self._committed += 1
        self.last_seq = seq
        return info

    def _without_landed(self, table: pa.Table) -> pa.Table:
        """``table`` less the rows of a commit that could not be confirmed and did land.

        Those rows head ``table``: a failed commit's rows are retried first. Raises while
        the ``shards`` table still cannot say, so they are not committed a second time.
        """
        info = self._unsure
        if info is None:
            return table
        landed = self._landed(info)
        if landed is None:
            raise OSError(
                f"cannot tell whether shard {info.shard_id} was committed (the shards table cannot be "
                f"read); its {info.num_rows} records are kept and not committed again until it can"
            )
        self._unsure = None
        if not landed:
            return table
        log.warning(
            "shard %s, whose commit could not be confirmed, did land: counted as committed", info.shard_id
        )
        self._committed += 1
        self.last_seq = info.seq
        self._seq = None if self._seq is None else max(self._seq, info.seq + 1)
        self._announce(info)
        return table.slice(info.num_rows)

    def close(self) -> ShardInfo | None:
        """Flush what is buffered and refuse further writes."""
        info = self.flush()
        self._closed = True
        return info

    def abandon(self, why: str, left_out: Collection[str] = ()) -> tuple[str, int] | None:
        """Close without committing anything more, for a writer that may not (another worker
        took its name): the records it has not committed are kept under the quarantine prefix,
        ``shards/quarantine/<kind>/<worker>/uncommitted-<id>.arrow``, each named with ``why`` in
        the ``.reason`` file beside it, but for those whose ``trajectory_id`` is in ``left_out``
        (their writer was told they were not written: it sends them again). Returns that file's
        run-relative path and its number of records (None: none is left). Raises when the store
        takes no file (records kept, a later call tries again)."""
        table = _merged(self._buffer) if self._buffer else None
        if table is not None and self._unsure is not None:
            try:
                table = self._without_landed(table)
                self._keep_buffered(table)  # a call made again sets none of the landed rows aside
            except OSError as exc:
                why += f"; the first {self._unsure.num_rows} may be in shard {self._unsure.shard_id} ({exc})"
        if table is not None and left_out:
            told = pc.is_in(table.column("trajectory_id"), value_set=pa.array(sorted(left_out), pa.string()))
            table = table.filter(pc.invert(pc.fill_null(told, False)))
        kept = None
        if table is not None and table.num_rows:
            ids = table.column("trajectory_id").to_pylist()
            reasons = [f"{row_name(tid, i)}: {why}" for i, tid in enumerate(ids)]
            kept = self._quarantine(table, reasons, "uncommitted"), table.num_rows
        self._clear_buffer()
        self._closed = True
        return kept

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _seq_from_table(self) -> int:
        shards = self.tables.read("shards")
        mine = shards.filter(
            pc.and_(
                pc.equal(shards.column("kind"), self.kind), pc.equal(shards.column("worker"), self.worker)
            )
        )
        return 0 if mine.num_rows == 0 else int(pc.max(mine.column("seq")).as_py()) + 1


class BackgroundShardWriter(ShardWriter):
    """A :class:`ShardWriter` whose shards are written and committed on a thread of its own,
    so that the caller (the event loop that runs the rollouts) does not wait on storage.

    ``flush`` hands the buffer to that thread and returns None (``on_commit`` hears of each
    shard there, in the caller's context); it waits only while the previous flush's commit
    still runs, so at most one shard is in flight. A commit that fails is logged and its
    records go into the next flush's shard (due ``flush_seconds`` after they were handed
    over, even when no record is written after them), so a store that is unreachable for a while
    loses nothing. Once more than ``max_unsaved_records`` records (8 x ``flush_records`` unless
    given) would wait that way, ``flush`` commits in the caller's thread instead and raises as
    :class:`ShardWriter` does, records kept. ``close`` commits what is left and waits for it.

    A failed commit is due again (``flush_if_due``) later and later while commits keep
    failing: each failure doubles the wait, from ``flush_seconds`` up to
    :data:`MAX_RETRY_WAIT_S`. A caller that calls ``flush_if_due`` on a timer thus does not
    run, past ``max_unsaved_records``, a commit in its thread at every tick of an outage.
    """

    def __init__(self, *args: Any, max_unsaved_records: int | None = None, **kwargs: Any):
        if max_unsaved_records is not None and max_unsaved_records < 0:
            raise ValueError(f"max_unsaved_records must be >= 0, got {max_unsaved_records}")
        super().__init__(*args, **kwargs)
        self.max_unsaved_records = (
            8 * self.flush_records if max_unsaved_records is None else max_unsaved_records
        )
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shards-{self.worker}")
        self._in_flight: Future[None] | None = None
        self._unsaved: pa.Table | None = None
        """Records handed over whose commit has not landed: in flight, or failed."""
        self._failures = 0
        """Commits failed in a row (set on the thread that ran them)."""
        self._retry_at = 0.0
        """When (``time.monotonic``) a failed commit is tried again."""

    @property
    def unsaved_records(self) -> int:
        """Records handed to a commit that is still running or failed."""
        return 0 if self._unsaved is None else self._unsaved.num_rows

    def flush(self) -> None:
        self._settle()
        retrying = self._unsaved is not None
        if not self._buffer and not retrying:
            return None
        self._unsaved = _merged(([self._unsaved] if retrying else []) + self._buffer)
        self._clear_buffer()
        if retrying and self.unsaved_records > self.max_unsaved_records:
            self._commit_unsaved(self._unsaved)
            return None
        self._in_flight = self._committer.submit(
            contextvars.copy_context().run, self._commit_unsaved, self._unsaved
        )
        return None

    def _due(self) -> bool:
        """Also due when a failed commit's wait before its next try is over: with no record
        written after them its records would wait for ``close``."""
        if super()._due():
            return True
        failed = self._unsaved is not None and (self._in_flight is None or self._in_flight.done())
        return failed and time.monotonic() >= self._retry_at

    def commit(self, table: pa.Table, seq: int) -> ShardInfo:
        self._settle()
        return super().commit(table, seq)

    def close(self) -> None:
        """Commit what is buffered and wait for it; raises when that fails (records kept,
        a later ``close`` tries again)."""
        if self._closed:
            return None
        self.flush()
        self._settle()
        if self._unsaved is not None:
            self._commit_unsaved(self._unsaved)
        self._committer.shutdown()
        self._closed = True
        return None

    def abandon(self, why: str, left_out: Collection[str] = ()) -> tuple[str, int] | None:
        """:meth:`ShardWriter.abandon`, once the commit in flight has ended: the records of
        one that failed are kept with those buffered."""
        with contextlib.suppress(InUse):
            self._settle()
        if self._unsaved is not None:
            self._buffer.insert(0, self._unsaved)
            self._unsaved = None
        target = super().abandon(why, left_out)
        self._committer.shutdown()
        return target

    def _commit_unsaved(self, table: pa.Table) -> None:
        """Commit ``table``, the unsaved records; they stay unsaved (what is left to retry of
        them) unless it lands, and are no longer counted so once it has, before ``on_commit``
        hears of it. A failure sets when the next try is due (:data:`MAX_RETRY_WAIT_S`)."""
        try:
            table = self._retryable(table, self._keep_unsaved)
            info = self._commit_next(table) if table.num_rows else None
        except Exception:
            self._failures += 1
            self._retry_at = time.monotonic() + _retry_wait(self._failures, self.flush_seconds)
            raise
        self._failures = 0
        self._unsaved = None
        if info is not None:
            self._announce(info)

    def _keep_unsaved(self, table: pa.Table) -> None:
        self._unsaved = table

    def _settle(self) -> None:
        """Wait for the commit in flight; its records stay unsaved if it failed. A commit its
        ``before_commit`` refused with :class:`~storage.status.InUse` is raised here (at the
        next ``flush`` or ``close``): retrying it under the same name would be refused too."""
        if self._in_flight is None:
            return
        future, self._in_flight = self._in_flight, None
        try:
            future.result()
        except InUse:  # the name was taken: no later shard will hold them either
            raise
        except Exception as exc:
            log.warning(
                "commit of %d records to a %s shard of %s failed; they go into the next shard: %s",
                self.unsaved_records,
                self.kind,
                self.worker,
                exc,
            )


class ShardReader:
    """Lists committed shards of one kind through the Delta commit log and reads them
    validated; a shard whose bytes are corrupt or invalid is quarantined, not raised."""

    def __init__(
        self,
        store: RunStore,
        kind: str = "raw",
        schema: pa.Schema | None = None,
        tables: Tables | None = None,
    ):
        _check_kind(kind)
        self.store = store
        self.kind = kind
        self.schema = _schema_for(kind, schema)
        self.tables = tables or Tables(store)

    def poll(self, after: int = -1, identity: str | None = None) -> tuple[list[ShardInfo], int]:
        """Shards of this kind committed in Delta log versions > ``after``, in commit
        order (from the start, whose rows share one version: by number, which keeps each
        worker's shards in the order they were committed, whatever the writers' clocks), and
        the offset to pass next time. ``identity``: the ``shards`` table's that ``after`` was
        taken in (see :meth:`Tables.changes`)."""
        rows, latest = self.tables.changes("shards", after, identity)
        rows = rows.filter(pc.equal(rows.column("kind"), self.kind))
        rows = rows.sort_by([("_commit_version", "ascending"), ("seq", "ascending")])
        fields = ShardInfo.__dataclass_fields__
        shards = [ShardInfo(**{k: v for k, v in row.items() if k in fields}) for row in rows.to_pylist()]
        return shards, latest

    def read(self, shard: ShardInfo) -> pa.Table | None:
        """The shard's records, validated; None (and the shard quarantined with a
        ``.reason`` file, and a warning logged) when it is missing, corrupt or invalid, or
        its bytes are not those its commit checksummed (a flipped bit in a token id still
        parses). A shard that cannot be moved to quarantine (the store refuses the move) is
        left in place and logged as an error, and each later read skips it the same way.

        Only what the bytes hold quarantines a shard: an error while fetching them (a
        timeout, a dropped connection) is raised, and the shard stays for the next read. A
        shard written before the canonical schema gained a nullable column reads it as null;
        one whose schema names a later record version raises :class:`NewerSchemaError`, and
        one of another kind than this reader's ``ValueError`` (read against the wrong schema,
        a good shard would be quarantined).
        """
        if shard.kind != self.kind:
            raise ValueError(f"shard {shard.shard_id} is a {shard.kind} shard, not a {self.kind} one")
        try:
            source = _open_ipc(self.store, shard.path)
        except FileNotFoundError:
            if self.quarantined(shard):
                log.warning("shard %s was quarantined before; skipping it", shard.shard_id)
            else:
                log.warning("shard %s is committed but its file %s is missing", shard.shard_id, shard.path)
            return None
        with source:
            whole = source.read_buffer()
        # summed on another thread while this one decodes (zlib lets go of the GIL)
        summed = None if shard.crc32 is None else _SUMS.submit(zlib.crc32, whole)
        try:
            table = pa.ipc.open_file(whole).read_all()
            # offsets and lengths checked against the buffers (microseconds: no values are
            # scanned), so corrupt bytes stop here rather than in a compute kernel
            table.validate(full=True)
        except (pa.ArrowException, ValueError, OSError, EOFError) as exc:
            # ArrowMemoryError: a corrupt length asks for an absurd allocation; ValueError:
            # a corrupt name or metadata string that is not UTF-8
            table = None
            error = f"cannot read the Arrow IPC file: {exc}"
        changed = _changed(summed and summed.result(), shard.crc32)
        if changed or table is None:
            self._quarantine(shard, changed or error)
            return None
        newer = newer_record(table.schema, self.schema)
        if newer is not None:
            own = self.schema.metadata[SCHEMA_KEY].decode()
            raise NewerSchemaError(
                f"shard {shard.shard_id} holds {newer} records, newer than this treadle's {own}: "
                "upgrade treadle to read it (the shard is left in place)"
            )
        try:
            if not table.schema.equals(self.schema, check_metadata=False):
                table = self._conformed(table)
            if table.num_rows != shard.num_rows:
                raise SchemaError(f"holds {table.num_rows} rows but its commit says {shard.num_rows}")
            return validate(table)
        except SchemaError as exc:
            self._quarantine(shard, str(exc))
            return None

    def _conformed(self, table: pa.Table) -> pa.Table:
        """``table`` in this reader's schema when a shard written before a change to the
        canonical schema differs only by it: columns added since (nullable) read as null,
        and columns that may be null now were required then. Raises :class:`SchemaError`
        naming every other difference."""
        names = table.schema.names
        if len(set(names)) == len(names) and [n for n in self.schema.names if n in names] == names:
            missing = [field for field in self.schema if field.name not in names]
            fields = [(table.schema.field(name), self.schema.field(name)) for name in names]
            if all(f.nullable for f in missing) and all(
                old.type == new.type and (new.nullable or not old.nullable) for old, new in fields
            ):
                columns = [
                    table.column(field.name) if field.name in names else pa.nulls(table.num_rows, field.type)
                    for field in self.schema
                ]
                return pa.Table.from_arrays(columns, schema=self.schema)
        raise SchemaError(
            f"schema differs from the canonical {self.kind} schema: {_schema_diff(table.schema, self.schema)}"
        )

    def quarantined(self, shard: ShardInfo) -> bool:
        """Whether ``shard`` was moved to quarantine (its ``.reason`` file, beside it, says why)."""
        return self.store.fs.exists(self.store.path(quarantine_path(shard.path)))

    def unread_reason(self, shard: ShardInfo) -> str:
        """Why :meth:`read` returned None for ``shard``: ``quarantined``, ``bad, left in place``
        (its move to quarantine failed) or ``file missing``."""
        if self.quarantined(shard):
            return "quarantined"
        if self.store.fs.exists(self.store.path(shard.path)):
            return "bad, left in place"
        return "file missing"

    def _quarantine(self, shard: ShardInfo, reason: str) -> None:
        target = quarantine_path(shard.path)
        fs = self.store.fs
        try:
            fs.mv(self.store.path(shard.path), self.store.path(target))
        except FileNotFoundError:
            log.warning(
                "shard %s (%s) was moved to quarantine by another reader meanwhile", shard.shard_id, reason
            )
            return
        except Exception as exc:
            # the bytes are bad whatever the store says: skipped, as every later read skips it
            log.error(
                "shard %s is skipped, and left at %s: it could not be moved to quarantine (%r): %s",
                shard.shard_id,
                shard.path,
                exc,
                reason,
            )
            return
        try:
            with fs.open(self.store.path(target + ".reason"), "w") as out:
                out.write(f"shard {shard.shard_id}: {reason}\n")
        except OSError as exc:
            # the shard is moved already: the log keeps the reason
            reason += f" (its .reason file could not be written: {exc})"
        log.warning("quarantined shard %s to %s: %s", shard.shard_id, target, reason)


def sweep_uncommitted(store: RunStore, older_than_s: float, tables: Tables | None = None) -> list[str]:
    """Delete the files under ``shards/`` that no ``shards`` commit lists and that are older
    than ``older_than_s``: temp files and placeholders of writers that died, and shards whose
    commit never landed. Quarantined shards stay, and so does every file but the temp ones
    when the run has no ``shards`` table (then nothing says which were committed); a
    ``shards`` table that cannot be read, or has an empty commit file (see
    :meth:`Tables.check_log`), raises before anything is deleted. Returns the removed paths
    (run-relative).

    The files are listed before the commits are read, so a shard committed meanwhile counts
    as committed; ``older_than_s`` must exceed the time a writer takes from its file to its
    commit (seconds), or an in-flight shard could go: below :data:`MIN_SWEEP_AGE_S` it
    raises ``ValueError``. Two sweeps may run at once: neither fails on a file the other
    removed first (on S3, where deleting a missing key succeeds, both may list it).
    """
    if older_than_s < MIN_SWEEP_AGE_S:
        raise ValueError(
            f"older_than_s must be >= {MIN_SWEEP_AGE_S:.0f} s (a younger file may belong to a "
            f"writer whose commit has not landed yet), got {older_than_s}"
        )
    root = store.path("shards")
    try:
        found = store.fs.find(root, detail=True)
    except FileNotFoundError:
        return []
    found = {
        posixpath.join("shards", posixpath.relpath(path, root)): (path, info) for path, info in found.items()
    }
    tables = tables or Tables(store)
    if tables.version("shards") is None:
        # no commit log to say which shard files were committed (the table lost, or a wrong
        # root): only temp files are sure to be left over, never a shard's own file
        keep = {relative for relative in found if not relative.startswith("shards/tmp/")}
        if keep:
            log.warning(
                "the run at %s has no shards table, so nothing says which of its %d shard files were "
                "committed: they are kept, and only temp files are swept",
                store.uri,
                len(keep),
            )
    else:
        # the shard files of an empty commit would read as never committed
        tables.check_log("shards")
        keep = set(tables.read("shards").column("path").to_pylist())
    now = time.time()
    removed = []
    for relative, (path, info) in found.items():
        if relative.startswith("shards/quarantine/") or relative in keep:
            continue
        if now - _modified(info) > older_than_s:
            try:
                store.fs.rm_file(path)
            except FileNotFoundError:
                continue  # a sweep running beside this one removed it first
            removed.append(relative)
    return sorted(removed)


def abort_stale_uploads(store: RunStore, older_than_s: float) -> list[str]:
    """Abort the incomplete multipart uploads under the run's prefix started more than
    ``older_than_s`` ago; returns their run-relative keys. Nothing to do on a local folder.

    s3fs sends a file of twice its 50 MiB part size or more in parts (a shard of long
    trajectories; weight files, whatever their writer): a writer killed before completing
    one (SIGKILL, out of memory) leaves its parts stored, and billed, but in no listing of
    objects, until the upload is aborted. As for :func:`sweep_uncommitted`, an age below
    :data:`MIN_SWEEP_AGE_S` raises ``ValueError`` (a younger upload may be a live writer's);
    an upload that ended meanwhile (completed, or aborted by another sweep) is passed over.
    A store that refuses the listing (credentials without the permission, a store without
    multipart uploads) is logged and aborts nothing: the rest of a maintenance still runs.
    """
    if older_than_s < MIN_SWEEP_AGE_S:
        raise ValueError(
            f"older_than_s must be >= {MIN_SWEEP_AGE_S:.0f} s (a younger upload may belong to a "
            f"writer still sending it), got {older_than_s}"
        )
    if not store.config.is_s3:
        return []
    bucket, prefix, _ = store.fs.split_path(store.path())
    prefix += "/"  # not the uploads of a run whose id starts with this one's
    cutoff = time.time() - older_than_s
    aborted = []
    markers: dict[str, str] = {}
    while True:
        try:
            page = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
        except OSError as exc:
            if not isinstance(exc, PermissionError) and exc.errno != errno.ENOSYS:
                raise
            log.warning("cannot list the incomplete uploads of %s, none aborted: %s", store.uri, exc)
            break
        for upload in page.get("Uploads", []):
            if upload["Initiated"].timestamp() > cutoff:
                continue
            try:
                store.fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
            except FileNotFoundError:
                continue
            aborted.append(upload["Key"].removeprefix(prefix))
        if not page.get("IsTruncated"):
            break
        markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
    if aborted:
        log.warning("aborted %d incomplete uploads of %s: %s", len(aborted), store.uri, ", ".join(aborted))
    return sorted(aborted)


def _modified(info: Mapping[str, Any]) -> float:
    """Epoch seconds of a file's last change, from an fsspec listing (local or S3)."""
    if "mtime" in info:
        return float(info["mtime"])
    return info["LastModified"].timestamp()


def quarantine_path(path: str) -> str:
    """Where a bad shard at ``path`` (``shards/<kind>/…``) is moved: ``shards/quarantine/<kind>/…``."""
    return posixpath.join("shards", "quarantine", posixpath.relpath(path, "shards"))


def _retry_wait(failures: int, flush_seconds: float) -> float:
    """Seconds before the next try of a commit after ``failures`` failed in a row: doubled at
    each, from ``flush_seconds`` up to :data:`MAX_RETRY_WAIT_S` (or ``flush_seconds``)."""
    return min(flush_seconds * 2.0 ** min(failures - 1, 32), max(MAX_RETRY_WAIT_S, flush_seconds))


def _merged(pieces: list[pa.Table]) -> pa.Table:
    """Buffered pieces as one table; many small ones (e.g. single records) become one
    batch, larger ones stay as they came (compressing them is faster than one huge batch)."""
    table = pa.concat_tables(pieces)
    if table.num_rows < SMALL_CHUNK_ROWS * len(pieces):
        table = table.combine_chunks()
    return table


def _write_ipc(sink: Any, table: pa.Table) -> None:
    options = pa.ipc.IpcWriteOptions(compression=COMPRESSION)
    with pa.ipc.new_file(sink, table.schema, options=options) as out:
        out.write_table(table, max_chunksize=BATCH_ROWS)


def _ipc_bytes(table: pa.Table) -> pa.Buffer:
    """``table`` as the bytes of a shard file."""
    sink = pa.BufferOutputStream()
    _write_ipc(sink, table)
    return sink.getvalue()


def _open_ipc(store: RunStore, path: str) -> pa.NativeFile:
    """The bytes of the shard file at ``path``, as a file to parse; errors here are the
    store's (missing file, timeout), not the shard's."""
    if store.config.is_s3:
        try:
            with store.fs.open(store.path(path), "rb") as source:
                return pa.BufferReader(source.read())
        except aiohttp.ClientError as exc:
            # a body cut short (ClientPayloadError) is no OSError: raised as the I/O error it is
            raise ConnectionError(f"reading shard file {path}: {exc}") from exc
    # Mapped rather than read: the IPC reader then decompresses straight from the page
    # cache instead of from a heap copy of every compressed buffer.
    return pa.memory_map(store.path(path), "rb")


def _changed(actual: int | None, crc32: int | None) -> str | None:
    """Why a shard whose bytes sum to ``actual`` is not the one committed with ``crc32``, or
    None when it is, or when there is nothing to check (a shard committed before it was
    recorded)."""
    if crc32 is None or actual == crc32:
        return None
    return f"its bytes changed since its commit (CRC-32 {actual:08x}, its commit says {crc32:08x})"


def _token_stats(table: pa.Table) -> dict[str, int]:
    """``num_tokens`` and the range of versions over generated tokens (−1 when none),
    worked out chunk by chunk without copying the lists."""
    num_tokens, lowest, highest = 0, _NO_VERSION, -1
    for chunk in table.column("versions").chunks:
        versions = chunk.flatten()
        versions = pc.fill_null(versions, -1).to_numpy() if versions.null_count else versions.to_numpy()
        num_tokens += len(versions)
        if len(versions):
            # Seen as unsigned, the −1 of non-generated tokens sorts after every version.
            lowest = min(lowest, int(versions.view(np.uint32).min()))
            highest = max(highest, int(versions.max()))
    if highest < 0:
        return {"num_tokens": num_tokens, "min_version": -1, "max_version": -1}
    return {"num_tokens": num_tokens, "min_version": lowest, "max_version": highest}


def _schema_for(kind: str, schema: pa.Schema | None) -> pa.Schema:
    """``schema``, checked to be a canonical record schema, or ``kind``'s default."""
    if schema is not None:
        check_columns(schema)
        return schema
    if kind not in SHARD_SCHEMAS:
        raise ValueError(
            f"shard kind {kind!r} has no default schema; pass schema= (known: {sorted(SHARD_SCHEMAS)})"
        )
    return SHARD_SCHEMAS[kind]


def _schema_diff(actual: pa.Schema, expected: pa.Schema) -> str:
    missing = [n for n in expected.names if n not in actual.names]
    extra = [n for n in actual.names if n not in expected.names]
    repeated = sorted({n for n in actual.names if actual.names.count(n) > 1})
    changed = [
        f"{f.name}: {actual.field(f.name).type} (nullable={actual.field(f.name).nullable}) "
        f"instead of {f.type} (nullable={f.nullable})"
        for f in expected
        if actual.names.count(f.name) == 1 and not actual.field(f.name).equals(f)
    ]
    parts = (
        [f"missing {missing}"] * bool(missing)
        + [f"unexpected {extra}"] * bool(extra)
        + [f"repeated {repeated}"] * bool(repeated)
        + changed
    )
    return "; ".join(parts) or "column order differs"


RESERVED_KINDS = ("tmp", "quarantine")
"""Folders under ``shards/`` that are no kind's: writers' temp files and the quarantine."""


def _check_kind(kind: str) -> None:
    _check_name("kind", kind)
    if kind in RESERVED_KINDS:
        raise ValueError(
            f"kind {kind!r} names the folder of shards/ that holds "
            f"{'temp files' if kind == 'tmp' else 'quarantined shards'}; choose another name"
        )


def _check_name(what: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(
            f"{what} must be a non-empty name of letters, digits, '_', '.', '-', not starting with '.'; "
            f"got {value!r}"
        )
