"""Elastic capacity between rollout and training (QwenGyre, arXiv 2609.33848).

Capacity units (engine replicas on a cluster, worker processes here) each serve rollout
or training. When the trainer is saturated and rollout can spare slots (no session waits
for one), or holds more replicas than the measured rates call for, the controller drains
rollout replicas, the least loaded first: a draining replica takes no new sessions, and
once it holds none the unit is handed to the trainer. With ``migrate_at_turns`` (the default) each of its live
sessions moves, at its next turn boundary, to an accepting replica with a free slot
(``migrate_session``; the new replica re-prefills the session's tokens, which the gateway
keeps), so a replica drains in about a turn; without it, or when no slot is free, its
sessions run to their end there. A drain counts the migrants' slots: it leaves the other
replicas ``headroom_slots`` free after they take its sessions. The router fills the most
loaded replicas first, so stragglers pack and lightly loaded replicas empty. When sessions
queue for a slot the controller cancels drains and borrows the trainer's idle units; when
the trainer's queue runs dry it cancels the drains the forecast below does not call for and
hands borrowed units back. A live rollout is never
interrupted: a session moves only between turns, never mid-generation.

How many training units to keep when lending: the most of ``min_train``, the measured
rate (trajectories the finished sessions wrote per second, a compacted rollout's one per
context, times unit-seconds per trajectory) and the forecast
(``forecast_completions``: each live session of age ``a`` ends within the next
``forecast_horizon_s`` ``H`` with probability ``P(L <= a + H | L > a)`` under the
empirical distribution of recently finished session lengths, bringing as many trajectories
as those sessions wrote (a compacted rollout one per context); expected trajectories times
unit-seconds per trajectory over ``H``). The measured rate lags at a phase change (no long
session has finished yet when a long phase starts); the forecast does not, because it
reads the ages of the sessions now live. Everything is observable in the pipeline:
session start/end times, queue depths, unconsumed trajectories, trainer idle time.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["rollout", "draining", "train"]

MOVE_HISTORY = 1024
"""Moves a controller keeps in ``moves`` (at least; it trims at twice as many), for its log and
its cooldown; what its decisions need of older moves each unit keeps (``Unit.role_since``,
``Unit.moved``: when a replica began to drain, which units it borrowed). An unbounded history
would grow over a run of weeks."""


class ElasticConfig(BaseModel):
    """Thresholds of the rollout/training capacity policy."""

    model_config = ConfigDict(allow_inf_nan=False)

    sessions_per_replica: int = Field(
        8, ge=1, description="Concurrent rollout sessions one replica serves (its session slots)."
    )
    headroom_slots: int = Field(
        4,
        ge=0,
        description="Free session slots the accepting replicas keep after one is lent to training.",
    )
    high_backlog: int = Field(
        2,
        ge=1,
        description="Unconsumed shards at or above which a trainer with no idle time can use another unit.",
    )
    low_backlog: int = Field(
        1,
        ge=0,
        description="Unconsumed shards at or below which the trainer runs dry and returns a borrowed unit.",
    )
    saturated_idle: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Trainer idle fraction at or below which the trainer counts as saturated.",
    )
    max_moves_per_step: int = Field(
        4, ge=1, description="Most units moved (or set draining) by one decision."
    )
    cooldown_s: float = Field(
        30.0,
        ge=0,
        description="Seconds after a move before the next decision (one decision tick of the pipeline).",
    )
    rate_window_s: float = Field(
        600.0,
        gt=0,
        description="Seconds of finished sessions over which the rollout output rate (their trajectories "
        "per second) is measured.",
    )
    forecast_horizon_s: float = Field(
        600.0,
        gt=0,
        description="Seconds ahead over which the live sessions' expected completions size the trainer.",
    )
    length_window: int = Field(
        4096, ge=1, description="Finished sessions whose lengths form the session-length model."
    )
    migrate_at_turns: bool = Field(
        True,
        description="A draining replica's sessions move to accepting replicas with free slots at their next "
        "turn boundary (re-prefilled there), so its live sessions need free slots elsewhere; off: they run "
        "to their end on it.",
    )
    min_rollout: int = Field(1, ge=1, description="Rollout units never lent to training.")
    min_train: int = Field(1, ge=1, description="Training units never handed to rollout.")

    @model_validator(mode="after")
    def _dry_below_saturated(self) -> ElasticConfig:
        # a trainer at once dry and saturated would have its drains cancelled and made again
        # at every decision
        if self.low_backlog >= self.high_backlog:
            raise ValueError(
                f"low_backlog ({self.low_backlog}) must be below high_backlog ({self.high_backlog}): "
                "a trainer would count as both dry and saturated"
            )
        return self


@dataclass(frozen=True)
class PolicyInputs:
    """What the controller decides on.

    ``unconsumed_shards``: committed shards the trainer has not consumed yet;
    ``engine_queue_depth``: sessions waiting for room on a rollout replica (in the pipeline,
    generation requests queued in the engines, one per waiting session);
    ``trainer_idle``: fraction of the last interval the training units sat idle (0..1);
    ``train_unit_s_per_trajectory``: unit-seconds the trainer spent per trajectory lately
    (measured; ``None`` while unknown);
    ``unconsumed_trajectories``: the trainer's backlog in trajectories (``None``: count one
    per shard).
    """

    unconsumed_shards: int
    engine_queue_depth: int
    trainer_idle: float
    train_unit_s_per_trajectory: float | None = None
    unconsumed_trajectories: int | None = None

    def __post_init__(self) -> None:
        # a NaN idle fraction is neither dry nor saturated and failed only in round() later
        if not 0 <= self.trainer_idle <= 1:
            raise ValueError(f"trainer_idle must be a fraction in [0, 1], got {self.trainer_idle}")
        cost = self.train_unit_s_per_trajectory
        if cost is not None and not 0 <= cost < math.inf:
            raise ValueError(f"train_unit_s_per_trajectory must be finite and >= 0, got {cost}")
        counts = (self.unconsumed_shards, self.engine_queue_depth, self.unconsumed_trajectories or 0)
        if not all(count >= 0 for count in counts):  # a NaN count is neither dry nor saturated either
            raise ValueError(f"queue counts must be >= 0, got {self}")


@dataclass(frozen=True)
class Move:
    """One decision: ``unit`` goes from ``source`` to ``target`` (``draining`` ends at ``train``)."""

    time: float
    unit: str
    source: Role
    target: Role
    reason: str


@dataclass
class Unit:
    """A capacity unit and the rollout sessions live on it (with their start times, when
    known); ``role_since``: when it took its role, ``moved``: the number of the move that gave
    it (its controller's ``moves_made`` then; both ``None``: it started in it); ``home``: the
    role it started in (a rollout unit in training is borrowed)."""

    name: str
    role: Role
    live_sessions: int = 0
    session_starts: list[float] = field(default_factory=list)
    role_since: float | None = None
    moved: int | None = None
    home: Role | None = None

    def __post_init__(self) -> None:
        if self.home is None:
            self.home = self.role


@dataclass
class SessionLengths:
    """Empirical distribution of the last ``window`` finished session lengths (seconds), each
    with the trajectories its session wrote: one, or a compacted rollout's one per context,
    all written when it ends.

    Learned online from session start/end events; says how many trajectories a live session
    of a given age is expected to bring within a horizon, with no knowledge of any session's
    own length.
    """

    window: int
    recent: deque[tuple[float, int]] = field(default_factory=deque)
    ordered: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    """The trajectories of the session of each length in ``ordered``, in its order."""
    _cumulative: list[int] | None = field(default=None, repr=False)

    def record(self, length: float, rows: int = 1) -> None:
        """Add one finished session's length and trajectories, forgetting the oldest beyond ``window``."""
        if rows < 1:
            raise ValueError(f"a finished session wrote at least one trajectory, got {rows}")
        if math.isnan(length):  # it compares false with every length: no place in the sorted lengths
            raise ValueError(f"a session length must be a number, got {length}")
        self.recent.append((length, rows))
        at = bisect.bisect_right(self.ordered, length)
        self.ordered.insert(at, length)
        self.rows.insert(at, rows)
        if len(self.recent) > self.window:
            length, rows = self.recent.popleft()
            # among sessions of its length, one with as many trajectories
            at = self.rows.index(rows, bisect.bisect_left(self.ordered, length))
            del self.ordered[at], self.rows[at]
        self._cumulative = None

    def ends_within(self, age: float, horizon: float) -> float:
        """E[rows · 1(length <= age + horizon) | length > age]: the trajectories a session of age
        ``age`` brings within ``horizon``, expected (P(length <= age + horizon | length > age)
        when every session wrote one); 0 for a session older than any seen (or no data)."""
        outlived = bisect.bisect_right(self.ordered, age)
        longer = len(self.ordered) - outlived
        if longer == 0:
            return 0.0
        if self._cumulative is None:
            self._cumulative = [0, *itertools.accumulate(self.rows)]
        ending = (
            self._cumulative[bisect.bisect_right(self.ordered, age + horizon)] - self._cumulative[outlived]
        )
        return ending / longer


@dataclass
class ElasticController:
    """Moves units between rollout and training as their queues change.

    The router asks ``routable()`` for replicas that take new sessions and reports
    ``begin_session`` / ``end_session``, and ``migrate_session`` when a draining replica's
    session moves at a turn boundary; the trainer uses ``units_in("train")``; a driver calls
    ``step(inputs, now)`` periodically. ``log_record()`` is the policy's last inputs, roles
    and moves, for the ``extra`` column of ``train_steps``. ``moves`` holds the latest moves
    (at least ``MOVE_HISTORY``), ``moves_made`` counts them all.
    """

    config: ElasticConfig
    units: dict[str, Unit]
    moves: list[Move] = field(default_factory=list)
    moves_made: int = 0
    last_inputs: PolicyInputs | None = None
    finished_at: deque[tuple[float, int]] = field(default_factory=deque)
    started: float | None = None
    last_rollout_rate: float = 0.0
    lengths: SessionLengths | None = None
    last_forecast: float | None = None
    last_demand: float | None = None

    def __post_init__(self) -> None:
        if self.lengths is None:
            self.lengths = SessionLengths(self.config.length_window)

    @classmethod
    def create(
        cls, rollout: list[str], train: list[str], config: ElasticConfig | None = None
    ) -> ElasticController:
        """A controller with the given rollout and training units."""
        config = config or ElasticConfig()
        if len(set(rollout)) != len(rollout) or len(set(train)) != len(train):
            raise ValueError(f"unit names must differ: rollout {rollout}, train {train}")
        if set(rollout) & set(train):
            raise ValueError(f"units {sorted(set(rollout) & set(train))} are in both rollout and train")
        if len(rollout) < config.min_rollout or len(train) < config.min_train:
            raise ValueError(
                f"need at least min_rollout={config.min_rollout} rollout and min_train={config.min_train} train units"
            )
        units = {n: Unit(n, "rollout") for n in rollout} | {n: Unit(n, "train") for n in train}
        return cls(config, units)

    def units_in(self, role: Role) -> list[str]:
        """Names of the units in ``role``."""
        return [u.name for u in self.units.values() if u.role == role]

    def routable(self) -> list[str]:
        """Rollout replicas that accept new sessions, the most loaded first.

        A router that fills replicas in this order packs sessions onto few replicas, so the
        lightly loaded ones (with a straggler or two) empty out and can be lent whole.
        """
        accepting = [u for u in self.units.values() if u.role == "rollout"]
        return [u.name for u in sorted(accepting, key=lambda u: -u.live_sessions)]

    def _unit(self, name: str) -> Unit:
        if name not in self.units:
            raise KeyError(f"unknown unit {name!r}; known: {sorted(self.units)}")
        return self.units[name]

    def begin_session(self, name: str, now: float | None = None) -> None:
        """A rollout session starts on replica ``name`` (refused unless it is accepting).

        With ``now`` the start time is kept, so the session's age feeds the forecast; pass
        the same time as ``started`` to ``end_session``.
        """
        unit = self._unit(name)
        if unit.role != "rollout":
            raise ValueError(f"unit {name!r} is {unit.role}, it takes no new sessions")
        unit.live_sessions += 1
        if now is not None:
            unit.session_starts.append(now)
            if self.started is None:  # the rate's interval opens before the first session ends
                self.started = now

    def end_session(self, name: str, now: float, started: float | None = None, rows: int = 1) -> Move | None:
        """A session on ``name`` ended; a drained replica goes to training here (its session boundary).

        ``started``: the session's start time as given to ``begin_session`` (its length then
        trains the session-length model); refused without it when every live session on
        ``name`` was begun with a time. ``rows``: the trajectories it wrote (a compacted
        rollout's one per context).
        """
        if rows < 1:
            raise ValueError(f"a finished session wrote at least one trajectory, got {rows}")
        unit = self._unit(name)
        self._take_session(unit, started, "end")
        if started is not None:
            self.lengths.record(now - started, rows)
        self.record_finished(rows, now)
        if unit.role == "draining" and unit.live_sessions == 0:
            return self._move(unit, "train", now, "drained at session boundary")
        return None

    def migrate_session(
        self, source: str, target: str, now: float, started: float | None = None
    ) -> Move | None:
        """A live session moves from draining ``source`` to accepting ``target`` at a turn boundary.

        ``started``: its start time as given to ``begin_session`` (it keeps its age; required
        as in ``end_session``). When
        ``source`` is left empty it goes to training here, as at a session end.
        """
        if not self.config.migrate_at_turns:
            raise ValueError("migrate_at_turns is off: sessions stay on their replica until they end")
        src, dst = self._unit(source), self._unit(target)
        if src.role != "draining":
            raise ValueError(f"unit {source!r} is {src.role}; only a draining replica's sessions migrate")
        if dst.role != "rollout":
            raise ValueError(f"unit {target!r} is {dst.role}, it takes no sessions")
        self._take_session(src, started, "migrate")
        if started is not None:
            dst.session_starts.append(started)
        dst.live_sessions += 1
        if src.live_sessions == 0:
            return self._move(src, "train", now, "drained: last session migrated at a turn boundary")
        return None

    def _take_session(self, unit: Unit, started: float | None, what: str) -> None:
        """Take one live session (the one started at ``started``, else one begun without a time) off ``unit``."""
        if unit.live_sessions < 1:
            raise ValueError(f"unit {unit.name!r} has no live session to {what}")
        if started is None and len(unit.session_starts) == unit.live_sessions:
            # taking a timed session without its start would leave that start in the forecast for good
            raise ValueError(
                f"unit {unit.name!r}: its live sessions were begun with a time; pass started to {what} one"
            )
        if started is not None:
            if started not in unit.session_starts:
                raise ValueError(f"unit {unit.name!r} has no live session started at {started}")
            unit.session_starts.remove(started)
        unit.live_sessions -= 1

    def _move(self, unit: Unit, target: Role, now: float, reason: str) -> Move:
        move = Move(now, unit.name, unit.role, target, reason)
        self.moves.append(move)
        self.moves_made += 1
        unit.role, unit.role_since, unit.moved = target, now, self.moves_made
        if len(self.moves) > 2 * MOVE_HISTORY:
            del self.moves[:-MOVE_HISTORY]
        return move

    def step(self, inputs: PolicyInputs, now: float) -> list[Move]:
        """Decide on the current queues; returns the moves made now (a drain completes later).

        See the module docstring for the policy.
        """
        self.last_inputs = inputs
        cfg = self.config
        rate = self.rollout_rate(now)
        forecast = self.forecast_completions(now)
        demand = self.training_demand(inputs, forecast)
        self.last_demand = demand
        # a move dated after now (the wall clock stepped back) holds nothing off: it would
        # freeze every decision until the clock caught up with it
        if self.moves and 0 <= now - self.moves[-1].time < cfg.cooldown_s:
            return []
        rollout = [self.units[n] for n in self.units_in("rollout")]
        draining = [self.units[n] for n in self.units_in("draining")]
        train = self.units_in("train")
        trainer_dry = inputs.unconsumed_shards <= cfg.low_backlog and inputs.trainer_idle > 0
        trainer_saturated = (
            inputs.unconsumed_shards >= cfg.high_backlog and inputs.trainer_idle <= cfg.saturated_idle
        )
        need = None
        if demand is not None:
            need = min(max(math.ceil(demand), cfg.min_train), len(self.units) - cfg.min_rollout)
        target = self.balanced_rollout_units(rate, inputs.train_unit_s_per_trajectory)
        wanted = math.ceil(inputs.engine_queue_depth / cfg.sessions_per_replica)
        moves: list[Move] = []
        if wanted > 0 or trainer_dry:
            cancel = wanted
            if trainer_dry:
                # a dry trainer keeps the drains the forecast says it will need: cancelled now,
                # they would be drained again (their sessions moved again) once the data lands
                still_needed = 0 if need is None else max(need - len(train), 0)
                cancel = max(cancel, len(draining) - still_needed)
            if trainer_saturated and target is not None:
                cancel = min(cancel, max(target - len(rollout), 0))
            for unit in sorted(draining, key=lambda u: -u.live_sessions)[
                : max(min(cancel, cfg.max_moves_per_step), 0)
            ]:
                moves.append(self._move(unit, "rollout", now, "drain cancelled: rollout needs its slots"))
            # a saturated trainer has no unit to spare, whatever its idle fraction rounds to
            idle_units = 0 if trainer_saturated else round(inputs.trainer_idle * len(train))
            if trainer_dry:
                idle_units = max(idle_units, 1)
            keep = cfg.min_train
            if inputs.train_unit_s_per_trajectory is not None:
                keep = max(keep, math.ceil(rate * inputs.train_unit_s_per_trajectory))
            if need is not None:
                keep = max(keep, need)
            room = min(len(train) - keep, cfg.max_moves_per_step - len(moves))
            lendable = min(wanted - len(moves), idle_units, room)
            order = self._return_order(train)
            reason = "trainer queue ran dry" if trainer_dry else "trainer has idle units"
            reason = f"{reason}, engines have queued sessions"
            borrowed = [n for n in order if self.units[n].home == "rollout"]
            if trainer_dry and min(len(borrowed), room) > lendable:
                # hand back what was borrowed though no session queues: engines that batch
                # every session they get never queue, and the unit would never come back
                order, lendable = borrowed, min(len(borrowed), room)
                reason = "trainer queue ran dry, borrowed unit handed back"
            for name in order[: max(lendable, 0)]:
                moves.append(self._move(self.units[name], "rollout", now, reason))
        if trainer_saturated and not moves:
            # free slots by pool: a replica's sessions move only within its pool
            free: Counter[str | None] = Counter()
            for unit in rollout:
                free[self._pool(unit)] += cfg.sessions_per_replica - unit.live_sessions
            if cfg.migrate_at_turns:  # the sessions of earlier drains, not yet moved, take free slots too
                for unit in draining:
                    free[self._pool(unit)] -= unit.live_sessions
            accepting = len(rollout)
            full: set[str | None] = set()
            for unit in self._drain_order(rollout, now):
                pool = self._pool(unit)
                # migrating sessions take free slots elsewhere: the whole replica's slots are lost
                lost = cfg.sessions_per_replica - (0 if cfg.migrate_at_turns else unit.live_sessions)
                if len(moves) == cfg.max_moves_per_step or accepting <= cfg.min_rollout:
                    break
                if pool in full:
                    continue
                # with sessions queued the next decision would cancel a drain for spare slots
                spare = wanted == 0 and free[pool] - lost >= cfg.headroom_slots
                over_target = target is not None and accepting > target
                if not (spare or over_target):
                    full.add(pool)
                    continue
                reason = "spare replica" if spare else "rollout above its balanced share"
                free[pool] -= lost
                accepting -= 1
                moves.append(self._lend(unit, now, f"trainer saturated, {reason}"))
        return moves

    def _lend(self, unit: Unit, now: float, reason: str) -> Move:
        """Lend accepting ``unit`` to training: at once when it holds no session, else by draining it."""
        if unit.live_sessions == 0:
            return self._move(unit, "train", now, f"{reason} (idle)")
        return self._move(unit, "draining", now, f"{reason} drains")

    def training_demand(self, inputs: PolicyInputs, forecast: float | None) -> float | None:
        """Training units the next ``forecast_horizon_s`` keeps busy: queued plus forecast work.

        ``(backlog + forecast_completions) * train_unit_s / horizon``, the backlog in
        trajectories (``unconsumed_trajectories``, else one a shard). ``None`` while the
        training cost or the session-length model is unknown.
        """
        train_s = inputs.train_unit_s_per_trajectory
        if train_s is None or forecast is None:
            return None
        backlog = inputs.unconsumed_trajectories
        if backlog is None:
            backlog = inputs.unconsumed_shards
        return (backlog + forecast) * train_s / self.config.forecast_horizon_s

    def _drain_order(self, rollout: list[Unit], now: float) -> list[Unit]:
        """Accepting replicas in the order they are drained: the fewest live sessions first."""
        return sorted(rollout, key=lambda u: u.live_sessions)

    def _pool(self, unit: Unit) -> str | None:
        """The pool of replicas among which ``unit``'s sessions move (``None``: all are one pool)."""
        return None

    def balanced_rollout_units(self, rate: float, train_unit_s: float | None) -> int | None:
        """Rollout replicas at which rollout and training output match, from measured rates.

        ``rate``: trajectories per second (``rollout_rate``). By Little's law the mean session
        lasts ``live / session_rate`` seconds and brings ``rate / session_rate`` trajectories,
        so one trajectory costs ``rho = live / (rate * sessions_per_replica)`` replica-seconds
        of rollout and ``tau = train_unit_s`` unit-seconds of training;
        ``N * rho / (rho + tau)`` of the ``N`` units balance the two. ``None`` while either
        rate is unknown.
        """
        live = sum(u.live_sessions for u in self.units.values())
        if train_unit_s is None or rate <= 0 or live == 0:
            return None
        rho = live / (rate * self.config.sessions_per_replica)
        total = len(self.units)
        balanced = round(total * rho / (rho + train_unit_s))
        return min(max(balanced, self.config.min_rollout), total - self.config.min_train)

    def forecast_completions(self, now: float) -> float | None:
        """Trajectories expected from the sessions that end within ``forecast_horizon_s``, from
        the live sessions' ages.

        Each live session (start time known) of age ``a`` ends within the horizon ``H`` with
        probability ``P(L <= a + H | L > a)`` under the session-length model, bringing the
        trajectories it wrote (one, or a compacted rollout's one per context, as the ended
        sessions did: ``SessionLengths.ends_within``); the sum is the expected count. ``None``
        before any session with a known start has finished.
        """
        if not self.lengths.ordered:
            self.last_forecast = None
            return None
        horizon = self.config.forecast_horizon_s
        self.last_forecast = sum(
            self.lengths.ends_within(now - start, horizon)
            for unit in self.units.values()
            for start in unit.session_starts
        )
        return self.last_forecast

    def record_finished(self, count: int, now: float) -> None:
        """Finished sessions wrote ``count`` trajectories at ``now`` (for a driver that learns
        them in batches, e.g. from the workers' published counts, rather than one
        ``end_session`` each)."""
        if self.started is None:
            self.started = now
        if count > 0:
            self.finished_at.append((now, count))

    def rollout_rate(self, now: float) -> float:
        """Trajectories the finished sessions wrote, per second, over the last ``rate_window_s``
        (or since the first decision, session start or finish): as the training cost, per
        trajectory, so a compacted rollout counts one per context."""
        if self.started is None:
            self.started = now
        while self.finished_at and self.finished_at[0][0] < now - self.config.rate_window_s:
            self.finished_at.popleft()
        elapsed = min(self.config.rate_window_s, now - self.started)
        finished = sum(count for _, count in self.finished_at)
        self.last_rollout_rate = finished / elapsed if elapsed > 0 else 0.0
        return self.last_rollout_rate

    def _return_order(self, train: list[str]) -> list[str]:
        """Training units, the most recently borrowed from rollout first, then the rest last-first."""
        # from the units, not ``moves``: a borrow trimmed from the history is still a borrow
        borrowed = sorted(
            (n for n in train if self.units[n].moved is not None), key=lambda n: -self.units[n].moved
        )
        return borrowed + [n for n in reversed(train) if self.units[n].moved is None]

    def log_record(self) -> dict:
        """Policy inputs, unit roles and the last moves, JSON-ready."""
        return {
            "elastic": {
                "inputs": asdict(self.last_inputs) if self.last_inputs else None,
                "rollout_rate": round(self.last_rollout_rate, 6),
                "forecast_completions": None if self.last_forecast is None else round(self.last_forecast, 3),
                "training_demand": None if self.last_demand is None else round(self.last_demand, 3),
                "roles": {n: u.role for n, u in self.units.items()},
                "live_sessions": {n: u.live_sessions for n, u in self.units.items()},
                "moves": [asdict(m) for m in self.moves[-8:]],
            }
        }
