"""Sandboxes: a process group with its own working directory, limits, no network.

A :class:`Sandbox` owns one private working directory and turns a command into an argv that runs
it isolated under one of three backends (see ``docs/sandboxes.md``):

- ``bwrap`` (bubblewrap): read-only system directories, the working directory the only writable
  path, new PID/network/IPC/UTS namespaces and no user namespace of its own, a new session,
  killed with its parent;
- ``apptainer`` (Apptainer/Singularity, for HPC clusters): ``exec --containall --no-privs
  --net --network none`` of a user-chosen image with the working directory bound;
- ``process`` (fallback, used only when bwrap is missing, with a loud warning): rlimits, a new
  process group and ``unshare -n`` where permitted. It does not stop writes outside the working
  directory.

Every backend runs the command under rlimits (CPU seconds, address space, file size, process
count) with a scrubbed environment; callers add a wall-clock timeout and an output cap. When the
worker runs as root, each sandbox also gets its own unprivileged uid (unique among the live
sandboxes of the workers of its network namespace), so that the process-count limit counts that
sandbox alone.

Failures the sandbox contains are raised as :class:`SandboxError` with a ``kind``. Those in
:data:`COMMAND_KINDS` are brought on by the command itself (what it ran or printed): an
environment whose commands are the model's actions reports them to the model as a failed
action. Any other that escapes an environment becomes the rollout's ``env_error`` status, or
``infra_error`` for a sandbox that could not start (``start_failed``) or one lost during init.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import logging
import math
import os
import re
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import IO, Literal, get_args

from ptyprocess import PtyProcess, PtyProcessError
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from envs.threads import to_thread_to_the_end

log = logging.getLogger(__name__)

Backend = Literal["auto", "bwrap", "process", "apptainer"]
ErrorKind = Literal[
    "timeout",
    "cpu_limit",
    "memory_limit",
    "process_limit",
    "file_size_limit",
    "output_limit",
    "write_outside",
    "network",
    "died",
    "start_failed",
]

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
LAUNCHER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
"""The environment of what the worker runs to start, probe or kill a sandbox's processes (bwrap,
setpriv, kill): never the worker's own, whose credentials a process of the sandbox's uid could
read in ``/proc/<pid>/environ``."""
DISABLE_USERNS = ["--unshare-user", "--disable-userns"]
BWRAP_PROCESSES = 2
"""bwrap's own processes under a sandbox's uid: its outer process and its PID namespace's init."""
UID_BASE = 2_000_000_000
UID_RANGE = 1 << 20
REAP_TIMEOUT_S = 5.0

# What a command brings on itself, by running too long or too much, printing too much, or running
# into the isolation; "died" and "start_failed" can also be the sandbox's own failure.
COMMAND_KINDS: frozenset[ErrorKind] = frozenset(get_args(ErrorKind)) - {"died", "start_failed"}

# Output patterns that show a command ran into the isolation rather than failing on its own.
VIOLATION_PATTERNS: tuple[tuple[ErrorKind, re.Pattern[bytes]], ...] = (
    (
        "process_limit",
        re.compile(rb"fork: (retry: )?Resource temporarily unavailable|BlockingIOError.*Errno 11"),
    ),
    ("memory_limit", re.compile(rb"MemoryError|[Cc]annot allocate memory|xmalloc|std::bad_alloc")),
    # a program that ignores SIGXFSZ (Python does) gets EFBIG from the write instead of dying
    ("file_size_limit", re.compile(rb"File too large")),
    ("write_outside", re.compile(rb"Read-only file system")),
    (
        "network",
        re.compile(
            rb"Network is unreachable|Connection refused|Temporary failure in name resolution"
            rb"|Could not resolve host|Name or service not known"
        ),
    ),
)


class SandboxError(RuntimeError):
    """A command was stopped or ran into the sandbox's isolation.

    ``kind`` names what happened (one of ``ErrorKind``); ``output`` is what the command printed.
    Raised out of an environment, the rollout service reports it as the ``env_error`` status
    with ``reason`` (``infra_error`` when the sandbox could not start, or failed during init).
    """

    def __init__(self, kind: ErrorKind, reason: str, output: str = ""):
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason
        self.output = output


