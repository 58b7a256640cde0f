"""The rollout task publishes its engines' queue through the run's storage and the train
task logs it in every ``train_steps`` row: no shared memory between the two."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from flows.config import RunConfig
from rl.models import build_tiny_model, ensure_base_version, publish_policy
from rl.trainer import Trainer
from rollout.engines.torch_engine import TorchEngine
from rollout.orchestrator import Orchestrator
from rollout.worker import RolloutWorker
from storage.config import RunStore, StorageConfig
from storage.schema import validate
from storage.shards import BackgroundShardWriter
from storage.status import (
    ElasticPlanBoard,
    HeldRole,
    InUse,
    RolloutStatus,
    RolloutStatusBoard,
    TrainerStatus,
    TrainerStatusBoard,
    wait_until_free,
)
from storage.tables import Tables
from storage.weights import WeightStore
from tasks import rollout as rollout_task
from tasks import train as train_task
from tasks.process import run_processor
from tasks.rollout import first_set, run_rollouts
from tasks.train import run_trainer
from tests.conftest import kept_fresh, published_by
from tests.rl.test_trainer import TINY, config, make_trajectories, write_shards

WAIT_S = 600.0
"""A bound on every wait, never reached unless something hangs."""


def test_train_steps_carry_the_queue_depth_a_live_rollout_worker_published(tmp_path):
    run = RunConfig(
        run_id="status-channel",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        orchestrator={"mix": {"arith": 1.0}, "concurrency": 4},
        service={"max_new_tokens": 6},
        sao=config(token_budget=384, micro_token_budget=384, publish_every=1),
    )
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    stop, trained = threading.Event(), threading.Event()
    handed_over: queue.Queue[dict] = queue.Queue()

    def on_progress(status: dict) -> None:
        # Once a shard is committed, hold the worker's report loop here until the trainer is
        # done: the status object in storage is then exactly the one handed to this callback.
        if status["backlog"] >= 1 and not trained.is_set():
            handed_over.put(status)
            trained.wait(WAIT_S)

    with ThreadPoolExecutor(1) as pool:
        rollouts = pool.submit(
            run_rollouts,
            run,
            time.time() + WAIT_S,
            "w0",
            on_progress=on_progress,
            progress_every_s=0.2,
            stop=stop,
            flush_records=2,
            flush_seconds=0.2,
        )
        try:
            status = handed_over.get(timeout=WAIT_S)
            run_processor(run, deadline=0.0)
            result = run_trainer(run, time.time() + WAIT_S, drain=True, status_max_age_s=WAIT_S)
        finally:
            trained.set()
            stop.set()
        worker_result = rollouts.result(timeout=WAIT_S)

    assert result["steps"] >= 1
    rows = Tables(store).read("train_steps").to_pylist()
    assert len(rows) == result["steps"]
    for row in rows:
        extra = json.loads(row["extra"])
        assert extra["rollout_status"] == {
            "workers": 1,
            "stopped": 0,
            "stale": 0,
            "corrupt": 0,
            "engine_queue_depth": status["engine_queue_depth"],
            "live_sessions": status["live_sessions"],
        }
        assert extra["elastic"]["inputs"]["engine_queue_depth"] == status["engine_queue_depth"]
    # the stopped worker's last word: nothing queued or pinned, not counted as a live worker,
    # and every rollout it finished still counted
    (final,), corrupt = RolloutStatusBoard(store).read()
    assert (final.worker, final.running, final.engine_queue_depth, corrupt) == ("w0", False, 0, 0)
    assert (final.live_sessions, final.replica_sessions, final.session_ages) == (0, {}, {})
    assert final.finished == worker_result["orchestrator"]["finished"] > 0


def test_a_second_worker_under_a_running_workers_name_refuses_to_start(tmp_path):
    run = RunConfig(run_id="taken-name", storage=StorageConfig(root=str(tmp_path / "runs")))
    store = RunStore(run.storage, run.run_id)
    board = RolloutStatusBoard(store)

    def running_worker() -> None:
        board.publish(
            RolloutStatus(worker="w0", time=time.time(), engine_queue_depth=3, live_sessions=5, running=True)
        )

    with kept_fresh(running_worker):
        with pytest.raises(InUse, match="'w0' is in use"):
            run_rollouts(run, time.time() + WAIT_S, "w0")
        assert board.read_worker("w0").live_sessions == 5  # its status is the running worker's
    assert Tables(store).read("shards").num_rows == 0


def small_worker_run(tmp_path, run_id: str) -> tuple[RunConfig, RunStore]:
    """A run at version 0 for one rollout worker: arith, 2 sessions, 4-token turns."""
    run = RunConfig(
        run_id=run_id,
        storage=StorageConfig(root=str(tmp_path / "runs")),
        orchestrator={"mix": {"arith": 1.0}, "concurrency": 2},
        service={"max_new_tokens": 4},
    )
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    return run, store


def test_a_worker_stops_once_it_serves_a_version_at_the_runs_max_policy_steps(tmp_path, caplog):
    """A rollout flow run apart from its trainer, with no wall-clock limit: once the trainer
    stopped at ``stop.max_policy_steps`` and published that step's version, nothing more the
    worker rolls out would be trained, so it stops (it rolled out until its deadline)."""
    run, store = small_worker_run(tmp_path, "steps-reached")
    run = run.model_copy(
        update={"stop": run.stop.model_copy(update={"max_seconds": None, "max_policy_steps": 3})}
    )
    model, tokenizer = build_tiny_model(TINY)
    rolled = threading.Event()
    with caplog.at_level(logging.INFO, logger="tasks.rollout"), ThreadPoolExecutor(1) as pool:
        rollouts = pool.submit(
            run_rollouts,
            run,
            time.time() + 300,  # the deadline a worker that never stops meets, past the wait below
            "w0",
            progress_every_s=0.1,
            on_progress=lambda s: rolled.set(),
        )
        assert rolled.wait(WAIT_S)
        publish_policy(WeightStore(store), model, tokenizer, step=2)
        time.sleep(1.0)
        assert not rollouts.done()  # a version short of the limit: the trainer goes on
        publish_policy(WeightStore(store), model, tokenizer, step=3)
        result = rollouts.result(timeout=120)
    assert result["version"] == 2
    stops = [r.message for r in caplog.records if r.name == "tasks.rollout" and " stops: " in r.message]
    assert stops == ["worker w0 stops: it serves weight version 2, at the run's stop.max_policy_steps 3"]


def test_a_worker_that_cannot_read_the_step_of_the_version_it_serves_goes_on_rolling_out(
    tmp_path, monkeypatch, caplog
):
    """The run stops at ``stop.max_policy_steps``, but once the worker's engines are up the
    manifest of the version they serve cannot be read (storage unreachable): that is not the
    limit reached, so the worker rolls on, looking again at each beat, until its stop."""
    run, store = small_worker_run(tmp_path, "steps-unread")
    run = run.model_copy(update={"stop": run.stop.model_copy(update={"max_policy_steps": 3})})
    start = RolloutWorker.start

    def unreachable(version):
        raise OSError("store unreachable (injected)")

    async def start_then_unreadable(self):
        worker = await start(self)
        monkeypatch.setattr(self.weights, "manifest", unreachable)
        return worker

    monkeypatch.setattr(RolloutWorker, "start", start_then_unreadable)
    stop, reports = threading.Event(), []

    def on_progress(status: dict) -> None:
        reports.append(status)
        if len(reports) == 3:
            stop.set()

    with caplog.at_level(logging.INFO, logger="tasks.rollout"):
        run_rollouts(
            run, time.time() + WAIT_S, "w0", on_progress=on_progress, progress_every_s=0.1, stop=stop
        )
    assert len(reports) >= 3
    assert not [r for r in caplog.records if r.name == "tasks.rollout" and " stops: " in r.message]
    assert "could not read the step of weight version 0: store unreachable (injected)" in caplog.text


def test_a_worker_publishes_its_status_once_a_beat_not_continuously(tmp_path, monkeypatch):
    """Beats of 1,000 s; the first comes at once, the clock of ``tasks.rollout`` moved on by
    a beat, and the run's stop with its report: the next beat is 1,000 s away, so the worker
    ends once its rollouts in flight finish, with no status between (with the beat left in
    the past it published one after another)."""
    run, store = small_worker_run(tmp_path, "one-beat")
    clock = {"offset": 0.0}
    monkeypatch.setattr(
        rollout_task,
        "time",
        SimpleNamespace(time=time.time, monotonic=lambda: time.monotonic() + clock["offset"]),
    )
    waits = []

    async def first_beat_now(events, timeout):
        waits.append(timeout)
        if len(waits) == 1:
            clock["offset"] += 1000.0
            timeout = 0.0
        await first_set(events, timeout)

    monkeypatch.setattr(rollout_task, "first_set", first_beat_now)
    stop, reports = threading.Event(), []

    def on_progress(status: dict) -> None:
        reports.append(status)
        stop.set()

    written = published_by(monkeypatch, RolloutStatusBoard)
    run_rollouts(run, time.time() + WAIT_S, "w0", on_progress=on_progress, progress_every_s=1000.0, stop=stop)
    assert len(reports) == 1
    assert [status.running for status in written[-3:]] == [True, True, False]  # started, the beat, stopped


def test_a_report_loop_that_fails_is_logged(tmp_path, monkeypatch, caplog):
    """The worker's status cannot be taken at a beat: the loop that publishes it stops, and
    the log says why rather than the statuses just ending."""
    run, store = small_worker_run(tmp_path, "report-fails")
    status, calls = RolloutWorker.status, []
    stop = threading.Event()

    async def fails_at_the_first_beat(self):
        calls.append(self)
        if len(calls) == 2:  # the first is the status published once the engines are up
            stop.set()
            raise OSError("the engines' counters could not be read (injected)")
        return await status(self)

    monkeypatch.setattr(RolloutWorker, "status", fails_at_the_first_beat)
    with caplog.at_level(logging.WARNING, logger="tasks.rollout"):
        run_rollouts(run, time.time() + WAIT_S, "w0", progress_every_s=0.1, stop=stop)
    assert (
        'worker w0 stopped reporting progress: OSError("the engines\' counters could not be read (injected)")'
        in caplog.text
    )


@pytest.mark.parametrize("noticed_at", ["status", "commit"])
def test_a_worker_whose_name_was_taken_commits_nothing_more_and_stops(
    tmp_path, monkeypatch, noticed_at, caplog
):
    """Its status went unrenewed past the time it counts and another worker took its name:
    it commits none of its finished rollouts (two writers would interleave the name's shard
    numbers) but keeps them in the quarantine, publishes no stopped status over the new
    holder's, and raises InUse. It finds out at its next status (``status``) or, with no
    status due, when it would commit (``commit``: its statuses every 1,000 s, its last shard
    once it is stopped)."""
    run, store = small_worker_run(tmp_path, "taken-worker")
    board = RolloutStatusBoard(store)
    written = published_by(monkeypatch, RolloutStatusBoard)
    finished = threading.Event()
    buffered: list[str] = []
    write_many = BackgroundShardWriter.write_many

    def buffering(self, records):
        buffered.extend(record["trajectory_id"] for record in records)
        return write_many(self, records)

    monkeypatch.setattr(BackgroundShardWriter, "write_many", buffering)

    def on_progress(status: dict) -> None:
        if status["orchestrator"]["finished"]:
            finished.set()

    every_s = 0.1 if noticed_at == "status" else 1000.0
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        rollouts = pool.submit(
            run_rollouts,
            run,
            time.time() + WAIT_S,
            "w0",
            on_progress,
            every_s,
            stop,
            flush_records=10_000,
            flush_seconds=3600,
        )
        if noticed_at == "status":
            assert finished.wait(WAIT_S)
        else:  # a rollout finished: the status its engines' start published came before it
            while not buffered:
                assert not rollouts.done()
                time.sleep(0.05)
        first_owner = written[0].owner

        def new_worker() -> None:
            board.publish(
                RolloutStatus(
                    worker="w0",
                    time=time.time(),
                    engine_queue_depth=0,
                    live_sessions=0,
                    running=True,
                    owner="new",
                )
            )

        with kept_fresh(new_worker, 0.02):
            if noticed_at == "commit":  # no status due: the worker ends, and commits its last shard
                stop.set()
            with pytest.raises(InUse, match="'w0' was taken over by another process"):
                rollouts.result(timeout=WAIT_S)
            assert board.read_worker("w0").owner == "new" and board.read_worker("w0").running
    assert Tables(store).read("shards").num_rows == 0
    assert all(status.running for status in written)
    assert {status.owner for status in written} == {first_owner, "new"}
    (kept,) = store.fs.glob(store.path("shards/quarantine/raw/w0/uncommitted-*.arrow"))
    with store.fs.open(kept, "rb") as source:
        records = validate(pa.ipc.open_file(source).read_all())
    ids = records.column("trajectory_id").to_pylist()
    assert sorted(ids) == sorted(buffered) and len(set(ids)) == len(ids)  # every finished rollout, once
    assert f"worker w0 kept the {len(ids)} records it could not commit in {kept}" in caplog.text


@pytest.mark.parametrize("slow", ["build", "start"])
def test_a_worker_keeps_its_name_taken_while_its_engines_load(tmp_path, monkeypatch, slow):
    """Building the worker or starting its engines takes 2 s, four times the 0.5 s after which
    a status goes stale: all the while a second worker under its name is refused."""
    run, store = small_worker_run(tmp_path, "slow-start")
    loading, loaded = threading.Event(), threading.Event()
    build, start = rollout_task._build_worker, RolloutWorker.start

    def slow_build(*args):
        loading.set()
        time.sleep(2.0)
        built = build(*args)
        loaded.set()
        return built

    async def slow_start(self):
        loading.set()
        await asyncio.sleep(2.0)
        worker = await start(self)
        loaded.set()
        return worker

    if slow == "build":
        monkeypatch.setattr(rollout_task, "_build_worker", slow_build)
    else:
        monkeypatch.setattr(RolloutWorker, "start", slow_start)
    board, stop = RolloutStatusBoard(store), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        rollouts = pool.submit(run_rollouts, run, time.time() + WAIT_S, "w0", progress_every_s=0.1, stop=stop)
        try:
            assert loading.wait(WAIT_S)
            with pytest.raises(InUse, match="'w0' is in use"):
                wait_until_free(
                    lambda: board.read_worker("w0"),
                    "rollout worker name 'w0'",
                    "rename it",
                    max_age_s=0.5,
                    poll_s=0.05,
                )
            assert not loaded.is_set()  # refused while it loads, not once it runs
        finally:
            stop.set()
        rollouts.result(timeout=WAIT_S)
    final = board.read_worker("w0")
    time.sleep(0.5)
    assert not final.running and board.read_worker("w0") == final  # no beat after the last word


def test_a_stop_raised_while_the_engines_load_launches_no_rollout(tmp_path, monkeypatch):
    """The run's stop signal comes while the engines load, its next beat 1,000 s away: the
    worker launches nothing (were one launched, it stops the run then, so as not to wait)."""
    run, store = small_worker_run(tmp_path, "stop-while-loading")
    stop, launched = threading.Event(), []
    start, launch = RolloutWorker.start, Orchestrator._launch_group

    async def start_then_stop(self):
        worker = await start(self)
        stop.set()
        return worker

    def recorded_launch(self):
        group = launch(self)
        launched.append(group.group_id)
        self.stop()
        return group

    monkeypatch.setattr(RolloutWorker, "start", start_then_stop)
    monkeypatch.setattr(Orchestrator, "_launch_group", recorded_launch)
    written = published_by(monkeypatch, RolloutStatusBoard)
    result = run_rollouts(run, time.time() + WAIT_S, "w0", progress_every_s=1000.0, stop=stop)

    assert launched == [] and result["orchestrator"]["finished"] == 0
    assert not RolloutStatusBoard(store).read_worker("w0").running
    # once started, before any beat, the worker said so with its engines' replicas
    assert any(status.running and status.replica_sessions for status in written)


def test_a_stop_cuts_the_rollouts_in_flight_short_at_the_next_beat(tmp_path, monkeypatch):
    """The run's stop signal comes while a generation hangs (an engine that never answers):
    at its next beat the worker cuts the rollout in flight short rather than wait for it
    until its deadline."""
    run, store = small_worker_run(tmp_path, "stop-in-flight")
    generating, stop = threading.Event(), threading.Event()

    async def hangs(engine, *args):
        generating.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(TorchEngine, "generate", hangs)
    with ThreadPoolExecutor(1) as pool:
        deadline = time.time() + 180  # what a worker that waits for its rollouts meets, past the wait below
        rollouts = pool.submit(run_rollouts, run, deadline, "w0", progress_every_s=0.1, stop=stop)
        assert generating.wait(WAIT_S)
        stop.set()
        result = rollouts.result(timeout=120)
    assert result["orchestrator"]["finished"] == 0
    assert not RolloutStatusBoard(store).read_worker("w0").running


def test_a_second_trainer_on_a_run_with_a_running_trainer_refuses_to_start(tmp_path):
    run = RunConfig(run_id="one-trainer", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config())
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    board = TrainerStatusBoard(store)

    def running_trainer() -> None:
        board.publish(TrainerStatus(time=time.time(), buffered_tokens=7, token_budget=44))

    with (
        kept_fresh(running_trainer),
        pytest.raises(InUse, match="the trainer of run 'one-trainer' is in use.*one trainer"),
    ):
        run_trainer(run, time.time() + WAIT_S, drain=True)
    assert WeightStore(store).list() == [0] and Tables(store).read("train_steps").num_rows == 0
    board.publish(TrainerStatus(time=time.time(), buffered_tokens=0, token_budget=44, running=False))
    assert run_trainer(run, time.time() + WAIT_S, drain=True)["steps"] == 0  # a stopped one holds nothing


def test_a_trainer_keeps_the_run_taken_while_it_loads(tmp_path, monkeypatch):
    """Loading the trainer takes 2 s, four times the 0.5 s after which a status goes stale:
    all the while a second trainer on the run is refused."""
    monkeypatch.setattr(train_task, "TRAINER_LOADING_BEAT_S", 0.05)
    run = RunConfig(run_id="slow-trainer", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config())
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    loading, loaded = threading.Event(), threading.Event()
    build = train_task.Trainer

    def slow_trainer(*args, **kwargs):
        loading.set()
        time.sleep(2.0)
        trainer = build(*args, **kwargs)
        loaded.set()
        return trainer

    monkeypatch.setattr(train_task, "Trainer", slow_trainer)
    board = TrainerStatusBoard(store)
    with ThreadPoolExecutor(1) as pool:
        training = pool.submit(run_trainer, run, time.time() + WAIT_S, drain=True)
        assert loading.wait(WAIT_S)
        with pytest.raises(InUse, match="the trainer of run 'slow-trainer' is in use"):
            wait_until_free(
                board.read, "the trainer of run 'slow-trainer'", "stop it", max_age_s=0.5, poll_s=0.05
            )
        assert not loaded.is_set()  # refused while it loads, not once it runs
        assert training.result(timeout=WAIT_S)["steps"] == 0
    final = board.read()
    time.sleep(0.3)
    assert not final.running and board.read() == final  # no beat after the last word


def test_a_trainer_that_fails_to_load_says_it_stopped(tmp_path, monkeypatch):
    """Loading the trainer fails with a bug: its status says it stopped, so a retry is not
    held back, and its loading heartbeat writes nothing after that last word."""
    monkeypatch.setattr(train_task, "TRAINER_LOADING_BEAT_S", 0.05)
    run = RunConfig(run_id="broken-trainer", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config())

    def broken(*args, **kwargs):
        time.sleep(0.2)  # beats while it loads
        raise ValueError("the model has a bug (injected)")

    monkeypatch.setattr(train_task, "Trainer", broken)
    with pytest.raises(ValueError, match="injected"):
        run_trainer(run, time.time() + WAIT_S)
    board = TrainerStatusBoard(RunStore(run.storage, run.run_id))
    final = board.read()
    time.sleep(0.3)
    assert not final.running and board.read() == final


def run_with_processed_shards(tmp_path, run_id: str, publish_every: int, **sao) -> tuple[RunConfig, RunStore]:
    """A run at version 0 whose trainer finds 4 processed shards of 3 trajectories (33
    tokens each) waiting."""
    run = RunConfig(
        run_id=run_id,
        storage=StorageConfig(root=str(tmp_path / "runs")),
        sao=config(publish_every=publish_every, **sao),
    )
    store = RunStore(run.storage, run.run_id)
    weights = WeightStore(store)
    weights.record(Tables(store), ensure_base_version(weights, TINY))  # as the warm start does
    write_shards(store, make_trajectories(store, 12, seed=1), per_shard=3)
    return run, store


def test_the_trainers_status_counts_the_shards_it_has_not_read_yet_as_waiting(tmp_path):
    """The workers pause on the trainer's queue (``max_trainer_batches``): the shards that the
    trainer's read-ahead holds back in storage wait for it as much as its buffer does."""
    run, store = run_with_processed_shards(
        tmp_path, "read-ahead-status", publish_every=100, read_ahead_batches=1
    )
    board = TrainerStatusBoard(store)
    seen: list[int] = []

    def first_step(row: dict) -> None:
        # 2 shards read (66 tokens), 44 trained: 22 in the buffer and 2 shards (66) unread
        deadline = time.monotonic() + 30
        while (status := board.read()) is None or status.buffered_tokens != 88:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        seen.append(status.buffered_tokens)

    stop = threading.Event()
    run_trainer(run, time.time() + WAIT_S, on_step=lambda row: (first_step(row), stop.set()), stop=stop)
    assert seen[0] == 88


