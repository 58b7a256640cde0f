"""The train task: the continuous SAO trainer until the deadline."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prefect import task

from flows.config import RunConfig
from flows.run_logs import module_logs_to_run
from rl.trainer import Trainer
from rollout.elastic import PolicyInputs
from rollout.elastic_plan import ElasticPlanner
from storage.heartbeat import Heartbeat
from storage.status import (
    DEFAULT_MAX_AGE_S,
    ElasticPlan,
    ElasticPlanBoard,
    HeldRole,
    InUse,
    RolloutStatus,
    RolloutStatusBoard,
    RolloutSummary,
    TrainerStatus,
    TrainerStatusBoard,
    fresh_statuses,
    summarize,
    wait_until_free,
)
from storage.weights import WeightStore
from tasks.common import (
    SIDE_EFFECTS,
    STORAGE_RETRIES,
    announce_version,
    deadline_once_started,
    reporting,
    run_store,
    said,
    watch_signal,
)

log = logging.getLogger(__name__)

STATUS_REFRESH_S = 1.0
"""Seconds between reads of the rollout workers' status objects while training, and between
elastic decisions while the trainer takes no step."""
PLAN_REFRESH_S = 5.0
"""Seconds after which an unchanged elastic plan is published again (workers ignore stale plans)."""
TRAIN_COST_STEPS = 20
"""Policy steps over which the controller's training cost per trajectory is measured."""
DECISION_FIELDS = (
    "time",
    "applied",
    "inputs",
    "rollout_rate",
    "forecast_completions",
    "training_demand",
    "decided",
)
"""What ``extra["elastic"]["decisions"]`` keeps of each decision (roles and live sessions
are the step's own record's)."""
TRAINER_STATUS_S = 0.25
"""Seconds between looks at the trainer's queue (how much data waits for it, the rollout
workers' backpressure); it is published when it changed, and every ``PLAN_REFRESH_S``."""

TRAINER_LOADING_BEAT_S = 5.0
"""Seconds between renewals of the trainer's status while it loads its models (a status
counts for ``DEFAULT_MAX_AGE_S``)."""


