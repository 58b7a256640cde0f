"""The ``cluster: ray`` path on a local Ray instance started by this module: engines as Ray
actors (same tokens and log-probs as a local TorchEngine, versions tagged across a reload,
weights fetched from the store when the directory is not on the node), environments with
their sandboxes in env-worker actors, and rollouts written to shards through both."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import re
import sys
import threading
import time
from collections import Counter

import pytest
import ray
import torch
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from envs import registry
from envs.arith import ArithEnv
from envs.base import EnvHostLost
from flows.config import RunConfig
from rl.models import TinyModelConfig, build_tiny_model, publish_policy
from rollout import ray_actors, ray_engine
from rollout.engines.base import EngineError, EngineStats, InvalidRequest, SamplingParams
from rollout.engines.factory import EngineConfig, build_engines
from rollout.engines.torch_engine import TorchEngine, TorchEngineConfig
from rollout.ray_actors import ActorStartError
from rollout.ray_engine import EngineHost, RayEngine
from rollout.ray_env import RayEnvPool
from rollout.router import Router
from storage.config import RunStore, StorageConfig
from storage.shards import ShardReader
from storage.status import ProcessOffset, ProcessOffsetBoard
from storage.weights import WeightStore
from tasks.rollout import run_rollouts
from tests.conftest import one_ray_at_a_time

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    torch.set_num_threads(1)
    with one_ray_at_a_time():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="treadle-tests")
        yield
        ray.shutdown()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run store holding version 0 (the tiny model) and version 1 (perturbed weights)."""
    config = StorageConfig(root=str(tmp_path_factory.mktemp("runs")))
    store = RunStore(config, "ray")
    weights = WeightStore(store)
    model, tokenizer = build_tiny_model(TINY)
    publish_policy(weights, model, tokenizer, step=0, tag="base")
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn(parameter.shape, generator=generator))
    publish_policy(weights, model, tokenizer, step=1, parent=0)
    return config, store, weights


PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
PROMPTS = [[5, 17, 42, 8], [3, 9, 30, 31, 2, 60]]


async def _generate_all(engine, session: str):
    return [await engine.generate(f"{session}-{i}", prompt, PARAMS) for i, prompt in enumerate(PROMPTS)]


def test_ray_engine_generates_what_the_local_engine_does_and_tags_reloaded_versions(run):
    _, _, weights = run
    v0, v1 = weights.load(0), weights.load(1)

    async def body():
        local = TorchEngine(v0, name="local", version=0)
        remote = RayEngine(TorchEngineConfig(), v0, name="remote", version=0)
        try:
            assert await remote.health()
            assert await remote.pid() != os.getpid()
            before = (await _generate_all(local, "a"), await _generate_all(remote, "a"))
            await local.load_version(1, v1)
            await remote.load_version(1, v1)
            after = (await _generate_all(local, "b"), await _generate_all(remote, "b"))
            stats = remote.stats()
        finally:
            await local.close()
            await remote.close()
        return before, after, stats, remote

    before, after, stats, remote = asyncio.run(body())
    for (local_gens, remote_gens), version in ((before, 0), (after, 1)):
        for local_gen, remote_gen in zip(local_gens, remote_gens, strict=True):
            assert remote_gen.token_ids == local_gen.token_ids
            assert remote_gen.logprobs == pytest.approx(local_gen.logprobs, abs=1e-5)
            assert remote_gen.versions == [version] * len(remote_gen.token_ids)
            assert remote_gen.engine == "remote"
    assert before[1][0].token_ids != after[1][0].token_ids, "version 1's weights changed nothing"
    assert remote.version == 1
    assert stats.requests == 4 and stats.decode_tokens > 0
    assert remote.stats().requests == 4, "a closed RayEngine keeps its final counters"


def test_a_cancelled_generate_stops_decoding_on_the_actor(run):
    """The caller is cancelled (its rollout ended): the actor's request is cancelled too,
    instead of decoding to its token budget for nobody."""
    _, _, weights = run
    long = SamplingParams(max_new_tokens=1000, temperature=1.0, seed=3)

    async def body():
        remote = RayEngine(TorchEngineConfig(), weights.load(0), name="remote", version=0)
        try:
            first = asyncio.create_task(remote.generate("long", PROMPTS[0], long))
            while (await remote._call("stats")).decode_tokens == 0:
                await asyncio.sleep(0.01)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            await remote.generate("short", PROMPTS[1], PARAMS)
            decoded = -1
            for _ in range(300):  # until the actor decodes nothing more
                stats = await remote._call("stats")
                if stats.decode_tokens == decoded:
                    break
                decoded = stats.decode_tokens
                await asyncio.sleep(0.5)
            return stats
        finally:
            await remote.close()

    stats = asyncio.run(body())
    assert stats.requests == 1, "only the short request finished"
    assert stats.decode_tokens < 1000


@ray.remote
class HangingLoads:
    """An engine actor (async, as ``EngineActor``) whose loads never end: a stuck load."""

    def __init__(self, *args):
        self.started, self.cancelled = [], []

    async def load_version(self, version: int, path: str) -> int:
        self.started.append(version)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(version)
            raise
        return version

    def loads(self) -> tuple[list[int], list[int]]:
        """The versions whose loads started, and those whose loads were cancelled."""
        return self.started, self.cancelled

    def stats(self) -> EngineStats:
        return EngineStats()

    async def close(self) -> None:
        pass


