"""Each flow run is named after the run it works on, so the Prefect UI's list of flow runs
tells a nightly training of one run from an evaluation of another."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import torch
from prefect.client.orchestration import get_client

import flows.evaluate
import flows.maintain
import flows.pipeline
import flows.process
import flows.rollout
import flows.train
import tasks.process
import tasks.rollout
import tasks.train
import tasks.weights
from storage.tables import Tables
from storage.weights import WeightStore
from tasks.common import run_store
from tests.flows.conftest import tiny_config


def name_of(state) -> str:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id).name


@pytest.fixture
def no_work(monkeypatch):
    """The flows' tasks replaced by ones that do nothing: only the flow runs are looked at."""
    done = {"steps": 0, "versions": 0, "stop_reason": "drained"}
    monkeypatch.setattr(tasks.weights, "warm_start", lambda config: 0)
    monkeypatch.setattr(tasks.rollout, "rollouts", lambda *args, **kwargs: {})
    monkeypatch.setattr(tasks.process, "process_pending", lambda config: {})
    monkeypatch.setattr(tasks.train, "train", lambda *args: done)
    monkeypatch.setattr(flows.train, "report_task", lambda config: "")
    monkeypatch.setattr(
        tasks.weights,
        "evaluate_task",
        lambda config, version=None: {"version": version or 0, "reward": {}, "count": {}},
    )


def with_a_table(config):
    """``config``, its run holding a table (maintain fails on a run that does not exist)."""
    row = {"version": 0, "env": "arith", "reward": 0.5, "count": 1, "time": datetime.fromtimestamp(0, UTC)}
    Tables(run_store(config)).append("evals", [row])
    return config


def with_versions(config):
    """``config``, its run holding weight versions 0 to 3 (the evaluate flow refuses a
    version the run does not hold)."""
    weights = WeightStore(run_store(config))
    for step in range(4):
        weights.publish({"w": torch.zeros(2)}, {}, None, step=step)
    return config


@pytest.mark.parametrize(
    ("run", "named"),
    [
        (lambda config: flows.train.train(config, drain=True, return_state=True), "nightly-1"),
        (lambda config: flows.process.process(config, continuous=False, return_state=True), "nightly-1"),
        (lambda config: flows.rollout.rollout(config, "gpu-1", return_state=True), "nightly-1/gpu-1"),
        (lambda config: flows.evaluate.evaluate(with_versions(config), 3, return_state=True), "nightly-1/v3"),
        (
            lambda config: flows.evaluate.evaluate(with_versions(config), return_state=True),
            "nightly-1/newest",
        ),
        (lambda config: flows.maintain.maintain(with_a_table(config), return_state=True), "nightly-1"),
    ],
    ids=["train", "process", "rollout", "evaluate-a-version", "evaluate-the-newest", "maintain"],
)
def test_a_flow_run_is_named_after_its_run(tmp_path, prefect_api, no_work, run, named):
    state = run(tiny_config(tmp_path / "runs", "nightly-1"))
    assert state.is_completed()
    assert name_of(state) == named


def test_a_pipeline_run_is_named_after_its_run_from_its_start(tmp_path, prefect_api):
    """Named before its body runs: a run that fails its first check carries the name too."""
    state = flows.pipeline.pipeline(
        tiny_config(tmp_path / "runs", "nightly-2", trainer_device="cuda:99"), return_state=True
    )
    assert state.is_failed()
    assert name_of(state) == "nightly-2"
