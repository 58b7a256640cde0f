"""The project's own log records in the flow run's logs (the Prefect UI), not only on the
worker's console.

Prefect sends the records of its run loggers to the API; the modules of ``storage``,
``envs``, ``rollout``, ``rl`` and ``tasks`` log through their own loggers ("could not
publish the elastic plan", "a dead holder goes stale"), which reach only the console.
:func:`module_logs_to_run` hands them to Prefect's API handler for as long as a flow runs, and
for as long as a task of it runs in a process of its own (a Ray worker, with ``cluster: ray``).
The loggers' levels are left as they are: with Prefect's logging config the root is at
WARNING, so warnings and errors are what the UI shows. A message repeated many times a
minute reaches the UI :data:`REPEATS_PER_WINDOW` times a minute, and the console every time.
What reaches the UI is masked (``storage.redaction.redact``): URLs' user info, AWS key ids,
credentials an S3 error echoes, named secrets' values.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any
from uuid import UUID

from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.handlers import APILogHandler
from prefect.settings import PREFECT_LOGGING_EXTRA_LOGGERS

from storage.redaction import redact

PACKAGES = ("storage", "envs", "rollout", "rl", "tasks")
"""Loggers (and their children) whose records go to the flow run."""

REPEATS_PER_WINDOW = 10
"""Records of one logger, level and message template a flow run's logs take per
:data:`REPEAT_WINDOW_S`; the rest go to the worker's console only (an environment that fails
every rollout logs a warning per rollout, hundreds a second)."""
REPEAT_WINDOW_S = 60.0
MAX_TEMPLATES = 1000
"""Message templates counted before the ones whose window has passed are forgotten."""


class _RunLogHandler(APILogHandler):
    """Prefect's API handler for a flow run's own loggers. A record logged where no run
    context is (a thread the work started: heartbeats, the shard-commit thread) goes to the
    flow run that attached the handler instead of being dropped with a warning."""

    def __init__(self, flow_run_id: UUID):
        super().__init__()
        self.flow_run_id = flow_run_id
        self._repeats: dict[tuple[str, int, Any], tuple[float, int]] = {}

    def _repeat(self, record: logging.LogRecord) -> int:
        """How many records like ``record`` (its logger, level and template) this window
        has seen, ``record`` included. Called under the handler's lock (``Handler.handle``)."""
        key = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        if len(self._repeats) >= MAX_TEMPLATES:
            self._repeats = {k: v for k, v in self._repeats.items() if now - v[0] < REPEAT_WINDOW_S}
        started, count = self._repeats.get(key, (now, 0))
        if now - started >= REPEAT_WINDOW_S:
            started, count = now, 0
        self._repeats[key] = (started, count + 1)
        return count + 1

    def emit(self, record: logging.LogRecord) -> None:
        repeat = self._repeat(record)
        if repeat > REPEATS_PER_WINDOW:
            return
        if repeat == REPEATS_PER_WINDOW:
            note = f" (the rest within {REPEAT_WINDOW_S:.0f} s of the first: on the worker's console only)"
            try:
                message = record.getMessage()
            except Exception:  # its arguments do not fit its template: a logging call never raises
                self.handleError(record)
                return
            record = logging.makeLogRecord({**record.__dict__, "msg": message + note, "args": ()})
        super().emit(record)

    def format(self, record: logging.LogRecord) -> str:
        # a record may quote an error as it came: the API stores it for whoever sees the run
        return redact(super().format(record))

    def prepare(self, record: logging.LogRecord) -> dict[str, Any]:
        if (
            getattr(record, "flow_run_id", None) is None
            and FlowRunContext.get() is None
            and TaskRunContext.get() is None
        ):
            record = logging.makeLogRecord({**record.__dict__, "flow_run_id": self.flow_run_id})
        return super().prepare(record)


_attached: _RunLogHandler | None = None


@contextlib.contextmanager
def module_logs_to_run() -> Iterator[None]:
    """While the body runs, send the records of :data:`PACKAGES` to the current flow run's
    logs: a flow's body enters it, and so does a task's that may run in another process (on a
    Ray worker, where the flow's handler is not). Outside a flow run, or inside one this
    process already sends them for (a nested flow, a task in the flow's process), it does
    nothing; a logger named in ``PREFECT_LOGGING_EXTRA_LOGGERS`` already has Prefect's
    own handler, so its records (and its children's) are left to it."""
    global _attached
    context = FlowRunContext.get()
    if _attached is not None or context is None or context.flow_run is None:
        yield
        return
    handler = _RunLogHandler(context.flow_run.id)
    extra = tuple(PREFECT_LOGGING_EXTRA_LOGGERS.value())
    handler.addFilter(lambda record: not any(_under(record.name, name) for name in extra))
    loggers = [logging.getLogger(name) for name in PACKAGES]
    for logger in loggers:
        logger.addHandler(handler)
    _attached = handler
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        _attached = None


def _under(logger: str, name: str) -> bool:
    """Whether ``logger`` is the logger ``name`` or one of its children."""
    return logger == name or logger.startswith(f"{name}.")


class _UnsentEventErrors(logging.Filter):
    """Drops the ERROR Prefect's events worker logs for an event its client could not send
    (``Service 'EventsWorker' failed to process item Event(...)``, the whole event) right after
    that client's WARNING that it cannot connect to the API and the event may be lost: a server
    away mid-run logged both for each event, about one every 7 s. Records are matched by their
    logger, template and thread; any other (a message Prefect changed) is kept."""

    def __init__(self) -> None:
        super().__init__()
        self._warned: set[int | None] = set()  # threads whose events client just warned

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == EVENTS_CLIENT_LOGGER:
            if str(record.msg).startswith("Unable to connect to"):
                self._warned.add(record.thread)
            return True
        warned = record.thread in self._warned
        self._warned.discard(record.thread)
        return not (
            warned
            and str(record.msg).startswith("Service %r failed to process item")
            and record.args is not None
            and record.args[0] == "EventsWorker"
        )


EVENTS_CLIENT_LOGGER = "prefect.events.clients"
SERVICES_LOGGER = "prefect._internal.concurrency"
"""Where Prefect's events client warns that it cannot connect, and where its worker then logs
the event it failed to send."""
_unsent_event_errors = _UnsentEventErrors()


def one_line_per_unsent_event() -> None:
    """Have Prefect log one line, not two, for each event it cannot send to an API that is
    away (see :class:`_UnsentEventErrors`)."""
    for name in (EVENTS_CLIENT_LOGGER, SERVICES_LOGGER):
        logging.getLogger(name).addFilter(_unsent_event_errors)
