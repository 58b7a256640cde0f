"""Work on a thread that outlives the cancel of the coroutine that started it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def to_thread_to_the_end(
    fn: Callable[..., T], *args: Any, discard: Callable[[T], Any] | None = None
) -> T:
    """``fn(*args)`` on a thread, as ``asyncio.to_thread``; but when the caller is cancelled
    it waits for the thread to finish before raising, since a thread cannot be stopped and
    what the caller holds (a model it runs, say) must not be released beneath it. A result
    that comes back to a cancelled caller is handed to ``discard`` (run on a thread), so what
    it holds is not left behind, however many cancels come meanwhile.
    """
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([work])
        if discard is not None and work.exception() is None:
            await to_thread_to_the_end(discard, work.result())
        raise
