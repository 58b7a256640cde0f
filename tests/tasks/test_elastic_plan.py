"""The elastic controller's moves take effect across the run's storage: the trainer side
decides over a rollout worker's real engine replicas from the status the worker publishes,
publishes a plan, and the worker drains its replicas by it through its router."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flows.config import ElasticRunConfig, RunConfig
from rl.models import ensure_base_version
from rollout.elastic import ElasticConfig, PolicyInputs
from rollout.elastic_plan import ElasticPlanner
from rollout.engines.base import SamplingParams
from rollout.router import Router
from rollout.worker import RolloutWorker
from storage.config import RunStore, StorageConfig
from storage.status import (
    ELASTIC_PLAN_NAME,
    ELASTIC_PLAN_PREFIX,
    ElasticPlan,
    ElasticPlanBoard,
    RolloutStatus,
    RolloutStatusBoard,
    TrainerStatusBoard,
)
from storage.tables import Tables
from storage.weights import WeightStore
from tasks.process import run_processor
from tasks.rollout import router_config, run_rollouts, status_object
from tasks.train import keep_decision, run_trainer
from tests.conftest import published_by
from tests.rl.test_trainer import TINY, config, make_trajectories, write_shards
from tests.rollout.test_elastic_plan import status as replica_status

WAIT_S = 120.0
"""A bound on every poll, never reached unless something hangs."""

SATURATED = PolicyInputs(unconsumed_shards=5, engine_queue_depth=0, trainer_idle=0.0)


def two_replica_worker(tmp_path, run_id: str, **options) -> RolloutWorker:
    """:func:`make_worker` of a run of two engine replicas in ``tmp_path``, its base version published."""
    run = RunConfig(run_id=run_id, storage=StorageConfig(root=str(tmp_path / "runs")), engine={"replicas": 2})
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    return make_worker(store, run, **options)


def make_worker(store: RunStore, run: RunConfig, **options) -> RolloutWorker:
    """Rollout worker ``w0`` of ``run``'s engines, gateway, service and mix, on ``store``."""
    return RolloutWorker(
        store,
        "w0",
        engine=run.engine,
        gateway=run.gateway,
        service=run.service,
        orchestrator=run.orchestrator,
        env_configs={name: run.env_config(name) for name in run.orchestrator.mix},
        **options,
    )


async def until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_worker_drains_the_replica_the_trainer_plans_and_hands_it_over_once_empty(store, caplog):
    """On a local folder and on the S3 server: the plan, the statuses and the weights the
    worker loads all go through the run's storage."""
    run = RunConfig(engine={"replicas": 2}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 4})
    ensure_base_version(WeightStore(store), TINY)
    worker = make_worker(store, run, plan_poll_s=0.01)
    statuses, plans = RolloutStatusBoard(store), ElasticPlanBoard(store)
    planner = ElasticPlanner(ElasticConfig(sessions_per_replica=16, headroom_slots=0, cooldown_s=0))
    params = SamplingParams(max_new_tokens=3, seed=1)
    prompt = [5, 6, 7, 8]

    def trainer_decides(now: float) -> ElasticPlan:
        # what run_trainer does each decision: read the workers' statuses, decide, publish
        read, corrupt = statuses.read()
        assert corrupt == 0
        planner.decide(read, SATURATED, now)
        plans.publish(planner.last_plan)
        return planner.last_plan

    async def body() -> None:
        await worker.start()
        if store.config.is_s3:  # its engines fetched the policy alone, never a trainer's extra files
            cache = worker.weights.cache_dir
            assert (cache / "serving" / "v000000").is_dir() and not (cache / "v000000").exists()
        router = worker.router
        follower = asyncio.create_task(worker.follow_plan())
        try:
            first = [f"s{i}" for i in range(8)]
            for session in first:
                await router.generate(session, prompt, params)
            loads = {r: router.load(r) for r in router.replicas}
            assert sorted(loads) == ["torch-0", "torch-1"] and min(loads.values()) >= 1, loads
            statuses.publish(status_object("w0", await worker.status(), running=True))
            plan = trainer_decides(time.time())
            (drained,) = [u.split("/")[1] for u in plan.draining]
            (kept,) = [u.split("/")[1] for u in plan.accepting]
            assert router.load(drained) <= router.load(kept), "the least loaded replica drains"
            await until(lambda: worker.plan_time == plan.time, "the worker to apply the plan")
            assert router.draining == [drained]
            movers = [s for s in first if router.assignment(s) == drained]

            for i in range(8, 14):  # new sessions avoid the draining replica
                assert (await router.generate(f"s{i}", prompt, params)).engine == kept
            for session in movers:  # its sessions move at their next turn, re-prefilled there
                assert (await router.generate(session, [*prompt, 9, 10], params)).engine == kept
            assert router.migrations == len(movers)
            status = await worker.status()
            assert status["replica_sessions"] == {kept: 14, drained: 0}
            assert (status["draining"], status["plan_time"]) == ([drained], plan.time)
            assert status["migrations"] == len(movers)

            statuses.publish(status_object("w0", status, running=True))
            plan = trainer_decides(time.time())
            assert (plan.accepting, plan.draining, plan.train) == ([f"w0/{kept}"], [], [f"w0/{drained}"])
            await until(lambda: worker.plan_time == plan.time, "the worker to apply the handover")
            assert router.draining == [drained], "a replica handed to training stays drained"

            # a corrupt plan is ignored with a warning: replicas stay as they are
            with caplog.at_level(logging.WARNING):
                store.fs.pipe_file(store.path(ELASTIC_PLAN_PREFIX, ELASTIC_PLAN_NAME), b"{not json")
                await until(lambda: "not a valid plan" in caplog.text, "the corrupt plan's warning")
            assert router.draining == [drained] and worker.plan_time == plan.time

            # a stale plan means no trainer is steering: every replica takes new sessions
            with caplog.at_level(logging.WARNING):
                stale = ElasticPlan(
                    time=time.time() - 1000, accepting=[f"w0/{kept}"], draining=[f"w0/{drained}"]
                )
                plans.publish(stale)
                await until(lambda: "s old" in caplog.text, "the stale plan's warning")
            # its time as a reader would look it up, not seconds since the epoch
            written = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stale.time))
            assert f"ignores the elastic plan of {written}: " in caplog.text
            await until(lambda: router.draining == [], "the worker to stop draining under a stale plan")
            assert worker.plan_time == plan.time
            router.drain(drained)

            released = planner.release(time.time())
            plans.publish(released)
            await until(lambda: worker.plan_time == released.time, "the worker to apply the release")
            assert router.draining == []
            assert (await router.generate("s99", prompt, params)).engine in {kept, drained}

            # a session its gateway ended for idling counts apart from the ended rollouts
            router.end_session("s0")
            router.end_session("s1", expired=True)
            status = await worker.status()
            assert (status["sessions_ended"], status["sessions_expired"]) == (1, 1)
            assert status["session_contexts"] == [1]  # the ended rollout's, one context long
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await worker.close()

    asyncio.run(body())


