"""Synthetic processed trajectories and a small trainer config, shared by the trainer's tests
(the CUDA ones included, which must import nothing beyond the pure packages)."""

from __future__ import annotations

import random

import torch

from rl.config import SAOConfig
from rl.models import TinyModelConfig, load_policy
from rollout.engines.torch_engine import sampling_logprobs
from storage.config import RunStore
from storage.schema import PROCESSED_SCHEMA, to_table
from storage.shards import ShardWriter
from storage.weights import WeightStore

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, vocab_size=300)


def make_trajectories(
    store: RunStore, count: int, seed: int, version: int = 0, reward_token: int = 40, temperature: float = 1.0
) -> list[dict]:
    """Prompt (4 tokens), action (3), observation (2), action (2); reward 1 when the
    first action token is ``reward_token``. Rollout log-probs are those a TorchEngine running
    the stored policy records when it samples at ``temperature``."""
    rng = random.Random(seed)
    policy, _ = load_policy(WeightStore(store).load(0))
    records = []
    for i in range(count):
        prompt = [rng.randrange(10, 200) for _ in range(4)]
        first = reward_token if rng.random() < 0.5 else rng.randrange(10, 200)
        action1 = [first] + [rng.randrange(10, 200) for _ in range(2)]
        observation = [rng.randrange(10, 200) for _ in range(2)]
        action2 = [rng.randrange(10, 200) for _ in range(2)]
        tokens = prompt + action1 + observation + action2
        mask = [False] * 4 + [True] * 3 + [False] * 2 + [True] * 2
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([tokens])).logits[0, :-1]  # (T - 1, V)
            every = sampling_logprobs(
                logits, torch.full((len(logits),), temperature), torch.ones(len(logits))
            )  # (T - 1, V)
            taken = every.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
            logprobs = torch.cat([torch.zeros(1), taken])
        records.append(
            {
                "trajectory_id": f"t{seed}-{i}",
                "execution_id": f"e{seed}-{i}",
                "task": "synthetic",
                "prompt_id": f"p{i}",
                "group_id": f"g{seed}-{i // 2}",
                "tokens": tokens,
                "logprobs": [lp if m else 0.0 for lp, m in zip(logprobs.tolist(), mask, strict=True)],
                "action_mask": mask,
                "turn": [0] * 7 + [1] * 4,
                "versions": [version if m else -1 for m in mask],
                "reward": 1.0 if first == reward_token else 0.0,
                "progress": 1.0,
                "status": "ok",
                "train_mask": mask,
                "loss_weight": [1.0] * len(tokens),
            }
        )
    return records


def write_shards(store: RunStore, records: list[dict], per_shard: int, worker: str = "proc") -> list:
    infos = []
    writer = ShardWriter(store, worker, kind="processed", schema=PROCESSED_SCHEMA)
    for start in range(0, len(records), per_shard):
        writer.write_table(to_table(records[start : start + per_shard], PROCESSED_SCHEMA))
        infos.append(writer.flush())
    writer.close()
    return infos


def config(**overrides) -> SAOConfig:
    base = dict(
        lr=1e-3, value_lr=1e-3, token_budget=44, micro_token_budget=24, publish_every=2, poll_seconds=0.05
    )
    return SAOConfig(**base | overrides)
