"""What a rollout worker leaves running when it stops: nothing its background loops started."""

from __future__ import annotations

import asyncio

from flows.config import RunConfig
from rl.models import ensure_base_version
from rollout.router import RouterConfig
from storage.weights import WeightStore
from tests.rl.test_trainer import TINY
from tests.tasks.test_elastic_plan import make_worker, until

WIND_DOWN_TURNS = 50
"""Event-loop turns torch-1's load takes to wind down once cancelled: far more than run()
took to return after the first reload ended."""


def test_a_stop_while_the_health_check_reloads_replicas_waits_for_every_reload(local_store):
    """Stopped while the health check reloads both replicas: torch-0's load ends at the cancel,
    torch-1's takes a while to wind down. The health check's wait (asyncio.gather) ended with
    the first cancelled reload, so run() returned with torch-1's still running, under no lock."""
    run = RunConfig(engine={"replicas": 2}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 2})
    ensure_base_version(WeightStore(local_store), TINY)
    worker = make_worker(local_store, run, router=RouterConfig(health_check_s=0.05), weight_poll_s=600)
    reloads: dict[str, asyncio.Task] = {}
    reloading_at_return = []

    async def body() -> None:
        await worker.start()
        quick, slow = worker.engines

        async def ends_at_the_cancel(version, path):
            reloads[quick.name] = asyncio.current_task()
            await asyncio.Event().wait()

        async def winds_down_slowly(version, path):
            reloads[slow.name] = asyncio.current_task()
            try:
                await asyncio.Event().wait()
            finally:
                for _ in range(WIND_DOWN_TURNS):
                    await asyncio.sleep(0)

        quick.load_version, slow.load_version = ends_at_the_cancel, winds_down_slowly
        quick.version = slow.version = 7  # both missed version 0: the health check reloads them
        run_task = asyncio.create_task(worker.run(max_seconds=600))
        run_task.add_done_callback(
            lambda _: reloading_at_return.extend(name for name, task in reloads.items() if not task.done())
        )
        try:
            await until(lambda: len(reloads) == 2, "the health check to reload both replicas")
        finally:
            worker.stop()
            await run_task
            await worker.close()

    asyncio.run(body())
    assert reloading_at_return == []


def test_a_worker_stopped_before_it_started_runs_no_rollout(local_store):
    """``stop`` before ``run`` builds the engines and the orchestrator (``run`` starts the worker
    itself): the stop only set an event the orchestrator, made afterwards, never read, so the
    worker ran rollouts until its max_rollouts or deadline."""
    run = RunConfig(orchestrator={"mix": {"arith": 1.0}, "concurrency": 2, "max_rollouts": 2})
    ensure_base_version(WeightStore(local_store), TINY)
    worker = make_worker(local_store, run, flush_seconds=600)

    async def body():
        worker.stop()
        try:
            return await worker.run(max_seconds=600)
        finally:
            await worker.close()

    stats = asyncio.run(body())
    assert stats.tasks["arith"].started == 0
    assert worker.writer.committed == 0


def test_a_worker_given_no_time_stops_at_once(local_store):
    """``run(max_seconds=0)`` (a deadline already reached) stops at once, as any other
    ``max_seconds`` stops at its end: taken for no limit, it ran rollouts for ever."""
    run = RunConfig(orchestrator={"mix": {"arith": 1.0}, "concurrency": 2})
    ensure_base_version(WeightStore(local_store), TINY)
    worker = make_worker(local_store, run, flush_seconds=600)

    async def body():
        try:
            return await asyncio.wait_for(worker.run(max_seconds=0), 20)
        finally:
            await worker.close()

    stats = asyncio.run(body())
    assert stats.finished + len(stats.cut_short) == stats.tasks["arith"].started <= 2