def test_a_single_replica_worker_never_drains_its_replica(tmp_path, caplog):
    run = RunConfig(run_id="elastic-one", storage=StorageConfig(root=str(tmp_path / "runs")))
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    worker = make_worker(store, run)

    async def body() -> None:
        await worker.start()
        try:
            plan = ElasticPlan(time=time.time(), draining=["w0/torch-0"])
            with caplog.at_level(logging.WARNING):
                assert worker.apply_plan(plan, time.time())
                assert worker.apply_plan(plan, time.time())  # the same plan again: no second warning
                assert worker.apply_plan(ElasticPlan(time=plan.time + 1, train=["w0/torch-9"]), time.time())
                newer = ElasticPlan(time=plan.time + 2, draining=["w0/torch-0"])
                assert worker.apply_plan(newer, time.time())  # a newer plan: warned of again
            assert worker.router.draining == []
            warnings = [r.getMessage() for r in caplog.records if r.name == "rollout.worker"]
            assert len(warnings) == 3, warnings
            assert "last accepting replica" in warnings[0] and "unknown replicas ['torch-9']" in warnings[1]
            assert "last accepting replica" in warnings[2]
        finally:
            await worker.close()

    asyncio.run(body())


def test_a_plan_that_drains_every_replica_keeps_the_last_one_accepting(tmp_path, caplog):
    worker = two_replica_worker(tmp_path, "elastic-all")

    async def body() -> None:
        await worker.start()
        try:
            now = time.time()
            with caplog.at_level(logging.WARNING):
                assert worker.apply_plan(ElasticPlan(time=now, draining=["w0/torch-0", "w0/torch-1"]), now)
            assert worker.router.draining == ["torch-0"]
            assert "keeps torch-1 accepting: it is its last accepting replica" in caplog.text
        finally:
            await worker.close()

    asyncio.run(body())


def test_a_plan_that_drains_a_replica_that_is_down_says_it_is_down_and_drains_it_once_back(tmp_path, caplog):
    """The trainer planned the drain from a status sent before the replica went down: the
    worker names it as down (not as a replica it does not know) and drains it when back."""
    worker = two_replica_worker(tmp_path, "elastic-down")

    async def body() -> None:
        await worker.start()
        try:
            router = worker.router
            router.take_down("torch-1")  # it failed its health check
            plan = ElasticPlan(time=time.time(), accepting=["w0/torch-0"], draining=["w0/torch-1"])
            with caplog.at_level(logging.WARNING):
                assert worker.apply_plan(plan, time.time())
            assert router.draining == []
            warnings = [r.getMessage() for r in caplog.records if r.name == "rollout.worker"]
            assert len(warnings) == 1, warnings
            assert "replicas ['torch-1'], which are down" in warnings[0] and "unknown" not in warnings[0]
            router.add(next(e for e in worker.engines if e.name == "torch-1"))  # healthy again
            assert worker.apply_plan(plan, time.time())
            assert router.draining == ["torch-1"]
        finally:
            await worker.close()

    asyncio.run(body())


def test_a_plan_that_moves_a_drain_to_another_replica_drains_it_at_once(tmp_path, caplog):
    """The trainer cancelled the drain of one replica and drained the other between two reads
    of the plan: the one put back accepts first, so the other is not its last accepting."""
    worker = two_replica_worker(tmp_path, "elastic-move")

    async def body() -> None:
        await worker.start()
        try:
            now = time.time()
            assert worker.apply_plan(
                ElasticPlan(time=now, accepting=["w0/torch-0"], draining=["w0/torch-1"]), now
            )
            assert worker.router.draining == ["torch-1"]
            moved = ElasticPlan(time=now + 1, accepting=["w0/torch-1"], draining=["w0/torch-0"])
            with caplog.at_level(logging.WARNING):
                assert worker.apply_plan(moved, now + 1)
            assert worker.router.draining == ["torch-0"]
            assert "last accepting replica" not in caplog.text
        finally:
            await worker.close()

    asyncio.run(body())


def test_with_no_readable_plan_a_drain_lasts_only_until_the_last_plan_applied_goes_stale(tmp_path, caplog):
    """The trainer died leaving a plan the worker cannot read (or none): its replicas return
    to rollout once the last plan it applied is as old as a stale plan, as they would under
    that plan."""
    worker = two_replica_worker(tmp_path, "elastic-unread", plan_max_age_s=30.0)

    async def body() -> None:
        await worker.start()
        try:
            router = worker.router
            assert not worker.apply_plan(None, 1000.0)  # none applied yet: nothing to undo
            plan = ElasticPlan(time=1000.0, accepting=["w0/torch-0"], draining=["w0/torch-1"])
            assert worker.apply_plan(plan, 1000.0)
            assert router.draining == ["torch-1"]
            assert not worker.apply_plan(None, 1029.0)
            assert router.draining == ["torch-1"], "a plan that cannot be read for a moment changes nothing"
            with caplog.at_level(logging.WARNING):
                assert not worker.apply_plan(None, 1031.0)
            assert router.draining == [] and worker.plan_time == 1000.0
            assert "every replica takes new sessions" in caplog.text
        finally:
            await worker.close()

    asyncio.run(body())


