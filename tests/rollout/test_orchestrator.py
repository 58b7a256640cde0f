"""Orchestrator: mixing ratios converging (also after a change while running), group mode
with DAPO filtering and refill, backpressure, clean stop, and records landing in shards."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading

import pytest
import torch

from envs import registry
from envs.arith import ArithEnv
from envs.base import EnvHostLost, StepResult
from rl.models import TinyModelConfig, build_tiny_model
from rl.processor import ProcessorConfig, combine_reward
from rollout.engines.base import EngineError, SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.gateway import Gateway, GatewayConfig
from rollout.orchestrator import SEED_STRIDE, Orchestrator, OrchestratorConfig
from rollout.router import Router, RouterConfig
from rollout.service import RolloutService, ServiceConfig
from storage.quota import RunQuota
from storage.shards import BackgroundShardWriter, ShardReader, ShardWriter
from tests.rollout.test_service import SlowEnv

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=512
)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny_model(TINY)


class ListSink:
    def __init__(self):
        self.records = []
        self.writes = []
        self.flushes = 0

    def write_many(self, records):
        self.writes.append(len(records))
        self.records.extend(records)

    def flush(self):
        self.flushes += 1


def streams(*names: str):
    return {name: itertools.cycle(registry.task_set(name, "train", seed=0, n=32)) for name in names}


def arith_service(model, tokenizer) -> tuple[TorchEngine, RolloutService]:
    """A rollout service on one TorchEngine replica of ``model``, 4-token turns."""
    engine = TorchEngine(model, tokenizer, name="torch-0")
    gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=512))
    return engine, RolloutService(
        gateway, lambda task: registry.make(task.env), ServiceConfig(max_new_tokens=4)
    )


async def run(
    tiny,
    config,
    tasks,
    sink,
    make_env=None,
    backlog=None,
    during=None,
    trainer_queue=None,
    trainer_starved=None,
    quota=None,
    service_config=None,
    stop_launching=None,
    on_result=None,
    serving=None,
    trained_reward=None,
):
    model, tokenizer = tiny
    engine = TorchEngine(model, tokenizer, name="torch-0")
    gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=512))
    service = RolloutService(
        gateway,
        make_env or (lambda task: registry.make(task.env)),
        service_config or ServiceConfig(max_new_tokens=4),
    )
    orchestrator = Orchestrator(
        service,
        tasks,
        sink,
        config,
        backlog=backlog,
        trainer_queue=trainer_queue,
        trainer_starved=trainer_starved,
        quota=quota,
        stop_launching=stop_launching,
        on_result=on_result,
        serving=serving,
        trained_reward=trained_reward,
    )
    try:
        job = asyncio.create_task(orchestrator.run())
        if during is not None:
            await during(orchestrator)
        return orchestrator, await job
    finally:
        await engine.close()


def test_mix_converges_to_its_targets_and_follows_a_change(tiny):
    async def during(orchestrator):
        while orchestrator.stats.finished < 60:
            await asyncio.sleep(0.01)
        first = {n: c.started for n, c in orchestrator.stats.tasks.items()}
        orchestrator.set_mix({"arith": 1.0, "guess": 1.0})
        during.first = first

    config = OrchestratorConfig(mix={"arith": 3.0, "guess": 1.0}, concurrency=8, max_rollouts=140)
    sink = ListSink()
    orchestrator, stats = asyncio.run(run(tiny, config, streams("arith", "guess"), sink, during=during))
    first = during.first
    assert abs(first["arith"] / (first["arith"] + first["guess"]) - 0.75) < 0.05
    later_arith = stats.tasks["arith"].started - first["arith"]
    later_guess = stats.tasks["guess"].started - first["guess"]
    # the starts after the change follow the new shares: not every one to guess until the
    # whole run's split is 50/50
    assert later_arith + later_guess >= 60
    assert abs(later_arith - later_guess) <= 2, (later_arith, later_guess)
    assert stats.finished == 140 and len(sink.records) == 140 and sink.flushes == 1
    assert orchestrator.mix == {"arith": 0.5, "guess": 0.5}


class CoinEnv(ArithEnv):
    """``arith`` scored by a seeded coin instead of the answer (rewards vary inside a group)."""

    name = "arith"
    flips = itertools.count()

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        self.coin = float(next(self.flips) % 3 == 0)
        return result

    async def evaluate(self) -> float:
        return self.coin


class EvenLosesCoinEnv(CoinEnv):
    """``CoinEnv`` that scores every rollout of a task with an even first operand 0: its
    groups are uniform."""

    async def evaluate(self) -> float:
        return 0.0 if self._require_task().data["a"] % 2 == 0 else self.coin


class PartlyRightEnv(ArithEnv):
    """``arith`` that fails every rollout (reward 0) with partial progress 0.2 or 0.8 by turns."""

    name = "arith"
    made = itertools.count()

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        result.progress = (0.2, 0.8)[next(self.made) % 2]
        return result

    async def evaluate(self) -> float:
        return 0.0


@pytest.mark.parametrize("progress_weight", [0.5, 0.0])
def test_a_group_of_failures_is_uniform_only_if_their_trained_rewards_are(tiny, progress_weight):
    """Rewards 0, 0 with progress 0.2, 0.8 are trained as 0.1, 0.4 under a progress weight of
    0.5 (an informative group, kept), but as 0, 0 with progress scoring off (filtered)."""
    PartlyRightEnv.made = itertools.count()
    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=2, group_size=2, max_rollouts=2)
    processor = ProcessorConfig(progress_weight=progress_weight)
    _, stats = asyncio.run(
        run(
            tiny,
            config,
            streams("arith"),
            sink,
            make_env=lambda task: PartlyRightEnv(),
            trained_reward=functools.partial(combine_reward, config=processor),
        )
    )
    assert sorted(record["progress"] for record in sink.records) == ([0.2, 0.8] if progress_weight else [])
    assert (stats.groups_kept, stats.groups_filtered) == ((1, 0) if progress_weight else (0, 1))


def test_group_mode_filters_uniform_groups_refills_and_cancels_redundant(tiny):
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=8, group_size=4, target_groups=5)
    sink = ListSink()
    _, stats = asyncio.run(
        run(tiny, config, streams("arith"), sink, make_env=lambda task: EvenLosesCoinEnv())
    )
    assert stats.groups_filtered > 0 and stats.groups_kept == 5
    assert len(sink.records) == 20
    assert sink.writes == [4] * 5  # a group in one write, so that it lands in one shard
    groups = {}
    for record in sink.records:
        groups.setdefault(record["group_id"], []).append(record)
    assert len(groups) == 5
    for members in groups.values():
        assert len(members) == 4
        assert len({m["prompt_id"] for m in members}) == 1
        assert len({m["reward"] for m in members}) > 1
    assert stats.cut_short == []
    assert stats.cancelled_redundant == stats.tasks["arith"].started - stats.finished


def test_backpressure_pauses_launching_until_the_trainer_catches_up(tiny):
    backlog = {"shards": 100}

    async def during(orchestrator):
        await asyncio.sleep(0.5)
        during.started_while_paused = sum(c.started for c in orchestrator.stats.tasks.values())
        during.paused_s_while_paused = orchestrator.stats.paused_s  # what a status shows mid-pause
        during.paused_while_paused = orchestrator.stats.as_dict()["paused"]
        backlog["shards"] = 8  # at the limit is not above it
        await until(lambda: orchestrator.stats.tasks["arith"].started > 0)

    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=8, max_backlog=8)
    _, stats = asyncio.run(
        run(tiny, config, streams("arith"), ListSink(), backlog=lambda: backlog["shards"], during=during)
    )
    assert during.started_while_paused == 0 and during.paused_s_while_paused >= 0.2
    # a worker's progress line says it waits and for what, not only a count that stands still
    assert during.paused_while_paused == "backlog 100 shards > max_backlog 8: waits for a new weight version"
    assert stats.finished == 8 and stats.paused_s >= 0.4 and stats.paused is None


def test_a_cancel_mid_pause_leaves_no_pause_reason_in_the_stats(tiny):
    """A status published after the orchestrator's task is cancelled mid-pause (a flow
    cancelled) must not still say that it waits for the trainer."""
    model, tokenizer = tiny

    async def body():
        engine, service = arith_service(model, tokenizer)
        config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_backlog=8)
        orchestrator = Orchestrator(service, streams("arith"), ListSink(), config, backlog=lambda: 100)
        try:
            job = asyncio.create_task(orchestrator.run())
            await until(lambda: orchestrator.stats.paused is not None)
            await asyncio.sleep(0.3)
            job.cancel()
            with pytest.raises(asyncio.CancelledError):
                await job
        finally:
            await engine.close()
        return orchestrator.stats

    stats = asyncio.run(body())
    assert stats.paused is None and stats.as_dict()["paused"] is None
    assert stats.paused_s >= 0.3  # the pause until the cancel is counted


@pytest.mark.parametrize(("starved", "pauses"), [(None, True), (False, True), (True, False)])
def test_the_backlog_pauses_launching_unless_the_trainer_is_starved(tiny, starved, pauses):
    # a trainer that has read everything and is short of a full batch cannot step, so
    # cannot publish: pausing for the backlog then would wait forever
    async def during(orchestrator):
        await asyncio.sleep(0.5)
        during.started = sum(c.started for c in orchestrator.stats.tasks.values())
        orchestrator.stop()

    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_backlog=8)
    asyncio.run(
        run(
            tiny,
            config,
            streams("arith"),
            ListSink(),
            backlog=lambda: 100,
            trainer_queue=lambda: 0.0,
            trainer_starved=None if starved is None else lambda: starved,
            during=during,
        )
    )
    assert (during.started == 0) == pauses


@pytest.mark.parametrize("limit", [2.0, None])
def test_a_full_trainer_queue_pauses_launching_until_it_shrinks(tiny, limit):
    queue = {"batches": 2.5}

    async def during(orchestrator):
        await asyncio.sleep(0.5)
        during.started_while_full = sum(c.started for c in orchestrator.stats.tasks.values())
        during.paused = orchestrator.stats.paused
        queue["batches"] = 2.0  # at the limit is not above it
        await until(lambda: orchestrator.stats.tasks["arith"].started > 0)

    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=8, max_trainer_batches=limit)
    _, stats = asyncio.run(
        run(tiny, config, streams("arith"), ListSink(), trainer_queue=lambda: queue["batches"], during=during)
    )
    assert stats.finished == 8
    if limit is None:  # off: the queue is not looked at
        assert during.started_while_full > 0 and stats.paused_s < 0.4 and during.paused is None
    else:
        assert during.started_while_full == 0 and stats.paused_s >= 0.4
        assert during.paused == "the trainer holds 2.5 steps' worth untrained > max_trainer_batches 2"


def test_the_trainer_queue_limit_must_leave_the_trainer_a_full_batch():
    with pytest.raises(ValueError, match="max_trainer_batches"):
        OrchestratorConfig(mix={"arith": 1.0}, max_trainer_batches=0.5)


def test_target_groups_needs_group_mode():
    # single rollouts form no groups: the target would never be reached and the run never stop
    with pytest.raises(ValueError, match="target_groups counts the groups of group mode.*max_rollouts"):
        OrchestratorConfig(mix={"arith": 1.0}, target_groups=3)


@pytest.mark.parametrize("seed", [-(2**63 // SEED_STRIDE), (2**63 - 1) // SEED_STRIDE])
def test_every_rollout_seed_of_a_valid_base_seed_is_one_the_engines_take(seed):
    base = OrchestratorConfig(mix={"arith": 1.0}, seed=seed).seed * SEED_STRIDE
    SamplingParams(seed=base + 1)  # the first rollout's first turn
    SamplingParams(seed=base + 10**12)  # a turn of the trillionth rollout
    for bad in (seed * 2, seed - 1 if seed < 0 else seed + 1):
        with pytest.raises(ValueError, match="seed"):
            OrchestratorConfig(mix={"arith": 1.0}, seed=bad)


class StuckEnv(ArithEnv):
    name = "arith"

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(3600)


def test_stop_cuts_in_flight_rollouts_short_and_flushes(tiny):
    async def during(orchestrator):
        await until(lambda: orchestrator.stats.peak_in_flight >= 6)
        await asyncio.sleep(0.1)
        orchestrator.stop()

    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=6)
    _, stats = asyncio.run(
        run(tiny, config, streams("arith"), sink, make_env=lambda task: StuckEnv(), during=during)
    )
    assert len(stats.cut_short) == 6 and stats.finished == 0
    assert sink.flushes == 1 and sink.records == []


def test_an_outside_stop_launches_nothing_more_and_lets_the_rollouts_in_flight_finish(tiny):
    """The run's stop signal, set on another thread as the first rollout starts: the two
    launched already finish and are written, no third one launches, and the run ends."""
    stop = threading.Event()

    def make_env(task):
        stop.set()
        return registry.make(task.env)

    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=2, max_rollouts=10)
    _, stats = asyncio.run(
        run(tiny, config, streams("arith"), sink, make_env=make_env, stop_launching=stop.is_set)
    )
    assert stats.tasks["arith"].started == stats.finished == len(sink.records) == 2
    assert stats.cut_short == []


class HeldQuota(RunQuota):
    """A run quota whose claims wait until the test lets them through."""

    def __init__(self, *args):
        super().__init__(*args)
        self.claiming = threading.Event()
        self.go = threading.Event()
        self.claimed_once = threading.Event()

    def claim(self, wanted, step=1):
        self.claiming.set()
        self.go.wait(30)
        try:
            return super().claim(wanted, step)
        finally:
            self.claimed_once.set()


def test_a_stop_during_a_quota_claim_launches_nothing_and_gives_the_claim_back(tiny, local_store):
    quota = HeldQuota(local_store, "rollouts", 8)

    async def during(orchestrator):
        await until(quota.claiming.is_set)
        orchestrator.stop()
        quota.go.set()

    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=8)
    _, stats = asyncio.run(run(tiny, config, streams("arith"), ListSink(), quota=quota, during=during))
    assert sum(c.started for c in stats.tasks.values()) == 0 and stats.cut_short == []
    assert quota.claimed() == 0


def test_a_cancel_during_a_quota_claim_gives_the_claim_back(tiny, local_store):
    model, tokenizer = tiny
    quota = HeldQuota(local_store, "rollouts", 8)

    async def body():
        engine, service = arith_service(model, tokenizer)
        config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=8)
        orchestrator = Orchestrator(service, streams("arith"), ListSink(), config, quota=quota)
        try:
            job = asyncio.create_task(orchestrator.run())
            await until(quota.claiming.is_set)
            job.cancel()
            quota.go.set()
            with pytest.raises(asyncio.CancelledError):
                await job
            assert await asyncio.to_thread(quota.claimed_once.wait, 30)
        finally:
            await engine.close()

    asyncio.run(body())
    assert quota.claimed() == 0


class FailingQuota(RunQuota):
    """A run quota whose claims numbered in ``failing`` (0 = the first) fail as storage would."""

    def __init__(self, *args, failing):
        super().__init__(*args)
        self.failing = failing
        self.calls = 0

    def claim(self, wanted, step=1):
        self.calls += 1
        if self.calls - 1 in self.failing:
            raise OSError("storage unreachable")
        return super().claim(wanted, step)


def test_a_failed_quota_claim_waits_for_the_rollouts_in_flight_and_is_tried_again(tiny, local_store):
    quota = FailingQuota(local_store, "rollouts", 8, failing={1, 2})
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=8)
    sink = ListSink()
    _, stats = asyncio.run(run(tiny, config, streams("arith"), sink, quota=quota))
    assert quota.calls >= 4
    assert stats.finished == 8 and len(sink.records) == 8 and stats.cut_short == []
    assert quota.claimed() == 8


def test_a_failed_quota_claim_with_nothing_in_flight_ends_the_run_with_its_error(tiny, local_store):
    quota = FailingQuota(local_store, "rollouts", 8, failing={0})
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=8)
    with pytest.raises(OSError, match="storage unreachable"):
        asyncio.run(run(tiny, config, streams("arith"), ListSink(), quota=quota))
    assert quota.claimed() == 0


class GatedEnv(ArithEnv):
    """``arith`` whose every answer waits for a permit from the test."""

    name = "arith"
    permits: asyncio.Semaphore

    async def step(self, action: str) -> StepResult:
        await self.permits.acquire()
        return await super().step(action)


class RecordedQuota(RunQuota):
    """A run quota that keeps what each of its claims granted."""

    def __init__(self, *args):
        super().__init__(*args)
        self.granted = []

    def claim(self, wanted, step=1):
        self.granted.append(super().claim(wanted, step))
        return self.granted[-1]


async def until(condition) -> None:
    """Waits until ``condition()`` holds (fails after 60 s)."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.01)


