"""The local Ray instance a run starts (no ``ray_address``, or ``local``) listens on 127.0.0.1
only, and leaves the process's SIGTERM handler as it was. It starts in a subprocess: tests/flows/test_ray.py keeps one Ray in the test process."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json
import signal
import sys

import psutil
import ray

from flows.config import RunConfig
from rollout.ray_engine import connect_ray


@ray.remote
def ping():
    return "pong"


def own_handler(signum, frame):
    pass


signal.signal(signal.SIGTERM, own_handler)  # as a Prefect flow run installs its own
config = RunConfig(cluster="ray", ray_address=sys.argv[1] or None)
connect_ray(config.ray_address, config.ray_node_ip)
sigterm_kept = signal.getsignal(signal.SIGTERM) is own_handler
assert ray.get(ping.remote()) == "pong"  # a worker is up and listening too
driver = psutil.Process()  # its core worker listens too
children = driver.children(recursive=True)
started = [(process.pid, process.create_time()) for process in children]
listening = []
for process in [driver, *children]:
    try:
        for connection in process.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN:
                listening.append((process.name(), connection.laddr.ip, connection.laddr.port))
    except psutil.NoSuchProcess:
        pass
print(json.dumps({"listening": listening, "started": started, "sigterm_kept": sigterm_kept}))
ray.shutdown()
"""


def _on_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def _stop_leftovers(started: list[tuple[int, float]]) -> None:
    """Kill any process the subprocess's Ray started that outlived it (the same pid and start
    time: never a process that reused the pid)."""
    leftovers = []
    for pid, created in started:
        try:
            process = psutil.Process(pid)
            if process.create_time() == created:
                process.kill()
                leftovers.append(process)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftovers, timeout=30)


def report_of(script: str, argument: str) -> dict:
    """The JSON last line ``script`` prints, run with ``argument`` in a fresh interpreter
    that starts a Ray of its own (``RAY_ADDRESS`` unset)."""
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    run = subprocess.run(
        [sys.executable, "-c", script, argument],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("address", ["", "local"])
def test_a_local_ray_started_by_a_run_listens_on_loopback_only(address):
    """``ray_address: local`` (``ray.init``'s own word for a new local instance) starts one on
    ``ray_node_ip`` too: it went to Ray's default, the machine's address on every interface."""
    report = report_of(SCRIPT, address)
    _stop_leftovers(report["started"])
    names = {name for name, _, _ in report["listening"]}
    assert {"gcs_server", "raylet"} <= names, report["listening"]
    beyond = [(name, ip, port) for name, ip, port in report["listening"] if not _on_loopback(ip)]
    assert beyond == [], f"Ray processes listening beyond loopback: {beyond}"
    assert report["sigterm_kept"], "ray.init's SIGTERM handler replaced the process's own"


SIZED_SCRIPT = """
import json
import sys

import ray

from flows.config import RunConfig
from tasks.rollout import connect_run_ray

config = RunConfig(cluster="ray", engine={"replicas": int(sys.argv[1])})
connect_run_ray(config, task_cpus=2)
print(json.dumps({"cpus": ray.cluster_resources()["CPU"]}))
ray.shutdown()
"""


def test_the_local_ray_a_run_starts_has_a_cpu_for_each_of_its_tasks_and_actors_beyond_the_cores():
    """The run's tasks and actors wait on each other: with Ray's one CPU per core, a 2-core
    machine ran the pipeline's process and train tasks and kept the rollout worker's env and
    engine actors pending until the trainer's deadline, and the run wrote no rollout."""
    replicas = os.cpu_count()
    report = report_of(SIZED_SCRIPT, str(replicas))
    # an env worker and an engine actor per replica, and the two tasks
    assert report["cpus"] == 2 * replicas + 2
