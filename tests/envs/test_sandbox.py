"""Sandbox attacks: each is contained, reported as a SandboxError kind, and the worker keeps serving."""

import asyncio
import concurrent.futures
import errno
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError

from envs import sandbox as sandbox_module
from envs import shell as shell_module
from envs.pyrepl import PythonRepl
from envs.sandbox import (
    UID_BASE,
    Sandbox,
    SandboxConfig,
    SandboxError,
    _unshare_net_prefix,
    bwrap_path,
    folder_path_bytes,
    python_in_sandbox,
    remove_tree,
    resolve_backend,
)
from envs.shell import MAX_CWD_BYTES, Shell, ansi_c_quote
from rollout.resources import CpuManager

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")

SMALL = SandboxConfig(
    backend="bwrap", cpu_seconds=2, memory_mb=256, max_processes=32, timeout_s=5, max_output_bytes=4096
)


def serves_after() -> None:
    with Sandbox(SMALL) as fresh:
        assert fresh.run("echo ok").output == "ok\n"


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        (":(){ :|:& };:; sleep 60", {"process_limit"}),
        ("python3 -c 'x = bytearray(2 * 1024**3)'", {"memory_limit"}),
        ("while :; do :; done", {"cpu_limit", "timeout"}),
        ("echo pwned > /etc/pwned", {"write_outside"}),
        ("yes 0123456789", {"output_limit"}),
    ],
)
def test_attack_is_contained(command, kind):
    with Sandbox(SMALL) as box, pytest.raises(SandboxError) as raised:
        box.run(command)
    assert raised.value.kind in kind, raised.value
    assert raised.value.reason
    assert not os.path.exists("/etc/pwned")
    serves_after()


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_network_is_closed(backend):
    config = SMALL.model_copy(update={"backend": backend})
    with Sandbox(config) as box:
        if backend == "process" and not _unshare_net_prefix(box.uid is not None):
            pytest.skip("unshare -n is not permitted here: the process backend keeps the network")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    accepted = []
    accepting = threading.Thread(target=lambda: accepted.append(_accept(listener)), daemon=True)
    accepting.start()
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
    with Sandbox(config) as box:
        with pytest.raises(SandboxError) as raised:
            box.run(["python3", "-c", code])
        assert raised.value.kind == "network"
        with pytest.raises(SandboxError) as outside:
            box.run(["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)"])
        assert outside.value.kind == "network"
    accepting.join(timeout=60)  # its accept times out 0.5 s after the last attempt could connect
    listener.close()
    assert accepted == [None]
    serves_after()


def _accept(listener):
    try:
        return listener.accept()
    except OSError:
        return None


def test_write_outside_leaves_host_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("safe")
    with Sandbox(SMALL) as box:
        hidden = box.run(f"echo pwned > {victim}")
        assert hidden.exit_code != 0 and "No such file or directory" in hidden.output
        with pytest.raises(SandboxError) as raised:
            box.run("touch /usr/pwned")
        assert raised.value.kind == "write_outside"
        box.run("echo mine > inside.txt")
        assert (Path(box.workdir) / "inside.txt").read_text() == "mine\n"
    assert victim.read_text() == "safe"
    assert not os.path.exists("/usr/pwned")


def test_code_in_a_sandbox_cannot_make_a_user_namespace_of_its_own():
    """A user namespace of its own gives sandboxed code root's capabilities over new mount,
    network and PID namespaces, and the kernel's namespaced-root code paths as attack surface:
    nothing a tool call or test run needs."""
    with Sandbox(SMALL) as box:
        assert box.run("id -u").exit_code == 0
        nested = box.run("unshare --user --map-root-user id -u")
        assert nested.exit_code != 0, nested.output
        assert "unshare failed" in nested.output
    serves_after()


@pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need a root worker")
@pytest.mark.parametrize("sandbox_uid_may", [True, False])
def test_whether_bwrap_may_disable_user_namespaces_is_asked_as_the_user_it_runs_as(
    monkeypatch, sandbox_uid_may
):
    """A root worker runs bwrap as a sandbox uid. Where root may make a user namespace and that
    uid may not (a setuid bwrap, unprivileged user namespaces off), a probe run as root said
    yes, and every sandbox would then fail to start on ``--unshare-user``."""
    run = subprocess.run

    def refused_to_the_sandbox_uid(argv, **kwargs):
        if argv[0] == "setpriv" and "--disable-userns" in argv and not sandbox_uid_may:
            return subprocess.CompletedProcess(argv, 1, b"", b"bwrap: No permissions to create new namespace")
        return run(argv, **kwargs)

    monkeypatch.setattr(sandbox_module.subprocess, "run", refused_to_the_sandbox_uid)
    sandbox_module._bwrap_takes.cache_clear()
    sandbox_module._bwrap_disables_userns.cache_clear()
    try:
        with Sandbox(SMALL) as box:
            assert box.uid is not None
            assert ("--disable-userns" in box.argv(["true"])) == sandbox_uid_may
    finally:
        sandbox_module._bwrap_takes.cache_clear()
        sandbox_module._bwrap_disables_userns.cache_clear()


def test_without_violations_are_errors_a_write_outside_is_plain_output():
    with Sandbox(SMALL.model_copy(update={"violations_are_errors": False})) as box:
        ran = box.run("touch /usr/pwned")
        assert ran.exit_code != 0 and "Read-only file system" in ran.output
        shell = Shell(box).run("touch /usr/pwned")
        assert shell.exit_code != 0 and "Read-only file system" in shell.output
        repl = PythonRepl(box).run("open('/usr/pwned', 'w')")
        assert repl.error == "OSError" and "Read-only file system" in repl.output
    assert not os.path.exists("/usr/pwned")


def test_memory_backed_dev_holds_at_most_memory_mb():
    """bwrap's /dev is a tmpfs: files written there take the worker's memory, which no rlimit
    counts. It was writable, up to half the host's memory per sandbox; now only /dev/shm is,
    capped at memory_mb, and POSIX semaphores still work."""
    config = SMALL.model_copy(update={"memory_mb": 32, "file_size_mb": 8})
    with Sandbox(config) as box:
        filled = box.run(
            "for i in $(seq 8); do head -c 8M /dev/zero > /dev/shm/f$i; done 2>/dev/null;"
            "du -sm /dev/shm | cut -f1; touch /dev/mine 2>/dev/null && echo wrote /dev; true"
        )
        assert int(filled.output.split()[0]) <= 32, filled.output
        assert "wrote /dev" not in filled.output
        box.run("rm /dev/shm/*")
        assert box.run("python3 -c 'import multiprocessing; multiprocessing.Lock()'").exit_code == 0


WRITE_2_MIB = "open('big', 'wb').write(b'x' * (2 << 20))"


@pytest.mark.parametrize(
    ("start", "command"),
    [
        (None, ["python3", "-c", WRITE_2_MIB]),
        (None, "head -c 2M /dev/zero > big 2>/dev/null"),
        (Shell, f"python3 -c {ansi_c_quote(WRITE_2_MIB)}"),
        (Shell, "head -c 2M /dev/zero > big 2>/dev/null"),
        (PythonRepl, WRITE_2_MIB),
    ],
    ids=["run-python", "run-head", "shell-python", "shell-head", "repl"],
)
def test_a_file_past_file_size_mb_is_a_file_size_limit_wherever_it_is_written(start, command):
    """Python ignores SIGXFSZ, so its write fails with EFBIG ('File too large') instead of
    the kill; so did every command of the shell, which inherited that from the worker (head,
    its error discarded, exited 1 as any failing command)."""
    with Sandbox(SMALL.model_copy(update={"file_size_mb": 1})) as box:
        with pytest.raises(SandboxError) as raised:
            (box if start is None else start(box)).run(command)
        assert raised.value.kind == "file_size_limit", raised.value
        assert os.path.getsize(os.path.join(box.workdir, "big")) <= 1 << 20


def test_background_processes_are_killed():
    box = Sandbox(SMALL)
    shell = Shell(box)
    nonce = uuid.uuid4().int % 10**9
    mine = (f"sleep 300.{nonce}", f"sleep 301.{nonce}")
    shell.run(f"{mine[0]} & setsid {mine[1]} & disown -a; echo started")
    if box.uid is not None:  # a sandbox without a uid of its own counts none
        assert box.leftover_processes() >= 3
    # "started" can come back before the forked children have exec'd their sleeps
    deadline = time.monotonic() + 30
    while len(pids := _pids_running(mine)) < len(mine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids) == len(mine)
    box.close()
    deadline = time.monotonic() + 5
    while (
        any(os.path.exists(f"/proc/{p}") and _cmdline(str(p)) for p in pids) and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}") and _cmdline(str(p))]
    assert not os.path.exists(box.workdir)
    serves_after()


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_a_job_a_command_moved_to_its_own_group_ends_with_the_command(backend):
    """Job control (``set -m``) starts each background job in a process group of its own:
    without bwrap's PID namespace, killing the command's group alone left it running."""
    nonce = uuid.uuid4().int % 10**9
    mine = (f"sleep 302.{nonce}",)
    with Sandbox(SMALL.model_copy(update={"backend": backend})) as box:
        box.run(f"exec >/dev/null 2>&1; set -m; {mine[0]} & sleep 0.5")
        deadline = time.monotonic() + 5  # a SIGKILLed process (bwrap: a whole namespace) takes a moment to go
        while _pids_running(mine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pids_running(mine) == []


def _pids_running(cmdlines: tuple[str, ...]) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).strip() in cmdlines]


def _stopped_under(root: int) -> bool:
    """Whether a process below ``root`` is stopped by a signal (state T)."""
    parents, stopped = {}, []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                state, ppid = handle.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        parents[int(name)] = int(ppid)
        if state == "T":
            stopped.append(int(name))
    for pid in stopped:
        while pid in parents and pid != root:
            pid = parents[pid]
        if pid == root:
            return True
    return False


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_timeout_kills_and_reports():
    with Sandbox(SMALL) as box, pytest.raises(SandboxError) as raised:
        box.run("sleep 30", timeout=0.5)
    assert raised.value.kind == "timeout"
    assert "its 0.5 s wall-clock limit" in str(raised.value)  # the run's limit, not timeout_s


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_timeout_holds_after_stdout_closes(backend):
    with Sandbox(SMALL.model_copy(update={"backend": backend})) as box:
        started = time.monotonic()
        with pytest.raises(SandboxError) as raised:
            box.run("exec >/dev/null 2>&1; sleep 300", timeout=0.5)
        assert raised.value.kind == "timeout"
        # far below the sleep, far above a loaded machine's sandbox start and kill
        assert time.monotonic() - started < 60


