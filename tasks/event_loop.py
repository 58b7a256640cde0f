"""The event loop a task runs its async work on, on a thread of its own so that a signal
stops that work as a whole; and waits of the main thread that a signal interrupts."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from storage.redaction import redact

T = TypeVar("T")

log = logging.getLogger(__name__)


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, stopped as a whole by what a signal's handler raises (Ctrl-C's
    ``KeyboardInterrupt``; during a flow run, the ``TerminationSignal`` of Prefect's SIGTERM
    handler, by which a deployment run is cancelled): ``main`` is cancelled, its cleanup runs
    (rollouts committed, engines closed), and then the signal's exception is raised here.

    The loop runs on a thread of its own, in this thread's context, while this thread waits:
    a handler runs in the main thread, and with the loop there its exception was raised at
    whatever line the loop ran, often inside a background task, which asyncio then ended with
    that error while ``main`` ran on as though no signal had come. A second signal during the
    cleanup is raised at once (the loop's thread still finishes the cleanup before the
    interpreter exits). An error ``main`` ends with after the cancel (its cleanup failed) is
    logged, as the signal's exception is raised in its place. Off the main thread, where no
    handler runs, it is ``asyncio.run(main)``."""
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(main)
    loop = _LoopThread(main)
    try:
        loop.start()
        _wait(loop.finished)
    except BaseException:
        loop.cancel()
        if loop.started():
            _wait(loop.finished)
            _log_failure(loop)
        else:  # a thread that still starts closes main unrun; one that could not start never will
            main.close()
        raise
    return loop.outcome()


def _log_failure(loop: _LoopThread) -> None:
    error = loop.error()
    if error is not None and not isinstance(error, asyncio.CancelledError):
        log.error(
            "the async work failed as it stopped for a signal (the signal is raised, not this): %s",
            redact(repr(error)),
        )


WAKE_SECONDS = 0.1
"""How often the main thread, waiting on the loop, wakes: the kernel may give a signal to any
thread, and then its handler runs only once the main thread runs Python again (a wait without
a timeout is interrupted only by a signal given to the main thread itself)."""


def _wait(finished: threading.Event) -> None:
    while not finished.wait(WAKE_SECONDS):
        pass


def wait_awake(wait: Callable[[], T]) -> T:
    """``wait()`` (a future's, which waits without a timeout) on a thread of its own, in this
    thread's context, while the main thread waits for it waking every :data:`WAKE_SECONDS`: a
    signal the kernel gave to another thread has its handler run, and its exception raised
    here, at once rather than once ``wait`` returns. The thread goes on waiting then, and ends
    with ``wait``. Off the main thread it is ``wait()``."""
    if threading.current_thread() is not threading.main_thread():
        return wait()
    finished = threading.Event()
    outcome: dict[str, Any] = {}

    def waiting() -> None:
        try:
            outcome["result"] = wait()
        except BaseException as error:
            outcome["error"] = error
        finally:
            finished.set()

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(waiting,), name="wait", daemon=True).start()
    _wait(finished)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


class _LoopThread:
    """``asyncio.run(main)`` on a thread started in the caller's context."""

    def __init__(self, main: Coroutine[Any, Any, Any]):
        self.finished = threading.Event()
        self._main = main
        self._lock = threading.Lock()  # the main task and whether it is cancelled, read and set together
        self._task: asyncio.Task | None = None
        self._cancelled = False
        self._result: Any = None
        self._error: BaseException | None = None
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name="event-loop")

    def start(self) -> None:
        self._thread.start()

    def started(self) -> bool:
        return self._thread.ident is not None

    def cancel(self) -> None:
        """Cancel ``main``, now if it runs, else as it starts."""
        with self._lock:
            self._cancelled = True
            task = self._task
        if task is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: main has ended
                task.get_loop().call_soon_threadsafe(task.cancel)

    def error(self) -> BaseException | None:
        """What ``main`` raised, once it has ended."""
        return self._error

    def outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self) -> None:
        try:
            self._result = asyncio.run(self._top())
        except BaseException as error:
            self._error = error
        finally:
            self.finished.set()

    async def _top(self) -> Any:
        with self._lock:
            self._task = asyncio.current_task()
            cancelled = self._cancelled
        if cancelled:
            self._main.close()
            raise asyncio.CancelledError
        return await self._main
