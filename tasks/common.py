"""What every task shares: the run's store, retries on transient errors."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from botocore.exceptions import BotoCoreError
from deltalake.exceptions import CommitFailedError
from prefect.cache_policies import NO_CACHE

from flows.config import RunConfig
from storage.config import RunStore

log = logging.getLogger(__name__)

SIDE_EFFECTS = {"cache_policy": NO_CACHE}
"""Task options of every task that writes: never cached."""

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (OSError, BotoCoreError, CommitFailedError)
"""Errors a second attempt can clear: storage and network I/O (``TimeoutError`` and
``ConnectionError`` are ``OSError``s), a Delta commit that lost a race."""


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is one a retry can clear (:data:`TRANSIENT_ERRORS`, or a Ray worker
    or node lost under a task)."""
    if isinstance(error, TRANSIENT_ERRORS):
        return True
    try:
        from ray.exceptions import RayError
    except ImportError:
        return False
    return isinstance(error, RayError)


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: retry a failed task run only when what failed it
    is transient; a bad config or a bug fails at once, with its error logged once."""
    error = state.data
    return not isinstance(error, BaseException) or is_transient(error)


STORAGE_RETRIES = {"retries": 3, "retry_delay_seconds": [1, 4, 16], "retry_condition_fn": retry_if_transient}
"""Retries with backoff for transient errors. Every task is safe to run again: shards
commit atomically, processing is idempotent, the trainer resumes exactly from ``LATEST``,
and warm start does nothing once a version exists."""


def reporting(callback: Callable[..., None] | None, what: str) -> Callable[..., None] | None:
    """``callback`` made unable to stop the work it reports on (a progress artifact, an
    event: the Prefect API may be unreachable for a moment); its errors are logged."""
    if callback is None:
        return None

    def guarded(*args: Any) -> None:
        try:
            callback(*args)
        except Exception as exc:
            log.warning("%s failed, the work goes on: %r", what, exc)

    return guarded


def run_store(config: RunConfig) -> RunStore:
    return RunStore(config.storage, config.run_id)
