"""The train task: the continuous SAO trainer until the deadline."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.events import emit_event

from flows.config import RunConfig
from rl.trainer import Trainer
from rollout.elastic import ElasticController, ElasticLog, PolicyInputs
from storage.status import DEFAULT_MAX_AGE_S, RolloutStatusBoard, RolloutSummary
from storage.weights import WeightStore
from tasks.common import SIDE_EFFECTS, STORAGE_RETRIES, run_store

log = logging.getLogger(__name__)

STATUS_REFRESH_S = 1.0
"""Seconds between reads of the rollout workers' status objects while training."""


def run_trainer(
    config: RunConfig,
    deadline: float,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_publish: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
    drain: bool = False,
    engine_queue_depth: Callable[[], int] | None = None,
    elastic: ElasticLog | None = None,
    status_max_age_s: float = DEFAULT_MAX_AGE_S,
) -> dict[str, Any]:
    """Train on processed shards until ``deadline`` (epoch seconds), ``stop`` or
    ``stop.max_policy_steps`` — or, with ``drain``, until no processed shard is waiting;
    the steps since the last version are published at the end.

    Every ``train_steps`` row carries the elastic controller's inputs (unconsumed shards,
    engine queue depth and the trainer's idle fraction since the last step) and its
    decision in ``extra``. The queue depth comes from ``engine_queue_depth`` when the
    caller can reach the engines, else from the rollout workers' status objects in the
    run's storage (``storage.status``, read at most every ``STATUS_REFRESH_S``): the sum over workers whose status is at most
    ``status_max_age_s`` old, with the count of fresh, stopped, stale and corrupt ones in
    ``extra["rollout_status"]``.
    ``elastic`` defaults to an advisory controller over one rollout and one training unit:
    it logs, and moves nothing."""
    store = run_store(config)
    weights = WeightStore(store)
    seen = {"version": weights.latest()}

    def check_published() -> None:
        # every version since the last check: two may land between checks (a step's and
        # the one published on stop)
        latest = weights.latest()
        if latest == seen["version"]:
            return
        before = -1 if seen["version"] is None else seen["version"]
        seen["version"] = latest
        if on_publish is not None:
            for version in weights.list():
                if before < version <= latest:
                    on_publish(version)

    def progress(row: dict[str, Any]) -> None:
        check_published()
        if on_step is not None:
            on_step(row)

    trainer = Trainer(store, config.sao, device=config.trainer_device)
    elastic = elastic or ElasticLog(ElasticController.create(["rollout0"], ["train0"]))
    last = {"wall": time.monotonic(), "idle": 0.0}
    rollout_status = RolloutStatusBoard(store)
    status_cache: dict[str, Any] = {"read_at": -math.inf, "summary": None}

    def rollout_summary() -> RolloutSummary | None:
        # workers publish every few seconds; reading every step would put a listing and a
        # GET per worker on the trainer's hot path (S3)
        if time.monotonic() - status_cache["read_at"] < STATUS_REFRESH_S:
            return status_cache["summary"]
        try:
            summary = rollout_status.summary(max_age_s=status_max_age_s)
        except Exception as exc:  # storage unreachable for a moment: log the step without it
            log.warning("could not read the rollout workers' status: %s", exc)
            summary = None
        status_cache.update(read_at=time.monotonic(), summary=summary)
        return summary

    def elastic_record() -> dict[str, Any]:
        now = time.monotonic()
        idle = (trainer.idle_seconds - last["idle"]) / max(now - last["wall"], 1e-9)
        last.update(wall=now, idle=trainer.idle_seconds)
        extra: dict[str, Any] = {}
        if engine_queue_depth is not None:
            depth = engine_queue_depth()
        else:
            summary = rollout_summary()
            depth = summary.engine_queue_depth if summary is not None else 0
            extra["rollout_status"] = summary.as_dict() if summary is not None else None
        inputs = PolicyInputs(
            unconsumed_shards=trainer.unconsumed_shards(),
            engine_queue_depth=depth,
            trainer_idle=round(min(max(idle, 0.0), 1.0), 4),
        )
        return {**elastic.record(inputs, time.time()), **extra}

    try:
        summary = trainer.run(
            max_seconds=max(deadline - time.time(), 0.0),
            max_steps=config.stop.max_policy_steps,
            stop_event=stop,
            progress=progress,
            drain=drain,
            step_extra=elastic_record,
        )
    finally:
        trainer.close()
    check_published()
    return {"steps": summary.steps, "versions": summary.versions, "stop_reason": summary.stop_reason}


@task(name="train", **SIDE_EFFECTS, **STORAGE_RETRIES)
def train(config: RunConfig, deadline: float, drain: bool = False) -> dict[str, Any]:
    """Run the trainer until the deadline (or until drained); emits an event per published
    weight version."""
    from tasks.report import ProgressReporter

    progress = ProgressReporter("Policy steps", total=config.stop.max_policy_steps, deadline=deadline)

    def published(version: int) -> None:
        emit_event(
            event="treadle.weights.published",
            resource={"prefect.resource.id": f"treadle.run.{config.run_id}", "treadle.run_id": config.run_id},
            payload={"version": version, "path": WeightStore(run_store(config)).version_url(version)},
        )

    result = run_trainer(
        config,
        deadline,
        on_step=lambda row: progress.update(
            row["step"],
            detail=f"version {row['version']}, reward {row['reward_mean']:.2f}, "
            f"masked {row['masked_fraction']:.3f}, staleness {row['staleness_mean']:.1f}",
        ),
        on_publish=published,
        drain=drain,
    )
    progress.update(result["steps"], final=True)
    return result