def test_a_worker_refused_a_claim_takes_up_what_another_gave_back_before_it_ran_dry(tiny, local_store):
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=8)
    quota = RecordedQuota(local_store, "rollouts", 8)
    workers = {}

    def worker(name, make_env, quota):
        async def keep(orchestrator):
            workers[name] = orchestrator

        return asyncio.create_task(
            run(tiny, config, streams("arith"), ListSink(), make_env=make_env, quota=quota, during=keep)
        )

    async def body():
        GatedEnv.permits = asyncio.Semaphore(0)
        waiting = worker("waiting", lambda task: GatedEnv(), quota)
        await until(lambda: "waiting" in workers and workers["waiting"].stats.peak_in_flight == 4)
        stopped = worker("stopped", lambda task: StuckEnv(), RunQuota(local_store, "rollouts", 8))
        await until(lambda: "stopped" in workers and workers["stopped"].stats.peak_in_flight == 4)
        GatedEnv.permits.release()
        await until(lambda: quota.granted == [4, 0])
        workers["stopped"].stop()
        _, stopped_stats = await stopped
        for _ in range(16):
            GatedEnv.permits.release()
        _, waiting_stats = await waiting
        return stopped_stats, waiting_stats

    stopped_stats, waiting_stats = asyncio.run(body())
    assert len(stopped_stats.cut_short) == 4 and stopped_stats.finished == 0
    assert waiting_stats.finished == 8
    assert quota.claimed() == 8


