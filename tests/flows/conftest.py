"""Flow tests run against a throwaway Prefect API: one ``prefect_test_harness`` per session.

``tiny_config`` is the run every flow test uses: ``configs/tiny.yaml`` made small enough to
finish in seconds on a loaded CPU, stored under the test's ``tmp_path``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect.client.schemas.objects import State
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.testing.utilities import prefect_test_harness

from flows.config import RunConfig, _merge, load_config
from storage.config import RunStore

REPO = Path(__file__).resolve().parents[2]

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry calls to the internet

FAST: dict[str, Any] = {
    "model": {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}},
    "warm_start": {"demos_per_env": 16, "sft": {"batch_size": 16, "max_steps": 20, "max_seconds": 5}},
    "engine": {"torch": {"max_batch": 16}},
    "orchestrator": {"concurrency": 8},
    "service": {"max_new_tokens": 8},
    "sao": {"token_budget": 384, "micro_token_budget": 384, "publish_every": 1, "poll_seconds": 0.2},
    "eval": {"tasks_per_env": 4},
    "stop": {"max_seconds": 20},
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
    """A temporary Prefect API (SQLite in a temp dir) for the whole session; its URL. Flow runs
    in the tests' process send Prefect no heartbeats: the thread that sends them sleeps a
    second at a time, and each flow call waited up to that second for it at its end (nothing
    of treadle's uses them; the flow commands the tests start still send them)."""
    with (
        temporary_settings(updates={"flows.heartbeat_frequency": None}),
        prefect_test_harness(server_startup_timeout=180),
    ):
        yield PREFECT_API_URL.value()


@dataclass
class PipelineRun:
    """One finished pipeline flow run of :func:`tiny_config`."""

    config: RunConfig
    state: State
    result: dict[str, Any]

    @property
    def flow_run_id(self) -> UUID:
        return self.state.state_details.flow_run_id

    @property
    def store(self) -> RunStore:
        return RunStore(self.config.storage, self.config.run_id)


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory, prefect_api) -> PipelineRun:
    """The pipeline flow run once on the tiny config (rollout, process and train for 20 s)."""
    from flows.pipeline import pipeline

    config = tiny_config(tmp_path_factory.mktemp("pipeline") / "runs", "pipeline-test")
    state = pipeline(config, return_state=True)
    return PipelineRun(config, state, state.result(raise_on_failure=False))