class SandboxConfig(BaseModel):
    """Isolation backend and limits of one sandbox."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    backend: Backend = Field(
        "auto",
        description="Isolation backend: auto (bwrap, else process with a warning), bwrap, process, apptainer.",
    )
    cpu_seconds: int = Field(30, ge=1, description="RLIMIT_CPU: CPU seconds per process before it is killed.")
    memory_mb: int = Field(1024, ge=32, description="RLIMIT_AS: address space per process, in MiB.")
    file_size_mb: int = Field(64, ge=1, description="RLIMIT_FSIZE: largest file a process may write, in MiB.")
    max_processes: int = Field(64, ge=4, description="RLIMIT_NPROC: processes the sandbox may run at once.")
    timeout_s: float = Field(
        30.0, gt=0, description="Wall-clock limit of one command (one action), in seconds."
    )
    max_output_bytes: int = Field(
        64 * 1024, ge=256, description="Output kept from one command; more kills the command (output_limit)."
    )
    violations_are_errors: bool = Field(
        True,
        description="Raise SandboxError when output shows a command ran into the isolation (read-only "
        "file system, no network, process or memory limit); false hands it to the model as plain output.",
    )
    apptainer_image: str | None = Field(
        None,
        validate_default=True,
        description="Image (.sif, directory or docker://) for the apptainer backend; required there.",
    )
    apptainer_bin: str = Field("apptainer", description="Apptainer or Singularity executable.")
    ro_binds: list[str] = Field(
        default_factory=list,
        description="Extra absolute host paths made visible read-only inside (e.g. a virtualenv).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Variables set inside, on top of the scrubbed PATH/HOME/LANG/TMPDIR.",
    )
    python: str = Field(
        "python3",
        description="Python interpreter inside the sandbox (the REPL server and code tests use it).",
    )
    root_dir: str | None = Field(
        None,
        description="Host folder under which working directories are made; the system temp dir if unset.",
    )

    @field_validator("apptainer_image")
    @classmethod
    def _image_for_apptainer(cls, value: str | None, info: ValidationInfo) -> str | None:
        # else every sandbox failed to start, each rollout an infra_error, once the run was under way
        if info.data.get("backend") == "apptainer" and not value:
            raise ValueError("the apptainer backend needs an image (.sif, directory or docker://)")
        return value

    # else each bwrap command failed with bwrap's own complaint as its output, which the model
    # saw as its command's failure, and each process-backend start raised a ValueError
    @field_validator("env")
    @classmethod
    def _settable_env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, text in value.items():
            if not key or "=" in key or "\0" in key + text:
                raise ValueError(
                    f"cannot set {key!r}: a name is non-empty, without '=' or NUL; a value has no NUL"
                )
        return value

    @field_validator("ro_binds")
    @classmethod
    def _absolute_binds(cls, value: list[str]) -> list[str]:
        for path in value:
            if not os.path.isabs(path) or "\0" in path:
                raise ValueError(f"a bind is an absolute host path without NUL, got {path!r}")
        return value


@dataclass
class ExecResult:
    """Outcome of one command: exit status (negative: killed by that signal) and its output."""

    exit_code: int
    output: str
    seconds: float


@cache
def bwrap_path() -> str | None:
    """The bubblewrap executable, if it exists and can create namespaces here."""
    path = shutil.which("bwrap")
    if path is None:
        return None
    probe = subprocess.run(
        [path, "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"],
        capture_output=True,
        timeout=10,
    )
    if probe.returncode != 0:
        log.warning(
            "bwrap exists but cannot create namespaces: %s", probe.stderr.decode(errors="replace")[:200]
        )
        return None
    return path


def _run_as(uid: int | None) -> list[str]:
    """The prefix that runs a command as ``uid`` (None: as this process)."""
    return [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


@cache
def _bwrap_takes(*options: str, as_uid: bool = False) -> bool:
    """Whether this bwrap runs a sandbox with ``options`` here (newer options, or ones the
    kernel or a container may refuse); ``as_uid``: run as an unprivileged sandbox uid (what a
    root worker runs bwrap as)."""
    path = bwrap_path()
    if path is None:
        return False
    probe = [
        *_run_as(UID_BASE if as_uid else None),
        path,
        "--ro-bind",
        "/",
        "/",
        *options,
        "--unshare-all",
        "true",
    ]
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        return subprocess.run(probe, capture_output=True, timeout=10, env=LAUNCHER_ENV).returncode == 0
    return False


@cache
def _bwrap_sizes_tmpfs() -> bool:
    """Whether this bwrap takes ``--size`` for a tmpfs (bubblewrap 0.7 and later)."""
    if _bwrap_takes("--size", "1048576", "--tmpfs", "/tmp"):
        return True
    log.warning(
        "bwrap takes no --size for a tmpfs (bubblewrap < 0.7): /dev/shm in bwrap sandboxes is unbounded"
    )
    return False


@cache
def _bwrap_disables_userns(as_uid: bool) -> bool:
    """Whether this bwrap can keep sandboxed code from making user namespaces of its own
    (bubblewrap 0.8 and later, where the user it runs as may make one: root may where a
    sandbox uid may not, with a setuid bwrap and unprivileged user namespaces off); ``as_uid``
    as for :func:`_bwrap_takes`."""
    if _bwrap_takes(*DISABLE_USERNS, as_uid=as_uid):
        return True
    log.warning(
        "bwrap cannot disable user namespaces here (bubblewrap < 0.8, or none can be made): "
        "code in bwrap sandboxes can make its own"
    )
    return False


def _unshare_net_prefix(as_uid: bool) -> tuple[str, ...]:
    """The ``unshare`` prefix that drops the network for the process backend, if permitted.

    ``as_uid``: probe as an unprivileged sandbox uid (what a root worker runs commands as).
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    user = _run_as(UID_BASE if as_uid else None)
    for prefix in ((unshare, "-n"), (unshare, "-r", "-n")):
        probe = subprocess.run([*user, *prefix, "true"], capture_output=True, timeout=10, env=LAUNCHER_ENV)
        if probe.returncode == 0:
            return prefix
    log.warning("unshare -n is not permitted here: process-backend sandboxes keep the network")
    return ()