def test_a_trainer_whose_role_was_taken_stops_without_publishing_anything_more(tmp_path, monkeypatch):
    """Its status went unrenewed past the time it counts and another trainer took the run:
    at its next status it finds the other's, stops, and publishes no weight version (the
    steps it trained are left to the new trainer, which resumes from the latest), no
    stopped status and no plan over the new holder's."""
    run, store = run_with_processed_shards(tmp_path, "taken-trainer", publish_every=100)
    board = TrainerStatusBoard(store)
    written = published_by(monkeypatch, TrainerStatusBoard)
    plans = published_by(monkeypatch, ElasticPlanBoard)
    trained = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        training = pool.submit(run_trainer, run, time.time() + 60, on_step=lambda row: trained.set())
        assert trained.wait(WAIT_S)
        first_owner = board.read().owner

        def new_trainer() -> None:
            board.publish(TrainerStatus(time=time.time(), buffered_tokens=0, token_budget=44, owner="new"))

        with kept_fresh(new_trainer, 0.02):
            with pytest.raises(InUse, match="the trainer of run .* was taken over by another process"):
                training.result(timeout=30)
            assert board.read().owner == "new" and board.read().running
    assert WeightStore(store).list() == [0]
    assert plans and all(plan.running for plan in plans)  # no release of the new trainer's replicas
    assert all(status.running for status in written)
    assert {status.owner for status in written} == {first_owner, "new"}


