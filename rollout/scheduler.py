"""Action-level resource scheduling (ARL-Tangram, arXiv 2603.13019).

Every tool call, test run and reward call asks for a resource vector for the length of
that one action instead of holding resources for a trajectory's whole life. An elastic
action also says how its duration scales with the units of one resource it gets:
``T(m) = T_1 / (E(m) * m)`` with efficiency ``0 < E(m) <= 1``.

``decide`` is the pure decision function: given the queue, the free resources and the
running actions it returns which queued actions start now and with how many units. It
takes queued actions first-come-first-served while they fit, spreads the spare units of
elastic resources where they shorten durations most net of the unit-seconds they burn
(priced by how many other actions compete for the pool), then greedily evicts the last
candidate while that lowers the total action completion time (queueing + execution),
estimating the rest of the queue with a completion-time heap.

``ResourceRequest`` and ``amdahl_efficiency`` live in ``envs.base`` (environments declare
their actions' requests without importing rollout) and are re-exported here.

``ActionPolicy`` (ours) and ``StaticPolicy`` (per-trajectory reservation, the baseline)
are clock-free state machines used both by the asyncio fronts ``ActionScheduler`` /
``StaticReservation`` and by the discrete-event cluster in ``rollout.simcluster``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from heapq import heappop, heappush
from itertools import accumulate
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple, Protocol

from envs.base import ResourceRequest, amdahl_efficiency

if TYPE_CHECKING:
    from rollout.resources import CpuManager

_EPS = 1e-9
_finish = itemgetter(0)
_holds = itemgetter(1)

__all__ = [
    "ActionPolicy",
    "ActionScheduler",
    "Grant",
    "Pending",
    "Policy",
    "ResourceRequest",
    "Running",
    "StaticPolicy",
    "StaticReservation",
    "amdahl_efficiency",
    "decide",
]


@dataclass
class Pending:
    """A queued action in the form ``decide`` reads: vectors aligned to the resource names.

    ``fixed[r]`` is the fixed demand on resource ``r``; ``elastic`` the index of the elastic
    resource (-1 if none); ``times[m]`` the duration on ``m`` units (``times[0]`` unused;
    a non-elastic action has ``times == (t, t)`` and ``min_units == max_units == 1``).
    """

    fixed: list[float]
    elastic: int
    min_units: int
    max_units: int
    times: list[float]
    enqueued_at: float = 0.0
    need: list[float] = field(init=False, repr=False)
    uses: list[int] = field(init=False, repr=False)
    single: int = field(init=False, repr=False)

    def __post_init__(self):
        self.need = _holding(self, self.min_units)
        self.uses = [r for r, n in enumerate(self.need) if n > 0]
        # the one resource this action uses (-1: none or several); the scan's fast path
        self.single = self.uses[0] if len(self.uses) == 1 else -1


class Running(NamedTuple):
    """A running action as ``decide`` sees it: when it should finish and what it holds."""

    finish_at: float
    holds: list[float]


def _holding(p: Pending, units: int) -> list[float]:
    if p.elastic < 0:
        return p.fixed
    holds = list(p.fixed)
    holds[p.elastic] += units
    return holds


def _fits(need: list[float], free: list[float]) -> bool:
    # a plain loop: this is an inner call of the decision path and all() with a generator is ~2x slower
    for r in range(len(need)):  # noqa: SIM110
        if need[r] > free[r] + _EPS:
            return False
    return True


def _gain(p: Pending, m: int, price: float) -> float:
    """Change of the objective from giving an elastic action its ``m + 1``-th unit.

    The action finishes ``T(m) - T(m + 1)`` sooner but burns ``(m + 1) T(m + 1) - m T(m)``
    more unit-seconds, which ``price`` converts into completion time of the other actions
    competing for the resource.
    """
    times = p.times
    return times[m + 1] - times[m] + price * ((m + 1) * times[m + 1] - m * times[m])


def _prices(free: Sequence[float], running: Sequence[Running], competing: list[int]) -> list[float]:
    """Completion seconds one unit-second of each resource is worth to the other actions.

    A unit-second taken from a pool of ``c`` units delays the pool's work by ``1 / c``
    seconds, and with it each of the ``n`` other actions competing for it: ``n / c``. The
    competitors are the running actions holding the resource plus ``competing[r]`` (the
    queued ones the decision saw), less the one asking; so a lone action takes every unit
    that shortens it, and in a crowded pool an elastic action does not take units it would
    use poorly while others wait.
    """
    prices = []
    columns = list(zip(*map(_holds, running), strict=True)) if running else [()] * len(free)
    for r, column in enumerate(columns):
        capacity = free[r] + sum(column)
        holders = len(column) - column.count(0.0)
        prices.append(max(holders + competing[r] - 1, 0) / capacity if capacity > 0 else 0.0)
    return prices


def _spread(
    cands: list[Pending],
    units: list[int],
    spare: list[float],
    gains: list[tuple[float, int]],
    live: int,
    prices: list[float],
) -> list[int]:
    """Give spare elastic units, one at a time, where they lower the objective most (in place).

    ``gains`` is a heap of (objective change from one more unit, candidate index); entries of
    candidates ``>= live`` (evicted) are dropped. Durations are convex in the units, so
    continuing this greedy from any greedy state stays optimal. Returns the candidates
    that grew.
    """
    grew = []
    stuck = []
    open_resources = {cands[k].elastic for _, k in gains if k < live and spare[cands[k].elastic] >= 1 - _EPS}
    while gains and open_resources:
        gain, k = gains[0]
        if gain >= 0:
            break
        heappop(gains)
        if k >= live:
            continue
        p = cands[k]
        e = p.elastic
        if e not in open_resources:
            stuck.append((gain, k))  # its resource ran out; more may free up on a later eviction
            continue
        spare[e] -= 1
        if spare[e] < 1 - _EPS:
            open_resources.discard(e)
        units[k] += 1
        grew.append(k)
        m = units[k]
        if m < p.max_units:
            heappush(gains, (_gain(p, m, prices[e]), k))
    for entry in stuck:
        heappush(gains, entry)
    return grew


def _timeline(
    events: list[tuple[float, list[float]]], free: list[float], resources: Sequence[int] | None = None
) -> tuple[list[float], list[list[float]]]:
    """Finish times of ``events`` sorted, and per resource the free amount after each has finished.

    ``events`` are (finish time, held vector) of everything running, ``free`` what is free
    now. Returns ``times`` (E,) sorted and ``cums`` (R, E + 1): ``cums[r][i]`` is ``free[r]``
    plus the holds of the ``i`` earliest events. Only the ``resources`` given (default: all)
    get their row; the others are empty.
    """
    events = sorted(events, key=_finish)
    times = list(map(_finish, events))
    holds = list(map(_holds, events))
    cums: list[list[float]] = [[] for _ in free]
    for r in range(len(free)) if resources is None else resources:
        cums[r] = list(accumulate(map(itemgetter(r), holds), initial=free[r]))
    return times, cums


def _queue_estimate(
    rest: Sequence[Pending],
    times: list[float],
    cums: list[list[float]],
    now: float,
    limit: float = math.inf,
) -> float:
    """Sum of completion times (from ``now``) of ``rest`` run FCFS as resources free up.

    ``times`` and ``cums`` come from ``_timeline`` over everything running. Each queued
    action starts at the first moment it fits and takes all the free units of its elastic
    resource up to its maximum. The moment an action fits is a binary search in the
    prefix-summed frees, not a walk over the events; the actions of ``rest`` started
    meanwhile finish through a small completion-time heap. The sum only grows, so the walk
    stops as soon as it reaches ``limit`` and returns ``inf`` (the caller only asks whether
    the estimate beats ``limit``).
    """
    n = len(times)
    size = range(len(cums))
    delta = [0.0] * len(cums)  # held by actions of ``rest`` started and not yet finished
    finishing: list[tuple[float, int, list[float]]] = []
    t = now
    ptr = 0  # events[:ptr] have finished
    total = 0.0
    for tie, p in enumerate(rest):
        need = p.need
        uses = p.uses
        while True:
            i = ptr
            for r in uses:
                j = bisect_left(cums[r], need[r] - delta[r] - _EPS, i)
                if j > i:
                    i = j
            fit_at = t if i == ptr else (times[i - 1] if i <= n else math.inf)
            if finishing and finishing[0][0] < fit_at:
                done, _, held = heappop(finishing)
                for r in size:
                    delta[r] += held[r]
                if done > t:
                    t = done
                    ptr = bisect_right(times, t, ptr)
                continue
            if i > n:
                return math.inf
            if fit_at > t:
                t = fit_at
            break
        # everything finished by t has given back (an elastic start takes it all)
        ptr = bisect_right(times, t, i)
        while finishing and finishing[0][0] <= t:
            for r, h in enumerate(heappop(finishing)[2]):
                delta[r] += h
        e = p.elastic
        if e >= 0:
            free_units = int(cums[e][ptr] + delta[e] + _EPS)
            units = max(p.min_units, min(p.max_units, free_units))
            held = _holding(p, units)
        else:
            units = 1
            held = need
        for r in uses:  # an elastic action's resource is in ``uses`` (it needs min_units >= 1)
            delta[r] -= held[r]
        finish = t + p.times[units]
        total += finish - now
        if total >= limit:
            return math.inf
        heappush(finishing, (finish, tie, held))
    return total


def decide(
    queue: Sequence[Pending],
    free: Sequence[float],
    running: Sequence[Running] = (),
    now: float = 0.0,
    *,
    window: int = 16,
    max_evictions: int = 4,
    reserve: Sequence[float] | None = None,
) -> list[tuple[int, int]]:
    """Which queued actions start now, and on how many elastic units.

    Candidates are taken FCFS while they fit (a resource blocked by an earlier action is
    not overtaken), spare elastic units go where they lower the objective most (the cut in
    duration less the unit-seconds burnt, priced by ``_prices``; with a ``reserve``, the
    units beyond it are surplus nobody is expected to want and go first, unpriced, where
    they cut durations most), then the last candidate
    is evicted (its units redistributed) while that lowers the total completion time of
    the candidates plus the heap estimate of the queue behind them. Each eviction trial
    changes the plan incrementally: the spread continues from the current greedy state,
    the candidates' total and events are updated only where a duration changed, and the
    queue estimate stops as soon as the trial cannot win.

    Args:
        queue: queued actions, oldest first.
        free: free amount of each resource, aligned with ``Pending.fixed``.
        running: the running actions (their expected finish and what they hold).
        now: the current time (same clock as ``Running.finish_at``).
        window: how many of the actions left in the queue the completion-time heap
            estimates; later ones are affected alike by every choice and are ignored (an
            action past them still starts if it fits on resources no earlier action waits for).
        max_evictions: most candidates one decision evicts (each trial re-estimates the
            queue); the next decision, at the next release, may evict more.
        reserve: per resource, the units to keep for actions expected to arrive beyond
            ``queue`` (a forecast, e.g. ``ActionPolicy``'s). The spare units beyond it are
            surplus that burns no one's time; ``None``: no forecast, every unit is priced.

    Returns:
        ``[(queue index, units), ...]`` in queue order; ``units`` is 1 for a non-elastic action.
    """
    spare = list(free)
    blocked = [False] * len(spare)
    competing = [0] * len(spare)
    cand_idx: list[int] = []
    rest_idx: list[int] = []
    for i, p in enumerate(queue):
        if len(rest_idx) >= window:
            # the estimate's window is full, but an action on resources no earlier action waits
            # for still starts (a backlog on one resource must not idle the others)
            if all(blocked):
                break
            if p.single >= 0 and blocked[p.single]:  # the common case, skipped inline
                continue
            uses = p.uses
            if any(blocked[r] for r in uses) or not _fits(p.need, spare):
                for r in uses:
                    blocked[r] = True
                continue
            for r in uses:
                competing[r] += 1
                spare[r] -= p.need[r]
            cand_idx.append(i)
            continue
        r = p.single
        if r >= 0:  # one resource: the common case, checked inline
            competing[r] += 1
            if not blocked[r]:
                amount = p.need[r]
                if amount <= spare[r] + _EPS:
                    spare[r] -= amount
                    cand_idx.append(i)
                    continue
                blocked[r] = True
        else:
            uses = p.uses
            for r in uses:
                competing[r] += 1
            if not any(blocked[r] for r in uses) and _fits(p.need, spare):
                need = p.need
                for r in uses:
                    spare[r] -= need[r]
                cand_idx.append(i)
                continue
            for r in uses:
                blocked[r] = True
        rest_idx.append(i)
    if not cand_idx:
        return []
    prices = _prices(free, running, competing)
    cands = [queue[i] for i in cand_idx]
    units = [p.min_units for p in cands]
    gains = [
        (_gain(p, p.min_units, prices[p.elastic]), k)
        for k, p in enumerate(cands)
        if p.elastic >= 0 and p.min_units < p.max_units
    ]
    if reserve is not None:
        surplus = [max(s - kept, 0.0) for s, kept in zip(spare, reserve, strict=True)]
        surplus_gains = [(_gain(cands[k], units[k], 0.0), k) for _, k in gains]
        heapq.heapify(surplus_gains)
        for k in _spread(cands, units, surplus, surplus_gains, len(cands), [0.0] * len(spare)):
            spare[cands[k].elastic] -= 1
        gains = [
            (_gain(cands[k], units[k], prices[cands[k].elastic]), k)
            for _, k in gains
            if units[k] < cands[k].max_units
        ]
    heapq.heapify(gains)
    _spread(cands, units, spare, gains, len(cands), prices)
    rest = [queue[i] for i in rest_idx]
    floor = max(1, len(cands) - max_evictions)  # evict down to this many candidates at most
    if len(cands) <= floor:
        return list(zip(cand_idx, units, strict=True))
    rows = {r for p in rest for r in p.uses}  # the timeline rows the queue estimate reads
    running_events = sorted(running, key=_finish)
    cand_events = [(now + p.times[m], _holding(p, m)) for p, m in zip(cands, units, strict=True)]
    cand_cost = sum(p.times[m] for p, m in zip(cands, units, strict=True))
    best = cand_cost + _queue_estimate(rest, *_timeline(running_events + cand_events, spare, rows), now)
    while len(cands) > floor:
        last = len(cands) - 1
        evicted = cands[last]
        trial_units = units[:last]
        trial_spare = list(spare)
        for r, h in enumerate(cand_events[last][1]):
            trial_spare[r] += h
        trial_gains = list(gains)
        grew = _spread(cands, trial_units, trial_spare, trial_gains, last, prices)
        trial_events = cand_events[:last]
        trial_cost = cand_cost - evicted.times[units[last]]
        for k in set(grew):
            p, m = cands[k], trial_units[k]
            trial_cost += p.times[m] - p.times[units[k]]
            trial_events[k] = (now + p.times[m], _holding(p, m))
        rows.update(evicted.uses)
        at = bisect_left(rest_idx, cand_idx[last])
        trial_rest = [*rest[:at], evicted, *rest[at:]]
        limit = best - _EPS - trial_cost
        trial = trial_cost + _queue_estimate(
            trial_rest, *_timeline(running_events + trial_events, trial_spare, rows), now, limit
        )
        if trial >= best - _EPS:
            break
        rest_idx.insert(at, cand_idx.pop())
        cands.pop()
        rest, units, spare, gains, cand_events = (
            trial_rest,
            trial_units,
            trial_spare,
            trial_gains,
            trial_events,
        )
        cand_cost, best = trial_cost, trial
    return list(zip(cand_idx, units, strict=True))


@dataclass
class Grant:
    """Resources granted to one action until ``release``."""

    ticket: int
    request: ResourceRequest
    units: int
    allocation: dict[str, float]
    enqueued_at: float
    started_at: float
    expected_finish: float
    cores: frozenset[int] = frozenset()


class Policy(Protocol):
    """A clock-free admission policy: the asyncio fronts and the simulated cluster drive it."""

    capacity: Mapping[str, float]

    def submit(self, request: ResourceRequest, now: float) -> int: ...

    def cancel(self, ticket: int) -> bool: ...

    def dispatch(self, now: float) -> list[Grant]: ...

    def release(self, grant: Grant, now: float, *, ran: bool = True) -> None: ...

    def end_trajectory(self, trajectory_id: str, now: float) -> None: ...


class _DurationEstimates:
    """Running mean of the single-unit duration ``T_1`` observed per action kind."""

    def __init__(self, default: float, alpha: float = 0.2):
        if not (math.isfinite(default) and default >= 0):
            raise ValueError(f"scheduler default_duration must be finite and >= 0, got {default}")
        self.default = default
        self.alpha = alpha
        self._t1: dict[str, float] = {}

    def t1(self, request: ResourceRequest) -> float:
        if request.duration is not None:
            return request.duration
        return self._t1.get(request.kind, self.default)

    def observe(self, grant: Grant, now: float) -> None:
        request = grant.request
        # the T_1 that predicts this run, T(m) = T_1 / (E(m) m); the run scaled to one unit is
        # T(1) = T_1 / E(1), which overstates T_1 when E(1) < 1
        sample = (now - grant.started_at) / request.duration_on(grant.units, 1.0)
        old = self._t1.get(request.kind)
        self._t1[request.kind] = sample if old is None else (1 - self.alpha) * old + self.alpha * sample


def _check_capacity(capacity: Mapping[str, float]) -> dict[str, float]:
    if not capacity:
        raise ValueError("scheduler capacity must name at least one resource")
    for name, amount in capacity.items():
        if not (math.isfinite(amount) and amount >= 0):
            raise ValueError(f"scheduler capacity[{name!r}] must be finite and >= 0, got {amount}")
    return dict(capacity)


class ActionPolicy:
    """Per-action admission with elastic units and greedy eviction (ours).

    It forecasts each resource's base load: an exponential moving average, over
    ``forecast_window_s``, of the unit-seconds the arriving actions need at their minimum
    (what the pool stays busy with if no action gets extra units). The part of that load
    neither held at minimum by the running actions nor asked for by the queue is the
    ``reserve`` handed to ``decide``: free units beyond it are surplus an elastic action
    may take without delaying the arrivals the forecast expects.
    """

    def __init__(
        self,
        capacity: Mapping[str, float],
        *,
        window: int = 16,
        default_duration: float = 1.0,
        forecast_window_s: float = 20.0,
    ):
        if not forecast_window_s > 0:
            raise ValueError(f"ActionPolicy forecast_window_s must be > 0, got {forecast_window_s}")
        self.capacity = _check_capacity(capacity)
        self.names = tuple(self.capacity)
        self._index = {name: r for r, name in enumerate(self.names)}
        self.free = [float(self.capacity[n]) for n in self.names]
        self.window = window
        self.forecast_window_s = forecast_window_s
        self.estimates = _DurationEstimates(default_duration)
        self._queue: dict[int, tuple[ResourceRequest, Pending]] = {}
        self._running: dict[int, tuple[Grant, Running, list[float]]] = {}
        self._tickets = itertools.count()
        self.base_load = [0.0] * len(self.names)
        self._base_held = [0.0] * len(self.names)
        self._forecast_at = 0.0

    def _age_forecast(self, now: float) -> None:
        decay = math.exp(-max(now - self._forecast_at, 0.0) / self.forecast_window_s)
        self.base_load = [load * decay for load in self.base_load]
        self._forecast_at = max(now, self._forecast_at)

    def reserve(self, now: float) -> list[float]:
        """Units of each resource the forecast base load wants beyond what is held at minimum or queued."""
        self._age_forecast(now)
        queued = [0.0] * len(self.names)
        for _, pending in self._queue.values():
            for r in pending.uses:
                queued[r] += pending.need[r]
        return [
            max(load - held - q, 0.0)
            for load, held, q in zip(self.base_load, self._base_held, queued, strict=True)
        ]

    def _pending(self, request: ResourceRequest, now: float) -> Pending:
        fixed = [0.0] * len(self.names)
        for name, amount in request.demand.items():
            if name not in self._index:
                raise ValueError(f"ResourceRequest demands unknown resource {name!r}; known: {self.names}")
            fixed[self._index[name]] = float(amount)
        t1 = self.estimates.t1(request)
        if request.elastic is None:
            elastic, lo, hi, times = -1, 1, 1, [t1, t1]
        else:
            if request.elastic not in self._index:
                raise ValueError(
                    f"ResourceRequest elastic resource {request.elastic!r} unknown; known: {self.names}"
                )
            elastic = self._index[request.elastic]
            lo = request.min_units
            hi = min(request.max_units, int(self.capacity[request.elastic] - fixed[elastic]))
            times = [0.0] + [request.duration_on(m, t1) for m in range(1, hi + 1)]
        pending = Pending(fixed, elastic, lo, hi, times, now)
        if hi < lo or not _fits(_holding(pending, lo), [float(self.capacity[n]) for n in self.names]):
            elastic_part = "" if request.elastic is None else f" and {request.min_units}+ {request.elastic!r}"
            raise ValueError(
                f"ResourceRequest {dict(request.demand)}{elastic_part} can never fit capacity {self.capacity}"
            )
        return pending

    def submit(self, request: ResourceRequest, now: float) -> int:
        """Queue an action; returns its ticket."""
        pending = self._pending(request, now)
        ticket = next(self._tickets)
        self._queue[ticket] = (request, pending)
        self._age_forecast(now)
        self._forecast(pending, 1.0)
        return ticket

    def _forecast(self, pending: Pending, weight: float) -> None:
        """Add ``weight`` times the action's unit-seconds at minimum, per forecast window, to the base load."""
        at_minimum = pending.times[pending.min_units] / self.forecast_window_s
        for r in pending.uses:
            self.base_load[r] = max(self.base_load[r] + weight * pending.need[r] * at_minimum, 0.0)

    def cancel(self, ticket: int) -> bool:
        """Drop a queued action and its share of the forecast base load (it will never run);
        False if it is not queued (already granted or unknown)."""
        entry = self._queue.pop(ticket, None)
        if entry is None:
            return False
        pending = entry[1]
        # the share added at its submit has decayed with the forecast since
        self._forecast(
            pending, -math.exp(-max(self._forecast_at - pending.enqueued_at, 0.0) / self.forecast_window_s)
        )
        return True

    def dispatch(self, now: float) -> list[Grant]:
        """Start whatever ``decide`` picks; returns the new grants."""
        if not self._queue:
            return []
        tickets = list(self._queue)
        pendings = [self._queue[t][1] for t in tickets]
        running = [r for _, r, _ in self._running.values()]
        reserve = self.reserve(now)
        grants = []
        for i, units in decide(pendings, self.free, running, now, window=self.window, reserve=reserve):
            ticket = tickets[i]
            request, pending = self._queue.pop(ticket)
            holds = _holding(pending, units)
            for r, h in enumerate(holds):
                self.free[r] -= h
            allocation = {self.names[r]: h for r, h in enumerate(holds) if h > 0}
            finish = now + pending.times[units]
            grant = Grant(ticket, request, units, allocation, pending.enqueued_at, now, finish)
            self._running[ticket] = (grant, Running(finish, holds), pending.need)
            for r in pending.uses:
                self._base_held[r] += pending.need[r]
            grants.append(grant)
        return grants

    def release(self, grant: Grant, now: float, *, ran: bool = True) -> None:
        """Give back a grant's resources; ``ran=False``: its action never ran, so how long the
        grant was held is no sample of its duration."""
        entry = self._running.pop(grant.ticket, None)
        if entry is None:
            raise ValueError(f"grant {grant.ticket} is not running (released twice?)")
        _, running, at_minimum = entry
        for r, h in enumerate(running.holds):
            self.free[r] += h
        for r, h in enumerate(at_minimum):
            self._base_held[r] -= h
        if ran:
            self.estimates.observe(grant, now)

    def end_trajectory(self, trajectory_id: str, now: float) -> None:
        """Nothing is held per trajectory."""

    @property
    def queued(self) -> int:
        return len(self._queue)


class StaticPolicy:
    """Baseline: each key (a trajectory, or a service) reserves a fixed vector for its whole life.

    The first action of a key waits FCFS until the reservation fits; later actions of the
    key run inside the reservation (FIFO among themselves), an elastic one on as many
    reserved units as it can use. ``end_trajectory`` returns the reservation.
    """

    def __init__(
        self,
        capacity: Mapping[str, float],
        reservation: Mapping[str, float],
        *,
        key: Callable[[ResourceRequest], str] = lambda request: request.trajectory_id,
        default_duration: float = 1.0,
    ):
        self.capacity = _check_capacity(capacity)
        for name, amount in reservation.items():
            if name not in self.capacity:
                raise ValueError(f"StaticPolicy reservation names unknown resource {name!r}")
            if not 0 <= amount <= self.capacity[name]:
                raise ValueError(f"StaticPolicy reservation[{name!r}]={amount} is outside [0, capacity]")
        self.reservation = dict(reservation)
        self.free = dict(self.capacity)
        self.key = key
        self.estimates = _DurationEstimates(default_duration)
        self._tickets = itertools.count()
        self._waiting_keys: deque[str] = deque()
        self._queues: dict[str, deque[tuple[int, ResourceRequest, float]]] = {}
        self._reserved: dict[str, dict[str, float]] = {}
        self._running: dict[int, tuple[str, dict[str, float]]] = {}

    def submit(self, request: ResourceRequest, now: float) -> int:
        """Queue an action under its key; returns its ticket."""
        need = dict(request.demand)
        if request.elastic is not None:
            need[request.elastic] = request.min_units
        for name, amount in need.items():
            if amount > self.reservation.get(name, 0) + _EPS:
                raise ValueError(
                    f"ResourceRequest needs {amount} {name!r}, more than the static reservation {self.reservation}"
                )
        k = self.key(request)
        if not k:
            raise ValueError("StaticPolicy: ResourceRequest has an empty key (set trajectory_id)")
        ticket = next(self._tickets)
        if k not in self._queues:
            self._queues[k] = deque()
            if k not in self._reserved:
                self._waiting_keys.append(k)
        self._queues[k].append((ticket, request, now))
        return ticket

    def cancel(self, ticket: int) -> bool:
        """Drop a queued action; False if it is not queued. A key left with nothing queued
        and no reservation leaves the admission line (it would take a reservation with nothing
        to run); a key that holds one keeps it until ``end_trajectory``."""
        for k, q in self._queues.items():
            for item in q:
                if item[0] == ticket:
                    q.remove(item)
                    if not q and k not in self._reserved:
                        del self._queues[k]
                        self._waiting_keys.remove(k)
                    return True
        return False

    def dispatch(self, now: float) -> list[Grant]:
        """Admit waiting keys FCFS while reservations fit, then start actions inside reservations."""
        while self._waiting_keys:
            k = self._waiting_keys[0]
            if not all(self.free[n] + _EPS >= a for n, a in self.reservation.items()):
                break
            self._waiting_keys.popleft()
            for n, a in self.reservation.items():
                self.free[n] -= a
            self._reserved[k] = dict(self.reservation)
        grants = []
        for k, left in self._reserved.items():
            q = self._queues.get(k)
            while q:
                ticket, request, enqueued = q[0]
                # a zero demand may name a resource the reservation leaves out (submit lets it in)
                need = {n: a for n, a in request.demand.items() if a > 0}
                units = 1
                if request.elastic is not None:
                    units = min(request.max_units, int(left.get(request.elastic, 0) + _EPS))
                    if units < request.min_units:
                        break
                    need[request.elastic] = units
                if not all(left.get(n, 0) + _EPS >= a for n, a in need.items()):
                    break
                q.popleft()
                for n, a in need.items():
                    left[n] -= a
                self._running[ticket] = (k, need)
                duration = request.duration_on(units, self.estimates.t1(request))
                grants.append(Grant(ticket, request, units, need, enqueued, now, now + duration))
        return grants

    def release(self, grant: Grant, now: float, *, ran: bool = True) -> None:
        """Return an action's share to its key's reservation (not to the pool); ``ran`` as in
        ``ActionPolicy.release``."""
        entry = self._running.pop(grant.ticket, None)
        if entry is None:
            raise ValueError(f"grant {grant.ticket} is not running (released twice?)")
        k, need = entry
        for n, a in need.items():
            self._reserved[k][n] += a
        if ran:
            self.estimates.observe(grant, now)

    def end_trajectory(self, trajectory_id: str, now: float) -> None:
        """Return the trajectory's reservation to the pool once its actions are done."""
        if any(k == trajectory_id for k, _ in self._running.values()):
            raise ValueError(f"trajectory {trajectory_id!r} still has a running action")
        if self._queues.get(trajectory_id):
            raise ValueError(f"trajectory {trajectory_id!r} still has a queued action")
        self._queues.pop(trajectory_id, None)
        if trajectory_id in self._waiting_keys:
            self._waiting_keys.remove(trajectory_id)
        held = self._reserved.pop(trajectory_id, None)
        if held is not None:
            for n, a in self.reservation.items():
                self.free[n] += a


class _AsyncFront:
    """asyncio face of a policy: ``await acquire(request)``, ``release(grant)``, ``async with run(...)``."""

    def __init__(self, policy: Policy, cpu: CpuManager | None = None, cpu_resource: str = "cpu"):
        if cpu is not None and policy.capacity.get(cpu_resource) != len(cpu.pool):
            raise ValueError(
                f"capacity[{cpu_resource!r}]={policy.capacity.get(cpu_resource)} must equal the CPU pool size {len(cpu.pool)}"
            )
        self.policy = policy
        self.cpu = cpu
        self.cpu_resource = cpu_resource
        self._waiters: dict[int, asyncio.Future[Grant]] = {}

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    def _dispatch(self) -> None:
        given_back = True
        while given_back:  # what a cancelled waiter gives back goes to the next in line
            given_back = False
            for grant in self.policy.dispatch(self._now()):
                if self.cpu is not None and grant.allocation.get(self.cpu_resource):
                    grant.cores = self.cpu.allocate(int(grant.allocation[self.cpu_resource]))
                waiter = self._waiters.pop(grant.ticket)
                if waiter.done():
                    self._give_back(grant, ran=False)
                    given_back = True
                else:
                    waiter.set_result(grant)

    def _give_back(self, grant: Grant, *, ran: bool = True) -> None:
        if grant.cores and self.cpu is not None:
            self.cpu.free(grant.cores)
            grant.cores = frozenset()
        self.policy.release(grant, self._now(), ran=ran)

    async def acquire(self, request: ResourceRequest) -> Grant:
        """Wait until the action is granted its resources."""
        cores = request.demand.get(self.cpu_resource)
        if self.cpu is not None and cores is not None and cores != int(cores):
            raise ValueError(
                f"an action asks for {cores} {self.cpu_resource!r}: the CPU manager grants whole cores"
            )
        ticket = self.policy.submit(request, self._now())
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = waiter
        self._dispatch()
        try:
            return await waiter
        except asyncio.CancelledError:
            if self.policy.cancel(ticket):
                self._waiters.pop(ticket, None)
                self._dispatch()  # it may have held up smaller requests queued behind it
            elif waiter.done() and not waiter.cancelled():
                self.release(waiter.result(), ran=False)
            raise

    def release(self, grant: Grant, *, ran: bool = True) -> None:
        """Give the grant's resources back and start whatever can run now; ``ran=False`` for a
        grant handed back unused (its hold is no duration sample of its kind of action)."""
        self._give_back(grant, ran=ran)
        self._dispatch()

    def end_trajectory(self, trajectory_id: str) -> None:
        """The trajectory is finished (frees its reservation in static mode)."""
        self.policy.end_trajectory(trajectory_id, self._now())
        self._dispatch()

    @asynccontextmanager
    async def run(self, request: ResourceRequest, pid: int | None = None) -> AsyncIterator[Grant]:
        """Hold a grant for the body; with ``pid`` (and a CPU manager) pin that process to the granted cores."""
        grant = await self.acquire(request)
        ran = False  # a body skipped (its bind failed) or cut short is no duration sample
        try:
            if pid is not None and self.cpu is not None and grant.cores:
                self.cpu.bind(pid, grant.cores)
            ran = True
            yield grant
        except asyncio.CancelledError:
            ran = False  # its hold understates the duration of its kind of action
            raise
        finally:
            try:
                if pid is not None and self.cpu is not None and grant.cores:
                    self.cpu.park(pid)
            finally:
                self.release(grant, ran=ran)


class ActionScheduler(_AsyncFront):
    """Per-action scheduling with elastic units and greedy eviction, for asyncio code."""

    def __init__(
        self,
        capacity: Mapping[str, float],
        *,
        cpu: CpuManager | None = None,
        window: int = 16,
        default_duration: float = 1.0,
        forecast_window_s: float = 20.0,
    ):
        policy = ActionPolicy(
            capacity, window=window, default_duration=default_duration, forecast_window_s=forecast_window_s
        )
        super().__init__(policy, cpu)


class StaticReservation(_AsyncFront):
    """Baseline with the same interface: a fixed reservation per trajectory for its whole life."""

    def __init__(
        self,
        capacity: Mapping[str, float],
        reservation: Mapping[str, float],
        *,
        cpu: CpuManager | None = None,
        default_duration: float = 1.0,
    ):
        super().__init__(StaticPolicy(capacity, reservation, default_duration=default_duration), cpu)

    async def admit(self, trajectory_id: str) -> None:
        """Wait until the trajectory holds its reservation (at once if it does already)."""
        grant = await self.acquire(ResourceRequest(kind="admission", trajectory_id=trajectory_id))
        self.release(grant, ran=False)