def test_records_land_in_committed_shards(tiny, local_store):
    writer = ShardWriter(local_store, "worker-0", flush_records=10)
    config = OrchestratorConfig(mix={"arith": 1.0, "guess": 1.0}, concurrency=8, max_rollouts=25)
    _, stats = asyncio.run(run(tiny, config, streams("arith", "guess"), writer))
    writer.close()
    reader = ShardReader(local_store)
    shards, _ = reader.poll()
    rows = sum(reader.read(s).num_rows for s in shards)
    assert rows == stats.written == 25


def test_rollouts_finished_while_paused_are_written_and_a_stop_keeps_them(tiny):
    lagging = {"on": False}

    async def during(orchestrator):
        await until(lambda: orchestrator.stats.peak_in_flight >= 4)
        lagging["on"] = True  # launching pauses with 4 in flight, each done 0.5 s later
        for _ in range(1000):
            if orchestrator.stats.written == 4:
                break
            await asyncio.sleep(0.02)
        during.written_while_paused = orchestrator.stats.written
        orchestrator.stop()

    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_trainer_batches=2.0)
    _, stats = asyncio.run(
        run(
            tiny,
            config,
            streams("arith"),
            sink,
            make_env=lambda task: SlowEnv(),
            trainer_queue=lambda: 10.0 if lagging["on"] else 0.0,
            during=during,
        )
    )
    assert during.written_while_paused == 4
    assert stats.finished == len(sink.records) == 4 and stats.cut_short == []


