"""A persistent bash on a pseudo-terminal inside a sandbox.

The shell survives between actions (``cd``, exported variables and files persist). Each command
is sent as one ``\\builtin eval $'…'`` with stdin from ``/dev/null``, followed on the same
line by a ``printf`` of an end marker that holds a fresh random nonce, the exit status and the
working directory the command left (a shell killed for a command starts afresh there), so neither
the command's output nor a guess can fake the end of a command. The marker goes to descriptor
``MARK_FD``, a copy of the terminal the shell opens as it starts, so a command that sends its
own output elsewhere (``exec >out.log 2>&1``) still ends. Both go through ``\\builtin``, which
no function or alias of the agent's named ``eval`` or ``printf`` shadows, nor (quoted) an alias
named ``builtin``. A command that closes or moves ``MARK_FD``, defines a function named
``builtin`` (bash lets one shadow any builtin, and every way to reach one can be a function) or
disables the builtin (``enable -n printf``) does hide it, and runs into its timeout like one
that never ends. (It stays open through the command: closed for it and restored after, it would
have to be made again at its number, which a command that lowered ``ulimit -n`` below it
forbids, and the shell would die.)

The terminal is switched to non-canonical mode with echo off (no line-length limit, no echoed
input), set again before each command, and bash runs without readline. ``PAGER`` and
``GIT_PAGER`` are ``cat`` unless the sandbox's ``env`` sets them; a program meant for a
terminal (``less``, ``vi``, ``top``) runs into its timeout. The sandbox's ``cpu_seconds``
(RLIMIT_CPU) holds bash over its whole life, what its builtins and loops ran in every command:
a shell killed for it says so (``cpu_limit``).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import termios
import threading
import time

from ptyprocess import PtyProcess

from envs.sandbox import (
    REAP_TIMEOUT_S,
    ExecResult,
    Sandbox,
    SandboxError,
    descendants,
    exited,
    kill_group,
    read_some,
    wait_ended,
    write_all,
)

_MARK = b"\x1eTRD"
MAX_CWD_BYTES = 1024
"""The longest working directory an end marker carries (it holds the first this many bytes,
and one this long is taken as cut); a shell killed in a longer one starts afresh in the
sandbox's folder."""
_MARK_BYTES = 64 + MAX_CWD_BYTES
"""The most an end marker takes."""
MARK_FD = 63
"""The shell's descriptor for end markers: past those scripts number by hand (3 to 9) and
those bash takes for itself from 10 up."""


def ansi_c_quote(text: str | bytes) -> str:
    """``text`` as a bash ``$'…'`` literal: every byte that is not plain printable ASCII escaped."""
    out = []
    for byte in text if isinstance(text, bytes) else text.encode():
        char = chr(byte)
        if 0x20 <= byte < 0x7F and char not in "\\'":
            out.append(char)
        else:
            out.append(f"\\x{byte:02x}")
    return "$'" + "".join(out) + "'"


def _restore_signals() -> None:
    """Give bash (and so its commands) the SIGPIPE and SIGXFSZ defaults Python ignores, as
    ``subprocess.Popen`` does: a command that outgrows ``file_size_mb`` is killed (``file_size_limit``)."""
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)


def _printed(buffer: bytearray, cap: int) -> str:
    """What a command printed (at most ``cap`` bytes of it), to show with why it was stopped."""
    return bytes(buffer[:cap]).decode(errors="replace")


