"""The rollout task: one worker's engines and orchestrator, running until the deadline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect import task

from flows.config import RunConfig
from rollout.worker import RolloutWorker
from tasks.common import SIDE_EFFECTS, run_store


def run_rollouts(
    config: RunConfig,
    deadline: float,
    worker_name: str = "worker-0",
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    progress_every_s: float = 5.0,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Run rollouts until ``deadline`` (epoch seconds), ``stop`` or ``stop.max_rollouts``."""
    orchestrator = config.orchestrator
    if config.stop.max_rollouts is not None:
        orchestrator = orchestrator.model_copy(update={"max_rollouts": config.stop.max_rollouts})
    worker = RolloutWorker(
        run_store(config),
        worker_name,
        engine=config.engine,
        gateway=config.gateway,
        service=config.service,
        orchestrator=orchestrator,
        env_configs={name: config.env_config(name) for name in orchestrator.mix},
        seed=config.seed,
    )

    async def report() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            if stop is not None and stop.is_set():
                worker.stop()
            if on_progress is not None:
                await asyncio.to_thread(on_progress, worker.status())

    async def main() -> dict[str, Any]:
        await worker.start()
        reporter = asyncio.create_task(report())
        try:
            stats = await worker.run(max_seconds=max(deadline - time.time(), 0.001))
        finally:
            reporter.cancel()
            await worker.close()
        return {
            **worker.status(),
            "orchestrator": stats.as_dict(),
            "version_loads": len(worker.version_loads),
        }

    return asyncio.run(main())


@task(name="rollouts", **SIDE_EFFECTS)
def rollouts(config: RunConfig, deadline: float, worker_name: str = "worker-0") -> dict[str, Any]:
    """Generate rollouts into raw shards until the deadline; returns the worker's counters."""
    from tasks.report import ProgressReporter

    progress = ProgressReporter("Rollouts finished", total=config.stop.max_rollouts)
    result = run_rollouts(
        config, deadline, worker_name, on_progress=lambda s: progress.update(s["orchestrator"]["finished"])
    )
    progress.update(result["orchestrator"]["finished"], final=True)
    return result
