"""The rollout flow's progress bar toward ``max_rollouts`` counts what that limit counts: the
rollouts of the whole run (every worker, every earlier flow run), not this worker's alone."""

from __future__ import annotations

import pytest

from flows.rollout import rollout
from storage.quota import RunQuota
from tasks.common import run_store
from tasks.weights import build_base_version
from tests.flows.conftest import tiny_config
from tests.flows.prefect_api import artifacts_of

LIMIT = 16
EARLIER = 8
"""Rollouts of the run's limit an earlier flow run used."""


def bar_of(state):
    (bar,) = [a for a in artifacts_of([state.state_details.flow_run_id]) if a.type == "progress"]
    return bar


@pytest.mark.parametrize(
    ("max_seconds", "ends"), [(300, "at the limit"), (0.001, "at its deadline")], ids=["limit", "deadline"]
)
def test_a_resumed_runs_rollout_bar_shows_the_runs_rollouts_against_max_rollouts(tmp_path, max_seconds, ends):
    config = tiny_config(
        tmp_path / "runs", "resumed", warm_start={"enabled": False}, stop={"max_seconds": max_seconds, "max_rollouts": LIMIT}
    )  # fmt: skip
    build_base_version(config, log=lambda line: None)
    quota = RunQuota(run_store(config), "rollouts", LIMIT)
    assert quota.claim(EARLIER) == EARLIER

    state = rollout(config, "w1", return_state=True)

    assert state.is_completed()
    finished = state.result()["orchestrator"]["finished"]
    run_total = quota.claimed()  # what this worker did not finish it gave back
    assert run_total == EARLIER + finished
    bar = bar_of(state)
    assert bar.data == pytest.approx(100.0 * run_total / LIMIT)
    assert bar.description == f"Rollouts of the run, done or in flight: {run_total}"
    if ends == "at the limit":
        assert finished == LIMIT - EARLIER and bar.data == 100.0


def test_a_quota_that_cannot_be_read_for_the_bar_does_not_fail_the_rollouts(tmp_path, monkeypatch, caplog):
    """The bar reads the run's count from storage; a storage error there costs a report, not
    the flow run whose rollouts are committed."""

    def unreadable(self):
        raise ConnectionError("storage away for a moment")

    config = tiny_config(
        tmp_path / "runs", "unread", warm_start={"enabled": False}, stop={"max_seconds": 300, "max_rollouts": 4}
    )  # fmt: skip
    build_base_version(config, log=lambda line: None)
    monkeypatch.setattr(RunQuota, "claimed", unreadable)

    state = rollout(config, "w0", return_state=True)

    assert state.is_completed() and state.result()["orchestrator"]["finished"] == 4
    assert "last progress report of worker w0 failed, the work goes on" in caplog.text


def test_with_both_rollout_limits_set_the_smaller_ends_the_run_and_its_bar(tmp_path):
    """``orchestrator.max_rollouts`` and ``stop.max_rollouts`` each promise "at most": with
    both set, the smaller orchestrator one was ignored and the run went on to the other."""
    config = tiny_config(
        tmp_path / "runs", "both", warm_start={"enabled": False}, orchestrator={"max_rollouts": 4},
        stop={"max_seconds": 300, "max_rollouts": LIMIT},
    )  # fmt: skip
    build_base_version(config, log=lambda line: None)

    state = rollout(config, "w0", return_state=True)

    assert state.is_completed() and state.result()["orchestrator"]["finished"] == 4
    assert RunQuota(run_store(config), "rollouts", 4).claimed() == 4
    assert bar_of(state).data == 100.0
