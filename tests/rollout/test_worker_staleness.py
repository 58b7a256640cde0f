"""A replica that keeps failing to load new weight versions serves its old one only while the
trainer would still train on its tokens (``max_staleness``): past that it leaves service, and
the health check brings it back once it has loaded a version within the limit."""

from __future__ import annotations

import asyncio
import logging

import pytest

from flows.config import RunConfig
from rl.models import ensure_base_version, load_policy, publish_policy
from rollout.engines.base import EngineError
from rollout.router import RouterConfig
from storage.weights import WeightStore
from tests.rl.test_trainer import TINY
from tests.tasks.test_elastic_plan import make_worker, until


def refuse_new_versions(engine, refusing: dict[str, bool], tried: list[int]) -> None:
    """Make ``engine`` fail every load of a version past 0 while ``refusing[engine.name]``,
    recording each version it is asked to load."""
    real_load = engine.load_version

    async def load_version(version, path):
        tried.append(version)
        if version > 0 and refusing[engine.name]:
            raise EngineError(f"{engine.name} cannot load version {version} (injected)")
        await real_load(version, path)

    engine.load_version = load_version


def taken_out(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "out of service" in r.getMessage()]


def dropped(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "the trainer drops every token" in r.getMessage()]


@pytest.mark.parametrize(
    ("max_staleness", "health_check_s", "in_service", "warnings"),
    [(None, 10.0, ["torch-0"], 0), (1, 10.0, [], 1), (1, None, ["torch-0"], 2)],
)
def test_a_replica_too_stale_for_the_trainer_leaves_service_unless_nothing_would_bring_it_back(
    local_store, caplog, max_staleness, health_check_s, in_service, warnings
):
    """The only replica fails to load versions 1 to 3: it served version 0 for ever, though
    the trainer, past ``max_staleness``, drops every token of it. With the trainer's limit it
    is out once two versions are newer than its own (not at one); without one it stays. With
    no health check nothing would bring it back: it stays, warned of once per newer version
    (the weight loop's next load that succeeds brings it up to date)."""
    run = RunConfig(engine={"replicas": 1}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 1})
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    router = RouterConfig(health_check_s=health_check_s)
    worker = make_worker(local_store, run, router=router, max_staleness=max_staleness)
    model, tokenizer = load_policy(weights.load(0))

    async def body() -> list[list[str]]:
        await worker.start()
        refuse_new_versions(worker.engines[0], {"torch-0": True}, [])
        replicas = []
        try:
            for step in (1, 2, 3):
                publish_policy(weights, model, tokenizer, step=step)
                with pytest.raises(EngineError, match="cannot load"):
                    await worker.sync_weights()
                assert not await worker.sync_weights()  # at once: the newest version's retry waits
                replicas.append(worker.router.replicas)
        finally:
            await worker.close()
        return replicas

    with caplog.at_level(logging.WARNING, logger="rollout.worker"):
        assert asyncio.run(body()) == [["torch-0"], in_service, in_service]
    assert worker.version == 0 and len(dropped(caplog)) == warnings


def test_a_replica_left_behind_by_its_failed_loads_leaves_service_and_comes_back_once_one_loads(
    local_store, caplog
):
    """``torch-1`` fails every load past version 0 while ``torch-0`` loads them. One version
    behind (``max_staleness=1``) it keeps serving while the health check retries; two behind
    it is taken out, saying so; once a load succeeds the health check puts it back on the
    worker's version."""
    weights = WeightStore(local_store)
    run = RunConfig(engine={"replicas": 2}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 2})
    ensure_base_version(weights, TINY)
    router = RouterConfig(health_check_s=0.05)
    worker = make_worker(local_store, run, router=router, weight_poll_s=0.05, max_staleness=1)
    refusing = {"torch-0": False, "torch-1": True}
    tried: list[int] = []
    model, tokenizer = load_policy(weights.load(0))

    async def body() -> None:
        await worker.start()
        behind = worker.engines[1]
        refuse_new_versions(behind, refusing, tried)
        run_task = asyncio.create_task(worker.run(max_seconds=600))
        try:
            publish_policy(weights, model, tokenizer, step=1)
            await until(lambda: tried.count(1) >= 3, "the health check to retry version 1 on torch-1")
            assert worker.version == 1 and behind.version == 0
            assert worker.router.replicas == ["torch-0", "torch-1"] and taken_out(caplog) == []
            publish_policy(weights, model, tokenizer, step=2)
            await until(lambda: worker.router.replicas == ["torch-0"], "torch-1 to leave service")
            refusing["torch-1"] = False
            await until(lambda: "torch-1" in worker.router.replicas, "torch-1 to come back")
            assert behind.version == worker.version == 2
        finally:
            worker.stop()
            await run_task
            await worker.close()

    with caplog.at_level(logging.WARNING, logger="rollout.worker"):
        asyncio.run(body())
    [message] = taken_out(caplog)
    assert "replica torch-1" in message and "version 0" in message
    assert "max_staleness=1" in message and "newest published, 2" in message


