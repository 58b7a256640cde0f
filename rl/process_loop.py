"""The process stage: raw shards in, processed shards and ``trajectories`` rows out.

Each raw shard ``raw/<worker>/<seq>`` becomes exactly one processed shard
``processed/<worker>/<seq>`` (committed under the same worker and sequence number, even
when no row was selected, and empty when the raw shard is quarantined), then its rows are
appended to the ``trajectories`` table. That makes the stage idempotent across restarts:

- a raw shard with a committed processed twin is never processed again;
- a twin whose ``trajectories`` rows are missing (a crash between the two writes, or an
  append that raised) gets them recomputed (the selection is deterministic) and appended,
  nothing else, unless the table shows that append landed after all (a raw shard without
  rows has none to miss).

The processor keeps its offset in the ``shards`` log in the run's storage
(``storage.status.ProcessOffsetBoard``, at most every ``SAVE_EVERY_S`` and on ``save``): a
new one, such as the event-triggered deployment starts for each commit, reads only what
was committed since, so its cost does not grow with the age of the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from rl.processor import Decode, ProcessorConfig, Rescore, ShardCounters, process_shard
from storage.config import RunStore
from storage.schema import PROCESSED_SCHEMA
from storage.shards import ShardInfo, ShardReader, ShardWriter
from storage.status import ProcessOffset, ProcessOffsetBoard
from storage.tables import Tables

log = logging.getLogger(__name__)

SAVE_EVERY_S = 10.0
"""Most seconds between two saves of the offset by a polling processor."""


@dataclass
class ProcessedShard:
    """One raw shard's outcome."""

    raw: ShardInfo
    processed: ShardInfo | None
    counters: ShardCounters | None
    skipped: str | None = None


