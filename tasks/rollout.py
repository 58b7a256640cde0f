"""The rollout task: one worker's engines and orchestrator, running until the deadline."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.events import emit_event

from flows.config import RunConfig
from flows.run_logs import module_logs_to_run
from rl.processor import combine_reward
from rollout.router import RouterConfig
from rollout.worker import RolloutWorker
from storage.heartbeat import Heartbeat
from storage.quota import RunQuota
from storage.schema import EXCLUDED_STATUSES
from storage.shards import ShardInfo
from storage.status import (
    HeldRole,
    InUse,
    RolloutStatus,
    RolloutStatusBoard,
    wait_until_free,
)
from tasks.common import (
    SIDE_EFFECTS,
    STORAGE_RETRIES,
    deadline_of,
    read_signal,
    reporting,
    run_resource,
    run_store,
    said,
    send_signal,
    watch_signal,
)
from tasks.event_loop import run_async

log = logging.getLogger(__name__)

STATUS_RETRY_S = 1.0
"""Seconds before a status published ahead of the beat (a drained replica emptied) is tried
again when it failed: the trainer waits for it, so it does not wait for the next beat."""


def status_object(worker_name: str, status: dict[str, Any], running: bool) -> RolloutStatus:
    """The status object a worker publishes, from ``RolloutWorker.status()`` now."""
    return RolloutStatus(
        worker=worker_name,
        time=time.time(),
        engine_queue_depth=status["engine_queue_depth"],
        live_sessions=status["live_sessions"],
        running=running,
        replica_sessions=status.get("replica_sessions", {}),
        draining=status.get("draining", []),
        plan_time=status.get("plan_time"),
        finished=(status.get("orchestrator") or {}).get("finished", 0),
        finished_rows=(status.get("orchestrator") or {}).get("finished_rows"),
        session_ages={r: [round(a, 3) for a in ages] for r, ages in status.get("session_ages", {}).items()},
        sessions_ended=status.get("sessions_ended", 0),
        sessions_expired=status.get("sessions_expired", 0),
        session_lengths=[round(length, 3) for length in status.get("session_lengths", [])],
        session_contexts=status.get("session_contexts", []),
    )


async def first_set(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Wait until one of ``events`` is set, or ``timeout`` seconds have passed."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def router_config(config: RunConfig) -> RouterConfig:
    """The worker's router: a drained replica's sessions move at their next turn exactly
    when the trainer's controller counts on it (``elastic.migrate_at_turns``), and only
    into a free session slot of a replica (``elastic.sessions_per_replica``), as it counts."""
    return RouterConfig(
        migrate_on_drain=config.elastic.migrate_at_turns,
        migration_slots=config.elastic_settings().sessions_per_replica,
    )


def run_rollouts(
    config: RunConfig,
    deadline: float | Callable[[], float],
    worker_name: str = "worker-0",
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    progress_every_s: float = 5.0,
    stop: threading.Event | None = None,
    on_shard: Callable[[ShardInfo], None] | None = None,
    flush_records: int = 64,
    flush_seconds: float = 10.0,
    placements: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run rollouts until ``deadline`` (epoch seconds, or a function called for them once the
    worker is up: its engines loaded and, on Ray, its env actors started), ``stop``,
    ``stop.max_rollouts`` or, seen at a beat, a served weight version at
    ``stop.max_policy_steps`` (the trainer stopped there: nothing more would be trained): no
    rollout launches once ``stop`` is set (or that version is served), and those in flight are
    cut short at the next beat (the run ends sooner once none is left); ``on_shard`` is called
    (on the worker's commit thread) with each raw shard it commits. Every ``progress_every_s``
    (and once at start and at the end) the worker publishes its engine queue depth, live
    sessions and each replica's pinned sessions and drain state to
    ``status/rollout/<worker_name>.json`` for the trainer (``storage.status``); ``on_progress``
    gets the same status, right after it is published;
    while its engines load (however long that takes), an idle running status at the same pace.
    The worker follows the trainer's elastic plan (``RolloutWorker.apply_plan``): with one
    engine replica nothing is ever drained. A replica it drains for training counts as training
    once a status shows it empty, so that status is published as soon as the worker sees it
    empty (``RolloutWorker.status_due``), between the beats and without a progress report (and
    again every ``STATUS_RETRY_S`` while publishing it fails).

    With ``config.cluster == "ray"`` the engines and the environments run in Ray actors
    (one env worker per engine replica, none serving only) on the cluster at ``config.ray_address``; with
    ``placements`` (the Ray options of each, in the order of :func:`rollout_actor_resources`:
    their bundles of a placement group the caller holds) each runs in its bundle, else Ray
    places them freely.
    ``flush_records`` and ``flush_seconds`` bound how much a raw shard holds and how long
    a finished rollout waits in the buffer before its shard is committed.

    A worker name is one worker's: starting under the name of a running worker raises
    :class:`~storage.status.InUse`; a fresh status left by a worker that died is waited
    out (``storage.status.wait_until_free``). Each status is published after reading the
    current one back, and so is each raw shard committed (``storage.status.HeldRole``): a
    worker that finds another's fresh status there (both started at once, or its own went
    unrenewed for ``DEFAULT_MAX_AGE_S`` and another took the name) commits no more shards,
    publishes no more statuses, stops, and raises :class:`~storage.status.InUse`; the
    records it had not committed (its rollouts', those a harness was told were written) are
    kept in the quarantine, ``shards/quarantine/raw/<worker>/uncommitted-*.arrow``, in no shard."""
    board = RolloutStatusBoard(run_store(config))
    wait_until_free(
        lambda: board.read_worker(worker_name),
        f"rollout worker name {worker_name!r}",
        "give each worker its own name (--worker, or the rollout flow's worker_name)",
    )
    role = HeldRole(
        lambda: board.read_worker(worker_name), board.publish, f"rollout worker name {worker_name!r}"
    )
    # the name is taken while the engines load, kept fresh by a heartbeat (a status left to go
    # stale would let a second worker take the name); a failed start says it stopped
    idle = {"engine_queue_depth": 0, "live_sessions": 0}
    role.claim(status_object(worker_name, idle, running=True))
    loading = Heartbeat(
        lambda: role.publish(status_object(worker_name, idle, running=True)),
        progress_every_s,
        f"status heartbeat of worker {worker_name}",
    )

    def mark_stopped() -> None:
        """Publish that the worker stopped, where its work never started (``main`` says so as
        it ends); called once the loading heartbeat is stopped, so that none lands after."""
        try:
            role.publish(status_object(worker_name, idle, running=False))
        except Exception as exc:  # its status goes stale instead; what stopped the start is the error
            log.warning("worker %s could not mark itself stopped: %s", worker_name, exc)

    try:
        # two writers under one name would interleave its shard numbers, which the trainer
        # reads in order
        worker, env_pool = _build_worker(
            config, worker_name, flush_records, flush_seconds, on_shard, role.require, stop, placements
        )
    except BaseException:
        loading.stop()
        mark_stopped()
        raise

    async def publish_status(running: bool) -> tuple[dict[str, Any], bool]:
        """The worker's status now, and whether publishing it raised nothing."""
        status = await worker.status()
        if not running:  # its engines are closed: nothing waits or is pinned there; its counts stand
            status |= {"engine_queue_depth": 0, "live_sessions": 0, "replica_sessions": {}, "draining": [],
                       "session_ages": {}}  # fmt: skip
        published = status_object(worker_name, status, running)
        sent = True
        try:
            await asyncio.to_thread(role.publish, published)
        except Exception as exc:  # a storage hiccup: the next status replaces this one
            sent = False
            log.warning("worker %s could not publish its status: %s", worker_name, exc)
        if role.lost.is_set():
            worker.stop()
        return status, sent

    finished = asyncio.Event()
    report_progress = reporting(on_progress, f"progress report of worker {worker_name}")
    steps_of: dict[int, int] = {}
    reached_limit: list[int] = []  # the version that stopped it: said once, not at every beat left

    def trained_enough() -> bool:
        """Whether the version served holds ``stop.max_policy_steps`` policy steps."""
        version = worker.version
        if version not in steps_of:
            what = f"the step of weight version {version}"
            try:
                steps_of[version] = int(worker.weights.manifest(version).get("step", 0))
            except Exception as exc:  # pruned, or storage unreachable: the next beat looks again
                worker.read_failed(what, exc)
                return False
            worker.read_again(what)
        return steps_of[version] >= config.stop.max_policy_steps

    async def report() -> None:
        # ends between two statuses, so none lands after the final one
        beat = time.monotonic() + progress_every_s
        while True:
            await first_set((finished, worker.status_due), beat - time.monotonic())
            if finished.is_set():
                return
            if stop is not None and stop.is_set():
                worker.stop()
            limit = config.stop.max_policy_steps
            if limit is not None and not reached_limit and await asyncio.to_thread(trained_enough):
                reached_limit.append(worker.version)
                log.info(
                    "worker %s stops: it serves weight version %s, at the run's stop.max_policy_steps %d",
                    worker_name,
                    worker.version,
                    limit,
                )
                worker.stop()
            if worker.status_due.is_set():  # a drained replica emptied: the trainer waits to see it
                worker.status_due.clear()
                _, sent = await publish_status(running=True)
                if not sent:  # still due, after a pause rather than at once while storage fails
                    await first_set((finished,), STATUS_RETRY_S)
                    worker.status_due.set()
                continue
            beat = time.monotonic() + progress_every_s
            status, _ = await publish_status(running=True)
            if report_progress is not None:
                await asyncio.to_thread(report_progress, status)

    began: list[bool] = []  # main ran: it says the worker stopped as it ends

    async def main() -> dict[str, Any]:
        began.append(True)
        reporter = None
        try:
            try:
                await worker.start()
            finally:  # stopped before the worker's own statuses, so that no idle one lands after them
                await asyncio.to_thread(loading.stop)
            await publish_status(running=True)
            end = await asyncio.to_thread(deadline) if callable(deadline) else deadline
            reporter = asyncio.create_task(report())
            stats = await worker.run(max_seconds=max(end - time.time(), 0.001))
        finally:
            finished.set()
            if reporter is not None:
                (reported,) = await asyncio.gather(reporter, return_exceptions=True)
                if isinstance(reported, Exception):
                    log.warning("worker %s stopped reporting progress: %s", worker_name, said(reported))
            try:
                await worker.close()
            finally:
                await publish_status(running=False)
        return {
            **(await worker.status()),
            "orchestrator": stats.as_dict(),
            "version_loads": len(worker.version_loads),
        }

    try:
        result = run_async(main())
    finally:
        loading.stop()  # main stops it, unless run_async refused to run main
        if not began:  # the loop's thread could not start, or a signal came as it did
            mark_stopped()
        if env_pool is not None:
            env_pool.close()
    if role.lost.is_set():
        raise InUse(f"{role.taken}; it stopped, and committed no more shards under the name")
    return result