def test_a_worker_whose_only_replica_is_too_stale_waits_for_it_to_load_a_version(local_store, caplog):
    """The only replica fails to load versions 1 and 2: it leaves service, nothing launches
    and the health check does not put it back on the stale version it still holds (the worker
    does not fail either); once it loads version 2 it is back and rollouts run again."""
    weights = WeightStore(local_store)
    run = RunConfig(engine={"replicas": 1}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 2})
    ensure_base_version(weights, TINY)
    router = RouterConfig(health_check_s=0.05)
    worker = make_worker(local_store, run, router=router, weight_poll_s=0.02, max_staleness=1)
    refusing = {"torch-0": True}
    model, tokenizer = load_policy(weights.load(0))

    async def body() -> None:
        await worker.start()
        refuse_new_versions(worker.engines[0], refusing, [])
        run_task = asyncio.create_task(worker.run(max_seconds=600))
        stats = worker.orchestrator.stats
        try:
            await until(lambda: stats.finished >= 2, "rollouts on version 0")
            publish_policy(weights, model, tokenizer, step=1)
            publish_policy(weights, model, tokenizer, step=2)
            await until(lambda: worker.router.replicas == [], "the stale replica to leave service")
            await asyncio.sleep(0.2)  # the rollouts in flight when it left end
            launched = stats.tasks["arith"].started
            await asyncio.sleep(0.5)  # ten health checks
            assert worker.router.replicas == [] and stats.tasks["arith"].started == launched
            assert not run_task.done()
            refusing["torch-0"] = False
            await until(lambda: worker.router.replicas == ["torch-0"], "the replica to come back")
            assert worker.version == worker.engines[0].version == 2
            await until(lambda: stats.tasks["arith"].started > launched, "rollouts to launch again")
        finally:
            worker.stop()
            await run_task
            await worker.close()

    with caplog.at_level(logging.WARNING, logger="rollout"):
        asyncio.run(body())
    assert worker.orchestrator.stats.tasks["arith"].statuses["infra_error"] <= 2
    assert any("replica torch-0 is healthy again but could not be restored" in m for m in caplog.messages)


def test_staleness_counts_the_versions_on_the_newest_ones_chain_as_the_trainer_does(local_store):
    """Version 3 is trained from version 1 (number 2 was claimed by a publish killed before
    its manifest): the trainer counts one version newer than 1 on its chain and trains on
    its tokens, so a replica left on version 1 keeps serving; by the difference of the
    numbers it was out. Once version 4 follows, it is two behind and leaves service."""
    weights = WeightStore(local_store)
    run = RunConfig(engine={"replicas": 1}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 1})
    ensure_base_version(weights, TINY)
    worker = make_worker(local_store, run, router=RouterConfig(health_check_s=10.0), max_staleness=1)
    model, tokenizer = load_policy(weights.load(0))

    async def body() -> list[list[str]]:
        await worker.start()
        refusing = {"torch-0": False}
        refuse_new_versions(worker.engines[0], refusing, [])
        replicas = []
        try:
            publish_policy(weights, model, tokenizer, step=1, parent=0)
            assert await worker.sync_weights()
            refusing["torch-0"] = True
            for version, parent in ((3, 1), (4, 3)):
                publish_policy(weights, model, tokenizer, step=version, parent=parent, version=version)
                with pytest.raises(EngineError, match="cannot load"):
                    await worker.sync_weights()
                replicas.append(worker.router.replicas)
        finally:
            await worker.close()
        return replicas

    assert asyncio.run(body()) == [["torch-0"], []]
    assert worker.version == 1


def test_a_negative_max_staleness_is_refused(local_store):
    run = RunConfig(orchestrator={"mix": {"arith": 1.0}})
    with pytest.raises(ValueError, match="max_staleness=-1 is negative"):
        make_worker(local_store, run, max_staleness=-1)