def test_a_trainer_whose_role_was_taken_while_it_loaded_stops_before_its_first_step(tmp_path, monkeypatch):
    """Another trainer takes the run while this one loads its models, and this one's loading
    heartbeat finds the other's status: once loaded it raises InUse, with shards waiting it
    takes no step, and it publishes no weight version, announcement, plan or status over the
    new holder's."""
    monkeypatch.setattr(train_task, "TRAINER_LOADING_BEAT_S", 0.05)
    run, store = run_with_processed_shards(tmp_path, "taken-while-loading", publish_every=1)
    board = TrainerStatusBoard(store)
    written = published_by(monkeypatch, TrainerStatusBoard)
    plans = published_by(monkeypatch, ElasticPlanBoard)
    refused = threading.Event()
    held_publish, build = HeldRole.publish, train_task.Trainer

    def noticing(self, status):
        published = held_publish(self, status)
        if not published:
            refused.set()
        return published

    def taken_while_loading(*args, **kwargs):
        board.publish(TrainerStatus(time=time.time(), buffered_tokens=0, token_budget=44, owner="new"))
        assert refused.wait(WAIT_S)  # the heartbeat found the new holder's status
        return build(*args, **kwargs)

    monkeypatch.setattr(HeldRole, "publish", noticing)
    monkeypatch.setattr(train_task, "Trainer", taken_while_loading)
    steps, announced = [], []
    with pytest.raises(
        InUse, match="the trainer of run .* was taken over by another process.*while it loaded"
    ):
        run_trainer(run, time.time() + WAIT_S, on_step=steps.append, on_publish=announced.append)
    assert (steps, announced, plans) == ([], [], [])
    assert WeightStore(store).list() == [0] and Tables(store).read("train_steps").num_rows == 0
    assert written[-1].owner == "new" and all(status.running for status in written)


