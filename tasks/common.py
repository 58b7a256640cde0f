"""What every task shares: the run's store, retries on transient storage errors."""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE

from flows.config import RunConfig
from storage.config import RunStore

SIDE_EFFECTS = {"cache_policy": NO_CACHE}
"""Task options of every task that writes: never cached."""

STORAGE_RETRIES = {"retries": 3, "retry_delay_seconds": [1, 4, 16]}
"""Retries with backoff for transient storage errors. Every task is safe to run again:
shards commit atomically, processing is idempotent, the trainer resumes exactly from
``LATEST``, and warm start does nothing once a version exists."""


def run_store(config: RunConfig) -> RunStore:
    return RunStore(config.storage, config.run_id)