def max_rollouts(config: RunConfig) -> int | None:
    """The run's limit of rollouts, the total of its quota and of its progress bar: the smaller
    of ``stop.max_rollouts`` and ``orchestrator.max_rollouts`` (each an "at most"), down to a
    whole number of groups (a group launches whole, so the run finishes no more); None: no limit."""
    limits = [
        limit for limit in (config.stop.max_rollouts, config.orchestrator.max_rollouts) if limit is not None
    ]
    if not limits:
        return None
    group = config.orchestrator.group_size
    return min(limits) // group * group


def connect_run_ray(config: RunConfig, task_cpus: int = 0) -> None:
    """Connect to the Ray cluster of ``config`` (see ``rollout.ray_engine.connect_ray``); a
    local instance it starts has a CPU for each Ray actor of the rollout worker (an environment
    worker per engine replica, and the torch engines' actors) and ``task_cpus`` more, for the
    Ray tasks the caller runs beside them."""
    from rollout.ray_engine import connect_ray

    cpus = sum(options["num_cpus"] for options in rollout_actor_resources(config)) + task_cpus
    connect_ray(config.ray_address, config.ray_node_ip, num_cpus=cpus)


def rollout_actor_resources(config: RunConfig) -> list[dict[str, int]]:
    """What each Ray actor of a rollout worker of ``config`` asks for: its environment workers
    (:func:`env_workers`), then the torch engines' actors (the order of ``run_rollouts``'s
    ``placements``)."""
    from rollout.ray_engine import engine_actor_resources
    from rollout.ray_env import ENV_WORKER_RESOURCES

    engine = config.engine
    engines = [engine_actor_resources(engine.torch)] * engine.replicas if engine.kind == "torch" else []
    return [ENV_WORKER_RESOURCES] * env_workers(config) + engines


