"""Flows of one run that start together both warm-start: one version 0, used by all."""

from __future__ import annotations

import os
import posixpath
import threading

from fsspec.implementations.local import LocalFileSystem
from prefect import flow

from flows.config import RunConfig
from storage.tables import Tables
from storage.weights import CLAIM_FILE, WeightStore
from tasks import weights as weight_tasks
from tasks.common import run_store
from tasks.weights import build_base_version, warm_start
from tests.flows.conftest import tiny_config


def test_flows_warm_starting_together_publish_one_version_zero(tmp_path):
    config = tiny_config(tmp_path / "runs", "warm-race")
    logs: dict[str, list[str]] = {"trainer": [], "worker": []}
    results: dict[str, int] = {}

    def start(name: str) -> None:
        results[name] = build_base_version(config, log=logs[name].append)

    threads = [threading.Thread(target=start, args=(name,)) for name in logs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert results == {"trainer": 0, "worker": 0}
    weights = WeightStore(run_store(config))
    assert weights.list() == [0] and weights.latest() == 0
    weights.load(0)  # every file matches the one manifest
    assert Tables(run_store(config)).read("weights").column("version").to_pylist() == [0]
    waited = [name for name, lines in logs.items() if any("using that one" in line for line in lines)]
    assert len(waited) == 1, logs


def test_a_version_zero_claimed_by_a_process_that_died_is_given_up_on(tmp_path, monkeypatch):
    config = tiny_config(tmp_path / "runs", "warm-dead", warm_start={"enabled": False})
    store = run_store(config)
    weights = WeightStore(store)
    store.create_exclusive(posixpath.join(weights.version_path(0), CLAIM_FILE), b"a process that died\n")
    monkeypatch.setattr(weight_tasks, "BASE_VERSION_WAIT_S", 0.5)
    lines: list[str] = []
    assert build_base_version(config, log=lines.append) == 1
    assert weights.list() == [1] and weights.latest() == 1 and weights.manifest(1)["tag"] == "base"
    assert "claimed but not published within 0 s" in lines[-1]
    assert Tables(store).read("weights").column("version").to_pylist() == [1]


@flow
def warm_starting(config: RunConfig) -> int:
    return warm_start(config)


def test_a_failed_upload_of_version_zero_is_retried_as_version_zero(tmp_path, monkeypatch):
    config = tiny_config(tmp_path / "runs", "warm-retry", warm_start={"enabled": False})
    real_put = LocalFileSystem.put_file
    failures: list[str] = []

    def fail_once_in_version_zero(fs, source, target, *args, **kwargs):
        if not failures and "weights/v000000/" in str(target):
            failures.append(target)
            raise OSError("transient storage error (injected)")
        return real_put(fs, source, target, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "put_file", fail_once_in_version_zero)
    monkeypatch.setattr(weight_tasks, "BASE_VERSION_WAIT_S", 2.0)  # what a claim of another process gets
    assert warm_starting(config) == 0  # the task's retry takes back its own claim
    assert failures
    weights = WeightStore(run_store(config))
    assert weights.list() == [0] and weights.latest() == 0 and weights.manifest(0)["tag"] == "base"
    assert sorted(os.listdir(weights.root)) == ["LATEST", "v000000"]
    weights.load(0)
    assert Tables(run_store(config)).read("weights").column("version").to_pylist() == [0]