def test_a_stop_while_launching_is_paused_cuts_the_rollouts_in_flight_short(tiny):
    # the pause takes the stop's wake-up off the queue; run() must not then wait for a
    # rollout that never finishes
    reads = []

    def trainer_queue():
        # the first launch goes ahead, then the trainer lags
        reads.append(None)
        return 0.0 if len(reads) == 1 else 10.0

    async def during(orchestrator):
        await until(lambda: len(reads) > 1)  # paused, with one rollout in flight
        orchestrator.stop()

    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=2)
    _, stats = asyncio.run(
        asyncio.wait_for(
            run(
                tiny,
                config,
                streams("arith"),
                ListSink(),
                make_env=lambda task: StuckEnv(),
                trainer_queue=trainer_queue,
                during=during,
            ),
            60,
        )
    )
    assert len(stats.cut_short) == 1 and stats.finished == 0


def test_a_rollout_done_when_the_stop_comes_is_collected_not_cut_short(tiny):
    # a stop that lands between a rollout finishing and run() collecting it
    model, tokenizer = tiny
    sink = ListSink()

    async def body():
        engine, service = arith_service(model, tokenizer)
        orchestrator = Orchestrator(service, streams("arith"), sink, OrchestratorConfig(mix={"arith": 1.0}))
        try:
            (job,) = orchestrator._launch_group().tasks
            await asyncio.wait_for(asyncio.shield(job), 60)
            await orchestrator._cancel_in_flight()
        finally:
            await engine.close()
        return orchestrator.stats

    stats = asyncio.run(body())
    assert stats.finished == len(sink.records) == 1 and stats.cut_short == []


class SlowCloseEnv(ArithEnv):
    """``arith`` whose close sets ``closing`` and then takes 0.5 s (a sandbox shutting down)."""

    name = "arith"

    def __init__(self, closing: asyncio.Event):
        super().__init__()
        self.closing = closing

    async def close(self) -> None:
        self.closing.set()
        await asyncio.sleep(0.5)
        await super().close()


def test_a_stop_while_a_finished_rollout_closes_its_env_still_writes_it(tiny):
    closing = asyncio.Event()

    async def during(orchestrator):
        await asyncio.wait_for(closing.wait(), 60)  # EVAL is over: its record is complete
        orchestrator.stop()

    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=1, max_rollouts=1)
    _, stats = asyncio.run(
        run(tiny, config, streams("arith"), sink, make_env=lambda task: SlowCloseEnv(closing), during=during)
    )
    assert stats.written == stats.finished == len(sink.records) == 1 and stats.cut_short == []
    assert sink.flushes == 1


class HeldCloseEnv(ArithEnv):
    """``arith`` whose close sets ``closing`` and waits for ``release`` (a sandbox shutting down)."""

    name = "arith"

    def __init__(self, closing: asyncio.Event, release: asyncio.Event):
        super().__init__()
        self.closing, self.release = closing, release

    async def close(self) -> None:
        self.closing.set()
        await self.release.wait()
        await super().close()