def test_a_plan_dated_ahead_of_the_workers_clock_is_said_to_be_ahead_not_negative_seconds_old(
    tmp_path, caplog
):
    """The trainer's clock runs 100 s ahead of the worker's: its plan is ignored as a stale
    one is, and the warning said it was "-100 s old", and that no trainer was steering."""
    worker = two_replica_worker(tmp_path, "elastic-ahead", plan_max_age_s=30.0)

    async def body() -> None:
        await worker.start()
        try:
            plan = ElasticPlan(time=1100.0, accepting=["w0/torch-0"], draining=["w0/torch-1"])
            with caplog.at_level(logging.WARNING):
                assert not worker.apply_plan(plan, 1000.0)
            assert worker.router.draining == []
            (warning,) = [r.getMessage() for r in caplog.records if r.name == "rollout.worker"]
            assert "-100 s" not in warning and "no trainer is steering" not in warning
            assert "dated 100 s ahead of this worker's clock (> 30 s)" in warning
            assert "clocks" in warning and "every replica takes new sessions" in warning
        finally:
            await worker.close()

    asyncio.run(body())


def test_the_last_plan_of_a_stopped_trainer_is_applied_quietly_however_old(tmp_path, caplog):
    """A stopped trainer's last plan puts every replica back in rollout and stays in force:
    it is not a running trainer's plan gone stale, and no one is warned of it."""
    worker = two_replica_worker(tmp_path, "elastic-stopped", plan_max_age_s=30.0)

    async def body() -> None:
        await worker.start()
        try:
            assert worker.apply_plan(ElasticPlan(time=1000.0, draining=["w0/torch-1"]), 1000.0)
            released = ElasticPlan(time=1001.0, accepting=["w0/torch-0", "w0/torch-1"], running=False)
            with caplog.at_level(logging.WARNING):
                assert worker.apply_plan(released, 5000.0)
            assert worker.router.draining == [] and worker.plan_time == 1001.0
            assert not [r for r in caplog.records if r.name == "rollout.worker"]
        finally:
            await worker.close()

    asyncio.run(body())


def test_a_worker_says_at_once_that_a_replica_it_drains_is_empty_not_at_its_next_beat(tmp_path):
    """The trainer counts a drained replica as training only once a status shows it empty:
    with a beat of 60 s, that status still comes within seconds of the plan."""
    run = RunConfig(
        run_id="elastic-early",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        engine={"replicas": 2},
        orchestrator={"mix": {"arith": 1.0}, "concurrency": 4},
    )
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    board = RolloutStatusBoard(store)
    plan = ElasticPlan(time=time.time(), accepting=["w0/torch-0"], draining=["w0/torch-1"])
    ElasticPlanBoard(store).publish(plan)
    seen: list[RolloutStatus] = []
    stop, written = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        rollouts = pool.submit(
            run_rollouts,
            run,
            time.time() + 15,
            "w0",
            progress_every_s=60,
            stop=stop,
            on_shard=lambda info: written.set(),
            flush_records=1,
        )
        while not rollouts.done():
            status = board.read_worker("w0")
            if status is not None and status.running and status.draining:
                seen.append(status)
                break
            time.sleep(0.05)
        # ended once torch-0 has written a rollout, not at the deadline
        written.wait(WAIT_S)
        stop.set()
        result = rollouts.result(timeout=WAIT_S)
    assert seen, "no status showed the drain before the worker stopped"
    (status,) = seen
    assert status.draining == ["torch-1"] and status.replica_sessions["torch-1"] == 0
    assert status.plan_time == plan.time
    assert result["orchestrator"]["finished"] > 0  # torch-0 kept rolling out


def test_a_worker_says_at_once_that_a_replica_drained_again_is_empty(tmp_path):
    """A drain cancelled and made again between two reads of the plan is a new drain to the
    trainer, confirmed only by a status of the newer plan: the worker, which saw the replica
    drained and empty all along, still publishes that status at once."""
    run = RunConfig(engine={"replicas": 2}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 4})
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "elastic-again")
    ensure_base_version(WeightStore(store), TINY)
    worker = make_worker(store, run, plan_poll_s=0.01)
    plans = ElasticPlanBoard(store)
    planner = ElasticPlanner(ElasticConfig(sessions_per_replica=16, headroom_slots=0, cooldown_s=0))
    dry = PolicyInputs(unconsumed_shards=0, engine_queue_depth=0, trainer_idle=1.0)

    async def body() -> None:
        await worker.start()
        follower = asyncio.create_task(worker.follow_plan())
        try:
            before = [status_object("w0", await worker.status(), running=True)]
            now = time.time()
            planner.decide(before, SATURATED, now)
            first = planner.last_plan
            plans.publish(first)
            await until(lambda: worker.status_due.is_set(), "the drained replica's status to be due")
            assert worker.plan_time == first.time
            worker.status_due.clear()  # what tasks.rollout does, publishing the status
            # the trainer ran dry before it read that status, cancelled the drain and drained
            # again; the worker read neither plan in between
            planner.decide(before, dry, now + 0.1)
            assert planner.last_plan.draining == []
            planner.decide(before, SATURATED, now + 0.2)
            again = planner.last_plan
            assert again.draining == first.draining
            plans.publish(again)
            await until(lambda: worker.plan_time == again.time, "the worker to apply the new drain")
            assert worker.status_due.is_set()
            moves = planner.observe([status_object("w0", await worker.status(), running=True)], now + 0.3)
            assert [(m.unit, m.target) for m in moves] == [(again.draining[0], "train")]
            # handed over: the plans that follow (each trainer decision) need no early status
            worker.status_due.clear()
            handed = planner.plan(now + 0.4)
            assert handed.train == again.draining
            plans.publish(handed)
            await until(lambda: worker.plan_time == handed.time, "the worker to apply the handover")
            await asyncio.sleep(0.1)  # several more reads of the plan
            assert not worker.status_due.is_set()
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await worker.close()

    asyncio.run(body())