def env_workers(config: RunConfig) -> int:
    """How many Ray environment workers a rollout worker of ``config`` starts: one per engine
    replica, none when it serves only (``gateway_http.serve_only``): it runs no env, the
    harnesses outside the run run theirs."""
    return 0 if config.gateway_http.serve_only else config.engine.replica_count


def _build_worker(
    config: RunConfig,
    worker_name: str,
    flush_records: int,
    flush_seconds: float,
    on_shard: Callable[[ShardInfo], None] | None,
    before_commit: Callable[[], None],
    stop: threading.Event | None = None,
    placements: list[dict[str, Any]] | None = None,
) -> tuple[RolloutWorker, Any]:
    """The rollout worker of ``config`` and, on a Ray cluster, the env pool its environments
    run in, its actors started within ``engine.load_timeout_s`` (None locally; closed again
    when the worker cannot be built), each actor placed by its entry of ``placements`` (see
    :func:`run_rollouts`). Its orchestrator launches nothing once ``stop`` is set."""
    orchestrator = config.orchestrator.model_copy(update={"max_rollouts": max_rollouts(config)})
    env_pool = None
    workers = env_workers(config)
    env_placements = None if placements is None else placements[:workers]
    engine_placements = None if placements is None else placements[workers:]
    if config.cluster == "ray":
        from rollout.ray_env import RayEnvPool

        connect_run_ray(config)
        if workers:
            env_configs = {name: config.env_config(name) for name in orchestrator.mix}
            env_pool = RayEnvPool(env_configs, num_workers=workers, placements=env_placements)
            env_pool.wait_started(config.engine.load_timeout_s)
    try:
        worker = RolloutWorker(
            run_store(config),
            worker_name,
            engine=config.engine,
            gateway=config.gateway,
            service=config.mix_service(),
            orchestrator=orchestrator,
            env_configs={name: config.env_config(name) for name in orchestrator.mix},
            seed=config.seed,
            flush_records=flush_records,
            flush_seconds=flush_seconds,
            cluster=config.cluster,
            engine_placements=engine_placements,
            make_env=env_pool.make_env if env_pool is not None else None,
            on_shard=on_shard,
            router=router_config(config),
            before_commit=before_commit,
            stop_launching=stop.is_set if stop is not None else None,
            http=config.gateway_http,
            trained_reward=functools.partial(combine_reward, config=config.processor),
            max_staleness=config.sao.max_staleness,
        )
    except BaseException:
        if env_pool is not None:
            env_pool.close()
        raise
    return worker, env_pool


