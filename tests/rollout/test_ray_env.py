"""Environment workers as Ray actors (a local Ray instance this module starts): what closing
an env or the pool does to calls still running on the actor, and errors that cross Ray."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import ray

from envs import registry
from envs.arith import ArithEnv
from envs.base import EnvHostLost
from envs.sandbox import SandboxError, bwrap_path
from envs.shell_env import ShellEnv
from rollout.ray_env import RayEnvPool
from tests.conftest import one_ray_at_a_time

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with one_ray_at_a_time():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="treadle-tests")
        yield
        ray.shutdown()


async def _give_up_on_reset(env, task, waiting: str) -> None:
    """Start ``env``'s reset and cancel it, as a driver that stops waiting does, once it has
    made the file ``waiting`` on the actor."""
    reset = asyncio.ensure_future(env.reset(task))
    while not os.path.exists(waiting):
        await asyncio.sleep(0.01)
    reset.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reset


def test_closing_an_env_stops_the_reset_its_driver_gave_up_on(tmp_path, monkeypatch):
    """A driver that stops waiting for a reset (its rollout cancelled or out of time) does not
    stop it on the actor, and the rollout's cleanup closes the env meanwhile: the reset went
    on to build its sandbox and start its shell after the close, and they were never closed
    (the folder, the uid and a live bash for the rest of the worker's life). Here the reset
    waits for a file before it builds anything."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    waiting, go, stopped = (str(tmp_path / name) for name in ("waiting", "go", "stopped"))

    @registry.register
    class HeldShell(ShellEnv):
        name = "held_shell"

        async def reset(self, task):
            open(waiting, "w").close()
            try:
                while not os.path.exists(go):
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                open(stopped, "w").close()
                raise
            return await super().reset(task)

    boxes = tmp_path / "boxes"
    boxes.mkdir()
    config = registry.make_config("held_shell", {"sandbox": {"root_dir": str(boxes)}})
    task = registry.task_set("shell", "train", seed=0, n=1)[0].model_copy(update={"env": "held_shell"})

    async def body():
        pool = RayEnvPool({"held_shell": config}, num_workers=1)
        try:
            env = pool.make_env(task)
            await _give_up_on_reset(env, task, waiting)
            await env.close()
            stopped_by_close = os.path.exists(stopped)
            open(go, "w").close()
            (actor,) = pool.actors
            return stopped_by_close, await actor.open_count.remote()
        finally:
            pool.close()

    stopped_by_close, still_open = asyncio.run(body())
    assert stopped_by_close
    assert still_open == 0
    assert os.listdir(boxes) == []


def test_closing_an_env_whose_driver_gave_up_on_its_open_closes_it(tmp_path, monkeypatch):
    """A driver cancelled while the open is in flight stops waiting, but the actor goes on to
    make the env; the proxy counted as opened only once the open returned, so its close sent
    nothing and the env stayed on the worker for the rest of its life. Here the env's
    constructor waits for a file."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    waiting, go = (str(tmp_path / name) for name in ("waiting", "go"))

    @registry.register
    class SlowToOpenShell(ShellEnv):
        name = "slow_to_open_shell"

        def __init__(self, config):
            open(waiting, "w").close()
            while not os.path.exists(go):
                time.sleep(0.01)
            super().__init__(config)

    config = registry.make_config("slow_to_open_shell", {"sandbox": {"root_dir": str(tmp_path)}})
    task = registry.task_set("shell", "train", seed=0, n=1)[0].model_copy(
        update={"env": "slow_to_open_shell"}
    )

    async def body():
        pool = RayEnvPool({"slow_to_open_shell": config}, num_workers=1)
        try:
            env = pool.make_env(task)
            await _give_up_on_reset(env, task, waiting)
            open(go, "w").close()
            await env.close()
            (actor,) = pool.actors
            return await actor.open_count.remote()
        finally:
            pool.close()

    assert asyncio.run(body()) == 0


def test_a_sandbox_error_an_env_raises_on_its_worker_comes_back_as_itself(monkeypatch):
    """``SandboxError`` does not survive pickling (its ``__init__`` takes ``kind`` and ``reason``,
    its ``args`` hold one string), so Ray failed to rebuild it on the driver and the proxy
    took the ``UnserializableException`` for a lost worker: an ``EnvHostLost``, counted as an
    infra error, where the local env gives the sandbox's own error with its kind. Raised by the
    env's constructor (the open), its step or its close."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))

    @registry.register
    class DyingSums(ArithEnv):
        name = "dying_sums"

        async def step(self, action):
            raise SandboxError("died", "the shell is not running", "partial output")

        async def close(self):
            raise SandboxError("died", "the sandbox is closed")

    @registry.register
    class UnopenableSums(ArithEnv):
        name = "unopenable_sums"

        def __init__(self, config):
            raise SandboxError("start_failed", "bwrap is missing")

    task = registry.task_set("dying_sums", "train", seed=0, n=1)[0]
    configs = {name: registry.make_config(name) for name in ("dying_sums", "unopenable_sums")}

    async def raised(call) -> tuple:
        with pytest.raises(SandboxError) as error:
            await call
        return str(error.value), error.value.kind, error.value.reason, error.value.output

    async def body():
        pool = RayEnvPool(configs, num_workers=1)
        try:
            env = pool.make_env(task)
            await env.reset(task)
            unopenable = task.model_copy(update={"env": "unopenable_sums"})
            return (
                await raised(env.step("ls")),
                await raised(env.close()),
                await raised(pool.make_env(unopenable).reset(unopenable)),
            )
        finally:
            pool.close()

    assert asyncio.run(body()) == (
        ("died: the shell is not running", "died", "the shell is not running", "partial output"),
        ("died: the sandbox is closed", "died", "the sandbox is closed", ""),
        ("start_failed: bwrap is missing", "start_failed", "bwrap is missing", ""),
    )


def test_a_call_its_env_is_closed_under_is_host_lost_and_a_closed_pool_makes_no_envs(tmp_path, monkeypatch):
    """Closing an env (as the pool's close does to every env still open) cancels its calls
    still running on the actor; the caller awaiting one got Ray's raw ``TaskCancelledError``,
    which the rollout service counted as the env's own error. And the closed pool went on
    handing out envs on its killed actors, each lost on its first call."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    waiting = str(tmp_path / "waiting")

    @registry.register
    class StuckSums(ArithEnv):
        name = "stuck_sums"

        async def step(self, action):
            open(waiting, "w").close()
            await asyncio.sleep(60)

    task = registry.task_set("stuck_sums", "train", seed=0, n=1)[0]

    async def body():
        pool = RayEnvPool({"stuck_sums": registry.make_config("stuck_sums")}, num_workers=1)
        try:
            env = pool.make_env(task)
            await env.reset(task)
            step = asyncio.ensure_future(env.step("1"))
            while not os.path.exists(waiting):
                await asyncio.sleep(0.01)
            await env.close()
            with pytest.raises(EnvHostLost, match="closed on its worker while its step ran"):
                await step
        finally:
            pool.close()
        with pytest.raises(RuntimeError, match="environment pool is closed"):
            pool.make_env(task)

    asyncio.run(body())


def test_an_env_error_pickling_mangles_or_cannot_carry_comes_back_as_itself(monkeypatch):
    """Ray sends an env's exception to the driver pickled. One whose ``__init__`` builds its
    message from its argument came back with the message built twice ('exit code exit code 3');
    one holding an attribute pickling refuses (a lock, a client) came back as Ray's bare
    ``RayError`` 'Exception ... isn't serializable' with the actor's traceback, its type and
    message lost, where the local env gives the env's own error."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))

    class ExitCode(Exception):
        def __init__(self, code: int):
            super().__init__(f"exit code {code}")
            self.code = code

    @registry.register
    class CodedSums(ArithEnv):
        name = "coded_sums"

        async def step(self, action):
            raise ExitCode(3)

    @registry.register
    class LockedSums(ArithEnv):
        name = "locked_sums"

        async def step(self, action):
            exc = RuntimeError("the judge refused: quota exceeded")
            exc.lock = threading.Lock()
            raise exc

    async def raised(name: str) -> BaseException:
        task = registry.task_set(name, "train", seed=0, n=1)[0]
        env = pool.make_env(task)
        await env.reset(task)
        try:
            await env.step("1")
        except Exception as exc:
            return exc
        finally:
            await env.close()
        raise AssertionError(f"{name}'s step raised nothing")

    pool = RayEnvPool({name: registry.make_config(name) for name in ("coded_sums", "locked_sums")})

    async def body():
        try:
            return await raised("coded_sums"), await raised("locked_sums")
        finally:
            pool.close()

    coded, locked = asyncio.run(body())
    assert (type(coded), str(coded), coded.code) == (ExitCode, "exit code 3", 3)
    assert (type(locked), str(locked)) == (RuntimeError, "the judge refused: quota exceeded")


def test_closing_the_pool_waits_for_every_workers_closes_when_one_worker_dies_in_its_own(
    tmp_path, monkeypatch
):
    """The pool's close waited for every worker's close of its envs with one ``ray.get``, which
    raises at the first worker that fails: one whose process died closing its envs (an env's
    close that crashed it, the OOM killer) had the others killed while they still closed
    theirs, whose sandboxes and outside resources were then never let go."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    closed = tmp_path / "closed"

    @registry.register
    class CrashingSums(ArithEnv):
        name = "crashing_sums"

        async def close(self):
            os._exit(1)

    @registry.register
    class SlowToCloseSums(ArithEnv):
        name = "slow_to_close_sums"

        async def close(self):
            await asyncio.sleep(2)
            closed.touch()

    configs = {name: registry.make_config(name) for name in ("crashing_sums", "slow_to_close_sums")}

    async def body():
        pool = RayEnvPool(configs, num_workers=2)
        try:
            for name in configs:  # one on each worker, in turn
                task = registry.task_set(name, "train", seed=0, n=1)[0]
                await pool.make_env(task).reset(task)
        finally:
            pool.close()

    asyncio.run(body())
    assert closed.exists(), "the env on the worker that did not die was not closed"
