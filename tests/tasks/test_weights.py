"""The warm start and evaluation tasks' own logic, called without a flow."""

from __future__ import annotations

import pytest

from storage.tables import Tables
from storage.weights import WeightStore
from tasks import weights as weight_tasks
from tasks.common import run_store
from tasks.weights import build_base_version
from tests.flows.conftest import tiny_config


def test_a_retry_of_a_warm_start_whose_latest_write_failed_uses_its_version_without_building_it_again(
    tmp_path, monkeypatch
):
    """Version 0 was written whole and only LATEST failed (a transient storage error): the
    retry built the policy again (with ``warm_start``, played the demonstrations and trained
    again), lost the claim of version 0 to its own earlier attempt and used that version
    without recording its ``weights`` row or announcing it."""
    config = tiny_config(tmp_path / "runs", "warm-latest", warm_start={"enabled": False})
    real_advance = WeightStore._advance_latest
    failures: list[int] = []

    def fail_once(weights, version):
        if not failures:
            failures.append(version)
            raise OSError("LATEST could not be written (injected)")
        return real_advance(weights, version)

    built: list[int] = []
    real_build = weight_tasks.build_tiny_model
    monkeypatch.setattr(weight_tasks, "build_tiny_model", lambda tiny: (built.append(1), real_build(tiny))[1])
    monkeypatch.setattr(WeightStore, "_advance_latest", fail_once)
    announced: list[int] = []
    with pytest.raises(OSError, match="LATEST could not be written"):
        build_base_version(config, log=print, owner="task-run-1", on_publish=announced.append)

    assert build_base_version(config, log=print, owner="task-run-1", on_publish=announced.append) == 0
    weights = WeightStore(run_store(config))
    assert weights.list() == [0] and weights.latest() == 0
    assert built == [1]
    assert Tables(run_store(config)).read("weights").column("version").to_pylist() == [0]
    assert announced == [0]
