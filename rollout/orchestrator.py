"""The multi-task orchestrator: keeps thousands of rollouts in flight across tasks.

- **Mixing**: each new rollout goes to the task furthest below its target share of the
  rollouts started so far, so the mix converges to the targets; targets can be changed
  while it runs (:meth:`Orchestrator.set_mix`), and count from the change on.
- **Backpressure**: when the trainer lags no new rollout starts until it catches up. Two
  signals: ``backlog()`` above ``max_backlog`` (the rollout worker counts the shards
  committed since its engines last loaded a new version, which bounds the data made for a
  trainer that stopped publishing), and ``trainer_queue()`` above ``max_trainer_batches``
  (policy steps' worth of data the trainer has read and not trained, as it publishes it;
  without this, a trainer slower than the engines lets its queue grow until samples go
  stale and are dropped, their rollout compute wasted). The backlog holds nothing back
  while ``trainer_starved()``: the trainer has read every shard this worker committed and
  holds less than one batch, so it cannot step, so cannot publish, until more data comes,
  and pausing then would wait forever (whenever ``max_backlog`` shards hold fewer tokens
  than the trainer's ``token_budget``). A trainer short of a batch while shards are still
  on their way to it (the processor lags) does not count: they will feed it.
- **Group mode** (GRPO baseline): ``group_size`` rollouts per prompt; with DAPO-style
  filtering a group whose rewards, as the trainer trains them (``trained_reward``: lifted by
  partial progress, a timeout's counting as 0; env and infra errors left out), are all equal is
  dropped (but for its env and infra errors, written for the run's failure counts), slots are
  refilled at once,
  and once ``target_groups`` informative groups exist the redundant in-flight rollouts
  are cancelled. A group whose member fails outside the service's classification or is
  cut short by a stop goes on with the members that finished, as a smaller group.
- **Quota**: ``max_rollouts`` alone counts this orchestrator's rollouts; with a ``quota``
  (a rollout worker's ``storage.quota.RunQuota``) it is the run's, shared by its workers and
  their restarts: blocks of rollouts are claimed before they launch, and what did not
  finish, or finished but the sink did not take (see ``Sink``), is given back when the
  orchestrator stops. One refused a claim claims once more
  when it runs dry, taking up what other workers gave back meanwhile. A claim that fails
  (storage unreachable) holds launching while rollouts are in flight, tried again as each
  finishes; with none in flight it ends the run with its error.
- Every finished rollout goes to the sink (a ``ShardWriter``), a group's records in one
  write so that they share a shard; ``stop()`` stops
  launching, cancels what is in flight, flushes the sink and records what was cut short.
  A sink that fails ends the run with its error, after the same cancel and flush.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from envs.base import Task
from envs.threads import to_thread_to_the_end
from rollout.config import SEED_STRIDE, OrchestratorConfig
from rollout.service import RolloutRequest, RolloutResult, RolloutService
from storage.schema import EXCLUDED_STATUSES
from storage.shards import records_kept

log = logging.getLogger(__name__)


async def wait_through_cancels(tasks: Iterable[asyncio.Future]) -> bool:
    """Wait until every one of ``tasks`` is done, however many cancels of the caller land
    meanwhile (a stop, then the worker cancelled): nothing is left running. True when one
    landed, for the caller to raise once it is done with them."""
    interrupted = False
    pending = set(tasks)
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            interrupted = True
    return interrupted


def _reward_alone(reward: float | None, progress: float | None) -> float:
    return reward or 0.0


class Quota(Protocol):
    """A run-wide quota of rollouts (``storage.quota.RunQuota``)."""

    def claim(self, wanted: int, step: int = 1) -> int: ...

    def release(self, unused: int) -> None: ...


class Sink(Protocol):
    """Where finished records go; ``write_many`` keeps its records together (one shard).

    An error ``write_many`` raises took none of its records, unless it carries a
    ``storage.shards.RecordsKept`` note (``records_kept``): a ``ShardWriter`` whose flush
    failed keeps them, and a later flush or its close commits them. The run's quota gets back
    the rollouts of a write that took none, and keeps those of one that kept them."""

    def write_many(self, records: Sequence[Mapping[str, Any]]) -> Any: ...

    def flush(self) -> Any: ...


@dataclass
class TaskCounters:
    started: int = 0
    finished: int = 0
    statuses: Counter = field(default_factory=Counter)
    reward_sum: float = 0.0
    rewarded: int = 0

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.rewarded if self.rewarded else None


@dataclass
class OrchestratorStats:
    """What the orchestrator did; ``cut_short`` names rollouts cancelled by a stop,
    ``cancelled_elsewhere`` those cancelled by something else (the service's ``cancel``);
    ``finished_rows``: the records (trajectories) of the finished rollouts, one each but a
    compacted rollout's one per context."""

    tasks: dict[str, TaskCounters] = field(default_factory=lambda: defaultdict(TaskCounters))
    finished_rows: int = 0
    written: int = 0
    groups_kept: int = 0
    groups_filtered: int = 0
    cancelled_redundant: int = 0
    cut_short: list[str] = field(default_factory=list)
    cancelled_elsewhere: list[str] = field(default_factory=list)
    paused_s: float = 0.0
    paused: str | None = None
    """Why launching waits, while it does (None while it launches)."""
    peak_in_flight: int = 0

    @property
    def finished(self) -> int:
        return sum(c.finished for c in self.tasks.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "finished": self.finished,
            "finished_rows": self.finished_rows,
            "written": self.written,
            "groups_kept": self.groups_kept,
            "groups_filtered": self.groups_filtered,
            "cancelled_redundant": self.cancelled_redundant,
            "cut_short": len(self.cut_short),
            "cancelled_elsewhere": len(self.cancelled_elsewhere),
            "paused_s": round(self.paused_s, 3),
            "paused": self.paused,
            "peak_in_flight": self.peak_in_flight,
            "tasks": {
                name: {
                    "started": c.started,
                    "finished": c.finished,
                    "statuses": dict(c.statuses),
                    "mean_reward": c.mean_reward,
                }
                for name, c in self.tasks.items()
            },
        }


@dataclass
class _Group:
    group_id: str
    size: int
    results: list[RolloutResult] = field(default_factory=list)
    tasks: set[asyncio.Task] = field(default_factory=set)
    lost: int = 0
    """Members that will never finish: failed outside the service's classification, or cut short."""
    cut_short: int = 0
    """Of ``lost``, those a stop cut short (the stop reports them, not the group)."""


class Orchestrator:
    """Feeds the rollout service from per-task task streams and writes results to ``sink``.

    Args:
        service: the rollout service.
        tasks: an endless iterator of train tasks per task name.
        sink: where finished records go (``ShardWriter``).
        backlog: how many committed shards wait for the trainer, as the caller counts them.
        trainer_queue: policy steps' worth of data the trainer holds untrained (None when unknown).
        trainer_starved: whether the trainer cannot step before more data comes (it has read
            every committed shard and holds less than one batch); the backlog then holds nothing back.
        on_result: called with each finished rollout's result once it is written (or kept in
            its group); an error it raises ends :meth:`run` as a sink's does.
        quota: the run's ``max_rollouts``, shared with its other workers and their restarts:
            rollouts launch only as far as claims on it are granted (a block of up to
            ``concurrency`` at a time), and what did not finish is given back at the end.
            Without it ``max_rollouts`` counts this orchestrator's rollouts alone.
        stop_launching: an outside stop (the run's stop signal, raised on another thread):
            once it returns True no rollout launches; those in flight go on until :meth:`stop`
            or they finish, and the run ends when none is left.
        serving: whether an engine replica is in service; while it returns False launching
            waits (each rollout would fail at once as an ``infra_error``, in a loop that
            writes failed rows and spends ``max_rollouts``), until a replica is back or a stop.
            One that raises (no replica can come back) stops launching as ``stop_launching``
            does: the rollouts in flight run to their end and are written (one that needs a
            model turn ends as an ``infra_error``), then the run ends with its error.
        trained_reward: the reward a rollout is trained with, from its ``reward`` and
            ``progress`` (the run's ``rl.processor.combine_reward``), which group mode's filter
            compares; without it, the reward alone (None as 0).
    """

    def __init__(
        self,
        service: RolloutService,
        tasks: Mapping[str, Iterator[Task]],
        sink: Sink,
        config: OrchestratorConfig | None = None,
        backlog: Callable[[], int] | None = None,
        trainer_queue: Callable[[], float | None] | None = None,
        trainer_starved: Callable[[], bool] | None = None,
        on_result: Callable[[RolloutResult], None] | None = None,
        quota: Quota | None = None,
        stop_launching: Callable[[], bool] | None = None,
        serving: Callable[[], bool] | None = None,
        trained_reward: Callable[[float | None, float | None], float] | None = None,
    ):
        self.service = service
        self.tasks = dict(tasks)
        self.sink = sink
        self.config = config or OrchestratorConfig()
        self.backlog = backlog
        self.trainer_queue = trainer_queue
        self.trainer_starved = trainer_starved
        self.on_result = on_result
        self.quota = quota
        self.stop_launching = stop_launching
        self.serving = serving
        self.trained_reward = trained_reward or _reward_alone
        self._granted = 0
        """Rollouts the quota granted this orchestrator."""
        self._quota_spent = False
        self._unwritten = 0
        """Finished rollouts whose records the sink did not take: given back to the quota."""
        self._serving_error: Exception | None = None
        """What ``serving`` raised: no replica can come back, so nothing launches again."""
        self.stats = OrchestratorStats()
        self._mix = self._normalise(self.config.mix)
        self._started_before_mix: Counter[str] = Counter()
        """Rollouts of each task started before the current mix was set."""
        self._stop = asyncio.Event()
        self._completed: asyncio.Queue[asyncio.Task | None] = asyncio.Queue()
        """Finished jobs in completion order (each job's done callback puts it here); ``None``
        wakes :meth:`run` for a stop. Waiting on this queue costs O(1) per completion, where
        ``asyncio.wait`` over every in-flight job would cost O(in flight)."""
        self._in_flight: dict[asyncio.Task, str] = {}
        self._groups: dict[asyncio.Task, _Group] = {}
        self._counter = 0

    def _normalise(self, mix: Mapping[str, float]) -> dict[str, float]:
        unknown = [name for name in mix if name not in self.tasks]
        if unknown:
            raise ValueError(f"mix names tasks with no task stream: {unknown}; known: {sorted(self.tasks)}")
        total = sum(mix.values())
        return {name: weight / total for name, weight in mix.items() if weight > 0}

    def set_mix(self, mix: Mapping[str, float]) -> None:
        """Change the target shares while running: the rollouts started from now on follow
        them (counted against all earlier starts, a task given more weight would get every
        start until its whole-run share caught up)."""
        self._mix = self._normalise(OrchestratorConfig(mix=dict(mix)).mix)
        self._started_before_mix = Counter({name: c.started for name, c in self.stats.tasks.items()})

    @property
    def mix(self) -> dict[str, float]:
        return dict(self._mix)

    def stop(self) -> None:
        """Ask :meth:`run` to stop: nothing new starts; in-flight rollouts are cut short."""
        self._stop.set()
        self._completed.put_nowait(None)

    def _next_task_name(self) -> str:
        started = {
            name: self.stats.tasks[name].started - self._started_before_mix[name] for name in self._mix
        }
        total = sum(started.values()) + 1
        return max(self._mix, key=lambda name: self._mix[name] * total - started[name])

    def _done(self) -> bool:
        cfg = self.config
        if self._stop.is_set():
            return True
        if cfg.max_rollouts is not None and self.stats.finished >= cfg.max_rollouts:
            return True
        return cfg.target_groups is not None and self.stats.groups_kept >= cfg.target_groups

    def _no_more_launches(self) -> bool:
        """Done, stopped launching from outside (``stop_launching``), or no replica can serve again."""
        if self._done() or self._serving_error is not None:
            return True
        return self.stop_launching is not None and self.stop_launching()

    def _in_service(self) -> bool:
        """``serving()`` (True without it); False for good once it raised (see ``serving``)."""
        if self.serving is None:
            return True
        if self._serving_error is not None:
            return False
        try:
            return self.serving()
        except Exception as exc:
            self._serving_error = exc
            log.error(
                "no engine replica can serve again (%s): nothing more launches; the %d rollouts in "
                "flight run to their end and are written",
                exc,
                len(self._in_flight),
            )
            return False

    def _started(self) -> int:
        return sum(c.started for c in self.stats.tasks.values())

    def _launched_enough(self) -> bool:
        cfg = self.config
        if cfg.max_rollouts is None:
            return False
        if self.quota is not None:
            return self._quota_spent and self._started() + cfg.group_size > self._granted
        return self._started() + cfg.group_size > cfg.max_rollouts

    async def _may_launch(self) -> bool:
        """Whether the quota (if any) grants the next group, claiming a block when it must."""
        cfg = self.config
        if self.quota is None or cfg.max_rollouts is None:
            return True
        if self._started() + cfg.group_size <= self._granted:
            return True
        if not self._quota_spent:
            block = max(cfg.concurrency // cfg.group_size, 1) * cfg.group_size
            try:
                # a cancel waits for the claim, whose grant is given back, not held by no one
                taken = await to_thread_to_the_end(
                    self.quota.claim, block, cfg.group_size, discard=self.quota.release
                )
            except Exception as exc:
                if not self._in_flight:
                    raise
                # storage down past its client's retries: the rollouts in flight finish and
                # are written, and the claim is tried again as each one does
                log.warning(
                    "could not claim rollouts from the run's max_rollouts (%s); launching waits, "
                    "%d rollouts in flight go on",
                    exc,
                    len(self._in_flight),
                )
                return False
            self._granted += taken
            self._quota_spent = taken == 0
        return self._started() + cfg.group_size <= self._granted

    async def _claimed_again(self) -> bool:
        """With nothing left in flight, whether a claim on a quota that refused this
        orchestrator before now grants the next group: other workers give back what they did
        not use (stopped, cut short, lost), and a worker still running takes it up. Claimed
        once each time the orchestrator runs dry, so never in a loop against storage."""
        if self.quota is None or not self._quota_spent or self._no_more_launches():
            return False
        self._quota_spent = False
        return await self._may_launch()

    async def _release_unused(self) -> None:
        """Give back the granted rollouts that did not finish (never launched, cut short, lost)
        and those that finished but whose records the sink did not take."""
        unused = self._granted - self.stats.finished + self._unwritten
        if self.quota is None or unused <= 0:
            return
        try:
            await asyncio.to_thread(self.quota.release, unused)
            self._granted -= unused
        except Exception as exc:  # the run then falls short of max_rollouts by these
            log.warning("could not give back %d unused rollouts of the run's max_rollouts: %s", unused, exc)

    async def _wait_for_trainer(self) -> None:
        """Hold launching while the trainer lags or no replica is in service; rollouts that
        finish meanwhile are written as usual (the pause holds back new work, never finished work)."""
        if self.backlog is None and self.trainer_queue is None and self.serving is None:
            return
        if not self._in_service() and self._serving_error is None:
            log.warning("no engine replica is in service: launching waits for one to be back")
        counted = time.perf_counter()
        try:
            while not self._no_more_launches() and (reason := self._pause_reason()) is not None:
                self.stats.paused = reason
                try:
                    job = await asyncio.wait_for(self._completed.get(), self.config.backpressure_poll_s)
                except TimeoutError:  # the poll's, not a sink's in _collect
                    job = None
                if job is not None:
                    self._collect(job)
                # counted as it goes: a status published during a long pause shows it
                now = time.perf_counter()
                self.stats.paused_s += now - counted
                counted = now
        finally:  # a cancel mid-pause too: a status published after it must not say it waits
            self.stats.paused_s += time.perf_counter() - counted
            self.stats.paused = None

    def _pause_reason(self) -> str | None:
        """Why launching must wait now: the trainer lags or no replica is in service (None: it may launch)."""
        reason = self.backpressure()
        if reason is None and not self._in_service():
            return "no engine replica in service"
        return reason

    def backpressure(self) -> str | None:
        """Why a new rollout must wait now for the trainer (see the module docstring), None when
        it may start. A rollout worker's gateway server asks it too, before it opens a harness's."""
        cfg = self.config
        starved = self.trainer_starved is not None and self.trainer_starved()
        backlog = None if self.backlog is None else self.backlog()
        if backlog is not None and backlog > cfg.max_backlog and not starved:
            return f"backlog {backlog} shards > max_backlog {cfg.max_backlog}: waits for a new weight version"
        queue = None if self.trainer_queue is None else self.trainer_queue()
        limit = cfg.max_trainer_batches
        if queue is not None and limit is not None and queue > limit:
            return f"the trainer holds {queue:.1f} steps' worth untrained > max_trainer_batches {limit:g}"
        return None

    def _launch_group(self) -> _Group:
        name = self._next_task_name()
        try:
            task = next(self.tasks[name])
        except StopIteration:  # raised on, it would end run() as "coroutine raised StopIteration"
            raise ValueError(
                f"the task stream of {name!r} ran out: an orchestrator's task streams must be endless "
                "(itertools.cycle a finite one)"
            ) from None
        size = self.config.group_size
        group = _Group(group_id=uuid.uuid4().hex if size > 1 else "", size=size)
        for _ in range(size):
            self._counter += 1
            request = RolloutRequest(
                task=task,
                group_id=group.group_id or None,
                seed=self.config.seed * SEED_STRIDE + self._counter,
            )
            job = asyncio.create_task(self.service.process(request), name=request.rollout_id)
            job.add_done_callback(self._completed.put_nowait)
            self._in_flight[job] = request.rollout_id
            group.tasks.add(job)
            self._groups[job] = group
            self.stats.tasks[name].started += 1
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self._in_flight))
        return group

    async def run(self) -> OrchestratorStats:
        """Run until a stop condition; returns the counters."""
        try:
            while not self._done():
                while (
                    len(self._in_flight) + self.config.group_size <= self.config.concurrency
                    and not self._no_more_launches()
                    and not self._launched_enough()
                ):
                    await self._wait_for_trainer()
                    # _may_launch may wait on storage: a stop() can land meanwhile
                    if self._no_more_launches() or not await self._may_launch() or self._no_more_launches():
                        break
                    self._launch_group()
                if not self._in_flight:
                    if await self._claimed_again():
                        continue
                    break
                # done while paused (a stop whose wake-up _wait_for_trainer took, or the last group
                # wanted kept): what is in flight is cut short or redundant, not awaited
                if self._done():
                    break
                job = await self._completed.get()
                if job is not None:
                    self._collect(job)
        finally:
            try:
                await self._cancel_in_flight()
            finally:
                try:
                    self.sink.flush()
                finally:
                    await self._release_unused()
        if self._serving_error is not None:
            raise self._serving_error
        return self.stats

    def _collect(self, job: asyncio.Task) -> None:
        rollout_id = self._in_flight.pop(job)
        group = self._groups.pop(job)
        group.tasks.discard(job)
        if job.cancelled():  # not by this orchestrator: _cancel_in_flight counts its own as cut short
            log.warning(
                "rollout %s was cancelled, not by this orchestrator; its group goes on without it", rollout_id
            )
            self.stats.cancelled_elsewhere.append(rollout_id)
            self._lose(group)
            return
        exc = job.exception()
        if exc is not None:
            log.error("rollout %s failed outside the service's classification: %r", rollout_id, exc)
            self._lose(group)
            return
        result: RolloutResult = job.result()
        counters = self.stats.tasks[result.record["task"]]
        counters.finished += 1
        self.stats.finished_rows += len(result.records)
        counters.statuses[result.status] += 1
        if result.reward is not None:
            counters.reward_sum += result.reward
            counters.rewarded += 1
        group.results.append(result)
        if self.config.group_size == 1:
            self._write([result])
        else:
            self._settle(group)
        if self.on_result is not None:  # once the result is kept: an error it raises loses nothing
            self.on_result(result)

    def _lose(self, group: _Group, cut_short: bool = False) -> None:
        """One member of ``group`` will never finish (failed outside the service's
        classification, or ``cut_short`` by a stop)."""
        group.lost += 1
        group.cut_short += cut_short
        self._settle(group)

    def _settle(self, group: _Group) -> None:
        """Finish ``group`` once none of its members is left running. Members it lost leave a
        smaller group, whose finished rollouts are written rather than kept back for ever."""
        if not group.results or len(group.results) + group.lost < group.size:
            return
        if group.lost > group.cut_short:
            log.warning(
                "group %s lost %d of its %d rollouts; its %d finished ones go on as a smaller group",
                group.group_id,
                group.lost,
                group.size,
                len(group.results),
            )
        self._finish_group(group)

    def _finish_group(self, group: _Group) -> None:
        # only env and infra errors are left out: a timeout (no reward) is trained as a failure
        scored = [
            self.trained_reward(r.reward, r.progress)
            for r in group.results
            if r.status not in EXCLUDED_STATUSES
        ]
        uniform = len(set(scored)) <= 1
        if self.config.filter_uniform_groups and uniform:
            self.stats.groups_filtered += 1
            self._write([r for r in group.results if r.status in EXCLUDED_STATUSES])
            return
        self.stats.groups_kept += 1
        self._write(group.results)

    def _write(self, results: list[RolloutResult]) -> None:
        if not results:
            return
        try:
            self.sink.write_many([record for result in results for record in result.records])
        except Exception as exc:
            if not records_kept(exc):
                self._unwritten += len(results)
            raise
        self.stats.written += len(results)

    async def _cancel_in_flight(self) -> None:
        """Cancel the rollouts still running and wait for them all, first: nothing is left
        running (nor its sandbox) whatever happens next. Then, unless the groups wanted are all
        kept (the rest is redundant), one that finished before or despite the cancel is
        collected like any other, not counted as cut short; records that cannot be written are
        logged, and the other rollouts are still collected. A cancel of :meth:`run` meanwhile
        (a stop, then the worker cancelled) does not end the wait: it is raised once they are
        collected."""
        redundant = (
            self.config.target_groups is not None and self.stats.groups_kept >= self.config.target_groups
        )
        jobs = list(self._in_flight)
        cancelled = {job for job in jobs if job.cancel()}  # False for one already done
        interrupted = await wait_through_cancels(jobs)
        for job in jobs:
            if redundant:
                self._in_flight.pop(job)
                self._groups.pop(job)
                self.stats.cancelled_redundant += 1
                if not job.cancelled():
                    job.exception()  # retrieved: what it raised is as redundant as its result
                continue
            rollout_id = self._in_flight[job]
            try:
                if job in cancelled and job.cancelled():
                    self._in_flight.pop(job)
                    self.stats.cut_short.append(rollout_id)
                    self._lose(self._groups.pop(job), cut_short=True)
                else:
                    self._collect(job)
            except Exception:
                log.exception(
                    "could not write the records of rollout %s (or of its group), or its on_result failed",
                    rollout_id,
                )
        if self.stats.cut_short:
            log.info(
                "stopped with %d rollouts cut short%s",
                len(self.stats.cut_short),
                "; the finished members of their groups go on as smaller groups"
                if self.config.group_size > 1
                else "",
            )
        if interrupted:
            raise asyncio.CancelledError