@pytest.mark.parametrize("noticed_at", ["status", "publish"])
def test_a_trainer_whose_role_was_taken_announces_its_own_versions_only(tmp_path, monkeypatch, noticed_at):
    """The run is taken right after a version this trainer published while it held it, and
    the new trainer publishes the next: the first still gets its announcement (its Prefect
    event) from this trainer, the new trainer's does not. It finds out at its next status
    (``status``) or, with none due, at the read-back before its next publish (``publish``)."""
    if noticed_at == "status":
        monkeypatch.setattr(train_task, "PLAN_REFRESH_S", 0.2)
    else:
        monkeypatch.setattr(train_task, "TRAINER_STATUS_S", 1000.0)
    run, store = run_with_processed_shards(tmp_path, "taken-after-publish", publish_every=1)
    board = TrainerStatusBoard(store)
    publish = Trainer.publish
    theirs = []

    def then_taken(self, before_commit=None):
        version = publish(self, before_commit)
        if not theirs:
            board.publish(TrainerStatus(time=time.time(), buffered_tokens=0, token_budget=44, owner="new"))
            theirs.append(publish_policy(self.weights, self.policy, self.tokenizer, step=0, parent=version))
            if noticed_at == "status":
                time.sleep(1.0)  # five of its statuses: it finds the new holder's before its next step
        return version

    monkeypatch.setattr(Trainer, "publish", then_taken)
    announced = []
    with pytest.raises(InUse, match="the trainer of run .* was taken over by another process"):
        run_trainer(run, time.time() + WAIT_S, on_publish=announced.append)
    assert (WeightStore(store).list(), theirs, announced) == ([0, 1, 2], [2], [1])