def resolve_backend(backend: Backend) -> Literal["bwrap", "process", "apptainer"]:
    """Pick the backend ``auto`` means here; a named backend that cannot run raises."""
    if backend == "apptainer":
        return "apptainer"
    if bwrap_path() is not None and backend in ("auto", "bwrap"):
        return "bwrap"
    if backend == "bwrap":
        raise SandboxError("start_failed", "backend 'bwrap' was requested but bwrap is missing or cannot run")
    if backend == "auto":
        log.warning(
            "!!! bubblewrap (bwrap) is not available: sandboxes fall back to plain processes with rlimits "
            "only; commands can read and write anything this user can. Install bubblewrap. !!!"
        )
    return "process"


class Sandbox:
    """One private working directory and the way to run commands isolated inside it.

    ``argv(cmd)`` wraps an argv for the backend; :meth:`run` runs one command to completion;
    :mod:`envs.shell` and :mod:`envs.pyrepl` keep a process alive inside. ``close()`` kills
    everything started here and removes the directory.
    """

    def __init__(self, config: SandboxConfig | None = None, workdir: str | None = None):
        self.config = config or SandboxConfig()
        self.backend = resolve_backend(self.config.backend)
        self._owns_dir = workdir is None
        if self._owns_dir:
            root = self.config.root_dir or tempfile.gettempdir()
            try:
                _sweep_once(root)
                workdir = tempfile.mkdtemp(prefix=_folder_prefix(os.getpid()), dir=root)
            except OSError as exc:  # a root_dir missing, full, not a folder
                raise SandboxError(
                    "start_failed", f"could not make a working folder under {root}: {exc}"
                ) from exc
        self.workdir = os.path.realpath(workdir)
        self.uid: int | None = None
        if os.geteuid() == 0 and self.backend != "apptainer" and _sandbox_uids_mapped():
            uid = None
            try:
                uid = _claim_uid()
                os.chown(self.workdir, uid, uid)
            except BaseException:
                if uid is not None:
                    _release_uid(uid)
                if self._owns_dir:
                    remove_tree(self.workdir)
                raise
            self.uid = uid
        self._procs: list[subprocess.Popen | PtyProcess] = []
        self._closing = threading.Lock()  # a process is tracked either before close() or not at all
        self.closed = False

    @property
    def running(self) -> list[int]:
        """Process ids of the commands running now (each leads its own process group)."""
        return [pid for pid in (getattr(proc, "pid", None) for proc in list(self._procs)) if pid]

    def env(self) -> dict[str, str]:
        """The scrubbed environment every command starts with."""
        base = {
            "PATH": SANDBOX_PATH,
            "HOME": self.workdir,
            "TMPDIR": self.workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        return base | self.config.env

    def _limits(self) -> list[str]:
        cfg = self.config
        nproc = cfg.max_processes
        if self.uid is None:
            # RLIMIT_NPROC counts every process of the real uid, the worker's own included (root's
            # too, in a user namespace; in the host's, root is not held to it at all).
            nproc += len(_uid_pids(os.getuid()))
        if self.backend == "bwrap":
            nproc += BWRAP_PROCESSES
        return [
            "prlimit",
            f"--cpu={cfg.cpu_seconds}:{cfg.cpu_seconds + 1}",
            f"--as={cfg.memory_mb * 1024 * 1024}",
            f"--fsize={cfg.file_size_mb * 1024 * 1024}",
            f"--nproc={nproc}",
            "--core=0",
            "--",
        ]

    def _user(self) -> list[str]:
        return _run_as(self.uid)

    def _bwrap(self) -> list[str]:
        args = [bwrap_path() or "bwrap"]
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for path in self.config.ro_binds:
            args += ["--ro-bind", path, path]
        args += ["--proc", "/proc", "--dev", "/dev"]
        # bwrap's /dev is a tmpfs as large as half the host's memory, which no rlimit counts:
        # only /dev/shm (POSIX semaphores, shared memory) stays writable, no larger than
        # memory_mb where bwrap can size it
        if _bwrap_sizes_tmpfs():
            args += ["--size", str(self.config.memory_mb * 1024 * 1024)]
        args += ["--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        args += ["--bind", self.workdir, self.workdir, "--remount-ro", "/"]
        args += ["--chdir", self.workdir, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
        if _bwrap_disables_userns(self.uid is not None):
            args += DISABLE_USERNS
        for key, value in self.env().items():
            args += ["--setenv", key, value]
        return [*args, "--"]

    def _apptainer(self) -> list[str]:
        cfg = self.config
        args = [
            # found here: Popen would look a bare name up on the scrubbed PATH of popen_kwargs
            shutil.which(cfg.apptainer_bin) or cfg.apptainer_bin,
            "exec",
            "--containall",
            "--no-privs",
            "--no-home",
            "--net",
            "--network",
            "none",
        ]
        args += ["--bind", f"{self.workdir}:{self.workdir}:rw", "--pwd", self.workdir]
        for path in cfg.ro_binds:
            args += ["--bind", f"{path}:{path}:ro"]
        for key, value in self.env().items():
            args += ["--env", f"{key}={value}"]
        # Limits go inside the image: the Go runtime of apptainer itself reserves more address
        # space than a sandbox is allowed.
        return [*args, str(cfg.apptainer_image), *self._limits()]

    def argv(self, cmd: list[str]) -> list[str]:
        """The full argv that runs ``cmd`` inside this sandbox."""
        if self.closed:
            raise SandboxError("died", "the sandbox is closed")
        self._reopen_workdir()
        if self.backend == "bwrap":
            return [*self._user(), *self._limits(), *self._bwrap(), *cmd]
        if self.backend == "apptainer":
            return [*self._apptainer(), *cmd]
        return [*self._user(), *self._limits(), *_unshare_net_prefix(self.uid is not None), *cmd]

    def _reopen_workdir(self) -> None:
        """Give the working directory's owner back what a command took (``chmod 000 .``):
        a process started there, a shell or interpreter in place of a killed one, could not
        enter it, a failed start the model brought on that the env raised as its own failure."""
        with contextlib.suppress(OSError):  # a caller's folder this worker does not own
            mode = os.stat(self.workdir).st_mode
            if mode & 0o700 != 0o700:
                os.chmod(self.workdir, mode | 0o700)

    def popen_kwargs(self) -> dict:
        """Keyword arguments for ``subprocess.Popen`` of an :meth:`argv` (cwd, env, own session)."""
        env = self.env() if self.backend == "process" else dict(LAUNCHER_ENV)
        return {"cwd": self.workdir, "env": env, "start_new_session": True, "close_fds": True}

    def run(
        self, command: str | list[str], timeout: float | None = None, stdin: bytes | None = None
    ) -> ExecResult:
        """Run one command to completion (``bash -c`` when given a string); blocking.

        Raises :class:`SandboxError` on timeout, too much output, a CPU/file-size kill, or (with
        ``violations_are_errors``) output that shows the isolation stopped it.
        """
        cmd, timeout = self._command(command, timeout)
        started = time.monotonic()
        proc = self._start(cmd, stdin is not None)
        try:
            if stdin is not None:
                # fed from a thread: a command that does not read it must not hold us past the timeout
                threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
            output, stopped = read_capped(
                proc.stdout.fileno(), self.config.max_output_bytes, started + timeout
            )
            # EOF does not end the command: it may have closed its stdout and run on.
            if stopped is None and not _ends_within(proc, started + timeout - time.monotonic()):
                stopped = "timeout"
            _kill_unreaped(proc)  # with the jobs it left, before its reaping frees its pid
            exit_code = proc.wait()
        finally:
            self._let_go(proc)
        return self._result(exit_code, output, stopped, started, timeout)

    async def run_async(
        self,
        command: str | list[str],
        timeout: float | None = None,
        cores: frozenset[int] | None = None,
        violations: bool = True,
    ) -> ExecResult:
        """:meth:`run` for the event loop, started on ``cores``: its output and exit are
        awaited on the loop, so a long command holds no worker thread (only its start,
        short, takes one).

        ``violations=False``: the output is not read for what the isolation stopped (whatever
        ``violations_are_errors`` says), for a command whose output holds what other programs
        printed (an agent program's log of its tools, an EVAL's report on the agent's code):
        only what the sandbox itself stops it for is raised."""
        cmd, timeout = self._command(command, timeout)
        started = time.monotonic()

        def start() -> subprocess.Popen:
            # in a thread: building the argv scans /proc, and started_on pins the calling thread
            with started_on(cores):
                return self._start(cmd, stdin=False)

        # a cancel while it starts must not leave the command running untracked by any caller
        proc = await to_thread_to_the_end(start, discard=self._abandon)
        deadline = started + timeout
        try:
            output, stopped = await read_capped_async(proc.stdout, self.config.max_output_bytes, deadline)
            # EOF does not end the command: it may have closed its stdout and run on.
            if stopped is None and not await ended_async(proc, deadline - time.monotonic()):
                stopped = "timeout"
            _kill_unreaped(proc)  # with the jobs it left, before its reaping frees its pid
            exit_code = await exit_code_async(proc)
        finally:
            self._let_go(proc)
            if proc.returncode is None:  # cancelled: reap the killed command, shielded from a second cancel
                await asyncio.shield(exit_code_async(proc, REAP_TIMEOUT_S))
        return self._result(exit_code, output, stopped, started, timeout, violations)

    def _command(self, command: str | list[str], timeout: float | None) -> tuple[list[str], float]:
        cmd = ["bash", "-c", command] if isinstance(command, str) else list(command)
        return cmd, self.config.timeout_s if timeout is None else timeout

    def _start(self, cmd: list[str], stdin: bool) -> subprocess.Popen:
        """Start ``cmd`` in the sandbox, tracked so that :meth:`close` kills it."""
        try:
            proc = subprocess.Popen(
                self.argv(cmd),
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                **self.popen_kwargs(),
            )
        except OSError as exc:
            raise SandboxError("start_failed", f"could not start {cmd[0]!r}: {exc}") from exc
        self.adopt(proc)
        return proc

    def _let_go(self, proc: subprocess.Popen) -> None:
        _kill_unreaped(proc)
        proc.stdout.close()
        self.disown(proc)
        reap_orphaned_namespaces()

    def _abandon(self, proc: subprocess.Popen) -> None:
        """Kill and reap a command whose caller is gone (at most ``REAP_TIMEOUT_S``)."""
        self._let_go(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(REAP_TIMEOUT_S)

    def _result(
        self,
        exit_code: int,
        output: bytes,
        stopped: str | None,
        started: float,
        timeout: float,
        violations: bool = True,
    ) -> ExecResult:
        if self.closed:
            raise SandboxError(
                "died", "the sandbox was closed while the command ran", output.decode(errors="replace")
            )
        result = ExecResult(exit_code, output.decode(errors="replace"), time.monotonic() - started)
        self.check(result, stopped, timeout, violations)
        return result

    def check(
        self,
        result: ExecResult,
        stopped: str | None = None,
        timeout: float | None = None,
        violations: bool = True,
    ) -> None:
        """Raise the :class:`SandboxError` that ``result`` shows, if any (``timeout``: the
        wall-clock limit the command ran under, default ``timeout_s``; ``violations``: read
        the output for what the isolation stopped: a stopped command's for the process limit,
        one that failed with ``violations_are_errors``)."""
        cap = self.config.max_output_bytes
        if stopped and violations and VIOLATION_PATTERNS[0][1].search(result.output.encode()):
            raise SandboxError(
                "process_limit", f"command hit the process limit and was stopped ({stopped})", result.output
            )
        if stopped == "timeout":
            raise SandboxError(
                "timeout",
                f"command ran past its {self.config.timeout_s if timeout is None else timeout:g} s wall-clock limit",
                result.output,
            )
        if stopped == "output":
            raise SandboxError(
                "output_limit", f"command printed more than {cap} bytes; it was killed", result.output
            )
        if result.exit_code in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or (
            result.exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL)
            and result.seconds >= self.config.cpu_seconds
        ):
            raise SandboxError(
                "cpu_limit", f"command used its {self.config.cpu_seconds} CPU seconds", result.output
            )
        if result.exit_code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ):
            raise SandboxError(
                "file_size_limit", f"a file grew past {self.config.file_size_mb} MiB", result.output
            )
        if violations and self.config.violations_are_errors and result.exit_code != 0:
            raw = result.output.encode()
            for kind, pattern in VIOLATION_PATTERNS:
                match = pattern.search(raw)
                if match:
                    raise SandboxError(
                        kind, f"stopped by the sandbox: {match.group(0).decode()}", result.output
                    )

    def adopt(self, handle: subprocess.Popen | PtyProcess) -> None:
        """Track a long-lived process (shell, interpreter) so :meth:`close` kills and reaps it;
        one started as the sandbox closed (from another thread) is killed and reaped here, and
        its owner finds the sandbox closed."""
        with self._closing:
            if not self.closed:
                self._procs.append(handle)
                return
        kill_group(handle.pid)
        _reap([handle], time.monotonic() + REAP_TIMEOUT_S)

    def disown(self, handle: subprocess.Popen | PtyProcess) -> None:
        """Stop tracking a process that is dead and reaped: by the time :meth:`close` runs,
        its pid may lead another process's group."""
        with contextlib.suppress(ValueError):  # close() already let go of it
            self._procs.remove(handle)

    def leftover_processes(self) -> int:
        """Processes still running as this sandbox's uid (0 when it has no uid of its own)."""
        return 0 if self.uid is None else len(_uid_pids(self.uid))

    def close(self) -> None:
        """Kill every process started here (reaping those it tracks) and remove the working
        directory (if made here)."""
        with self._closing:
            if self.closed:
                return
            self.closed = True
            handles = list(self._procs)
            self._procs.clear()
        for handle in handles:
            pid = getattr(handle, "pid", None)
            if pid and not _reaped(handle):  # a reaped pid may lead another process's group
                kill_group(pid)
        _reap(handles, time.monotonic() + REAP_TIMEOUT_S)
        if self.uid is not None:
            _kill_uid(self.uid)
            _release_uid(self.uid)
        reap_orphaned_namespaces()
        if self._owns_dir:
            remove_tree(self.workdir)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def started_on(cores: frozenset[int] | None) -> Iterator[None]:
    """Processes this thread starts inside the block run on ``cores`` (they inherit the thread's affinity).

    Use it around a blocking ``subprocess`` start in a worker thread; ``None`` changes nothing.
    """
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _feed(pipe: IO[bytes], data: bytes) -> None:
    """Write ``data`` to ``pipe`` and close it; gives up when the reader is gone (killed)."""
    with contextlib.suppress(OSError):
        pipe.write(data)
    with contextlib.suppress(OSError):
        pipe.close()


POLL_MAX_MS = 2**31 - 1
"""The longest wait one ``poll`` takes, in milliseconds (about 25 days)."""


def _ready(fd: int, event: int, timeout: float, wake: int | None = None) -> bool:
    """Whether ``fd`` is ready for ``event`` (or hung up, or failed), or ``wake`` is readable,
    within ``timeout`` seconds.

    ``poll``, not ``select``: a busy worker holds more than ``FD_SETSIZE`` (1024) descriptors,
    and ``select`` refuses any numbered past that (``ValueError``). One poll waits at most
    ``POLL_MAX_MS`` (``OverflowError`` past it): a longer ``timeout`` takes several.
    """
    poller = select.poll()
    poller.register(fd, event)
    if wake is not None:
        poller.register(wake, select.POLLIN)
    deadline = time.monotonic() + timeout
    while True:
        left_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
        if poller.poll(min(left_ms, POLL_MAX_MS)):
            return True
        if left_ms <= POLL_MAX_MS:
            return False


def _woken(wake: int | None) -> bool:
    return wake is not None and _ready(wake, select.POLLIN, 0)


def read_capped(fd: int, cap: int, deadline: float) -> tuple[bytes, str | None]:
    """Read ``fd`` until EOF, ``cap`` bytes, or ``deadline``; says which stopped it (None: EOF)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), "timeout"
        if not _ready(fd, select.POLLIN, left):
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            return b"".join(chunks), None
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return b"".join(chunks)[:cap], "output"


def read_some(fd: int, deadline: float, wake: int | None = None) -> bytes | None:
    """What ``fd`` has ready once something arrives: ``b""`` at EOF or once ``wake`` is readable
    (a closer's signal: a process outside the killed group may keep ``fd`` open), None if
    ``deadline`` passes first."""
    left = deadline - time.monotonic()
    if left <= 0 or not _ready(fd, select.POLLIN, left, wake):
        return None
    if _woken(wake):
        return b""
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: the other side of a pty closed
        return b""


def write_all(fd: int, data: bytes, deadline: float, wake: int | None = None) -> bool:
    """Write all of ``data`` to ``fd`` (set non-blocking) unless ``deadline`` passes, or ``wake``
    turns readable, first: False then. A reader that stopped reading (a stuck interpreter, a
    stopped shell) cannot hold the caller past its deadline once ``data`` outgrows the pipe's buffer."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not _ready(fd, select.POLLOUT, left, wake) or _woken(wake):
            return False
        with contextlib.suppress(BlockingIOError):
            view = view[os.write(fd, view) :]
    return True


def reap_orphaned_namespaces() -> None:
    """Reap the zombie children of this process that live in a nested PID namespace.

    bwrap's outer process exits without waiting for its namespace's init, which goes to the
    nearest reaper: PID 1 of the worker's PID namespace (a container's init, or the worker
    itself) or a child subreaper, where it would stay a zombie, one per command, unless that
    reaper reaps. No one in this process waits for such a child (what this process forks
    shares its namespace), so reaping it takes no caller's exit status. A process that is
    not a reaper has no such children, and skips the scan.
    """
    if not _adopts_orphans():
        return
    # /proc may belong to an ancestor of this process's PID namespace (not remounted for it):
    # its ids then start with that namespace's, and a child's id here is the one at our depth
    depth = len(_proc_status("self").get("NSpid", "").split())
    children: list[str] = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as handle:
            children += handle.read().split()
    for child in children:
        try:
            status = _proc_status(child)
        except OSError:
            continue
        ids = status.get("NSpid", "").split()
        if status.get("State", "").strip().startswith("Z") and len(ids) > depth:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(ids[depth - 1]), os.WNOHANG)


PR_GET_CHILD_SUBREAPER = 37


def _adopts_orphans() -> bool:
    """Whether orphaned descendants go to this process: PID 1 of its namespace, or a child subreaper."""
    if os.getpid() == 1:
        return True
    flag = ctypes.c_int(0)
    _libc().prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return bool(flag.value)


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _proc_status(pid: str) -> dict[str, str]:
    """The fields of ``/proc/<pid>/status``."""
    with open(f"/proc/{pid}/status") as handle:
        return dict(line.split(":", 1) for line in handle if ":" in line)


OWNED_FOLDER = re.compile(r"treadle-sbx-([0-9a-f]{8})-(\d+)-(\d+)-")
"""The name of a sandbox folder that records its owner: host key, pid, start time (see :func:`_folder_prefix`)."""

# the sandbox roots this process has swept (see _sweep_once)
_swept_roots: set[str] = set()
_sweep_lock = threading.Lock()


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None if none runs under that id."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@cache
def _host_key() -> str | None:
    """8 hex digits for this host's boot and this process's PID and time namespaces: the pids
    that folders with this key record are ones this process can look up, and their start
    times read as this process reads them (a time namespace shifts them). None where ``/proc``
    is not this namespace's (an ancestor's, not remounted), whose ids are not this process's."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        namespaces = [os.stat("/proc/self/ns/pid").st_ino]
    except OSError:  # no /proc
        return None
    with contextlib.suppress(OSError):  # kernels before 5.6 have no time namespaces
        namespaces.append(os.stat("/proc/self/ns/time").st_ino)
    return hashlib.blake2b(f"{boot}:{namespaces}".encode(), digest_size=4).hexdigest()


@cache
def _folder_prefix(pid: int) -> str:
    """The name prefix of the sandbox folders process ``pid`` (this one; a forked child asks
    again) makes: its host key, pid and start time, so that a later worker can tell that it
    died (SIGKILL, out of memory) without removing them (:func:`sweep_abandoned`)."""
    key = _host_key()
    started = _start_time(pid)
    return "treadle-sbx-" if key is None or started is None else f"treadle-sbx-{key}-{pid}-{started}-"


FOLDER_SUFFIX = 8
"""Characters ``tempfile.mkdtemp`` adds to a sandbox folder's prefix."""


def folder_path_bytes(root_dir: str | None) -> int:
    """Bytes of the path of a sandbox folder this process makes under ``root_dir`` (the
    system temp dir when None)."""
    root = os.path.realpath(root_dir or tempfile.gettempdir())
    return len(os.fsencode(os.path.join(root, _folder_prefix(os.getpid())))) + FOLDER_SUFFIX


def _sweep_once(root: str | None) -> None:
    """:func:`sweep_abandoned` under ``root``, the first time a sandbox of this process is made there."""
    where = os.path.realpath(root or tempfile.gettempdir())
    with _sweep_lock:
        if where in _swept_roots:
            return
        _swept_roots.add(where)
    sweep_abandoned(where)


def sweep_abandoned(root: str) -> list[str]:
    """Remove the sandbox folders under ``root`` whose owner is dead; returns their paths.

    A worker killed with SIGKILL (or by the out-of-memory killer) never closes its sandboxes.
    Only folders provably abandoned go: named for a process of this host and PID namespace
    (:func:`_folder_prefix`) that no longer runs (no process has that pid, or one that started
    at another time), and which this worker may remove (its own, or any when it is root).
    A live worker's folders, other hosts' (a shared ``root_dir``) and unmarked ones stay.
    """
    key = _host_key()
    if key is None:
        return []
    euid = os.geteuid()
    removed = []
    for name in os.listdir(root):
        match = OWNED_FOLDER.match(name)
        if match is None or match.group(1) != key:
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:  # removed meanwhile
            continue
        if not stat.S_ISDIR(info.st_mode) or (euid != 0 and info.st_uid != euid):
            continue
        if _start_time(int(match.group(2))) != int(match.group(3)):
            remove_tree(path)
            removed.append(path)
    if removed:
        log.info("removed %d sandbox folders of dead workers under %s", len(removed), root)
    return removed


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything under it, whatever a command left there: folders
    nested thousands deep (``shutil.rmtree`` recurses in Python, and its ``RecursionError``
    would escape) and folders it took its owner's access to (``chmod 000``, which refuses
    entry to a worker that is not root). coreutils walk any depth."""
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "check": False}
    subprocess.run(["rm", "-rf", "--", path], **quiet)
    if os.path.lexists(path):
        subprocess.run(["chmod", "-R", "u+rwx", "--", path], **quiet)
        subprocess.run(["rm", "-rf", "--", path], **quiet)
    if os.path.lexists(path):
        log.warning("could not remove the sandbox folder %s", path)


def _reap(handles: list[subprocess.Popen | PtyProcess], deadline: float) -> None:
    """Wait (polling, until ``deadline``) for killed processes to end, reaping each through its
    own handle so that it keeps the exit status; one still running by then (stuck in the
    kernel) is left to its handle. An owner (a shell, an interpreter) may reap it meanwhile."""
    while handles and time.monotonic() < deadline:
        handles = [handle for handle in handles if not _ended(handle)]
        if handles:
            time.sleep(0.01)


def _reaped(handle: subprocess.Popen | PtyProcess) -> bool:
    """Whether ``handle``'s process has been reaped (by its run, or its owner); reaps nothing."""
    if isinstance(handle, subprocess.Popen):
        return handle.returncode is not None
    return handle.terminated


def _ended(handle: subprocess.Popen | PtyProcess) -> bool:
    if isinstance(handle, subprocess.Popen):
        return handle.poll() is not None
    try:
        return not handle.isalive()
    except PtyProcessError:  # its owner reaped it while this asked
        return True


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (every sandbox command leads its own session
    and group) and the rest of its session: a job the command moved to a group of its own
    (``set -m``, ``setpgid``) is still in it. One that left the session (``setsid``) is out
    of reach here; bwrap's PID namespace, or a root worker's per-sandbox uid, contains it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for member in _session_pids(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


def _kill_unreaped(proc: subprocess.Popen) -> None:
    """:func:`kill_group` of ``proc`` unless it is reaped (here or by a ``close()``): its pid
    may lead another process's group by then."""
    if proc.returncode is None:
        kill_group(proc.pid)


def exited(pid: int) -> bool:
    """Whether the child ``pid`` has ended (or was reaped), leaving it unreaped: until it is
    reaped its number cannot go to another process, so its group can still be killed."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def descendants(pid: int) -> list[int]:
    """Ids of the processes descended from ``pid`` now: its children, theirs, and so on."""
    found: list[int] = []
    parents = [pid]
    while parents:
        parent = parents.pop()
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{tid}/children") as handle:
                    children = [int(child) for child in handle.read().split()]
                found += children
                parents += children
    return found


def wait_ended(pids: list[int], deadline: float) -> None:
    """Wait (polling, until ``deadline``) until none of ``pids`` runs any more (a zombie has ended).

    A killed process tree takes a moment to die (bwrap's: once its namespace's init has killed
    the rest), and until then it counts against the sandbox's ``max_processes``: a shell or
    interpreter started in its place at once could not fork.
    """
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        return not _proc_status(str(pid)).get("State", "").strip().startswith("Z")
    except OSError:
        return False


def _session_pids(sid: int) -> list[int]:
    """Ids of the processes in session ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[3]) == sid:
                    pids.append(int(entry))
    return pids


# the claim of each uid a live sandbox of this process holds (see _claim_uid)
_uid_claims: dict[int, socket.socket] = {}
_uids_lock = threading.Lock()


@cache
def _sandbox_uids_mapped() -> bool:
    """Whether this process's user namespace maps every per-sandbox uid (``UID_BASE`` and the
    ``UID_RANGE`` after it). A rootless or user-namespaced container maps a few thousand (its
    root is a user of the host), where a chown to one of them fails (``EINVAL``): a root
    worker there runs its sandboxes as itself, as a worker that is not root does."""
    with open("/proc/self/uid_map") as handle:
        extents = [tuple(map(int, line.split())) for line in handle if line.strip()]
    if any(inside <= UID_BASE and inside + count >= UID_BASE + UID_RANGE for inside, _, count in extents):
        return True
    log.warning(
        "this user namespace does not map uids %d..%d: sandboxes run as the worker's own uid, "
        "and max_processes counts the worker's processes too",
        UID_BASE,
        UID_BASE + UID_RANGE - 1,
    )
    return False


def _claim_uid() -> int:
    """A per-sandbox uid that no live sandbox of a worker in this network namespace holds and
    no process runs as.

    The claim is an abstract Unix socket named for the uid, bound for the sandbox's life: a
    bind is atomic between processes (the env workers of a node, whose sandboxes may not have
    run anything yet), and the kernel lets go of it when the worker dies."""
    while True:
        uid = UID_BASE + secrets.randbelow(UID_RANGE)
        if _uid_pids(uid):
            continue
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0treadle-sandbox-uid-{uid}")
        except OSError as exc:
            claim.close()
            if exc.errno == errno.EADDRINUSE:
                continue
            raise
        with _uids_lock:
            _uid_claims[uid] = claim
        return uid


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: a ``kill -9 -1`` sent as ``uid`` reaches all of them
    but itself at once, and no fork gets past it (a fork fails once its parent has a SIGKILL
    pending), where a scan of /proc kills what it found, not a child forked since. The scan
    stays for what the kill could not reach (its start refused)."""
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "check": False}
    with contextlib.suppress(OSError):
        subprocess.run([*_run_as(uid), "kill", "-9", "-1"], env=LAUNCHER_ENV, **quiet)
    for pid in _uid_pids(uid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _release_uid(uid: int) -> None:
    with _uids_lock:
        claim = _uid_claims.pop(uid, None)
    if claim is not None:
        claim.close()


def _uid_pids(uid: int) -> list[int]:
    """Ids of the processes running as ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
    return pids


def python_in_sandbox(config: SandboxConfig) -> str:
    """The interpreter to run inside: ``config.python``, resolved to a path the sandbox can see."""
    path = shutil.which(config.python, path=SANDBOX_PATH) or config.python
    if not os.path.isabs(path):
        raise SandboxError("start_failed", f"python interpreter {config.python!r} not found")
    return path


async def read_capped_async(pipe: IO[bytes], cap: int, deadline: float) -> tuple[bytes, str | None]:
    """:func:`read_capped` on the event loop: read ``pipe`` until EOF, ``cap`` bytes, or
    ``deadline`` (``time.monotonic``); says which stopped it (None: EOF)."""
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe
    )
    chunks: list[bytes] = []
    size = 0
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
            except TimeoutError:
                return b"".join(chunks), "timeout"
            if not chunk:
                return b"".join(chunks), None
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                return b"".join(chunks)[:cap], "output"
    finally:
        transport.close()


