"""How often the health check tries again to load the worker's version into a replica in
service that keeps failing to load it."""

from __future__ import annotations

import asyncio
import logging
import time

from flows.config import RunConfig
from rl.models import ensure_base_version, load_policy, publish_policy
from rollout.engines.base import EngineError
from rollout.router import RouterConfig
from storage.weights import WeightStore
from tests.rl.test_trainer import TINY
from tests.tasks.test_elastic_plan import make_worker, until

PROBE_S = 0.05
WATCH_S = 1.5
"""Seconds watched after the first failed reload: 30 probes, or 4 tries when each failure
doubles the wait (0.1, 0.2, 0.4, 0.8 s)."""


def test_a_replica_that_keeps_failing_to_load_is_retried_later_and_later_not_at_every_probe(
    local_store, caplog
):
    """``torch-1`` fails every load of version 1; the worker moves on with ``torch-0`` and the
    health check retries ``torch-1``. It retried at every probe, each try a load of the
    version's files and a warning, for as long as the replica kept failing; the waits now
    double up to ``LOAD_RETRY_MAX_S``, as the weight loop's do, and the version loads once the
    replica takes it."""
    weights = WeightStore(local_store)
    run = RunConfig(engine={"replicas": 2}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 2})
    ensure_base_version(weights, TINY)
    worker = make_worker(local_store, run, router=RouterConfig(health_check_s=PROBE_S), weight_poll_s=0.05)
    tries: list[float] = []
    failing = [True]

    async def body() -> None:
        await worker.start()
        replica = worker.engines[1]
        real_load = replica.load_version

        async def load_version(version, path):
            if version == 1:
                tries.append(time.monotonic())
                if failing[0]:
                    raise EngineError(f"{replica.name} failed to load version {version} (injected)")
            await real_load(version, path)

        replica.load_version = load_version
        run_task = asyncio.create_task(worker.run(max_seconds=600))
        try:
            model, tokenizer = load_policy(weights.load(0))
            publish_policy(weights, model, tokenizer, step=1)
            await until(lambda: len(tries) >= 2, "the health check to retry torch-1")
            await asyncio.sleep(WATCH_S)
            failing[0] = False
            await until(lambda: replica.version == 1, "torch-1 to load version 1 once it can")
        finally:
            worker.stop()
            await run_task
            await worker.close()

    with caplog.at_level(logging.WARNING, logger="rollout.worker"):
        asyncio.run(body())
    retried = [t for t in tries if t - tries[1] <= WATCH_S]
    assert len(retried) <= 5, f"{len(retried)} tries in {WATCH_S} s, probes every {PROBE_S} s"
    warned = [r for r in caplog.records if "torch-1 failed to load weight version 1" in r.getMessage()]
    assert len(warned) <= 6
    assert "tried again in" in warned[-1].getMessage()
