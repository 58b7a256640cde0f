"""run_async: a signal's exception, raised in the main thread while the loop runs on its own,
cancels the async work, lets it clean up, and is raised once it has."""

import asyncio
import contextvars
import gc
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

from tasks.event_loop import _LoopThread, run_async

REPO = Path(__file__).resolve().parents[2]


class Stopped(BaseException):
    """What the SIGTERM handler raises: a BaseException, as Prefect's ``TerminationSignal`` is."""


def raise_stopped(signum, frame):
    raise Stopped(signum)


@pytest.fixture
def sigterm_raises_stopped():
    previous = signal.signal(signal.SIGTERM, raise_stopped)
    yield
    signal.signal(signal.SIGTERM, previous)


def sigterm_from_a_background_task(log: list[str]) -> None:
    """Start a task that sends SIGTERM to this process and runs on, as the rollouts do."""

    async def background() -> None:
        await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGTERM)
        total = 0
        for i in range(10_000):  # with the loop on the main thread, the handler ran in here
            total += i
        log.append("background ran on")

    asyncio.get_running_loop().create_task(background())


def test_sigterm_sent_while_a_background_task_runs_cancels_main_which_cleans_up_before_it_is_raised(
    sigterm_raises_stopped,
):
    log = []

    async def main() -> str:
        sigterm_from_a_background_task(log)
        try:
            await asyncio.sleep(60)
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


def test_a_main_that_stops_gracefully_on_cancellation_still_raises_the_signal(sigterm_raises_stopped):
    log = []

    async def main() -> str:
        sigterm_from_a_background_task(log)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            log.append("stopped early")
        return "partial result"

    with pytest.raises(Stopped):
        run_async(main())
    assert log == ["background ran on", "stopped early"]


def test_an_error_of_mains_cleanup_after_the_signal_is_logged_not_lost(sigterm_raises_stopped, caplog):
    """The signal's exception is raised in place of what main ended with; an error its cleanup
    raised (rollouts it could not commit) was dropped without a word, where asyncio.run shows
    it. It is logged, its secrets masked."""

    async def main() -> None:
        sigterm_from_a_background_task([])
        try:
            await asyncio.sleep(60)
        finally:
            raise RuntimeError("could not commit the rollouts to s3://key:hunter2@bucket/run")

    with pytest.raises(Stopped):
        run_async(main())
    [record] = [r for r in caplog.records if r.name == "tasks.event_loop"]
    assert record.levelname == "ERROR"
    assert "could not commit the rollouts" in record.getMessage()
    assert "hunter2" not in record.getMessage()


def test_a_main_cancelled_by_the_signal_logs_nothing(sigterm_raises_stopped, caplog):
    async def main() -> None:
        sigterm_from_a_background_task([])
        await asyncio.sleep(60)

    with pytest.raises(Stopped):
        run_async(main())
    assert not [r for r in caplog.records if r.name == "tasks.event_loop"]


def test_a_signal_the_kernel_gives_to_the_loops_thread_still_stops_main_at_once(sigterm_raises_stopped):
    """A process-wide signal goes to any thread that does not block it, and Python runs its
    handler in the main thread only once that thread runs again: one waiting on the loop
    without a timeout ran it when ``main`` had ended on its own (here, after its 60 s)."""
    log = []

    async def main() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # this thread takes it
        sigterm_from_a_background_task(log)
        try:
            await asyncio.sleep(60)
            log.append("main ran to its end")
        except asyncio.CancelledError:
            log.append("main cancelled")
            raise

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the main thread does not
    try:
        with pytest.raises(Stopped):
            run_async(main())
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    assert log == ["background ran on", "main cancelled"]


def test_a_second_signal_during_the_cleanup_is_raised_at_once_and_the_cleanup_still_finishes(
    sigterm_raises_stopped,
):
    log = []
    release = threading.Event()

    async def main() -> None:
        sigterm_from_a_background_task(log)
        try:
            await asyncio.sleep(60)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.to_thread(release.wait, 60)  # a slow cleanup: until the test has looked
            log.append("cleanup finished")

    with pytest.raises(Stopped):
        run_async(main())
    assert log == ["background ran on"]
    release.set()
    deadline = time.monotonic() + 60
    while log == ["background ran on"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log == ["background ran on", "cleanup finished"]


def test_the_signal_handler_stays_installed_while_main_runs(sigterm_raises_stopped):
    """Prefect acknowledges a cancel only while its own SIGTERM handler is the one installed;
    replaced, the run crashed instead of ending Cancelled."""

    async def main() -> object:
        await asyncio.sleep(0)
        return signal.getsignal(signal.SIGTERM)

    assert run_async(main()) is raise_stopped


def test_main_runs_in_the_callers_context():
    run_id = contextvars.ContextVar("run_id")
    run_id.set("run-7")

    async def main() -> str:
        return run_id.get()

    assert run_async(main()) == "run-7"


def test_a_main_that_fails_raises_its_error():
    async def main() -> None:
        raise ValueError("broken")

    with pytest.raises(ValueError, match="broken"):
        run_async(main())


def test_ctrl_c_cancels_main_which_cleans_up_before_keyboard_interrupt_is_raised():
    program = textwrap.dedent(
        """
        import asyncio, os, signal
        from tasks.event_loop import run_async

        async def main():
            async def background():
                await asyncio.sleep(0)
                os.kill(os.getpid(), signal.SIGINT)
            asyncio.get_running_loop().create_task(background())
            try:
                await asyncio.sleep(30)
            finally:
                print("cleaned up", flush=True)
            print("main ran to its end", flush=True)

        try:
            run_async(main())
        except KeyboardInterrupt:
            print("KeyboardInterrupt", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "cleaned up\nKeyboardInterrupt\n"


def test_main_cancelled_before_its_loop_starts_never_runs():
    """It is closed unrun: no 'coroutine was never awaited' warning in the run's log."""
    ran = []

    async def main() -> None:
        ran.append(True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = _LoopThread(main())
        loop.cancel()
        loop.start()
        loop.finished.wait(timeout=60)
        with pytest.raises(asyncio.CancelledError):
            loop.outcome()
        del loop
        gc.collect()
    assert ran == []
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_off_the_main_thread_it_runs_main_as_asyncio_run_does():
    results = []

    async def main() -> str:
        await asyncio.sleep(0)
        return "ran"

    thread = threading.Thread(target=lambda: results.append(run_async(main())))
    thread.start()
    thread.join(timeout=30)
    assert results == ["ran"]


def test_a_loop_thread_that_cannot_start_raises_its_error_at_once_and_closes_main(monkeypatch):
    """Out of threads, the start fails: its error is raised, not waited on for a loop that
    never ran, and ``main`` is closed unrun (left open, Python warned at its collection that it
    was never awaited, wherever that came)."""

    def out_of_threads(self) -> None:
        raise RuntimeError("can't start new thread")

    async def main() -> None:
        pass

    monkeypatch.setattr(_LoopThread, "start", out_of_threads)
    unrun = main()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        run_async(unrun)
    assert inspect.getcoroutinestate(unrun) == inspect.CORO_CLOSED
