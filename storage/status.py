"""Live status that a run's rollout workers publish for its trainer (``status/rollout/<worker>.json``),
and what the trainer publishes for them: its elastic plan (``status/elastic/plan.json``) and
its own status (``status/train/trainer.json``).

The rollout and train tasks may run in one process, in separate processes or on separate
machines, so they meet here, in the run's storage, not in memory. Each rollout worker
replaces its own small JSON object every few seconds (a temp file moved into place on a
local folder, a single PUT on S3: a reader sees the old object or the new one, never half);
the trainer reads every worker's object when it records a step and sums their queues.

A worker that stopped cleanly says so (``running: false``) and adds nothing; one whose
status is older than ``max_age_s`` is presumed gone and only counted as stale, and so is one
dated more than ``max_age_s`` ahead (a writer whose clock is that far off would otherwise
count as alive for ever; see :func:`is_fresh`). A file that
does not parse is skipped with a warning (once per distinct content), never raised.

The other way, the trainer's elastic controller publishes one plan object saying which
engine replicas (units ``<worker>/<replica>``) accept new sessions, which drain and which
are handed to training; each worker reads it at most once a second and drains or undrains
its own replicas. A plan that does not parse reads as no plan (with a warning), so a worker
keeps serving as it is. The trainer also publishes ``status/train/trainer.json``: how much
processed data waits for it and the newest shard it has read from each worker, which the
workers' orchestrators use as backpressure.

The process stage keeps its place in the ``shards`` commit log in
``status/process/offset.json``, so a processor started for each commit (the event-triggered
deployment) reads what was committed since, not the whole log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from storage.config import RunStore

log = logging.getLogger(__name__)

ROLLOUT_STATUS_PREFIX = "status/rollout"
ELASTIC_PLAN_PREFIX = "status/elastic"
ELASTIC_PLAN_NAME = "plan.json"
TRAINER_STATUS_PREFIX = "status/train"
TRAINER_STATUS_NAME = "trainer.json"
PROCESS_OFFSET_PREFIX = "status/process"
PROCESS_OFFSET_NAME = "offset.json"
PROCESSOR_STATUS_NAME = "processor.json"
DEFAULT_MAX_AGE_S = 30.0
"""Seconds after which a running worker's status no longer counts (it publishes every few)."""


Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A duration a status reports: the elastic controller's forecast sorts them (a NaN has no
place among them)."""


class RolloutStatus(BaseModel):
    """What one rollout worker last said about its engines."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    worker: str = Field(min_length=1, description="Worker name (also the object's file name).")
    time: float = Field(
        allow_inf_nan=False, description="Epoch seconds at which the worker wrote this status."
    )
    engine_queue_depth: int = Field(
        ge=0, description="Generation requests waiting in the worker's engines, summed over replicas."
    )
    live_sessions: int = Field(
        ge=0, description="Rollout sessions assigned to the worker's engines, not ended."
    )
    running: bool = Field(description="False once the worker stopped cleanly (its queues are then empty).")
    replica_sessions: dict[str, int] = Field(
        default_factory=dict,
        description="Sessions pinned to each of the worker's engine replicas in service, by replica name.",
    )
    draining: list[str] = Field(
        default_factory=list, description="The worker's replicas that take no new session (draining)."
    )
    plan_time: float | None = Field(
        None,
        allow_inf_nan=False,
        description="``time`` of the last elastic plan the worker applied (None: none yet).",
    )
    finished: int = Field(0, ge=0, description="Rollouts the worker finished since it started.")
    finished_rows: int | None = Field(
        None,
        ge=0,
        description="Trajectories (rows) of the rollouts in ``finished``, the trainer's rollout rate: one "
        "each, a compacted rollout's one per context (None from a worker that did not count them: one each).",
    )
    session_ages: dict[str, list[Seconds]] = Field(
        default_factory=dict,
        description="Seconds each live session has run at ``time``, by the replica it is pinned to "
        "(a compacted rollout's context: since its first context was routed).",
    )
    sessions_ended: int = Field(
        0,
        ge=0,
        description="Sessions the worker's router ended since it started (a compacted rollout's "
        "contexts count once, when its last one ends), but for those in ``sessions_expired``.",
    )
    sessions_expired: int = Field(
        0,
        ge=0,
        description="Sessions its gateway ended for idling, or at its HTTP server's stop, since it started "
        "(a harness that crashed, or was cut off): their replicas are freed, but no record of them "
        "reaches the trainer, so they are no ended rollouts for the elastic forecast.",
    )
    session_lengths: list[Seconds] = Field(
        default_factory=list,
        description="Lengths (seconds) of the most recently ended sessions, the newest last (a compacted "
        "rollout's: from its first context's routing to its last one's end).",
    )
    session_contexts: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="Contexts (trajectories written) of each session in ``session_lengths``, in its order: "
        "more than one for a compacted rollout (empty from a worker that did not count them: one each).",
    )
    owner: str = Field("", description="Which worker process wrote it (a random id per start).")


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


