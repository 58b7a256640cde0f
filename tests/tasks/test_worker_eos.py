"""A rollout worker's gateway stops at every EOS id of the model's generation_config, as vLLM
would by default (Qwen2.5 instruct lists <|im_end|> and <|endoftext|>): the engines sample on
past any id the gateway's stop ids leave out."""

from __future__ import annotations

import asyncio

from flows.config import RunConfig
from rl.models import build_tiny_model, publish_policy
from storage.weights import WeightStore
from tests.rl.test_trainer import TINY
from tests.tasks.test_elastic_plan import make_worker

OTHER_EOS = 100


def test_a_worker_stops_at_every_eos_id_of_the_published_model(local_store):
    model, tokenizer = build_tiny_model(TINY)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, OTHER_EOS]
    publish_policy(WeightStore(local_store), model, tokenizer, step=0)

    async def body():
        worker = make_worker(local_store, RunConfig(orchestrator={"mix": {"arith": 1.0}, "concurrency": 1}))
        try:
            await worker.start()
            return worker.service.gateway.stop_ids
        finally:
            await worker.close()

    stop_ids = asyncio.run(body())
    assert tokenizer.eos_token_id in stop_ids and OTHER_EOS in stop_ids