def test_the_train_task_publishes_a_drain_and_never_the_last_accepting_replica(tmp_path):
    run = RunConfig(run_id="elastic-train", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config())
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    write_shards(store, make_trajectories(store, 8, seed=5), per_shard=2)
    board = RolloutStatusBoard(store)
    for worker, sessions in {"w0": {"torch-0": 3, "torch-1": 1}, "w1": {"torch-0": 0}}.items():
        board.publish(
            RolloutStatus(
                worker=worker,
                time=time.time(),
                engine_queue_depth=0,
                live_sessions=sum(sessions.values()),
                running=True,
                replica_sessions=sessions,
            )
        )
    planner = ElasticPlanner(
        ElasticConfig(high_backlog=1, low_backlog=0, sessions_per_replica=8, headroom_slots=0, cooldown_s=0)
    )
    plans = []
    run_trainer(
        run,
        time.time() + 600,
        drain=True,
        elastic=planner,
        status_max_age_s=600,
        on_step=lambda row: plans.append(ElasticPlanBoard(store).read()),
    )
    assert plans and plans[0].draining == ["w0/torch-1"], plans
    for plan in plans:
        assert plan.running and {"w0/torch-0", "w1/torch-0"} <= set(plan.accepting), plan
    final = ElasticPlanBoard(store).read()
    assert not final.running and final.accepting == ["w0/torch-0", "w0/torch-1", "w1/torch-0"]
    queue = TrainerStatusBoard(store).read()  # drained: nothing waits, and it says it stopped
    assert (queue.running, queue.buffered_tokens, queue.token_budget) == (False, 0, run.sao.token_budget)
    assert queue.newest_read == {"proc": 3}  # the last of its four shards
    rows = sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])
    extras = [json.loads(row["extra"]) for row in rows]
    assert all(extra["rollout_status"]["workers"] == 2 for extra in extras)
    assert extras[0]["elastic"]["roles"]["w0/torch-1"] == "draining"
    assert ("w0/torch-1", "rollout", "draining") in {
        (m["unit"], m["source"], m["target"]) for m in extras[-1]["elastic"]["moves"]
    }


def test_a_two_replica_pipeline_lends_a_replica_to_training_and_loses_no_rollout(tmp_path):
    """Rollouts (2 engine replicas, multi-turn guess), processing and training side by side
    until a replica was lent, steered by a controller that lends a replica to training
    whenever a shard waits: a replica is drained and handed over during the run, and every
    rollout started still finishes, is written, processed and counted."""
    run = RunConfig(
        run_id="elastic-pipeline",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        engine={"replicas": 2},
        orchestrator={"mix": {"guess": 1.0}, "concurrency": 8},
        sao=config(),
    )
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    # 16 slots a replica for 8 sessions: the other replica always has room for a drained
    # one's sessions, so every waiting shard lends a replica to training
    planner = ElasticPlanner(
        ElasticConfig(
            high_backlog=1,
            low_backlog=0,
            saturated_idle=1.0,
            sessions_per_replica=16,
            headroom_slots=0,
            cooldown_s=0,
        )
    )
    # the rollouts end once a replica was lent and the worker drained one, with two steps
    # taken (a step's cost needs one before it); the deadline is only a bound
    deadline = time.time() + 120
    statuses: list[dict] = []
    steps: list[dict] = []
    results: dict = {}
    enough, rollouts_done, processed = threading.Event(), threading.Event(), threading.Event()

    def seen(log: list, item) -> None:
        log.append(item)
        if (
            len(steps) >= 2
            and any(m.target == "train" for m in planner.controller.moves)
            and any(s["draining"] for s in statuses)
        ):
            enough.set()

    def go(name, done, fn, *args, **kwargs):
        try:
            results[name] = fn(*args, **kwargs)
        finally:
            done.set()

    threads = [
        threading.Thread(
            target=go,
            args=("rollouts", rollouts_done, run_rollouts, run, deadline),
            kwargs={
                "on_progress": lambda status: seen(statuses, status),
                "progress_every_s": 0.3,
                "flush_records": 8,
                "stop": enough,
            },
        ),
        # processing ends once the rollouts wrote their last shard, and training once it is processed
        threading.Thread(
            target=go,
            args=("process", processed, run_processor, run, deadline),
            kwargs={"stop": rollouts_done},
        ),
        threading.Thread(
            target=go,
            args=("train", threading.Event(), run_trainer, run, deadline),
            kwargs={"elastic": planner, "on_step": lambda row: seen(steps, row), "stop": processed},
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(results) == {"rollouts", "process", "train"}, "a task raised (see the log)"

    moves = planner.controller.moves
    lent = [m for m in moves if m.target == "train"]
    assert lent and {m.unit for m in lent} <= {"worker-0/torch-0", "worker-0/torch-1"}, moves
    for move in lent:  # a replica with sessions drains first; only an idle one goes at once
        assert move.source == "draining" or (move.source == "rollout" and "(idle)" in move.reason), move
    assert any(m.target == "draining" for m in moves), moves
    assert any(s["draining"] for s in statuses), "the worker never applied a drain"
    for status in statuses:
        assert len(status["draining"]) < 2, "the last accepting replica was drained"
    final = ElasticPlanBoard(store).read()
    assert not final.running and final.train == [] and final.draining == []

    rollouts = results["rollouts"]["orchestrator"]
    assert rollouts["finished"] > 0 and rollouts["written"] == rollouts["finished"]
    assert set(rollouts["tasks"]["guess"]["statuses"]) <= {"ok", "truncated"}, rollouts
    shards = Tables(store).read("shards").to_pylist()
    raw = [s for s in shards if s["kind"] == "raw"]
    assert sum(s["num_rows"] for s in raw) == rollouts["written"]
    assert sum(s["num_rows"] for s in shards if s["kind"] == "processed") == rollouts["written"]
    assert results["train"]["steps"] >= 1

    # the policy's inputs are measured in the run: the rollout rate from the worker's
    # finished counts, the forecast from its sessions' ages and lengths, the training
    # cost from the steps
    rows = sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])
    records = [json.loads(row["extra"])["elastic"] for row in rows]
    assert max(r["rollout_rate"] for r in records) > 0
    assert any(r["forecast_completions"] is not None for r in records)
    costs = [r["inputs"]["train_unit_s_per_trajectory"] for r in records[1:]]
    assert costs and all(c is not None and c > 0 for c in costs)
    assert all(r["inputs"]["unconsumed_trajectories"] >= 0 for r in records)


def test_the_workers_router_migrates_drained_sessions_exactly_when_the_controller_counts_on_it():
    assert router_config(RunConfig()).migrate_on_drain is True
    staying = RunConfig.model_validate({"elastic": {"migrate_at_turns": False}})
    assert router_config(staying).migrate_on_drain is False