def _replace(store: RunStore, root: str, name: str, payload: bytes) -> None:
    """Replace object ``root/name`` so that a reader sees the old or the new one, never half:
    a single PUT on S3, a temp file moved into place on a local folder."""
    path = posixpath.join(root, name)
    if store.config.is_s3:
        store.fs.pipe_file(path, payload)
        return
    os.makedirs(root, exist_ok=True)
    # no fsync: an object lost in a crash is replaced seconds later or goes stale
    temp = posixpath.join(root, f".{name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(temp, "wb") as handle:
            handle.write(payload)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'object'}: {e['msg']}" for e in exc.errors(include_url=False)
    )


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
        name = posixpath.basename(self._path(status.worker))
        _replace(self.store, self.root, name, status.model_dump_json().encode())

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
            status = self._parse(path, payload)
            if status is None:
                corrupt += 1
            else:
                statuses.append(status)
        return statuses, corrupt

    def read_worker(self, worker: str) -> RolloutStatus | None:
        """``worker``'s status; None when it has none or it does not parse (warned)."""
        path = self._path(worker)
        try:
            payload = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return self._parse(path, payload)

    def _parse(self, path: str, payload: bytes) -> RolloutStatus | None:
        try:
            return RolloutStatus.model_validate_json(payload)
        except ValidationError as exc:
            self._warn_corrupt(path, payload, exc)
            return None

    def _warn_corrupt(self, path: str, payload: bytes, exc: ValidationError) -> None:
        if self._warned.get(path) == payload:
            return
        self._warned[path] = payload
        log.warning(
            "skipping rollout status %s (%d bytes): not a valid status object (%s)",
            self.store.url(ROLLOUT_STATUS_PREFIX, posixpath.basename(path)),
            len(payload),
            _problems(exc),
        )

    def summary(self, now: float | None = None, max_age_s: float = DEFAULT_MAX_AGE_S) -> RolloutSummary:
        """Sum the fresh running workers' queues at ``now`` (epoch seconds, default: the clock)."""
        statuses, corrupt = self.read()
        return summarize(statuses, corrupt, now, max_age_s)


def fresh_statuses(
    statuses: list[RolloutStatus], now: float, max_age_s: float = DEFAULT_MAX_AGE_S
) -> list[RolloutStatus]:
    """The running workers among ``statuses`` whose status is at most ``max_age_s`` old at ``now``."""
    if max_age_s <= 0:
        raise ValueError(f"max_age_s must be positive, got {max_age_s}")
    return [s for s in statuses if s.running and is_fresh(s.time, now, max_age_s)]


def is_fresh(written: float, now: float, max_age_s: float) -> bool:
    """Whether a status written at ``written`` (its writer's clock) still counts at ``now``:
    at most ``max_age_s`` old, and at most ``max_age_s`` ahead (clocks of two machines may
    differ a little; one far ahead, or a corrupt time, would keep a dead writer alive)."""
    return abs(now - written) <= max_age_s


