"""The pipeline flow under the Prefect test harness: it completes, reports, emits events,
and its Delta tables answer SQL through duckdb."""

from __future__ import annotations

import base64
import re
import signal
import sys
import threading
import time

import pytest
from prefect.states import Completed, Crashed, Failed

from flows import pipeline as pipeline_module
from flows.sql import connect
from rollout.config import GatewayHTTPConfig
from storage.tables import Tables
from tasks.common import run_store, send_signal, signal_path, signals_dir
from tasks.report import artifact_key
from tests.flows.conftest import tiny_config
from tests.flows.prefect_api import artifacts_of, count, run_logs, wait_for_events

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_pipeline_completes_and_trains(pipeline_run):
    assert pipeline_run.state.is_completed(), pipeline_run.state.message
    result = pipeline_run.result
    assert result["before"]["version"] == 0
    assert result["after"]["version"] >= 1, "no weight version was published during the run"
    assert result["rollouts"]["finished"] > 0
    assert result["processed"]["shards"] >= 1
    assert result["trained"]["steps"] >= 1
    assert set(result["gain"]) == {"arith", "guess"}


def test_the_last_rollout_progress_line_tells_what_the_workers_rollouts_came_to(pipeline_run):
    """The last line was the count alone: a run shorter than the log pace never showed its
    served version, rewards, failures or dropped groups."""
    lines = [m for _, _, m in run_logs(pipeline_run.flow_run_id) if m.startswith("Rollouts finished: ")]
    finished = pipeline_run.result["rollouts"]["finished"]
    assert re.match(
        rf"Rollouts finished: \d+ — this worker finished {finished}, serving v\d+, ", lines[-1]
    ), lines


def test_pipeline_artifacts_progress_tables_and_curves(pipeline_run):
    artifacts = artifacts_of([pipeline_run.flow_run_id])
    by_type: dict[str, list] = {}
    for artifact in artifacts:
        by_type.setdefault(artifact.type, []).append(artifact)
    progress = {a.description.split(":")[0]: a.data for a in by_type["progress"]}
    assert progress == {"Rollouts finished": 100.0, "Policy steps": 100.0}
    key = artifact_key(pipeline_run.config.run_id)
    tables = {a.key: a for a in by_type["table"]}
    assert {f"{key}-evals", f"{key}-shards"} <= set(tables)
    (markdown,) = by_type["markdown"]
    assert markdown.key == f"{key}-report"
    png_url = pipeline_run.store.url("reports", "curves.png")
    assert f"](<{png_url}>)" in markdown.data
    assert "| step | version | reward |" in markdown.data
    with pipeline_run.store.fs.open(pipeline_run.store.path("reports/curves.png"), "rb") as png:
        stored = png.read()
    assert stored.startswith(PNG_MAGIC)
    # the UI shows the page's own copy: it cannot fetch the stored file
    (embedded,) = re.findall(
        r"!\[reward and loss curves\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown.data
    )
    assert base64.b64decode(embedded) == stored


def test_pipeline_events_match_the_tables(pipeline_run):
    tables = Tables(pipeline_run.store)
    shards = tables.read("shards").to_pylist()
    raw = [s for s in shards if s["kind"] == "raw"]
    # version 0 too: the pipeline's warm start published it
    versions = sorted(r["version"] for r in tables.read("weights").to_pylist())
    assert versions[0] == 0
    expected = {
        "treadle.shard.committed": len(raw),
        "treadle.shard.processed": len(raw),
        "treadle.weights.published": len(versions),
    }
    events = wait_for_events(
        f"treadle.run.{pipeline_run.config.run_id}",
        lambda events: all(count(events, name) >= n for name, n in expected.items()),
    )
    assert {name: count(events, name) for name in expected} == expected
    committed = {e.payload["shard_id"] for e in events if e.event == "treadle.shard.committed"}
    assert committed == {s["shard_id"] for s in raw}
    processed = {e.payload["raw_shard"] for e in events if e.event == "treadle.shard.processed"}
    assert processed == committed
    published = sorted(e.payload["version"] for e in events if e.event == "treadle.weights.published")
    assert published == versions
    # each shows on the pipeline's run page in the UI: the flow run is among its related resources
    run_resource = f"prefect.flow-run.{pipeline_run.flow_run_id}"
    unrelated = [e.event for e in events if run_resource not in {r.id for r in e.related}]
    assert unrelated == []