def test_the_workers_router_moves_a_drained_session_only_into_a_free_session_slot():
    """``elastic.sessions_per_replica`` are a replica's session slots: the controller drains a
    replica counting on its sessions finding free slots elsewhere (or staying where none is
    free), and the worker's router moved them onto a full replica all the same."""
    from tests.rollout.test_router import _replicas

    run = RunConfig.model_validate(
        {
            "engine": {"replicas": 2},
            "orchestrator": {"concurrency": 4},
            "elastic": {"sessions_per_replica": 2},
        }
    )
    router = Router(_replicas(2), router_config(run))
    for session in ("a", "b", "c"):
        router.route(session)
    assert sorted(router.load(name) for name in router.replicas) == [1, 2]
    full = max(router.replicas, key=router.load)
    (drained,) = [name for name in router.replicas if name != full]
    (mover,) = [s for s in ("a", "b", "c") if router.assignment(s) == drained]
    router.drain(drained)
    assert router.route(mover).name == drained, "moved onto a replica with no free slot"
    assert router.migrations == 0
    router.end_session(next(s for s in ("a", "b", "c") if router.assignment(s) == full))
    assert router.route(mover).name == full and router.migrations == 1
    # unset, a replica's slots are its share of the worker's concurrency
    assert router_config(run.model_copy(update={"elastic": ElasticRunConfig()})).migration_slots == 2


def test_a_replicas_session_slots_are_its_share_of_the_workers_concurrency():
    vllm = RunConfig.model_validate(
        {
            "engine": {
                "kind": "vllm",
                "vllm": [{"base_url": "http://127.0.0.1:8000"}, {"base_url": "http://127.0.0.1:8001"}],
            },
            "orchestrator": {"concurrency": 512},
        }
    )
    assert vllm.elastic_settings().sessions_per_replica == 256
    torch_replicas = RunConfig.model_validate(
        {"engine": {"replicas": 3}, "orchestrator": {"concurrency": 64}}
    )
    assert torch_replicas.elastic_settings().sessions_per_replica == 22
    fixed = RunConfig.model_validate({"elastic": {"sessions_per_replica": 5}})
    assert fixed.elastic_settings().sessions_per_replica == 5


def test_a_workers_status_object_carries_what_the_controller_forecasts_from():
    """The trainer's rollout rate and session-end forecast come from these fields alone."""
    status = {
        "engine_queue_depth": 2,
        "live_sessions": 3,
        "orchestrator": {"finished": 7, "finished_rows": 9},
        "session_ages": {"torch-0": [1.23456]},
        "sessions_ended": 5,
        "sessions_expired": 2,
        "session_lengths": [2.34567, 3.0],
        "session_contexts": [1, 4],
    }
    published = status_object("w0", status, running=True)
    assert (published.finished, published.finished_rows, published.sessions_ended) == (7, 9, 5)
    assert published.sessions_expired == 2
    older = status_object("w0", {**status, "orchestrator": {"finished": 7}}, running=True)
    assert older.finished_rows is None  # a worker that does not count them
    assert (published.session_ages, published.session_lengths) == ({"torch-0": [1.235]}, [2.346, 3.0])
    assert published.session_contexts == [1, 4]


def test_a_failing_progress_report_does_not_stop_the_trainer(tmp_path, caplog):
    run = RunConfig(run_id="report-fails", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config())
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    write_shards(store, make_trajectories(store, 8, seed=5), per_shard=2)
    reports = []

    def unreachable_api(row):
        reports.append(row["step"])
        raise ConnectionError("Prefect API unreachable for a moment")

    with caplog.at_level(logging.WARNING, logger="tasks.common"):
        summary = run_trainer(run, time.time() + 600, drain=True, on_step=unreachable_api)
    steps = sorted(Tables(store).read("train_steps").column("step").to_pylist())
    assert summary["stop_reason"] == "drained" and summary["steps"] == len(reports) > 1
    assert steps == reports
    assert "progress report of the trainer failed, the work goes on" in caplog.text


def worker_status(sessions: dict[str, int], draining=(), plan_time: float | None = None) -> RolloutStatus:
    """A fresh running status of worker ``w0``, its replicas pinning ``sessions``."""
    return replica_status("w0", sessions, draining, plan_time).model_copy(update={"time": time.time()})


def lend_a_replica(planner: ElasticPlanner, board: RolloutStatusBoard) -> None:
    """``w0/torch-1`` drains, and its worker's status (published on ``board``) confirms it
    empty under that plan: the next decision hands it to training."""
    drained_at = time.time() - 1
    planner.decide([worker_status({"torch-0": 3, "torch-1": 1})], SATURATED, drained_at)
    assert planner.last_plan.draining == ["w0/torch-1"]
    board.publish(worker_status({"torch-0": 4, "torch-1": 0}, draining=["torch-1"], plan_time=drained_at))


def trainer_run(tmp_path, run_id: str, **sao) -> tuple[RunConfig, RunStore]:
    run = RunConfig(run_id=run_id, storage=StorageConfig(root=str(tmp_path / "runs")), sao=config(**sao))
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    return run, store


def recording(planner: ElasticPlanner) -> list[PolicyInputs]:
    """The inputs of every decision ``planner`` makes from now on."""
    inputs: list[PolicyInputs] = []
    decide = planner.decide

    def decide_and_record(statuses, policy_inputs, now):
        inputs.append(policy_inputs)
        return decide(statuses, policy_inputs, now)

    planner.decide = decide_and_record
    return inputs


