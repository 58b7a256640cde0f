"""A thread that calls a function at a fixed pace until stopped: a status or a claim kept
fresh while slow work (an engine load, a checkpoint upload) runs."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Heartbeat:
    """Calls ``beat`` every ``every_s`` seconds on a thread, from its creation until :meth:`stop`;
    a beat that fails is logged and the next one still comes."""

    def __init__(self, beat: Callable[[], None], every_s: float, what: str):
        # 0, a negative or NaN wait returns at once (a busy loop of beats); a wait past
        # TIMEOUT_MAX raises on the thread, which would then die without a word
        if not 0 < every_s <= threading.TIMEOUT_MAX:
            raise ValueError(f"{what}: every_s must be a positive number of seconds, got {every_s}")
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._beats, args=(beat, every_s, what), name=what, daemon=True
        )
        self._thread.start()

    def _beats(self, beat: Callable[[], None], every_s: float, what: str) -> None:
        while not self._stopped.wait(every_s):
            try:
                beat()
            except Exception as exc:  # a storage hiccup: the next beat replaces this one
                log.warning("%s failed: %s", what, str(exc) or type(exc).__name__)

    def stop(self) -> None:
        """Stop beating; once this returns no beat runs any more (stopping again does nothing)."""
        self._stopped.set()
        self._thread.join()
