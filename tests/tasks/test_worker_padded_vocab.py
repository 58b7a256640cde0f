"""A model whose vocabulary is padded past its tokenizer (Qwen3-0.6B: 151936 embedding rows,
151669 tokenizer tokens) samples ids the tokenizer has no text for: they are the model's
tokens (an embedding, a log-prob), so a rollout keeps them, on either engine, and an
evaluation scores it."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from envs import registry
from flows.config import RunConfig
from rl.models import build_tiny_model, publish_policy
from rollout.service import RolloutRequest
from storage.config import StorageConfig
from storage.schema import to_table, validate
from storage.weights import WeightStore
from tasks.common import run_store
from tasks.weights import evaluate_weights
from tests.rl.test_trainer import TINY
from tests.rollout.vllm_standin import StandinServer
from tests.tasks.test_elastic_plan import make_worker

PADDING = 64


def publish_padded_policy(weights: WeightStore) -> tuple[torch.nn.Module, int]:
    """Publish the tiny model with ``PADDING`` embedding rows past its tokenizer, made large
    so that the model samples them; returns the model and its tokenizer's length."""
    model, tokenizer = build_tiny_model(TINY)
    model.resize_token_embeddings(len(tokenizer) + PADDING, mean_resizing=False)
    with torch.no_grad():
        model.get_output_embeddings().weight[len(tokenizer) :] = torch.randn(PADDING, TINY.hidden_size)
    publish_policy(weights, model, tokenizer, step=0)
    return model, len(tokenizer)


@pytest.mark.parametrize("kind", ["torch", "vllm"])
def test_ids_past_the_tokenizer_are_kept_in_the_rollout(local_store, kind):
    weights = WeightStore(local_store)
    torch.manual_seed(0)
    model, tokenizer_length = publish_padded_policy(weights)
    task = registry.task_set("arith", "train", seed=0, n=1)[0]

    async def body():
        server = await StandinServer(model, max_model_len=256).start() if kind == "vllm" else None
        engine = {"kind": "vllm", "vllm": [{"base_url": server.url}]} if server else {}
        run = RunConfig(
            engine=engine,
            gateway={"max_context_tokens": 256},
            service={"max_new_tokens": 8},
            orchestrator={"mix": {"arith": 1.0}, "concurrency": 1},
        )
        worker = make_worker(local_store, run)
        try:
            await worker.start()
            return await worker.service.process(RolloutRequest(task=task, seed=1))
        finally:
            await worker.close()
            if server is not None:
                await server.stop()

    result = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    record = result.record
    padded = [i for i, t in enumerate(record["tokens"]) if t >= tokenizer_length]
    assert padded and all(record["action_mask"][i] for i in padded)
    assert all(math.isfinite(record["logprobs"][i]) and record["logprobs"][i] <= 0 for i in padded)
    validate(to_table([record]))


def test_an_evaluation_scores_rollouts_that_sample_ids_past_the_tokenizer(tmp_path):
    run = RunConfig(
        run_id="padded",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        service={"max_new_tokens": 8},
        orchestrator={"mix": {"arith": 1.0}},
        eval={"tasks_per_env": 2},
    )
    torch.manual_seed(0)
    publish_padded_policy(WeightStore(run_store(run)))
    result = evaluate_weights(run)
    assert result.count == {"arith": 2}, result.statuses