def keep_decision(decisions: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    """Append ``entry`` to ``decisions``, a run of decisions that moved nothing kept as its
    latest with ``count`` saying how many it stands for (the ticker decides every second:
    an hour's wait for data would otherwise put 3,600 records in one row)."""
    entry["count"] = 1
    if not entry.get("decided") and decisions and not decisions[-1].get("decided"):
        entry["count"] += decisions.pop()["count"]
    decisions.append(entry)


def run_trainer(
    config: RunConfig,
    deadline: float | Callable[[], float],
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_publish: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
    drain: bool = False,
    drain_event: threading.Event | None = None,
    engine_queue_depth: Callable[[], int] | None = None,
    elastic: ElasticPlanner | None = None,
    status_max_age_s: float = DEFAULT_MAX_AGE_S,
) -> dict[str, Any]:
    """Train on processed shards until ``deadline`` (epoch seconds, or a function called for
    them once the trainer is loaded, its status kept fresh while it waits), ``stop`` or
    ``stop.max_policy_steps`` — or, with ``drain`` (or once ``drain_event`` is set), until
    no processed shard is waiting; the steps since the last version are published at the end.
    Returns the policy step counter at the stop (``steps``: the run's, the steps of the version
    it resumed from included), the steps this call took (``new_steps``), the versions it
    published and why it stopped.

    Elastic capacity: an :class:`ElasticPlanner` (default: ``config.elastic_settings()``)
    decides over the rollout workers' engine replicas, named from the status objects they
    publish in the run's storage (``storage.status``, read at most every
    ``STATUS_REFRESH_S``; workers whose status is older than ``status_max_age_s`` leave),
    on every step and (unless ``engine_queue_depth`` is given) every ``STATUS_REFRESH_S``
    while no step is taken, and publishes its
    plan to ``status/elastic/plan.json`` when it changes (and every ``PLAN_REFRESH_S``);
    the workers drain and undrain their replicas by it. On the way out every replica is
    released to rollout. With one replica per worker nothing is ever drained. The controller
    balances the workers' rollout rate (from the counts of finished rollouts they publish)
    against the trainer's measured cost per trajectory, and forecasts session ends from the
    ages and lengths of sessions they publish.

    Backpressure: every ``TRAINER_STATUS_S`` the trainer publishes how many tokens wait in
    its buffer and the newest shard it has read from each worker (``status/train/trainer.json``)
    when that changed; the workers' orchestrators pause launching while the tokens exceed
    ``orchestrator.max_trainer_batches`` token budgets, and tell from the shards whether
    their data has reached the trainer (``rollout.worker``).

    Every ``train_steps`` row carries, in ``extra["elastic"]``, the step's decision: the
    controller's inputs (unconsumed shards and trajectories, engine queue depth, the
    trainer's idle fraction since the last decision, the time of a wait for data in
    progress included, and what a trajectory costs to train: step seconds times the
    trainer's own units, per trajectory, over the last ``TRAIN_COST_STEPS`` steps), the
    units' roles, its recent moves, the moves it decided and whether its plan was published
    (``applied``; not: the workers follow the last plan until a decision publishes); and in
    ``decisions`` every decision since the previous row (the step's own last), each with its
    time, ``applied``, inputs and the moves it decided, so no move goes unlogged (those after the last row go to the
    log); consecutive decisions that moved nothing are kept as the latest, with their
    ``count``. The queue depth comes from ``engine_queue_depth`` when the caller can reach the
    engines, else from the fresh workers' statuses, whose counts (fresh, stopped, stale,
    corrupt) are in ``extra["rollout_status"]``. When the statuses cannot be read there is
    no decision: the last plan stands, and the record says ``skipped`` and why.

    One trainer per run: while another trainer's status is updated, this one raises
    :class:`~storage.status.InUse` instead of training the same shards; the fresh status a
    killed trainer left is waited out (``storage.status.wait_until_free``). Each status is
    published after reading the current one back (``storage.status.HeldRole``): a trainer
    that finds another's fresh status there (both started at once, or its own went unrenewed
    for ``DEFAULT_MAX_AGE_S`` and another took the run) stops without publishing a weight
    version, a status or a plan, and raises :class:`~storage.status.InUse`."""
    store = run_store(config)
    queue_board = TrainerStatusBoard(store)
    wait_until_free(
        queue_board.read,
        f"the trainer of run {config.run_id!r}",
        "a run has one trainer: stop the other first",
    )
    role = HeldRole(queue_board.read, queue_board.publish, f"the trainer of run {config.run_id!r}")
    weights = WeightStore(store)
    seen: dict[str, int] = {}  # "version": the newest checked, set once the trainer is built

    def announce(before: int, latest: int) -> None:
        for version in weights.list():
            if before < version <= latest and version not in trainer.passed_over:
                on_publish(version)

    announce_versions = (
        reporting(announce, "announcement of published weight versions") if on_publish is not None else None
    )

    def check_published() -> None:
        """Announce every version since the last check up to this trainer's own, never one
        published by a trainer that took the run, nor one this trainer resumed below as it
        did not verify."""
        latest = trainer.version
        if latest == seen["version"]:
            return
        before = seen["version"]
        seen["version"] = latest
        if announce_versions is not None:
            announce_versions(before, latest)

    def trainer_status(
        tokens: int, running: bool, newest_read: dict[str, int] | None = None
    ) -> TrainerStatus:
        return TrainerStatus(
            time=time.time(),
            buffered_tokens=tokens,
            token_budget=config.sao.token_budget,
            running=running,
            newest_read=newest_read or {},
        )

    # the role is this trainer's from here: one started while this one loads is refused, and
    # a heartbeat keeps the status fresh through a load longer than a status counts
    role.claim(trainer_status(0, running=True))
    loading = Heartbeat(
        lambda: role.publish(trainer_status(0, running=True)),
        TRAINER_LOADING_BEAT_S,
        "trainer status heartbeat while it loads",
    )
    try:
        trainer = Trainer(
            store, config.sao, device=config.trainer_device, temperature=config.service.temperature
        )
        end = deadline() if callable(deadline) else deadline
    except BaseException:
        loading.stop()
        try:
            role.publish(trainer_status(0, running=False))
        except Exception as exc:  # its status goes stale instead; what stopped the load is the error
            log.warning("could not mark the trainer of run %s stopped: %s", config.run_id, exc)
        raise
    loading.stop()
    if role.lost.is_set():
        raise InUse(f"{role.taken}; it stopped while it loaded")
    # the version resumed from is announced by whoever wrote its row: the trainer, when its
    # publisher failed before (an attempt of this task). Each is announced at once: a retry
    # resumes from it with its row written, and would never announce it
    seen["version"] = trainer.version - 1 if trainer.recorded_resumed else trainer.version
    check_published()
    elastic = elastic or ElasticPlanner(config.elastic_settings())
    # (unit-seconds, trajectories) of the last steps: what a trajectory costs to train
    step_costs: deque[tuple[float, int]] = deque(maxlen=TRAIN_COST_STEPS)
    deciding = threading.Lock()  # the ticker thread decides while the trainer thread steps

    report_step = reporting(on_step, "progress report of the trainer")

    def progress(row: dict[str, Any]) -> None:
        # the trainer runs on its own units only: a replica lent to training does not
        # shorten its steps, so counting it would raise the cost with every replica lent,
        # lower the balanced rollout share and lend more
        step_costs.append((row["step_seconds"] * len(elastic.trainer_units), row["num_samples"]))
        if report_step is not None:
            report_step(row)

    def train_unit_s_per_trajectory() -> float | None:
        costs = tuple(step_costs)
        trajectories = sum(n for _, n in costs)
        return sum(s for s, _ in costs) / trajectories if trajectories else None

    last = {"wall": time.monotonic(), "idle": 0.0, "decided": time.monotonic()}
    rollout_status = RolloutStatusBoard(store)
    plans = ElasticPlanBoard(store)
    published: dict[str, Any] = {"plan": None, "at": -math.inf}
    status_cache: dict[str, Any] = {"read_at": -math.inf, "read": None, "error": None}
    decisions: list[dict[str, Any]] = []  # every decision since the last train_steps row

    def rollout_statuses() -> tuple[RolloutSummary, list[RolloutStatus]] | None:
        """The workers' summary and fresh statuses; ``None`` when they could not be read
        (``status_cache["error"]`` says why)."""
        # workers publish every few seconds; reading every step would put a listing and a
        # GET per worker on the trainer's hot path (S3)
        if time.monotonic() - status_cache["read_at"] >= STATUS_REFRESH_S:
            try:
                statuses, corrupt = rollout_status.read()
                now = time.time()
                read = (
                    summarize(statuses, corrupt, now, status_max_age_s),
                    fresh_statuses(statuses, now, status_max_age_s),
                )
                error = None
            except Exception as exc:  # storage unreachable for a moment: the next read retries
                error = f"could not read the rollout workers' status: {said(exc)}"
                log.warning("%s; no elastic decision", error)
                read = None
            status_cache.update(read_at=time.monotonic(), read=read, error=error)
        return status_cache["read"]

    def publish(plan: ElasticPlan) -> bool:
        """Publish ``plan`` unless the one published lately says the same; whether the
        workers can read it (False: they keep following the last plan)."""
        if role.lost.is_set():  # the plan is the new trainer's
            return False
        roles = (plan.accepting, plan.draining, plan.train, plan.running)
        if roles == published["plan"] and time.monotonic() - published["at"] < PLAN_REFRESH_S:
            return True
        try:
            plans.publish(plan)
        except Exception as exc:  # the next decision publishes again; workers keep the last plan
            log.warning("could not publish the elastic plan: %s", said(exc))
            return False
        published.update(plan=roles, at=time.monotonic())
        return True

    def decide() -> dict[str, Any]:
        """One elastic decision (the caller holds ``deciding``), kept in ``decisions``; its record.

        Unread statuses skip it and the last plan stands: deciding with no worker seen would
        drop every replica from the plan (back to rollout, those lent to training too), and
        an unmeasured queue depth is not 0.
        """
        read = rollout_statuses()
        last["decided"] = time.monotonic()
        if read is None:
            skipped = {"time": time.time(), "applied": False, "skipped": status_cache["error"]}
            keep_decision(decisions, dict(skipped))
            extra = {} if engine_queue_depth is not None else {"rollout_status": None}
            return {"elastic": skipped, **extra}
        summary, fresh = read
        now = time.monotonic()
        idle_total = trainer.idle_seconds_at(now)
        idle = (idle_total - last["idle"]) / max(now - last["wall"], 1e-9)
        last.update(wall=now, idle=idle_total)
        extra: dict[str, Any] = {}
        if engine_queue_depth is not None:
            depth = engine_queue_depth()
        else:
            depth = summary.engine_queue_depth
            extra["rollout_status"] = summary.as_dict()
        inputs = PolicyInputs(
            unconsumed_shards=trainer.unconsumed_shards(),
            engine_queue_depth=depth,
            trainer_idle=round(min(max(idle, 0.0), 1.0), 4),
            train_unit_s_per_trajectory=train_unit_s_per_trajectory(),
            unconsumed_trajectories=trainer.queued_samples(),
        )
        record = elastic.decide(fresh, inputs, time.time())
        record["elastic"]["applied"] = publish(elastic.last_plan)
        keep_decision(decisions, {key: record["elastic"][key] for key in DECISION_FIELDS})
        return {**record, **extra}

    def step_extra() -> dict[str, Any]:
        """The step's decision, with every decision since the last row in ``decisions``."""
        with deciding:
            record = decide()
            record["elastic"]["decisions"] = decisions.copy()
            decisions.clear()
            return record

    stop_ticking = threading.Event()

    def tick() -> None:
        # decide while no step is taken (the trainer waits for data, or a step is long), so
        # drains are cancelled and units returned when the trainer's queue runs dry
        while not stop_ticking.wait(STATUS_REFRESH_S):
            if time.monotonic() - last["decided"] >= STATUS_REFRESH_S:
                try:
                    with deciding:
                        decide()
                except Exception as exc:  # the next step or tick decides again
                    log.warning("elastic decision failed: %s", exc)

    ticker = threading.Thread(target=tick, name="elastic-ticker", daemon=True)
    if engine_queue_depth is None:  # a caller's depth callable is read once per step, no more
        ticker.start()
    reported: dict[str, Any] = {"tokens": None, "newest_read": None, "at": -math.inf}

    def publish_queue(running: bool) -> None:
        # read before the tokens: the trainer marks a shard read after buffering its rows
        newest_read = trainer.newest_read
        tokens = trainer.queued_tokens()
        unchanged = (tokens, newest_read) == (reported["tokens"], reported["newest_read"])
        if running and unchanged and time.monotonic() - reported["at"] < PLAN_REFRESH_S:
            return  # on S3 every status is a PUT
        try:
            if not role.publish(trainer_status(tokens, running, newest_read)):
                return
        except Exception as exc:  # the next one replaces it; a stale status holds no rollout back
            log.warning("could not publish the trainer's status: %s", said(exc))
            return
        reported.update(tokens=tokens, newest_read=newest_read, at=time.monotonic())

    def report_queue() -> None:
        # on its own clock, not per step: when samples are dropped as stale or a step is
        # long, the workers must still see the queue shrink
        while not stop_ticking.wait(TRAINER_STATUS_S):
            publish_queue(running=True)

    reporter = threading.Thread(target=report_queue, name="trainer-status", daemon=True)
    reporter.start()
    resumed_at = trainer.step
    try:
        summary = trainer.run(
            max_seconds=max(end - time.time(), 0.0),
            max_steps=config.stop.max_policy_steps,
            stop_event=stop,
            progress=progress,
            drain=drain,
            drain_event=drain_event,
            step_extra=step_extra,
            role=role,
            on_publish=lambda _version: check_published(),
        )
    finally:
        stop_ticking.set()
        for thread in (ticker, reporter):
            if thread.is_alive():
                thread.join()
        publish_queue(running=False)
        with deciding:
            unlogged = [move for decision in decisions for move in decision.get("decided", [])]
            if unlogged:
                log.info("elastic moves after the last train_steps row: %s", unlogged)
            published["at"] = -math.inf
            publish(elastic.release(time.time()))
    if summary.stop_reason == "abandoned":
        raise InUse(
            f"{role.taken}; it stopped at policy step {summary.steps}, and what it trained since its "
            "last version is left to the other"
        )
    return {
        "steps": summary.steps,
        "new_steps": summary.steps - resumed_at,
        "versions": summary.versions,
        "stop_reason": summary.stop_reason,
    }


@task(name="train", **SIDE_EFFECTS, **STORAGE_RETRIES)
def train(
    config: RunConfig, deadline: float | None = None, drain: bool = False, signals: str | None = None
) -> dict[str, Any]:
    """Run the trainer until the deadline (or until drained); emits an event per published
    weight version. With ``signals`` (a key of :func:`tasks.common.send_signal`) it also
    stops at signal ``stop`` and drains from signal ``processed``. Without ``deadline`` it is
    the one the rollouts task sharing ``signals`` raises in signal ``started`` once its worker
    is up: the trainer loads meanwhile, and trains nothing when ``stop`` or ``processed``
    comes first."""
    with module_logs_to_run():
        from tasks.report import ProgressReporter

        if deadline is None and signals is None:
            raise ValueError(
                "the train task needs a deadline, or the signals key of a rollouts task that raises it"
            )
        progress = ProgressReporter("Policy steps", total=config.stop.max_policy_steps, deadline=deadline)

        store = run_store(config)
        with (
            watch_signal(store, signals, "stop") as stop,
            watch_signal(store, signals, "processed") as processed,
        ):

            def deadline_from_start() -> float:
                started = deadline_once_started(store, signals, stop, processed)
                end = time.time() if started is None else started
                progress.time_toward(end)
                return end

            result = run_trainer(
                config,
                deadline_from_start if deadline is None else deadline,
                on_step=lambda row: progress.update(
                    row["step"],
                    detail=f"version {row['version']}, reward {row['reward_mean']:.2f}, "
                    f"masked {row['masked_fraction']:.3f}, staleness {row['staleness_mean']:.1f}",
                ),
                on_publish=lambda version: announce_version(config, version),
                stop=stop,
                drain=drain,
                drain_event=processed,
            )
        progress.update(result["steps"], final=True)
        return result