def test_run_cancelled_while_its_stop_waits_for_a_finished_rollout_still_writes_it(tiny):
    """A stop waits for the rollouts it cancelled; run() cancelled meanwhile (a worker's stop,
    then its flow run cancelled) still waits for them, writes the one that finished, and
    then raises its cancel: nothing is lost nor left running."""
    model, tokenizer = tiny
    sink = ListSink()
    closing, release = asyncio.Event(), asyncio.Event()

    async def body():
        engine = TorchEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=512))
        service = RolloutService(
            gateway, lambda task: HeldCloseEnv(closing, release), ServiceConfig(max_new_tokens=4)
        )
        config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=1, max_rollouts=1)
        orchestrator = Orchestrator(service, streams("arith"), sink, config)
        try:
            runner = asyncio.create_task(orchestrator.run())
            await asyncio.wait_for(closing.wait(), 60)  # EVAL is over: its record is complete
            (job,) = orchestrator._in_flight
            orchestrator.stop()
            await until(job.cancelling)  # the stop cancelled it and waits for it
            runner.cancel()
            await asyncio.sleep(0.05)
            release.set()
            (outcome,) = await asyncio.gather(runner, return_exceptions=True)
            return outcome, job.done(), orchestrator.stats, service.status()
        finally:
            await engine.close()

    outcome, job_done, stats, status = asyncio.run(body())
    assert isinstance(outcome, asyncio.CancelledError)
    assert job_done and status["in_flight"] == 0
    assert stats.written == stats.finished == len(sink.records) == 1 and stats.cut_short == []
    assert sink.flushes == 1


def test_a_rollout_cancelled_by_someone_else_is_logged_and_counted(tiny, caplog):
    async def during(orchestrator):
        await until(lambda: orchestrator.service.status()["in_flight"])
        (rollout_id,) = orchestrator._in_flight.values()
        during.rollout_id = rollout_id
        assert orchestrator.service.cancel(rollout_id)  # the service's cancel, not a stop

    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=1, max_rollouts=1)
    _, stats = asyncio.run(
        run(tiny, config, streams("arith"), sink, make_env=lambda task: StuckEnv(), during=during)
    )
    assert stats.cancelled_elsewhere == [during.rollout_id] and stats.cut_short == []
    assert stats.as_dict()["cancelled_elsewhere"] == 1 and stats.finished == 0
    assert f"rollout {during.rollout_id} was cancelled, not by this orchestrator" in caplog.text


class BrokenSink(ListSink):
    def write_many(self, records):
        self.writes.append(len(records))
        raise OSError("the store is down (injected)")


def test_a_sink_that_fails_ends_the_run_with_its_error_after_cancelling_and_flushing(tiny, caplog):
    """Two rollouts finish before run() collects either, a third never does: writing the first
    fails, and still the third is cancelled, the second is tried, and the sink is flushed."""
    model, tokenizer = tiny
    sink = BrokenSink()
    envs = iter([ArithEnv(), ArithEnv(), StuckEnv()])

    async def body():
        engine = TorchEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=512))
        service = RolloutService(gateway, lambda task: next(envs), ServiceConfig(max_new_tokens=4))
        config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=3, max_rollouts=3)
        orchestrator = Orchestrator(service, streams("arith"), sink, config)
        try:
            jobs = [job for _ in range(3) for job in orchestrator._launch_group().tasks]
            await asyncio.wait_for(asyncio.wait(jobs[:2]), 60)
            with pytest.raises(OSError, match="the store is down"):
                await orchestrator.run()
            return orchestrator.stats, jobs, service.status()
        finally:
            await engine.close()

    stats, jobs, status = asyncio.run(body())
    assert jobs[2].cancelled() and stats.cut_short == [jobs[2].get_name()]
    assert status["in_flight"] == 0
    assert sink.writes == [1, 1] and sink.flushes == 1 and stats.written == 0
    assert f"could not write the records of rollout {jobs[1].get_name()}" in caplog.text


def store_down(*args):
    raise OSError("the store is down (injected)")


def test_rollouts_a_failing_sink_did_not_write_are_given_back_to_the_runs_quota(tiny, local_store):
    """A sink that fails ends the run: the rollouts whose records it did not take were counted
    finished and kept from the run's quota, so its other workers (and its restart) fell short
    of max_rollouts by them."""
    quota = RunQuota(local_store, "rollouts", 8)
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=8)
    with pytest.raises(OSError, match="the store is down"):
        asyncio.run(run(tiny, config, streams("arith"), BrokenSink(), quota=quota))
    assert quota.claimed() == 0


@pytest.mark.parametrize("writer_class", [ShardWriter, BackgroundShardWriter])
def test_rollouts_a_shard_writer_kept_from_its_failed_flush_still_count_in_the_runs_quota(
    tiny, local_store, monkeypatch, writer_class
):
    """A ShardWriter whose flush fails keeps the records of the write that set it off, and its
    close commits them: given back as well, the run would pass max_rollouts by them. (A
    background one, a rollout worker's, raises once more than one record waits.)"""
    quota = RunQuota(local_store, "rollouts", 8)
    background = {"max_unsaved_records": 1} if writer_class is BackgroundShardWriter else {}
    writer = writer_class(local_store, "worker-0", flush_records=1, **background)
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=8)
    with monkeypatch.context() as patch:
        patch.setattr(writer.tables, "append", store_down)
        with pytest.raises(OSError, match="the store is down"):
            asyncio.run(run(tiny, config, streams("arith"), writer, quota=quota))
    writer.close()
    reader = ShardReader(local_store)
    committed = sum(reader.read(shard).num_rows for shard in reader.poll()[0])
    assert quota.claimed() == committed >= 1


class TimingOutSink(ListSink):
    def write_many(self, records):
        self.writes.append(len(records))
        raise TimeoutError("the store timed out (injected)")


def test_a_sink_that_times_out_while_launching_is_paused_ends_the_run_with_its_error(tiny):
    """A rollout collected while launching waits for the trainer is written as any other: a
    TimeoutError of the sink's is its failure, not the pause's poll running out."""
    reads = []

    def trainer_queue():
        reads.append(None)  # the first launch goes ahead, then the trainer lags
        return 0.0 if len(reads) == 1 else 10.0

    sink = TimingOutSink()

    async def during(orchestrator):
        await until(lambda: sink.writes)
        await asyncio.sleep(0.5)  # a few polls of the pause
        orchestrator.stop()

    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=2, backpressure_poll_s=0.05)
    with pytest.raises(TimeoutError, match="injected"):
        asyncio.run(run(tiny, config, streams("arith"), sink, trainer_queue=trainer_queue, during=during))
    assert sink.writes == [1] and sink.flushes == 1