def rollout_detail(status: dict[str, Any]) -> str:
    """One line of a worker's status: served version, mean reward per task, rollouts per
    task that failed outside the policy (a sandbox, an engine: no reward), the groups dropped
    for uniform rewards (never written: the run's tables hold fewer rollouts than finished),
    the reward models loaded again after an eviction (a device budget that holds fewer than
    all: each reload waits for a copy), and why launching waits while it does. A worker serving
    the gateway's HTTP API (``gateway_http``) says where, how many records harnesses had it
    write (its own INFO log line with the URL does not reach the console) and how many new
    rollouts it refused them while it waited for the trainer; a serve-only one, which launches
    nothing, says it is paused while it would refuse one."""
    tasks = sorted(status["orchestrator"]["tasks"].items())
    rewards = ", ".join(
        f"{name} {counters['mean_reward']:.2f}"
        for name, counters in tasks
        if counters["mean_reward"] is not None
    )
    failures = {
        name: sum(counters["statuses"].get(failed, 0) for failed in EXCLUDED_STATUSES)
        for name, counters in tasks
    }
    failed = ", ".join(f"{name} {count}" for name, count in failures.items() if count)
    # a serve-only worker launches nothing of its own: its harnesses' new rollouts wait instead
    paused = status["orchestrator"]["paused"] or status.get("backpressure")
    dropped = status["orchestrator"]["groups_filtered"]
    groups = dropped + status["orchestrator"]["groups_kept"]
    return (
        f"serving v{status['version']}, backlog {status['backlog']} shard{'' if status['backlog'] == 1 else 's'}, "
        f"mean reward {rewards or '—'}"
        + (f", failed outside the policy: {failed}" if failed else "")
        + (f", {dropped} of {groups} groups dropped (every reward in them equal)" if dropped else "")
        + (
            f", reward models reloaded {reloads} time{'' if reloads == 1 else 's'} (their device budget holds fewer than all)"
            if (reloads := status["reward_reloads"])
            else ""
        )
        + (f", paused: {paused}" if paused else "")
        + (f", gateway at {url}" if (url := status.get("gateway_url")) else "")
        + (
            f", {written} record{'' if written == 1 else 's'} written by harnesses"
            if (written := status.get("harness_records"))
            else ""
        )
        + (
            f", {refused} new harness rollout{'' if refused == 1 else 's'} refused (429) while paused"
            if (refused := status.get("harness_sessions_refused"))
            else ""
        )
    )