async def exit_code_async(proc: subprocess.Popen, timeout: float | None = None) -> int | None:
    """``proc``'s exit status once it ends (awaited on a pidfd), or None if ``timeout`` passes first."""
    if not await ended_async(proc, timeout):
        return None
    return proc.wait()


async def ended_async(proc: subprocess.Popen, timeout: float | None = None) -> bool:
    """Whether ``proc`` ends within ``timeout`` (awaited on a pidfd), leaving it unreaped
    (see :func:`exited`)."""
    if proc.returncode is not None or exited(proc.pid):  # a reaped pid, perhaps reused since
        return True
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except OSError:  # no descriptor to spare (EMFILE): poll instead
        return await _polled_end(proc, timeout)
    ended = loop.create_future()
    loop.add_reader(pidfd, lambda: ended.done() or ended.set_result(None))
    try:
        await asyncio.wait_for(ended, timeout)
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return True


async def _polled_end(proc: subprocess.Popen, timeout: float | None) -> bool:
    """:func:`ended_async` without a pidfd: polls the process every 10 ms."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while proc.returncode is None and not exited(proc.pid):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def _ends_within(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` ends within ``timeout`` seconds, leaving it unreaped (see :func:`exited`)."""
    if proc.returncode is not None or exited(proc.pid):  # a reaped pid, perhaps reused since
        return True
    try:
        pidfd = os.pidfd_open(proc.pid)
    except OSError:  # no descriptor to spare (EMFILE): poll instead
        deadline = time.monotonic() + timeout
        while not exited(proc.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True
    try:
        return _ready(pidfd, select.POLLIN, timeout)
    finally:
        os.close(pidfd)