def test_on_result_gets_each_finished_rollout_once_with_the_result_written(tiny):
    reported = []
    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=3, max_rollouts=7)
    _, stats = asyncio.run(run(tiny, config, streams("arith"), sink, on_result=reported.append))
    assert stats.finished == stats.written == stats.finished_rows == 7
    assert len({result.rollout_id for result in reported}) == 7
    assert [result.record for result in reported] == sink.records


def test_an_on_result_that_raises_ends_the_run_with_its_error_and_loses_no_finished_rollout(tiny, caplog):
    """Two rollouts finish before run() collects either, a third never does; ``on_result``
    raises at each: the run ends with its error, the third is cancelled, and both finished
    rollouts are written (the first was counted finished and never written) and flushed."""
    model, tokenizer = tiny
    sink = ListSink()
    envs = iter([ArithEnv(), ArithEnv(), StuckEnv()])
    reported = []

    def on_result(result) -> None:
        reported.append(result)
        raise RuntimeError("the progress report failed (injected)")

    async def body():
        engine = TorchEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=512))
        service = RolloutService(gateway, lambda task: next(envs), ServiceConfig(max_new_tokens=4))
        config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=3, max_rollouts=3)
        orchestrator = Orchestrator(service, streams("arith"), sink, config, on_result=on_result)
        try:
            jobs = [job for _ in range(3) for job in orchestrator._launch_group().tasks]
            await asyncio.wait_for(asyncio.wait(jobs[:2]), 60)
            # bounded: were the error not to end it, the stuck rollout would keep it running
            with pytest.raises(RuntimeError, match="the progress report failed"):
                await asyncio.wait_for(orchestrator.run(), 60)
            return orchestrator.stats, jobs, service.status()
        finally:
            await engine.close()

    stats, jobs, status = asyncio.run(body())
    assert jobs[2].cancelled() and stats.cut_short == [jobs[2].get_name()] and status["in_flight"] == 0
    assert sorted(result.rollout_id for result in reported) == sorted(job.get_name() for job in jobs[:2])
    assert [result.record for result in reported] == sink.records and sink.flushes == 1
    assert stats.finished == stats.written == 2


class OneStuckInFour(CoinEnv):
    """Every fourth environment made never answers; the others score a seeded coin."""

    made = itertools.count()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stuck = next(self.made) % 4 == 3

    async def step(self, action: str) -> StepResult:
        if self.stuck:
            await asyncio.sleep(3600)
        return await super().step(action)


def test_a_stop_writes_the_finished_members_of_a_group_it_cuts_short(tiny, caplog):
    """The stop says so once, at INFO: a group it cut short has lost nothing to warn about."""
    caplog.set_level(logging.INFO, logger="rollout.orchestrator")

    async def during(orchestrator):
        while orchestrator.stats.finished < 3:
            await asyncio.sleep(0.01)
        orchestrator.stop()

    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, group_size=4, filter_uniform_groups=False)
    OneStuckInFour.made = itertools.count()
    _, stats = asyncio.run(
        run(tiny, config, streams("arith"), sink, make_env=lambda task: OneStuckInFour(), during=during)
    )
    assert len(stats.cut_short) == 1 and stats.finished == 3
    assert sink.writes == [3] and stats.groups_kept == 1  # one write: the group stays in one shard
    assert len({record["group_id"] for record in sink.records}) == 1
    orchestrator_logs = [r for r in caplog.records if r.name == "rollout.orchestrator"]
    assert [r.levelname for r in orchestrator_logs] == ["INFO"]
    assert "1 rollouts cut short; the finished members of their groups go on as smaller groups" in caplog.text


def test_a_group_member_failing_outside_the_service_leaves_the_others_written(tiny, monkeypatch, caplog):
    calls = itertools.count()
    process = RolloutService.process

    async def failing_second(self, request):
        if next(calls) == 1:
            raise RuntimeError("a bug in the service (injected)")
        return await process(self, request)

    monkeypatch.setattr(RolloutService, "process", failing_second)
    sink = ListSink()
    config = OrchestratorConfig(
        mix={"arith": 1.0}, concurrency=4, group_size=4, max_rollouts=4, filter_uniform_groups=False
    )
    _, stats = asyncio.run(run(tiny, config, streams("arith"), sink, make_env=lambda task: CoinEnv()))
    assert stats.finished == 3 and stats.cut_short == []
    assert sink.writes == [3] and stats.groups_kept == 1
    assert "lost 1 of its 4 rollouts; its 3 finished ones go on as a smaller group" in caplog.text


class OneTimesOutInFour(OneStuckInFour):
    """Every fourth environment made never answers (its rollout times out); the others score ``score``."""

    score = 1.0

    async def evaluate(self) -> float:
        return self.score


@pytest.mark.parametrize("others", [1.0, 0.0])
def test_a_group_whose_members_all_scored_alike_but_one_timed_out_is_scored_with_it_as_0(
    tiny, others, monkeypatch
):
    # the trainer trains a timeout as reward 0: rewards 1, 1, 1, 0 are an informative group,
    # 0, 0, 0, 0 a uniform one
    monkeypatch.setattr(OneTimesOutInFour, "score", others)
    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, group_size=4, max_rollouts=4)
    OneStuckInFour.made = itertools.count()
    _, stats = asyncio.run(
        run(
            tiny,
            config,
            streams("arith"),
            sink,
            make_env=lambda task: OneTimesOutInFour(),
            service_config=ServiceConfig(max_new_tokens=4, timeout_s=5),
        )
    )
    if others == 0.0:
        assert stats.groups_kept == 0 and stats.groups_filtered == 1 and sink.records == []
        return
    assert stats.groups_kept == 1 and stats.groups_filtered == 0
    rewards = sorted((record["status"] == "timeout", record["reward"]) for record in sink.records)
    assert rewards == [(False, 1.0)] * 3 + [(True, None)]


