"""Live status that a run's rollout workers publish for its trainer: ``status/rollout/<worker>.json``.

The rollout and train tasks may run in one process, in separate processes or on separate
machines, so they meet here, in the run's storage, not in memory. Each rollout worker
replaces its own small JSON object every few seconds (a temp file moved into place on a
local folder, a single PUT on S3: a reader sees the old object or the new one, never half);
the trainer reads every worker's object when it records a step and sums their queues.

A worker that stopped cleanly says so (``running: false``) and adds nothing; one whose
status is older than ``max_age_s`` is presumed gone and only counted as stale. A file that
does not parse is skipped with a warning (once per distinct content), never raised.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
import uuid
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from storage.config import RunStore

log = logging.getLogger(__name__)

ROLLOUT_STATUS_PREFIX = "status/rollout"
DEFAULT_MAX_AGE_S = 30.0
"""Seconds after which a running worker's status no longer counts (it publishes every few)."""


class RolloutStatus(BaseModel):
    """What one rollout worker last said about its engines."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    worker: str = Field(min_length=1, description="Worker name (also the object's file name).")
    time: float = Field(description="Epoch seconds at which the worker wrote this status.")
    engine_queue_depth: int = Field(
        ge=0, description="Generation requests waiting in the worker's engines, summed over replicas."
    )
    live_sessions: int = Field(
        ge=0, description="Rollout sessions assigned to the worker's engines, not ended."
    )
    running: bool = Field(description="False once the worker stopped cleanly (its queues are then empty).")


@dataclass(frozen=True)
class RolloutSummary:
    """All rollout workers' statuses at one moment, as the trainer logs them.

    ``workers``: running workers with a fresh status (their queues are summed);
    ``stopped``: workers that stopped cleanly; ``stale``: running workers whose status is
    older than the allowed age (left out of the sums); ``corrupt``: status files skipped
    because they did not parse.
    """

    workers: int
    stopped: int
    stale: int
    corrupt: int
    engine_queue_depth: int
    live_sessions: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class RolloutStatusBoard:
    """The rollout workers' status objects of one run (see the module docstring)."""

    def __init__(self, store: RunStore):
        self.store = store
        self.fs = store.fs
        self.root = store.path(ROLLOUT_STATUS_PREFIX)
        self._warned: dict[str, bytes] = {}

    def _path(self, worker: str) -> str:
        if not worker or "/" in worker or worker.startswith("."):
            raise ValueError(
                f"worker name must be non-empty, without '/' and not start with '.', got {worker!r}"
            )
        return posixpath.join(self.root, f"{worker}.json")

    def publish(self, status: RolloutStatus) -> None:
        """Replace ``status.worker``'s status object atomically."""
        path = self._path(status.worker)
        payload = status.model_dump_json().encode()
        if self.store.config.is_s3:
            self.fs.pipe_file(path, payload)
            return
        os.makedirs(self.root, exist_ok=True)
        # no fsync: a status lost in a crash is replaced seconds later or goes stale
        temp = posixpath.join(self.root, f".{status.worker}.json.tmp-{uuid.uuid4().hex}")
        with open(temp, "wb") as handle:
            handle.write(payload)
        os.replace(temp, path)

    def read(self) -> tuple[list[RolloutStatus], int]:
        """Every worker's status and how many status files were skipped as corrupt."""
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return [], 0
        statuses, corrupt = [], 0
        for path in sorted(names):
            name = posixpath.basename(path.rstrip("/"))
            if name.startswith(".") or not name.endswith(".json"):
                continue
            try:
                payload = self.fs.cat_file(path)
            except FileNotFoundError:
                continue
            try:
                statuses.append(RolloutStatus.model_validate_json(payload))
            except ValidationError as exc:
                corrupt += 1
                self._warn_corrupt(path, payload, exc)
        return statuses, corrupt

    def _warn_corrupt(self, path: str, payload: bytes, exc: ValidationError) -> None:
        if self._warned.get(path) == payload:
            return
        self._warned[path] = payload
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'object'}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        log.warning(
            "skipping rollout status %s (%d bytes): not a valid status object (%s)",
            self.store.url(ROLLOUT_STATUS_PREFIX, posixpath.basename(path)),
            len(payload),
            problems,
        )

    def summary(self, now: float | None = None, max_age_s: float = DEFAULT_MAX_AGE_S) -> RolloutSummary:
        """Sum the fresh running workers' queues at ``now`` (epoch seconds, default: the clock)."""
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s}")
        now = time.time() if now is None else now
        statuses, corrupt = self.read()
        stopped = [s for s in statuses if not s.running]
        fresh = [s for s in statuses if s.running and now - s.time <= max_age_s]
        return RolloutSummary(
            workers=len(fresh),
            stopped=len(stopped),
            stale=len(statuses) - len(stopped) - len(fresh),
            corrupt=corrupt,
            engine_queue_depth=sum(s.engine_queue_depth for s in fresh),
            live_sessions=sum(s.live_sessions for s in fresh),
        )
