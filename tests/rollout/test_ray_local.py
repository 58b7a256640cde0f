"""The local Ray instance a run starts (no ``ray_address``, or ``local``) listens on 127.0.0.1
only, leaves the process's SIGTERM handler as it was, and, stopped by a signal as it starts,
leaves no process behind. It starts in a subprocess: tests/flows/test_ray.py keeps one Ray in the test process."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import free_port, one_ray_at_a_time

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def no_other_ray():
    """Each test here starts a Ray of its own, some stopped mid-start: one at a time on the machine."""
    with one_ray_at_a_time():
        yield


SCRIPT = """
import json
import signal
import sys

import psutil
import ray

from flows.config import RunConfig
from tasks.rollout import connect_run_ray


@ray.remote
def ping():
    return "pong"


def own_handler(signum, frame):
    pass


signal.signal(signal.SIGTERM, own_handler)  # as a Prefect flow run installs its own
config = RunConfig(cluster="ray", ray_address=sys.argv[1] or None, engine={"replicas": int(sys.argv[2])})
connect_run_ray(config, task_cpus=2)
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
cpus = ray.cluster_resources()["CPU"]
print(json.dumps({"listening": listening, "started": started, "sigterm_kept": sigterm_kept, "cpus": cpus}))
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


def report_of(script: str, *arguments: str) -> dict:
    """The JSON last line ``script`` prints, run with ``arguments`` in a fresh interpreter
    that starts a Ray of its own (``RAY_ADDRESS`` unset)."""
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    run = subprocess.run(
        [sys.executable, "-c", script, *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("address", ["", "local"])
def test_a_local_ray_started_by_a_run_listens_on_loopback_only_with_a_cpu_for_each_of_its_tasks_and_actors(
    address,
):
    """``ray_address: local`` (``ray.init``'s own word for a new local instance) starts one on
    ``ray_node_ip`` too: it went to Ray's default, the machine's address on every interface.

    The run's tasks and actors wait on each other: with Ray's one CPU per core, a 2-core
    machine ran the pipeline's process and train tasks and kept the rollout worker's env and
    engine actors pending until the trainer's deadline, and the run wrote no rollout. Both are
    checked on one start: each Ray start here takes seconds."""
    replicas = os.cpu_count()
    report = report_of(SCRIPT, address, str(replicas))
    _stop_leftovers(report["started"])
    names = {name for name, _, _ in report["listening"]}
    assert {"gcs_server", "raylet"} <= names, report["listening"]
    beyond = [(name, ip, port) for name, ip, port in report["listening"] if not _on_loopback(ip)]
    assert beyond == [], f"Ray processes listening beyond loopback: {beyond}"
    assert report["sigterm_kept"], "ray.init's SIGTERM handler replaced the process's own"
    # an env worker and an engine actor per replica, and the two tasks
    assert report["cpus"] == 2 * replicas + 2


SIGNALLED_SCRIPT = """
import os
import signal
import sys
import time

import ray._private.worker

from flows.cli_args import flow_command
from flows.config import RunConfig
from tasks.rollout import connect_run_ray

if sys.argv[1] == "self":
    connect = ray._private.worker.connect

    def connect_then_signal(*args, **kwargs):
        connect(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # at the end of ray.init, its core worker started

    ray._private.worker.connect = connect_then_signal


@flow_command  # as a flow command: one line and the signal's status
def main():
    connect_run_ray(RunConfig(cluster="ray"))
    print("connected", flush=True)
    time.sleep(120)  # a signal that came once Ray was up stops the command here


main()
"""


def _descendants(process: psutil.Process, seen: dict[tuple[int, float], str]) -> None:
    """Add each process below ``process`` to ``seen`` as (pid, start time) -> its name now (one
    seen between its fork and its exec has its parent's)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in process.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                seen[child.pid, child.create_time()] = child.name()


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _described(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()[:2])
    except psutil.Error:  # it has just exited
        return f"{process.pid} (exited)"


def _survivors(seen: dict[tuple[int, float], str], temp_dir: str, within_s: float) -> list[psutil.Process]:
    """The processes of ``seen`` still running ``within_s`` seconds from now (the same start
    time: never one that reused a pid), and any other whose command line names ``temp_dir``,
    the Ray instance's own: a process its Ray stopped may take a moment to exit."""
    candidates = {}
    for pid, created in seen:
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            if process.create_time() == created:
                candidates[pid] = process
    for process in psutil.process_iter(["cmdline"]):
        if any(temp_dir in part for part in process.info["cmdline"] or ()):
            candidates.setdefault(process.pid, process)
    running = [process for process in candidates.values() if _running(process)]
    deadline = time.monotonic() + within_s
    while running and time.monotonic() < deadline:
        time.sleep(0.2)
        running = [process for process in running if _running(process)]
    return running


def _stopped_while_ray_starts(
    tmp_path: Path, signum: signal.Signals | None
) -> tuple[int, str, str, list[str]]:
    """Run :data:`SIGNALLED_SCRIPT` with its own Ray temp folder, send it ``signum`` once its
    raylet runs (None: it sends itself SIGTERM), wait for it to end; its status, stdout,
    stderr and the processes its Ray left running (killed before this returns)."""
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's sockets are made below it
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"  # files: a survivor would hold a pipe open
    seen: dict[tuple[int, float], str] = {}
    with stdout.open("w") as out, stderr.open("w") as err:
        command = subprocess.Popen(
            [sys.executable, "-c", SIGNALLED_SCRIPT, "self" if signum is None else "test"],
            cwd=ROOT,
            env=env | {"RAY_TMPDIR": temp_dir},
            stdout=out,
            stderr=err,
        )
    try:
        driver = psutil.Process(command.pid)
        deadline = time.monotonic() + 60
        while signum is not None and "raylet" not in seen.values():
            assert command.poll() is None, f"ended before Ray started: {stderr.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no raylet within 60 s: {stderr.read_text()[-3000:]}"
            _descendants(driver, seen)
            time.sleep(0.05)
        if signum is not None:
            command.send_signal(signum)
        deadline = time.monotonic() + 60
        while command.poll() is None and time.monotonic() < deadline:
            _descendants(driver, seen)
            time.sleep(0.05)
        left = [_described(process) for process in _survivors(seen, temp_dir, within_s=10)]
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
        for process in _survivors(seen, temp_dir, within_s=0):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
    return command.returncode, stdout.read_text(), stderr.read_text(), left


def _assert_stopped_by(signum: signal.Signals, code: int, stdout: str, stderr: str, left: list[str]) -> None:
    landed = "after" if "connected" in stdout else "while"
    assert code == 128 + signum, f"(signal {landed} Ray started) {stderr[-3000:]}"
    assert stderr.count("stopped by") == 1 and f"stopped by {signum.name}\n" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert left == [], f"left running by a signal {landed} Ray started"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_local_ray_starts_stops_the_command_as_elsewhere_and_leaves_no_ray_process(
    tmp_path, signum
):
    """A SIGTERM that came while ``ray.init`` started the run's local Ray met Ray's own
    handler: the command exited 15, without its "stopped by" line. A SIGTERM or Ctrl-C
    interrupted the start wherever it was and left the raylet's agents (``DashboardAgent``,
    ``RuntimeEnvAgent``) running, orphaned. Now the signal waits for the start to end, Ray is
    shut down, and the signal stops the command as at any other time. It is sent once the
    raylet runs: a signal that lands after the start ended must stop the command the same way."""
    _assert_stopped_by(signum, *_stopped_while_ray_starts(tmp_path, signum))


def test_a_sigterm_once_rays_core_worker_started_stops_the_command_as_elsewhere(tmp_path):
    """At the end of ``ray.init``, once its core worker has started, a SIGTERM goes first to the
    core worker's failure signal handler, which arms an alarm that aborts the process 3 s
    later: the command died by SIGABRT while Ray shut down. The signal is sent there by the
    command itself (after ``ray._private.worker.connect``), where a signal from outside lands
    only now and then."""
    _assert_stopped_by(signal.SIGTERM, *_stopped_while_ray_starts(tmp_path, None))


@pytest.mark.parametrize("local", [True, False])
def test_a_ctrl_c_while_connecting_waits_for_a_local_start_and_stops_joining_a_cluster_at_once(local):
    """Starting a local Ray, the signal is held until the start ends (its agents would be left
    orphaned); joining a cluster, which starts nothing here, it stops the connection at once
    rather than after Ray's time-outs for a cluster that does not answer."""
    from rollout.ray_engine import _signals_held

    went_on = []
    # as in a command's process: an earlier test in this process may have left another handler
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), _signals_held(hold=local):
            signal.raise_signal(signal.SIGINT)
            went_on.append(True)
        assert went_on == ([True] if local else [])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_ray_shutdown_that_fails_after_a_held_signal_gives_the_signals_back(monkeypatch):
    """Ray's shutdown after a held Ctrl-C raised and left the holding handlers in place: the
    process recorded Ctrl-C, SIGTERM and SIGHUP from then on and never stopped for them."""
    from rollout import ray_engine

    def failing_shutdown(**kwargs):
        raise RuntimeError("shutdown failed (injected)")

    monkeypatch.setattr(ray_engine.ray, "shutdown", failing_shutdown)
    # as in a command's process: an earlier test in this process may have left another handler
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    handlers = {signum: signal.getsignal(signum) for signum in ray_engine.HELD_SIGNALS}
    try:
        with pytest.raises(KeyboardInterrupt), ray_engine._signals_held():
            signal.raise_signal(signal.SIGINT)
        left = {signum: signal.getsignal(signum) for signum in ray_engine.HELD_SIGNALS}
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.signal(signal.SIGINT, before)
    assert left == handlers


JOINING_SCRIPT = """
import atexit
import os
import signal
import time

import ray._private.worker

from flows.cli_args import flow_command
from flows.config import RunConfig
from tasks.rollout import connect_run_ray

connect = ray._private.worker.connect


def connect_then_signal(*args, **kwargs):
    connect(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # at the end of ray.init, its core worker started


ray._private.worker.connect = connect_then_signal
atexit.register(time.sleep, 4)  # a flow command's exit takes seconds (its temporary Prefect server stops)


@flow_command
def main():
    connect_run_ray(RunConfig(cluster="ray", ray_address="auto"))
    print("connected", flush=True)


main()
"""


def test_a_sigterm_once_rays_core_worker_joined_a_cluster_stops_the_command_as_elsewhere(tmp_path):
    """Joining a cluster, a SIGTERM is not held: it stops the command at once. Once the core
    worker has started, it went first to the core worker's failure signal handler, whose alarm
    was left armed, so the command, still exiting 3 s later, died by SIGABRT."""
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's sockets are made below it
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"} | {
        "RAY_TMPDIR": temp_dir
    }
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"  # files: a survivor would hold a pipe open
    try:
        head = [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={free_port()}"]
        options = [
            "--num-cpus=1",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ]
        started = subprocess.run([*head, *options], env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr[-3000:]
        with stdout.open("w") as out, stderr.open("w") as err:
            command = subprocess.run(
                [sys.executable, "-c", JOINING_SCRIPT], cwd=ROOT, env=env, stdout=out, stderr=err, timeout=120
            )
    finally:
        for process in _survivors({}, temp_dir, within_s=0):  # the cluster's, started above
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert command.returncode == 128 + signal.SIGTERM, stderr.read_text()[-3000:]
    assert stderr.read_text().count("stopped by SIGTERM\n") == 1
