"""The train task: the continuous SAO trainer until the deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.events import emit_event

from flows.config import RunConfig
from rl.trainer import Trainer
from storage.weights import WeightStore
from tasks.common import SIDE_EFFECTS, run_store


def run_trainer(
    config: RunConfig,
    deadline: float,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_publish: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
    drain: bool = False,
) -> dict[str, Any]:
    """Train on processed shards until ``deadline`` (epoch seconds), ``stop`` or
    ``stop.max_policy_steps`` — or, with ``drain``, until no processed shard is waiting;
    the steps since the last version are published at the end."""
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
    try:
        summary = trainer.run(
            max_seconds=max(deadline - time.time(), 0.0),
            max_steps=config.stop.max_policy_steps,
            stop_event=stop,
            progress=progress,
            drain=drain,
        )
    finally:
        trainer.close()
    check_published()
    return {"steps": summary.steps, "versions": summary.versions, "stop_reason": summary.stop_reason}


@task(name="train", **SIDE_EFFECTS)
def train(config: RunConfig, deadline: float, drain: bool = False) -> dict[str, Any]:
    """Run the trainer until the deadline (or until drained); emits an event per published
    weight version."""
    from tasks.report import ProgressReporter

    progress = ProgressReporter("Policy steps", total=config.stop.max_policy_steps)

    def published(version: int) -> None:
        emit_event(
            event="treadle.weights.published",
            resource={"prefect.resource.id": f"treadle.run.{config.run_id}", "treadle.run_id": config.run_id},
            payload={"version": version, "path": WeightStore(run_store(config)).version_url(version)},
        )

    result = run_trainer(
        config,
        deadline,
        on_step=lambda row: progress.update(row["step"]),
        on_publish=published,
        drain=drain,
    )
    progress.update(result["steps"], final=True)
    return result
