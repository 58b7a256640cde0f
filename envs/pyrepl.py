"""A persistent Python interpreter inside a sandbox.

A small server (:data:`SERVER`, stdlib only) runs in the sandbox, says ``ready`` once it runs,
then reads one JSON request per line on stdin (``{"code": "...", "id": nonce}``); it executes
the code in one persistent namespace, echoes the value of a final expression like a REPL, and
answers one JSON line (``{"id", "output", "error", "truncated"}``) on its original stdout.
Output is captured from ``sys.stdout``/``sys.stderr`` and their ``buffer`` (one object for
every run, so that a stream the code kept, a logging handler's, writes to the run going on) and
capped inside the server at ``max_output_bytes`` bytes of UTF-8; bytes that child processes
write straight to file descriptors are discarded. The code's stdin is ``/dev/null``: ``input()`` raises ``EOFError``
rather than waiting on the request channel. A copy of the server that the code forks exits once
the code is done in it, without answering or reading another request. The sandbox's
``cpu_seconds`` (RLIMIT_CPU) holds the interpreter over its whole life, not each run: one killed
for it says so (``cpu_limit``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from envs.sandbox import (
    REAP_TIMEOUT_S,
    ExecResult,
    Sandbox,
    SandboxError,
    descendants,
    exited,
    kill_group,
    python_in_sandbox,
    read_some,
    wait_ended,
    write_all,
)

SERVER = r"""
import ast, io, json, os, sys, traceback
proto = os.fdopen(os.dup(1), "w")
requests = os.fdopen(os.dup(0))
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0); os.dup2(null, 1); os.dup2(null, 2)
CAP = int(sys.argv[1])
server = os.getpid()
proto.write("ready\n"); proto.flush()

class OutputLimit(BaseException):
    pass

class CappedBytes(io.BufferedIOBase):
    # sys.stdout.buffer: bytes written there join the same capped output, in order
    def __init__(self, text):
        self.text = text
    def writable(self):
        return True
    def write(self, b):
        data = bytes(memoryview(b))
        self.text.write(data.decode("utf-8", "replace"))
        return len(data)

class Capped(io.TextIOBase):
    encoding = "utf-8"
    def __init__(self):
        self.buffer = CappedBytes(self)
        self.clear()
    def clear(self):
        self.parts, self.size = [], 0
    def writable(self):
        return True
    def write(self, s):
        # a write that fails keeps nothing: what is kept is joined into the reply
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if self.size > CAP:  # the code caught the OutputLimit and printed on
            raise OutputLimit()
        size = len(s.encode("utf-8", "surrogatepass"))
        self.parts.append(s); self.size += size
        if self.size > CAP:
            raise OutputLimit()
        return len(s)
    def value(self):
        return "".join(self.parts).encode("utf-8", "surrogatepass")[:CAP].decode("utf-8", "ignore")

