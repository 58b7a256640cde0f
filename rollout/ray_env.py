"""Environment workers as Ray actors, with an ``Env``-protocol proxy for the driver.

A :class:`EnvWorkerActor` hosts many environments (and their sandboxes) on a cluster node,
keyed by an id per rollout; :class:`RayEnv` is the driver-side stand-in the rollout service
drives exactly like a local env; :class:`RayEnvPool` owns a set of actors and hands out
proxies round-robin (``pool.make_env`` is a drop-in ``make_env`` of the rollout service).
Only tasks, actions and observations cross the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ray
from ray import cloudpickle
from ray.exceptions import RayError, RayTaskError, TaskCancelledError

from envs import registry
from envs.base import Env, EnvConfig, EnvHostLost, StepResult, Task
from rollout.ray_actors import wait_actors_started
from storage.redaction import redact

log = logging.getLogger(__name__)


ENV_WORKER_RESOURCES = {"num_cpus": 1}
"""What an environment-worker actor asks Ray for by default."""


class UnknownEnv(KeyError):
    """No environment of that id is open on the worker."""


def _rebuilt(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    """An exception of ``cls`` with ``args`` and attributes ``state``, made without its ``__init__``."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class _Carried(Exception):
    """Carries an env's exception that pickling cannot rebuild as it was (an ``__init__`` whose
    arguments are not its ``args``, as ``SandboxError``'s; an attribute pickling refuses, a lock
    or a client): unpickled, it is that exception again, less such attributes."""

    def __init__(self, exc: BaseException):
        super().__init__(str(exc))
        self.exc = exc

    def __reduce__(self):
        exc = self.exc
        args = exc.args if _pickles(exc.args) else (str(exc),)
        return _rebuilt, (
            type(exc),
            args,
            {key: value for key, value in vars(exc).items() if _pickles(value)},
        )


def _pickles(value: Any) -> bool:
    try:
        cloudpickle.dumps(value)
    except Exception:
        return False
    return True


def _survives_pickling(exc: Exception) -> bool:
    """Whether ``exc`` unpickles as itself: its type and message (one whose ``__init__`` makes
    its message from its argument unpickled with the message made twice)."""
    try:
        rebuilt = cloudpickle.loads(cloudpickle.dumps(exc))
        return type(rebuilt) is type(exc) and str(rebuilt) == str(exc)
    except Exception:
        return False


@contextlib.contextmanager
def _crossing_ray() -> Iterator[None]:
    """Run an env's code, its exceptions made to come back as themselves on the driver: one Ray
    could not rebuild there came back as an ``UnserializableException``, a lost worker's, and
    one it could not pickle as Ray's bare ``RayError`` quoting the actor's traceback."""
    try:
        yield
    except Exception as exc:
        if _survives_pickling(exc):
            raise
        raise _Carried(exc) from exc


@ray.remote
class EnvWorkerActor:
    """Hosts live environments by id; every method is async so envs interleave."""

    def __init__(self, envs: dict[str, tuple[type[Env], dict[str, Any]]]):
        # the classes come with their configs: an env the driver registered is not in the
        # registry of this process
        self.envs_known = envs
        self.envs: dict[str, Env] = {}
        self.calls: dict[str, set[asyncio.Future]] = {}  # each open env's calls in flight

    def open(self, env_id: str, name: str) -> None:
        if env_id in self.envs:
            raise ValueError(f"environment id {env_id!r} is already open on this worker")
        cls, config = self.envs_known[name]
        with _crossing_ray():
            self.envs[env_id] = cls(cls.config_cls.model_validate(config))

    def _env(self, env_id: str) -> Env:
        try:
            return self.envs[env_id]
        except KeyError:
            raise UnknownEnv(f"no open environment {env_id!r} on this worker") from None

    async def _call(self, env_id: str, method: str, *args: Any) -> Any:
        """``method`` of env ``env_id``, tracked until it returns so that closing the env stops it."""
        call = asyncio.ensure_future(getattr(self._env(env_id), method)(*args))
        calls = self.calls.setdefault(env_id, set())
        calls.add(call)
        try:
            with _crossing_ray():
                return await call
        finally:
            calls.discard(call)

    async def reset(self, env_id: str, task: Task) -> list[dict]:
        return await self._call(env_id, "reset", task)

    async def step(self, env_id: str, action: str) -> StepResult:
        return await self._call(env_id, "step", action)

    async def evaluate(self, env_id: str) -> float:
        return await self._call(env_id, "evaluate")

    async def close(self, env_id: str) -> None:
        """Stop the env's calls still running here, then close it.

        A driver that gives up on a call (its rollout cancelled or out of time) stops waiting,
        but the call runs on here: a reset went on to build its sandbox and start its shell
        after the env was closed, and nothing closed them for the rest of the worker's life.
        """
        env = self.envs.pop(env_id, None)
        calls = self.calls.pop(env_id, set())
        for call in calls:
            call.cancel()
        if calls:
            await asyncio.wait(calls)
        if env is not None:
            with _crossing_ray():
                await env.close()

    async def close_all(self) -> int:
        """Close every open env, each whatever the others' closes raise (logged here)."""
        env_ids = list(self.envs)
        for env_id in env_ids:
            try:
                await self.close(env_id)
            except Exception as exc:
                log.warning("could not close environment %s: %s", env_id, redact(repr(exc)))
        return len(env_ids)

    def open_count(self) -> int:
        return len(self.envs)

    def pid(self) -> int:
        return os.getpid()