def test_a_load_its_caller_gives_up_on_is_cancelled_on_the_actor(monkeypatch):
    """The worker gives up on a load that outlasts ``load_timeout_s`` (``asyncio.wait_for``
    cancels it): the actor's load is cancelled too, rather than going on to apply a version
    its caller no longer waits for, maybe after a newer one."""
    monkeypatch.setattr(ray_engine, "EngineActor", HangingLoads)

    async def body():
        remote = RayEngine(TorchEngineConfig(), "/unused", name="stuck", version=0)
        try:
            load = asyncio.create_task(remote.load_version(1, "/unused"))
            while not (await remote.actor.loads.remote())[0]:
                await asyncio.sleep(0.01)
            load.cancel()
            with pytest.raises(asyncio.CancelledError):
                await load
            for _ in range(300):  # until the actor's load is cancelled (an instant once fixed)
                started, cancelled = await remote.actor.loads.remote()
                if cancelled:
                    break
                await asyncio.sleep(0.1)
            return started, cancelled, remote.version
        finally:
            await remote.close()

    assert asyncio.run(body()) == ([1], [1], 0)


def test_ray_engines_fetch_a_version_their_node_does_not_have(run):
    storage, store, weights = run

    async def body():
        config = EngineConfig(replicas=2)
        engines = build_engines(config, "/nonexistent/v000001", 1, cluster="ray", store=store)
        try:
            assert [e.name for e in engines] == ["ray-torch-0", "ray-torch-1"]
            assert all(isinstance(e, RayEngine) for e in engines)
            remote = await engines[1].generate("s", PROMPTS[0], PARAMS)
        finally:
            await asyncio.gather(*(e.close() for e in engines))
        local = TorchEngine(weights.load(1), version=1)
        try:
            return remote, await local.generate("s", PROMPTS[0], PARAMS)
        finally:
            await local.close()

    remote, local = asyncio.run(body())
    assert remote.token_ids == local.token_ids
    assert remote.versions == [1] * len(remote.token_ids)


def test_an_engine_host_answers_generations_while_it_fetches_a_version_from_the_store(run, monkeypatch):
    """The fetch of a version its node does not have (held here until a generation has been
    answered) leaves the host's event loop free for generations and probes."""
    _, store, weights = run
    fetching, released = threading.Event(), threading.Event()
    load = WeightStore.load

    def held_load(self, version, *args, **kwargs):
        fetching.set()
        assert released.wait(30), "the fetch held the host's event loop: no generation was answered"
        return load(self, version, *args, **kwargs)

    async def body():
        host = EngineHost(TorchEngineConfig().model_dump(), weights.load(0), "host", 0, store)
        monkeypatch.setattr(WeightStore, "load", held_load)
        try:
            loading = asyncio.create_task(host.load_version(1, "/nonexistent/v000001"))
            while not fetching.is_set():
                await asyncio.sleep(0.01)
            generation = await host.generate("s", PROMPTS[0], PARAMS)
            released.set()
            return generation, await loading
        finally:
            released.set()
            await host.close()

    generation, (loaded, _) = asyncio.run(body())
    assert generation.versions == [0] * len(generation.token_ids)
    assert loaded == 1


def test_an_engine_hosts_load_cancelled_while_it_fetches_holds_off_the_next_load_until_its_fetch_ends(
    run, monkeypatch
):
    """A load that times out is cancelled, but its fetch's thread cannot be: the host let go of
    its one-load-at-a-time lock at the cancel, and the next load fetched beside it (the older
    fetch finishing last lets go of the newer copy, ``one_copy``)."""
    _, store, weights = run
    fetching, released = threading.Event(), threading.Event()
    at_once, most = [0], [0]
    load = WeightStore.load

    def held_load(self, version, *args, **kwargs):
        at_once[0] += 1
        most[0] = max(most[0], at_once[0])
        fetching.set()
        try:
            released.wait(30)
            return load(self, version, *args, **kwargs)
        finally:
            at_once[0] -= 1

    async def body():
        host = EngineHost(TorchEngineConfig().model_dump(), weights.load(0), "host", 0, store)
        monkeypatch.setattr(WeightStore, "load", held_load)
        try:
            first = asyncio.create_task(host.load_version(1, "/nonexistent/v000001"))
            while not fetching.is_set():
                await asyncio.sleep(0.01)
            first.cancel()
            await asyncio.sleep(0.1)  # the cancel lands while the fetch is held
            second = asyncio.create_task(host.load_version(1, "/nonexistent/v000001"))
            await asyncio.sleep(0.2)  # a second fetch, were it let start, would be under way
            released.set()
            with pytest.raises(asyncio.CancelledError):
                await first
            return await second
        finally:
            released.set()
            await host.close()

    loaded, _ = asyncio.run(body())
    assert loaded == 1 and most[0] == 1


def test_ray_engine_without_the_directory_or_a_store_fails_clearly():
    async def body():
        engine = RayEngine(TorchEngineConfig(), "/nonexistent/v000000", name="lost")
        try:
            return await engine.generate("s", [1, 2], PARAMS)
        finally:
            await engine.close()

    with pytest.raises(Exception, match="not on this node and no run store"):
        asyncio.run(body())