@task(name="rollouts", **SIDE_EFFECTS, **STORAGE_RETRIES)
def rollouts(
    config: RunConfig,
    worker_name: str = "worker-0",
    signals: str | None = None,
    placements: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Generate rollouts into raw shards until the deadline, ``stop.max_seconds`` from when
    the worker is up (its start-up, a Ray cluster's actors and engines loading, left out);
    emits ``treadle.shard.committed`` per raw shard; returns the worker's counters. With
    ``signals`` (a key of :func:`tasks.common.send_signal`) it also stops at signal ``stop``,
    and raises its deadline as signal ``started`` for the tasks that share it. ``placements``
    places its Ray actors (see :func:`run_rollouts`)."""
    with module_logs_to_run():
        from tasks.report import ProgressReporter

        limit = max_rollouts(config)
        # against a limit the bar counts the run's rollouts, as the limit does: every worker's and
        # every earlier flow run's, finished or in flight (claimed and not given back)
        quota = None if limit is None else RunQuota(run_store(config), "rollouts", limit)
        progress = ProgressReporter(
            "Rollouts finished" if quota is None else "Rollouts of the run, done or in flight",
            total=limit,
        )

        def counted(finished: int) -> int:
            """The bar's count, given the rollouts this worker finished."""
            return finished if quota is None else quota.claimed()

        def detail(status: dict[str, Any]) -> str:
            """What the progress line says after the count, from the worker's status."""
            return f"this worker finished {status['orchestrator']['finished']}, {rollout_detail(status)}"

        def committed(info: ShardInfo) -> None:
            emit_event(
                event="treadle.shard.committed",
                resource=run_resource(config),
                payload={
                    "shard_id": info.shard_id,
                    "rows": info.num_rows,
                    "tokens": info.num_tokens,
                    "min_version": info.min_version,
                    "max_version": info.max_version,
                },
            )

        def deadline_from_start() -> float:
            store = run_store(config)
            # a retry keeps the deadline its first attempt gave the tasks that share it
            held = None if signals is None else read_signal(store, signals, "started")
            end = deadline_of(config) if held is None else float(held)
            progress.time_toward(end)
            if signals is not None and held is None:
                send_signal(store, signals, "started", content=repr(end))
            return end

        with watch_signal(run_store(config), signals, "stop") as stop:
            result = run_rollouts(
                config,
                deadline_from_start,
                worker_name,
                on_progress=lambda s: progress.update(
                    counted(s["orchestrator"]["finished"]), detail=detail(s)
                ),
                on_shard=committed,
                stop=stop,
                placements=placements,
            )
        # the quota's storage may fail for a moment: the rollouts are committed already
        last_report = reporting(
            lambda: progress.update(
                counted(result["orchestrator"]["finished"]), final=True, detail=detail(result)
            ),
            f"last progress report of worker {worker_name}",
        )
        last_report()
        return result
