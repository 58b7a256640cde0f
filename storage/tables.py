"""The Delta tables of a run (README.md, Storage): one canonical schema each.

Every write is cast to the table's schema first. Appends are safe with several writers
at once: on S3 each commit is a conditional put (see ``StorageConfig.delta_options``),
deltalake rebases an append onto commits that landed meanwhile, and a commit that still
conflicts (e.g. two writers creating the table at once) is retried here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import posixpath
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from storage.config import RunStore
from storage.leases import SlotLease
from storage.schema import BEYOND_FLOAT32, SchemaError, beyond_float32, widened

log = logging.getLogger(__name__)

UTC_MICROS = pa.timestamp("us", tz="UTC")

TABLE_SCHEMAS: dict[str, pa.Schema] = {
    "shards": pa.schema(
        [
            pa.field("shard_id", pa.string(), nullable=False),
            pa.field("kind", pa.string(), nullable=False),
            pa.field("path", pa.string(), nullable=False),
            pa.field("worker", pa.string(), nullable=False),
            pa.field("seq", pa.int64(), nullable=False),
            pa.field("num_rows", pa.int64(), nullable=False),
            pa.field("num_tokens", pa.int64(), nullable=False),
            pa.field("min_version", pa.int32(), nullable=False),
            pa.field("max_version", pa.int32(), nullable=False),
            pa.field("committed_at", UTC_MICROS, nullable=False),
            pa.field("crc32", pa.int64()),
        ]
    ),
    "trajectories": pa.schema(
        [
            pa.field("trajectory_id", pa.string(), nullable=False),
            pa.field("execution_id", pa.string(), nullable=False),
            pa.field("parent_id", pa.string()),
            pa.field("task", pa.string(), nullable=False),
            pa.field("prompt_id", pa.string(), nullable=False),
            pa.field("group_id", pa.string()),
            pa.field("shard_id", pa.string(), nullable=False),
            pa.field("reward", pa.float32()),
            pa.field("progress", pa.float32()),
            pa.field("status", pa.string(), nullable=False),
            pa.field("num_tokens", pa.int32(), nullable=False),
            pa.field("num_action_tokens", pa.int32(), nullable=False),
            pa.field("num_train_tokens", pa.int32(), nullable=False),
            pa.field("num_turns", pa.int16(), nullable=False),
            pa.field("min_version", pa.int32(), nullable=False),
            pa.field("max_version", pa.int32(), nullable=False),
            pa.field("selected", pa.bool_(), nullable=False),
            pa.field("drop_reason", pa.string()),
            pa.field("text", pa.string()),
            pa.field("engine", pa.string()),
            pa.field("processed_at", UTC_MICROS, nullable=False),
            pa.field("error", pa.string()),
        ]
    ),
    "train_steps": pa.schema(
        [
            pa.field("step", pa.int64(), nullable=False),
            pa.field("version", pa.int32(), nullable=False),
            pa.field("policy_loss", pa.float32(), nullable=False),
            pa.field("value_loss", pa.float32()),
            pa.field("masked_fraction", pa.float32(), nullable=False),
            pa.field("mean_ratio", pa.float32(), nullable=False),
            pa.field("kl", pa.float32(), nullable=False),
            pa.field("staleness_mean", pa.float32(), nullable=False),
            pa.field("staleness_max", pa.int32(), nullable=False),
            pa.field("num_samples", pa.int32(), nullable=False),
            pa.field("num_tokens", pa.int64(), nullable=False),
            pa.field("tokens_per_s", pa.float32(), nullable=False),
            pa.field("reward_mean", pa.float32(), nullable=False),
            pa.field("dropped_stale", pa.int32(), nullable=False),
            pa.field("step_seconds", pa.float32(), nullable=False),
            pa.field("time", UTC_MICROS, nullable=False),
            pa.field("extra", pa.string()),
            pa.field("trajectory_ids", pa.list_(pa.string())),
        ]
    ),
    "weights": pa.schema(
        [
            pa.field("version", pa.int32(), nullable=False),
            pa.field("step", pa.int64(), nullable=False),
            pa.field("parent", pa.int32()),
            pa.field("path", pa.string(), nullable=False),
            pa.field("num_consumed_shards", pa.int32(), nullable=False),
            pa.field("created_at", UTC_MICROS, nullable=False),
            pa.field("tag", pa.string()),
            pa.field("dropped_stale", pa.int32()),
            pa.field("rejected_rows", pa.int32()),
        ]
    ),
    "evals": pa.schema(
        [
            pa.field("version", pa.int32(), nullable=False),
            pa.field("env", pa.string(), nullable=False),
            pa.field("reward", pa.float32(), nullable=False),
            pa.field("count", pa.int32(), nullable=False),
            pa.field("time", UTC_MICROS, nullable=False),
            pa.field("tasks", pa.int32()),
            pa.field("setup", pa.string()),
        ]
    ),
}
"""Canonical schema of each Delta table; a field marked not-nullable must be given.
``trajectories.error`` is the record's (``storage.schema``): why the rollout failed or was
truncated, null for one that did not and in rows written before it was added.
``train_steps.value_loss`` is null for a step that took no critic step (GRPO mode has no
critic): a NaN there made every ``AVG(value_loss)`` NaN. ``train_steps.trajectory_ids`` are
the trajectories the step trained on, the ``trajectory_id`` of their ``trajectories`` rows
(null in rows written before it was added). ``evals.count`` is the rollouts
measured, ``evals.tasks`` the tasks evaluated, those that failed outside the policy included
(null in rows written before it was added); ``evals.setup`` a fingerprint of what the
measurement depended on besides the weights (the eval settings and tasks, the env's config, the
rollout limits; null in rows written before it was added). ``shards.crc32`` is the CRC-32 of the shard's
file as written, which its readers check (null in rows written before it was added: those
shards are read unchecked). ``weights.dropped_stale`` and
``weights.rejected_rows`` are the trajectories the trainer dropped as stale and the rows it
rejected since the version's parent, as its manifest lists them (rejections after a run's
last step reach no ``train_steps`` row); null for a version no trainer published (a base
version) and in rows written before they were added."""

TABLE_CONFIGURATION = {"delta.enableChangeDataFeed": "true"}
"""Set when a table is created (ignored by later appends): the change feed is how
:meth:`Tables.changes` reads what each commit appended, from version 0 on."""

COMMIT_ATTEMPTS = 8
"""Appends that still fail with a commit conflict after deltalake's own retries are
retried this many times in all."""

SNAPSHOT_APPENDS = 100
"""Appends one loaded snapshot of a table serves before it is loaded again. A snapshot
carried from commit to commit keeps every commit since its load and goes over them all on
each append (measured: 15 ms per append after 100 appends, 75 ms after 600), while a fresh
load starts from the last checkpoint (deltalake writes one every 100 commits)."""

CDF_COMMITS = 8
"""Commits one change-feed read (``load_cdf``) spans at most. deltalake (1.6.6) reads the
commit files of the range one after another with the GIL held, so every other thread of the
process (a rollout worker's event loop, heartbeats) stalls for about one S3 round trip per
commit: a reviewer measured a 6.7 s stall for a read of 20 commits at 0.3 s a request, 3.5 s
for reads of 8. Reads of at most this many commits let the other threads run in between."""

COMPACT_FILES = 256
"""Small data files (under ``SMALL_FILE_BYTES``) at which an append compacts its table. Each
append adds one, and reads and snapshot loads slow down with their number (a reviewer
measured 52 ms to read ``shards`` whole at 100 files, 2 s at 3,000; 15 ms again once
compacted)."""

SMALL_FILE_BYTES = 32 * 2**20
"""Data files under this size count toward ``COMPACT_FILES``: a compaction writes files of
about 100 MB (deltalake's target), so a table that grew past hundreds of those is not
compacted again on every append."""

COMPACTION_SLOT_S = 300
"""Slot of the lease (``storage.leases.SlotLease`` in ``status/compaction/<table>/``) a
compaction holds while it runs: deltalake (1.6) lets two compactions of the same files both
commit, each having rewritten them, and the table then holds their rows twice. A process
that finds the lease held skips its compaction."""

COMPACTION_PREFIX = "status/compaction"


ANSI_CODES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
"""Terminal escape sequences (CSI): the colours deltalake writes into its errors' chains of causes."""


class StaleOffsetError(ValueError):
    """An offset given to :meth:`Tables.changes` that the table's log never reached (the
    table was recreated, or the offset was kept from another run's), or one older than a
    vacuum's retention, whose later commits' data files the vacuum removed."""


MISSING_FILE = re.compile(r"Object at location (\S+) not found")
"""What deltalake's error says of a data file the store does not have, local or on S3."""


def without_ansi_codes(text: str) -> str:
    """``text`` without terminal escape sequences, for a log or an error message."""
    return ANSI_CODES.sub("", text)


def _credentials_masked(method: Callable) -> Callable:
    """``method`` of :class:`Tables`, its storage errors raised with the credentials masked
    (``StorageConfig.redacted``): deltalake quotes a failed request's body, in which AWS echoes
    the key id and the session token, and a flow's error goes to the Prefect API's logs; and
    without deltalake's colour codes, which a retried task's log showed raw."""

    @functools.wraps(method)
    def masked(self: Tables, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (DeltaError, OSError) as exc:
            message = self.store.config.redacted(without_ansi_codes(str(exc)))
            if message == str(exc):
                raise
            raise type(exc)(message) from None

    return masked


class Tables:
    """The Delta tables of one run, under ``<run>/tables/<name>``."""

    def __init__(self, store: RunStore):
        self.store = store
        self._options = store.config.delta_options()
        self._for_append: dict[str, tuple[DeltaTable, int]] = {}
        """Per table, the snapshot the last append left and how many appends it has served."""
        self._writer = secrets.token_hex(8)

    def _writer_id(self) -> str:
        """The ``txn`` app id of this object's appends on the calling thread. Not one per
        append, so that a table's log holds one entry per writer; not one per process, so
        that two writers (two objects, or one on two threads) never conflict with each
        other's commits: their appends rebase onto them, as without it."""
        return f"treadle-append/{self._writer}/{threading.get_ident()}"

    def uri(self, name: str) -> str:
        """URL of table ``name`` (what deltalake, duckdb or Spark are given)."""
        schema_of(name)
        return self.store.url("tables", name)

    @_credentials_masked
    def append(
        self, name: str, rows: Sequence[Mapping[str, Any]] | pa.Table, once: str | None = None
    ) -> bool:
        """Cast ``rows`` (dicts or a table) to the schema of ``name`` and append them in
        one commit; returns whether they were appended. Raises :class:`SchemaError` naming
        the table and column on bad rows.

        ``once``: an id of these rows, kept in the commit (a Delta ``txn`` action): an
        append with an id that a commit of the table carries already appends nothing, and
        of two racing with one id, the one that commits second conflicts, finds the other's
        commit when it retries and appends nothing. Each call's commit carries a number of its
        own, so a retry that finds the id committed by this very call (its reply lost) says
        the rows were appended.

        Every commit also carries this writer's own ``txn`` (:meth:`_writer_id`, with the
        call's number): when the store lost the reply to a commit that landed, deltalake's
        retry finds the commit there and, without it, took it for another writer's and
        committed the same data file again, which the change feed (:meth:`changes`) then read
        twice. With it that retry conflicts, and the next attempt finds the call's number. An
        error deltalake raises once the commit has landed (writing the checkpoint that follows
        every 100th commit) is logged, and the call says the rows were appended.

        A table created by an older treadle is brought up to the canonical schema first (see
        :meth:`_upgrade`)."""
        table = conform(name, rows)
        if table.num_rows == 0:
            return False
        nonce = secrets.randbits(63)
        writer = self._writer_id()
        transactions = [Transaction(app_id=writer, version=nonce)]
        if once is not None:
            transactions.append(Transaction(app_id=once, version=nonce))
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            # The snapshot loaded for the last append is reused (deltalake moves it to its
            # own commit and rebases onto commits of other writers, which saves a log
            # replay per append) for up to SNAPSHOT_APPENDS appends.
            snapshot, served = self._for_append.pop(name, (None, 0))
            if snapshot is None:
                snapshot = self._open(name)
                if snapshot is not None:
                    snapshot = self._upgrade(name, snapshot)
            if once is not None and snapshot is None:
                # An append to a table not there yet commits onto whatever is there by then, and
                # only a snapshot's commits are checked for ``once``: the table is made first.
                snapshot = self._create(name)
            found = None if once is None or snapshot is None else snapshot.transaction_version(once)
            if found is not None:
                self._for_append[name] = (snapshot, served)
                return found == nonce
            if attempt > 1 and snapshot is not None and snapshot.transaction_version(writer) == nonce:
                self._for_append[name] = (snapshot, served)
                return True
            target = snapshot or self.uri(name)
            try:
                write_deltalake(
                    target,
                    table,
                    mode="append",
                    configuration=TABLE_CONFIGURATION,
                    storage_options=self._options,
                    commit_properties=CommitProperties(max_commit_retries=50, app_transactions=transactions),
                )
                if isinstance(target, DeltaTable):
                    if served + 1 < SNAPSHOT_APPENDS:
                        self._for_append[name] = (target, served + 1)
                    if _small_files(target) >= COMPACT_FILES:
                        self._compact_after_append(name)
                return True
            except CommitFailedError as exc:
                if attempt == COMMIT_ATTEMPTS:
                    raise
                log.info(
                    "commit to table %s conflicted (attempt %d): %s; retrying",
                    name,
                    attempt,
                    without_ansi_codes(str(exc)),
                )
                time.sleep(0.05 * 2**attempt)
            except (DeltaError, OSError) as exc:
                if not self._landed(name, writer, nonce):
                    raise
                log.warning(
                    "table %s: the append landed, but deltalake failed after its commit: %s",
                    name,
                    self.store.config.redacted(without_ansi_codes(str(exc))),
                )
                return True

    @_credentials_masked
    def read(self, name: str, columns: Sequence[str] | None = None) -> pa.Table:
        """The whole table ``name`` as Arrow, in its canonical schema, or only ``columns`` of
        it, in that order (empty if never written). A column the canonical schema lacks
        raises ``ValueError`` naming it."""
        schema = schema_of(name)
        if columns is not None:
            unknown = [column for column in columns if column not in schema.names]
            if unknown:
                raise ValueError(
                    f"table {name!r} has no column {unknown[0]!r}; its columns are {schema.names}"
                )
            schema = pa.schema([schema.field(column) for column in columns])
        table = self._open(name)
        if table is None:
            return schema.empty_table()
        present = {field.name for field in table.schema().fields}
        return _cast_to(
            name,
            schema,
            _fetched(name, lambda: table.scan(columns=[n for n in schema.names if n in present])),
        )

    @_credentials_masked
    def version(self, name: str) -> int | None:
        """Latest Delta log version of ``name``, or None when the table does not exist yet."""
        table = self._open(name)
        return None if table is None else table.version()

    @_credentials_masked
    def identity(self, name: str) -> str | None:
        """The id ``name``'s Delta metadata was created with, or None when it does not exist yet:
        a table deleted and created again has a new one, though its versions count up alike."""
        table = self._open(name)
        return None if table is None else table.metadata().id

    @_credentials_masked
    def columns(self, name: str) -> list[str] | None:
        """Columns of ``name`` as its log has them (a table made by an older treadle lacks
        the columns added since, until its next append), or None when it does not exist yet."""
        table = self._open(name)
        return None if table is None else [field.name for field in table.schema().fields]

    @_credentials_masked
    def changes(self, name: str, after: int = -1, identity: str | None = None) -> tuple[pa.Table, int]:
        """Rows appended by commits with log version > ``after``, in commit order, with a
        ``_commit_version`` column; and the latest version (the next ``after``).

        Compaction commits add no data and are not returned. With ``after`` < 0 (from the
        start) the rows are the table's snapshot at the latest version, each with that
        version as ``_commit_version`` and in no particular order: the change feed of the
        first versions reads their data files, which ``optimize`` + ``vacuum`` delete.

        An ``after`` past the latest version, or >= 0 for a table that does not exist, raises
        :class:`StaleOffsetError`: a table's log never goes back, so the offset is not this
        table's (it was recreated, or the offset is another run's), and reading on from it
        would return nothing forever. So does one whose later commits' data files a vacuum
        removed: every retry would fail alike. A data file the table's latest snapshot still
        lists but the store lacks raises ``FileNotFoundError`` naming it.

        ``identity`` (:meth:`identity` of the table ``after`` was taken in; None: unknown)
        catches a recreated table whose log has passed ``after`` by now: its versions up to
        ``after`` were never read, so that raises :class:`StaleOffsetError` too.
        """
        table = self._open(name)
        if table is None:
            if after >= 0:
                raise StaleOffsetError(
                    f"table {name!r}: asked for its changes after version {after}, but the table "
                    "does not exist (deleted, or the offset is another run's)"
                )
            return _with_commit_version(schema_of(name).empty_table()), after
        if after >= 0 and identity is not None and table.metadata().id != identity:
            raise StaleOffsetError(
                f"table {name!r}: asked for its changes after version {after} of the table with id "
                f"{identity}, but the table now has id {table.metadata().id}: it was recreated since; "
                "read it from the start (after=-1)"
            )
        latest = table.version()
        if latest < after:
            raise StaleOffsetError(
                f"table {name!r}: asked for its changes after version {after}, but its latest version "
                f"is {latest}: the table was recreated, or the offset is another run's; read it from "
                "the start (after=-1)"
            )
        if latest == after:
            return _with_commit_version(schema_of(name).empty_table()), after
        if after < 0:
            snapshot = _cast_read(name, _fetched(name, table.scan))
            return snapshot.append_column(
                "_commit_version", pa.array([latest] * snapshot.num_rows, pa.int64())
            ), latest
        try:
            data = pa.concat_tables(
                _inserted(name, table, start, min(start + CDF_COMMITS - 1, latest))
                for start in range(after + 1, latest + 1, CDF_COMMITS)
            )
        except OSError as exc:
            missing = MISSING_FILE.search(str(exc))
            if missing is None:
                raise
            file = posixpath.basename(missing.group(1))
            # a file the latest snapshot still lists is no vacuum's: a read from the start fails on it too
            if file in {posixpath.basename(uri) for uri in table.file_uris()}:
                raise FileNotFoundError(
                    f"table {name!r}: its data file {file} is missing from the store, though its log "
                    "still lists it (deleted outside Delta?): no read of the table succeeds until it "
                    "is restored"
                ) from None
            raise StaleOffsetError(
                f"table {name!r}: asked for its changes after version {after}, but the data file "
                f"{file} of a later commit was removed by a vacuum (the offset is older than its "
                "retention); read it from the start (after=-1)"
            ) from None
        return data.take(pc.sort_indices(data.column("_commit_version"))), latest

    @_credentials_masked
    def optimize(self, name: str, now: float | None = None) -> dict[str, Any] | None:
        """Compact the small files of ``name``; returns deltalake's metrics ({} when the table
        does not exist), or None when another process is compacting it (it holds the lease,
        see ``COMPACTION_SLOT_S``)."""
        lease = SlotLease(self.store, self.store.path(COMPACTION_PREFIX, name), COMPACTION_SLOT_S)
        if not lease.take(time.time() if now is None else now):
            return None
        with lease.kept():
            table = self._open(name)
            return {} if table is None else table.optimize.compact()

    def _compact_after_append(self, name: str) -> None:
        """Compact ``name`` for an append that found it fragmented; a failure is only logged
        (the append has landed)."""
        try:
            metrics = self.optimize(name)
        except Exception as exc:
            log.warning("could not compact table %s (its appends are unaffected): %s", name, exc)
            return
        if metrics:
            log.info(
                "compacted table %s: %s files into %s",
                name,
                metrics.get("numFilesRemoved"),
                metrics.get("numFilesAdded"),
            )

    @_credentials_masked
    def vacuum(self, name: str, retention_hours: int = 168) -> list[str]:
        """Delete files of ``name`` no longer referenced and older than ``retention_hours``;
        returns the deleted files' names (paths inside the table).

        Unreferenced means removed by a commit, or never committed: the files of a writer or
        a compaction killed before its commit (a full vacuum; the retention keeps a live
        writer's file, whose commit lands within minutes).

        deltalake (1.6.6) lists again each file an earlier vacuum deleted, until the commit
        that removed it leaves the log; so only files present before are returned."""
        table = self._open(name)
        if table is None:
            return []
        folder = self.store.path("tables", name)
        present = {posixpath.basename(path) for path in self.store.fs.ls(folder, detail=False, refresh=True)}
        listed = table.vacuum(
            retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False, full=True
        )
        return [file for file in map(posixpath.basename, listed) if file in present]

    @_credentials_masked
    def check_log(self, name: str) -> None:
        """Raise a ``DeltaError`` naming ``name`` and the version when one of its commit
        files is empty: deltalake (1.6.6) reads an empty commit file (a commit whose bytes a
        crash lost) as a commit of nothing, so the rows it committed read as missing, without
        an error, and its data files as unreferenced. Lists the table's log (one request per
        1,000 commits on S3)."""
        try:
            listed = self.store.fs.ls(
                self.store.path("tables", name, "_delta_log"), detail=True, refresh=True
            )
        except FileNotFoundError:
            return
        empty = sorted(
            int(posixpath.basename(entry["name"])[: -len(".json")])
            for entry in listed
            if entry["name"].endswith(".json") and entry["size"] == 0
        )
        if empty:
            raise DeltaError(
                f"table {name!r}: its commit {empty[0]} is empty (0 bytes: lost in a crash?"
                f"{f' and so are {empty[1:]}' if len(empty) > 1 else ''}), so the rows it committed "
                "read as missing; restore that commit file"
            )

    def _upgrade(self, name: str, table: DeltaTable) -> DeltaTable:
        """Bring ``table``'s log up to the canonical schema of ``name``; returns the snapshot
        to append with.

        A run's table keeps the schema it was created with, so a run begun by an older
        treadle may lack a column added since, or mark required a column that may be null
        now. A missing column is added (one ADD COLUMNS commit; the older rows read it as
        null), which needs it nullable in the canonical schema: a required one raises
        :class:`SchemaError`, as does a column the canonical schema lacks (deltalake's own
        error names neither table nor column). A required one that may be null now has its
        constraint dropped (a CHANGE COLUMN commit), because deltalake (1.6) refuses an append
        of nulls into a column its log marks NOT NULL, even with ``schema_mode="merge"``. Rows
        and the change feed are untouched. When another writer upgrades the table first, this commit fails
        and the table, loaded again, has the change already.
        """
        canonical = schema_of(name)
        present = {field.name: field for field in table.schema().fields}
        unknown = [column for column in present if column not in canonical.names]
        if unknown:
            raise SchemaError(
                f"table {name!r} has the columns {unknown} this treadle does not know (added by a "
                "newer treadle?): upgrade treadle to append to it"
            )
        missing = [field for field in canonical if field.name not in present]
        if missing:
            required = [field.name for field in missing if not field.nullable]
            if required:
                raise SchemaError(
                    f"table {name!r} lacks the required columns {required}: its older rows cannot hold them"
                )
            try:
                table.alter.add_columns(DeltaSchema.from_arrow(pa.schema(missing)).fields)
                log.info(
                    "table %s: columns %s added, as its canonical schema has them",
                    name,
                    [f.name for f in missing],
                )
            except DeltaError:
                table = self._open(name)
                if not {field.name for field in missing} <= {field.name for field in table.schema().fields}:
                    raise
        for field in table.schema().fields:
            if (
                field.nullable
                or field.name not in canonical.names
                or not canonical.field(field.name).nullable
            ):
                continue
            try:
                table.alter.drop_column_not_null(field.name)
                log.info(
                    "table %s: column %s is nullable now, as its canonical schema says", name, field.name
                )
            except DeltaError:
                table = self._open(name)
                if not next(f for f in table.schema().fields if f.name == field.name).nullable:
                    raise
        return table

    def _landed(self, name: str, writer: str, nonce: int) -> bool:
        """Whether the commit of the append numbered ``nonce`` is in the log of ``name`` (False
        when the log cannot be loaded). deltalake raises the errors of the steps after a commit
        that landed (the checkpoint it writes after every 100th commit: an S3 503 on it), which
        would have the caller append the rows again."""
        try:
            table = self._open(name)
        except (DeltaError, OSError):
            return False
        return table is not None and table.transaction_version(writer) == nonce

    def _create(self, name: str) -> DeltaTable:
        """Table ``name``, created empty unless it exists."""
        # CommitFailedError: another writer created it between the check for it and this commit
        with contextlib.suppress(CommitFailedError):
            DeltaTable.create(
                self.uri(name),
                schema_of(name),
                mode="ignore",
                configuration=TABLE_CONFIGURATION,
                storage_options=self._options,
            )
        return self._open(name)

    def _open(self, name: str) -> DeltaTable | None:
        try:
            return DeltaTable(self.uri(name), storage_options=self._options)
        except TableNotFoundError:
            return None
        except DeltaError as exc:  # a commit file that does not parse, say: name the table it is in
            raise DeltaError(f"table {name!r}: cannot load its Delta log: {exc}") from None


def schema_of(name: str) -> pa.Schema:
    """Canonical schema of table ``name``."""
    try:
        return TABLE_SCHEMAS[name]
    except KeyError:
        raise ValueError(f"unknown table {name!r}; expected one of {sorted(TABLE_SCHEMAS)}") from None


def conform(name: str, rows: Sequence[Mapping[str, Any]] | pa.Table) -> pa.Table:
    """``rows`` as a table of ``name``'s schema: cast, extra columns dropped, required
    columns checked for nulls."""
    schema = schema_of(name)
    if isinstance(rows, pa.Table):
        missing = [f.name for f in schema if f.name not in rows.column_names and not f.nullable]
        if missing:
            raise SchemaError(f"table {name!r}: missing columns {missing}")
        columns = [
            rows.column(f.name) if f.name in rows.column_names else pa.nulls(rows.num_rows, f.type)
            for f in schema
        ]
        source = pa.table(columns, names=schema.names)
        for field in schema:
            found = source.column(field.name).type
            # Arrow casts 2 and 0.5 to True, and an integer to a timestamp as microseconds
            # since 1970 (epoch seconds as a moment of January 1st, 1970), without a word
            if (
                pa.types.is_boolean(field.type)
                and not (pa.types.is_boolean(found) or pa.types.is_null(found))
            ) or (
                pa.types.is_timestamp(field.type)
                and (pa.types.is_integer(found) or pa.types.is_floating(found))
            ):
                raise SchemaError(
                    f"table {name!r}: column {field.name!r} has type {found}, expected {field.type}"
                )
    else:
        rows = list(rows)
        _check_no_fractions(name, schema, rows)
        _check_no_strings_for_lists(name, schema, rows)
        _check_no_numbers_for_times(name, schema, rows)
        wide = pa.schema([field.with_type(widened(field.type)) for field in schema])
        try:
            source = pa.Table.from_pylist(rows, schema=wide)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
            raise SchemaError(f"table {name!r}: cannot convert rows: {exc}") from exc
    for field in schema:
        if not field.nullable and source.column(field.name).null_count:
            raise SchemaError(f"table {name!r}: column {field.name!r} is required but has null values")
    try:
        table = source.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise SchemaError(f"table {name!r}: cannot cast to the canonical schema: {exc}") from exc
    for field in schema:
        if source.column(field.name).type == field.type:
            continue
        beyond = np.flatnonzero(beyond_float32(source.column(field.name), table.column(field.name)))
        if len(beyond):
            raise SchemaError(f"table {name!r}: column {field.name!r}, row {beyond[0]}: {BEYOND_FLOAT32}")
    return table


def _check_no_fractions(name: str, schema: pa.Schema, rows: list[Mapping[str, Any]]) -> None:
    """Raise :class:`SchemaError` for a float that is not a whole number in an integer column
    of ``rows``: pyarrow converts it by dropping its fraction (a table's cast refuses it)."""
    integers = [field.name for field in schema if pa.types.is_integer(field.type)]
    for row in rows:
        for column in integers:
            value = row.get(column) if isinstance(row, Mapping) else None
            if isinstance(value, float | np.floating) and not float(value).is_integer():
                raise SchemaError(f"table {name!r}: column {column!r} is an integer but was given {value!r}")


def _check_no_strings_for_lists(name: str, schema: pa.Schema, rows: list[Mapping[str, Any]]) -> None:
    """Raise :class:`SchemaError` for a string in a list column of ``rows``: pyarrow converts
    it as the list of its characters."""
    lists = [field.name for field in schema if pa.types.is_list(field.type)]
    for row in rows:
        for column in lists:
            value = row.get(column) if isinstance(row, Mapping) else None
            if isinstance(value, str | bytes):
                raise SchemaError(f"table {name!r}: column {column!r} is a list but was given {value!r}")


def _check_no_numbers_for_times(name: str, schema: pa.Schema, rows: list[Mapping[str, Any]]) -> None:
    """Raise :class:`SchemaError` for a number in a timestamp column of ``rows``: pyarrow reads
    it as microseconds since 1970 (``time.time()`` as a moment of January 1st, 1970)."""
    times = [field.name for field in schema if pa.types.is_timestamp(field.type)]
    for row in rows:
        for column in times:
            value = row.get(column) if isinstance(row, Mapping) else None
            if isinstance(value, int | float | np.number):
                raise SchemaError(f"table {name!r}: column {column!r} is a timestamp but was given {value!r}")


STEP_ORDER = ("time", "step", "version", "policy_loss")
"""The order ``train_steps`` rows count as logged in: by ``time``, and rows logged at one
microsecond (a coarse clock) by step, as one trainer logs them, then by version and policy
loss, so that of two different rows of one step and microsecond one is kept whatever the order
of the table's files."""


def one_row_per_step(steps: pa.Table, weights: pa.Table) -> pa.Table:
    """``train_steps`` rows of the policy steps the run's weights went through, one per step,
    in step order; ``steps`` has at least the columns of :data:`STEP_ORDER`, ``weights`` is
    the run's ``weights`` table (its ``step`` and ``created_at``).

    A trainer restarted after a failure resumes from its last published version and logs
    the steps after it again; the rows its predecessor logged after that version, logged
    again or not (the run may end first), went into no weights. So a row stays when no row
    logged after it (in the order of :data:`STEP_ORDER`) has a step at or below its own, and
    a version published at or after its time has reached its step: a trainer's steps since
    its last version show once it publishes them, and a version published at the microsecond
    a step was logged, which a trainer publishes after logging the step, holds it. Of two
    rows of one step, microsecond, version and policy loss (one row appended twice), one
    stays.
    """
    ordered = steps.sort_by([(column, "ascending") for column in STEP_ORDER])
    step = ordered.column("step").to_numpy()
    # (N,) the lowest step logged after each row (none after the last)
    lowest_after = np.full(len(step), np.iinfo(np.int64).max)
    lowest_after[:-1] = np.minimum.accumulate(step[::-1])[::-1][1:]
    published = weights.sort_by("created_at")
    created = _micros(published.column("created_at"))
    # (V + 1,) the newest step of the versions from each one on (none past the last)
    reached_from = np.full(len(created) + 1, -1, dtype=np.int64)
    reached_from[:-1] = np.maximum.accumulate(published.column("step").to_numpy()[::-1])[::-1]
    # side="left": the versions published at or after each row's time
    reached_after = reached_from[np.searchsorted(created, _micros(ordered.column("time")), side="left")]
    return ordered.filter(pa.array((step < lowest_after) & (step <= reached_after))).sort_by("step")


def one_row_per_version(weights: pa.Table) -> pa.Table:
    """The rows of ``weights`` (the run's ``weights`` table), one per version, in version order.

    A row appended again after an append whose answer was lost (its commit had landed) is
    there twice; so may be a version recorded by writers that spelled the run's root
    differently (its ``path``). Rows are ordered by the table's columns in turn, nulls last,
    and the first row of each version stays: the least ``step``, then ``parent``, then
    ``path``, and so on.
    """
    ordered = weights.sort_by([(column, "ascending") for column in schema_of("weights").names])
    version = ordered.column("version").to_numpy()
    first = np.ones(len(version), dtype=bool)
    first[1:] = version[1:] != version[:-1]
    return ordered.filter(pa.array(first))


def _micros(times: pa.ChunkedArray) -> np.ndarray:
    """UTC timestamps as integer microseconds."""
    return times.cast(UTC_MICROS).cast(pa.int64()).to_numpy()


def _fetched(name: str, stream: Callable[[], Any]) -> pa.Table:
    """The rows of ``stream()`` (a scan or change feed of table ``name``) read whole. A data
    file that cannot be fetched or parsed (an S3 503, a truncated file) fails the stream with
    an ``ArrowInvalid``, which quotes the refused request's body: it is raised as the storage
    error it is, an ``OSError`` naming the table, which a task retries and
    :func:`_credentials_masked` masks. Other Arrow errors (out of memory, say) stay what they
    are."""
    try:
        return pa.table(stream())
    except (pa.ArrowInvalid, OSError) as exc:
        raise OSError(f"table {name!r}: cannot read its data files: {exc}") from None


def _inserted(name: str, table: DeltaTable, first: int, last: int) -> pa.Table:
    """Rows that the commits ``first`` to ``last`` of ``table`` (table ``name``) appended, in
    its canonical schema, with a ``_commit_version`` column."""
    feed = _fetched(name, lambda: table.load_cdf(starting_version=first, ending_version=last))
    inserted = pc.equal(pc.cast(feed.column("_change_type"), pa.string()), "insert")
    data = _cast_read(name, feed).append_column(
        "_commit_version", pc.cast(feed.column("_commit_version"), pa.int64())
    )
    return data.filter(inserted)


def _cast_read(name: str, table: pa.Table) -> pa.Table:
    """Delta gives back e.g. ``string_view`` and nullable fields; restore the canonical schema."""
    return _cast_to(name, schema_of(name), table)


def _small_files(table: DeltaTable) -> int:
    """Data files of ``table`` under ``SMALL_FILE_BYTES``."""
    sizes = pa.table(table.get_add_actions(flatten=True)).column("size_bytes")
    return int(pc.sum(pc.less(sizes, SMALL_FILE_BYTES)).as_py() or 0)


def _cast_to(name: str, schema: pa.Schema, table: pa.Table) -> pa.Table:
    """``table``'s columns of ``schema`` (read from table ``name``), cast to it; a nullable
    column the table lacks (added to the canonical schema after the table was made) reads as
    nulls."""
    missing = [f.name for f in schema if f.name not in table.column_names and not f.nullable]
    if missing:
        raise SchemaError(f"table {name!r} lacks the required columns {missing}")
    columns = [
        pc.cast(table.column(f.name), f.type)
        if f.name in table.column_names
        else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _with_commit_version(table: pa.Table) -> pa.Table:
    return table.append_column("_commit_version", pa.array([], pa.int64()))
