"""Valid trajectory records for storage tests, deterministic from their index."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from storage.schema import PROCESSED_SCHEMA, TRAJECTORY_SCHEMA, to_table


def make_record(index: int, num_tokens: int = 24, prefix: str = "t") -> dict[str, Any]:
    """One valid raw record: a prompt, then alternating action/observation turns; its
    content is a function of ``index`` so a reader can check it came back whole."""
    rng = np.random.default_rng(index)
    action_mask = (np.arange(num_tokens) // 4) % 2 == 1
    return {
        "trajectory_id": f"{prefix}{index}",
        "execution_id": f"e{index}",
        "parent_id": None,
        "branch_at": None,
        "task": "count",
        "prompt_id": f"p{index % 7}",
        "group_id": None,
        "tokens": rng.integers(0, 1000, num_tokens).tolist(),
        "logprobs": np.where(action_mask, -rng.random(num_tokens), 0.0).tolist(),
        "action_mask": action_mask.tolist(),
        "turn": (np.arange(num_tokens) // 8).tolist(),
        "versions": np.where(action_mask, index % 5, -1).tolist(),
        "reward": float(index % 2),
        "progress": 0.5,
        "status": "ok",
        "engine": "torch-0",
        "timing": {"init": 0.1, "run": 1.0, "eval": 0.2, "queue": 0.0},
    }


def make_table(start: int, count: int, num_tokens: int = 24, prefix: str = "t") -> pa.Table:
    """Records ``start … start+count-1`` as a table of the canonical raw schema."""
    return to_table(
        [make_record(i, num_tokens, prefix) for i in range(start, start + count)], TRAJECTORY_SCHEMA
    )


def make_processed_table(start: int, count: int, num_tokens: int = 24) -> pa.Table:
    """Valid processed records: train every action token with weight 1."""
    records = []
    for i in range(start, start + count):
        record = make_record(i, num_tokens)
        record["train_mask"] = record["action_mask"]
        record["loss_weight"] = [1.0] * num_tokens
        records.append(record)
    return to_table(records, PROCESSED_SCHEMA)