class InUse(RuntimeError):
    """A role one process holds at a time (a rollout worker's name, a run's trainer) is held
    by a running process."""


def wait_until_free(
    read: Callable[[], RolloutStatus | TrainerStatus | ProcessorStatus | None],
    what: str,
    advice: str,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    poll_s: float = 1.0,
) -> None:
    """Return once the status ``read`` returns shows no running holder of ``what``: none,
    stopped, or older than ``max_age_s``. A fresh running status may be a holder that just
    died (a restart takes its place) or a live one: wait for it to go stale, and raise
    :class:`InUse` (with ``advice``) as soon as it is updated, which only a live one does."""
    first = read()

    def free(status: RolloutStatus | TrainerStatus | ProcessorStatus | None) -> bool:
        return status is None or not status.running or not is_fresh(status.time, time.time(), max_age_s)

    if free(first):
        return
    log.warning(
        "%s: a running holder published its status %s; waiting up to %.0f s for it to go "
        "stale (one that died) before taking its place",
        what,
        _written(first.time, time.time()),
        max_age_s,
    )
    while True:
        time.sleep(poll_s)
        current = read()
        if free(current):
            return
        if current.time != first.time:
            raise InUse(
                f"{what} is in use: a running process updated its status "
                f"{_written(current.time, time.time())}; {advice}"
            )


def _written(written: float, now: float) -> str:
    """When a status written at ``written`` (its writer's clock) was written, seen at ``now``:
    a writer whose clock is ahead of this one's dates it in the future."""
    if written <= now:
        return f"{now - written:.1f} s ago"
    return f"dated {written - now:.0f} s ahead of this machine's clock"


def summarize(
    statuses: list[RolloutStatus],
    corrupt: int,
    now: float | None = None,
    max_age_s: float = DEFAULT_MAX_AGE_S,
) -> RolloutSummary:
    """Sum the fresh running workers' queues at ``now`` (epoch seconds, default: the clock);
    ``corrupt``: status files skipped by the read."""
    now = time.time() if now is None else now
    fresh = fresh_statuses(statuses, now, max_age_s)
    stopped = [s for s in statuses if not s.running]
    return RolloutSummary(
        workers=len(fresh),
        stopped=len(stopped),
        stale=len(statuses) - len(stopped) - len(fresh),
        corrupt=corrupt,
        engine_queue_depth=sum(s.engine_queue_depth for s in fresh),
        live_sessions=sum(s.live_sessions for s in fresh),
    )


