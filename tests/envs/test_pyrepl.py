"""PythonRepl: what a run reports about an interpreter that ended on its own."""

import time

import pytest

from envs.pyrepl import PythonRepl, ReplResult
from envs.sandbox import Sandbox, SandboxConfig, SandboxError

SMALL = SandboxConfig(cpu_seconds=5, memory_mb=256, max_processes=32, timeout_s=10)


def test_an_interpreter_that_ended_between_runs_is_reported_with_its_status_and_closed():
    """Code that left a thread to end the interpreter after its run (``os._exit(5)``): the next
    run said only 'not running', the status unreported, and left the dead interpreter unclosed,
    its pipes and wake-up descriptor open (pytool starts a new one in its place, so the old
    one's descriptors leaked for the worker's life) and its process unreaped."""
    with Sandbox(SMALL) as sandbox:
        repl = PythonRepl(sandbox)
        try:
            repl.run(
                "import os, threading, time\n"
                "threading.Thread(target=lambda: (time.sleep(0.2), os._exit(5))).start()"
            )
            deadline = time.monotonic() + 10
            while repl.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(SandboxError, match="exited with status 5") as exc:
                repl.run("1")
            assert exc.value.kind == "died"
            assert repl.closed and repl._wake is None and repl.proc.returncode == 5
        finally:
            repl.close()


def test_an_interpreter_out_of_cpu_time_says_the_limit_counts_every_run_since_it_started():
    """RLIMIT_CPU holds the persistent interpreter to ``cpu_seconds`` over its whole life, so a
    short run after longer ones was stopped as 'command used its 1 CPU seconds': a reason that
    was false of that run, and told the model (and the run's log) nothing of what to change."""
    with Sandbox(SMALL.model_copy(update={"cpu_seconds": 1})) as sandbox:
        repl = PythonRepl(sandbox)
        try:
            busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass"
            repl.run(busy.format(0.7))
            with pytest.raises(SandboxError) as exc:
                repl.run(busy.format(0.5))  # killed at 1 s of the interpreter's, under 0.5 s of its own
            assert exc.value.kind == "cpu_limit"
            assert "counted over every run since it started" in exc.value.reason
        finally:
            repl.close()


def test_code_that_writes_bytes_to_stdouts_buffer_prints_them_in_order_and_capped():
    """``sys.stdout.buffer.write(b'...')``, the fast output of competitive programming, raised
    AttributeError ('Capped' object has no attribute 'buffer'), and ``sys.stdout.encoding`` was
    None, where plain Python has both."""
    with Sandbox(SMALL.model_copy(update={"max_output_bytes": 256})) as sandbox:
        repl = PythonRepl(sandbox)
        try:
            code = "import sys\nprint('a')\nn = sys.stdout.buffer.write(b'1 2\\n')\nsys.stdout.buffer.flush()\nn, sys.stdout.encoding"
            assert repl.run(code) == ReplResult("a\n1 2\n(4, 'utf-8')\n", None, False)
            with pytest.raises(SandboxError) as exc:
                repl.run("sys.stdout.buffer.write(b'x' * 300)")
            assert exc.value.kind == "output_limit" and exc.value.output == "x" * 256
        finally:
            repl.close()