class OneFailsInFour(CoinEnv):
    """Every fourth environment made fails: the first such loses its host (``infra_error``), the
    next raises (``env_error``); the others score 1."""

    made = itertools.count()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.index = next(self.made)

    async def step(self, action: str) -> StepResult:
        if self.index == 3:
            raise EnvHostLost("the env's host died (injected)")
        if self.index == 7:
            raise RuntimeError("a bug in the env (injected)")
        return await super().step(action)

    async def evaluate(self) -> float:
        return 1.0


def test_a_group_uniform_but_for_an_errored_member_is_filtered_and_only_its_errored_member_written(tiny):
    """Env and infra errors are never trained on, so they leave a group's rewards 1, 1, 1
    uniform (counted as reward 0 it would be kept); of a filtered group only the errored rows
    are written, for the run's failure counts: an env that crashed as well as a lost host."""
    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, group_size=4, max_rollouts=8)
    OneFailsInFour.made = itertools.count()
    _, stats = asyncio.run(run(tiny, config, streams("arith"), sink, make_env=lambda task: OneFailsInFour()))
    statuses = stats.tasks["arith"].statuses
    assert stats.finished == 8 and statuses["infra_error"] == 1 and statuses["env_error"] == 1
    assert stats.groups_filtered == 2 and stats.groups_kept == 0
    assert sink.writes == [1, 1]
    assert [record["status"] for record in sink.records] == ["infra_error", "env_error"]
    assert "a bug in the env (injected)" in sink.records[1]["error"]


def test_each_start_goes_to_the_task_furthest_below_its_share(tiny):
    # one at a time, so the records come in start order: guess (the larger share) goes first,
    # then arith once guess is a full share ahead of it
    config = OrchestratorConfig(mix={"arith": 1.0, "guess": 3.0}, concurrency=1, max_rollouts=4)
    sink = ListSink()
    asyncio.run(run(tiny, config, streams("arith", "guess"), sink))
    assert [record["task"] for record in sink.records] == ["guess", "arith", "guess", "guess"]


def test_a_task_weighted_zero_is_left_out_of_the_mix():
    orchestrator = Orchestrator(
        None, streams("arith", "guess"), ListSink(), OrchestratorConfig(mix={"arith": 1.0, "guess": 0.0})
    )
    assert orchestrator.mix == {"arith": 1.0}
    orchestrator.set_mix({"arith": 0.0, "guess": 2.0})
    assert orchestrator.mix == {"guess": 1.0}


def test_launching_waits_while_no_engine_replica_is_in_service(tiny, caplog):
    in_service = {"on": False}

    async def during(orchestrator):
        await asyncio.sleep(0.5)
        during.started = sum(c.started for c in orchestrator.stats.tasks.values())
        during.paused = orchestrator.stats.paused
        in_service["on"] = True

    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=4)
    with caplog.at_level(logging.WARNING, logger="rollout.orchestrator"):
        _, stats = asyncio.run(
            run(tiny, config, streams("arith"), ListSink(), serving=lambda: in_service["on"], during=during)
        )
    assert during.started == 0 and during.paused == "no engine replica in service"
    assert "no engine replica is in service" in caplog.text
    assert stats.finished == 4 and stats.paused is None


class HeldEnv(ArithEnv):
    """``arith`` that stops at its ``gate`` (``reset``, ``step`` or ``evaluate``) until the
    test lets it go on; ``arrived[gate]`` is set once it waits there."""

    name = "arith"

    def __init__(self, gate: str, arrived: dict[str, asyncio.Event], go: dict[str, asyncio.Event]):
        super().__init__()
        self.gate, self.arrived, self.go = gate, arrived, go

    async def _at(self, point: str) -> None:
        if point == self.gate:
            self.arrived[point].set()
            await self.go[point].wait()

    async def reset(self, task):
        await self._at("reset")
        return await super().reset(task)

    async def step(self, action: str) -> StepResult:
        await self._at("step")
        return await super().step(action)

    async def evaluate(self) -> float:
        await self._at("evaluate")
        return await super().evaluate()


def test_with_every_replica_out_for_good_the_rollouts_in_flight_run_to_their_end_and_are_written(tiny):
    """The only replica leaves service and nothing can bring it back (no health check:
    ``serving`` raises) while three rollouts are in flight: one scoring its episode, one in its
    last env step, one resetting its env. The first two need no model turn: they finish and
    are written; the third's turn finds no replica and it is written as an infra_error. The
    orchestrator cancelled both finished ones as it raised; now nothing new launches and
    the run ends with the error once the rollouts in flight have ended."""
    model, tokenizer = tiny
    gates = ["evaluate", "step", "reset"]
    role: dict[str, str] = {}
    sink = ListSink()
    raised = []

    async def body():
        arrived = {gate: asyncio.Event() for gate in gates}
        go = {gate: asyncio.Event() for gate in gates}
        waiting = iter(gates)

        def make_env(task):
            role[task.id] = next(waiting)
            return HeldEnv(role[task.id], arrived, go)

        engine = TorchEngine(model, tokenizer, name="torch-0")
        router = Router([engine], RouterConfig(health_check_s=None))
        gateway = Gateway(router, tokenizer, GatewayConfig(max_context_tokens=512))
        service = RolloutService(gateway, make_env, ServiceConfig(max_new_tokens=4))

        def serving() -> bool:  # as RolloutWorker.serving with no health check
            if router.replicas:
                return True
            raised.append(True)
            raise EngineError("every engine replica is out of service and none comes back")

        config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=3)
        orchestrator = Orchestrator(service, streams("arith"), sink, config, serving=serving)
        try:
            job = asyncio.create_task(orchestrator.run())
            for gate in gates:
                await asyncio.wait_for(arrived[gate].wait(), 60)
            router.take_down("torch-0")
            go["reset"].set()
            await until(lambda: raised)
            go["step"].set()
            go["evaluate"].set()
            with pytest.raises(EngineError, match="none comes back"):
                await asyncio.wait_for(job, 60)
            return orchestrator.stats
        finally:
            await engine.close()

    stats = asyncio.run(body())
    assert stats.cut_short == [] and stats.tasks["arith"].started == 3
    statuses = {role[record["prompt_id"]]: record["status"] for record in sink.records}
    assert statuses.keys() == set(gates) and statuses["reset"] == "infra_error"
    assert statuses["evaluate"] in ("ok", "truncated") and statuses["step"] in ("ok", "truncated")
    assert sink.flushes == 1 and len(raised) == 1


