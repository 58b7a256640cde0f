"""Engine replicas as Ray actors, with an ``Engine``-protocol client for the driver.

``EngineActor`` hosts one :class:`TorchEngine` on a Ray node; :class:`RayEngine` speaks the
``Engine`` protocol and forwards every call to its actor, so the router, gateway and rollout
service on the driver use remote replicas unchanged. Only paths, token ids and small
records cross the wire: the actor builds its model from a weight-version directory, and
when that directory is not on the actor's node (another machine, object storage) it loads
the version from the run's store itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import ray
from ray._private import ray_constants
from ray._private import utils as ray_utils
from ray.exceptions import RayError, RayTaskError

from envs.threads import to_thread_to_the_end
from rollout.config import TorchEngineConfig
from rollout.engines.base import EngineError, EngineStats, Generation, SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.ray_actors import ActorStartError, wait_actors_started
from storage.config import RunStore
from storage.weights import WeightStore

CLOSE_TIMEOUT_S = 10.0
"""How long :meth:`RayEngine.close` waits for each of the actor's last answers (its counters,
its engine closed) before it stops the actor regardless: one that never started (no node has
its resources free) or hangs would hold the close, and the rollout task, for ever."""


LOOPBACK = "127.0.0.1"


def connect_ray(
    address: str | None = None, node_ip: str | None = LOOPBACK, num_cpus: int | None = None
) -> None:
    """Connect this process to the Ray cluster at ``address`` ('auto', ``ray://host:10001``),
    or start a local Ray instance on ``node_ip`` when ``address`` is None or 'local'; nothing
    when already connected. On 127.0.0.1 every process of the instance listens on loopback
    only, on another address on every interface. With ``node_ip`` None, or ``RAY_ADDRESS`` set
    (to other than 'local') and ``address`` None, ``ray.init()`` decides as it does alone: it joins the cluster that
    ``RAY_ADDRESS`` or a ``ray start`` on this machine names, else starts one on the machine's
    address. A SIGTERM handler the process installed is kept: ``ray.init`` makes SIGTERM
    ``sys.exit``, which took the place of a Prefect flow run's handler (by which a deployment
    run is cancelled; without it the run crashed). Ctrl-C, SIGTERM or SIGHUP while it starts a
    local instance waits for the start to end, then shuts Ray down and stops the run as it
    would at any other time (:func:`_signals_held`); while it joins a cluster, it stops the
    connection at once (a cluster that does not answer would hold it for Ray's time-outs).

    A local instance started on ``node_ip`` has ``num_cpus`` logical CPUs when given (Ray's
    default: one per core): a run's own instance holds only the run's tasks and actors, and
    they wait on each other (a trainer holds its CPU waiting for rollouts whose actors wait for
    a free CPU), so each needs one of its own, whatever the machine's cores."""
    if ray.is_initialized():
        return
    # RAY_ADDRESS=local asks Ray for a new local instance, as no address does
    local = address == "local" or (address is None and os.environ.get("RAY_ADDRESS", "") in ("", "local"))
    with _signals_held(hold=local):
        if not local or node_ip is None:
            ray.init(address=address, include_dashboard=False)
        elif node_ip == LOOPBACK:
            _start_on_loopback(num_cpus)
        else:
            ray.init(address="local", include_dashboard=False, _node_ip_address=node_ip, num_cpus=num_cpus)


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that stop a run (Ctrl-C, ``docker stop``, a closed terminal), held while
``ray.init`` runs."""


@contextlib.contextmanager
def _signals_held(hold: bool = True) -> Iterator[None]:
    """Run the body, a ``ray.init``, with each of :data:`HELD_SIGNALS` that arrives recorded
    rather than acted on (unless not ``hold``); then, when one came, shut Ray down and deliver
    it again, to the handlers the process has after the start (its own, else Ray's for
    SIGTERM), which stop the run as at any other time. Off the main thread, where no handler
    runs, it only runs the body.

    A signal acted on inside ``ray.init`` stopped the start wherever it was: Ray's SIGTERM
    handler (``sys.exit``, installed as the start begins) ended a flow command with status
    15 and without its "stopped by" line, and Ctrl-C or SIGTERM left the raylet's agents
    (``DashboardAgent``, ``RuntimeEnvAgent``) running, orphaned. ``ray.init``'s own
    time-outs bound how long a signal waits. Ray's SIGTERM handler is not installed during the
    start, and afterwards only where the process had none of its own (as before: a Prefect
    flow run's handler, by which a deployment run is cancelled, is kept)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before = {signum: signal.getsignal(signum) for signum in HELD_SIGNALS}
    after = dict(before)

    def keep(signum, frame) -> None:
        held.append(signum)

    def keep_for_after(handler) -> None:  # in place of Ray's install of its SIGTERM handler
        if not callable(before[signal.SIGTERM]):
            after[signal.SIGTERM] = handler

    # an ignored signal stays so (``nohup``), and one whose handler is not Python's cannot be restored
    for signum, handler in before.items():
        if hold and handler not in (signal.SIG_IGN, None):
            signal.signal(signum, keep)
    install_sigterm = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = keep_for_after
    alarm_before = any(signal.getitimer(signal.ITIMER_REAL))
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = install_sigterm
        # an alarm armed during the start is the core worker's abort on a SIGTERM, held or (joining
        # a cluster) acted on: the process stops as at any other time, not by SIGABRT 3 s later
        if not alarm_before and any(signal.getitimer(signal.ITIMER_REAL)):
            _cancel_abort_alarm()
        try:
            if held:
                ray.shutdown(wait_for_processes=True)
        finally:
            for signum, handler in after.items():
                if handler is not None:
                    signal.signal(signum, handler)
            for signum in held:
                signal.raise_signal(signum)


def _cancel_abort_alarm() -> None:
    """Cancel the alarm by which the failure signal handler of Ray's core worker aborts the
    process: a SIGTERM once the core worker has started, at the end of ``ray.init``, goes to that
    handler first, which writes a stack trace, passes the signal on, and arms an alarm that
    aborts the process 3 s later (an exit by SIGABRT, during Ray's shutdown or the command's own exit)."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    alarm = signal.getsignal(signal.SIGALRM)
    if alarm is not None:
        signal.signal(signal.SIGALRM, alarm)  # the handler the process had, in place of Ray's abort


def _start_on_loopback(num_cpus: int | None) -> None:
    """Start a local Ray instance whose processes all listen on 127.0.0.1."""
    # Ray takes a node address of 127.0.0.1 for the machine's own (and its servers then
    # listen on every interface) unless it runs with clusters off, as on macOS and Windows
    enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", include_dashboard=False, _node_ip_address=LOOPBACK, num_cpus=num_cpus)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


def actor_device(device: str) -> str:
    """The device an engine actor uses for the configured ``device``: Ray shows an actor only
    the GPU it was given, as ``cuda`` (``cuda:0``), so a configured index is not the actor's."""
    return "cuda" if device.startswith("cuda") else device


def _local_dir(path: str, version: int, weights: WeightStore | None) -> str:
    """``path`` when this node has it, else version ``version`` fetched from ``weights``.

    One ``WeightStore`` for all of an actor's fetches: a store holds the copy its load returned
    in use until its next load (see ``WeightStore.load``); one made per fetch would let it go
    once collected, before the engine read it, and could not delete the copy before it."""
    if os.path.isdir(path):
        return path
    if weights is None:
        raise EngineError(f"weight directory {path} is not on this node and no run store was given")
    store = weights.store
    if not store.config.is_s3 and not os.path.isdir(store.uri):
        raise EngineError(
            f"weight directory {path} is not on this node, nor is the run's folder {store.uri}: "
            "engines on other machines need the run on s3:// storage (or a folder every node mounts)"
        )
    return weights.load(version, "serving")


def _start_dir(path: str, version: int, weights: WeightStore | None) -> tuple[str, int]:
    """The directory and version an actor starts on: ``_local_dir`` of ``version``, or the
    store's newest version that verifies (``WeightStore.load_newest``, as a worker's engines
    start on) once retention deleted ``version``. Ray restarts an actor with its first
    arguments, so on the version its worker started on, which is pruned when the worker
    started on an untagged one; a constructor that raises is not restarted again."""
    try:
        return _local_dir(path, version, weights), version
    except KeyError:  # the store no longer has it
        newest, path = weights.load_newest("serving")
        return path, newest


class EngineHost:
    """One TorchEngine replica as its :data:`EngineActor` runs it (an async actor: requests
    batch)."""

    def __init__(
        self,
        config: dict[str, Any],
        model_dir: str,
        name: str,
        version: int,
        store: RunStore | None = None,
    ):
        self.weights = None if store is None else WeightStore(store, one_copy=True)
        # one load at a time: a load lets go of the copy before it (one_copy deletes it), so an
        # older fetch finishing last would delete the newer copy and serve the older version
        self._loading = asyncio.Lock()
        # a restarted actor's process may have the pid the dead one had (on another node, in a
        # container started alike): this id is the one process's, never another's
        self.incarnation = uuid.uuid4().hex
        path, version = _start_dir(model_dir, version, self.weights)
        self.engine = TorchEngine.from_config(
            TorchEngineConfig.model_validate(config | {"device": actor_device(config["device"])}),
            path,
            name=name,
            version=version,
        )

    async def generate(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return await self.engine.generate(session_id, prompt_ids, params)

    async def load_version(self, version: int, path: str) -> tuple[int, str]:
        """Load ``version`` from ``path``; returns the version served and :attr:`incarnation`."""
        # a version fetched from the store takes seconds to minutes: in a thread, so the
        # actor goes on answering generations and health probes meanwhile
        async with self._loading:
            # a cancelled load (timed out) holds the lock until its fetch's thread is done
            local = await to_thread_to_the_end(_local_dir, path, version, self.weights)
            await self.engine.load_version(version, local)
        return self.engine.version, self.incarnation

    def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def health(self) -> tuple[bool, str, int]:
        """Whether the engine is up, :attr:`incarnation` (another one: Ray restarted the actor)
        and the version it serves."""
        return await self.engine.health(), self.incarnation, self.engine.version

    async def close(self) -> None:
        await self.engine.close()
        if self.weights is not None:
            self.weights.release()

    def pid(self) -> int:
        return os.getpid()


def engine_actor_resources(config: TorchEngineConfig) -> dict[str, int]:
    """What an engine actor asks Ray for by default: one CPU, and one GPU when the engine runs
    on CUDA."""
    return {"num_gpus": 1, "num_cpus": 1} if config.device.startswith("cuda") else {"num_cpus": 1}


EngineActor = ray.remote(EngineHost)
"""The Ray actor class hosting one :class:`EngineHost` per replica."""


class RayEngine:
    """An ``Engine`` whose model runs in an :class:`EngineActor` on the Ray cluster.

    Args:
        config: settings of the remote TorchEngine.
        model_dir: weight-version directory to start from (on the actor's node, or fetched
            from ``store`` when it is not there).
        name: replica name reported in every ``Generation``.
        version: weight version of ``model_dir``.
        store: the run's store, for actors on nodes that do not see ``model_dir``.
        actor_options: Ray resource options of the actor (``num_cpus``, ``num_gpus`` …);
            by default one GPU when the engine runs on CUDA, else one CPU. An actor that dies
            is restarted on ``model_dir`` (``max_restarts=-1`` unless set here), or on the
            store's latest version once retention deleted ``version``: the worker's health
            check takes the replica out meanwhile, and loads its current version onto it before
            putting it back. A restart between two probes is seen by the next one, which sets
            ``version`` to the one the new actor serves: the health check then loads its own.

    ``stats()`` is synchronous in the protocol, so it waits (at most 10 s) for the actor's
    counters; an actor that does not answer reports empty counters, a closed engine the
    counters it had when it closed.
    """

    def __init__(
        self,
        config: TorchEngineConfig,
        model_dir: str,
        *,
        name: str = "ray-torch",
        version: int = 0,
        store: RunStore | None = None,
        actor_options: dict[str, Any] | None = None,
    ):
        if not ray.is_initialized():
            raise EngineError("RayEngine needs a connected Ray cluster: call ray.init() first")
        options = {"max_restarts": -1, **(actor_options or engine_actor_resources(config))}
        self.name = name
        self.version = version
        self._loaded_in: str | None = None
        """Incarnation of the actor that loaded ``version``; None while the actor serves what it
        started on, which every probe reports (a restarted actor's may differ from the first's)."""
        self.actor_options = options
        self.actor = EngineActor.options(**options).remote(
            config.model_dump(), str(model_dir), name, version, store
        )
        self.tokenizer = None
        self._closed = False
        self._final_stats = EngineStats()

    async def _call(self, method: str, *args, cancel_remote: bool = False):
        """The actor's ``method(*args)``; with ``cancel_remote`` a cancelled caller cancels the
        actor's task too (awaiting a Ray object ref alone does not)."""
        if self._closed:
            raise EngineError(f"engine {self.name!r} is closed")
        call = getattr(self.actor, method).remote(*args)
        try:
            return await call
        except asyncio.CancelledError:
            if cancel_remote:
                ray.cancel(call)
            raise
        except RayTaskError as exc:
            raise exc.cause from None
        except RayError as exc:  # not only RayActorError: one the memory monitor killed is OutOfMemoryError
            raise EngineError(f"engine actor {self.name!r} lost: {type(exc).__name__}: {exc}") from None

    async def generate(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        # a cancelled caller (its rollout is gone) stops the actor decoding tokens nobody reads
        return await self._call("generate", session_id, prompt_ids, params, cancel_remote=True)

    async def load_version(self, version: int, path: str) -> None:
        # a caller that gives up (the worker's load_timeout_s) stops the actor's load too,
        # instead of leaving it to run on with nothing awaiting it
        self.version, self._loaded_in = await self._call("load_version", version, path, cancel_remote=True)

    def end_session(self, session_id: str) -> None:
        if not self._closed:
            self.actor.end_session.remote(session_id)

    def stats(self) -> EngineStats:
        if self._closed:
            return self._final_stats
        try:
            return ray.get(self.actor.stats.remote(), timeout=10)
        except RayError:  # dead, killed (OutOfMemoryError), restarting or slow (GetTimeoutError)
            return EngineStats()

    async def health(self) -> bool:
        try:
            healthy, incarnation, served = await self._call("health")
        except EngineError:
            return False
        if self._loaded_in is None or incarnation != self._loaded_in:
            # Ray restarted the actor on model_dir (or the latest version, see _start_dir): what
            # it loaded went with the old process
            self.version, self._loaded_in = served, None
        return bool(healthy)

    async def pid(self) -> int:
        """Process id of the actor (to check where the engine runs)."""
        return await self._call("pid")

    async def close(self) -> None:
        """Stop the remote engine and release its actor."""
        if self._closed:
            return
        try:
            self._final_stats = await asyncio.wait_for(self._call("stats"), CLOSE_TIMEOUT_S)
            await asyncio.wait_for(self._call("close"), CLOSE_TIMEOUT_S)
        except (EngineError, TimeoutError):
            pass
        finally:
            self._closed = True
            ray.kill(self.actor)


def wait_started(engines: list[RayEngine], timeout_s: float) -> list[RayEngine]:
    """``engines`` once every actor is placed on a node and has built its engine; else every
    actor stopped and an :class:`EngineError` with the constructor's error, or naming what
    the actors not started within ``timeout_s`` ask for (see :func:`wait_actors_started`)."""
    actors = {engine.name: engine.actor for engine in engines}
    try:
        wait_actors_started("engine", actors, engines[0].actor_options, timeout_s, "engine.load_timeout_s")
    except ActorStartError as exc:
        raise EngineError(str(exc)) from None
    return engines