class RayEnv:
    """An ``Env`` whose instance lives on an :class:`EnvWorkerActor`.

    Errors raised by the remote env come back as themselves (a ``SandboxError`` stays one,
    so the rollout service classifies it as usual). A worker that died, or was restarted
    since it opened this env (the env died with it), is an :class:`EnvHostLost`, and so is a
    call the env's close or the pool's stopped on the worker.
    """

    def __init__(self, actor, name: str, env_id: str | None = None):
        self.actor = actor
        self.name = name
        self.env_id = env_id or uuid.uuid4().hex
        self._opened = False
        self._closed = False

    async def _call(self, method: str, *args):
        try:
            return await getattr(self.actor, method).remote(self.env_id, *args)
        except RayTaskError as exc:
            if self._opened and isinstance(exc.cause, UnknownEnv):
                raise EnvHostLost(
                    f"environment worker restarted since it opened {self.env_id!r}: the env is gone"
                ) from None
            if isinstance(exc.cause, TaskCancelledError):  # not the env's error: its close's, or the pool's
                raise EnvHostLost(
                    f"environment {self.env_id!r} was closed on its worker while its {method} ran"
                ) from None
            raise exc.cause from None
        except RayError as exc:  # the actor died or is restarting, or its node is gone
            raise EnvHostLost(f"environment worker lost: {type(exc).__name__}: {exc}") from None

    async def reset(self, task: Task) -> list[dict]:
        if not self._opened:
            # marked before the open returns: a caller cancelled meanwhile stops waiting, not
            # the open, and its close must still reach the env the open makes on the worker
            self._opened = True
            await self._call("open", self.name)
        return await self._call("reset", task)

    async def step(self, action: str) -> StepResult:
        return await self._call("step", action)

    async def evaluate(self) -> float:
        return await self._call("evaluate")

    def resource_pid(self) -> None:
        """None: the env's processes run on its actor's node, out of reach of this worker's
        CPU manager (the actor's own cores bound them)."""
        return None

    async def close(self) -> None:
        """Close the remote env and its sandbox; safe to call twice."""
        if self._opened and not self._closed:
            self._closed = True
            await self._call("close")


class RayEnvPool:
    """A fixed set of environment-worker actors; :meth:`make_env` spreads rollouts over them.

    Args:
        env_configs: validated config per environment name: the environments it serves
            (their classes travel to the actors, user-registered ones included).
        num_workers: actors to start, named ``env-worker-0``, ``env-worker-1`` … in errors.
        actor_options: Ray options of each actor (default: one CPU). An actor that dies
            is restarted (``max_restarts=-1`` unless set here): the envs it held are lost,
            later rollouts on it run.
        placements: Ray options placing each actor, one per worker in order (its bundle of a
            placement group the caller holds: ``rollout.ray_actors.in_bundle``); a restarted
            actor comes back in its bundle. None: Ray places each freely.
    """

    def __init__(
        self,
        env_configs: Mapping[str, EnvConfig],
        num_workers: int = 1,
        actor_options: dict[str, Any] | None = None,
        placements: Sequence[dict[str, Any]] | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if placements is not None and len(placements) != num_workers:
            raise ValueError(f"placements must name one per worker ({num_workers}), got {len(placements)}")
        if not ray.is_initialized():
            raise RuntimeError("RayEnvPool needs a connected Ray cluster: call ray.init() first")
        envs = {name: (registry.env_class(name), config.model_dump()) for name, config in env_configs.items()}
        self.actor_options = {"max_restarts": -1, **(actor_options or ENV_WORKER_RESOURCES)}
        self.names = [f"env-worker-{i}" for i in range(num_workers)]
        self.placements = list(placements or [{}] * num_workers)
        self.actors = [
            EnvWorkerActor.options(**self.actor_options, **placement).remote(envs)
            for placement in self.placements
        ]
        self._next = itertools.cycle(self.actors)
        self.env_names = sorted(envs)

    def wait_started(self, timeout_s: float) -> None:
        """Return once every actor is placed on a node and constructed, within ``timeout_s``
        (the run's ``engine.load_timeout_s``); else stop them all and raise a
        :class:`rollout.ray_actors.ActorStartError`: an actor whose constructor raised (the
        user's env module importable on the driver only) is never restarted, and would lose
        every rollout sent to it (see :func:`wait_actors_started`)."""
        actors = dict(zip(self.names, self.actors, strict=True))
        options = self.actor_options | self.placements[0]
        wait_actors_started("env", actors, options, timeout_s, "engine.load_timeout_s")

    def make_env(self, task: Task) -> RayEnv:
        """A proxy for a new env of ``task.env`` on the next actor."""
        if not self.actors:
            raise RuntimeError("the environment pool is closed: its workers are stopped")
        if task.env not in self.env_names:
            raise KeyError(f"environment {task.env!r} is not one this pool was built for: {self.env_names}")
        return RayEnv(next(self._next), task.env)

    def close(self) -> None:
        """Close every env still open and stop the actors; nothing once closed."""
        if not self.actors:
            return
        closing = [actor.close_all.remote() for actor in self.actors]
        try:
            # every worker's answer, each on its own: a ray.get of them all raises at the first
            # that failed (a worker that died closing its envs), the others still closing theirs
            ray.wait(closing, num_returns=len(closing), timeout=60)
            for name, closed in zip(self.names, closing, strict=True):
                try:
                    ray.get(closed, timeout=0)
                except RayError as exc:  # dead, restarting or too slow: it is stopped all the same
                    log.warning("closing environment worker %s: %s", name, exc)
        finally:
            for actor in self.actors:
                ray.kill(actor)
            self.actors = []
