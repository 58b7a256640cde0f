"""Flow tests run against a throwaway Prefect API: one ``prefect_test_harness`` per session.

``tiny_config`` is the run every flow test uses: ``configs/tiny.yaml`` made small enough to
finish in seconds on a loaded CPU, stored under the test's ``tmp_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prefect.settings import PREFECT_API_URL
from prefect.testing.utilities import prefect_test_harness

from flows.config import RunConfig, _merge, load_config

REPO = Path(__file__).resolve().parents[2]

FAST: dict[str, Any] = {
    "model": {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}},
    "warm_start": {"demos_per_env": 16, "sft": {"batch_size": 16, "max_steps": 20, "max_seconds": 5}},
    "engine": {"torch": {"max_batch": 16}},
    "orchestrator": {"concurrency": 8},
    "service": {"max_new_tokens": 8},
    "sao": {"token_budget": 384, "micro_token_budget": 384, "publish_every": 1, "poll_seconds": 0.2},
    "eval": {"tasks_per_env": 4},
    "stop": {"max_seconds": 15},
}
"""Overrides of configs/tiny.yaml that make a run take seconds."""


def tiny_config(root: Path, run_id: str = "test", **overrides: Any) -> RunConfig:
    """configs/tiny.yaml with :data:`FAST` and ``overrides`` applied, stored under ``root``."""
    return load_config(
        REPO / "configs" / "tiny.yaml",
        _merge(FAST, {"run_id": run_id, "storage": {"root": str(root)}, **overrides}),
    )


@pytest.fixture(scope="session", autouse=True)
def prefect_api():
    """A temporary Prefect API (SQLite in a temp dir) for the whole session; its URL."""
    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()