@pytest.mark.parametrize("env_name", ["arith", "shell"])
def test_env_worker_actor_runs_sandboxed_env(env_name):
    tasks = registry.task_set(env_name, "train", seed=0, n=2)

    async def episode(env, task):
        messages = await env.reset(task)
        rewards = []
        for action in registry.demonstrate(task):
            result = await env.step(action)
            rewards.append(result.reward)
            if result.done:
                break
        score = await env.evaluate()
        await env.close()
        return messages, rewards, score

    async def body():
        pool = RayEnvPool({env_name: registry.make_config(env_name)}, num_workers=2)
        try:
            remote = await asyncio.gather(*(episode(pool.make_env(t), t) for t in tasks))
            pids = ray.get([actor.pid.remote() for actor in pool.actors])
            still_open = ray.get([actor.open_count.remote() for actor in pool.actors])
            unstarted = pool.make_env(tasks[0])
            with pytest.raises(KeyError, match="no open environment"):
                await unstarted.step("1")
        finally:
            pool.close()
        local = [await episode(registry.make(env_name), t) for t in tasks]
        return remote, local, pids, still_open

    remote, local, pids, still_open = asyncio.run(body())
    assert remote == local
    assert all(score == 1.0 for _, _, score in remote), "the scripted solver should solve every task"
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert still_open == [0, 0]


def test_an_env_the_driver_registered_runs_on_the_actors(monkeypatch):
    """A user environment exists only in the driver's registry: its class travels to the
    actors with its config (the actors' own registry holds the built-in ones alone)."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))

    @registry.register
    class Sums(ArithEnv):
        name = "sums"

    task = registry.task_set("sums", "train", seed=0, n=1)[0]

    async def body():
        pool = RayEnvPool({"sums": registry.make_config("sums")}, num_workers=1)
        try:
            env = pool.make_env(task)
            await env.reset(task)
            (action,) = registry.demonstrate(task)
            result = await env.step(action)
            with pytest.raises(KeyError, match="not one this pool was built for"):
                pool.make_env(registry.task_set("arith", "train", seed=0, n=1)[0])
            return result.reward
        finally:
            pool.close()

    assert asyncio.run(body()) == 1.0


DRIVER_ONLY_ENV = """
from envs.arith import ArithEnv


class DriverOnly(ArithEnv):
    name = "driver-only"
"""


def test_env_workers_that_cannot_import_the_users_env_fail_the_start_in_one_line(tmp_path, monkeypatch):
    """The user's env module is importable on the driver only (loaded from a folder the
    actors do not search): the env workers' constructors raise ``ModuleNotFoundError``, which
    Ray never retries, so the rollout task fails at its start with that error in one line
    and stops the workers, instead of running on with every rollout an ``infra_error``."""
    (tmp_path / "driver_only_env.py").write_text(DRIVER_ONLY_ENV)
    spec = importlib.util.spec_from_file_location("driver_only_env", tmp_path / "driver_only_env.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "driver_only_env", module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(registry.REGISTRY, "driver-only", module.DriverOnly)
    killed = []
    kill = ray.kill
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: (killed.append(actor), kill(actor, **kw)))
    config = RunConfig(
        run_id="driver-only-env",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        cluster="ray",
        engine={"replicas": 1},
        orchestrator={"mix": {"driver-only": 1.0}, "concurrency": 2},
        service={"max_new_tokens": 4},
        stop={"max_rollouts": 2},
    )
    publish_policy(WeightStore(RunStore(config.storage, config.run_id)), *build_tiny_model(TINY), step=0)

    with pytest.raises(ActorStartError) as raised:
        # a run that starts regardless ends at this deadline, its rollouts lost
        run_rollouts(config, deadline=time.time() + 120)

    assert str(raised.value) == (
        "env actor 'env-worker-0' could not start: ModuleNotFoundError: No module named 'driver_only_env'"
    )
    assert len(killed) == 1


async def answered_once_restarted(method, timeout_s: float = 60.0):
    """What the actor ``method`` belongs to returns, once it answers: a call that reaches it
    while it restarts fails with ``ActorUnavailableError``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await method.remote()
        except ray.exceptions.ActorUnavailableError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