@dataclass
class ShardProcessor:
    """Processes every committed raw shard of a run once; call :meth:`poll` repeatedly."""

    store: RunStore
    config: ProcessorConfig = field(default_factory=ProcessorConfig)
    decode: Decode | None = None
    rescore: Rescore | None = None
    on_shard: Callable[[ProcessedShard], None] | None = None
    before_commit: Callable[[], None] | None = None
    """Called before each processed shard is committed, and before each raw shard's
    ``trajectories`` rows are appended; raising refuses them (nothing written)."""

    def __post_init__(self):
        self.tables = Tables(self.store)
        self.raw = ShardReader(self.store, kind="raw", tables=self.tables)
        self.board = ProcessOffsetBoard(self.store)
        self._writers: dict[str, ShardWriter] = {}
        self.table_id: str | None = None
        """The ``shards`` table's identity (``Tables.identity``) the offset is a version of."""
        self.offset, shards = self._resume()
        self._saved, self._saved_at = (self.offset, self.table_id), 0.0
        # raw shards after the offset have their twins after it too: committed later
        self._twins = _twins_in(shards)
        self._polled_twins: set[tuple[str, int]] = set()
        """Twins committed (or found) since the current poll began: once it returns, the
        offset is past their raw shards, and ``_twins`` holds only these, which is what a
        processor started at the new offset reads from the log."""
        self._twins_unsure = False
        """A twin commit raised: it may have landed all the same (its reply lost, the
        ``shards`` table unreadable), so the log is read again before committing another."""
        self._recorded: set[str] | None = None
        """Raw shards with rows in ``trajectories``; read when a poll first needs it (a twin met)
        and again after an append that raised (its reply may be lost with the rows landed)."""

    def _resume(self) -> tuple[int, pa.Table]:
        """The saved offset and the ``shards`` rows committed after it; -1 and the whole log
        when no offset is saved or the log no longer has what followed it (a table recreated
        since it was saved, which counts its versions anew, included)."""
        saved = self.board.read()
        # read first: a table recreated after this read fails the next poll, never skips
        self.table_id = self.tables.identity("shards")
        if saved is not None:
            latest = self.tables.version("shards")
            if latest is None or saved.offset > latest:
                log.warning(
                    "the saved process offset %d is past the shards log (version %s): was the run's "
                    "storage replaced? processing from the beginning of the log",
                    saved.offset,
                    latest,
                )
            else:
                try:
                    return saved.offset, self.tables.changes("shards", saved.offset, saved.table_id)[0]
                except Exception as exc:  # change files after it vacuumed, or the table recreated since
                    log.warning(
                        "cannot read the shards log after the saved process offset %d (%s); "
                        "processing from the beginning of the log",
                        saved.offset,
                        exc,
                    )
        return -1, self.tables.changes("shards", -1)[0]

    def save(self) -> None:
        """Save the offset, so that a new processor of the run starts there."""
        if (self.offset, self.table_id) != self._saved:
            self.board.publish(ProcessOffset(offset=self.offset, time=time.time(), table_id=self.table_id))
            self._saved = (self.offset, self.table_id)
        self._saved_at = time.monotonic()

    def _read_recorded(self) -> set[str]:
        """Raw shards whose rows are in the ``trajectories`` table."""
        shard_ids = self.tables.read("trajectories", columns=["shard_id"]).column("shard_id")
        return set(pc.unique(shard_ids).to_pylist())

    def poll(self) -> list[ProcessedShard]:
        """Process the raw shards committed since the last poll.

        The offset moves on only once every one of them is processed: if one raises, the
        next poll sees them all again, and skips those already processed.
        """
        self._polled_twins = set()
        if self.table_id is None:  # none yet when this processor started
            self.table_id = self.tables.identity("shards")
        shards, latest = self.raw.poll(self.offset, self.table_id)
        processed = [self._process(shard) for shard in shards]
        self.offset = latest
        # no raw shard up to the offset is polled again: only the twins, and the recorded
        # shards, of those after it can be met, so neither grows with the age of the run
        self._twins, self._polled_twins = self._polled_twins, set()
        self._recorded = None
        if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            try:
                self.save()
            except Exception as exc:  # a restart then re-checks a little more of the log
                self._saved_at = time.monotonic()  # tried again a save interval later, not every poll
                log.warning("could not save the process offset %d: %s", self.offset, exc)
        return processed

    def _writer(self, worker: str) -> ShardWriter:
        if worker not in self._writers:
            self._writers[worker] = ShardWriter(
                self.store,
                worker,
                kind="processed",
                schema=PROCESSED_SCHEMA,
                tables=self.tables,
                numbers_given=True,
                before_commit=self.before_commit,
            )
        return self._writers[worker]

    def _process(self, raw: ShardInfo) -> ProcessedShard:
        if self._twins_unsure:
            # the poll that raised left the offset where it was
            found = _twins_in(self.tables.changes("shards", self.offset, self.table_id)[0])
            self._twins |= found
            self._polled_twins |= found
            self._twins_unsure = False
        twin_done = (raw.worker, raw.seq) in self._twins
        if twin_done and raw.num_rows and self._recorded is None:
            self._recorded = self._read_recorded()
        # a shard without rows, or a quarantined one (its twin empty), has no trajectories row:
        # its twin says it is done
        if twin_done and (not raw.num_rows or raw.shard_id in self._recorded or self.raw.quarantined(raw)):
            return ProcessedShard(raw, None, None, skipped="already processed")
        table = self.raw.read(raw)
        if table is None:
            if twin_done:  # its file went missing before: dealt with (and reported) then
                return ProcessedShard(raw, None, None, skipped="already processed")
            # an empty twin still tells the trainer, and through it the worker's
            # backpressure, that this shard has been dealt with
            processed = self._commit_twin(raw, PROCESSED_SCHEMA.empty_table())
            outcome = ProcessedShard(raw, processed, None, skipped=self.raw.unread_reason(raw))
            self._notify(outcome)
            return outcome
        result = process_shard(
            table, self.config, shard_id=raw.shard_id, rescore=self.rescore, decode=self.decode
        )
        processed = None if twin_done else self._commit_twin(raw, _as_processed(result.processed))
        if result.trajectories:
            if self.before_commit is not None:  # the role may have been taken while the twin committed
                self.before_commit()
            try:
                self.tables.append("trajectories", result.trajectories)
            except BaseException:
                self._recorded = None
                raise
        if self._recorded is not None:
            self._recorded.add(raw.shard_id)
        outcome = ProcessedShard(raw, processed, result.counters)
        self._notify(outcome)
        return outcome

    def _commit_twin(self, raw: ShardInfo, table: pa.Table) -> ShardInfo:
        try:
            info = self._writer(raw.worker).commit(table, seq=raw.seq)
        except BaseException:
            self._twins_unsure = True
            raise
        self._twins.add((raw.worker, raw.seq))
        self._polled_twins.add((raw.worker, raw.seq))
        return info

    def _notify(self, outcome: ProcessedShard) -> None:
        if outcome.skipped:
            log.warning("raw shard %s skipped: %s", outcome.raw.shard_id, outcome.skipped)
        errors = [] if outcome.counters is None else outcome.counters.errors
        if errors:
            more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
            log.warning("raw shard %s: %s%s", outcome.raw.shard_id, "; ".join(errors[:5]), more)
        if self.on_shard is not None:
            self.on_shard(outcome)


def _twins_in(shards: pa.Table) -> set[tuple[str, int]]:
    """``(worker, seq)`` of the processed shards among ``shards`` rows."""
    processed = shards.filter(pc.equal(shards.column("kind"), "processed"))
    return set(zip(processed.column("worker").to_pylist(), processed.column("seq").to_pylist(), strict=True))


def _as_processed(table: pa.Table) -> pa.Table:
    return table if table.schema.equals(PROCESSED_SCHEMA) else table.cast(PROCESSED_SCHEMA)