def run_with_an_unrecorded_version(tmp_path, run_id: str) -> tuple[RunConfig, RunStore]:
    """:func:`run_with_processed_shards` where an attempt of the train task published version
    1 and failed before its ``weights`` row (and so its announcement)."""
    run, store = run_with_processed_shards(tmp_path, run_id, publish_every=100)
    weights = WeightStore(store)
    trainer = Trainer(store, run.sao)
    publish_policy(weights, trainer.policy, trainer.tokenizer, step=0, parent=0)
    return run, store


def test_a_trainer_announces_the_version_a_failed_attempt_published_without_its_row(tmp_path):
    """The retry resumes from version 1, records it and announces it."""
    run, store = run_with_an_unrecorded_version(tmp_path, "retried-trainer")
    weights = WeightStore(store)
    announced = []
    result = run_trainer(run, time.time() + WAIT_S, on_publish=announced.append, drain=True)
    assert result["stop_reason"] == "drained"
    assert announced == weights.list()[1:] and announced[0] == 1
    assert sorted(Tables(store).read("weights").column("version").to_pylist()) == weights.list()


def test_a_retry_that_takes_no_step_still_announces_the_version_it_resumed_from(tmp_path):
    """The retry records version 1 as it resumes, then takes no step (its deadline passed):
    a later retry finds the row written and would never announce it, so it is announced at
    once, not with the next version published."""
    run, store = run_with_an_unrecorded_version(tmp_path, "retried-idle")
    announced = []
    assert run_trainer(run, time.time(), on_publish=announced.append)["steps"] == 0
    assert announced == [1]
    assert 1 in Tables(store).read("weights").column("version").to_pylist()