def test_a_killed_env_worker_loses_its_envs_as_host_failures_and_serves_again(monkeypatch):
    """The actor dies (OOM-killed, say) while one env awaits a step and another sits
    between steps: both are lost, as ``EnvHostLost`` (an infra error, not the env's), and
    the pool's actor restarts, so later rollouts on it run (without the restart every
    rollout sent to it would fail for the rest of the run)."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))

    @registry.register
    class SlowSums(ArithEnv):
        name = "slow_sums"

        async def step(self, action):
            if action == "wait":
                await asyncio.sleep(60)
            return await super().step(action)

    task = registry.task_set("slow_sums", "train", seed=0, n=1)[0]
    (action,) = registry.demonstrate(task)

    async def body():
        pool = RayEnvPool({"slow_sums": registry.make_config("slow_sums")}, num_workers=1)
        try:
            (actor,) = pool.actors
            before = await actor.pid.remote()
            waiting, idle = pool.make_env(task), pool.make_env(task)
            await waiting.reset(task)
            await idle.reset(task)
            step = asyncio.ensure_future(waiting.step("wait"))
            await asyncio.sleep(0.5)
            ray.kill(actor, no_restart=False)
            with pytest.raises(EnvHostLost, match="environment worker lost"):
                await step
            after = await answered_once_restarted(actor.pid)
            with pytest.raises(EnvHostLost, match="restarted since it opened"):
                await idle.step(action)
            await idle.close()
            fresh = pool.make_env(task)
            await fresh.reset(task)
            return (await fresh.step(action)).reward, before, after
        finally:
            pool.close()

    reward, before, after = asyncio.run(body())
    assert reward == 1.0 and after != before


def test_run_rollouts_on_ray_writes_shards(run, tmp_path):
    storage, _, weights = run
    config = RunConfig(
        run_id="ray-rollouts",
        storage=StorageConfig(root=str(tmp_path)),
        cluster="ray",
        engine={"replicas": 2},
        orchestrator={"mix": {"arith": 0.5, "guess": 0.5}, "concurrency": 4},
        service={"max_new_tokens": 6},
        stop={"max_rollouts": 6},
    )
    store = RunStore(config.storage, config.run_id)
    publish_policy(WeightStore(store), *build_tiny_model(TINY), step=0, tag="base")

    result = run_rollouts(config, deadline=float("inf"))

    assert result["orchestrator"]["finished"] == 6
    assert result["decode_tokens"] > 0
    reader = ShardReader(store)
    shards, _ = reader.poll()
    rows = [row for shard in shards for row in reader.read(shard).to_pylist()]
    assert len(rows) == 6
    assert {row["task"] for row in rows} == {"arith", "guess"}
    assert {row["engine"] for row in rows} <= {"ray-torch-0", "ray-torch-1"}
    assert all(row["status"] in ("ok", "truncated") for row in rows)
    assert all(v == 0 for row in rows for v, m in zip(row["versions"], row["action_mask"], strict=True) if m)


@pytest.mark.slow
def test_pipeline_flow_runs_its_tasks_on_ray(tmp_path, prefect_api):
    """The three long-running tasks run as Ray tasks and return their counters, and what the
    project's modules log in them reaches the flow run's logs, as it does from the flow's own
    process (a saved process offset past the shards log: the processor warns and starts over).

    How many rollouts fit before the deadline depends on how fast Ray starts its workers,
    so only what holds for any count is asserted (rollouts themselves are checked above)."""
    from flows.pipeline import pipeline
    from tests.flows.conftest import tiny_config
    from tests.flows.prefect_api import run_logs

    config = tiny_config(
        tmp_path / "runs",
        "ray-pipeline",
        cluster="ray",
        warm_start={"enabled": False},
        eval={"tasks_per_env": 2},
        # from the rollout worker's start: what is asserted holds for any number of rollouts and steps
        stop={"max_seconds": 5},
    )
    ProcessOffsetBoard(RunStore(config.storage, config.run_id)).publish(ProcessOffset(offset=999, time=0.0))
    state = pipeline(config, return_state=True)
    result = state.result()

    assert state.is_completed()
    warned = [
        message
        for name, level, message in run_logs(state.state_details.flow_run_id)
        if name == "rl.process_loop" and level == logging.WARNING
    ]
    assert len(warned) == 1 and warned[0].startswith("the saved process offset 999 is past the shards log")
    assert result["processed"].get("trajectories_in", 0) == result["rollouts"]["written"]
    assert result["trained"]["stop_reason"] == "max_seconds"
    store = RunStore(config.storage, config.run_id)
    engines = {
        row["engine"]
        for shard in ShardReader(store).poll()[0]
        for row in ShardReader(store).read(shard).to_pylist()
    }
    assert engines <= {"ray-torch-0"}


def test_closing_the_pool_closes_every_env_and_stops_its_workers_when_one_fails(monkeypatch, tmp_path):
    """One env's close raises (its sandbox would not die): the envs after it on the worker
    are closed all the same, and the pool's actors are stopped, not left holding their CPUs
    (and the rollout task that closes the pool does not fail for it)."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    closed = tmp_path / "closed"
    closed.mkdir()

    @registry.register
    class StuckClose(ArithEnv):
        name = "stuck_close"
        marks = str(closed)
        fails = ""

        async def close(self) -> None:
            if self.task.id == self.fails:
                raise RuntimeError("the sandbox would not die")
            open(os.path.join(self.marks, self.task.id), "w").close()

    tasks = registry.task_set("stuck_close", "train", seed=0, n=3)
    StuckClose.fails = tasks[0].id

    async def body():
        pool = RayEnvPool({"stuck_close": registry.make_config("stuck_close")}, num_workers=1)
        actors = list(pool.actors)
        for task in tasks:
            await pool.make_env(task).reset(task)
        pool.close()
        return actors

    actors = asyncio.run(body())
    assert sorted(os.listdir(closed)) == sorted(t.id for t in tasks[1:])
    # ray.kill is asynchronous: a call sent just after it may still be answered
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(actors[0].pid.remote(), timeout=60)
            time.sleep(0.1)


def test_closing_a_ray_engine_whose_actor_never_started_returns_and_stops_it(monkeypatch):
    """The actor asks for a GPU no node has, so it never starts: close gives up on its last
    counters after ``CLOSE_TIMEOUT_S`` and stops the actor, instead of holding the worker's
    close (and the rollout task) for ever."""
    monkeypatch.setattr(ray_engine, "CLOSE_TIMEOUT_S", 0.5)

    async def body():
        remote = RayEngine(TorchEngineConfig(), "/unused", name="pending", actor_options={"num_gpus": 1})
        await asyncio.wait_for(remote.close(), 30)
        return remote

    remote = asyncio.run(body())
    assert remote.stats() == EngineStats()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(remote.actor.pid.remote(), timeout=60)


def test_ray_engines_no_node_can_place_fail_the_start_with_what_they_ask_for(run, monkeypatch):
    """Engines on CUDA ask for a GPU each, which no node of this cluster has: Ray keeps such
    actors pending for ever (an autoscaler may yet add a node), so building them fails once
    ``load_timeout_s`` has passed, naming the request, and stops the actors, instead of the
    worker starting on replicas that never answer."""
    _, store, weights = run
    killed = []
    kill = ray.kill
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: (killed.append(actor), kill(actor, **kw)))
    config = EngineConfig(replicas=2, torch={"device": "cuda"}, load_timeout_s=1)

    with pytest.raises(EngineError, match=r"did not start within 1 s.*'num_gpus': 1"):
        build_engines(config, weights.load(0), 0, cluster="ray", store=store)
    assert len(killed) == 2