def test_a_failed_status_read_skips_the_decision_and_the_last_plan_stands(tmp_path, monkeypatch, caplog):
    """The first read of the workers' statuses fails (S3 unreachable for a moment): no
    worker seen must not hand the replica lent to training back to rollout."""
    run, store = trainer_run(tmp_path, "elastic-unread")
    write_shards(store, make_trajectories(store, 12, seed=5), per_shard=2)
    board = RolloutStatusBoard(store)
    planner = ElasticPlanner(
        ElasticConfig(high_backlog=1, low_backlog=0, sessions_per_replica=8, headroom_slots=0, cooldown_s=0)
    )
    lend_a_replica(planner, board)
    planner.decide(board.read()[0], SATURATED, time.time())
    lent = (["w0/torch-0"], [], ["w0/torch-1"])
    assert (planner.last_plan.accepting, planner.last_plan.draining, planner.last_plan.train) == lent

    reads, read = [], RolloutStatusBoard.read

    def unreachable_once(self):
        reads.append(time.time())
        if len(reads) == 1:
            raise OSError("S3 unreachable for a moment")
        return read(self)

    published, publish = [], ElasticPlanBoard.publish

    def keep(self, plan):
        published.append(plan)
        publish(self, plan)

    monkeypatch.setattr(RolloutStatusBoard, "read", unreachable_once)
    monkeypatch.setattr(ElasticPlanBoard, "publish", keep)
    # every step reads the statuses; with a depth callable no ticker decides in between
    monkeypatch.setattr("tasks.train.STATUS_REFRESH_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="tasks.train"):
        result = drain_with_an_idle_engine(run, planner)
    assert result["steps"] == 3 and len(reads) == 3
    assert "S3 unreachable for a moment" in caplog.text
    running = [plan for plan in published if plan.running]
    assert running, "the decisions after the failed read publish their plan"
    for plan in running:
        assert (plan.accepting, plan.draining, plan.train) == lent, plan
    rows = sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])
    records = [json.loads(row["extra"])["elastic"] for row in rows]
    assert records[0]["applied"] is False and "S3 unreachable" in records[0]["skipped"]
    assert [d.get("skipped") is not None for d in records[0]["decisions"]] == [True]
    assert all(r["applied"] and r["roles"]["w0/torch-1"] == "train" for r in records[1:])


def test_a_decision_whose_plan_could_not_be_published_is_not_logged_as_applied(tmp_path, monkeypatch):
    """The first decision hands the drained replica to training, but its plan does not
    reach the bucket: the workers still follow the last plan, so its row must not say the
    decision was applied; the next decision publishes the plan and says it was."""
    run, store = trainer_run(tmp_path, "elastic-unpublished")
    write_shards(store, make_trajectories(store, 12, seed=5), per_shard=2)
    planner = ElasticPlanner(
        ElasticConfig(high_backlog=1, low_backlog=0, sessions_per_replica=8, headroom_slots=0, cooldown_s=0)
    )
    lend_a_replica(planner, RolloutStatusBoard(store))
    publishes, publish = [], ElasticPlanBoard.publish

    def unreachable_once(self, plan):
        publishes.append(plan)
        if len(publishes) == 1:
            raise OSError("S3 unreachable for a moment")
        publish(self, plan)

    monkeypatch.setattr(ElasticPlanBoard, "publish", unreachable_once)
    monkeypatch.setattr("tasks.train.STATUS_REFRESH_S", 0.0)
    drain_with_an_idle_engine(run, planner)
    rows = sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])
    records = [json.loads(row["extra"])["elastic"] for row in rows]
    assert [(m["unit"], m["target"]) for m in records[0]["decided"]] == [("w0/torch-1", "train")]
    assert [r["applied"] for r in records] == [False, True, True]
    assert [d["applied"] for d in records[0]["decisions"]] == [False]


def test_a_plan_the_same_as_the_one_published_lately_is_not_published_again(tmp_path, monkeypatch):
    """Every step decides, and on S3 every plan published is a PUT: the first decision drains
    ``w0/torch-1``, the next two leave it draining, and only the release at the end differs."""
    run, store = trainer_run(tmp_path, "elastic-unchanged")
    write_shards(store, make_trajectories(store, 12, seed=5), per_shard=2)
    RolloutStatusBoard(store).publish(worker_status({"torch-0": 3, "torch-1": 1}))
    planner = ElasticPlanner(
        ElasticConfig(high_backlog=1, low_backlog=0, sessions_per_replica=8, headroom_slots=0, cooldown_s=0)
    )
    plans = published_by(monkeypatch, ElasticPlanBoard)
    monkeypatch.setattr("tasks.train.PLAN_REFRESH_S", 3600.0)
    assert drain_with_an_idle_engine(run, planner)["steps"] == 3
    assert [(plan.draining, plan.running) for plan in plans] == [(["w0/torch-1"], True), ([], False)]


def test_a_changed_plan_is_published_at_once(tmp_path, monkeypatch):
    """The first step drains ``w0/torch-1``; its worker then says it is empty under that plan,
    and the next decision, well within ``PLAN_REFRESH_S``, hands it to training: that plan
    reaches the workers at once, not when the last one would be published again."""
    run, store = trainer_run(tmp_path, "elastic-changed")
    write_shards(store, make_trajectories(store, 12, seed=5), per_shard=2)
    board = RolloutStatusBoard(store)
    board.publish(worker_status({"torch-0": 3, "torch-1": 1}))
    planner = ElasticPlanner(
        ElasticConfig(high_backlog=1, low_backlog=0, sessions_per_replica=8, headroom_slots=0, cooldown_s=0)
    )
    plans = published_by(monkeypatch, ElasticPlanBoard)
    monkeypatch.setattr("tasks.train.PLAN_REFRESH_S", 3600.0)
    monkeypatch.setattr("tasks.train.STATUS_REFRESH_S", 0.0)

    def emptied(row: dict) -> None:
        if row["step"] == 1:
            board.publish(
                worker_status({"torch-0": 4, "torch-1": 0}, draining=["torch-1"], plan_time=plans[0].time)
            )

    run_trainer(
        run,
        time.time() + 600,
        drain=True,
        on_step=emptied,
        engine_queue_depth=lambda: 0,
        elastic=planner,
        status_max_age_s=600,
    )
    assert [(plan.draining, plan.train, plan.running) for plan in plans] == [
        (["w0/torch-1"], [], True),
        ([], ["w0/torch-1"], True),
        ([], [], False),
    ]


def test_with_the_statuses_unread_a_row_says_the_workers_counts_are_unknown(tmp_path, monkeypatch):
    """The queue depth comes from the workers' statuses, which cannot be read: every row says
    why its decision was skipped, and that the workers' counts are unknown, not zero."""
    run, store = trainer_run(tmp_path, "elastic-never-read")
    write_shards(store, make_trajectories(store, 4, seed=5), per_shard=2)

    def unreachable(self):
        raise OSError("S3 unreachable (injected)")

    monkeypatch.setattr(RolloutStatusBoard, "read", unreachable)
    assert run_trainer(run, time.time() + 600, drain=True, status_max_age_s=600)["steps"] >= 1
    for row in Tables(store).read("train_steps").to_pylist():
        extra = json.loads(row["extra"])
        assert extra["rollout_status"] is None
        assert "S3 unreachable (injected)" in extra["elastic"]["skipped"]