def test_rollout_seeds_count_up_from_the_base_seeds_stride(tiny):
    model, tokenizer = tiny
    seeds = []

    async def body():
        engine, service = arith_service(model, tokenizer)
        process = service.process

        async def recorded(request):
            seeds.append(request.seed)
            return await process(request)

        service.process = recorded
        config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=1, max_rollouts=3, seed=3)
        try:
            await Orchestrator(service, streams("arith"), ListSink(), config).run()
        finally:
            await engine.close()

    asyncio.run(body())
    assert seeds == [3 * SEED_STRIDE + 1, 3 * SEED_STRIDE + 2, 3 * SEED_STRIDE + 3]


def test_groups_of_two_share_a_group_id(tiny):
    config = OrchestratorConfig(
        mix={"arith": 1.0}, concurrency=2, group_size=2, max_rollouts=4, filter_uniform_groups=False
    )
    sink = ListSink()
    asyncio.run(run(tiny, config, streams("arith"), sink))
    ids = [record["group_id"] for record in sink.records]
    assert len(ids) == 4 and all(ids) and len(set(ids)) == 2


class UnreleasableQuota(RunQuota):
    """A run quota whose storage is unreachable when rollouts are given back."""

    def release(self, unused):
        raise OSError("storage unreachable")


def test_unused_rollouts_that_cannot_be_given_back_are_logged_and_the_run_still_ends(
    tiny, local_store, caplog
):
    quota = UnreleasableQuota(local_store, "rollouts", 8)

    async def during(orchestrator):
        await until(lambda: orchestrator.stats.peak_in_flight == 4)
        orchestrator.stop()

    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, max_rollouts=8)
    with caplog.at_level(logging.WARNING, logger="rollout.orchestrator"):
        _, stats = asyncio.run(
            run(
                tiny,
                config,
                streams("arith"),
                ListSink(),
                make_env=lambda task: StuckEnv(),
                quota=quota,
                during=during,
            )
        )
    assert len(stats.cut_short) == 4
    assert "could not give back 4 unused rollouts" in caplog.text
    assert quota.claimed() == 4


def test_a_mix_naming_a_task_with_no_stream_is_refused():
    config = OrchestratorConfig(mix={"arith": 1.0, "nosuch": 1.0})
    with pytest.raises(ValueError, match=r"mix names tasks with no task stream: \['nosuch'\]"):
        Orchestrator(None, streams("arith"), ListSink(), config)


class HostAlwaysLost(ArithEnv):
    name = "arith"

    async def step(self, action: str) -> StepResult:
        raise EnvHostLost("the env's host died (injected)")


def test_a_group_whose_members_all_errored_is_filtered_with_its_infra_errors_written(tiny):
    # nothing in it is trained on, so it has nothing to teach: not a kept group
    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=4, group_size=4, max_rollouts=4)
    _, stats = asyncio.run(run(tiny, config, streams("arith"), sink, make_env=lambda task: HostAlwaysLost()))
    assert stats.groups_filtered == 1 and stats.groups_kept == 0
    assert sink.writes == [4] and {record["status"] for record in sink.records} == {"infra_error"}


def test_rollouts_a_stop_cuts_short_are_not_counted_as_redundant_once_the_target_is_kept(tiny):
    """Two groups of four, each with one member stuck; a stop before ``target_groups`` (1) is
    kept cuts both stuck members short and writes both groups, the first reaching the target:
    nothing was cancelled as redundant, and the result must not say so."""

    async def during(orchestrator):
        while orchestrator.stats.finished < 6:
            await asyncio.sleep(0.01)
        orchestrator.stop()

    sink = ListSink()
    config = OrchestratorConfig(
        mix={"arith": 1.0},
        concurrency=8,
        group_size=4,
        target_groups=1,
        filter_uniform_groups=False,
        max_rollouts=8,
    )
    OneStuckInFour.made = itertools.count()
    _, stats = asyncio.run(
        run(tiny, config, streams("arith"), sink, make_env=lambda task: OneStuckInFour(), during=during)
    )
    assert len(stats.cut_short) == 2 and stats.groups_kept == 2 and sink.writes == [3, 3]
    assert stats.cancelled_redundant == 0


def test_a_task_stream_that_runs_out_ends_the_run_saying_which(tiny):
    """``tasks`` must be endless; one that is not ends the run with an error naming it, after
    its rollouts are written, not with Python's 'coroutine raised StopIteration'."""
    sink = ListSink()
    config = OrchestratorConfig(mix={"arith": 1.0}, concurrency=1, max_rollouts=4)
    finite = {"arith": iter(registry.task_set("arith", "train", seed=0, n=2))}
    with pytest.raises(ValueError, match="the task stream of 'arith' ran out"):
        asyncio.run(run(tiny, config, finite, sink))
    assert len(sink.records) == 2 and sink.flushes == 1