def test_a_trainer_leaves_a_version_recorded_by_another_flow_meanwhile_to_that_flow(tmp_path, monkeypatch):
    """Version 0 has no row yet when the trainer starts: another flow's warm start published
    it and is about to record it. That flow's record lands first, and that flow announces it;
    the trainer announced it as well, so the event came twice."""
    run = RunConfig(
        run_id="raced-base", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config(publish_every=100)
    )
    store = RunStore(run.storage, run.run_id)
    weights = WeightStore(store)
    ensure_base_version(weights, TINY)  # published, its row not yet written
    write_shards(store, make_trajectories(store, 12, seed=1), per_shard=3)
    real_record = WeightStore.record
    others: list[bool] = []

    def the_other_flow_first(self, tables, version):
        if not others:
            others.append(real_record(self, tables, version))
        return real_record(self, tables, version)

    monkeypatch.setattr(WeightStore, "record", the_other_flow_first)
    announced = []
    result = run_trainer(run, time.time() + WAIT_S, on_publish=announced.append, drain=True)
    assert result["stop_reason"] == "drained"
    assert others == [True]
    assert announced == weights.list()[1:] and announced
    assert sorted(Tables(store).read("weights").column("version").to_pylist()) == weights.list()


def test_a_trainer_whose_announcements_fail_keeps_training(tmp_path, caplog):
    """An announcement is a Prefect event: the API (or the store's listing) failing for a
    moment loses the event, never the training."""
    run, store = run_with_processed_shards(tmp_path, "announce-fails", publish_every=1)

    def unreachable(version):
        raise ConnectionError("the Prefect API is unreachable (injected)")

    result = run_trainer(run, time.time() + WAIT_S, on_publish=unreachable, drain=True)
    assert result["stop_reason"] == "drained" and result["versions"]
    assert WeightStore(store).latest() == result["versions"][-1]
    assert "announcement of published weight versions failed" in caplog.text