class ElasticPlan(BaseModel):
    """Which engine replicas take new sessions, drain, or are handed to training.

    Replicas are named ``<worker>/<replica>`` (the worker's name and the router's replica
    name); a replica no list names accepts new sessions.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    time: float = Field(
        allow_inf_nan=False, description="Epoch seconds (the trainer's clock) at which the plan was decided."
    )
    accepting: list[str] = Field(default_factory=list, description="Replicas that take new sessions.")
    draining: list[str] = Field(
        default_factory=list,
        description="Replicas that take no new session; their sessions move off at their next turn.",
    )
    train: list[str] = Field(
        default_factory=list,
        description="Replicas handed to training (drained and empty; they stay drained).",
    )
    running: bool = Field(
        True, description="False once the trainer stopped: every replica accepts new sessions again."
    )

    @model_validator(mode="after")
    def _one_role_each(self) -> ElasticPlan:
        named = [*self.accepting, *self.draining, *self.train]
        twice = sorted({n for n in named if named.count(n) > 1})
        if twice:
            raise ValueError(f"replicas {twice} are named more than once in the plan")
        bad = sorted(n for n in named if n.count("/") != 1 or not all(n.split("/")))
        if bad:
            raise ValueError(f"replica names must read '<worker>/<replica>', got {bad}")
        return self

    def drained(self, worker: str) -> set[str]:
        """Replica names of ``worker`` that must take no new session (draining or handed to training)."""
        if not self.running:
            return set()
        return {
            unit.split("/", 1)[1] for unit in [*self.draining, *self.train] if unit.split("/", 1)[0] == worker
        }


class _ObjectBoard:
    """One status object of the run, replaced whole and read back validated."""

    model: type[BaseModel]
    prefix: str
    name: str
    what: str
    on_corrupt: str

    def __init__(self, store: RunStore):
        self.store = store
        self.root = store.path(self.prefix)
        self.path = posixpath.join(self.root, self.name)
        self._warned: bytes | None = None

    def publish(self, obj: BaseModel) -> None:
        """Replace the object atomically."""
        _replace(self.store, self.root, self.name, obj.model_dump_json().encode())

    def read(self) -> BaseModel | None:
        """The current object; None when there is none or it does not parse (warned once per content)."""
        try:
            payload = self.store.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        try:
            return self.model.model_validate_json(payload)
        except ValidationError as exc:
            if self._warned != payload:
                self._warned = payload
                log.warning(
                    "ignoring the %s %s (%d bytes): not a valid %s (%s); %s",
                    self.what,
                    self.store.url(self.prefix, self.name),
                    len(payload),
                    self.what.split()[-1],
                    _problems(exc),
                    self.on_corrupt,
                )
            return None


class ElasticPlanBoard(_ObjectBoard):
    """The run's elastic plan object ``status/elastic/plan.json`` (see the module docstring)."""

    model = ElasticPlan
    prefix = ELASTIC_PLAN_PREFIX
    name = ELASTIC_PLAN_NAME
    what = "elastic plan"
    on_corrupt = "replicas stay as they are"


class TrainerStatus(BaseModel):
    """What the trainer last said about the data waiting for it (the workers' backpressure)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    time: float = Field(
        allow_inf_nan=False, description="Epoch seconds (the trainer's clock) at which it wrote this status."
    )
    buffered_tokens: int = Field(
        ge=0,
        description="Tokens of processed samples not yet trained: in the trainer's buffer, or in shards "
        "it polled and holds back until the buffer drains (SAOConfig.read_ahead_batches).",
    )
    token_budget: int = Field(ge=1, description="Tokens the trainer takes per policy step.")
    running: bool = Field(True, description="False once the trainer stopped: nothing waits on it.")
    newest_read: dict[str, int] = Field(
        default_factory=dict,
        description="For each rollout worker, the newest sequence number among its shards the trainer has "
        "read (a processed shard keeps its raw shard's number).",
    )
    owner: str = Field("", description="Which trainer wrote it (a random id per trainer).")

    @property
    def queued_batches(self) -> float:
        """Policy steps' worth of data waiting for the trainer."""
        return self.buffered_tokens / self.token_budget


class TrainerStatusBoard(_ObjectBoard):
    """The trainer's status object ``status/train/trainer.json``."""

    model = TrainerStatus
    prefix = TRAINER_STATUS_PREFIX
    name = TRAINER_STATUS_NAME
    what = "trainer status"
    on_corrupt = "rollouts are not held back by it"


class ProcessOffset(BaseModel):
    """Where the process stage stands in the ``shards`` commit log."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    offset: int = Field(
        ge=0, description="Delta version of ``shards`` up to which every raw shard has been processed."
    )
    time: float = Field(allow_inf_nan=False, description="Epoch seconds at which it was written.")
    table_id: str | None = Field(
        None,
        description="Delta metadata id of the ``shards`` table ``offset`` is a version of: a table "
        "recreated since counts its versions anew (None: saved by an older treadle, unknown).",
    )


class ProcessOffsetBoard(_ObjectBoard):
    """The process stage's offset object ``status/process/offset.json``."""

    model = ProcessOffset
    prefix = PROCESS_OFFSET_PREFIX
    name = PROCESS_OFFSET_NAME
    what = "process offset"
    on_corrupt = "the processor starts from the beginning of the log (it skips what it processed)"


