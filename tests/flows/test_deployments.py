"""deployments/prefect.yaml on a real ``prefect server``, executed by a real process worker.

The server and its SQLite database (PREFECT_HOME) are the module's, every deployment
registered there once with ``prefect deploy --all``; the workers are each test's own. All are
processes on 127.0.0.1, each in its own process group, killed at the end. One test runs
``evaluate/on-demand`` through the API and fires the ``process/on-commit`` automation with a
shard-commit event, then reads flow-run states, artifacts and events back through the Prefect
client; the other cancels a ``rollout/gpu-worker`` run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from uuid import uuid4

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate, WorkPoolCreate
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.deployments import run_deployment
from prefect.events import Event
from prefect.events.schemas.automations import AutomationCore
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Cancelling
from prefect.workers.process import ProcessWorker

from storage.schema import TRAJECTORY_SCHEMA, to_table
from storage.shards import ShardWriter
from storage.status import RolloutStatusBoard
from storage.tables import Tables
from tasks.common import run_store
from tasks.weights import build_base_version
from tests.conftest import free_port
from tests.flows.conftest import REPO, tiny_config
from tests.flows.prefect_api import artifacts_of, count, read_events, wait_for_events
from tests.storage.records import make_record

PREFECT = Path(sys.executable).parent / "prefect"
RAW_SHARDS = 2


def start(args: list[str], env: dict, log: Path, cwd: Path = REPO) -> subprocess.Popen:
    with log.open("wb") as out:  # the child writes to its own copy of the descriptor
        return subprocess.Popen(
            args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it if it lingers, and reap the leader."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # children that outlived their leader


def wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"prefect server exited: {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"prefect server not healthy after {timeout_s} s: {log.read_text()[-3000:]}")


def start_server(tmp_path: Path, processes: list[subprocess.Popen]) -> tuple[str, dict[str, str]]:
    """Start a ``prefect server`` on a free port of 127.0.0.1, its database in ``tmp_path``
    (added to ``processes``, which the caller stops), and wait until it answers; its API URL
    and the environment of the processes that use it. Without the scheduler: no test here runs
    a deployment by its schedule, and train/nightly's at 02:00 would be the gpu pool's worker's
    to run."""
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_API_URL=api_url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_CLI_PROMPT="false",
        OMP_NUM_THREADS="1",
    )
    log = tmp_path / "server.log"
    command = [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-scheduler"]
    server = start(command, env, log)
    processes.append(server)
    wait_healthy(api_url, server, log)
    return api_url, env


@dataclass
class Deployed:
    """The module's Prefect server, its ``cpu`` and ``gpu`` process pools, and every deployment
    of deployments/prefect.yaml registered there: each test starts the workers it needs."""

    api_url: str
    env: dict[str, str]
    server_log: Path


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    """One server for the module's tests (each start migrated a fresh database), with every
    deployment registered by ``prefect deploy --all``."""
    tmp_path = tmp_path_factory.mktemp("prefect-server")
    processes: list[subprocess.Popen] = []
    try:
        api_url, env = start_server(tmp_path, processes)
        with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
            for pool in ("cpu", "gpu"):
                client.create_work_pool(
                    WorkPoolCreate(
                        name=pool,
                        type="process",
                        base_job_template=ProcessWorker.get_default_base_job_template(),
                    )
                )
        deploy = subprocess.run(
            [str(PREFECT), "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        yield Deployed(api_url, env, tmp_path / "server.log")
    finally:
        for process in processes:
            stop(process)


def write_raw_shards(config) -> list[str]:
    """Raw shards of valid trajectories with token ids inside the tiny vocabulary."""
    writer = ShardWriter(run_store(config), "worker-0")
    ids = []
    for seq in range(RAW_SHARDS):
        records = [make_record(seq * 4 + i, prefix="deploy-") for i in range(4)]
        for record in records:
            record["tokens"] = [t % config.model.tiny.vocab_size for t in record["tokens"]]
            record["task"] = "arith"
        ids.append(writer.commit(to_table(records, TRAJECTORY_SCHEMA), seq).shard_id)
    return ids


@pytest.mark.slow
def test_deployments_run_on_a_real_server_and_worker(tmp_path, deployed):
    config = tiny_config(tmp_path / "runs", "demo", warm_start={"enabled": False}, eval={"tasks_per_env": 3})
    build_base_version(config)
    raw_shards = write_raw_shards(config)
    processes: list[subprocess.Popen] = []
    try:
        with temporary_settings({PREFECT_API_URL: deployed.api_url}), get_client(sync_client=True) as client:
            deployments = {
                f"{client.read_flow(d.flow_id).name}/{d.name}": d for d in client.read_deployments()
            }
            assert set(deployments) == {
                "train/nightly",
                "pipeline/on-demand",
                "evaluate/on-demand",
                "maintain/on-demand",
                "process/on-commit",
                "rollout/gpu-worker",
            }
            nightly = deployments["train/nightly"]
            (schedule,) = nightly.schedules
            assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 2 * * *", "Europe/Lisbon")
            assert nightly.work_pool_name == "gpu" and nightly.parameters["drain"] is True
            assert nightly.job_variables["env"]["CUDA_VISIBLE_DEVICES"] == "0"
            schema = client.read_deployment(nightly.id).parameter_openapi_schema
            assert "definitions" in schema, str(schema)[:3000]
            assert schema["definitions"]["RunConfig"]["properties"]["sao"]["description"]

            # the trigger's automation runs the process deployment for this test's run, at once
            # rather than 30 s after the commit, as it is deployed to
            process_deployment = deployments["process/on-commit"]
            client.update_deployment(
                process_deployment.id,
                DeploymentUpdate(parameters={"config": config.model_dump(mode="json"), "continuous": False}),
            )
            (on_commit,) = client.read_resource_related_automations(
                f"prefect.deployment.{process_deployment.id}"
            )
            (action,) = on_commit.actions
            assert (action.deployment_id, action.schedule_after) == (
                process_deployment.id,
                timedelta(seconds=30),
            )
            client.update_automation(
                on_commit.id,
                AutomationCore(
                    **on_commit.model_dump(exclude={"id", "actions", "owner_resource"}),  # not updatable
                    actions=[action.model_copy(update={"schedule_after": timedelta(0)})],
                ),
            )
            worker = start(
                [str(PREFECT), "worker", "start", "--pool", "cpu", "--type", "process"],
                deployed.env,
                tmp_path / "worker.log",
                cwd=tmp_path,
            )
            processes.append(worker)

            evaluation = run_deployment(
                "evaluate/on-demand", parameters={"config": config.model_dump(mode="json")}, timeout=0
            )
            commit = Event(
                event="treadle.shard.committed",
                resource={"prefect.resource.id": "treadle.run.cluster", "treadle.run_id": "cluster"},
                payload={"shard_id": raw_shards[-1]},
                id=uuid4(),
            )
            client.request("POST", "/events", json=[commit.model_dump(mode="json")])

            evaluation = wait_final(client, evaluation.id, tmp_path)
            assert evaluation.state.is_completed(), evaluation.state.message
            triggered = wait_for_flow_run(client, process_deployment.id, tmp_path, deployed.server_log)
            assert triggered.state.is_completed(), triggered.state.message

            (table,) = [a for a in artifacts_of([evaluation.id]) if a.type == "table"]
            assert '"version": 0' in table.data and '"env": "guess"' in table.data
            events = wait_for_events(
                "treadle.run.demo", lambda events: count(events, "treadle.shard.processed") >= RAW_SHARDS
            )
            assert sorted(e.payload["raw_shard"] for e in events if e.event == "treadle.shard.processed") == (
                raw_shards
            )
            lifecycle = wait_for_events(
                f"prefect.flow-run.{evaluation.id}",
                lambda events: count(events, "prefect.flow-run.Completed") == 1,
                prefix="prefect.flow-run.",
            )
            assert count(lifecycle, "prefect.flow-run.Running") == 1
            assert not read_events(f"prefect.flow-run.{evaluation.id}", "prefect.flow-run.Failed")
    finally:
        for process in reversed(processes):
            stop(process)
    trajectories = Tables(run_store(config)).read("trajectories")
    assert trajectories.num_rows == 4 * RAW_SHARDS
    evals = Tables(run_store(config)).read("evals").to_pylist()
    assert sorted((r["version"], r["env"], r["count"]) for r in evals) == [(0, "arith", 3), (0, "guess", 3)]


def wait_final(client, flow_run_id, tmp_path: Path, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while True:
        flow_run = client.read_flow_run(flow_run_id)
        if flow_run.state is not None and flow_run.state.is_final():
            return flow_run
        assert time.monotonic() < deadline, (
            f"flow run {flow_run_id} still {flow_run.state}: {(tmp_path / 'worker.log').read_text()[-3000:]}"
        )
        time.sleep(1)


def wait_for_flow_run(client, deployment_id, tmp_path: Path, server_log: Path, timeout_s: float = 300):
    """The first flow run of ``deployment_id`` once it is final (an automation creates it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )
        if runs:
            return wait_final(client, runs[0].id, tmp_path, max(deadline - time.monotonic(), 1))
        assert time.monotonic() < deadline, (
            f"no run of the triggered deployment: {server_log.read_text()[-3000:]}"
        )
        time.sleep(1)