def drain_with_an_idle_engine(run, planner) -> dict:
    """``run_trainer`` on ``planner`` until it has trained every shard, its engines queueing nothing."""
    return run_trainer(
        run,
        time.time() + 600,
        drain=True,
        engine_queue_depth=lambda: 0,
        elastic=planner,
        status_max_age_s=600,
    )


def train_through_two_decisions(
    run, planner, inputs: list, end: threading.Event, then=None, **kwargs
) -> None:
    """``run_trainer`` on ``planner`` in a thread until ``inputs`` (recorded by the planner)
    holds two decisions, then ``then()``; ``end`` is set and the trainer joined."""
    trainer = threading.Thread(
        target=run_trainer,
        args=(run, time.time() + 600),
        kwargs={"elastic": planner, "status_max_age_s": 600, **kwargs},
    )
    trainer.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while len(inputs) < 2:
            assert time.monotonic() < deadline, "gave up waiting for the ticker's decisions"
            time.sleep(0.05)
        if then is not None:
            then()
    finally:
        end.set()
        trainer.join()


def shards_after_two_decisions(run, store, planner, inputs: list, **kwargs) -> None:
    """:func:`train_through_two_decisions` where, after the two decisions, shards of 8
    trajectories arrive and the trainer drains them."""
    processed = threading.Event()
    train_through_two_decisions(
        run,
        planner,
        inputs,
        processed,
        then=lambda: write_shards(store, make_trajectories(store, 8, seed=5), per_shard=4),
        drain_event=processed,
        **kwargs,
    )


def test_a_trainer_waiting_for_data_counts_as_idle_and_is_lent_nothing(tmp_path):
    """One shard of 22 tokens waits under the 44-token budget: the trainer sleeps 30 s
    polls for more. Each decision during the first poll counts the time waited so far."""
    run, store = trainer_run(tmp_path, "elastic-waiting", poll_seconds=30)
    write_shards(store, make_trajectories(store, 2, seed=5), per_shard=2)
    RolloutStatusBoard(store).publish(worker_status({"torch-0": 3, "torch-1": 1}))
    planner = ElasticPlanner(
        ElasticConfig(high_backlog=1, low_backlog=0, sessions_per_replica=8, headroom_slots=0, cooldown_s=0)
    )
    inputs = recording(planner)
    stop = threading.Event()
    train_through_two_decisions(run, planner, inputs, stop, stop=stop)
    assert [i.unconsumed_shards for i in inputs[:2]] == [1, 1]
    assert all(i.trainer_idle > 0.5 for i in inputs[:2]), inputs
    assert planner.controller.moves == [], "a waiting trainer is not saturated"


def costed_at(store, units: int) -> list[dict]:
    """The elastic records of the run's ``train_steps`` rows, by step, after checking that
    each decision after the first step was given the steps so far at ``units`` unit-seconds
    per second of a step, per trajectory trained."""
    rows = sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])
    records = [json.loads(row["extra"])["elastic"] for row in rows]
    for step in range(1, len(rows)):
        seconds = sum(row["step_seconds"] for row in rows[:step])
        trajectories = sum(row["num_samples"] for row in rows[:step])
        cost = records[step]["inputs"]["train_unit_s_per_trajectory"]
        assert cost == pytest.approx(units * seconds / trajectories, rel=1e-5), step
    return records


def test_the_training_cost_counts_the_trainers_own_units_not_the_replicas_lent_to_it(tmp_path):
    """The trainer steps on its one unit whatever is lent to it: a trajectory costs the step's
    seconds per trajectory, not twice that because a replica is lent."""
    run, store = trainer_run(tmp_path, "elastic-cost")
    write_shards(store, make_trajectories(store, 12, seed=5), per_shard=2)
    planner = ElasticPlanner(
        ElasticConfig(high_backlog=1, low_backlog=0, sessions_per_replica=8, headroom_slots=0, cooldown_s=0)
    )
    lend_a_replica(planner, RolloutStatusBoard(store))
    run_trainer(run, time.time() + 600, drain=True, elastic=planner, status_max_age_s=600)
    records = costed_at(store, units=1)
    assert len(records) == 3 and all(r["roles"]["w0/torch-1"] == "train" for r in records)
    assert records[0]["inputs"]["train_unit_s_per_trajectory"] is None


def test_the_training_cost_counts_each_of_the_trainers_own_units(tmp_path):
    """A trainer of two units spends two unit-seconds on every second of a step: a trajectory
    costs twice the step's seconds per trajectory."""
    run, store = trainer_run(tmp_path, "elastic-two-units")
    write_shards(store, make_trajectories(store, 12, seed=5), per_shard=2)
    planner = ElasticPlanner(run.elastic_settings(), trainer_units=("train0", "train1"))
    assert drain_with_an_idle_engine(run, planner)["steps"] == 3
    costed_at(store, units=2)


def test_the_trainers_idle_fraction_is_measured_since_the_last_decision(tmp_path):
    """The trainer waits for data through two decisions, then its first step's report holds
    it busy through two more: those count it busy, not idle for the share of the run it
    spent waiting."""
    run, store = trainer_run(tmp_path, "elastic-idle-since", poll_seconds=0.1)
    planner = ElasticPlanner(run.elastic_settings())
    inputs = recording(planner)
    busy: list[int] = []

    def working(row: dict) -> None:
        if not busy:
            busy.append(len(inputs))  # the step's own decision is the last one made
            deadline = time.monotonic() + WAIT_S
            while len(inputs) < busy[0] + 2:
                assert time.monotonic() < deadline, "gave up waiting for the ticker's decisions"
                time.sleep(0.05)

    shards_after_two_decisions(run, store, planner, inputs, on_step=working)
    assert all(i.trainer_idle > 0 for i in inputs[:2]), inputs
    assert [i.trainer_idle for i in inputs[busy[0] : busy[0] + 2]] == [0.0, 0.0], inputs


