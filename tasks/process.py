"""The process task: raw shards → processed shards and ``trajectories`` rows."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prefect import task
from prefect.events import emit_event

from flows.config import RunConfig
from flows.run_logs import module_logs_to_run
from rl.models import load_tokenizer
from rl.process_loop import ProcessedShard, ShardProcessor
from storage.heartbeat import Heartbeat
from storage.status import (
    HeldRole,
    InUse,
    ProcessorStatus,
    ProcessorStatusBoard,
    wait_until_free,
)
from storage.tables import Tables
from storage.weights import WeightStore
from tasks.common import (
    SIDE_EFFECTS,
    STORAGE_RETRIES,
    deadline_once_started,
    reporting,
    run_resource,
    run_store,
    watch_signal,
)

log = logging.getLogger(__name__)

STATUS_EVERY_S = 5.0
"""How often a running processor renews its status (it goes stale after 30 s)."""
TOKENIZER_RETRY_S = 60.0
"""How long the rows of a processor whose tokenizer did not load go without text before it
tries to load it again."""
DRAIN_SECONDS = 10.0
"""How long past the run's deadline a process task given none goes on, to process the last
shards of the rollouts that end at it."""


def shard_processor(
    config: RunConfig,
    on_shard: Callable[[ProcessedShard], None] | None = None,
    before_commit: Callable[[], None] | None = None,
) -> ShardProcessor:
    """A processor for the run, decoding text with the tokenizer of its newest version whose
    tokenizer verifies (``WeightStore.load_newest``), looked up at the first row to decode: a
    processor started before version 0 is published (beside the trainer and the workers)
    decodes too, and a raw shard implies a version.
    ``before_commit`` is called before each processed shard is committed (it raises once
    another processor holds the run's processor role)."""
    store = run_store(config)
    weights = WeightStore(store, one_copy=True)
    loaded: list = []
    failed: list[tuple[float, str]] = []  # the last failed load: when, and why (one at most)

    def decode(ids: list[int]) -> str:
        if not loaded:
            # each row of a shard decodes: a load that failed would otherwise fetch every
            # version's tokenizer again for each of them
            if failed and time.monotonic() - failed[-1][0] < TOKENIZER_RETRY_S:
                raise LookupError(
                    f"{failed[-1][1]} (the tokenizer is loaded again {TOKENIZER_RETRY_S:.0f} s after that)"
                )
            try:
                try:
                    _, path = weights.load_newest("tokenizer")
                except FileNotFoundError:
                    raise LookupError(
                        f"run {config.run_id} has no weight version, so no tokenizer yet"
                    ) from None
                loaded.append(load_tokenizer(path))
            except Exception as exc:
                failed[:] = [(time.monotonic(), f"{type(exc).__name__}: {exc}")]
                raise
            weights.release()
        return loaded[0].decode(ids, skip_special_tokens=False)

    return ShardProcessor(
        store, config.processor, decode=decode, on_shard=on_shard, before_commit=before_commit
    )


COUNTS = ("shards", "trajectories_in", "trajectories_out", "tokens_in", "train_tokens_out")
"""What every summary counts, at zero when no shard was processed."""


class ProcessTotals:
    """Running totals over processed shards (a long run keeps these, not every outcome)."""

    def __init__(self) -> None:
        self.totals: Counter = Counter(dict.fromkeys(COUNTS, 0))
        self.dropped: Counter = Counter()

    def add(self, outcomes: list[ProcessedShard]) -> ProcessTotals:
        for outcome in outcomes:
            if outcome.counters is None:
                self.totals[f"skipped_{outcome.skipped}"] += 1
                continue
            c = outcome.counters
            self.totals.update(
                shards=1,
                trajectories_in=c.trajectories_in,
                trajectories_out=c.trajectories_out,
                tokens_in=c.tokens_in,
                train_tokens_out=c.train_tokens_out,
            )
            self.dropped.update(c.dropped)
        return self

    def summary(self) -> dict[str, Any]:
        return {**self.totals, "dropped": dict(self.dropped)}


@contextlib.contextmanager
def holding_the_processor(config: RunConfig) -> Iterator[HeldRole]:
    """Hold the run's processor role while the block runs; yields the role (its ``lost`` is
    set once the role is lost; its ``require`` raises then).

    One processor per run: two would process its shards twice. While another processor's
    status is renewed this raises :class:`~storage.status.InUse`; the fresh status a killed
    one left is waited out (``storage.status.wait_until_free``). The status is renewed on a
    thread, which first reads it back: when another processor's fresh status has replaced
    this one's (two started at once, or a renewal stalled past the time a status counts and
    another took the run), the role is lost, this processor stops renewing, and it leaves the
    status to its new holder."""
    board = ProcessorStatusBoard(run_store(config))
    wait_until_free(
        board.read,
        f"the processor of run {config.run_id!r}",
        "a run has one processor: stop the other first (a pipeline run processes its own run)",
    )
    role = HeldRole(board.read, board.publish, f"the processor of run {config.run_id!r}")
    role.claim(ProcessorStatus(time=time.time()))
    beat = Heartbeat(
        lambda: role.publish(ProcessorStatus(time=time.time())), STATUS_EVERY_S, "processor status"
    )
    try:
        yield role
    finally:
        beat.stop()
        try:
            role.publish(ProcessorStatus(time=time.time(), running=False))
        except Exception as exc:  # its status goes stale instead, and frees the role then
            log.warning("could not mark the processor of run %s stopped: %s", config.run_id, exc)


def run_processor(
    config: RunConfig,
    deadline: float | Callable[[], float],
    poll_s: float = 0.5,
    on_shard: Callable[[ProcessedShard], None] | None = None,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Process raw shards as they are committed until ``deadline`` (epoch seconds, or a function
    called for them once the run's processor role is held), then drain once more (holding the
    role; raises :class:`~storage.status.InUse` once it is lost)."""
    with holding_the_processor(config) as role:
        end = deadline() if callable(deadline) else deadline
        processor = shard_processor(
            config,
            reporting(on_shard, "report of a processed shard"),
            role.require,
        )
        totals = ProcessTotals()
        while time.time() < end and not (stop is not None and stop.is_set()) and not role.lost.is_set():
            new = processor.poll()
            totals.add(new)
            if not new:
                time.sleep(poll_s)
        if role.lost.is_set():  # its offset, too, is the new holder's to save
            raise InUse(f"{role.taken}; stopped after {totals.totals['shards']} shards, the other goes on")
        totals.add(processor.poll())
        processor.save()
        return totals.summary()


def _emit(config: RunConfig, outcome: ProcessedShard) -> None:
    payload = {"raw_shard": outcome.raw.shard_id, "rows": outcome.raw.num_rows}
    if outcome.processed is not None:
        payload["processed_shard"] = outcome.processed.shard_id
    if outcome.counters is not None:
        payload |= {
            "trajectories_out": outcome.counters.trajectories_out,
            "train_tokens_out": outcome.counters.train_tokens_out,
        }
    emit_event(
        event="treadle.shard.processed",
        resource=run_resource(config),
        payload=payload,
    )


@task(name="process-shards", **SIDE_EFFECTS, **STORAGE_RETRIES)
def process_shards(
    config: RunConfig, deadline: float | None = None, signals: str | None = None
) -> dict[str, Any]:
    """Process raw shards continuously until the deadline; emits an event per shard. With
    ``signals`` (a key of :func:`tasks.common.send_signal`) it also ends at signal
    ``rollouts-done``, after processing what the rollouts committed. Without ``deadline`` it
    is :data:`DRAIN_SECONDS` past the one the rollouts task sharing ``signals`` raises in
    signal ``started`` once its worker is up; ``rollouts-done`` first, it processes what is
    pending once and ends."""
    with module_logs_to_run():
        if deadline is None and signals is None:
            raise ValueError(
                "the process-shards task needs a deadline, or the signals key of a rollouts task that raises it"
            )
        store = run_store(config)
        with watch_signal(store, signals, "rollouts-done") as rollouts_done:

            def deadline_from_start() -> float:
                started = deadline_once_started(store, signals, rollouts_done)
                return time.time() if started is None else started + DRAIN_SECONDS

            return run_processor(
                config,
                deadline_from_start if deadline is None else deadline,
                on_shard=lambda outcome: _emit(config, outcome),
                stop=rollouts_done,
            )


@task(name="process-pending", **SIDE_EFFECTS, **STORAGE_RETRIES)
def process_pending(config: RunConfig) -> dict[str, Any]:
    """One pass over the raw shards pending when it starts (for event-triggered runs: a shard
    committed during the pass is left to the pass its own commit event schedules).

    Raises ``FileNotFoundError`` naming the storage when it holds no trace of the run (no
    ``shards`` table, no weight version): a commit event then names a run that this storage
    does not hold (a worker on another machine writing to its own local folder rather than
    to shared ``s3://`` storage)."""
    store = run_store(config)
    if Tables(store).version("shards") is None and WeightStore(store).latest() is None:
        raise FileNotFoundError(
            f"run {config.run_id!r} is not at {store.uri}: no shards table, no weight version; check "
            "storage.root and run_id (processes on other machines need shared s3:// storage)"
        )
    with holding_the_processor(config) as role:
        processor = shard_processor(
            config,
            on_shard=reporting(lambda outcome: _emit(config, outcome), "report of a processed shard"),
            before_commit=role.require,
        )
        totals = ProcessTotals().add(processor.poll())
        processor.save()
        return totals.summary()