@pytest.mark.slow
def test_a_rollout_deployment_cancelled_through_the_api_ends_cancelled_with_every_finished_rollout_committed(
    tmp_path, deployed
):
    """Cancel in the UI: the worker sends the flow run's process SIGTERM, which Prefect's
    handler raises wherever the main thread is, an event-loop task among them. The rollouts
    stop, the buffered ones are committed, the worker's last status says it stopped, and the
    run ends Cancelled."""
    config = tiny_config(
        tmp_path / "runs", "cancel", warm_start={"enabled": False}, stop={"max_seconds": 900}
    )
    build_base_version(config)
    raw = tmp_path / "runs" / "cancel" / "shards" / "raw"
    processes: list[subprocess.Popen] = []
    try:
        with temporary_settings({PREFECT_API_URL: deployed.api_url}), get_client(sync_client=True) as client:
            processes.append(
                start(
                    [str(PREFECT), "worker", "start", "--pool", "gpu", "--type", "process"],
                    deployed.env,
                    tmp_path / "worker.log",
                    cwd=tmp_path,
                )
            )
            flow_run = run_deployment(
                "rollout/gpu-worker", parameters={"config": config.model_dump(mode="json")}, timeout=0
            )
            deadline = time.monotonic() + 300
            while not (raw.exists() and any(raw.rglob("*.arrow"))):  # rollouts are being committed
                state = client.read_flow_run(flow_run.id).state
                assert not state.is_final(), f"{state}: {(tmp_path / 'worker.log').read_text()[-3000:]}"
                assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
                time.sleep(0.5)
            client.set_flow_run_state(flow_run.id, Cancelling())
            cancelled = wait_final(client, flow_run.id, tmp_path)
    finally:
        for process in reversed(processes):
            stop(process)
    assert cancelled.state.is_cancelled(), (cancelled.state, (tmp_path / "worker.log").read_text()[-3000:])
    store = run_store(config)
    (final,), corrupt = RolloutStatusBoard(store).read()
    shards = Tables(store).read("shards").to_pylist()
    committed = sum(s["num_rows"] for s in shards if s["kind"] == "raw")
    assert (final.worker, final.running, final.engine_queue_depth, final.live_sessions, corrupt) == (
        "gpu-0",
        False,
        0,
        0,
        0,
    )
    assert committed == final.finished > 0


def test_a_boolean_for_the_evaluate_flows_version_is_refused_as_the_servers_schema_refuses_it():
    from prefect.exceptions import ParameterTypeError
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import ValidationError, validate

    import flows.evaluate

    evaluate = flows.evaluate.evaluate
    with pytest.raises(ValidationError):  # a deployment's run: refused by the server
        validate({"version": True}, parameter_schema(evaluate).model_dump(), raise_on_error=True)
    # called from Python, pydantic's lax mode read true as version 1 and evaluated it
    with pytest.raises(ParameterTypeError, match="version"):
        evaluate.validate_parameters({"version": True})
    assert evaluate.validate_parameters({"version": 3})["version"] == 3