def test_calls_on_an_engine_actor_lost_with_any_ray_error_fail_as_engine_errors():
    """Calls on an actor that is gone fail with Ray errors beside ``RayActorError``: one the
    memory monitor killed with ``OutOfMemoryError``, one held to a node that no longer exists
    (here one that never did) with ``ActorUnschedulableError``. Each is an ``EngineError``,
    which the router fails over and the rollout service counts as an infra error, not as the
    environment's own; the probe says down and ``stats()`` gives empty counters, instead of
    the raw Ray error failing the worker's status."""
    gone = NodeAffinitySchedulingStrategy("ab" * 28, soft=False)

    async def body():
        remote = RayEngine(
            TorchEngineConfig(),
            "/unused",
            name="gone",
            actor_options={"num_cpus": 1, "scheduling_strategy": gone},
        )
        try:
            with pytest.raises(EngineError, match=r"^engine actor 'gone' lost: ActorUnschedulableError: "):
                await remote.generate("s", PROMPTS[0], PARAMS)
            return await remote.health(), remote.stats()
        finally:
            await remote.close()

    assert asyncio.run(body()) == (False, EngineStats())


def counted(engine: RayEngine, calls: Counter) -> RayEngine:
    """``engine``, with each of its ``generate`` calls counted in ``calls[engine.name]``."""
    generate = engine.generate

    async def counting(*args):
        calls[engine.name] += 1
        return await generate(*args)

    engine.generate = counting
    return engine


def test_an_error_the_engine_raises_on_its_actor_is_itself_and_only_a_lost_actor_is_failed_over(run):
    """A request the engine refuses on its actor (a token id outside the vocabulary) comes
    back as that ``InvalidRequest``, not an ``EngineError``: the router neither probes nor
    retries it, and the replica stays in service. A call on an actor that is gone is an
    ``EngineError`` the router fails over: retried once, on the session's new replica."""
    _, _, weights = run
    gone = NodeAffinitySchedulingStrategy("ab" * 28, soft=False)

    async def body():
        calls: Counter = Counter()
        live = counted(RayEngine(TorchEngineConfig(), weights.load(0), name="live", version=0), calls)
        lost = counted(
            RayEngine(
                TorchEngineConfig(),
                "/unused",
                name="lost",
                actor_options={"num_cpus": 1, "scheduling_strategy": gone},
            ),
            calls,
        )
        try:
            refusing = Router([live])
            refusing.route("bad")  # pinned to live before lost joins
            refusing.add(lost)
            with pytest.raises(InvalidRequest, match=r"prompt_ids\[1\] = 1000000 is not a token id"):
                await refusing.generate("bad", [5, 1_000_000], PARAMS)
            refused = dict(calls), refusing.replicas, refusing.down
            calls.clear()
            failing = Router([lost])
            failing.route("moved")
            failing.add(live)
            generation = await failing.generate("moved", PROMPTS[0], PARAMS)
            return refused, (dict(calls), failing.replicas, failing.down), generation
        finally:
            await live.close()
            await lost.close()

    refused, failed_over, generation = asyncio.run(body())
    assert refused == ({"live": 1}, ["live", "lost"], [])
    assert failed_over == ({"lost": 1, "live": 1}, ["live"], ["lost"])
    assert len(generation.token_ids) > 0


def test_an_error_an_env_raises_on_its_worker_comes_back_as_itself_from_one_call(monkeypatch):
    """The env's own step raises on the actor: the driver gets that error as itself, not an
    ``EnvHostLost`` (the rollout service counts it as the env's error, not an infra one), from
    one call of the env's step, and the env is still open on the actor."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))

    @registry.register
    class PickySums(ArithEnv):
        name = "picky_sums"
        steps = 0

        async def step(self, action):
            self.steps += 1
            raise ValueError(f"no move {action!r}")

        async def evaluate(self):
            return float(self.steps)

    task = registry.task_set("picky_sums", "train", seed=0, n=1)[0]

    async def body():
        pool = RayEnvPool({"picky_sums": registry.make_config("picky_sums")}, num_workers=1)
        try:
            env = pool.make_env(task)
            await env.reset(task)
            with pytest.raises(Exception) as raised:
                await env.step("up")
            (actor,) = pool.actors
            return (
                type(raised.value),
                str(raised.value),
                await env.evaluate(),
                await actor.open_count.remote(),
            )
        finally:
            pool.close()

    assert asyncio.run(body()) == (ValueError, "no move 'up'", 1.0, 1)


def test_env_workers_ray_cannot_place_fail_the_start_in_one_line_and_are_stopped(monkeypatch):
    """Actors Ray will never place or prepare (held to a node that is gone, here one that never
    was: ``ActorUnschedulableError``; a runtime env that fails to set up) answer the start's
    probe with an error that is no ``RayActorError``: the start fails in one line naming the
    actor and stops every actor, instead of that raw error leaving them all running."""
    killed = []
    kill = ray.kill
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: (killed.append(actor), kill(actor, **kw)))
    gone = NodeAffinitySchedulingStrategy("ab" * 28, soft=False)
    pool = RayEnvPool(
        {"arith": registry.make_config("arith")},
        num_workers=2,
        actor_options={"num_cpus": 1, "scheduling_strategy": gone},
    )

    with pytest.raises(ActorStartError) as raised:
        pool.wait_started(60)

    message = str(raised.value)
    # the start fails on the first answer that says so, whichever actor's it is
    expected = r"env actor 'env-worker-[01]' could not start: ActorUnschedulableError: "
    assert re.match(expected, message), message
    assert "\n" not in message
    assert len(killed) == 2


async def restarted_pid(engine: RayEngine, before: int) -> int | None:
    """The process id of ``engine``'s actor once Ray restarted it (None: not within 60 s)."""
    for _ in range(600):
        try:
            pid = await engine.pid()
            if pid != before:
                return pid
        except EngineError:  # dead, or not restarted yet
            pass
        await asyncio.sleep(0.1)
    return None


