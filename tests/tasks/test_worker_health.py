"""A rollout worker probes its replicas: a dead one leaves service before a request finds it,
one that recovers comes back on the worker's weight version."""

from __future__ import annotations

import asyncio

from flows.config import RunConfig
from rl.models import ensure_base_version, load_policy, publish_policy
from rollout.router import RouterConfig
from storage.weights import WeightStore
from tests.rl.test_trainer import TINY
from tests.tasks.test_elastic_plan import make_worker, until


def test_probes_take_a_dead_replica_out_and_bring_it_back_on_the_current_version(local_store):
    run = RunConfig(engine={"replicas": 2}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 2})
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    worker = make_worker(local_store, run, router=RouterConfig(health_check_s=0.05))
    healthy = {"torch-1": True}

    async def body() -> None:
        await worker.start()
        sick = worker.engines[1]
        real_health = sick.health

        async def health() -> bool:
            return healthy["torch-1"] and await real_health()

        sick.health = health
        run_task = asyncio.create_task(worker.run(max_seconds=600))
        try:
            healthy["torch-1"] = False
            await until(lambda: worker.router.replicas == ["torch-0"], "the sick replica to leave service")
            model, tokenizer = load_policy(weights.load(0))
            publish_policy(weights, model, tokenizer, step=1)  # loaded while torch-1 is down
            await until(lambda: worker.version == 1, "the worker to load version 1")
            assert (worker.engines[0].version, sick.version) == (1, 0)
            healthy["torch-1"] = True
            await until(lambda: "torch-1" in worker.router.replicas, "the replica to come back")
            await until(lambda: sick.version == 1, "the replica that came back to load version 1")
        finally:
            worker.stop()
            await run_task
            await worker.close()

    asyncio.run(body())
