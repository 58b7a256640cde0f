"""A vLLM server that holds fewer tokens than a session may serves no rollout of the worker,
whether it was up when the worker started or came up later."""

from __future__ import annotations

import asyncio
import logging

from flows.config import RunConfig
from rl.models import ensure_base_version, load_policy
from rollout.engines.vllm_engine import VLLMEngine
from rollout.router import RouterConfig
from storage.weights import WeightStore
from tests.rl.test_trainer import TINY
from tests.rollout.vllm_standin import StandinServer
from tests.tasks.test_elastic_plan import make_worker, until

SHORT_SERVER = "gateway.max_context_tokens=256 is over vLLM server vllm-0's max_model_len=128"


def test_a_vllm_server_down_at_start_with_a_shorter_context_stays_out_once_it_is_up(
    local_store, monkeypatch, caplog
):
    """``vllm-0`` is still launching when the worker starts, so the start's check of each
    server's ``max_model_len`` skipped it; once up, the health check put it in service, and
    every rollout it took past its 128 tokens ended early. It now stays out, saying why, as
    the start would have refused it."""
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    launched_with, _ = load_policy(weights.load(0))
    launching = {"vllm-0"}
    real_health = VLLMEngine.health

    async def health(engine) -> bool:
        return engine.name not in launching and await real_health(engine)

    monkeypatch.setattr(VLLMEngine, "health", health)

    def refused() -> bool:
        return any(SHORT_SERVER in message for message in caplog.messages)

    async def body() -> None:
        short = await StandinServer(launched_with, max_model_len=128).start()
        long = await StandinServer(launched_with, max_model_len=256).start()
        run = RunConfig(
            engine={"kind": "vllm", "vllm": [{"base_url": short.url}, {"base_url": long.url}]},
            gateway={"max_context_tokens": 256},
            orchestrator={"mix": {"arith": 1.0}, "concurrency": 1},
        )
        worker = make_worker(local_store, run, router=RouterConfig(health_check_s=0.05))
        try:
            await worker.start()
            assert worker.router.replicas == ["vllm-1"]
            run_task = asyncio.create_task(worker.run(max_seconds=600))
            launching.clear()
            await until(
                lambda: refused() or "vllm-0" in worker.router.replicas, "vllm-0 to come in or be refused"
            )
            assert worker.router.replicas == ["vllm-1"] and worker.router.down == ["vllm-0"]
            assert refused()
            worker.stop()
            await run_task
        finally:
            await worker.close()
            await short.stop()
            await long.stop()

    with caplog.at_level(logging.WARNING, logger="rollout.router"):
        asyncio.run(body())