def test_a_worker_that_fails_to_start_says_it_stopped_and_frees_its_name(tmp_path, caplog):
    run = RunConfig(run_id="no-weights", storage=StorageConfig(root=str(tmp_path / "runs")))
    board = RolloutStatusBoard(RunStore(run.storage, run.run_id))
    with pytest.raises(FileNotFoundError, match="no weight version"):
        run_rollouts(run, time.time() + WAIT_S, "w0")
    status = board.read_worker("w0")
    assert status is not None and not status.running
    # the retry is not held back by the failed start
    with caplog.at_level(logging.WARNING, logger="storage.status"), pytest.raises(FileNotFoundError):
        run_rollouts(run, time.time() + WAIT_S, "w0")
    assert "waiting up to" not in caplog.text


def test_a_worker_whose_event_loop_never_ran_says_it_stopped_and_frees_its_name(
    tmp_path, monkeypatch, caplog
):
    """Built, but its async work never run (the loop's thread could not start, or a signal
    came as it started: run_async closes main unrun): main, which says the worker stopped,
    never ran, and its running status held the name until it went stale."""
    from tasks import event_loop

    def cannot_start(loop):
        raise RuntimeError("can't start new thread (injected)")

    monkeypatch.setattr(event_loop._LoopThread, "start", cannot_start)
    run = RunConfig(run_id="no-loop", storage=StorageConfig(root=str(tmp_path / "runs")))
    board = RolloutStatusBoard(RunStore(run.storage, run.run_id))
    with pytest.raises(RuntimeError, match="injected"):
        run_rollouts(run, time.time() + WAIT_S, "w0")
    status = board.read_worker("w0")
    assert status is not None and not status.running
    monkeypatch.undo()
    # the next start is not held back by the one whose loop never ran
    with caplog.at_level(logging.WARNING, logger="storage.status"), pytest.raises(FileNotFoundError):
        run_rollouts(run, time.time() + WAIT_S, "w0")
    assert "waiting up to" not in caplog.text


def test_a_worker_that_cannot_even_be_built_says_it_stopped(tmp_path):
    run = RunConfig(run_id="bad-table", storage=StorageConfig(root=str(tmp_path / "runs")))
    store = RunStore(run.storage, run.run_id)
    log = Path(store.path("tables", "shards", "_delta_log"))
    log.mkdir(parents=True)
    (log / "00000000000000000000.json").write_text("not json\n")  # the writer cannot read its shards
    with pytest.raises(Exception, match="Json error"):
        run_rollouts(run, time.time() + WAIT_S, "w0", progress_every_s=0.05)
    board = RolloutStatusBoard(store)
    status = board.read_worker("w0")
    time.sleep(0.3)
    assert status is not None and not status.running
    assert board.read_worker("w0") == status  # its loading heartbeat stopped: no beat after the last word