def test_timeout_holds_while_stdin_is_unread():
    started = time.monotonic()
    with Sandbox(SMALL) as box, pytest.raises(SandboxError) as raised:
        box.run("sleep 300", timeout=1, stdin=b"x" * 1_000_000)
    assert raised.value.kind == "timeout"
    assert time.monotonic() - started < 60
    serves_after()


def test_a_wall_clock_limit_longer_than_poll_can_wait_runs_commands():
    """``timeout_s`` above 2**31 ms (about 25 days: "no limit to speak of") made every
    command, shell and interpreter raise ``OverflowError: timeout is too large`` from poll."""
    with Sandbox(SMALL.model_copy(update={"timeout_s": 1e7})) as box:
        assert box.run("echo run").output == "run\n"
        assert Shell(box).run("echo shell").output == "shell\n"
        assert PythonRepl(box).run("'repl'").output == "'repl'\n"


def test_commands_run_while_the_worker_holds_over_1024_descriptors():
    """select() refuses a descriptor past FD_SETSIZE; a busy worker's pipes and ptys get there."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("the descriptor limit is too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with Sandbox(SMALL) as box:
            assert box.run("echo hi").output == "hi\n"
            assert box.run("cat", stdin=b"fed").output == "fed"
            assert PythonRepl(box).run("6 * 7").output == "42\n"
            assert Shell(box).run("echo $((6 * 7))").output.strip() == "42"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_close_during_run_reports_died():
    box = Sandbox(SMALL)
    raised = []

    def run():
        try:
            box.run("sleep 30", timeout=20)
        except SandboxError as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 5
    while not box.running and time.monotonic() < deadline:
        time.sleep(0.01)
    box.close()
    thread.join(10)
    assert [exc.kind for exc in raised] == ["died"]


def test_shell_persists_state_and_reports_exit_status():
    with Sandbox(SMALL) as box:
        shell = Shell(box)
        shell.run("mkdir sub && cd sub && export GREETING=hi")
        result = shell.run("echo $GREETING from $(basename $PWD); (exit 3)")
        assert (result.output, result.exit_code) == ("hi from sub\n", 3)
        tricky = "printf '%s\\n' \"a'b\" 'c\"d' \\\\ \x1eTRDdeadbeef:0\x1e; echo tail"
        result = shell.run(tricky)
        assert result.output.endswith("tail\n") and result.exit_code == 0
        assert shell.run("cat", timeout=2).output == ""


def test_a_command_that_resets_the_terminal_leaves_the_next_commands_as_they_were():
    """A command that set the terminal back to its defaults (``reset``, ``stty sane``) left
    echo on, so every later command showed in its own output, and canonical mode, where a
    command line past 4095 bytes was cut and never ended (a timeout)."""
    with Sandbox(SMALL) as box:
        shell = Shell(box)
        shell.run("stty sane <&2")
        assert shell.run("echo hi").output == "hi\n"
        long = "x" * 5000
        assert shell.run(f"echo {long} | wc -c").output == "5001\n"


def test_shell_dies_on_gigabytes_and_infinite_loop():
    with Sandbox(SMALL) as box:
        shell = Shell(box)
        with pytest.raises(SandboxError) as raised:
            shell.run("head -c 2000000000 /dev/zero | tr '\\0' x")
        assert raised.value.kind == "output_limit"
        assert not shell.alive
        shell = Shell(box)
        with pytest.raises(SandboxError) as raised:
            shell.run("while :; do :; done")
        assert raised.value.kind in {"cpu_limit", "timeout"}
        assert Shell(box).run("echo back").output == "back\n"


FORK_LOOP = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"


@pytest.mark.parametrize(
    ("start", "bomb", "probe"),
    [(Shell, f"python3 -c {ansi_c_quote(FORK_LOOP)}", "echo 7"), (PythonRepl, FORK_LOOP, "7")],
)
def test_a_shell_or_interpreter_killed_with_every_process_slot_taken_starts_afresh(start, bomb, probe):
    """Killing the tree takes a moment (bwrap's namespace dies after its outer process), and its
    processes count against max_processes until then: an interpreter started at once failed
    ('died', status 1), which pytool raised out of the step as the env's failure."""
    with Sandbox(SMALL) as box:
        with pytest.raises(SandboxError) as raised:
            start(box).run(bomb, timeout=2)
        assert raised.value.kind == "timeout"
        assert start(box).run(probe).output == "7\n"


FORK_CHILDREN = """
import os, sys, time
children = []
for _ in range(int(sys.argv[1])):
    try:
        pid = os.fork()
    except OSError as exc:
        print(exc.strerror)
        break
    if pid == 0:
        time.sleep(2)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
print(len(children), "forked")
"""


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_max_processes_counts_the_commands_processes_alone_on_every_backend(backend):
    """bwrap's outer process and its PID namespace's init run under the sandbox's uid: counted
    against ``max_processes``, they left a bwrap command two processes fewer than a
    process-backend one (at the lowest setting, 4, a shell with three children failed)."""
    config = SMALL.model_copy(update={"backend": backend, "max_processes": 4})
    # a sandbox each: a bwrap command's processes take a moment to go once it ended
    with Sandbox(config) as box:
        assert box.run(["python3", "-c", FORK_CHILDREN, "3"]).output == "3 forked\n"
    with Sandbox(config) as box:
        assert box.run(["python3", "-c", FORK_CHILDREN, "4"]).output == (
            "Resource temporarily unavailable\n3 forked\n"
        )


@pytest.mark.parametrize(
    ("start", "lock", "probe"),
    [(Shell, "chmod 000 .; exit", "echo 7"), (PythonRepl, "import os; os.chmod('.', 0); os._exit(0)", "7")],
)
def test_a_shell_or_interpreter_that_locked_its_folder_and_died_starts_afresh(start, lock, probe):
    """A command that took the working directory's permissions (``chmod 000 .``) left no
    process able to start there: the shell or interpreter started in place of the dead one
    could not enter it ('died', status 1), which the env raised as its own failure."""
    with Sandbox(SMALL) as box:
        with pytest.raises(SandboxError) as raised:
            start(box).run(lock)
        assert raised.value.kind == "died"
        assert start(box).run(probe).output == "7\n"


def test_a_closed_or_killed_shell_or_interpreter_is_no_longer_tracked():
    """Once reaped, its pid can lead another process's group by the time the sandbox
    closes, and closing the sandbox SIGKILLs the group of every pid it tracks."""
    with Sandbox(SMALL) as box:
        shell, repl = Shell(box), PythonRepl(box)
        assert sorted(box.running) == sorted([shell.proc.pid, repl.proc.pid])
        shell.close()
        repl.close()
        assert box.running == []
        shell = Shell(box)
        with pytest.raises(SandboxError):
            shell.run("yes 0123456789")
        repl = PythonRepl(box)
        with pytest.raises(SandboxError):
            repl.run("import __main__; __main__.proto.write('forged\\n'); __main__.proto.flush()")
        assert not shell.alive and not repl.alive
        assert box.running == []


@pytest.mark.parametrize(
    ("start", "command"), [(Shell, "sleep 60"), (PythonRepl, "import time; time.sleep(60)")]
)
def test_closing_a_shell_or_interpreter_under_a_run_never_lets_the_run_read_another_descriptor(
    start, command, monkeypatch
):
    """A step's thread runs on when its caller is cancelled (a rollout cancelled or out of
    time), and the env's cleanup closes the shell or interpreter from another thread meanwhile.
    Its descriptor was closed under the run, whose next read took whatever descriptor the
    worker opened next under that number: another rollout's pipe, whose data it swallowed.
    The run here is held just before its read until the close has returned (or, once close
    waits for the run, for a while), and the next descriptor is made to take the number."""
    module = sys.modules[start.__module__]
    real_read_some = module.read_some
    reading, go_on = threading.Event(), threading.Event()
    read_fds, outcome = [], []

    def held_read_some(fd, deadline, wake=None):
        if threading.current_thread() is runner:
            read_fds.append(fd)
            reading.set()
            go_on.wait(3)  # a close that waits for the run waits this long, then the run reads
        return real_read_some(fd, deadline, wake)

    def run():
        try:
            outcome.append(process.run(command))
        except SandboxError as exc:
            outcome.append(exc)

    with Sandbox(SMALL.model_copy(update={"timeout_s": 30})) as box:
        process = start(box)
        monkeypatch.setattr(module, "read_some", held_read_some)
        runner = threading.Thread(target=run)
        runner.start()
        reading.wait()
        closer = threading.Thread(target=process.close)
        closer.start()
        closer.join()
        other, writer = os.pipe()
        taken = []
        while read_fds[0] not in taken:  # the lowest free number: the run's, once it is closed
            taken.append(os.dup(other))
        os.write(writer, b"another rollout's data")
        go_on.set()
        runner.join()
        os.set_blocking(other, False)
        assert os.read(other, 100) == b"another rollout's data"
        assert len(outcome) == 1 and isinstance(outcome[0], SandboxError)
        for fd in (other, writer, *taken):
            os.close(fd)


ESCAPE = "setsid sh -c 'echo $$ > escaped.tmp; mv escaped.tmp escaped; exec sleep 120' &"
ESCAPED_FORK = """
import os, time
if os.fork() == 0:
    os.setsid()
    with open("escaped.tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.rename("escaped.tmp", "escaped")
    time.sleep(120)
"""


def _escaped(box: Sandbox) -> int:
    """The pid a command that left its session wrote to ``escaped`` in the working directory."""
    pid_file = Path(box.workdir, "escaped")
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return int(pid_file.read_text())


def _assert_close_wakes_the_run(process: Shell | PythonRepl, runner: threading.Thread, outcome: list) -> None:
    """``process.close()`` under the run in ``runner`` returns well before the run's 60 s
    timeout, and the run ends ``died``."""
    started = time.monotonic()
    process.close()
    closed_in = time.monotonic() - started
    runner.join()
    assert closed_in < 30, f"close() waited {closed_in:.1f} s for the run"
    assert len(outcome) == 1 and isinstance(outcome[0], SandboxError)
    assert outcome[0].kind == "died"


@pytest.mark.parametrize(
    ("start", "command"),
    [
        (Shell, f"{ESCAPE} sleep 120"),
        (PythonRepl, ESCAPED_FORK + "time.sleep(120)"),
    ],
)
def test_closing_a_shell_or_interpreter_under_a_run_returns_while_an_escaped_process_holds_its_output(
    start, command
):
    """A command can leave the session (``setsid``, a daemon) with the pty or pipe still open:
    under the process backend the kill cannot reach it, the run in flight on another thread
    never reads EOF, and close(), which closes the descriptors only once the run has let go,
    waited out the run's whole timeout. It wakes the run instead."""
    outcome = []

    def run():
        try:
            outcome.append(process.run(command))
        except SandboxError as exc:
            outcome.append(exc)

    with Sandbox(SMALL.model_copy(update={"backend": "process", "timeout_s": 60})) as box:
        process = start(box)
        runner = threading.Thread(target=run)
        runner.start()
        escaped = _escaped(box)
        try:
            _assert_close_wakes_the_run(process, runner, outcome)
        finally:
            os.kill(escaped, signal.SIGKILL)


def _shell_stopped(process: Shell, box: Sandbox) -> bool:
    return _stopped_under(process.proc.pid)


def _interpreter_asleep(process: PythonRepl, box: Sandbox) -> bool:
    return os.path.exists(os.path.join(box.workdir, "asleep"))


@pytest.mark.parametrize(
    ("start", "setup", "halted"),
    [
        (Shell, f"{ESCAPE} (sleep 1; kill -STOP $$) &", _shell_stopped),
        (
            PythonRepl,
            ESCAPED_FORK
            + "import signal\n"
            + "signal.signal(signal.SIGALRM, lambda *a: (open('asleep', 'w').close(), time.sleep(10**6)))\n"
            + "signal.alarm(1)",
            _interpreter_asleep,
        ),
    ],
)
def test_closing_a_shell_or_interpreter_under_a_run_returns_while_an_escaped_process_holds_its_input(
    start, setup, halted, monkeypatch
):
    """The shell or interpreter stopped reading, and a process that left its session holds
    the pty or pipe open: the run's write of a call bigger than the buffer waits, and the
    kill cannot end that wait. close() wakes the run rather than waiting out its timeout."""
    module = sys.modules[start.__module__]
    real_write_all = module.write_all
    writing, outcome = threading.Event(), []

    def signalled_write_all(*args):
        writing.set()
        return real_write_all(*args)

    def run():
        try:
            outcome.append(process.run("x = '" + "a" * 200_000 + "'"))
        except SandboxError as exc:
            outcome.append(exc)

    with Sandbox(SMALL.model_copy(update={"backend": "process", "timeout_s": 60})) as box:
        process = start(box)
        process.run(setup)
        escaped = _escaped(box)
        try:
            deadline = time.monotonic() + 30
            while not halted(process, box) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert halted(process, box), "the shell or interpreter never stopped reading"
            monkeypatch.setattr(module, "write_all", signalled_write_all)
            runner = threading.Thread(target=run)
            runner.start()
            writing.wait()
            _assert_close_wakes_the_run(process, runner, outcome)
        finally:
            os.kill(escaped, signal.SIGKILL)


@pytest.mark.parametrize("start", [Shell, PythonRepl])
def test_a_second_close_never_kills_the_group_of_the_pid_the_first_one_reaped(start, monkeypatch):
    """Two closes at once (a timed-out run's and the env's cleanup): the second passed its
    unlocked check, the first reaped the process, and the second then killed the group of
    the reaped pid, which may lead another process's group by then. The second close's kill
    is held until the first close has returned (or, once reaping waits for the kill, for a
    while); the pid must still be the process's own when it is killed."""
    module = sys.modules[start.__module__]
    real_kill_group = module.kill_group
    killing, first_done = threading.Event(), threading.Event()
    unreaped_at_kill = []

    def held_kill_group(pid):
        if threading.current_thread() is second:
            killing.set()
            first_done.wait(3)
            unreaped_at_kill.append(os.path.exists(f"/proc/{pid}"))
        real_kill_group(pid)

    with Sandbox(SMALL) as box:
        process = start(box)
        monkeypatch.setattr(module, "kill_group", held_kill_group)
        second = threading.Thread(target=process.close)
        second.start()
        killing.wait()
        process.close()
        first_done.set()
        second.join()
        assert unreaped_at_kill == [True]


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_closing_reaps_the_shell_and_interpreter_it_kills(backend):
    """A sandbox closed with its shell and interpreter still open (their owners never close
    them) leaves no zombie behind in a long-lived worker, even from an interpreter that
    ignores SIGTERM."""
    box = Sandbox(SMALL.model_copy(update={"backend": backend}))
    shell, repl = Shell(box), PythonRepl(box)
    repl.run("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    box.close()
    assert repl.proc.returncode == -signal.SIGKILL
    assert shell.proc.terminated and shell.proc.signalstatus == signal.SIGKILL
    assert not os.path.exists(f"/proc/{repl.proc.pid}") and not os.path.exists(f"/proc/{shell.proc.pid}")
    for stream in (repl.proc.stdin, repl.proc.stdout):
        stream.close()
    shell.proc.close()


def test_closing_removes_a_workdir_nested_past_pythons_recursion_limit():
    with Sandbox(SMALL) as box:
        box.run("python3 -c \"import os\nfor _ in range(1500): os.mkdir('d'); os.chdir('d')\"; touch leaf")
        workdir = box.workdir
        assert os.path.lexists(os.path.join(workdir, *["d"] * 10))
    assert not os.path.lexists(workdir)


def _gone(path: str) -> bool:
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    return False


def test_a_folder_a_command_locked_its_owner_out_of_is_removed():
    """``chmod 000`` refuses entry to its owner unless the owner is root, so the removal runs
    as a uid that is not root: the worker's own, or, for a root worker, ``nobody`` (in a
    folder it can reach: pytest's own temporary folders are private to root)."""
    top = tempfile.mkdtemp(prefix="treadle-locked-")
    tree = Path(top) / "workdir"
    locked = [tree / "locked", tree / "locked" / "inner"]
    locked[1].mkdir(parents=True)
    (locked[1] / "file").write_text("x")
    try:
        if os.geteuid() != 0:
            for folder in reversed(locked):
                folder.chmod(0)
            remove_tree(str(tree))
            assert _gone(str(tree))
            return
        nobody = 65534
        for path in (Path(top), tree, *locked, locked[1] / "file"):
            os.chown(path, nobody, nobody)
        for folder in reversed(locked):
            folder.chmod(0)
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setresgid(nobody, nobody, nobody)
                os.setresuid(nobody, nobody, nobody)
                if _gone(str(tree)):
                    os._exit(3)  # the tree must be within its reach
                remove_tree(str(tree))
                os._exit(0)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _gone(str(tree))
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.parametrize("backend", ["bwrap", "process"])  # bwrap's outer process holds the output open
def test_a_command_whose_exit_has_no_descriptor_to_wait_on_is_polled(monkeypatch, backend):
    """With the worker out of descriptors (EMFILE), ``pidfd_open`` fails: the command's
    exit is then polled, not lost as an ``OSError``."""

    def out_of_descriptors(pid, flags=0):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(os, "pidfd_open", out_of_descriptors)
    with Sandbox(SMALL.model_copy(update={"backend": backend})) as box:
        result = asyncio.run(box.run_async("sleep 0.2; echo done; exit 3"))
        assert (result.output, result.exit_code) == ("done\n", 3)
        started = time.monotonic()
        with pytest.raises(SandboxError) as raised:
            asyncio.run(box.run_async("exec >/dev/null 2>&1; sleep 300", timeout=1))
        assert raised.value.kind == "timeout"
        assert time.monotonic() - started < 60  # far below the sleep, far above a loaded start and kill
        assert box.running == []


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_a_command_cancelled_on_the_event_loop_is_killed_and_reaped(backend):
    """A rollout cancelled while its env awaits a command (the agent's program): the command
    is killed and reaped, not left a zombie for the garbage collector to find."""

    async def cancel(box: Sandbox) -> None:
        command = asyncio.create_task(box.run_async("sleep 60"))
        while not box.running:
            await asyncio.sleep(0.01)
        (pid,) = box.running
        command.cancel()
        with pytest.raises(asyncio.CancelledError):
            await command
        assert not os.path.exists(f"/proc/{pid}")  # while the cancelled task still holds its Popen

    with Sandbox(SMALL.model_copy(update={"backend": backend})) as box:
        asyncio.run(cancel(box))


def test_a_command_cancelled_while_it_starts_is_killed_and_reaped():
    """A cancel that came while the command's start ran on its thread dropped the started
    command: it ran on, its output pipe open, until the whole sandbox closed."""

    async def cancel(box: Sandbox) -> None:
        command = asyncio.create_task(box.run_async("sleep 60"))
        await asyncio.sleep(0)  # the task is now waiting on its start thread
        command.cancel()
        with pytest.raises(asyncio.CancelledError):
            await command
        await asyncio.get_running_loop().shutdown_default_executor()  # every start has returned
        assert box.running == []

    with Sandbox(SMALL) as box:
        asyncio.run(cancel(box))


IN_A_USER_NAMESPACE = """
import sys
from envs.pyrepl import PythonRepl
from envs.sandbox import Sandbox, SandboxConfig
from envs.shell import Shell

with Sandbox(SandboxConfig(backend="bwrap", root_dir=sys.argv[1])) as box:
    print(box.uid, box.run("id -u").output.strip(), Shell(box).run("echo sh").output.strip())
    print(PythonRepl(box).run("6 * 7").output.strip())
"""


def test_a_root_worker_whose_user_namespace_maps_few_uids_runs_its_sandboxes_as_itself(tmp_path):
    """A rootless or user-namespaced container maps some thousands of uids, not the per-sandbox
    uids (2,000,000,000 + ...): giving the working directory to one failed (EINVAL), so every
    sandbox of a root worker there failed to start, each leaving its folder behind. Here the
    namespace maps root alone."""
    namespace = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    if subprocess.run([*namespace, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a user namespace here")
    ran = subprocess.run(
        [*namespace, sys.executable, "-c", IN_A_USER_NAMESPACE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == ["None", "0", "sh", "42"]
    assert "does not map uids" in ran.stderr
    assert os.listdir(tmp_path) == []


WORKER_HOLDING_A_SANDBOX = """
import sys, time
from envs.sandbox import Sandbox, SandboxConfig

box = Sandbox(SandboxConfig(backend="process", root_dir=sys.argv[1]))
open(box.workdir + "/left.txt", "w").close()
print(box.workdir, flush=True)
time.sleep(600)
"""


def test_a_new_sandbox_removes_the_folders_of_a_worker_killed_with_sigkill_and_no_other(tmp_path):
    """A worker killed with SIGKILL never closes its sandboxes, and nothing removed their
    folders. The first sandbox a worker makes under a root removes those whose owner is dead,
    and keeps a live worker's folders and folders that name no owner."""
    killed, live = (
        subprocess.Popen(
            [sys.executable, "-c", WORKER_HOLDING_A_SANDBOX, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    )
    abandoned, held = (worker.stdout.readline().strip() for worker in (killed, live))
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert os.path.exists(os.path.join(abandoned, "left.txt"))
        unmarked = tmp_path / "treadle-sbx-unmarked"
        unmarked.mkdir()
        with Sandbox(SMALL.model_copy(update={"root_dir": str(tmp_path)})) as box:
            left = sorted(os.listdir(tmp_path))
            assert left == sorted(map(os.path.basename, [held, str(unmarked), box.workdir]))
    finally:
        live.kill()
        live.wait()
        live.stdout.close()
        killed.stdout.close()


def test_a_sandbox_folder_whose_owners_pid_runs_a_later_process_is_abandoned(tmp_path):
    """A pid is reused: the folder of a dead worker whose pid a process started since has
    (here this one) is removed; one recording this process's own start is kept. The dead
    worker's start is a real one, a process started after this one: a start time read from
    the wrong field of ``/proc/<pid>/stat`` would be the same for both."""
    later = subprocess.Popen(["sleep", "60"])
    try:
        later_start = sandbox_module._start_time(later.pid)
    finally:
        later.kill()
        later.wait()
    prefix = f"treadle-sbx-{sandbox_module._host_key()}-{os.getpid()}-"
    reused, reused_later, own = (
        tmp_path / f"{prefix}1-reused",
        tmp_path / f"{prefix}{later_start}-reused",
        tmp_path / f"{prefix}{sandbox_module._start_time(os.getpid())}-own",
    )
    for folder in (reused, reused_later, own):
        folder.mkdir()
    assert sorted(sandbox_module.sweep_abandoned(str(tmp_path))) == sorted([str(reused), str(reused_later)])
    assert os.listdir(tmp_path) == [own.name]


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another uid")
def test_only_folders_of_dead_workers_this_worker_may_remove_are_swept(tmp_path, monkeypatch):
    """A file or a link named as a dead worker's folder is no sandbox folder (a link in a shared
    temp dir may point anywhere): it stays. A worker that is not root leaves another user's
    folders, which it could not remove, to their owner; a root worker removes them."""
    dead = f"treadle-sbx-{sandbox_module._host_key()}-{os.getpid()}-1-"
    target = tmp_path / "target"
    target.mkdir()
    (target / "kept.txt").write_text("kept")
    (tmp_path / f"{dead}file").write_text("not a folder")
    (tmp_path / f"{dead}link").symlink_to(target)
    (tmp_path / f"{dead}others").mkdir()
    os.chown(tmp_path / f"{dead}others", 65534, 65534)
    with monkeypatch.context() as not_root:
        not_root.setattr(os, "geteuid", lambda: 1000)
        assert sandbox_module.sweep_abandoned(str(tmp_path)) == []
    assert sandbox_module.sweep_abandoned(str(tmp_path)) == [str(tmp_path / f"{dead}others")]
    assert sorted(os.listdir(tmp_path)) == sorted([f"{dead}file", f"{dead}link", "target"])
    assert (target / "kept.txt").read_text() == "kept"


def test_a_sandbox_without_root_dir_sweeps_the_system_temp_dir(tmp_path, monkeypatch):
    """With no ``root_dir`` the sandbox folders go to the system temp dir: a dead worker's
    folders there are removed too."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sandbox_module, "_swept_roots", set())
    dead = tmp_path / f"treadle-sbx-{sandbox_module._host_key()}-{os.getpid()}-1-dead"
    dead.mkdir()
    with Sandbox(SMALL) as box:
        assert os.listdir(tmp_path) == [os.path.basename(box.workdir)]


def test_the_path_length_of_a_sandbox_folder_is_told_for_a_root_dir_behind_a_link(tmp_path):
    """``folder_path_bytes`` (what the run checks a socket path against) is the length of the
    sandbox folder's real path: a ``root_dir`` given through a link is resolved as the folder is."""
    real = tmp_path / ("long-real-folder-" + "r" * 40)
    real.mkdir()
    link = tmp_path / "l"
    link.symlink_to(real)
    with Sandbox(SMALL.model_copy(update={"root_dir": str(link)})) as box:
        assert folder_path_bytes(str(link)) == len(os.fsencode(box.workdir))


@pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need a root worker")
def test_a_sandbox_whose_folder_cannot_be_given_to_its_uid_leaves_no_folder(tmp_path, monkeypatch):
    """The chown of the working directory fails (a root_dir on NFS that squashes root): the
    folder made for the sandbox was left behind, one per sandbox that could not start."""

    def refused(*args):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "chown", refused)
    with pytest.raises(PermissionError):
        Sandbox(SMALL.model_copy(update={"root_dir": str(tmp_path)}))
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need a root worker")
def test_live_sandboxes_never_share_a_uid(monkeypatch):
    draws = iter([5, 5, 7, 9, 11, 5])
    monkeypatch.setattr(secrets, "randbelow", lambda n: next(draws))
    user = ["setpriv", f"--reuid={UID_BASE + 9}", f"--regid={UID_BASE + 9}", "--clear-groups"]
    stray = subprocess.Popen([*user, "sh", "-c", "echo ready; exec sleep 60"], stdout=subprocess.PIPE)
    assert stray.stdout.readline() == b"ready\n"  # it runs as uid 9 by now
    boxes = []
    try:
        boxes += [Sandbox(SMALL), Sandbox(SMALL)]
        assert [box.uid - UID_BASE for box in boxes] == [5, 7]
        boxes.append(Sandbox(SMALL))
        assert boxes[-1].uid - UID_BASE == 11  # a process still runs as 9
        boxes[0].close()
        boxes.append(Sandbox(SMALL))
        assert boxes[-1].uid - UID_BASE == 5
    finally:
        stray.kill()
        stray.wait()
        stray.stdout.close()
        for box in boxes:
            box.close()


ANOTHER_WORKER = """
import secrets, sys
secrets.randbelow = lambda n: 5
from envs.sandbox import Sandbox, SandboxConfig
box = Sandbox(SandboxConfig(backend="bwrap"))
print(box.uid, flush=True)
sys.stdin.read()
box.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need a root worker")
def test_a_uid_another_worker_holds_for_a_sandbox_that_runs_nothing_yet_is_not_claimed(monkeypatch):
    """Env workers on one node (Ray actors) each claimed uids alone: a sandbox of one that ran
    nothing yet (a code env's until its tests run) had its uid claimed by another, and the
    first of the two closed killed the other's commands (close() kills every process of its uid)."""
    other = subprocess.Popen(
        [sys.executable, "-c", ANOTHER_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline().strip() == str(UID_BASE + 5)
        draws = iter([5, 7])
        monkeypatch.setattr(secrets, "randbelow", lambda n: next(draws))
        with Sandbox(SMALL) as box:
            assert box.uid == UID_BASE + 7
    finally:
        other.communicate(timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need a root worker")
def test_a_sandbox_that_cannot_claim_its_uid_leaves_no_working_folder(monkeypatch, tmp_path):
    """A worker out of file descriptors cannot open the uid's claim: the sandbox is refused
    with that error, and the folder made for it is removed."""

    def no_descriptors(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(socket, "socket", no_descriptors)
    with pytest.raises(OSError, match="Too many open files"):
        Sandbox(SMALL.model_copy(update={"root_dir": str(tmp_path)}))
    assert os.listdir(tmp_path) == []


def test_shell_output_cap_is_exact():
    """A command that printed a few bytes past the cap and ended came back whole, its end
    marker read before the cap was checked; it is an output_limit with the first ``cap``
    bytes, and the shell, whose command is over, lives on."""
    cap = SMALL.max_output_bytes
    with Sandbox(SMALL) as box:
        shell = Shell(box)
        assert shell.run(f"head -c {cap} /dev/zero | tr '\\0' x").output == "x" * cap
        with pytest.raises(SandboxError) as raised:
            shell.run(f"head -c {cap + 1} /dev/zero | tr '\\0' x")
        assert raised.value.kind == "output_limit"
        assert raised.value.output == "x" * cap
        assert shell.run("echo ok").output == "ok\n"


def test_a_command_cannot_read_its_end_marker_from_the_terminal_to_fake_it():
    """bash reads its input 1024 bytes at a time, and runs a complete line at once: the end
    marker's ``printf``, sent on a line of its own, stayed in the terminal when the command's
    line ended within the first read, where the command could read it (from its stdout or
    stderr, the terminal) and print the marker, nonce and all, with the exit status it chose.
    Here for each length of a command around that read's end."""
    spoof = 'IFS= read -r -t 0.01 t <&2; n=${t#*TRD}; printf "\\036TRD%s:0:\\036" "${n%%:*}"; (exit 3) #'
    with Sandbox(SMALL) as box:
        shell = Shell(box)
        for size in range(1030, 960, -1):
            command = spoof + "x" * (size - len(ansi_c_quote(spoof)))
            assert len(ansi_c_quote(command)) == size
            assert shell.run(command).exit_code == 3, size


@pytest.mark.parametrize(
    ("hider", "shown"),
    [
        ("exec >out.log 2>&1; echo hidden", ""),
        ("exec >&- 2>&-; echo hidden", ""),
        ("printf() { :; }; echo() { :; }", ""),
        ("ulimit -n 32", "kept from sub\n"),
    ],
)
def test_a_command_that_sends_its_output_elsewhere_leaves_the_end_marker_reachable(hider, shown):
    """The end marker was printed to whatever stdout the shell had: a command that moved it
    (``exec >out.log 2>&1``, common in scripts) or shadowed ``printf`` with a function hid the
    marker of every command after it, each a timeout that killed the shell and its state.
    What such a command prints goes where it said, and the exit status still comes back; one
    that lowers the descriptor limit below the marker's keeps it."""
    with Sandbox(SMALL) as box:
        shell = Shell(box)
        shell.run("mkdir sub && cd sub && X=kept")
        assert shell.run(hider, timeout=2).output == ""
        result = shell.run("echo $X from $(basename $PWD); (exit 3)", timeout=2)
        assert (result.output, result.exit_code, shell.alive) == (shown, 3, True)
        if "out.log" in hider:
            with open(os.path.join(box.workdir, "sub", "out.log")) as log:
                assert log.read() == "hidden\nkept from sub\n"
        if hider.startswith("printf"):
            assert shell.run("builtin echo $X").output == "kept\n"


@pytest.mark.parametrize(
    "definition", ["eval() { echo hijacked; }", "alias eval='echo hijacked'", "alias builtin='echo hijacked'"]
)
def test_a_function_or_alias_the_agent_names_like_the_shells_wrapper_leaves_later_commands_their_meaning(
    definition,
):
    """Each command ran as ``eval $'…'``: an agent's function or alias named ``eval`` ran
    in place of every later command (which printed 'hijacked' instead of what it said), and an
    alias named ``builtin`` hid every end marker, each command a timeout."""
    with Sandbox(SMALL) as box:
        shell = Shell(box)
        shell.run(f"X=kept; {definition}", timeout=2)
        result = shell.run("echo $X; (exit 3)", timeout=2)
        assert (result.output, result.exit_code) == ("kept\n", 3)


def test_a_traced_shell_shows_the_commands_trace_and_not_the_end_markers():
    """With ``set -x`` (an agent debugging its script) every command's output ended on the
    trace of the shell's own end-marker ``printf``, its nonce and working directory."""
    with Sandbox(SMALL) as box:
        shell = Shell(box)
        shell.run("set -x")
        output = shell.run("echo hi").output
        assert "hi\n" in output and "+ echo hi\n" in output
        assert "TRD" not in output and "printf" not in output


def test_a_shell_started_in_a_killed_shells_directory_goes_back_there():
    """The end marker carries the directory each command left, for a shell started in a
    killed one's place: any bytes, up to ``MAX_CWD_BYTES`` (a command's whole output still
    comes back in a directory that long); past it, or with PWD unset (under ``set -u``,
    which stopped the marker's printf), the sandbox's folder."""
    cap = SMALL.max_output_bytes
    with Sandbox(SMALL) as box:
        shell = Shell(box)
        assert shell.cwd == box.workdir
        shell.run("mkdir $'\\xff' && cd $'\\xff'")
        assert shell.cwd == f"{box.workdir}/\udcff"
        assert Shell(box, shell.cwd).run("[[ $PWD == */$'\\xff' ]]").exit_code == 0
        deep = "/".join(["x" * ((MAX_CWD_BYTES - len(box.workdir) - 20) // 5)] * 5)
        assert shell.run(f"cd .. && mkdir -p {deep} && cd {deep}").exit_code == 0
        assert MAX_CWD_BYTES - 20 < len(shell.cwd) < MAX_CWD_BYTES
        assert shell.run(f"head -c {cap} /dev/zero | tr '\\0' x").output == "x" * cap
        assert Shell(box, shell.cwd).run("pwd").output == f"{shell.cwd}\n"
        # 15 to 19 bytes short of the cap, by the folder's length mod 5: 21 more pass it
        assert shell.run(f"mkdir {'y' * 20} && cd {'y' * 20}").exit_code == 0
        assert shell.cwd is None
        assert Shell(box, shell.cwd).run("pwd").output == f"{box.workdir}\n"
        shell.run("set -u; unset PWD", timeout=2)
        assert (shell.run("echo ok", timeout=2).output, shell.cwd) == ("ok\n", None)


def test_a_shell_out_of_cpu_time_says_the_limit_counts_every_command_since_it_started():
    """RLIMIT_CPU holds the persistent bash to ``cpu_seconds`` over its whole life: the builtins
    and loops it runs itself add up across commands, so a short loop after a longer one was
    stopped as 'command used its 1 CPU seconds', a reason false of that command."""
    busy = (
        "read -a s </proc/$$/stat; t=$((s[13] + s[14])); "
        "while read -a s </proc/$$/stat; ((s[13] + s[14] - t < {})); do :; done"
    )
    with Sandbox(SMALL.model_copy(update={"cpu_seconds": 1})) as box:
        shell = Shell(box)
        shell.run(busy.format(70))  # 0.7 s of the shell's own (100 ticks a second)
        with pytest.raises(SandboxError) as raised:
            shell.run(busy.format(50))  # killed at 1 s of the shell's, under 0.5 s of its own
        assert raised.value.kind == "cpu_limit"
        assert "counted over every command since it started" in raised.value.reason


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_command_that_pages_what_it_prints_to_a_terminal_prints_it_all():
    """git (like man, psql, journalctl) sends what it prints to a terminal through a pager,
    less by default, which waited for a key: ``git log`` of any history longer than a screen
    ran into its timeout and killed the shell."""
    with Sandbox(SMALL) as box:
        shell = Shell(box)
        commit = "git -c user.name=a -c user.email=a@b commit -q --allow-empty -m"
        shell.run(f'git init -q && {commit} "$(seq 100)"')
        result = shell.run("git log --format=%B", timeout=2)
        assert result.output.split() == [str(line) for line in range(1, 101)]


def test_ansi_c_quote_round_trips_through_bash():
    text = 'a\'b\\c\n\t"$HOME" `x` é \x01'
    with Sandbox(SMALL) as box:
        assert box.run(f"printf %s {ansi_c_quote(text)}").output == text


def test_python_repl_keeps_namespace_and_contains_attacks():
    with Sandbox(SMALL) as box:
        repl = PythonRepl(box)
        assert repl.run("x = 41").output == ""
        assert repl.run("x + 1").output == "42\n"
        failed = repl.run("1/0")
        assert failed.error == "ZeroDivisionError" and "division by zero" in failed.output
        with pytest.raises(SandboxError) as raised:
            repl.run("b = bytearray(2 * 1024**3)")
        assert raised.value.kind == "memory_limit"
        with pytest.raises(SandboxError) as raised:
            repl.run("while True: print('x' * 100)")
        assert raised.value.kind == "output_limit"
        with pytest.raises(SandboxError) as raised:
            repl.run("open('/usr/pwned', 'w')")
        assert raised.value.kind == "write_outside"
        with pytest.raises(SandboxError) as raised:
            repl.run("while True: pass")
        assert raised.value.kind in {"cpu_limit", "timeout"}
        assert not repl.alive
        assert PythonRepl(box).run("'fresh'").output == "'fresh'\n"


def test_python_repl_code_reads_an_empty_stdin():
    """The code's stdin was the request channel: ``input()`` waited there for a line that
    never came until the timeout killed the interpreter, its variables lost."""
    with Sandbox(SMALL) as box:
        repl = PythonRepl(box)
        repl.run("x = 1")
        failed = repl.run("n = input()")
        assert failed.error == "EOFError"
        assert repl.run("import sys; sys.stdin.read(), x").output == "('', 1)\n"


def test_python_repl_caps_output_in_bytes():
    """The cap counts UTF-8 bytes, whatever the reply's JSON escaping makes of them."""
    cap = SMALL.max_output_bytes
    with Sandbox(SMALL) as box:
        repl = PythonRepl(box)
        assert repl.run(f"print('\\x00' * {cap - 100})").output == "\x00" * (cap - 100) + "\n"
        with pytest.raises(SandboxError) as raised:
            repl.run(f"print('é' * {cap // 2 + 100})")
        assert raised.value.kind == "output_limit"
        assert len(raised.value.output.encode()) <= cap
        assert repl.alive


@pytest.mark.parametrize("written", ["b'x'", "42"])
def test_python_repl_code_that_writes_no_text_to_stdout_gets_a_type_error_and_keeps_its_namespace(written):
    """``sys.stdout.write(b'x')``, a common slip, was kept before the write failed, and the
    server crashed joining it to the output: the interpreter died, its namespace lost, and the
    model was told the interpreter exited rather than what Python says of the write."""
    with Sandbox(SMALL) as box:
        repl = PythonRepl(box)
        repl.run("kept = 7")
        result = repl.run(f"import sys\nsys.stdout.write({written})")
        assert result.error == "TypeError"
        assert "write() argument must be str" in result.output
        assert repl.run("print('after'); kept").output == "after\n7\n"


def test_python_repl_output_to_a_stream_an_earlier_run_kept_shows_in_the_run_that_writes_it():
    """Each run had an output object of its own: a logging handler (or anything else holding
    ``sys.stderr``) set up in one run wrote every later run's lines to that run's, never shown."""
    with Sandbox(SMALL) as box:
        repl = PythonRepl(box)
        repl.run("import logging, sys\nlogging.basicConfig(level=logging.INFO)\nkept = sys.stdout")
        assert repl.run("logging.info('later')").output == "INFO:root:later\n"
        assert repl.run("print('kept', file=kept)").output == "kept\n"


def test_python_repl_code_that_catches_the_output_limit_is_still_an_output_limit():
    """Code whose bare ``except:`` swallowed the server's OutputLimit printed on: its output
    came back silently cut at the cap, with no output_limit."""
    cap = SMALL.max_output_bytes
    line = "x" * 99 + "\n"
    with Sandbox(SMALL) as box:
        repl = PythonRepl(box)
        with pytest.raises(SandboxError) as raised:
            repl.run("for i in range(1000):\n    try:\n        print('x' * 99)\n    except:\n        pass")
        assert raised.value.kind == "output_limit"
        assert raised.value.output == (line * (cap // len(line) + 1))[:cap]
        assert repl.run("'alive'").output == "'alive'\n"


def test_python_repl_a_forked_copy_of_the_interpreter_ends_with_the_code():
    """A process the code forks ran on as a second server: it answered the request too and
    read the next ones, so the next call got a stale reply and killed the interpreter, and a
    fork bomb's copies held every process slot after its process_limit was reported."""
    with Sandbox(SMALL) as box:
        repl = PythonRepl(box)
        repl.run("import os; os.fork()")
        assert repl.run("1 + 1").output == "2\n"
        with pytest.raises(SandboxError) as raised:
            repl.run("while True: os.fork()")
        assert raised.value.kind == "process_limit"
        assert repl.run("2 + 2").output == "4\n"


@pytest.mark.parametrize(
    "forged",
    [
        "'not json\\n'",
        "'{}\\n'",
        """'{"id": "guess", "output": "fake", "error": null, "truncated": false}\\n'""",
    ],
)
def test_python_repl_code_that_writes_to_the_reply_channel_kills_only_its_interpreter(forged):
    """The code can reach the server's reply channel: what it writes there is not taken for
    the answer (a crash of the step, or a stale reply handed to the next call)."""
    with Sandbox(SMALL) as box:
        repl = PythonRepl(box)
        with pytest.raises(SandboxError) as raised:
            repl.run(f"import __main__; __main__.proto.write({forged}); __main__.proto.flush()")
        assert raised.value.kind == "died" and "malformed" in str(raised.value)
        assert not repl.alive
        assert PythonRepl(box).run("'fresh'").output == "'fresh'\n"


def test_python_repl_a_forged_reply_with_a_lone_surrogate_kills_only_its_interpreter():
    """Code can read the request's nonce and forge the whole reply: one holding a lone
    surrogate was taken, and the first encode of it (the sandbox's check of a failed
    action) raised UnicodeEncodeError out of the step, the env's failure."""
    forge = (
        "import __main__, json; __main__.proto.write(json.dumps({'id': __main__.request['id'], "
        "'output': '\\udc80', 'error': 'E', 'truncated': False}) + '\\n'); __main__.proto.flush()"
    )
    with Sandbox(SMALL) as box:
        repl = PythonRepl(box)
        with pytest.raises(SandboxError) as raised:
            repl.run(forge)
        assert raised.value.kind == "died" and "malformed" in str(raised.value)
        assert not repl.alive


@pytest.mark.parametrize("exited_at_once", [False, True])
def test_a_shell_that_cannot_start_says_why(exited_at_once, monkeypatch):
    """A shell the sandbox could not start (a ro_binds path that does not exist) was reported
    as 'exited with status 1' alone, bwrap's own error only in the output no report shows;
    and when bwrap had already exited as the shell took its first command (a loaded
    machine), as 'the shell is not running', without it."""
    if exited_at_once:
        spawn = shell_module.PtyProcess.spawn

        def spawn_and_wait_for_the_exit(*args, **kwargs):
            proc = spawn(*args, **kwargs)
            deadline = time.monotonic() + 10
            while not sandbox_module.exited(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            return proc

        monkeypatch.setattr(shell_module.PtyProcess, "spawn", spawn_and_wait_for_the_exit)
    missing = f"/{uuid.uuid4().hex}"
    with Sandbox(SMALL.model_copy(update={"ro_binds": [missing]})) as box:
        with pytest.raises(SandboxError) as raised:
            Shell(box)
        assert raised.value.kind == "died"
        assert f"{missing}: No such file or directory" in raised.value.reason
        assert box.running == []


def test_python_repl_that_cannot_start_says_why():
    """An interpreter the sandbox could not start (a path it does not show) was reported as
    'exited with status 1' alone: bwrap's own error went to /dev/null."""
    missing = f"/{uuid.uuid4().hex}/python3"
    with Sandbox(SMALL.model_copy(update={"python": missing})) as box:
        with pytest.raises(SandboxError) as raised:
            PythonRepl(box)
        assert raised.value.kind == "died"
        assert f"{missing}: No such file or directory" in raised.value.reason
        assert box.running == []


def test_input_that_is_never_read_times_out():
    """The interpreter or shell stops reading (a signal handler that sleeps, a stopped
    shell) and the next call is bigger than the pipe's buffer: it times out, not hangs."""
    big = "a" * 200_000
    with Sandbox(SMALL) as box:
        repl = PythonRepl(box)
        repl.run(
            "import signal, time; signal.signal(signal.SIGALRM, lambda *a: time.sleep(10**6)); signal.alarm(1)"
        )
        time.sleep(1.5)
        started = time.monotonic()
        with pytest.raises(SandboxError) as raised:
            repl.run(f"x = '{big}'", timeout=2)
        assert raised.value.kind == "timeout" and time.monotonic() - started < 30 and not repl.alive
        shell = Shell(box)
        shell.run("(sleep 1; kill -STOP $$) &")
        deadline = time.monotonic() + 30
        while not _stopped_under(shell.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _stopped_under(shell.proc.pid), "the shell never stopped"
        started = time.monotonic()
        with pytest.raises(SandboxError) as raised:
            shell.run(f"echo {big}", timeout=2)
        assert raised.value.kind == "timeout" and time.monotonic() - started < 30 and not shell.alive
        assert Shell(box).run("echo back").output == "back\n"


def test_process_fallback_enforces_limits_and_timeout(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "worker-secret")
    config = SMALL.model_copy(update={"backend": "process"})
    with Sandbox(config) as box:
        assert box.backend == "process"
        assert box.run("pwd").output.strip() == box.workdir
        env = box.run("env").output
        assert f"HOME={box.workdir}\n" in env
        assert "AWS_SECRET_ACCESS_KEY" not in env and "worker-secret" not in env
        with pytest.raises(SandboxError) as raised:
            box.run("python3 -c 'x = bytearray(2 * 1024**3)'")
        assert raised.value.kind == "memory_limit"
        with pytest.raises(SandboxError) as raised:
            box.run("sleep 30", timeout=0.5)
        assert raised.value.kind == "timeout"


@pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need a root worker")
@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_what_the_worker_runs_as_a_sandbox_uid_never_carries_its_environment(backend, monkeypatch):
    """close() ran ``kill -9 -1`` as the sandbox's uid, and the probes ran as one, with the
    worker's whole environment: its credentials were in ``/proc/<pid>/environ`` of a process
    the sandbox's own processes (the same uid, under the process backend) may read."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "worker-secret")
    run = subprocess.run
    leaked = []

    def watched(argv, **kwargs):
        if argv[0] == "setpriv" and "worker-secret" in str(kwargs.get("env", os.environ)):
            leaked.append(argv)
        return run(argv, **kwargs)

    monkeypatch.setattr(sandbox_module.subprocess, "run", watched)
    sandbox_module._bwrap_takes.cache_clear()
    sandbox_module._bwrap_disables_userns.cache_clear()
    try:
        with Sandbox(SMALL.model_copy(update={"backend": backend})) as box:
            assert box.uid is not None
            assert box.run("echo ok").output == "ok\n"
    finally:
        sandbox_module._bwrap_takes.cache_clear()
        sandbox_module._bwrap_disables_userns.cache_clear()
    assert leaked == []


def test_apptainer_command_line():
    config = SandboxConfig(
        backend="apptainer", apptainer_image="/images/tools.sif", cpu_seconds=7, memory_mb=300
    )
    box = Sandbox(config)
    try:
        argv = box.argv(["bash", "-c", "echo hi"])
        image = argv.index("/images/tools.sif")
        options = argv[:image]
        assert os.path.basename(options[0]) == "apptainer" and options[1] == "exec"
        for flag in ("--containall", "--no-privs", "--no-home", "--net"):
            assert flag in options
        assert options[options.index("--network") + 1] == "none"
        assert options[options.index("--pwd") + 1] == box.workdir
        assert f"{box.workdir}:{box.workdir}:rw" in options
        assert f"HOME={box.workdir}" in options
        inside = argv[image + 1 :]
        assert inside[0] == "prlimit" and "--cpu=7:8" in inside and f"--as={300 * 1024 * 1024}" in inside
        assert inside[-3:] == ["bash", "-c", "echo hi"]
    finally:
        box.close()


def test_an_apptainer_found_on_the_workers_path_runs(tmp_path, monkeypatch):
    """Popen looks a bare name up on the PATH of the environment it is given, the scrubbed
    one (``/usr/bin:/bin``): an apptainer the worker finds elsewhere (``module load``, or
    ``/usr/local/bin``, where a build from source goes) could not start, every sandbox a
    start_failed."""
    tools = tmp_path / "tools"
    tools.mkdir()
    fake = tools / "treadle-test-apptainer"
    fake.write_text('#!/bin/sh\necho "apptainer $1"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    config = SandboxConfig(
        backend="apptainer", apptainer_image="/images/tools.sif", apptainer_bin="treadle-test-apptainer"
    )
    with Sandbox(config) as box:
        assert box.run("echo hi").output == "apptainer exec\n"


def test_the_apptainer_backend_without_an_image_is_refused_as_the_config_loads():
    """Refused by the sandbox as it started, each rollout an infra_error once the run was under way."""
    with pytest.raises(ValidationError, match="apptainer_image\n.*the apptainer backend needs an image"):
        SandboxConfig(backend="apptainer")
    with pytest.raises(ValidationError, match="apptainer_image"):
        SandboxConfig(backend="apptainer", apptainer_image="")
    assert SandboxConfig(backend="process").apptainer_image is None


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"env": {"A=B": "x"}}, "env"),
        ({"env": {"": "x"}}, "env"),
        ({"env": {"A": "x\0y"}}, "env"),
        ({"ro_binds": ["venv"]}, "ro_binds"),
        ({"ro_binds": ["/opt\0x"]}, "ro_binds"),
    ],
)
def test_an_env_or_ro_bind_no_sandbox_can_take_is_refused_as_the_config_loads(update, field):
    """Taken as it was, every bwrap command failed with bwrap's own ``setenv failed`` or
    ``Can't find source path`` as its output, which the model saw as its command's failure, and
    the process backend raised a ValueError out of each start."""
    with pytest.raises(ValidationError, match=field):
        SandboxConfig(**update)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_python_repl_is_whole_when_started_so_a_bind_reaches_the_interpreter():
    """Pinning a new interpreter's process tree moves the interpreter itself: the sandbox has
    finished forking it before the REPL is handed out (a process still being forked keeps the
    cores its parent had before the move)."""
    core = max(os.sched_getaffinity(0))
    for _ in range(20):
        with Sandbox(SMALL) as box:
            repl = PythonRepl(box)
            CpuManager().bind(repl.proc.pid, {core})
            assert repl.run("import os; sorted(os.sched_getaffinity(0))").output == f"[{core}]\n"


REAPER_SCRIPT = """
import ctypes, os, subprocess, sys, time
from envs.pyrepl import PythonRepl
from envs.sandbox import Sandbox, SandboxConfig, SandboxError

PR_SET_CHILD_SUBREAPER = 36
assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def zombies():
    children = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as handle:
            children += handle.read().split()
    return [c for c in children if "Z (zombie)" in open(f"/proc/{c}/status").read()]


config = SandboxConfig(backend="bwrap", timeout_s=5)
# a child of this process that has exited and that its Popen has not waited for yet
bystander = subprocess.Popen([sys.executable, "-c", "raise SystemExit(9)"])
while bystander.pid not in map(int, zombies()):
    time.sleep(0.01)
with Sandbox(config) as box:
    codes = [box.run(f"exit {code}").exit_code for code in range(8)]
    try:
        box.run("sleep 30", timeout=0.5)
    except SandboxError as exc:
        assert exc.kind == "timeout"
    PythonRepl(box).close()
codes.append(bystander.wait())
# the last namespace init may still be exiting: a later sandbox's close reaps it
deadline = time.monotonic() + 10
while zombies() and time.monotonic() < deadline:
    time.sleep(0.05)
    Sandbox(config).close()
print(codes, len(zombies()))
"""


def test_a_worker_that_reaps_for_its_container_is_left_no_zombie_sandbox_processes():
    """bwrap leaves each command's namespace init to the nearest reaper. Where the worker is
    that reaper (PID 1 of its container; a child subreaper here), the sandboxes reap them, one
    zombie per command otherwise, and no exit status is taken from its owner: not the
    commands', nor that of a child of the worker that has exited and is not waited for yet."""
    result = subprocess.run(
        [sys.executable, "-c", REAPER_SCRIPT],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == f"{[*range(8), 9]} 0"


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_config_env_is_set_inside_over_the_scrubbed_defaults(backend):
    config = SMALL.model_copy(update={"backend": backend, "env": {"LANG": "C", "TREADLE_GREETING": "hi"}})
    with Sandbox(config) as box:
        assert box.run("echo $LANG $TREADLE_GREETING").output == "C hi\n"


def test_ro_binds_are_readable_and_never_writable_inside():
    shared = tempfile.mkdtemp(prefix="treadle-ro-")
    try:
        os.chmod(shared, 0o777)  # writable by the sandbox's uid too: only the bind stops the write
        Path(shared, "data.txt").write_text("host data")
        with Sandbox(SMALL.model_copy(update={"ro_binds": [shared]})) as box:
            assert box.run(f"cat {shared}/data.txt").output == "host data"
            with pytest.raises(SandboxError) as raised:
                box.run(f"touch {shared}/pwned")
            assert raised.value.kind == "write_outside"
        assert os.listdir(shared) == ["data.txt"]
    finally:
        shutil.rmtree(shared)


def test_a_bwrap_command_leads_a_session_of_its_own_inside_the_namespace():
    """``--new-session``: the command is cut off from any terminal outside (no TIOCSTI
    injection into it); without it, its session's leader is outside the namespace (id 0)."""
    with Sandbox(SMALL) as box:
        assert box.run("python3 -c 'import os; print(os.getsid(0))'").output != "0\n"


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_commands_may_write_no_core_dump(backend):
    """Not even under a worker that may: a core dump fills the working directory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if hard == 0:
        pytest.skip("this worker may write no core dump itself")
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
    try:
        with Sandbox(SMALL.model_copy(update={"backend": backend})) as box:
            assert box.run("ulimit -c").output == "0\n"
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


def test_a_closed_sandbox_starts_nothing():
    box = Sandbox(SMALL)
    box.close()
    for start in (lambda: box.argv(["true"]), lambda: box.run("true"), lambda: Shell(box)):
        with pytest.raises(SandboxError) as raised:
            start()
        assert raised.value.kind == "died"


def test_a_command_that_ignores_sigxcpu_is_still_a_cpu_limit_and_a_quick_sigkill_is_not():
    """Past the soft CPU limit comes SIGXCPU, one second later SIGKILL; a command that kills
    itself well within its CPU seconds is a plain failure."""
    spin = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    with Sandbox(SMALL.model_copy(update={"cpu_seconds": 1, "timeout_s": 120})) as box:
        with pytest.raises(SandboxError) as raised:
            box.run(["python3", "-c", spin])
        assert raised.value.kind == "cpu_limit"
    with Sandbox(SMALL.model_copy(update={"cpu_seconds": 30})) as box:
        assert box.run("kill -9 $$").exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL)


def test_a_successful_command_that_prints_a_violation_message_is_plain_output():
    with Sandbox(SMALL) as box:
        assert box.run("echo 'touch: Read-only file system'").output == "touch: Read-only file system\n"


def test_a_command_read_without_violations_raises_only_what_the_sandbox_stopped():
    """``run_async(violations=False)``: output that names the isolation (another program's
    log) is not taken for it, neither from a failed command nor from one stopped at its timeout."""
    with Sandbox(SMALL) as box:
        failed = asyncio.run(box.run_async("echo 'Read-only file system'; exit 1", violations=False))
        assert (failed.exit_code, failed.output) == (1, "Read-only file system\n")
        with pytest.raises(SandboxError) as raised:
            asyncio.run(
                box.run_async(
                    "echo 'fork: Resource temporarily unavailable'; sleep 60", timeout=1, violations=False
                )
            )
        assert raised.value.kind == "timeout"


@pytest.mark.parametrize("on_loop", [False, True], ids=["run", "run_async"])
def test_command_output_cap_is_exact(on_loop):
    """``max_output_bytes`` printed is the whole output; one byte more is an output_limit
    with the first ``max_output_bytes`` bytes."""
    cap = SMALL.max_output_bytes
    with Sandbox(SMALL) as box:

        def run(command):
            return asyncio.run(box.run_async(command)) if on_loop else box.run(command)

        assert run(f"head -c {cap} /dev/zero | tr '\\0' x").output == "x" * cap
        with pytest.raises(SandboxError) as raised:
            run(f"head -c {cap + 1} /dev/zero | tr '\\0' x")
        assert raised.value.kind == "output_limit"
        assert raised.value.output == "x" * cap


@pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need a root worker")
def test_closing_a_process_sandbox_kills_what_left_its_session():
    """Without bwrap's PID namespace a ``setsid`` process is out of the group kill's reach:
    the close kills every process of the sandbox's uid."""
    box = Sandbox(SMALL.model_copy(update={"backend": "process"}))
    box.run(f"exec >/dev/null 2>&1; {ESCAPE} while [ ! -e escaped ]; do sleep 0.05; done")
    escaped = _escaped(box)
    assert _cmdline(str(escaped)) == "sleep 120 "
    box.close()
    deadline = time.monotonic() + 5
    while _cmdline(str(escaped)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _cmdline(str(escaped))


def test_closing_a_sandbox_keeps_the_callers_working_directory(tmp_path):
    with Sandbox(SMALL.model_copy(update={"backend": "process"}), workdir=str(tmp_path)) as box:
        box.run("echo kept > result.txt")
    assert (tmp_path / "result.txt").read_text() == "kept\n"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_command_started_on_cores_runs_there_and_its_start_thread_gets_its_cores_back():
    everywhere = os.sched_getaffinity(0)
    core = max(everywhere)

    async def run(box: Sandbox) -> tuple[str, set[int]]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        pinned = await box.run_async(
            "python3 -c 'import os; print(sorted(os.sched_getaffinity(0)))'", cores={core}
        )
        return pinned.output, await loop.run_in_executor(None, os.sched_getaffinity, 0)

    with Sandbox(SMALL) as box:
        assert asyncio.run(run(box)) == (f"[{core}]\n", everywhere)


def test_a_named_backend_that_cannot_run_is_refused_and_auto_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap to find
    bwrap_path.cache_clear()
    try:
        with pytest.raises(SandboxError) as raised:
            resolve_backend("bwrap")
        assert raised.value.kind == "start_failed"
        assert resolve_backend("auto") == "process"
        assert "bubblewrap (bwrap) is not available" in caplog.text
    finally:
        bwrap_path.cache_clear()


def test_a_python_the_sandbox_cannot_find_is_a_start_failure():
    with pytest.raises(SandboxError) as raised:
        python_in_sandbox(SMALL.model_copy(update={"python": f"python-{uuid.uuid4().hex}"}))
    assert raised.value.kind == "start_failed"
    assert python_in_sandbox(SMALL).startswith("/")


WORKER_THAT_DIES = """
import sys
from envs.sandbox import Sandbox, SandboxConfig
box = Sandbox(SandboxConfig(backend="bwrap", timeout_s=600))
print(box.workdir, flush=True)
box.run(sys.argv[1])
"""


def test_a_bwrap_command_ends_with_the_worker_that_was_killed_under_it():
    """A worker killed outright (OOM, SIGKILL) runs no close: ``--die-with-parent`` ends its
    sandboxes' commands, which ran on otherwise, each holding its process slots."""
    mine = (f"sleep 304.{uuid.uuid4().int % 10**9}",)
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER_THAT_DIES, mine[0]],
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    workdir = worker.stdout.readline().strip()
    try:
        deadline = time.monotonic() + 30
        while not _pids_running(mine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pids_running(mine)
        worker.kill()
        worker.wait()
        deadline = time.monotonic() + 5
        while _pids_running(mine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pids_running(mine) == []
    finally:
        worker.stdout.close()
        remove_tree(workdir)


WORKER_WITH_PROCESSES = """
import subprocess, sys
from envs.sandbox import Sandbox, SandboxConfig
held = [subprocess.Popen(["sleep", "60"]) for _ in range(30)]
try:
    with Sandbox(SandboxConfig(backend=sys.argv[2], max_processes=16, root_dir=sys.argv[1])) as box:
        print(box.run("sleep 0.1 & sleep 0.1 & sleep 0.1 & wait; echo forked").output.strip())
finally:
    for proc in held:
        proc.kill()
        proc.wait()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a worker as another uid")
@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_a_worker_that_runs_sandboxes_as_itself_leaves_them_their_max_processes(backend):
    """A worker that is not root runs its sandboxes as its own uid, whose processes RLIMIT_NPROC
    counts too: a worker already running more than ``max_processes`` left its commands none."""
    nobody = 65534
    root_dir = tempfile.mkdtemp(prefix="treadle-nobody-")
    os.chown(root_dir, nobody, nobody)
    try:
        ran = subprocess.run(
            ["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups"]
            + [sys.executable, "-c", WORKER_WITH_PROCESSES, root_dir, backend],
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stderr[-2000:]
        assert ran.stdout == "forked\n"
    finally:
        shutil.rmtree(root_dir)


def test_a_live_workers_folder_is_kept_when_it_runs_in_another_time_namespace(tmp_path):
    """A time namespace shifts the start times ``/proc`` gives: a live worker in another one
    (``unshare --time``, a container restored by CRIU) recorded a start this process reads
    otherwise, and its folder was removed as a dead worker's."""
    command = ["unshare", "--time", "--fork", "--boottime", "1000"]
    if shutil.which("unshare") is None or subprocess.run([*command, "true"], capture_output=True).returncode:
        pytest.skip("this machine may not make a time namespace (unshare --time)")
    unshare = subprocess.Popen(
        [*command, sys.executable, "-c", WORKER_HOLDING_A_SANDBOX, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    held = unshare.stdout.readline().strip()
    try:
        assert held and sandbox_module.sweep_abandoned(str(tmp_path)) == []
        assert os.listdir(tmp_path) == [os.path.basename(held)]
    finally:
        if held:  # the worker unshare forked, named in its folder: killing unshare leaves it running
            os.kill(int(sandbox_module.OWNED_FOLDER.match(os.path.basename(held)).group(2)), signal.SIGKILL)
        unshare.kill()
        unshare.wait()
        unshare.stdout.close()


def test_a_live_workers_folder_is_kept_when_it_runs_in_another_pid_namespace(tmp_path):
    """A worker in another PID namespace (a container sharing the temp dir) records a pid of
    its namespace: looked up in this one, it names another process or none, and its live
    folder would be removed as a dead worker's."""
    command = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if shutil.which("unshare") is None or subprocess.run([*command, "true"], capture_output=True).returncode:
        pytest.skip("this machine may not make a PID namespace (unshare --pid)")
    unshare = subprocess.Popen(
        [*command, sys.executable, "-c", WORKER_HOLDING_A_SANDBOX, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        held = unshare.stdout.readline().strip()
        assert held and sandbox_module.sweep_abandoned(str(tmp_path)) == []
        assert os.listdir(tmp_path) == [os.path.basename(held)]
    finally:
        unshare.kill()  # --kill-child: the worker goes with it
        unshare.wait()
        unshare.stdout.close()


class _ClosingOnStart:
    """``subprocess`` as the sandbox module sees it, but each ``Popen`` closes ``box`` once the
    process has started: a close from another thread (the env's, under a cancelled rollout
    whose command runs on in its thread) that lands while the command starts."""

    def __init__(self, box: Sandbox):
        closing = self

        class Popen(subprocess.Popen):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                box.close()
                closing.closed_at = time.monotonic()

        self.Popen = Popen

    def __getattr__(self, name):
        return getattr(subprocess, name)


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_a_command_that_starts_as_the_sandbox_closes_is_killed_with_it(backend, monkeypatch, tmp_path):
    """close() kills what it tracks; a command that started while it ran was tracked after
    it and ran on in the closed sandbox until its own timeout. Here the sandbox runs as the
    worker (no uid of its own to find the command by) in the caller's folder (which close
    leaves, so bwrap still finds it)."""
    monkeypatch.setattr(sandbox_module, "_sandbox_uids_mapped", lambda: False)
    box = Sandbox(SMALL.model_copy(update={"backend": backend}), workdir=str(tmp_path))
    closing = _ClosingOnStart(box)
    monkeypatch.setattr(sandbox_module, "subprocess", closing)
    with pytest.raises(SandboxError) as raised:
        box.run("sleep 30", timeout=10)
    assert raised.value.kind == "died"
    assert time.monotonic() - closing.closed_at < 5  # far below the timeout
    assert box.running == []


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_a_process_adopted_by_a_closed_sandbox_is_killed_and_reaped(backend, monkeypatch, tmp_path):
    """A shell or interpreter whose sandbox closed between its start and its adoption was
    never killed: close() had already run, and nothing else would (as above: no uid of its
    own, the caller's folder)."""
    monkeypatch.setattr(sandbox_module, "_sandbox_uids_mapped", lambda: False)
    box = Sandbox(SMALL.model_copy(update={"backend": backend}), workdir=str(tmp_path))
    proc = subprocess.Popen(box.argv(["sleep", "30"]), **box.popen_kwargs())
    try:
        box.close()
        box.adopt(proc)
        assert proc.returncode == -signal.SIGKILL
        assert box.running == []
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("on_loop", [False, True], ids=["run", "run_async"])
@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_a_command_that_ended_is_killed_with_its_group_before_it_is_reaped(backend, on_loop, monkeypatch):
    """After a command ended, its group was killed (for the jobs it left) once it was reaped:
    its pid was free by then, and may lead another process's group (another sandbox's
    command, each leads its own). Each kill must find the command's pid still its own."""
    real_kill_group = sandbox_module.kill_group
    unreaped_at_kill = []

    def recording_kill_group(pid):
        unreaped_at_kill.append(os.path.exists(f"/proc/{pid}"))
        real_kill_group(pid)

    with Sandbox(SMALL.model_copy(update={"backend": backend})) as box:
        monkeypatch.setattr(sandbox_module, "kill_group", recording_kill_group)
        result = asyncio.run(box.run_async("exit 3")) if on_loop else box.run("exit 3")
        assert result.exit_code == 3
        assert box.running == []
    assert unreaped_at_kill and all(unreaped_at_kill), unreaped_at_kill


def test_a_close_under_a_run_never_kills_the_group_of_the_command_the_run_reaped(monkeypatch):
    """A close() from another thread that came after the run had reaped its command, before
    the run let go of it, killed the group of the reaped pid, which may lead another
    process's group by then."""
    real_kill_group = sandbox_module.kill_group
    unreaped_at_kill = []

    def recording_kill_group(pid):
        unreaped_at_kill.append(os.path.exists(f"/proc/{pid}"))
        real_kill_group(pid)

    box = Sandbox(SMALL)
    real_disown = box.disown

    def close_then_disown(handle):
        box.close()
        real_disown(handle)

    monkeypatch.setattr(sandbox_module, "kill_group", recording_kill_group)
    monkeypatch.setattr(box, "disown", close_then_disown)
    with pytest.raises(SandboxError) as raised:
        box.run("exit 3")
    assert raised.value.kind == "died"
    assert all(unreaped_at_kill), unreaped_at_kill


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("start", [Shell, PythonRepl])
def test_a_shell_or_interpreter_whose_sandbox_closed_as_it_started_leaves_no_descriptor_open(
    start, monkeypatch, tmp_path
):
    """A sandbox closed from another thread between the start of a shell or interpreter and
    its adoption: it is killed there, and the start raised without closing its pty or pipes
    and eventfd, a leak per start in a long-lived worker. The error is kept: closing them must
    not wait for the garbage collector."""
    before = _open_fds()  # the sandbox's uid claim (a socket) is open until it closes
    box = Sandbox(SMALL, workdir=str(tmp_path))
    real_adopt = box.adopt

    def close_then_adopt(handle):
        box.close()
        real_adopt(handle)

    monkeypatch.setattr(box, "adopt", close_then_adopt)
    with pytest.raises(SandboxError) as raised:
        start(box)
    assert raised.value.kind == "died"
    assert _open_fds() == before


@pytest.mark.parametrize("root", ["missing", "a_file"])
def test_a_sandbox_whose_root_dir_takes_no_folder_fails_to_start(root, tmp_path):
    """A root_dir that is missing (or full, or not a folder) raised the OSError of the sweep
    or of mkdtemp: the rollout was an env_error, where a sandbox that cannot start is an
    infra_error. Both the first sandbox made there (which sweeps it) and a later one."""
    path = tmp_path / root
    if root == "a_file":
        path.write_text("")
    config = SMALL.model_copy(update={"root_dir": str(path)})
    for _ in range(2):
        with pytest.raises(SandboxError) as raised:
            Sandbox(config)
        assert raised.value.kind == "start_failed"
        assert str(path) in raised.value.reason
        assert ("No such file" if root == "missing" else "Not a directory") in raised.value.reason


FORK_CHAINS = r"""
import ctypes, os, shlex, subprocess, threading, time
from envs.sandbox import Sandbox, SandboxConfig, _proc_status, _uid_pids

def live(uid):
    pids = []
    for pid in _uid_pids(uid):
        try:
            if not _proc_status(str(pid))["State"].strip().startswith("Z"):
                pids.append(pid)
        except OSError:
            pass
    return pids

# the chains' orphans come here, reaped at once: no zombies pile up to the process limit and
# stop the chains by themselves (whatever reaps orphans on this host, and how soon)
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
box = Sandbox(SandboxConfig(backend="process", max_processes=128, timeout_s=10))
uid = box.uid
stop = threading.Event()

def reap():
    while not stop.is_set():
        for child in open("/proc/self/task/%d/children" % os.getpid()).read().split():
            try:
                ours = os.stat("/proc/" + child).st_uid == uid and int(child) not in box.running
                if ours and _proc_status(child)["State"].strip().startswith("Z"):
                    os.waitpid(int(child), os.WNOHANG)
            except OSError:
                pass
        time.sleep(0.001)

threading.Thread(target=reap, daemon=True).start()
# 24 chains, each a process that forks a child and exits, the child likewise, on and on (and
# again after a fork refused while the zombies await their reaping)
chains = (
    "import os\nfor _ in range(24):\n if not os.fork():\n  while True:\n   try:\n"
    "    if os.fork():\n     break\n   except OSError:\n    pass\n  break"
)
try:
    box.run(f"setsid -w python3 -c {shlex.quote(chains)} </dev/null >/dev/null 2>&1")
    deadline = time.monotonic() + 5
    while len(live(uid)) < 24 and time.monotonic() < deadline:
        time.sleep(0.01)
    print("running", len(live(uid)))
    box.close()
    deadline = time.monotonic() + 5
    while live(uid) and time.monotonic() < deadline:
        time.sleep(0.01)
    print("survived", len(live(uid)))
finally:
    box.close()
    while live(uid):  # a chain survived: end it, whoever holds the uid next
        subprocess.run(["setpriv", f"--reuid={uid}", "--", "kill", "-9", "-1"], capture_output=True)
    stop.set()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox uids need a root worker")
def test_close_kills_every_process_of_the_sandboxs_uid_however_fast_it_forks():
    """Under the process backend (no PID namespace to end with the sandbox), close() killed
    its uid's processes in one scan of /proc: one that forked since the scan found it has a
    child the kill never reaches, and a process that forks a child and exits over and over
    outlived the sandbox. Run in a process of its own, the chains' subreaper."""
    done = subprocess.run([sys.executable, "-c", FORK_CHAINS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    counts = dict(line.split() for line in done.stdout.splitlines())
    assert int(counts["running"]) >= 24, done.stdout
    assert counts["survived"] == "0", done.stdout
