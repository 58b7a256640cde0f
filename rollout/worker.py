"""A rollout worker: engines, gateway, service and orchestrator wired to a run's storage.

It serves the newest weight version, writes every finished rollout to raw shards, and
follows the trainer: a background loop polls ``weights/LATEST`` and loads each new
version into every engine between decode steps, so each token keeps the version that
really produced it. A replica that fails to load a version serves its old one while the
health check retries, until it falls more than the trainer's ``max_staleness`` behind the
newest: the trainer would drop its every token, so it leaves service until a load succeeds.
Given ``http`` (``GatewayHTTPConfig``) it also serves the gateway's HTTP API
(``rollout.gateway_http``) to harnesses outside the run while it runs, writing the records they
send into its raw shards, beside its own rollouts or, serving only, instead of them.

Backpressure: the backlog the orchestrator sees is the number of shards this worker
committed since its engines last picked up a new version. When the trainer lags, no new
version arrives, the backlog grows past ``max_backlog`` and rollouts pause, which bounds
how stale the data waiting for the trainer can become. A trainer that does publish but
trains slower than the engines roll out is caught by the second signal: a loop reads the
trainer's status (``status/train/trainer.json``) every ``trainer_poll_s`` and the
orchestrator pauses while the trainer holds more than ``max_trainer_batches`` steps' worth
of untrained data. While a fresh status says the trainer holds less than one batch and has
read this worker's newest shard, the backlog holds nothing back: that trainer cannot step,
so cannot publish, before more data comes. While a shard of this worker has not reached the
trainer (the processor lags) the backlog stays in charge, so rollouts do not run on unbounded
for a trainer that will soon have data. A missing, stale or unreadable trainer status leaves
the backlog alone in charge.

Elastic capacity: a second loop reads the trainer's elastic plan (``status/elastic/plan.json``,
``rollout.elastic_plan``) at most once a second and drains or undrains this worker's replicas
through its router; the worker's status reports each replica's pinned sessions, so the
trainer sees when a draining replica is empty and counts it as training. The trainer waits
for that status, so a draining replica that empties, or is empty under a newer plan, sets
``status_due`` (checked at every read of the plan) and ``tasks.rollout`` publishes a status at
once rather than at its next beat. A drained replica's sessions move to an accepting one at
their next turn; a generation in flight finishes where it started. On this CPU machine a
replica handed to training simply goes idle (its engine thread waits for requests that no
longer come), which frees its core for the trainer's threads; nothing here changes torch's
thread counts, which are process-wide.
A plan that does not parse is ignored with a warning (the replicas stay as they are until
the last plan applied goes stale); a stale one (the trainer died or hangs) puts every
replica back in rollout. A worker never drains its last accepting replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import pyarrow as pa

from envs import registry
from envs.base import Env, EnvConfig, Task
from rollout.config import EngineConfig, GatewayHTTPConfig, OrchestratorConfig, ServiceConfig
from rollout.engines.base import Engine, EngineError
from rollout.engines.factory import build_engines
from rollout.engines.vllm_engine import UNKNOWN_VERSION, VLLMEngine
from rollout.gateway import Gateway, GatewayConfig
from rollout.gateway_http import GatewayServer, RunSampling
from rollout.orchestrator import Orchestrator, OrchestratorStats, wait_through_cancels
from rollout.router import Router, RouterConfig, probe_health
from rollout.service import RolloutResult, RolloutService
from storage.config import RunStore
from storage.quota import RunQuota
from storage.shards import BackgroundShardWriter, ShardInfo
from storage.status import (
    DEFAULT_MAX_AGE_S,
    ElasticPlan,
    ElasticPlanBoard,
    InUse,
    TrainerStatus,
    TrainerStatusBoard,
    is_fresh,
)
from storage.weights import CorruptVersion, WeightStore, versions_ahead

log = logging.getLogger(__name__)

LOAD_RETRY_MAX_S = 60.0
"""Longest wait before a weight version whose load failed is tried again (the waits double from
``weight_poll_s``); a newer version is tried at the next poll."""


def task_streams(
    names: list[str], env_configs: Mapping[str, EnvConfig], seed: int, pool: int = 2048
) -> dict[str, Iterator[Task]]:
    """An endless stream of train tasks per environment: a pool of ``pool`` tasks (all of
    them, in an env whose train split holds fewer distinct ones), cycled."""
    return {
        name: itertools.cycle(registry.task_pool(name, "train", seed, pool, env_configs[name]))
        for name in names
    }


def worker_seed(seed: int, worker: str, resumed_at: int = 0) -> int:
    """``seed`` made worker ``worker``'s own (40 bits: a valid ``OrchestratorConfig.seed``),
    and its own again at each restart after it committed shards (``resumed_at``: its next
    shard number; 0 on a worker's first start).

    The workers of a run share its seeds; with them as they are, each would roll out the same
    tasks in the same order with the same sampling seeds: the same trajectories, at one
    weight version. So would a restarted worker, from the start of the stream it began with.
    """
    key = f"{seed}/{worker}" if resumed_at == 0 else f"{seed}/{worker}/{resumed_at}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:5], "big")


def _clock(epoch_s: float) -> str:
    """A plan's time (seconds since the epoch) as its writer's UTC clock read it."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch_s))


class RolloutWorker:
    """Runs rollouts for one run until stopped; see the module docstring.

    Args:
        store: the run's storage (weights are read, raw shards written).
        name: worker name, used for its shards (``shards/raw/<name>/``); with it and the
            number of its next shard, the worker makes the task seed ``seed`` and the
            orchestrator's sampling seed its own (:func:`worker_seed`).
        env_configs: validated config per environment in the mix.
        flush_records: records per raw shard; shards are written and committed off the event
            loop (``BackgroundShardWriter``), and ``on_shard`` is called with each once committed.
        cluster: ``"ray"`` runs the engines as Ray actors (``rollout.ray_engine``).
        engine_placements: on Ray, the options placing each engine actor, one per replica
            (its bundle of a placement group the caller holds: ``build_engines``); None: Ray
            places them freely.
        router: the sticky router's settings (whether a drained replica's sessions move at
            their next turn must agree with the trainer's ``elastic.migrate_at_turns``).
        make_env: builds each rollout's env (e.g. ``RayEnvPool.make_env``); default: in process.
        plan_poll_s: seconds between reads of the elastic plan.
        plan_max_age_s: a running trainer's plan or status older than this is ignored (with a warning
            for a plan).
        trainer_poll_s: seconds between reads of the trainer's status (backpressure).
        close_retry_s: waits between the attempts ``close`` makes to commit the last shard.
        before_commit: called before each raw shard is written; it raises
            :class:`~storage.status.InUse` once another worker took this one's name, and the
            shard is not committed (``close`` then sets the uncommitted records aside in the
            quarantine and raises it, without retrying).
        stop_launching: the orchestrator's outside stop, looked at before each launch
            (``Orchestrator``'s ``stop_launching``).
        http: the gateway's HTTP API for outside harnesses, served while :meth:`run` runs when its
            ``port`` is set (the bearer token read from its ``token_env`` here, so that a worker
            without one fails before its engines load); the records they ask it to write go into
            this worker's raw shards. With ``serve_only`` no rollout of ``orchestrator.mix`` runs.
            A harness's new rollout is refused (429) while this worker's own would wait for the
            trainer (:meth:`Orchestrator.backpressure <rollout.orchestrator.Orchestrator.backpressure>`).
        trained_reward: the reward a rollout is trained with, from its reward and progress
            (the run's ``rl.processor.combine_reward``), for group mode's filter
            (``Orchestrator``'s ``trained_reward``).
        max_staleness: the trainer's ``sao.max_staleness``: a replica whose weight version is
            more than this many versions behind the newest published one (counted on that
            one's chain of parents, as the trainer counts) leaves service, as the trainer would
            drop every token it generates; the health check brings it back once it has loaded
            the worker's version, while that is within the limit (with no health check,
            ``router.health_check_s`` null, it stays, warned of). None: a replica that failed
            to load new versions serves its old one for as long as they keep failing.
    """

    def __init__(
        self,
        store: RunStore,
        name: str,
        *,
        engine: EngineConfig,
        gateway: GatewayConfig,
        service: ServiceConfig,
        orchestrator: OrchestratorConfig,
        env_configs: Mapping[str, EnvConfig],
        seed: int = 0,
        flush_records: int = 64,
        flush_seconds: float = 10.0,
        weight_poll_s: float = 1.0,
        on_result: Callable[[RolloutResult], None] | None = None,
        on_shard: Callable[[ShardInfo], None] | None = None,
        router: RouterConfig | None = None,
        cluster: Literal["local", "ray"] = "local",
        engine_placements: Sequence[dict[str, Any]] | None = None,
        make_env: Callable[[Task], Env] | None = None,
        plan_poll_s: float = 1.0,
        plan_max_age_s: float = DEFAULT_MAX_AGE_S,
        trainer_poll_s: float = 0.25,
        close_retry_s: tuple[float, ...] = (1.0, 2.0, 4.0),
        before_commit: Callable[[], None] | None = None,
        stop_launching: Callable[[], bool] | None = None,
        http: GatewayHTTPConfig | None = None,
        trained_reward: Callable[[float | None, float | None], float] | None = None,
        max_staleness: int | None = None,
    ):
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} is negative: it counts versions (>= 0, or None)")
        self.max_staleness = max_staleness
        self.http = http if http is not None and http.port is not None else None
        self._http_token = self.http.token() if self.http is not None else None
        self.http_server: GatewayServer | None = None
        self.harness_records = 0
        """Records that harnesses had this worker write over HTTP (buffered: committed as its own)."""
        self._name_taken: InUse | None = None
        """Why a harness write was refused as the worker's name was taken: every later one is too."""
        self._told_unwritten: set[str] = set()
        """Trajectory ids of the harness write buffered, then answered as not written, as its
        flush found the worker's name taken: none is set aside (its harness sends it again)."""
        self._stopped = asyncio.Event()
        self.store = store
        self.name = name
        self.engine_config = engine
        self.gateway_config = gateway
        self.service_config = service
        self.writer = BackgroundShardWriter(
            store,
            name,
            flush_records=flush_records,
            flush_seconds=flush_seconds,
            on_commit=on_shard,
            before_commit=before_commit,
        )
        resumed_at = self.writer.next_seq
        self.orchestrator_config = orchestrator.model_copy(
            update={"seed": worker_seed(orchestrator.seed, name, resumed_at)}
        )
        self.env_configs = dict(env_configs)
        self.seed = worker_seed(seed, name, resumed_at)
        self.weights = WeightStore(store, one_copy=True)
        self.router_config = router or RouterConfig()
        self.weight_poll_s = weight_poll_s
        self.close_retry_s = close_retry_s
        self.on_result = on_result
        self.stop_launching = stop_launching
        self.trained_reward = trained_reward
        self.cluster = cluster
        self.engine_placements = engine_placements
        self._make_env = make_env
        self.engines: list[Engine] = []
        self.version: int | None = None
        self._newest_chain: list[int] = []
        """The newest version published (``LATEST``) at its last read, last, after its newest
        ancestors (``WeightStore.recent_chain``, with ``max_staleness``): what
        :meth:`_too_stale` counts on."""
        self._stale_warned: int | None = None
        """The newest version at the last warning of replicas too stale left in service."""
        self._loading = asyncio.Lock()
        """Held while weights are loaded into the engines (new versions, or a replica back up)."""
        self.version_loads: list[tuple[int, float]] = []
        self._refused: int | None = None
        """The newest version refused as corrupt: not fetched again (immutable, it stays so)."""
        self._retry: tuple[int, int, float] | None = None
        """A version whose load failed: (version, failures in a row, monotonic time before which
        it is not tried again)."""
        self._reload_retry: dict[str, tuple[int, int, float]] = {}
        """Per replica in service that failed the health check's reload: as ``_retry``."""
        self._shards_at_version = 0
        self.orchestrator: Orchestrator | None = None
        self.service: RolloutService | None = None
        self.router: Router | None = None
        self.plans = ElasticPlanBoard(store)
        self.plan_poll_s = plan_poll_s
        self.plan_max_age_s = plan_max_age_s
        self.plan_time: float | None = None
        self._plan_warnings: tuple[float | None, set[str]] = (None, set())
        self.status_due = asyncio.Event()
        """Set when a draining replica emptied, or is empty under a newer plan, since the last
        check (see the module docstring)."""
        self._emptied: frozenset[tuple[str, float | None]] = frozenset()
        self._confirming: frozenset[str] = frozenset()
        """This worker's replicas the applied plan names as draining: the trainer waits for a
        status that shows them empty (those it names as training it counts as handed over)."""
        self.trainer_status = TrainerStatusBoard(store)
        self.trainer_poll_s = trainer_poll_s
        self._trainer: TrainerStatus | None = None
        self._read_errors: dict[str, str] = {}
        """The error each polled object (trainer status, elastic plan) last failed to read with."""

    def make_env(self, task: Task) -> Env:
        if self._make_env is not None:
            return self._make_env(task)
        return registry.make(task.env, self.env_configs.get(task.env))

    def backlog(self) -> int:
        """Shards committed since the engines last picked up a new weight version."""
        return self.writer.committed - self._shards_at_version

    def trainer_queue(self) -> float | None:
        """Policy steps' worth of data the trainer last said it holds untrained (None when unknown)."""
        status = self._trainer
        return None if status is None else status.queued_batches

    def trainer_starved(self) -> bool:
        """Whether the trainer last said it holds less than one batch, having read every shard
        this worker committed: it cannot step before more data comes. False when its status
        is unknown, or while a shard of this worker has not reached it (the processor lags,
        or the trainer has not polled yet)."""
        status = self._trainer
        if status is None or status.queued_batches >= 1:
            return False
        committed = self.writer.last_seq
        return committed is None or status.newest_read.get(self.writer.worker, -1) >= committed

    def refresh_trainer_queue(self, now: float) -> None:
        """Read the trainer's status; a missing, stopped or stale one leaves the queue unknown."""
        status = self.trainer_status.read()
        fresh = status is not None and status.running and is_fresh(status.time, now, self.plan_max_age_s)
        self._trainer = status if fresh else None

    async def follow_trainer(self) -> None:
        """Refresh :meth:`trainer_queue` every ``trainer_poll_s``, until cancelled."""
        while True:
            try:
                await asyncio.to_thread(self.refresh_trainer_queue, time.time())
            except Exception as exc:  # storage unreachable for a moment: the queue is unknown
                self._trainer = None
                self.read_failed("the trainer's status", exc)
            else:
                self.read_again("the trainer's status")
            await asyncio.sleep(self.trainer_poll_s)

    def read_failed(self, what: str, exc: Exception) -> None:
        """Warn that ``what`` could not be read, once per distinct error while it lasts: a loop
        reads it every second or more often, for as long as storage is down."""
        error = f"{type(exc).__name__}: {exc}"
        if self._read_errors.get(what) != error:
            log.warning("worker %s could not read %s: %s", self.name, what, exc)
        self._read_errors[what] = error

    def read_again(self, what: str) -> None:
        """Say that ``what``, which :meth:`read_failed` warned of, is read again."""
        if self._read_errors.pop(what, None) is not None:
            log.info("worker %s reads %s again", self.name, what)

    async def start(self) -> RolloutWorker:
        """Build engines on the newest version that verifies (``WeightStore.load_newest``:
        ``LATEST``'s, or with a warning the newest below a corrupt one) and the orchestrator
        over them."""
        try:
            version, path = await asyncio.to_thread(self.weights.load_newest, "serving")
        except FileNotFoundError:
            raise FileNotFoundError(f"no weight version in {self.store.url('weights')} to serve") from None
        except CorruptVersion as error:
            raise CorruptVersion(
                f"worker {self.name} has no weights to serve: {error}; restore the version's files "
                "or start a new run"
            ) from None
        self.engines = await asyncio.to_thread(
            build_engines, self.engine_config, path, version, self.cluster, self.store, self.engine_placements
        )
        self.router = Router(self.engines, self.router_config)
        # a vLLM server holds what it was launched with or last loaded, not necessarily this
        missing = await self._load_on([e for e in self.engines if e.version != version], version, path)
        if len(missing) == len(self.engines):
            raise EngineError(
                f"worker {self.name}: no replica could load weight version {version}: {missing}"
            )
        for name in missing:  # out of service; the health check loads the version when it is up
            self.router.take_down(name)
        await self._check_context([e for e in self.engines if e.name not in missing])
        from rl.models import load_tokenizer, model_eos_ids, model_vocab_size

        tokenizer = getattr(self.engines[0], "tokenizer", None)
        if tokenizer is None:
            tokenizer = load_tokenizer(path)
        gateway_config = self.gateway_config
        if gateway_config.vocab_size is None:
            # the model's ids, not the tokenizer's: ids past the tokenizer are sampled too
            gateway_config = gateway_config.model_copy(update={"vocab_size": model_vocab_size(path)})
        if gateway_config.eos_token_ids is None:
            gateway_config = gateway_config.model_copy(update={"eos_token_ids": model_eos_ids(path)})
        self.version = version
        self._newest_chain = [version]
        self._shards_at_version = self.writer.committed
        gateway = Gateway(self.router, tokenizer, gateway_config)
        service = self.service = RolloutService(
            gateway, self.make_env, self.service_config, secrets=self.store.config.secrets()
        )
        streams = task_streams(list(self.orchestrator_config.mix), self.env_configs, self.seed)
        self.orchestrator = Orchestrator(
            service,
            streams,
            self.writer,
            self.orchestrator_config,
            backlog=self.backlog,
            trainer_queue=self.trainer_queue,
            trainer_starved=self.trainer_starved,
            on_result=self.on_result,
            quota=self.quota(),
            stop_launching=self.stop_launching,
            serving=self.serving,
            trained_reward=self.trained_reward,
        )
        if self._stopped.is_set():  # stopped before, or while, the engines were built
            self.orchestrator.stop()
        return self

    async def _check_context(self, engines: list[Engine]) -> None:
        """Raise ``ValueError`` when a vLLM server of ``engines`` holds fewer tokens than a
        session may (``GatewayConfig.max_context_tokens``): every rollout past its
        ``max_model_len`` would end early as truncated."""
        limit = self.gateway_config.max_context_tokens
        for engine in engines:
            if isinstance(engine, VLLMEngine):
                length = await engine.max_model_len()
                if length is not None and length < limit:
                    raise ValueError(
                        f"worker {self.name}: gateway.max_context_tokens={limit} is over vLLM server "
                        f"{engine.name}'s max_model_len={length}; lower it to {length} or relaunch the "
                        f"server with --max-model-len {limit}"
                    )

    def serving(self) -> bool:
        """Whether an engine replica is in service; with none, launching waits for the health
        check to bring one back. Raises ``EngineError`` when none can come back: with no
        health check (``router.health_check_s`` None), a replica taken out stays out: the
        orchestrator launches nothing more, lets the rollouts in flight end, and the run fails
        with it."""
        if self.router.replicas:
            return True
        if self.router.config.health_check_s is None:
            raise EngineError(
                f"worker {self.name}: every engine replica is out of service ({', '.join(self.router.down)}) "
                "and router.health_check_s is null, so none comes back; restart the worker once they are up, "
                "or set router.health_check_s"
            )
        return False

    def quota(self) -> RunQuota | None:
        """The run's ``max_rollouts``, which every worker of the run and every restart shares."""
        limit = self.orchestrator_config.max_rollouts
        return None if limit is None else RunQuota(self.store, "rollouts", limit)

    async def sync_weights(self) -> bool:
        """Load the newest published version into every healthy engine; True when one was loaded.

        A version refused as corrupt (``CorruptVersion``, raised once) is not fetched again:
        the engines keep theirs until a newer one is published. ``LATEST`` that cannot be read
        (storage unreachable, or garbled) loads nothing and is warned of once while it lasts
        (:meth:`read_failed`): the weight loop reads it every ``weight_poll_s``.
        A replica that is down is skipped: it cannot load anything, and failing the whole
        update for it would make the healthy replicas reload the version at every poll.
        Whatever the load does, a replica left too far behind the newest version leaves
        service (:meth:`_take_out_stale`).
        """
        async with self._loading:
            try:
                return await self._sync_weights()
            finally:
                self._take_out_stale()

    @property
    def newest(self) -> int | None:
        """The newest version published (``LATEST``) at its last read."""
        return self._newest_chain[-1] if self._newest_chain else None

    def _too_stale(self, version: int) -> bool:
        """Whether the trainer drops the tokens of ``version``: more than ``max_staleness``
        versions behind the newest published, on its chain."""
        limit = self.max_staleness
        return (
            limit is not None
            and bool(self._newest_chain)
            and versions_ahead(self._newest_chain, version) > limit
        )

    def _take_out_stale(self) -> None:
        """Take out of service each replica whose version is :meth:`_too_stale` (one that failed
        to load the versions since): the trainer would drop everything it generates. The health
        check's restore puts it back once it loads the worker's version. With no health check
        nothing would, while the weight loop's next load that succeeds brings the replicas up to
        date in service: they stay, warned of once per newest version. A replica whose weights
        are unknown (``UNKNOWN_VERSION``) is left to its own refusal to generate."""
        router = self.router
        if router is None:
            return
        stale = {
            name: version
            for name in router.replicas
            if (version := router.engine(name).version) != UNKNOWN_VERSION and self._too_stale(version)
        }
        if stale and router.config.health_check_s is None:
            if self._stale_warned != self.newest:
                self._stale_warned = self.newest
                log.warning(
                    "worker %s: replicas %s serve weight versions more than max_staleness=%d behind the "
                    "newest published, %d, so the trainer drops every token they generate; with "
                    "router.health_check_s null nothing would bring them back: they serve until a load "
                    "succeeds",
                    self.name,
                    stale,
                    self.max_staleness,
                    self.newest,
                )
            return
        for name, version in stale.items():
            log.warning(
                "worker %s takes replica %s out of service: it serves weight version %d, more than "
                "max_staleness=%d behind the newest published, %d, so the trainer drops every token "
                "it generates; it is back once it loads a newer version",
                self.name,
                name,
                version,
                self.max_staleness,
                self.newest,
            )
            router.take_down(name)

    async def _sync_weights(self) -> bool:
        try:
            latest = await asyncio.to_thread(self.weights.latest)
        except Exception as exc:  # storage unreachable, or LATEST garbled: the engines keep theirs
            self.read_failed("the weights' LATEST", exc)
            return False
        self.read_again("the weights' LATEST")
        if latest is not None and latest != self.newest:
            self._newest_chain = (
                [latest]
                if self.max_staleness is None
                else await asyncio.to_thread(
                    self.weights.recent_chain, latest, self.max_staleness + 1, self._newest_chain
                )
            )
        if latest is None or latest in (self.version, self._refused):
            return False
        retry = self._retry if self._retry is not None and self._retry[0] == latest else None
        if retry is not None and time.monotonic() < retry[2]:
            return False
        try:
            path = await asyncio.to_thread(self.weights.load, latest, "serving")
            await self._load_on(self.engines, latest, path)
        except CorruptVersion:
            self._refused = latest
            self._retry = None  # an older version's wait: this one is never tried again
            raise
        except Exception:
            # tried again later and later (each try verifies the copy's digests, a model's size
            # read, and warns), while a newer version is tried at the next poll
            failures = 1 if retry is None else retry[1] + 1
            self._retry = (latest, failures, time.monotonic() + self.retry_wait_s(failures))
            raise
        self._retry = None
        self.version = latest
        self._shards_at_version = self.writer.committed
        self.version_loads.append((latest, time.time()))
        log.info("worker %s now serves weight version %d", self.name, latest)
        return True

    async def _load_on(self, engines: list[Engine], version: int, path: str) -> list[str]:
        """Load ``version`` onto the replicas of ``engines`` that are up; returns the names of
        those that did not load it (down, or failed with a health check to retry them).

        Raises when every replica that is up fails, or when one fails and no health check
        would reload it later; a replica that is down is skipped (it cannot load anything,
        and failing the whole update for it would make the healthy replicas reload the
        version at every poll): the health check loads it when it comes back.
        """
        if not engines:
            return []
        # probed as the router probes: one that hangs (a stuck actor) or raises counts as down
        # after health_timeout_s, not holding the update (and the lock it holds) for ever
        timeout = self.router_config.health_timeout_s
        up = await asyncio.gather(*(probe_health(engine, timeout) for engine in engines))
        down = [engine.name for engine, ok in zip(engines, up, strict=True) if not ok]
        if down:
            log.warning(
                "worker %s loads weight version %d without replicas %s: down", self.name, version, down
            )
        loading = [engine for engine, ok in zip(engines, up, strict=True) if ok]
        results = await asyncio.gather(
            *(self._load(engine, version, path) for engine in loading), return_exceptions=True
        )
        failed = {e.name: r for e, r in zip(loading, results, strict=True) if isinstance(r, BaseException)}
        if failed and (len(failed) == len(loading) or self.router_config.health_check_s is None):
            # with no health check nothing would reload the failed replicas: the next poll does
            raise next(iter(failed.values()))
        if failed:
            # the worker moves on with the replicas that loaded it: the health check reloads
            # the others (their version differs), rather than every replica going back
            log.warning(
                "worker %s: weight version %d failed to load on %s; the health check retries them",
                self.name,
                version,
                "; ".join(f"{name}: {exc}" for name, exc in failed.items()),
            )
        return [*down, *failed]

    def retry_wait_s(self, failures: int) -> float:
        """Seconds before a version whose load failed ``failures`` times in a row is tried again."""
        return min(self.weight_poll_s * 2**failures, LOAD_RETRY_MAX_S)

    async def _follow_weights(self) -> None:
        while True:
            await asyncio.sleep(self.weight_poll_s)
            try:
                await self.sync_weights()
            except Exception as exc:  # a half-visible or corrupt version: keep serving the current one
                retry = (
                    ""
                    if self._retry is None
                    else f"; tried again in {self.retry_wait_s(self._retry[1]):.1f} s"
                )
                log.warning("worker %s could not load a new weight version: %s%s", self.name, exc, retry)

    def apply_plan(self, plan: ElasticPlan | None, now: float) -> bool:
        """Drain and undrain this worker's replicas as ``plan`` says; False when it is ignored.

        Ignored: no plan, or a running trainer's plan older than ``plan_max_age_s`` at
        ``now`` (warned once per plan): the trainer died or hangs, so every replica goes back
        to rollout rather than staying drained for a trainer that may never come back. No
        plan (none, or one that does not parse) leaves the replicas as the last plan applied
        put them until that plan is as old, then puts them back the same way.
        Replicas the plan does not name as draining or handed to training accept new
        sessions; the last accepting replica is never drained.
        """
        if (
            plan is None
            and self.plan_time is not None
            and not is_fresh(self.plan_time, now, self.plan_max_age_s)
        ):
            plan = ElasticPlan(time=self.plan_time)  # the last plan applied, gone stale
        if plan is None or self.router is None:
            return False
        stale = plan.running and not is_fresh(plan.time, now, self.plan_max_age_s)
        if stale:
            why = (
                f"{now - plan.time:.0f} s old (> {self.plan_max_age_s:.0f} s), so no trainer is steering"
                if plan.time <= now
                else f"dated {plan.time - now:.0f} s ahead of this worker's clock (> {self.plan_max_age_s:.0f} s): "
                "the trainer's and this machine's clocks disagree"
            )
            self._warn_plan(
                "stale",
                plan,
                f"worker {self.name} ignores the elastic plan of {_clock(plan.time)}: {why}; "
                "every replica takes new sessions",
            )
        router = self.router
        wanted = set() if stale else plan.drained(self.name)
        down = wanted & (set(router.down) - set(router.draining))
        if down:
            # a plan made before the trainer saw them go down (a status lists replicas in service)
            self._warn_plan(
                "down",
                plan,
                f"worker {self.name}: the elastic plan drains replicas {sorted(down)}, which are down; "
                "each is drained when back in service if the plan then still names it",
            )
        unknown = wanted - set(router.replicas) - set(router.down)
        if unknown:
            self._warn_plan(
                "unknown",
                plan,
                f"worker {self.name}: the elastic plan names unknown replicas {sorted(unknown)}",
            )
        # first: a replica the plan puts back accepts before another drains (one drain moved
        # to another replica is not refused as draining the last accepting one)
        for replica in router.draining:
            if replica not in wanted:
                router.undrain(replica)
                log.info(
                    "worker %s puts replica %s back in rollout (elastic plan of %s)",
                    self.name,
                    replica,
                    _clock(plan.time),
                )
        to_drain = [r for r in router.replicas if r in wanted and r not in router.draining]
        accepting = [r for r in router.replicas if r not in router.draining]
        for replica in to_drain:
            if len(accepting) <= 1:
                self._warn_plan(
                    "last",
                    plan,
                    f"worker {self.name} keeps {replica} accepting: it is its last accepting replica",
                )
                break
            router.drain(replica)
            accepting.remove(replica)
            log.info(
                "worker %s drains replica %s (elastic plan of %s)", self.name, replica, _clock(plan.time)
            )
        if stale:
            return False
        self.plan_time = plan.time
        self._confirming = frozenset(
            unit.split("/", 1)[1] for unit in plan.draining if unit.split("/", 1)[0] == self.name
        )
        return True

    def _warn_plan(self, kind: str, plan: ElasticPlan, message: str) -> None:
        # once per kind of problem and plan: the same plan is read again every poll
        if self._plan_warnings[0] != plan.time:
            self._plan_warnings = (plan.time, set())
        if kind not in self._plan_warnings[1]:
            self._plan_warnings[1].add(kind)
            log.warning("%s", message)

    async def follow_plan(self) -> None:
        """Read the elastic plan every ``plan_poll_s``, apply it and check for emptied draining
        replicas (``status_due``), until cancelled."""
        while True:
            try:
                plan = await asyncio.to_thread(self.plans.read)
                self.read_again("the elastic plan")
                self.apply_plan(plan, time.time())
            except Exception as exc:  # storage unreachable for a moment: replicas stay as they are
                self.read_failed("the elastic plan", exc)
            self._check_emptied()
            await asyncio.sleep(self.plan_poll_s)

    def _check_emptied(self) -> None:
        """Set ``status_due`` when a replica the plan drains holds no session and did not at the
        last check, or did under an older plan: the newer one may drain it anew (cancelled and
        made again between two reads), and the trainer confirms a drain only by a status of its
        plan."""
        router = self.router
        empty = (
            frozenset(
                (r, self.plan_time) for r in router.draining if r in self._confirming and router.load(r) == 0
            )
            if router
            else frozenset()
        )
        if empty - self._emptied:
            self.status_due.set()
        self._emptied = empty

    async def run(self, max_seconds: float | None = None) -> OrchestratorStats:
        """Run rollouts until the orchestrator's stop condition, ``max_seconds`` (None: no limit;
        0 stops at once) or :meth:`stop`."""
        if self.orchestrator is None:
            await self.start()
        follower = asyncio.create_task(self._follow_weights())
        planner = asyncio.create_task(self.follow_plan())
        queue_reader = asyncio.create_task(self.follow_trainer())
        flusher = asyncio.create_task(self._flush_when_due())
        prober = asyncio.create_task(self._check_health())
        loop = asyncio.get_running_loop()
        timer = None if max_seconds is None else loop.call_later(max_seconds, self.stop)
        try:
            await self._serve_http()
            if self.http is not None and self.http.serve_only:
                await self._stopped.wait()
                return self.orchestrator.stats
            return await self.orchestrator.run()
        finally:
            if timer is not None:
                timer.cancel()
            try:
                await self._stop_http()
            finally:
                loops = (follower, planner, queue_reader, flusher, prober)
                for loop in loops:
                    loop.cancel()
                await asyncio.gather(*loops, return_exceptions=True)

    async def _serve_http(self) -> None:
        """Start the gateway's HTTP API for outside harnesses, if asked for (``http``)."""
        if self.http is None:
            return
        sampling = RunSampling(self.service_config.temperature, self.service_config.top_p, fixed=True)
        self.http_server = await GatewayServer(
            self.service.gateway,
            host=self.http.host,
            port=self.http.port,
            token=self._http_token,
            sampling=sampling,
            idle_timeout_s=self.http.idle_timeout_s,
            drain_timeout_s=self.http.drain_timeout_s,
            read_timeout_s=self.http.read_timeout_s,
            max_connections=self.http.max_connections,
            write=self._write_harness_records,
            backpressure=self.orchestrator.backpressure,
        ).start()
        log.info(
            "worker %s serves the gateway at %s%s",
            self.name,
            self.http_server.url,
            " (serve only: none of its own rollouts)" if self.http.serve_only else "",
        )

    def _write_harness_records(self, table: pa.Table) -> None:
        """Buffer the records a harness sent over HTTP (``GatewayServer``'s ``write``); raises
        only when they will not be committed (the writer closed, or the worker's name taken), or,
        buffering none, while the writer holds more than its ``max_unsaved_records`` whose commits
        failed (the store is down): the harness keeps them and sends them again, rather than this
        worker holding ever more in memory, lost if it dies. A flush this write sets off that fails
        keeps them for the next one, as the flusher's does: the harness is told they are written,
        and its resend is refused rather than committed twice."""
        if self.writer.closed:
            raise RuntimeError(f"worker {self.name} is stopping: its raw shards take no more records")
        if self._name_taken is not None:  # a flush would buffer them and answer them written
            raise InUse(str(self._name_taken))
        unsaved, bound = self.writer.unsaved_records, self.writer.max_unsaved_records
        if unsaved > bound:
            raise RuntimeError(
                f"worker {self.name} holds {unsaved} records whose commits to its raw shards failed, more "
                f"than its max_unsaved_records={bound}: it takes no more until the store takes those"
            )
        try:
            self.writer.write_table(table)
        except InUse as exc:
            self._name_taken = exc
            self._told_unwritten.update(table.column("trajectory_id").to_pylist())
            raise
        except Exception as exc:
            log.warning(
                "worker %s could not commit its buffered records (a harness's among them); the next "
                "flush retries them: %s",
                self.name,
                exc,
            )
        self.harness_records += table.num_rows

    async def _stop_http(self) -> None:
        """Stop the HTTP API (its requests in flight finish first), before the writer closes."""
        if self.http_server is not None:
            server, self.http_server = self.http_server, None
            await server.stop()
            log.info("worker %s stopped serving the gateway", self.name)

    async def _flush_when_due(self) -> None:
        """Commit finished rollouts once they have waited ``flush_seconds``, also while none
        finishes (long sessions), so a crash then loses at most that much."""
        while True:
            await asyncio.sleep(min(1.0, self.writer.flush_seconds))
            try:
                self.writer.flush_if_due()
            except Exception as exc:  # its records stay buffered; the next flush retries
                log.warning("worker %s could not commit its buffered rollouts: %s", self.name, exc)

    async def _check_health(self) -> None:
        """Probe the replicas every ``health_check_s`` of the router's config (``Router.check_health``).

        A replica that comes back loads this worker's weight version before it serves again,
        whatever version it last loaded: it missed the loads while down, or it restarted on
        other weights; none comes back while that version is too stale (``max_staleness``), nor a
        vLLM server that holds fewer tokens than a session may (:meth:`_check_context`: one down
        at start missed the start's check). One in service that missed a load (a failed probe in
        ``sync_weights``) loads it too, tried again later and later while it fails (:meth:`_reload_due`)."""
        interval = self.router.config.health_check_s
        if interval is None:
            return
        while True:
            await asyncio.sleep(interval)
            try:
                await self.router.check_health(restore=self._load_current_version)
                async with self._loading:  # not while sync_weights moves the version on
                    version = self.version
                    stale = [
                        e
                        for e in self.engines
                        if e.name in self.router.replicas
                        and e.version != version
                        and self._reload_due(e.name)
                    ]
                    if stale:
                        path = await asyncio.to_thread(self.weights.load, version, "serving")
                        await self._reload_all(stale, version, path)
            except Exception as exc:  # the next probe tries again
                log.warning("worker %s could not check its replicas: %s", self.name, exc)

    async def _reload_all(self, engines: list[Engine], version: int, path: str) -> None:
        """:meth:`_reload` of each of ``engines`` at once, each awaited whatever the others do:
        one left loading would overlap the next load of its replica (the caller holds the
        loading lock), or go on after the worker stopped. A cancel cancels them all and is
        raised once every one has ended."""
        reloads = [asyncio.create_task(self._reload(engine, version, path)) for engine in engines]
        try:
            await asyncio.wait(reloads)
        finally:
            for reload in reloads:
                reload.cancel()
            if await wait_through_cancels(reloads):
                raise asyncio.CancelledError

    def _reload_due(self, replica: str) -> bool:
        """Whether the health check may try to load the worker's version into ``replica`` now:
        after each failure in a row it waits twice as long (``retry_wait_s``), as the weight
        loop does, rather than loading the version's files again at every probe."""
        retry = self._reload_retry.get(replica)
        return retry is None or retry[0] != self.version or time.monotonic() >= retry[2]

    async def _reload(self, engine: Engine, version: int, path: str) -> None:
        """:meth:`_load` for the health check, whose probes retry a replica that fails."""
        try:
            await self._load(engine, version, path)
        except Exception as exc:
            retry = self._reload_retry.get(engine.name)
            failures = 1 if retry is None or retry[0] != version else retry[1] + 1
            wait = self.retry_wait_s(failures)
            self._reload_retry[engine.name] = (version, failures, time.monotonic() + wait)
            log.warning(
                "worker %s: replica %s failed to load weight version %d (tried again in %.1f s): %s",
                self.name,
                engine.name,
                version,
                wait,
                exc,
            )
        else:
            self._reload_retry.pop(engine.name, None)

    async def _load_current_version(self, engine: Engine) -> None:
        async with self._loading:  # not while sync_weights moves the version on
            if self._too_stale(self.version):
                raise EngineError(
                    f"worker {self.name} serves weight version {self.version}, more than "
                    f"max_staleness={self.max_staleness} behind the newest published, {self.newest}: "
                    "its replicas stay out until a newer version loads"
                )
            await self._check_context([engine])
            path = await asyncio.to_thread(self.weights.load, self.version, "serving")
            await self._load(engine, self.version, path)
            self._reload_retry.pop(engine.name, None)

    async def _load(self, engine: Engine, version: int, path: str) -> None:
        """``engine.load_version``, failed with an ``EngineError`` after the engine config's
        ``load_timeout_s``: a replica that answers its probes but hangs on a load would hold
        ``_loading`` for ever."""
        timeout = self.engine_config.load_timeout_s
        try:
            await asyncio.wait_for(engine.load_version(version, path), timeout)
        except TimeoutError:
            raise EngineError(
                f"replica {engine.name} did not load weight version {version} within {timeout:g} s"
            ) from None

    def stop(self) -> None:
        self._stopped.set()
        if self.orchestrator is not None:
            self.orchestrator.stop()

    def live_sessions(self) -> int:
        """Rollout sessions assigned to this worker's engines that have not ended."""
        return sum(self.replica_sessions().values())

    def replica_sessions(self) -> dict[str, int]:
        """Sessions pinned to each replica in service, or under the router's ``round_robin`` (which
        pins none) its requests generating: ``Router.load``; a draining replica is empty at 0."""
        if self.router is None:
            return {}
        return {name: self.router.load(name) for name in self.router.replicas}

    async def status(self) -> dict[str, Any]:
        # off the event loop: a replica's stats() may wait on it (RayEngine up to 10 s)
        engine_stats = await asyncio.gather(*(asyncio.to_thread(engine.stats) for engine in self.engines))
        rewards = self.service.rewards if self.service else None
        return {
            "version": self.version,
            "backlog": self.backlog(),
            "unsaved_records": self.writer.unsaved_records,
            "engine_queue_depth": sum(s.queue_depth for s in engine_stats),
            "live_sessions": self.live_sessions(),
            "replica_sessions": self.replica_sessions(),
            "plan_time": self.plan_time,
            **self._routing_status(),
            "orchestrator": self.orchestrator.stats.as_dict() if self.orchestrator else None,
            "prefill_computed": sum(s.prefill_computed for s in engine_stats),
            "prefill_reused": sum(s.prefill_reused for s in engine_stats),
            "decode_tokens": sum(s.decode_tokens for s in engine_stats),
            "reward_reloads": rewards.manager.reloads if rewards else 0,
            "gateway_url": self.http_server.url if self.http_server is not None else None,
            "harness_records": self.harness_records,
            **self._harness_status(),
        }

    def _harness_status(self) -> dict[str, Any]:
        """What a worker serving the gateway (``http``) tells of outside harnesses: the new
        rollouts it refused them (429) and why one would be refused now (None: it would open)."""
        if self.http_server is None:
            return {"harness_sessions_refused": 0, "backpressure": None}
        return {
            "harness_sessions_refused": self.http_server.sessions_refused,
            "backpressure": self.orchestrator.backpressure(),
        }

    def _routing_status(self) -> dict[str, Any]:
        """The router's drains, moves and session ages, lengths and contexts (empty before ``start``)."""
        router = self.router
        if router is None:
            return {
                "draining": [],
                "migrations": 0,
                "session_ages": {},
                "sessions_ended": 0,
                "sessions_expired": 0,
                "session_lengths": [],
                "session_contexts": [],
            }
        return {
            "draining": router.draining,
            "migrations": router.migrations,
            "session_ages": router.session_ages(),
            "sessions_ended": router.sessions_ended,
            "sessions_expired": router.sessions_expired,
            "session_lengths": list(router.session_lengths),
            "session_contexts": list(router.session_contexts),
        }

    async def close(self) -> None:
        """Commit what is buffered, then stop the service and the engines, whether or not
        that commit landed, and let the weight cache drop the copy they served. A commit that
        fails is tried again after each wait of ``close_retry_s`` (the records stay in the
        writer meanwhile); the last failure is raised once everything is stopped."""
        try:
            await self._close_writer()
        finally:
            try:
                if self.service is not None:
                    await self.service.close()
            finally:
                await asyncio.gather(*(engine.close() for engine in self.engines), return_exceptions=True)
                self.weights.release()

    async def _close_writer(self) -> None:
        for wait in (*self.close_retry_s, None):
            try:
                await asyncio.to_thread(self.writer.close)
                return
            except InUse:  # another worker has the name: its shards, not these, come next
                await self._set_aside_uncommitted()
                raise
            except Exception as exc:
                if wait is None:
                    raise
                log.warning(
                    "worker %s could not commit its last %d records (%s); trying again in %.0f s",
                    self.name,
                    self.writer.unsaved_records,
                    exc,
                    wait,
                )
                await asyncio.sleep(wait)

    async def _set_aside_uncommitted(self) -> None:
        """Keep the records this worker can no longer commit (its name taken) in the
        quarantine, so that a rollout finished, or a harness's write answered, is not lost."""
        why = f"not committed: another process took worker name {self.name!r} before their shard's commit"
        try:
            kept = await asyncio.to_thread(self.writer.abandon, why, self._told_unwritten)
        except Exception as exc:
            log.error(
                "worker %s could neither commit its last records nor set them aside: %s", self.name, exc
            )
            return
        if kept is not None:
            path, records = kept
            log.error(
                "worker %s kept the %d records it could not commit in %s (its name was taken; "
                "they are in no shard and no table)",
                self.name,
                records,
                self.writer.store.url(path),
            )