def test_pipeline_tables_read_by_duckdb(pipeline_run):
    result = pipeline_run.result
    db = connect(pipeline_run.store)
    (raw_rows,) = db.execute("SELECT sum(num_rows) FROM shards WHERE kind = 'raw'").fetchone()
    (trajectories,) = db.execute("SELECT count(*) FROM trajectories").fetchone()
    assert trajectories == raw_rows == result["rollouts"]["finished"]
    evals = db.execute("SELECT version, env, count FROM evals ORDER BY version, env").fetchall()
    final = result["after"]["version"]
    assert evals == [(0, "arith", 4), (0, "guess", 4), (final, "arith", 4), (final, "guess", 4)]
    (steps, newest) = db.execute("SELECT count(*), max(version) FROM train_steps").fetchone()
    assert steps == result["trained"]["steps"]
    assert newest <= final
    per_version = db.execute(
        "SELECT max_version, count(*) FROM trajectories GROUP BY max_version ORDER BY max_version"
    ).fetchall()
    assert per_version[0][0] == 0
    assert sum(n for _, n in per_version) == trajectories


def _pipeline_in_thread(config, timeout_s: float = 300):
    """The pipeline's final state, or a failure if it is still running after ``timeout_s``."""
    from flows.pipeline import pipeline

    outcome = {}
    runner = threading.Thread(
        target=lambda: outcome.update(state=pipeline(config, return_state=True)), daemon=True
    )
    runner.start()
    runner.join(timeout_s)
    assert not runner.is_alive(), f"the pipeline is still running after {timeout_s} s"
    return outcome["state"]


@pytest.mark.parametrize(
    ("stop", "stop_reason"),
    [({"max_policy_steps": 2}, "max_steps"), ({"max_rollouts": 24}, "drained")],
)
def test_with_no_wall_clock_limit_the_pipeline_ends_with_its_first_stop_condition(
    tmp_path, prefect_api, stop, stop_reason
):
    config = tiny_config(tmp_path / "runs", "no-limit", stop={"max_seconds": None, **stop})
    result = _pipeline_in_thread(config).result()
    assert result["trained"]["stop_reason"] == stop_reason
    store = run_store(config)
    assert not store.fs.exists(store.path("status/signals")) or not store.fs.ls(store.path("status/signals"))
    if "max_rollouts" in stop:  # the rollouts ended first: all they wrote is processed, then trained
        assert result["rollouts"]["written"] == result["processed"]["trajectories_in"] == 24
    else:
        assert result["trained"]["steps"] == 2


def test_a_failed_process_task_ends_the_pipeline_as_failed(tmp_path, prefect_api, monkeypatch):
    import tasks.process

    def broken(*args, **kwargs):
        raise ValueError("the processor has a bug (injected)")

    monkeypatch.setattr(tasks.process, "run_processor", broken)
    config = tiny_config(
        tmp_path / "runs", "process-fails", stop={"max_seconds": None, "max_policy_steps": 2}
    )
    state = _pipeline_in_thread(config)
    assert state.is_failed()
    with pytest.raises(ValueError, match="injected"):
        state.result()


def test_artifact_keys_are_valid_and_keep_runs_with_similar_ids_apart():
    keys = {artifact_key(run_id) for run_id in ("exp_1", "exp-1", "Exp.1", "exp 1")}
    assert len(keys) == 4
    assert all(re.fullmatch(r"[a-z0-9-]+", key) for key in keys)


class SignalledTask:
    """A task's future that ends once signal ``name`` of its flow run is raised."""

    def __init__(self, store, key: str, name: str):
        self.store, self.key, self.name, self.waited = store, key, name, False

    def wait(self) -> None:
        assert self.store.fs.exists(self.store.path(signal_path(self.key, self.name))), self.name
        self.waited = True


def test_a_pipeline_that_is_interrupted_removes_its_signals_once_its_tasks_are_over(tmp_path, monkeypatch):
    """Interrupted while it waits for its tasks, the flow raises their signals, waits for them
    to end and removes its own signals; another flow run's are left."""
    config = tiny_config(tmp_path / "runs", "interrupted")
    store = run_store(config)
    send_signal(store, "another-run", "stop")
    # the signal each task ends at: the process task watches for the rollouts' end alone
    tasks = [SignalledTask(store, "this-run", name) for name in ("stop", "rollouts-done", "stop")]

    def interrupted(futures):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline_module, "as_completed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipeline_module._wind_down(config, "this-run", *tasks)
    assert all(task.waited for task in tasks)
    assert store.fs.ls(store.path("status/signals"), detail=False) == [store.path(signals_dir("another-run"))]


