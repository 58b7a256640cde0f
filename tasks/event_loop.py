"""The event loop a task runs its async work on, stopped by SIGTERM as asyncio is by Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, with SIGTERM taken as asyncio takes Ctrl-C: ``main`` is
    cancelled, its cleanup runs (rollouts committed, engines closed), and only then is the
    signal handed to the SIGTERM handler installed before (Prefect's during a flow run, which
    crashes the run). That handler raises at whatever line the main thread runs: landing in
    one of ``main``'s background tasks, its exception became that task's result, and ``main``
    ran on as though no signal had come. A second SIGTERM goes to that handler at once.
    Off the main thread, where no signal is handled, it is ``asyncio.run(main)``."""
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(main)
    return asyncio.run(_cancelled_by_sigterm(main))


async def _cancelled_by_sigterm(main: Coroutine[Any, Any, T]) -> T:
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        return await main
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def cancel_main(signum: int, frame: Any) -> None:
        if received:
            _deliver(previous, signum, frame)
            return
        received.append(signum)
        task.cancel()
        loop.call_soon_threadsafe(lambda: None)  # wakes a loop waiting in select

    signal.signal(signal.SIGTERM, cancel_main)
    cancelled = None
    try:
        result = await main
    except asyncio.CancelledError as exc:
        if not received:
            raise
        cancelled = exc
    finally:
        signal.signal(signal.SIGTERM, previous)
    if received:
        _deliver(previous, signal.SIGTERM, None)
    if cancelled is not None:
        raise cancelled
    return result


def _deliver(handler: Any, signum: int, frame: Any) -> None:
    """What ``handler`` (a value of :func:`signal.getsignal`) does with ``signum``: a Python
    handler is called; the default action ends the process, as the signal would have."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