async def killed_and_restarted(engine: RayEngine, before: int):
    """Kill ``engine``'s actor (pid ``before``) for Ray to restart; then the new pid (None: not
    restarted), the first probe's answer, the version the engine then claims and a generation."""
    ray.kill(engine.actor, no_restart=False)
    after = await restarted_pid(engine, before)
    healthy = await engine.health()
    return after, healthy, engine.version, await engine.generate("s", PROMPTS[0], PARAMS)


def test_a_killed_engine_actor_restarts_and_serves_again(run):
    """The engine's actor dies (OOM-killed, its node lost): Ray restarts it, so the worker's
    health check finds the replica up again and puts it back, instead of the replica being
    lost for the rest of the run (every rollout an infra error once the last one goes). The
    restarted actor serves its start version, not the one loaded before: the engine's version
    says so once a probe answers, so the worker's health check loads its own onto it (the
    restart may fall between two probes, which then never see it down)."""
    _, _, weights = run

    async def body():
        remote = RayEngine(TorchEngineConfig(), weights.load(0), name="restarts", version=0)
        try:
            await remote.load_version(1, weights.load(1))
            return await killed_and_restarted(remote, await remote.pid())
        finally:
            await remote.close()

    after, healthy, version, generation = asyncio.run(body())
    assert after is not None, "the engine actor was not restarted"
    assert healthy
    assert generation.versions == [0] * len(generation.token_ids)
    assert version == 0, "the engine still claims the version its dead actor loaded"


def test_an_engine_actor_whose_start_version_was_pruned_restarts_on_the_latest(tmp_path):
    """Ray restarts an actor with its first arguments, so on the version its worker started
    on: by the time it dies, retention may have deleted that version (a worker that joined a
    run after its untagged version 1). The restarted actor serves the store's latest version
    and its engine says so, rather than its constructor failing, which Ray never retries:
    the replica would be lost for the rest of the run."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "pruned")
    weights = WeightStore(store)
    model, tokenizer = build_tiny_model(TINY)
    for step in range(3):
        publish_policy(weights, model, tokenizer, step=step, tag="base" if step == 0 else None)

    async def body():
        remote = RayEngine(TorchEngineConfig(), weights.load(1), name="pruned", version=1, store=store)
        try:
            before = await remote.pid()
            assert weights.retain(keep_last=1) == [1]
            weights.load(2)  # the worker follows LATEST: its fetch forgets its copy of version 1
            return await killed_and_restarted(remote, before)
        finally:
            await remote.close()

    after, healthy, version, generation = asyncio.run(body())
    assert after is not None, "the engine actor did not come back"
    assert healthy and version == 2
    assert generation.versions == [2] * len(generation.token_ids)


def test_an_engine_host_whose_start_version_was_pruned_starts_on_the_newest_that_verifies(tmp_path):
    """With LATEST's version corrupt, a restarted actor whose version was pruned loaded
    LATEST's (CorruptVersion): its constructor failed, which Ray never retries."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "pruned-corrupt")
    weights = WeightStore(store)
    model, tokenizer = build_tiny_model(TINY)
    for step in range(4):
        publish_policy(weights, model, tokenizer, step=step, tag="base" if step == 0 else None)
    assert weights.retain(keep_last=2) == [1]
    os.truncate(os.path.join(weights.version_path(3), "model.safetensors"), 10)
    host = EngineHost(TorchEngineConfig().model_dump(), "/nonexistent/v000001", "host", 1, store)
    try:
        assert host.engine.version == 2
    finally:
        asyncio.run(host.close())