class ProcessorStatus(BaseModel):
    """That a run's processor is running: one processor per run (two would process its shards
    twice), so a second one waits this out or is refused."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    time: float = Field(allow_inf_nan=False, description="Epoch seconds at which it was written.")
    running: bool = Field(True, description="False once the processor stopped.")
    owner: str = Field("", description="Which processor wrote it (a random id per processor).")


class ProcessorStatusBoard(_ObjectBoard):
    """The processor's status object ``status/process/processor.json``."""

    model = ProcessorStatus
    prefix = PROCESS_OFFSET_PREFIX
    name = PROCESSOR_STATUS_NAME
    what = "processor status"
    on_corrupt = "it does not hold the run's processing back"


CLAIM_SETTLE_S = 0.5
"""Seconds a new holder waits after its first status before reading it back once more: two
started at once may both have read no holder before either wrote, and then the later write
is the one both read back (a status write takes far less)."""


class HeldRole:
    """A role that one process holds at a time (a rollout worker's name, a run's trainer, its
    processor): held by publishing its status object stamped with this holder's random
    ``owner`` id.

    Every publish first reads the status back, and so does :meth:`holds`. When another
    holder's running status has replaced this one's (two started at once, or this one's
    renewals stalled past ``max_age_s`` and another took the role), the role is lost:
    :attr:`lost` is set and this holder publishes nothing more, leaving the status to the new
    holder. Before this holder's first publish only a fresh one holds the role (a stale one
    is a dead holder's); after it, any other running one was written since, by a live
    process, however its date reads on this machine's clock."""

    def __init__(
        self,
        read: Callable[[], RolloutStatus | TrainerStatus | ProcessorStatus | None],
        publish: Callable[[RolloutStatus | TrainerStatus | ProcessorStatus], None],
        what: str,
        max_age_s: float = DEFAULT_MAX_AGE_S,
    ):
        self._read, self._publish = read, publish
        self.what = what
        self.owner = uuid.uuid4().hex
        self.lost = threading.Event()
        self._max_age_s = max_age_s
        self._lock = threading.Lock()  # a read-back and its publish are one step
        self._published = False

    @property
    def taken(self) -> str:
        """Why a holder stops whose role another process took."""
        return (
            f"{self.what} was taken over by another process (this one's status went unrenewed for "
            f"over {self._max_age_s:.0f} s, both started at once, or their machines' clocks differ "
            "by more than that)"
        )

    def claim(
        self, status: RolloutStatus | TrainerStatus | ProcessorStatus, settle_s: float = CLAIM_SETTLE_S
    ) -> None:
        """Take the role: publish ``status``, wait ``settle_s``, and publish it again, dated
        now, if the read-back finds the role still this holder's; raises :class:`InUse`
        when it does not."""
        if self.publish(status):
            time.sleep(settle_s)
            if self.publish(status.model_copy(update={"time": time.time()})):
                return
        raise InUse(f"{self.what} is in use: another process took it at the same time")

    def holds(self) -> bool:
        """Whether the role is still this holder's, by the status read back now."""
        with self._lock:
            return self._holds()

    def require(self) -> None:
        """Raise :class:`InUse` (:attr:`taken`) unless the role is still this holder's (read back now)."""
        if not self.holds():
            raise InUse(self.taken)

    def _holds(self) -> bool:
        if not self.lost.is_set():
            current = self._read()
            if (
                current is not None
                and current.owner != self.owner
                and current.running
                # read stale, it may still be a live holder's whose clock differs from this one's
                and (self._published or is_fresh(current.time, time.time(), self._max_age_s))
            ):
                log.error("%s", self.taken)
                self.lost.set()
        return not self.lost.is_set()

    def publish(self, status: RolloutStatus | TrainerStatus | ProcessorStatus) -> bool:
        """Publish ``status`` as this holder's unless the role is lost; whether it was published."""
        with self._lock:
            if not self._holds():
                return False
            self._publish(status.model_copy(update={"owner": self.owner}))
            self._published = True
            return True