def test_a_ctrl_c_the_kernel_gives_to_a_tasks_thread_winds_the_pipeline_down_at_once(
    tmp_path, prefect_api, monkeypatch
):
    """A process-wide signal goes to any thread that does not block it, and Python runs its
    handler in the main thread only once that thread runs again: the flow, waiting on its tasks
    without a timeout, heard a Ctrl-C (a cancellation's SIGTERM) given to a task's thread only
    once a task had ended on its own (its deadline, or its stop condition), and its signals
    told none of them to end."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.task_runners import ThreadPoolTaskRunner

    from tasks.common import watch_signal

    config = tiny_config(tmp_path / "runs", "interrupted-in-a-task")
    store = run_store(config)
    waiting = threading.Event()
    ended = {}

    def as_completed(runs):
        waiting.set()
        return pipeline_module.as_completed.__wrapped__(runs)

    as_completed.__wrapped__ = pipeline_module.as_completed
    monkeypatch.setattr(pipeline_module, "as_completed", as_completed)

    @task(cache_policy=NO_CACHE)
    def ends_at(name: str, signal_name: str) -> None:
        if name == "rollouts":  # the kernel gives the signal to this task's thread
            waiting.wait()
            # whatever mask this pool's thread inherited from whoever started it
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        with watch_signal(store, "this-run", signal_name) as told:
            # the test's own bound on a flow that never hears the signal
            ended[name] = "at its signal" if told.wait(30) else "on its own"

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=3))
    def winding_down():
        runs = [ends_at.submit(*names) for names in TASK_SIGNALS]
        return pipeline_module._wind_down(config, "this-run", *runs)

    # Python's own Ctrl-C, whatever handler an earlier test of this process left
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            winding_down()
    finally:
        signal.signal(signal.SIGINT, before)
    assert ended == {name: "at its signal" for name, _ in TASK_SIGNALS}
    assert not store.fs.exists(store.path(signals_dir("this-run")))


def test_a_ctrl_c_while_the_pipeline_submits_its_tasks_ends_those_already_submitted(
    tmp_path, prefect_api, monkeypatch
):
    """Interrupted between two submissions, the flow had not begun its wind-down: the rollouts
    task, already running, was told nothing, and the flow's task runner waited on its thread
    until the rollouts' own deadline (none at all without ``stop.max_seconds``)."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    import tasks.process
    import tasks.rollout
    import tasks.weights
    from tasks.common import watch_signal

    config = tiny_config(tmp_path / "runs", "interrupted-submitting")
    store = run_store(config)
    ended = {}
    started = threading.Event()

    @task(cache_policy=NO_CACHE)
    def rollouts(config, signals: str) -> None:
        with watch_signal(store, signals, "stop") as told:
            started.set()
            # the test's own bound on a flow that never raises the signal
            ended["rollouts"] = "at its signal" if told.wait(30) else "on its own"

    class Interrupted:
        def submit(self, *args, **kwargs):
            started.wait(30)  # a task runner cancels a task it has not started
            raise KeyboardInterrupt

    monkeypatch.setattr(tasks.rollout, "rollouts", rollouts)
    monkeypatch.setattr(tasks.process, "process_shards", Interrupted())
    monkeypatch.setattr(tasks.weights, "warm_start", lambda config: None)
    monkeypatch.setattr(tasks.weights, "evaluate_task", lambda config, reuse: {"version": 0, "reward": {}})
    with pytest.raises(KeyboardInterrupt):
        pipeline_module.pipeline(config)
    assert ended == {"rollouts": "at its signal"}
    signals = store.path("status/signals")
    assert not store.fs.exists(signals) or not store.fs.ls(signals)


TASK_SIGNALS = [("rollouts", "stop"), ("process", "rollouts-done"), ("train", "stop")]
"""Each task of the pipeline and the signal it ends at when the flow is stopped."""


