"""PythonRepl: what a run reports about an interpreter that ended on its own."""

import time

import pytest

from envs.pyrepl import PythonRepl
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
