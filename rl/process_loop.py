"""The process stage: raw shards in, processed shards and ``trajectories`` rows out.

Each raw shard ``raw/<worker>/<seq>`` becomes exactly one processed shard
``processed/<worker>/<seq>`` (committed under the same worker and sequence number, even
when no row was selected, and empty when the raw shard is quarantined), then its rows are
appended to the ``trajectories`` table. That makes the stage idempotent across restarts:

- a raw shard with a committed processed twin is never processed again;
- a twin whose ``trajectories`` rows are missing (a crash between the two writes, or an
  append that raised) gets them recomputed (the selection is deterministic) and appended,
  nothing else, unless the table shows that append landed after all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from rl.processor import Decode, ProcessorConfig, Rescore, ShardCounters, process_shard
from storage.config import RunStore
from storage.schema import PROCESSED_SCHEMA
from storage.shards import ShardInfo, ShardReader, ShardWriter
from storage.tables import Tables

log = logging.getLogger(__name__)


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

    def __post_init__(self):
        self.tables = Tables(self.store)
        self.raw = ShardReader(self.store, kind="raw", tables=self.tables)
        self.offset = -1
        self._writers: dict[str, ShardWriter] = {}
        shards = self.tables.read("shards")
        processed = shards.filter(pc.equal(shards.column("kind"), "processed"))
        self._twins = set(
            zip(processed.column("worker").to_pylist(), processed.column("seq").to_pylist(), strict=True)
        )
        self._recorded = self._read_recorded()

    def _read_recorded(self) -> set[str]:
        """Raw shards whose rows are in the ``trajectories`` table."""
        trajectories = self.tables.read("trajectories")
        return set(pc.unique(trajectories.column("shard_id")).to_pylist())

    def poll(self) -> list[ProcessedShard]:
        """Process the raw shards committed since the last poll.

        The offset moves on only once every one of them is processed: if one raises, the
        next poll sees them all again, and skips those already processed.
        """
        shards, latest = self.raw.poll(self.offset)
        processed = [self._process(shard) for shard in shards]
        self.offset = latest
        return processed

    def _writer(self, worker: str) -> ShardWriter:
        if worker not in self._writers:
            self._writers[worker] = ShardWriter(
                self.store, worker, kind="processed", schema=PROCESSED_SCHEMA, tables=self.tables
            )
        return self._writers[worker]

    def _process(self, raw: ShardInfo) -> ProcessedShard:
        twin_done = (raw.worker, raw.seq) in self._twins
        if twin_done and raw.shard_id not in self._recorded:
            # an earlier attempt's append may have landed with its reply lost: ask the table
            self._recorded = self._read_recorded()
        # a quarantined shard gets its (empty) twin and no trajectories row: the twin says it is done
        if twin_done and (raw.shard_id in self._recorded or self.raw.quarantined(raw)):
            return ProcessedShard(raw, None, None, skipped="already processed")
        table = self.raw.read(raw)
        if table is None:
            # an empty twin still tells the trainer, and through it the worker's
            # backpressure, that this shard has been dealt with
            processed = None if twin_done else self._commit_twin(raw, PROCESSED_SCHEMA.empty_table())
            outcome = ProcessedShard(raw, processed, None, skipped="quarantined")
            self._notify(outcome)
            return outcome
        result = process_shard(
            table, self.config, shard_id=raw.shard_id, rescore=self.rescore, decode=self.decode
        )
        processed = None if twin_done else self._commit_twin(raw, _as_processed(result.processed))
        if result.trajectories:
            self.tables.append("trajectories", result.trajectories)
        self._recorded.add(raw.shard_id)
        outcome = ProcessedShard(raw, processed, result.counters)
        self._notify(outcome)
        return outcome

    def _commit_twin(self, raw: ShardInfo, table: pa.Table) -> ShardInfo:
        info = self._writer(raw.worker).commit(table, seq=raw.seq)
        self._twins.add((raw.worker, raw.seq))
        return info

    def _notify(self, outcome: ProcessedShard) -> None:
        if outcome.skipped:
            log.warning("raw shard %s skipped: %s", outcome.raw.shard_id, outcome.skipped)
        if self.on_shard is not None:
            self.on_shard(outcome)


def _as_processed(table: pa.Table) -> pa.Table:
    return table if table.schema.equals(PROCESSED_SCHEMA) else table.cast(PROCESSED_SCHEMA)