def test_an_engine_host_fetching_version_after_version_holds_one_open_file_and_one_copy(tmp_path):
    """A host on a node without its worker's weight folders fetches each version it loads
    from the store. Each fetch went through a WeightStore of its own, whose lock on the copy
    (an open file) was never closed: a file descriptor more per version, until the actor ran
    out of them, and every copy held in use, so none was ever deleted. Closed, the host lets
    the last copy go too."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "fetching-host")
    weights = WeightStore(store)
    model, tokenizer = build_tiny_model(TINY)
    publish_policy(weights, model, tokenizer, step=0)

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    def cached() -> list[str]:
        return sorted(p.name for p in weights.cache_dir.rglob("v0*"))

    async def body():
        host = EngineHost(TorchEngineConfig().model_dump(), "/nonexistent/v000000", "host", 0, store)
        try:
            await host.load_version(0, "/nonexistent/v000000")
            before = open_files()
            for version in range(1, 6):
                publish_policy(weights, model, tokenizer, step=version)
                assert await host.load_version(version, f"/nonexistent/v{version:06d}") == (
                    version,
                    host.incarnation,
                )
            return before, open_files(), cached()
        finally:
            await host.close()

    before, after, held = asyncio.run(body())
    assert after == before
    assert held == ["v000005"]
    assert cached() == []


def test_an_engine_host_asked_for_two_versions_at_once_ends_on_the_newer_with_its_copy_kept(tmp_path):
    """A worker's new version can reach a host while the one before is still downloading.
    The older fetch finishing last marked its copy in use, which let go of (and deleted) the
    newer one, and the engine went back to the older version."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "two-loads-host")
    weights = WeightStore(store)
    model, tokenizer = build_tiny_model(TINY)
    for version in range(3):
        publish_policy(weights, model, tokenizer, step=version)

    async def body():
        host = EngineHost(TorchEngineConfig().model_dump(), "/nonexistent/v000000", "host", 0, store)
        load = host.weights.load

        def slow_download_of_version_1(version, part):
            if version == 1:
                time.sleep(1.0)
            return load(version, part)

        host.weights.load = slow_download_of_version_1
        try:
            older = asyncio.create_task(host.load_version(1, "/nonexistent/v000001"))
            await asyncio.sleep(0.2)
            newer = await host.load_version(2, "/nonexistent/v000002")
            await older
            return newer[0], host.engine.version, sorted(p.name for p in weights.cache_dir.rglob("v0*"))
        finally:
            await host.close()

    assert asyncio.run(body()) == (2, 2, ["v000002"])


def test_ray_engines_on_a_node_without_the_runs_local_folder_fail_the_start_in_one_line(
    tmp_path, monkeypatch
):
    """An engine actor on another machine sees neither the weight directory the driver names
    nor the run's local folder (a cluster whose nodes share no folder): its constructor
    raises, which Ray never retries, so building the engines fails with that error in one
    line and stops the actors, instead of the worker running on with replicas that are dead
    for good (every rollout an infra_error)."""
    killed = []
    kill = ray.kill
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: (killed.append(actor), kill(actor, **kw)))
    elsewhere = RunStore(StorageConfig(root=str(tmp_path / "on-the-driver")), "run")

    with pytest.raises(EngineError) as raised:
        build_engines(EngineConfig(replicas=2), "/nonexistent/v000000", 0, cluster="ray", store=elsewhere)

    message = str(raised.value)
    assert "could not start" in message and "nor is the run's folder" in message and "s3://" in message
    assert "\n" not in message, message
    assert len(killed) == 2


