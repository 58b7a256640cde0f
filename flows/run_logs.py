"""The project's own log records in the flow run's logs (the Prefect UI), not only on the
worker's console.

Prefect sends the records of its run loggers to the API; the modules of ``storage``,
``envs``, ``rollout``, ``rl`` and ``tasks`` log through their own loggers ("could not
publish the elastic plan", "a dead holder goes stale"), which reach only the console.
:func:`module_logs_to_run` hands them to Prefect's API handler for as long as a flow runs.
The loggers' levels are left as they are: with Prefect's logging config the root is at
WARNING, so warnings and errors are what the UI shows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any
from uuid import UUID

from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.handlers import APILogHandler
from prefect.settings import PREFECT_LOGGING_EXTRA_LOGGERS

PACKAGES = ("storage", "envs", "rollout", "rl", "tasks")
"""Loggers (and their children) whose records go to the flow run."""


class _RunLogHandler(APILogHandler):
    """Prefect's API handler for a flow run's own loggers. A record logged where no run
    context is (a thread the work started: heartbeats, the shard-commit thread) goes to the
    flow run that attached the handler instead of being dropped with a warning."""

    def __init__(self, flow_run_id: UUID):
        super().__init__()
        self.flow_run_id = flow_run_id

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
    logs. Outside a flow run, or inside one that already sends them (a nested flow), it
    does nothing; a logger named in ``PREFECT_LOGGING_EXTRA_LOGGERS`` already has Prefect's
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