def test_the_pipelines_wall_clock_budget_counts_from_when_its_rollout_worker_is_up(
    tmp_path, prefect_api, monkeypatch
):
    """stop.max_seconds counted from the flow's start (before the tasks were submitted): a
    worker's start-up, on a fresh Ray cluster tens of seconds of actors and engines, ate a
    short run's budget. The rollouts, processing and training now share one deadline, taken
    once the worker is up: no earlier than its start-up's end plus the budget."""
    import tasks.process
    import tasks.train
    from rollout.worker import RolloutWorker

    up, deadlines = [], {}
    start, run = RolloutWorker.start, RolloutWorker.run

    async def started(worker):
        await start(worker)
        up.append(time.time())

    async def running(worker, max_seconds=None):
        deadlines["rollouts"] = time.time() + max_seconds
        return await run(worker, max_seconds)

    def spying(module, name, key):
        real = getattr(module, name)

        def spy(config, deadline, *args, **kwargs):
            def recorded() -> float:
                deadlines[key] = deadline() if callable(deadline) else deadline
                return deadlines[key]

            return real(config, recorded, *args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    monkeypatch.setattr(RolloutWorker, "start", started)
    monkeypatch.setattr(RolloutWorker, "run", running)
    spying(tasks.train, "run_trainer", "train")
    spying(tasks.process, "run_processor", "process")
    budget = 2.0
    config = tiny_config(
        tmp_path / "runs",
        "budget-from-start",
        warm_start={"enabled": False},
        eval={"tasks_per_env": 1},
        stop={"max_seconds": budget},
    )
    state = _pipeline_in_thread(config)
    assert state.is_completed(), state.message
    (worker_up,) = up
    assert deadlines["train"] >= worker_up + budget
    assert deadlines["rollouts"] >= worker_up + budget
    assert deadlines["process"] == deadlines["train"] + tasks.process.DRAIN_SECONDS


def test_the_trainer_loads_while_the_rollout_worker_starts(tmp_path, prefect_api, monkeypatch):
    """Processing and training were submitted only once the rollout worker was up: the trainer's
    own load (its model and optimizer) came out of the run's budget, and the run's wall time
    grew by the worker's start-up. The three are submitted at once, processing and training
    waiting for the worker's deadline themselves: here the worker starts once the trainer loads."""
    import asyncio

    import tasks.train
    from rollout.worker import RolloutWorker

    loading, waited = threading.Event(), []
    build, start = tasks.train.Trainer, RolloutWorker.start

    def loaded(*args, **kwargs):
        loading.set()
        return build(*args, **kwargs)

    async def started(worker):
        # the bound only ends a wait that fails the test: a trainer that never loads meanwhile
        waited.append(await asyncio.to_thread(loading.wait, 120))
        await start(worker)

    monkeypatch.setattr(tasks.train, "Trainer", loaded)
    monkeypatch.setattr(RolloutWorker, "start", started)
    config = tiny_config(
        tmp_path / "runs",
        "trainer-loads-meanwhile",
        warm_start={"enabled": False},
        eval={"tasks_per_env": 1},
        stop={"max_seconds": 2.0},
    )
    state = _pipeline_in_thread(config)
    assert state.is_completed(), state.message
    assert waited == [True]


def test_a_retried_rollouts_task_keeps_the_deadline_its_first_attempt_gave_the_pipeline(
    tmp_path, prefect_api, monkeypatch
):
    """A rollouts task retried after a transient error took a new deadline, a whole budget
    from its retry, while processing and training kept the first one."""
    from prefect import flow

    import tasks.rollout
    from rollout.worker import RolloutWorker
    from tasks.weights import build_base_version

    ends, run = [], RolloutWorker.run

    async def running(worker, max_seconds=None):
        ends.append(time.time() + max_seconds)
        return await run(worker, min(max_seconds, 1.0))  # its deadline recorded, not waited for

    monkeypatch.setattr(RolloutWorker, "run", running)
    config = tiny_config(
        tmp_path / "runs", "retried-deadline", warm_start={"enabled": False}, stop={"max_seconds": 600.0}
    )
    build_base_version(config)
    first = time.time() + 5.0
    send_signal(run_store(config), "this-run", "started", content=repr(first))

    @flow
    def retried() -> dict:
        return tasks.rollout.rollouts(config, signals="this-run")

    retried()
    (end,) = ends
    assert end < first + 60


def test_a_pipeline_whose_rollout_worker_never_comes_up_raises_why_and_leaves_no_signals(
    tmp_path, prefect_api, monkeypatch
):
    """A rollouts task that failed before its worker came up raised no deadline: it is the
    run's error, not a wait for ever; processing and training, waiting for that deadline, end
    without training, and the run leaves no signals."""
    import tasks.process
    import tasks.rollout
    import tasks.train

    results = {}

    def broken(*args, **kwargs):
        raise ValueError("the engines did not load (injected)")

    def recording(module, name, key):
        real = getattr(module, name)

        def recorded(*args, **kwargs):
            results[key] = real(*args, **kwargs)
            return results[key]

        monkeypatch.setattr(module, name, recorded)

    monkeypatch.setattr(tasks.rollout, "_build_worker", broken)
    recording(tasks.train, "run_trainer", "train")
    recording(tasks.process, "run_processor", "process")
    config = tiny_config(
        tmp_path / "runs", "no-worker", warm_start={"enabled": False}, eval={"tasks_per_env": 1}
    )
    state = _pipeline_in_thread(config)
    assert state.is_failed()
    with pytest.raises(ValueError, match=r"^the engines did not load \(injected\)$"):
        state.result()
    assert results["train"]["steps"] == 0 and results["train"]["versions"] == []
    assert results["process"].get("shards", 0) == 0
    store = run_store(config)
    assert not store.fs.exists(store.path("status/signals")) or not store.fs.ls(store.path("status/signals"))


def test_a_pipeline_whose_rollout_worker_never_comes_up_ends_when_the_store_refuses_its_signals(
    tmp_path, prefect_api, monkeypatch
):
    """A store refusing writes (a full disk) as a rollouts task failed before its worker came
    up: processing and training, which wait for the deadline that worker raises, never heard
    the run end, and the flow waited for them for ever. Its own threads hear it all the same."""
    import tasks.rollout

    def broken(*args, **kwargs):
        raise ValueError("the engines did not load (injected)")

    monkeypatch.setattr(tasks.rollout, "_build_worker", broken)
    config = tiny_config(
        tmp_path / "runs", "disk-full", warm_start={"enabled": False}, eval={"tasks_per_env": 1}
    )
    fs_type = type(run_store(config).fs)
    pipe_file = fs_type.pipe_file

    def full(fs, path, *args, **kwargs):
        if "/status/signals/" in str(path):
            raise OSError(28, "No space left on device (injected)")
        return pipe_file(fs, path, *args, **kwargs)

    def unretried(store, key, name, *args):  # no store to wait for here: refused at the first try
        send_signal(store, key, name, ())

    monkeypatch.setattr(fs_type, "pipe_file", full)
    monkeypatch.setattr(pipeline_module, "send_signal", unretried)
    state = _pipeline_in_thread(config)
    with pytest.raises(ValueError, match=r"^the engines did not load \(injected\)$"):
        state.result()


class FinishedTask:
    """A task's future that is over, with ``value`` as its result."""

    state = Completed()

    def __init__(self, value: dict):
        self.value = value

    def wait(self) -> None:
        pass

    def result(self) -> dict:
        return self.value


def test_a_pipeline_whose_signals_cannot_be_removed_still_returns_its_tasks_results(
    tmp_path, prefect_api, monkeypatch
):
    """A store that fails the removal of the signals once all three tasks are done leaves
    them behind with a warning; it failed the run before its last evaluation and report."""
    from prefect import flow

    config = tiny_config(tmp_path / "runs", "signals-stay")
    store = run_store(config)

    def refused(store, key):
        raise OSError("the store refused the delete (injected)")

    monkeypatch.setattr(pipeline_module, "as_completed", iter)  # the rollouts end first
    monkeypatch.setattr(pipeline_module, "clear_signals", refused)

    @flow
    def winding_down():
        tasks = [FinishedTask({"task": name}) for name in ("rollouts", "process", "train")]
        return pipeline_module._wind_down(config, "this-run", *tasks)

    state = winding_down(return_state=True)
    assert state.is_completed()
    assert state.result() == ({"task": "rollouts"}, {"task": "process"}, {"task": "train"})
    assert store.fs.exists(store.path(signal_path("this-run", "processed")))


def test_a_pipeline_whose_signal_the_store_refused_once_returns_its_tasks_results(
    tmp_path, prefect_api, monkeypatch, caplog
):
    """A store away past the retries of one signal, back for the next: the signals were all
    raised on the second try and the three tasks ended as they do, yet the store's error
    failed the run before its last evaluation and report. It is logged."""
    from prefect import flow

    config = tiny_config(tmp_path / "runs", "signal-refused-once")
    refusals = []

    def refused_once(store, key, name, *args, **kwargs):
        if not refusals:
            refusals.append(name)
            raise OSError(f"the store refused signal {name!r} (injected)")
        send_signal(store, key, name, *args, **kwargs)

    monkeypatch.setattr(pipeline_module, "send_signal", refused_once)
    monkeypatch.setattr(pipeline_module, "as_completed", iter)  # the rollouts end first

    @flow
    def winding_down():
        tasks = [FinishedTask({"task": name}) for name in ("rollouts", "process", "train")]
        return pipeline_module._wind_down(config, "this-run", *tasks)

    state = winding_down(return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == ({"task": "rollouts"}, {"task": "process"}, {"task": "train"})
    assert refusals == ["rollouts-done"]
    assert "the store refused signal 'rollouts-done' (injected)" in caplog.text
    store = run_store(config)
    assert not store.fs.exists(store.path(signals_dir("this-run")))


class TaskEndingAtSignals:
    """A task's future that, once over, kept which signals were raised."""

    state = Completed()

    def __init__(self, store, key: str, name: str):
        self.store, self.key, self.name, self.told = store, key, name, None

    def wait(self) -> None:
        self.told = [
            signal
            for signal in ("stop", "rollouts-done", "processed")
            if self.store.fs.exists(self.store.path(signal_path(self.key, signal)))
        ]

    def result(self) -> dict:
        return {"task": self.name}


@pytest.mark.parametrize(
    ("signal", "first", "told"),
    [
        ("rollouts-done", 0, [[], ["rollouts-done"], ["rollouts-done", "processed"]]),
        ("stop", 2, [["stop"], ["stop", "rollouts-done"], ["stop", "rollouts-done", "processed"]]),
    ],
    ids=["rollouts-end-first", "training-ends-first"],
)
def test_a_signal_the_store_refused_past_its_retries_then_took_still_ends_the_tasks_in_order(
    tmp_path, prefect_api, monkeypatch, signal, first, told
):
    """A store that refused 'rollouts-done' past a signal's retries, then took it: the flow
    raised the three signals at once, so training was told to stop (and drain) while
    processing still handled the last shards, which no trainer of the run then saw. The
    refused signal is tried again in order: processing ends before the trainer hears of it,
    and, when training ended first, the rollouts before processing hears they are done."""
    from prefect import flow

    from tasks.common import SIGNAL_RETRY_S

    config = tiny_config(tmp_path / "runs", "signal-refused-in-order")
    store = run_store(config)
    fs_type = type(store.fs)
    pipe_file = fs_type.pipe_file
    refused = []

    def away_for_a_while(fs, path, *args, **kwargs):
        if str(path).endswith(f"/{signal}") and len(refused) <= len(SIGNAL_RETRY_S):
            refused.append(path)
            raise ConnectionResetError("connection reset (injected)")
        return pipe_file(fs, path, *args, **kwargs)

    monkeypatch.setattr(fs_type, "pipe_file", away_for_a_while)
    monkeypatch.setattr(
        pipeline_module, "WIND_DOWN_RETRY_S", (0.01,) * len(pipeline_module.WIND_DOWN_RETRY_S)
    )
    monkeypatch.setattr(pipeline_module, "as_completed", lambda runs: iter(runs[first:]))
    tasks = [TaskEndingAtSignals(store, "this-run", name) for name in ("rollouts", "process", "train")]

    @flow
    def winding_down():
        return pipeline_module._wind_down(config, "this-run", *tasks)

    state = winding_down(return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == ({"task": "rollouts"}, {"task": "process"}, {"task": "train"})
    assert len(refused) == len(SIGNAL_RETRY_S) + 1, "the store refused the signal past its retries"
    assert [task.told for task in tasks] == told, "a task was told of a signal before the one before it ended"


class RolloutsFailedAtStart:
    """The future of a rollouts task that failed before its worker came up."""

    state = Failed()

    def wait(self, timeout: float | None = None) -> None:
        pass

    def result(self) -> dict:
        raise ValueError("the engines did not load (injected)")


def test_a_pipeline_whose_rollouts_task_failed_raises_its_error_when_the_store_refuses_its_signals(
    tmp_path, prefect_api, monkeypatch, caplog
):
    """The store refusing the signals (down past its retries) as the run wound down after a
    rollouts task that failed before its worker came up: the store's error replaced the
    rollouts' as the run's error. The refusals are logged."""
    from prefect import flow

    config = tiny_config(tmp_path / "runs", "signals-refused")

    def refused(store, key, name, *args, **kwargs):
        raise OSError(f"the store refused signal {name!r} (injected)")

    monkeypatch.setattr(pipeline_module, "send_signal", refused)
    monkeypatch.setattr(pipeline_module, "as_completed", iter)  # the rollouts end first

    @flow
    def winding_down():
        tasks = [RolloutsFailedAtStart(), FinishedTask({"task": "process"}), FinishedTask({"task": "train"})]
        return pipeline_module._wind_down(config, "this-run", *tasks)

    with pytest.raises(ValueError, match=r"^the engines did not load \(injected\)$"):
        winding_down()
    assert "could not raise signal 'rollouts-done'" in caplog.text
    assert "the store refused signal 'rollouts-done' (injected)" in caplog.text


class TrainerCrashed:
    """The future of a train task whose worker died under it (Ray gives such a task a Crashed
    state, not a Failed one)."""

    state = Crashed()

    def wait(self, timeout: float | None = None) -> None:
        pass

    def result(self) -> dict:
        raise RuntimeError("the trainer's worker died (injected)")


def test_a_pipeline_whose_trainer_crashed_raises_its_error_when_the_store_refuses_its_signals(
    tmp_path, prefect_api, monkeypatch
):
    """A trainer that crashed, and a store refusing the signals as the run wound down: only a
    failed task's error was looked for, so the store's error replaced the crash as the run's."""
    from prefect import flow

    config = tiny_config(tmp_path / "runs", "trainer-crashed")

    def refused(store, key, name, *args, **kwargs):
        raise OSError(f"the store refused signal {name!r} (injected)")

    monkeypatch.setattr(pipeline_module, "send_signal", refused)
    monkeypatch.setattr(pipeline_module, "as_completed", lambda runs: iter(runs[2:]))  # training ends first

    @flow
    def winding_down():
        tasks = [FinishedTask({"task": "rollouts"}), FinishedTask({"task": "process"}), TrainerCrashed()]
        return pipeline_module._wind_down(config, "this-run", *tasks)

    with pytest.raises(RuntimeError, match=r"^the trainer's worker died \(injected\)$"):
        winding_down()


def test_a_pipeline_run_on_a_cuda_device_the_machine_lacks_fails_before_the_warm_start(tmp_path, prefect_api):
    """As a run started from a deployment's form does (the command line refuses it before a
    flow run starts); no machine shows 100 GPUs."""
    config = tiny_config(tmp_path / "runs", "no-such-gpu", trainer_device="cuda:99")
    state = pipeline_module.pipeline(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=r"^trainer_device is 'cuda:99', but this machine shows "):
        state.result()
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_a_pipeline_run_whose_reward_models_are_on_a_cuda_device_the_machine_lacks_fails_before_the_warm_start(
    tmp_path, prefect_api
):
    """The reward models are served in the flow's own process: on a device it lacks, the run
    failed only once the warm start was over (a run started from a deployment's form)."""
    service = {"reward_models": {"judge": {"path": str(tmp_path)}}, "reward_device": "cuda:99"}
    config = tiny_config(
        tmp_path / "runs", "no-such-reward-gpu", service=service, envs={"arith": {"reward_model": "judge"}}
    )
    state = pipeline_module.pipeline(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=r"^service.reward_device is 'cuda:99', but this machine shows "):
        state.result()
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize("missing", ["ray", "prefect_ray"])
def test_a_ray_pipeline_run_on_a_machine_without_the_ray_extra_fails_before_the_warm_start(
    tmp_path, prefect_api, monkeypatch, missing
):
    """It failed with ``No module named 'prefect_ray'`` once the warm start and the first
    evaluation were over."""
    monkeypatch.setitem(sys.modules, missing, None)  # its import then fails as if not installed
    config = tiny_config(tmp_path / "runs", "no-ray", cluster="ray")
    state = pipeline_module.pipeline(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=rf"^cluster is 'ray', but {missing} is not installed: pip install"):
        state.result()
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_a_ray_pipeline_run_on_a_cuda_device_the_machine_lacks_fails_before_the_warm_start(
    tmp_path, prefect_api
):
    """With cluster 'ray' the evaluations still run in the flow's own process: on a device
    it lacks, the first one failed after the warm start."""
    config = tiny_config(
        tmp_path / "runs", "no-such-gpu-ray", cluster="ray", engine={"torch": {"device": "cuda:99"}}
    )
    state = pipeline_module.pipeline(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=r"^engine.torch.device is 'cuda:99', but this machine shows "):
        state.result()
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_a_rerun_whose_trainer_took_no_step_is_warned_though_the_runs_step_counter_is_not_zero(
    tmp_path, prefect_api, monkeypatch, caplog
):
    """The train task's ``steps`` is the run's counter, the steps of the version it resumed from
    included: a rerun that trained nothing ended at that step and was never warned."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    import tasks.process
    import tasks.rollout
    import tasks.train
    import tasks.weights

    orchestrator = {"finished": 8, "written": 8, "groups_kept": 0, "groups_filtered": 0}

    @task(cache_policy=NO_CACHE)
    def rollouts(config, signals: str) -> dict:
        return {"orchestrator": orchestrator, "harness_records": 0}

    @task(cache_policy=NO_CACHE)
    def process_shards(config, signals: str) -> dict:
        return {}

    @task(cache_policy=NO_CACHE)
    def train(config, signals: str) -> dict:
        return {"steps": 3, "new_steps": 0, "versions": [], "stop_reason": "drained"}

    monkeypatch.setattr(tasks.rollout, "rollouts", rollouts)
    monkeypatch.setattr(tasks.process, "process_shards", process_shards)
    monkeypatch.setattr(tasks.train, "train", train)
    monkeypatch.setattr(tasks.weights, "warm_start", lambda config: None)
    monkeypatch.setattr(tasks.weights, "evaluate_task", lambda config, reuse: {"version": 3, "reward": {}})
    monkeypatch.setattr(pipeline_module, "report_task", lambda config: None)
    with caplog.at_level("WARNING"):
        result = pipeline_module.pipeline(tiny_config(tmp_path / "runs", "rerun-untrained"))
    assert result["trained"]["steps"] == 3
    assert any(m.startswith("no policy step: the trainer got too little") for m in caplog.messages)


def test_the_warning_of_a_run_that_took_no_policy_step_tells_the_groups_dropped_for_equal_rewards():
    """A GRPO run whose untrained policy failed every task (12844 rollouts, all 3211 groups
    dropped for equal rewards) logged "Policy steps: 0" and ended Completed, with no word why."""
    stats = {"finished": 12844, "written": 0, "groups_kept": 0, "groups_filtered": 3211}
    assert pipeline_module.untrained_warning(worker_result(stats), GatewayHTTPConfig(), UNTRAINED) == (
        "no policy step: the trainer got too little to train on; 0 of 12844 rollouts finished were "
        "written, 3211 of 3211 groups dropped with every reward in them equal "
        "(orchestrator.filter_uniform_groups)"
    )
    stats = {"finished": 40, "written": 40, "groups_kept": 0, "groups_filtered": 0}
    assert pipeline_module.untrained_warning(worker_result(stats), GatewayHTTPConfig(), UNTRAINED) == (
        "no policy step: the trainer got too little to train on; 40 of 40 rollouts finished were written"
    )


def worker_result(orchestrator: dict[str, int], harness_records: int = 0) -> dict:
    """What the rollout task returns, as far as the warning of a run without a policy step reads it."""
    return {"orchestrator": orchestrator, "harness_records": harness_records}


UNTRAINED = {"steps": 0, "new_steps": 0, "stop_reason": "drained"}
"""What the train task returns, as far as that warning reads it, for a run that got too little to train on."""

NOTHING_OF_ITS_OWN = {"finished": 0, "written": 0, "groups_kept": 0, "groups_filtered": 0}


@pytest.mark.parametrize(
    ("harness_records", "said"),
    [(0, "harnesses wrote no record"), (1, "harnesses wrote 1 record"), (3, "harnesses wrote 3 records")],
)
def test_the_warning_of_a_serve_only_run_that_took_no_policy_step_tells_what_harnesses_wrote(
    harness_records, said
):
    """It said "0 of 0 rollouts finished were written": a serve-only worker runs none, and the
    records harnesses had it write, the run's only ones, went unmentioned."""
    http = GatewayHTTPConfig(port=0, serve_only=True)
    assert pipeline_module.untrained_warning(
        worker_result(NOTHING_OF_ITS_OWN, harness_records), http, UNTRAINED
    ) == (
        "no policy step: the trainer got too little to train on; the rollout worker served harnesses only "
        f"(gateway_http.serve_only), and {said}"
    )


def test_the_warning_of_a_run_serving_harnesses_beside_its_own_rollouts_tells_what_they_wrote():
    stats = {"finished": 8, "written": 8, "groups_kept": 2, "groups_filtered": 0}
    http = GatewayHTTPConfig(port=0)
    assert pipeline_module.untrained_warning(worker_result(stats, 2), http, UNTRAINED) == (
        "no policy step: the trainer got too little to train on; 8 of 8 rollouts finished were written, "
        "and harnesses wrote 2 records"
    )


def test_the_warning_of_a_rerun_already_at_its_max_policy_steps_says_so_not_that_data_was_short():
    """A rerun of a run whose step counter had reached stop.max_policy_steps: the trainer stops
    at once, and the run was warned that the trainer "got too little to train on", naming the
    few rollouts written before the stop, which sent its user looking at the rollouts."""
    stats = {"finished": 8, "written": 8, "groups_kept": 2, "groups_filtered": 0}
    trained = {"steps": 40, "new_steps": 0, "stop_reason": "max_steps"}
    warning = pipeline_module.untrained_warning(worker_result(stats), GatewayHTTPConfig(), trained)
    assert warning == (
        "no policy step: the run was already at policy step 40, its stop.max_policy_steps (which counts "
        "the steps of earlier flow runs too): raise it to train further"
    )