def test_every_decision_since_the_last_step_reaches_the_next_row_with_its_moves(tmp_path):
    """The trainer waits for data while the ticker decides (one decision hands the drained
    replica over); then shards arrive and the first step's row holds every decision since
    the start, the step's own last, and every move made up to it."""
    run, store = trainer_run(tmp_path, "elastic-decisions", poll_seconds=0.1)
    planner = ElasticPlanner(
        ElasticConfig(high_backlog=1, low_backlog=0, sessions_per_replica=8, headroom_slots=0, cooldown_s=0)
    )
    lend_a_replica(planner, RolloutStatusBoard(store))
    before = len(planner.controller.moves)
    inputs = recording(planner)
    shards_after_two_decisions(run, store, planner, inputs)
    rows = sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])
    records = [json.loads(row["extra"])["elastic"] for row in rows]
    first = records[0]["decisions"]
    assert len(first) >= 2 and first[-1]["time"] == records[0]["time"]
    assert first[0]["inputs"]["unconsumed_shards"] == 0, "the ticker's, before any data"
    assert all("training_demand" in d for d in first), "the trainers each decision kept"
    assert sum(d["count"] for d in first) >= 3, "the ticker's two at least, and the step's own"
    assert ("w0/torch-1", "draining", "train") in {
        (m["unit"], m["source"], m["target"]) for m in first[0]["decided"]
    }
    logged = [
        (m["time"], m["unit"], m["target"]) for r in records for d in r["decisions"] for m in d["decided"]
    ]
    made = [
        (m.time, m.unit, m.target) for m in planner.controller.moves[before:] if m.time <= records[-1]["time"]
    ]
    assert sorted(logged) == sorted(made)


def test_the_moves_decided_after_the_last_train_steps_row_go_to_the_log(tmp_path, caplog):
    """The trainer waits for data and is stopped before its first step: the ticker handed the
    drained replica to training, and with no row to carry it that move is logged."""
    run, store = trainer_run(tmp_path, "elastic-unlogged", poll_seconds=0.1)
    planner = ElasticPlanner(
        ElasticConfig(high_backlog=1, low_backlog=0, sessions_per_replica=8, headroom_slots=0, cooldown_s=0)
    )
    lend_a_replica(planner, RolloutStatusBoard(store))
    inputs = recording(planner)
    stop = threading.Event()
    with caplog.at_level(logging.INFO, logger="tasks.train"):
        train_through_two_decisions(run, planner, inputs, stop, stop=stop)
    (logged,) = [
        r for r in caplog.records if r.message.startswith("elastic moves after the last train_steps row")
    ]
    assert "'unit': 'w0/torch-1'" in logged.message and "'target': 'train'" in logged.message


def test_a_decision_of_the_ticker_that_fails_is_made_again_at_the_next_tick(tmp_path, caplog):
    """The trainer waits for data, so only the ticker decides: its first decision raises,
    the failure is logged and the ticker goes on deciding."""
    run, store = trainer_run(tmp_path, "elastic-tick-fails", poll_seconds=30)
    RolloutStatusBoard(store).publish(worker_status({"torch-0": 3, "torch-1": 1}))
    planner = ElasticPlanner(ElasticConfig(sessions_per_replica=8, headroom_slots=0))
    decide, failures = planner.decide, []

    def fails_once(statuses, policy_inputs, now):
        if not failures:
            failures.append(now)
            raise OSError("the controller's input could not be read (injected)")
        return decide(statuses, policy_inputs, now)

    planner.decide = fails_once
    inputs = recording(planner)
    stop = threading.Event()
    with caplog.at_level(logging.WARNING, logger="tasks.train"):
        train_through_two_decisions(run, planner, inputs, stop, stop=stop)
    assert len(failures) == 1 and len(inputs) >= 2
    assert "elastic decision failed: the controller's input could not be read (injected)" in caplog.text


def test_the_workers_statuses_are_read_at_most_once_a_status_refresh(tmp_path, monkeypatch):
    """Every step decides, but on S3 a read of the statuses is a listing and a GET per worker:
    within ``STATUS_REFRESH_S`` (here an hour) the three steps decide on one read."""
    run, store = trainer_run(tmp_path, "elastic-cached-read")
    write_shards(store, make_trajectories(store, 12, seed=5), per_shard=2)
    reads, read = [], RolloutStatusBoard.read

    def counted(self):
        reads.append(time.time())
        return read(self)

    monkeypatch.setattr(RolloutStatusBoard, "read", counted)
    monkeypatch.setattr("tasks.train.STATUS_REFRESH_S", 3600.0)
    assert drain_with_an_idle_engine(run, ElasticPlanner(run.elastic_settings()))["steps"] == 3
    assert len(reads) == 1


def test_an_unchanged_trainer_queue_is_not_published_again(tmp_path, monkeypatch):
    """The trainer waits for data: its queue is looked at every ``TRAINER_STATUS_S`` (here
    10 ms), but on S3 every status is a PUT, and it publishes none while the queue stays the
    same (within ``PLAN_REFRESH_S``, here an hour); it still says at the end that it stopped."""
    monkeypatch.setattr("tasks.train.TRAINER_STATUS_S", 0.01)
    monkeypatch.setattr("tasks.train.PLAN_REFRESH_S", 3600.0)
    run, store = trainer_run(tmp_path, "queue-unchanged", poll_seconds=30)
    written = published_by(monkeypatch, TrainerStatusBoard)
    planner = ElasticPlanner(run.elastic_settings())
    inputs, published = recording(planner), []

    def while_it_waits() -> None:
        before = len(written)
        time.sleep(0.5)
        published.append(len(written) - before)

    stop = threading.Event()
    train_through_two_decisions(run, planner, inputs, stop, then=while_it_waits, stop=stop)
    assert published == [0]
    assert not written[-1].running


def test_a_run_of_decisions_that_moved_nothing_is_kept_as_its_latest_with_its_count():
    decisions: list[dict] = []
    moved = [{"unit": "w0/torch-1", "source": "draining", "target": "train"}]
    for time_, decided in [(1, []), (2, moved), (3, []), (4, []), (5, [])]:
        keep_decision(decisions, {"time": time_, "decided": decided})
    keep_decision(decisions, {"time": 6, "applied": False, "skipped": "status unreadable"})
    assert [(d["time"], d["count"]) for d in decisions] == [(1, 1), (2, 1), (6, 4)]
    assert decisions[1]["decided"] == moved