def recording_runner(record):
    """A stand-in for ``RayTaskRunner`` that submits nothing: ``record(task, parameters)``
    sees each submission, which returns the task's name."""

    class RecordingRunner:
        def __init__(self, address=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            pass

        def submit(self, task, parameters):
            record(task, parameters)
            return task.name

    return RecordingRunner


def slivers(what, requests, timeout_s, setting):
    """A placement group with a bundle per one of ``requests``, each a sliver of a CPU
    whatever it asks for: this cluster holds it. Placed before it is returned, as the group
    ``reserve_together`` returns: one removed while Ray was still placing it kept its
    bundles, and the next test found the cluster short of them."""
    group = placement_group([{"CPU": 0.01}] * len(requests))
    ray.get(group.ready())
    return group


@pytest.mark.parametrize(("device", "gpus", "seen"), [("cuda:1", 1, "cuda"), ("cpu", 0, "cpu")])
def test_the_pipeline_asks_ray_for_a_gpu_for_a_trainer_on_cuda(monkeypatch, device, gpus, seen):
    """The train task asks Ray for a GPU when the trainer runs on CUDA: without it Ray could
    place it on a node without one (the head, on the Prefect worker's machine) or beside engine
    actors on a GPU they hold. Ray shows the task its one GPU as cuda:0, so the trainer is
    given ``cuda`` whatever index was configured."""
    import prefect_ray.task_runners
    from prefect_ray.context import RemoteOptionsContext

    from flows import pipeline

    submitted = {}

    def record(task, parameters):
        options = dict(RemoteOptionsContext.get().current_remote_options)
        submitted[task.name] = (options, parameters["config"].trainer_device)

    monkeypatch.setattr(prefect_ray.task_runners, "RayTaskRunner", recording_runner(record))
    monkeypatch.setattr(pipeline, "_wind_down", lambda config, signals, *runs: runs)
    # this cluster has no GPU, on which the probes fail the run (see the tests below)
    monkeypatch.setattr(ray_actors, "wait_placeable", lambda *args: None)
    monkeypatch.setattr(ray_actors, "reserve_together", slivers)
    config = RunConfig(run_id="gpu-trainer", cluster="ray", trainer_device=device)

    assert pipeline._run_on_ray(config, signals="s") == ("rollouts", "process-shards", "train")

    options, trainer_device = submitted["train"]
    assert options.get("num_gpus", 0) == gpus and options["num_cpus"] == 1
    assert trainer_device == seen
    assert (
        submitted["rollouts"][0].get("num_gpus", 0) == 0 == submitted["process-shards"][0].get("num_gpus", 0)
    )


def test_the_pipeline_starts_a_local_ray_with_a_cpu_for_each_of_its_tasks_and_actors(monkeypatch):
    """Processing and training hold a CPU each for the whole run, waiting for rollouts: a local
    Ray of one CPU per core (2 here) kept the rollout worker's actors pending until the
    trainer's deadline. The instance the run starts counts one for each task and actor."""
    import prefect_ray.task_runners

    from flows import pipeline

    asked = []
    monkeypatch.setattr(ray_engine, "connect_ray", lambda address, node_ip, num_cpus: asked.append(num_cpus))
    # this cluster has 4 CPUs, which this run's tasks and actors do not fit in (see the test below)
    monkeypatch.setattr(ray_actors, "reserve_together", slivers)
    monkeypatch.setattr(prefect_ray.task_runners, "RayTaskRunner", recording_runner(lambda *args: None))
    monkeypatch.setattr(pipeline, "_wind_down", lambda config, signals, *runs: runs)
    config = RunConfig(run_id="sized", cluster="ray", engine={"replicas": 3})

    pipeline._run_on_ray(config, signals="s")

    # an engine actor and an env worker per replica, processing and training
    assert asked == [3 + 3 + 2]


def placeable_only_given_long_enough(monkeypatch, *kinds: str) -> None:
    """Give the probes of the pipeline's ``kinds`` tasks, which this cluster places, long enough
    to start on a loaded machine, whatever ``engine.load_timeout_s``: the test's own, short, is
    then waited out in full only by what the cluster cannot hold."""
    wait_placeable = ray_actors.wait_placeable

    def waited(kind, options, timeout_s, setting):
        wait_placeable(kind, options, 120 if kind in kinds else timeout_s, setting)

    monkeypatch.setattr(ray_actors, "wait_placeable", waited)


def test_a_pipeline_whose_trainer_no_node_can_place_fails_before_submitting_its_tasks(monkeypatch):
    """The trainer on CUDA asks Ray for a GPU, which no node of this cluster has: Ray would
    keep the train task pending for ever, and the flow waiting on it once the rollouts and
    processing ended. The run fails once ``engine.load_timeout_s`` has passed, naming the
    request, before any task is submitted."""
    import prefect_ray.task_runners

    from flows import pipeline

    submitted = []
    monkeypatch.setattr(
        prefect_ray.task_runners,
        "RayTaskRunner",
        recording_runner(lambda task, parameters: submitted.append(task.name)),
    )
    monkeypatch.setattr(pipeline, "_wind_down", lambda config, signals, *runs: runs)
    placeable_only_given_long_enough(monkeypatch, "process-shards")
    config = RunConfig(run_id="no-gpu", cluster="ray", trainer_device="cuda", engine={"load_timeout_s": 1})

    with pytest.raises(ActorStartError, match=r"^the train task did not start within 1 s .*'num_gpus': 1"):
        pipeline._run_on_ray(config, signals="s")
    assert submitted == []


def test_a_pipeline_whose_tasks_and_actors_the_cluster_cannot_hold_at_once_fails_before_submitting_them(
    monkeypatch,
):
    """This cluster has 4 CPUs, and the run asks for 6: processing and training (placed each
    alone) held theirs for the whole run, and the rollout worker's actors waited for a CPU
    until the trainer's deadline, the run writing no rollout. It fails once
    ``engine.load_timeout_s`` has passed, naming what they ask for, before any task is
    submitted; a run they fit in goes on to submit its tasks."""
    import prefect_ray.task_runners

    from flows import pipeline

    submitted = []
    monkeypatch.setattr(
        prefect_ray.task_runners,
        "RayTaskRunner",
        recording_runner(lambda task, parameters: submitted.append(task.name)),
    )
    monkeypatch.setattr(pipeline, "_wind_down", lambda config, signals, *runs: runs)
    placeable_only_given_long_enough(monkeypatch, "process-shards", "train")
    config = RunConfig(run_id="too-big", cluster="ray", engine={"replicas": 2, "load_timeout_s": 1})

    with pytest.raises(
        ActorStartError,
        match=r"^processing, training and the rollout worker's actors did not fit on the Ray cluster at once "
        r"within 1 s \(engine.load_timeout_s\), asking for \[\{'num_cpus': 1\}, \{'num_cpus': 1, 'num_gpus': 0\}, "
        r"(\{'num_cpus': 1\}, ){3}\{'num_cpus': 1\}\]: .*'CPU': 4\.0",
    ):
        pipeline._run_on_ray(config, signals="s")
    assert submitted == []

    # long enough for the group this cluster holds to be placed on a loaded machine
    fits = config.engine.model_copy(update={"replicas": 1, "load_timeout_s": 120})
    pipeline._run_on_ray(config.model_copy(update={"engine": fits}), "s")
    assert sorted(submitted) == ["process-shards", "rollouts", "train"]


def test_an_actor_whose_constructor_raised_fails_the_start_without_waiting_for_one_still_pending(tmp_path):
    """One engine actor's constructor raised (its node lacks the run's folder) while another
    is still pending (no node has its GPU free yet): the start fails at once with the error,
    instead of holding it for ``load_timeout_s`` (600 s by default) for the pending one, and
    stops the pending one too."""
    elsewhere = RunStore(StorageConfig(root=str(tmp_path / "on-the-driver")), "run")
    failing = RayEngine(TorchEngineConfig(), "/nonexistent/v000000", name="no-folder", store=elsewhere)
    pending = RayEngine(TorchEngineConfig(), "/unused", name="no-gpu", actor_options={"num_gpus": 1})
    actors = {engine.name: engine.actor for engine in (failing, pending)}

    started = time.monotonic()
    with pytest.raises(
        ActorStartError, match=r"^engine actor 'no-folder' could not start: .*nor is the run's"
    ):
        ray_actors.wait_actors_started("engine", actors, {"num_cpus": 1}, 120, "engine.load_timeout_s")
    assert time.monotonic() - started < 60
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pending.actor.pid.remote(), timeout=60)