namespace = {"__name__": "__main__"}
out = Capped()  # one for every run: what the code keeps of it (a logging handler) writes to the run now
for line in requests:
    request = json.loads(line)
    code = request["code"]
    out.clear(); sys.stdout = sys.stderr = out
    error = None; truncated = False
    try:
        tree = ast.parse(code, "<action>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<action>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<action>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except OutputLimit:
        truncated = True
    except BaseException as exc:
        error = type(exc).__name__[:200]
        try:
            traceback.print_exc(limit=-3)
        except OutputLimit:
            truncated = True
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    if os.getpid() != server:
        os._exit(0)
    reply = {"id": request["id"], "output": out.value(), "error": error, "truncated": truncated or out.size > CAP}
    proto.write(json.dumps(reply) + "\n")
    proto.flush()
"""


@dataclass
class ReplResult:
    """Output of one ``run``: the captured text, the exception name if the code raised, and truncation."""

    output: str
    error: str | None
    truncated: bool


class PythonRepl:
    """A Python interpreter that keeps its namespace between :meth:`run` calls (blocking)."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        cap = sandbox.config.max_output_bytes
        argv = sandbox.argv([python_in_sandbox(sandbox.config), "-I", "-u", "-c", SERVER, str(cap)])
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,  # the server moves its fd 2 to /dev/null once it runs
                **sandbox.popen_kwargs(),
            )
        except OSError as exc:
            raise SandboxError("start_failed", f"could not start the Python interpreter: {exc}") from exc
        sandbox.adopt(self.proc)
        self._buffer = b""
        self.closed = False
        self._lock = threading.RLock()  # held by a run while it uses the pipes
        self._reaping = threading.Lock()  # held to reap the interpreter, and to signal it or the run
        self._wake: int | None = os.eventfd(0, os.EFD_CLOEXEC)  # readable once it is killed
        self._killed = False
        # Handed out once the server says it runs: the sandbox has forked every process down to
        # the interpreter, so pinning the tree to an action's cores reaches the interpreter itself
        # (a process still being forked keeps the cores its parent had before the move).
        started = time.monotonic()
        timeout = sandbox.config.timeout_s
        self._read_line(
            started,
            started + timeout,
            SandboxError("start_failed", f"the Python interpreter did not start within {timeout:g} s"),
        )

    @property
    def alive(self) -> bool:
        if self.closed or self.sandbox.closed:
            return False
        with self._reaping:
            return self.proc.returncode is None and not exited(self.proc.pid)

    def run(self, code: str, timeout: float | None = None) -> ReplResult:
        """Execute ``code``; a timeout or a dead interpreter kills it and raises :class:`SandboxError`.

        An exception raised by the code is not an error of the sandbox: it comes back as
        ``error`` with its traceback in ``output`` — unless it shows the isolation stopped the
        code (``MemoryError``, a refused connection, ...) and ``violations_are_errors`` is set.
        """
        with self._lock:
            return self._run(code, timeout)

    def _run(self, code: str, timeout: float | None) -> ReplResult:
        if not self.alive:
            if self.closed or self.sandbox.closed:
                raise SandboxError("died", "the Python interpreter is not running")
            self._died(time.monotonic())  # it ended on its own since the last run (a thread's exit)
        config = self.sandbox.config
        timeout = config.timeout_s if timeout is None else timeout
        started = time.monotonic()
        deadline = started + timeout
        nonce = secrets.token_hex(8)
        try:
            sent = write_all(
                self.proc.stdin.fileno(),
                json.dumps({"code": code, "id": nonce}).encode() + b"\n",
                deadline,
                self._wake,
            )
        except BrokenPipeError:
            self._died(started)
        if not sent:
            if self._killed:  # woken by close(), which closes the pipes once this run lets go
                raise SandboxError("died", "the interpreter was closed while it took the code")
            self.close()
            raise SandboxError(
                "timeout", f"the interpreter took no input for its {timeout:g} s limit; it was killed"
            )
        line = self._read_line(
            started,
            deadline,
            SandboxError("timeout", f"code ran past its {timeout:g} s wall-clock limit; interpreter killed"),
        )
        result = self._reply(line, nonce)
        if result.truncated:
            raise SandboxError(
                "output_limit", f"code printed more than {config.max_output_bytes} bytes", result.output
            )
        if result.error:
            self.sandbox.check(ExecResult(1, result.output, time.monotonic() - started))
        return result

    def _read_line(self, started: float, deadline: float, late: SandboxError) -> bytes:
        """The server's next line. The interpreter is killed when the line has not come by
        ``deadline`` (``late`` is raised), when it exits, or when the line outgrows any answer."""
        # the reply's JSON escapes each byte of output into at most 6 (a control byte: \u00XX)
        limit = 6 * self.sandbox.config.max_output_bytes + 1024
        while b"\n" not in self._buffer:
            chunk = read_some(self.proc.stdout.fileno(), deadline, self._wake)
            if chunk is None:
                self.close()
                raise late
            if not chunk:
                self._died(started)
            self._buffer += chunk
            if len(self._buffer) > limit:
                self.close()
                raise SandboxError("output_limit", "the interpreter answered more than its output cap")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _reply(self, line: bytes, nonce: str) -> ReplResult:
        """The server's answer to the request ``nonce``. The code can write to the reply
        channel too (``__main__.proto``): a line that is not that answer kills the
        interpreter, rather than failing the step or handing a later call a stale reply."""
        try:
            reply = json.loads(line)
            if reply["id"] != nonce:
                raise ValueError(f"a reply to another request: {reply['id']!r}")
            output, error = str(reply["output"]), reply["error"] and str(reply["error"])
            for text in (output, error or ""):
                # a lone surrogate, which only a forged reply holds, fails here (UnicodeEncodeError
                # is a ValueError) rather than in the first encode of the observation
                text.encode()
            return ReplResult(output, error, bool(reply["truncated"]))
        except (ValueError, KeyError, TypeError) as exc:
            self.close()
            raise SandboxError(
                "died", f"the interpreter's reply was malformed ({exc}); it was killed"
            ) from None

    def _died(self, started: float) -> None:
        self._kill()  # before it is reaped: what it left in its group goes too
        deadline = time.monotonic() + 2.0
        while (status := self._poll()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        status = -1 if status is None else status
        said = self._start_errors()
        self.close()
        try:
            self.sandbox.check(ExecResult(status, "", time.monotonic() - started))
        except SandboxError as exc:
            if exc.kind != "cpu_limit":
                raise
            # RLIMIT_CPU counts the interpreter's whole life: the run it stopped may have used little
            raise SandboxError(
                "cpu_limit",
                f"the Python interpreter used its {self.sandbox.config.cpu_seconds} CPU seconds, "
                "counted over every run since it started; it was killed",
            ) from None
        raise SandboxError(
            "died", f"the Python interpreter exited with status {status}" + (f": {said}" if said else "")
        )

    def _start_errors(self) -> str:
        """What the sandbox or the interpreter printed to stderr before the server ran (why it
        could not start: a path the sandbox does not show, say), at most 1000 bytes."""
        fd = self.proc.stderr.fileno()
        os.set_blocking(fd, False)
        with contextlib.suppress(OSError):
            return os.read(fd, 1000).decode(errors="replace").strip()
        return ""

    def close(self) -> None:
        """Kill the interpreter and everything it started, and wait until that has ended; safe
        to call twice.

        A :meth:`run` in flight on another thread (that of a step whose caller was cancelled)
        sees the interpreter end, and the pipes are closed only once that run has let go of
        them: closed under the run, a number could be another descriptor's by the time the run
        reads it (a pipe or socket of another rollout, whose data the run would take). The run
        is woken too, and lets go at once: a process that left the interpreter's session
        (``setsid``) is out of reach of the kill, and may hold the pipe open past the run's deadline.
        """
        tree = self._kill()
        with self._lock:
            if self.closed:
                return
            self.closed = True
            with self._reaping:
                os.close(self._wake)
                self._wake = None
                for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                    with contextlib.suppress(OSError):
                        stream.close()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.proc.pid, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=5)
            if self.proc.returncode is not None:
                self.sandbox.disown(self.proc)
        wait_ended(tree, time.monotonic() + REAP_TIMEOUT_S)

    def _kill(self) -> list[int]:
        """SIGKILL the interpreter's group and session unless it is reaped (its pid may lead
        another process's group by then), and wake a run in flight; the processes it had."""
        with self._reaping:
            tree = []
            if self.proc.returncode is None:
                tree = descendants(self.proc.pid)
                kill_group(self.proc.pid)
            self._killed = True
            if self._wake is not None:
                os.eventfd_write(self._wake, 1)
            return tree

    def _poll(self) -> int | None:
        """Reap the interpreter if it has ended; its exit status then."""
        with self._reaping:
            return self.proc.poll()
