"""run_async: SIGTERM cancels the async work, lets it clean up, then reaches the handler
installed before, wherever in the event loop it landed."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tasks.event_loop import run_async

REPO = Path(__file__).resolve().parents[2]


class Stopped(BaseException):
    """What the handler installed before raises: a BaseException, as Prefect's
    ``TerminationSignal`` is."""


def raise_stopped(signum, frame):
    raise Stopped(signum)


@pytest.fixture
def sigterm_raises_stopped():
    previous = signal.signal(signal.SIGTERM, raise_stopped)
    yield
    signal.signal(signal.SIGTERM, previous)


def sigterm_from_a_background_task(log: list[str]) -> None:
    """Start a task that sends SIGTERM to this process and runs on: the handler runs
    while that task, not the one awaiting, executes."""

    async def background() -> None:
        await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGTERM)
        total = 0
        for i in range(10_000):  # the pending handler runs at one of these bytecodes
            total += i
        log.append("background ran on")

    asyncio.get_running_loop().create_task(background())


def test_sigterm_landing_in_a_background_task_cancels_main_which_cleans_up_before_the_handler_runs(
    sigterm_raises_stopped,
):
    log = []

    async def main() -> str:
        sigterm_from_a_background_task(log)
        try:
            await asyncio.sleep(5)
            log.append("main ran to its end")
        except asyncio.CancelledError:
            log.append("main cancelled")
            raise
        finally:
            await asyncio.sleep(0)  # cleanup that awaits, as closing engines does
            log.append("cleaned up")
        return "done"

    with pytest.raises(Stopped):
        run_async(main())
    assert log == ["background ran on", "main cancelled", "cleaned up"]
    assert signal.getsignal(signal.SIGTERM) is raise_stopped


def test_a_main_that_stops_gracefully_on_cancellation_still_hands_the_signal_on(sigterm_raises_stopped):
    log = []

    async def main() -> str:
        sigterm_from_a_background_task(log)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            log.append("stopped early")
        return "partial result"

    with pytest.raises(Stopped):
        run_async(main())
    assert log == ["background ran on", "stopped early"]


def test_a_second_sigterm_during_the_cleanup_reaches_the_handler_at_once(sigterm_raises_stopped):
    log = []

    async def main() -> None:
        sigterm_from_a_background_task(log)
        try:
            await asyncio.sleep(5)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(5)  # a cleanup that hangs
            log.append("cleanup finished")

    with pytest.raises(Stopped):
        run_async(main())
    assert log == ["background ran on"]
    assert signal.getsignal(signal.SIGTERM) is raise_stopped


def test_without_a_signal_it_returns_mains_result_and_restores_the_handler(sigterm_raises_stopped):
    async def main() -> int:
        await asyncio.sleep(0)
        assert signal.getsignal(signal.SIGTERM) is not raise_stopped
        return 7

    assert run_async(main()) == 7
    assert signal.getsignal(signal.SIGTERM) is raise_stopped


def test_a_main_that_fails_raises_its_error_and_restores_the_handler(sigterm_raises_stopped):
    async def main() -> None:
        raise ValueError("broken")

    with pytest.raises(ValueError, match="broken"):
        run_async(main())
    assert signal.getsignal(signal.SIGTERM) is raise_stopped


def test_with_the_default_action_the_process_ends_by_the_signal_after_the_cleanup():
    program = textwrap.dedent(
        """
        import asyncio, os, signal
        from tasks.event_loop import run_async

        async def main():
            async def background():
                await asyncio.sleep(0)
                os.kill(os.getpid(), signal.SIGTERM)
            asyncio.get_running_loop().create_task(background())
            try:
                await asyncio.sleep(30)
            finally:
                print("cleaned up", flush=True)
            print("main ran to its end", flush=True)

        run_async(main())
        print("survived the signal", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout == "cleaned up\n"


def test_off_the_main_thread_it_runs_main_as_asyncio_run_does():
    results = []

    async def main() -> str:
        await asyncio.sleep(0)
        return "ran"

    thread = threading.Thread(target=lambda: results.append(run_async(main())))
    thread.start()
    thread.join(timeout=30)
    assert results == ["ran"]
