"""The rollout, process and train flows as three processes that share nothing but the S3
server and the Prefect API, as on three machines, started together on an empty run: the
rollout and train flows race to publish version 0 and one wins; the trainer lends one of
the worker's two engine replicas to training and gives it back through the plan in the
bucket; every rollout the worker finished is written, processed and accounted for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import yaml

from storage.config import RunStore
from storage.status import ElasticPlanBoard, RolloutStatusBoard
from storage.tables import Tables
from storage.weights import WeightStore
from tests.flows.conftest import REPO, tiny_config

SECONDS = {"rollout": 25, "train": 30, "process": 45}
"""Each flow's ``stop.max_seconds``: processing outlives the worker's last shard."""


def start_flow(name: str, config_path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"flows.{name}", "--config", str(config_path),
         "--set", f"stop.max_seconds={SECONDS[name]}"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


@pytest.mark.slow
def test_three_flow_processes_on_s3_lend_a_replica_and_lose_no_rollout(tmp_path, s3_server, prefect_api):
    config = tiny_config(
        tmp_path,
        "elastic-processes",
        storage=s3_server.config("elastic-processes").model_dump(),
        warm_start={"enabled": False},
        engine={"replicas": 2},
        orchestrator={"mix": {"guess": 1.0}, "concurrency": 8},
        # lend a replica whenever a shard waits; 16 slots a replica for 8 sessions, so the
        # other replica always has room for a drained one's sessions
        elastic={"high_backlog": 1, "low_backlog": 0, "saturated_idle": 1.0, "sessions_per_replica": 16,
                 "headroom_slots": 0, "cooldown_s": 0},
    )  # fmt: skip
    store = RunStore(config.storage, config.run_id)
    data = config.model_dump(mode="json")
    data["storage"].update(access_key_id=None, secret_access_key=None)  # from the environment
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(data))
    env = dict(
        os.environ,
        PREFECT_API_URL=prefect_api,
        OMP_NUM_THREADS="1",
        AWS_ACCESS_KEY_ID=s3_server.access_key_id,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_access_key,
    )

    statuses = []
    watching = threading.Event()

    def watch() -> None:  # what the worker says about its replicas, as any machine sees it
        board = RolloutStatusBoard(store)
        while not watching.wait(0.25):
            statuses.extend(board.read()[0])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    flows = {name: start_flow(name, config_path, env) for name in SECONDS}
    try:
        for name, process in flows.items():
            _, stderr = process.communicate(timeout=300)
            assert process.returncode == 0, f"{name} flow failed:\n{stderr[-4000:]}"
    finally:
        watching.set()
        watcher.join()
        for process in flows.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    assert any(s.draining for s in statuses), "the worker never applied a drain"
    assert all(len(s.draining) < 2 for s in statuses), "the last accepting replica was drained"
    final = ElasticPlanBoard(store).read()
    # the stopping trainer's last plan gives every replica back to rollout
    assert not final.running and final.draining == [] and final.train == [], final

    weights = WeightStore(store)
    assert [v for v in weights.list() if weights.manifest(v)["tag"] == "base"] == [0]
    assert weights.manifest(weights.latest())["step"] > 0

    tables = Tables(store)
    rows = sorted(tables.read("train_steps").to_pylist(), key=lambda row: row["step"])
    records = [json.loads(row["extra"])["elastic"] for row in rows]
    # every decision since the previous step, the ticker's too, with the moves it made
    moves = [
        move for record in records for decision in record["decisions"] for move in decision.get("decided", [])
    ]
    assert any(m["target"] == "train" and m["unit"].startswith("worker-0/") for m in moves), [
        (round(m["time"], 2), m["unit"], m["source"], m["target"], m["reason"]) for m in moves
    ]
    assert max(r["rollout_rate"] for r in records) > 0  # from the counts in the worker's statuses

    (last,) = RolloutStatusBoard(store).read()[0]
    assert not last.running and last.finished > 0
    # a finished rollout is one execution, written as a row per context: more than one once
    # compacted (service.compact_at), so rows count rollouts only with compaction off, as here
    assert config.service.compact_at is None
    trajectories = tables.read("trajectories", columns=["execution_id", "status"]).to_pydict()
    assert len(set(trajectories["execution_id"])) == last.finished
    assert set(trajectories["status"]) <= {"ok", "truncated"}
    shards = tables.read("shards").to_pylist()
    written = len(trajectories["status"])
    assert sum(s["num_rows"] for s in shards if s["kind"] == "raw") == written == last.finished
    assert sum(s["num_rows"] for s in shards if s["kind"] == "processed") == written