def test_a_replica_slow_to_report_its_counters_does_not_hold_up_the_rollouts(tmp_path, monkeypatch):
    """A replica's ``stats()`` waits (a Ray replica waits up to 10 s on an actor that does not
    answer): the worker's status waits for it off the event loop, so rollouts go on meanwhile.
    The first status of the run waits for a generation to finish; were it on the loop, none
    could, and it would give up."""
    run, store = small_worker_run(tmp_path, "slow-stats")
    generated, stop, answers = threading.Event(), threading.Event(), []
    real_stats, real_generate = TorchEngine.stats, TorchEngine.generate

    def slow_stats(engine):
        # the first call is the status published before the rollouts start
        if len(answers) == 1:
            answers.append(generated.wait(5.0))
            stop.set()
        else:
            answers.append(True)
        return real_stats(engine)

    async def generate(engine, *args):
        generation = await real_generate(engine, *args)
        if len(answers) >= 1:
            generated.set()
        return generation

    monkeypatch.setattr(TorchEngine, "stats", slow_stats)
    monkeypatch.setattr(TorchEngine, "generate", generate)
    run_rollouts(run, time.time() + WAIT_S, "w0", progress_every_s=0.05, stop=stop)

    assert answers[1], "no generation finished while a status waited for the replica's counters"


def test_a_status_due_ahead_of_the_beat_that_fails_to_publish_is_published_again(
    tmp_path, monkeypatch, caplog
):
    """A drained replica emptied (``RolloutWorker.status_due``) and the status published at
    once for the trainer fails (a storage hiccup): it is published again shortly after, not
    left to the next beat (here 1,000 s away)."""
    run, store = small_worker_run(tmp_path, "due-status")
    publish = RolloutStatusBoard.publish
    due, attempts = threading.Event(), []

    def flaky_publish(board, status):
        if due.is_set() and not attempts:
            attempts.append("failed")
            raise OSError("store unreachable (injected)")
        publish(board, status)
        if due.is_set():
            attempts.append(status.running)

    def check_emptied(worker):  # one replica found empty, once; the run stops once its status is out
        if not due.is_set():
            due.set()
            worker.status_due.set()
        elif len(attempts) > 1:
            worker.stop()

    monkeypatch.setattr(RolloutStatusBoard, "publish", flaky_publish)
    monkeypatch.setattr(RolloutWorker, "_check_emptied", check_emptied)
    run_rollouts(run, time.time() + WAIT_S, "w0", progress_every_s=1000.0)

    assert attempts == ["failed", True, False]
    assert "worker w0 could not publish its status: store unreachable (injected)" in caplog.text


@pytest.mark.parametrize("one_set", [True, False])
def test_a_wait_for_the_first_of_two_events_leaves_no_wait_behind(one_set):
    """Whether one event was set or the time ran out, the wait on the other is cancelled: the
    report loop waits so at every beat, and a wait left behind each time would pile up."""

    async def waits_left() -> list[asyncio.Task]:
        unset, other = asyncio.Event(), asyncio.Event()
        if one_set:
            other.set()
        await first_set((unset, other), WAIT_S if one_set else 0.01)
        await asyncio.sleep(0)  # a cancelled wait is done at the loop's next turn
        return [
            task for task in asyncio.all_tasks() if task is not asyncio.current_task() and not task.done()
        ]

    assert asyncio.run(waits_left()) == []


def test_a_workers_group_filter_compares_rewards_as_the_runs_processor_trains_them(tmp_path):
    """The worker a rollout task builds scores a group's members for DAPO's filter with the
    run's ``processor`` (``combine_reward``): a failure's partial progress lifts its reward
    by ``progress_weight``, a success keeps its own."""
    run, _ = small_worker_run(tmp_path, "trained-reward")
    run = run.model_copy(update={"processor": run.processor.model_copy(update={"progress_weight": 0.25})})
    worker, env_pool = rollout_task._build_worker(run, "w0", 64, 10.0, None, lambda: None)
    assert env_pool is None
    assert worker.trained_reward(0.0, 0.8) == pytest.approx(0.2)
    assert worker.trained_reward(1.0, 0.1) == 1.0 and worker.trained_reward(None, None) == 0.0


def test_a_workers_replicas_are_held_to_the_trainers_max_staleness(tmp_path):
    """The worker a rollout task builds takes a replica out of service past the run's
    ``sao.max_staleness``, the trainer's limit (it had none: a replica whose loads failed
    served tokens the trainer dropped, for as long as they failed)."""
    run, _ = small_worker_run(tmp_path, "max-staleness")
    run = run.model_copy(update={"sao": run.sao.model_copy(update={"max_staleness": 2})})
    worker, _ = rollout_task._build_worker(run, "w0", 64, 10.0, None, lambda: None)
    assert worker.max_staleness == 2
