"""The train flow: killed mid-run and started again, it loses and repeats no processed shard;
run with train/nightly's parameters, it trains the backlog and publishes one version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

import flows.train
from flows.config import RunConfig
from storage.schema import PROCESSED_SCHEMA, to_table
from storage.shards import ShardWriter
from storage.weights import WeightStore
from tasks.common import run_store
from tasks.weights import build_base_version
from tests.flows.conftest import REPO, tiny_config
from tests.storage.records import make_record

NUM_SHARDS, ROWS_PER_SHARD = 8, 6


def processed_table(start: int, count: int, vocab_size: int):
    """Valid processed rows the tiny model can read: token ids inside its vocabulary."""
    records = []
    for i in range(start, start + count):
        record = make_record(i, num_tokens=24, prefix="resume-")
        record["tokens"] = [t % vocab_size for t in record["tokens"]]
        record["versions"] = [0 if m else -1 for m in record["action_mask"]]
        record["train_mask"] = record["action_mask"]
        record["loss_weight"] = [1.0] * 24
        records.append(record)
    return to_table(records, PROCESSED_SCHEMA)


def version_chain(weights: WeightStore) -> list[dict]:
    """Manifests from LATEST back to version 0, oldest first."""
    chain, version = [], weights.latest()
    while version is not None:
        chain.append(weights.manifest(version))
        version = chain[-1]["parent"]
    return chain[::-1]


def start_train_flow(config_path, api_url: str, tmp_path) -> subprocess.Popen:
    """The train flow in a process of its own; its temporary folders (a publish's staging,
    left behind by a process killed mid-publish) under ``tmp_path`` rather than /tmp."""
    (tmp_path / "flow-tmp").mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "flows.train", "--config", str(config_path), "--drain"],
        cwd=REPO,
        env=dict(os.environ, PREFECT_API_URL=api_url, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path / "flow-tmp")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_killed_train_flow_resumes_without_losing_or_repeating_a_shard(tmp_path, prefect_api):
    config = tiny_config(
        tmp_path / "runs",
        "resume",
        warm_start={"enabled": False},
        sao={"token_budget": 72, "micro_token_budget": 72, "publish_every": 1, "max_staleness": 1000},
        stop={"max_seconds": 300},
    )
    store = run_store(config)
    build_base_version(config)
    writer = ShardWriter(store, "proc", kind="processed", schema=PROCESSED_SCHEMA)
    shards = {}
    for index in range(NUM_SHARDS):
        info = writer.commit(
            processed_table(index * ROWS_PER_SHARD, ROWS_PER_SHARD, config.model.tiny.vocab_size), index
        )
        shards[info.shard_id] = info.num_rows
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    weights = WeightStore(store)

    first = start_train_flow(config_path, prefect_api, tmp_path)
    try:
        while (weights.latest() or 0) < 1:
            assert first.poll() is None, f"train flow ended before publishing: {first.stderr.read()[-3000:]}"
            time.sleep(0.1)
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        kill_group(first)
    assert first.returncode == -signal.SIGKILL
    killed_at = weights.latest()
    assert killed_at < NUM_SHARDS * ROWS_PER_SHARD // 3, "the first run drained before it was killed"

    second = start_train_flow(config_path, prefect_api, tmp_path)
    try:
        _, stderr = second.communicate(timeout=300)
    finally:
        kill_group(second)
    assert second.returncode == 0, stderr[-3000:]
    assert "the trainer of run 'resume': a running holder published its status" in stderr  # waited it out

    chain = version_chain(weights)
    versions = [m["version"] for m in chain]
    # a version the kill caught mid-publish leaves a gap (its number is never reused), no fork
    assert versions[0] == 0 and versions == sorted(set(versions))
    consumed = [s for m in chain for s in m["metadata"].get("consumed_shards", [])]
    assert sorted(consumed) == sorted(shards), "a shard was lost or consumed twice"
    rows: dict[str, int] = {}
    for manifest in chain[1:]:
        for shard, n in manifest["metadata"]["consumed_rows"].items():
            rows[shard] = rows.get(shard, 0) + n
    assert rows == shards, "a row was lost or trained twice"
    assert chain[-1]["version"] > killed_at


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group of ``process`` if it still runs, reap it and close its stderr."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    process.stderr.close()


def test_the_nightly_deployments_parameters_train_the_backlog_and_publish_one_version(tmp_path):
    (nightly,) = [
        d
        for d in yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())["deployments"]
        if d["entrypoint"] == "flows.train:train" and d["name"] == "nightly"
    ]
    parameters = nightly["parameters"]
    # the deployment's run, on this machine's CPU and in a folder of the test's own; a stop
    # minutes away rather than its hour, should it not drain
    here = {
        "storage": {"root": str(tmp_path / "runs")},
        "trainer_device": "cpu",
        "warm_start": {"enabled": False},
        "stop": {"max_seconds": 120},
    }
    config = RunConfig.model_validate(parameters["config"] | here)
    store = run_store(config)
    build_base_version(config)
    writer = ShardWriter(store, "proc", kind="processed", schema=PROCESSED_SCHEMA)
    shards = {
        writer.commit(processed_table(index * 40, 40, config.model.tiny.vocab_size), index).shard_id
        for index in range(6)
    }

    result = flows.train.train(config, drain=parameters["drain"])

    assert (result["stop_reason"], result["versions"]) == ("drained", [1])
    assert result["steps"] > 1, "the backlog fits one step: one version per step would pass too"
    assert WeightStore(store).list() == [0, 1]
    assert set(WeightStore(store).manifest(1)["metadata"]["consumed_shards"]) == shards