class Shell:
    """A bash that lives as long as its sandbox; :meth:`run` executes one command in it (blocking)."""

    def __init__(self, sandbox: Sandbox, cwd: str | None = None):
        """Start bash in ``cwd`` (a killed shell's :attr:`cwd`), or in the sandbox's folder
        when None or gone."""
        self.sandbox = sandbox
        self.cwd = cwd  # where the last command that ended left the shell (None: not known)
        kwargs = sandbox.popen_kwargs()
        argv = sandbox.argv(["bash", "--norc", "--noprofile", "--noediting", "-i"])
        try:
            self.proc = PtyProcess.spawn(
                argv,
                cwd=kwargs["cwd"],
                env=kwargs["env"],
                echo=False,
                dimensions=(50, 200),
                preexec_fn=_restore_signals,
            )
        except OSError as exc:
            raise SandboxError("start_failed", f"could not start bash: {exc}") from exc
        sandbox.adopt(self.proc)
        self.fd = self.proc.fd
        self.closed = False
        self._lock = threading.RLock()  # held by a run while it uses the pty
        self._reaping = threading.Lock()  # held to reap the shell, and to signal it or the run
        self._wake: int | None = os.eventfd(0, os.EFD_CLOEXEC)  # readable once the shell is killed
        self._killed = False
        self._killed_tree: list[int] = []  # what a kill found running in bwrap's PID namespace
        try:
            attrs = termios.tcgetattr(self.fd)
            attrs[1] &= ~termios.OPOST
            attrs[3] &= ~(termios.ECHO | termios.ICANON | termios.ISIG)
            attrs[6][termios.VMIN] = 1
            attrs[6][termios.VTIME] = 0
            self._modes = attrs
            # a pager (git's, man's) would wait on the terminal for a key until the timeout
            start = (
                f"exec {MARK_FD}>&1; PS1=''; PS2=''; unset PROMPT_COMMAND MAILCHECK HISTFILE; set +H +m; "
                'export PAGER="${PAGER-cat}" GIT_PAGER="${GIT_PAGER-cat}"'
            )
            if cwd is not None:
                start += f"; builtin cd -- {ansi_c_quote(os.fsencode(cwd))} 2>/dev/null"
            self.run(start, wrap=False)
        except BaseException:
            # a sandbox closed as the shell started (its adopt killed the shell) raises here too:
            # no caller holds the shell to close its pty and eventfd
            self.close()
            raise

    @property
    def alive(self) -> bool:
        if self.closed or self.sandbox.closed:
            return False
        with self._reaping:
            return not self.proc.terminated and not exited(self.proc.pid)

    def run(self, command: str, timeout: float | None = None, wrap: bool = True) -> ExecResult:
        """Run ``command`` in the shell; returns its output and exit status.

        A timeout, too much output, or the shell dying kills the shell and raises
        :class:`SandboxError`; so does output that shows the isolation stopped the command
        (with ``violations_are_errors``). A command that ended having printed more than
        ``max_output_bytes`` is an ``output_limit`` too, the shell kept.
        """
        with self._lock:
            return self._run(command, timeout, wrap)

    def _run(self, command: str, timeout: float | None, wrap: bool) -> ExecResult:
        # a shell that exited before its start's command (bwrap refused a bind) is read to its
        # end below, for what it printed
        if not self.alive and (wrap or self.closed or self.sandbox.closed):
            raise SandboxError("died", "the shell is not running")
        config = self.sandbox.config
        timeout = config.timeout_s if timeout is None else timeout
        # a command may have changed the terminal (``reset``, ``stty sane <&2``): echoed, the
        # next command would show in its own output, and past 4095 bytes, cut, never end
        termios.tcsetattr(self.fd, termios.TCSANOW, self._modes)
        nonce = secrets.token_hex(8)
        body = f"\\builtin eval {ansi_c_quote(command)} </dev/null" if wrap else command
        # one line, which bash reads whole before it runs any of it: a printf on a line of its
        # own could stay in the terminal past bash's 1024-byte read, for the command to read.
        # Its trace (``set -x``) goes nowhere; "${PWD-}": with ``set -u`` an unset PWD is an error
        template = f"'\\036TRD{nonce}:%s:%.{MAX_CWD_BYTES}s\\036'"
        marker = f'\\builtin printf {template} "$?" "${{PWD-}}" >&{MARK_FD}'
        line = f"{body}; {{ {marker}; }} 2>/dev/null\n"
        started = time.monotonic()
        if not write_all(self.fd, line.encode(), started + timeout, self._wake):
            if self._killed:  # woken by close(), which closes the pty once this run lets go
                raise SandboxError("died", "the shell was closed while it took the command")
            self.close()
            raise SandboxError(
                "timeout", f"the shell took no input for its {timeout:g} s wall-clock limit; it was killed"
            )
        end = re.compile(re.escape(_MARK + nonce.encode()) + rb":(\d+):([^\x1e]*)\x1e")
        buffer = bytearray()
        cap = config.max_output_bytes
        while True:
            match = end.search(buffer, max(0, len(buffer) - 65536 - _MARK_BYTES))
            if match:
                cwd = match.group(2)
                self.cwd = os.fsdecode(cwd) if 0 < len(cwd) < MAX_CWD_BYTES else None
                if match.start() > cap:  # it ended, but printed more than the cap (read at once)
                    raise SandboxError(
                        "output_limit", f"command printed more than {cap} bytes", _printed(buffer, cap)
                    )
                output = bytes(buffer[: match.start()])
                result = ExecResult(
                    int(match.group(1)), output.decode(errors="replace"), time.monotonic() - started
                )
                self.sandbox.check(result)
                return result
            if len(buffer) > cap + _MARK_BYTES:
                self.close()
                raise SandboxError(
                    "output_limit",
                    f"command printed more than {cap} bytes; the shell was killed",
                    _printed(buffer, cap),
                )
            left = started + timeout - time.monotonic()
            if left <= 0:
                self.close()
                raise SandboxError(
                    "timeout",
                    f"command ran past its {timeout:g} s wall-clock limit; the shell was killed",
                    _printed(buffer, cap),
                )
            chunk = read_some(self.fd, started + timeout, self._wake)
            if chunk == b"":
                self._kill()  # before it is reaped: what it left in its group goes too
                status = self._exit_status()
                output = _printed(buffer, cap)
                seconds = time.monotonic() - started  # before close(), which may wait for the tree
                self.close()
                self._check_died(ExecResult(status, output, seconds))
                reason = f"the shell exited with status {status}"
                if not wrap:  # the start's own command: what it printed is the sandbox's or bash's
                    reason += f": {output.strip()[:1000]}"
                raise SandboxError("died", reason, output) from None
            buffer += chunk or b""

    def _check_died(self, result: ExecResult) -> None:
        """Raise what the sandbox's check makes of the shell's own end (``result``)."""
        try:
            self.sandbox.check(result)
        except SandboxError as exc:
            if exc.kind != "cpu_limit":
                raise
            # RLIMIT_CPU counts the shell's whole life (its builtins and loops over every
            # command): the command it stopped may have used little
            raise SandboxError(
                "cpu_limit",
                f"the shell used its {self.sandbox.config.cpu_seconds} CPU seconds, counted over "
                "every command since it started; it was killed",
                result.output,
            ) from None

    def _exit_status(self) -> int:
        """Exit status of the exited shell (negative: the signal that killed it)."""
        deadline = time.monotonic() + 2.0
        while not self._reaped() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._reaped():
            return -1
        return -self.proc.signalstatus if self.proc.signalstatus else self.proc.exitstatus

    def close(self) -> None:
        """Kill the shell and everything it started; safe to call twice.

        A :meth:`run` in flight on another thread (that of a step whose caller was cancelled)
        sees the shell end, and the pty is closed only once that run has let go of it: closed
        under the run, its number could be another descriptor's by the time the run reads it
        (a pipe or socket of another rollout, whose data the run would take). The run is woken
        too, and lets go at once: a process that left the shell's session (``setsid``) is out of
        reach of the kill, and may hold the pty open past the run's deadline.

        Under bwrap it returns once the processes the kill found have ended (at most
        ``REAP_TIMEOUT_S``): its PID namespace dies whole, but a moment after its outer process,
        and until then its processes count against ``max_processes``, so a shell started in this
        one's place at once (after a fork loop ran past its timeout) could not start.
        """
        self._kill()
        with self._lock:
            if self.closed:
                return
            self.closed = True
            with self._reaping:
                os.close(self._wake)
                self._wake = None
                if self.proc.isalive():
                    self.proc.terminate(force=True)
                self.proc.close(force=True)
            self.sandbox.disown(self.proc)
        wait_ended(self._killed_tree, time.monotonic() + REAP_TIMEOUT_S)

    def _kill(self) -> None:
        """SIGKILL the shell's group and session unless it is reaped (its pid may lead another
        process's group by then), and wake a run in flight."""
        with self._reaping:
            if not self.proc.terminated:
                # elsewhere a process that left the session outlives the kill: not waited for
                if self.sandbox.backend == "bwrap":
                    self._killed_tree += descendants(self.proc.pid)
                kill_group(self.proc.pid)
            self._killed = True
            if self._wake is not None:
                os.eventfd_write(self._wake, 1)

    def _reaped(self) -> bool:
        """Reap the shell if it has ended; whether it is reaped."""
        with self._reaping:
            return not self.proc.isalive()
