"""A discrete-event simulated rollout/training pipeline driven by the real elastic controller.

``simulate_elastic`` runs a pipeline whose capacity units are split between rollout and
training either fixed or by ``rollout.elastic.ElasticController``. Nothing here
reimplements a decision: the controller is the same object the pipeline flow uses.

Two shapes of run. ``cycles=0``: one finite batch (a phase of long prompts, then one of
short ones) run until every trajectory is trained; measured by its makespan. ``cycles>0``:
the continuous pipeline: prompts keep coming, cycling through the two phases, and the run
lasts until ``cycles`` cycles' worth of trajectories are trained, so a straggler's tail
overlaps the next phase's work and only the rate counts.

Staleness is controlled as the real pipeline does it: the trainer publishes a weight
version every ``publish_every`` optimizer steps of ``batch_size`` trajectories, and drops
a trajectory whose first token is more than ``max_staleness`` versions older than the
trainer (``rl.config.SAOConfig``); the orchestrator stops launching while ``max_backlog``
or more trajectories wait for the trainer (``rollout.orchestrator``'s backpressure) and
keeps ``concurrency`` sessions launched, those without a session slot waiting in the
engine queue. ``max_ahead`` is the cruder admission bound of the finite stress case:
at most that many trajectories in flight or waiting for the trainer.

A session is a sequence of turns of ``turn_s`` seconds (a generation, then its tool step).
At a turn boundary a session on a draining replica moves, when the controller's
``migrate_at_turns`` is on, to the first accepting replica in the router's order with a free
slot; there its history (``prompt_tokens`` plus ``context_tokens_per_s`` per second of turns
so far) is prefilled at ``prefill_tokens_per_s``, and every session on that replica,
the migrant included, is held up for that long (the prefill takes the replica). While
sessions wait on draining replicas for their turn boundary, that many free slots are kept
for them rather than given to new sessions. A session is never moved mid-turn and never
loses work: it ends after its own turns plus the holdups.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from rollout.elastic import ElasticController, Move, PolicyInputs


class ElasticWorkload(BaseModel):
    """A rollout/training mix whose balance shifts: long stragglers, then a training burst."""

    units: int = Field(16, ge=2, description="Capacity units (engine replicas / GPU groups) in the cluster.")
    sessions_per_replica: int = Field(8, ge=1, description="Concurrent rollout sessions one replica serves.")
    long_sessions: int = Field(320, ge=0, description="Phase 1: long-horizon prompts (rollout-bound).")
    long_median_s: float = Field(900.0, gt=0, description="Median session length of phase-1 prompts.")
    long_sigma: float = Field(
        0.7, ge=0, description="Log-space spread of phase-1 session length (the stragglers)."
    )
    long_train_s: float = Field(40.0, gt=0, description="Unit-seconds to train one phase-1 trajectory.")
    short_sessions: int = Field(1600, ge=0, description="Phase 2: short prompts (training-bound burst).")
    short_median_s: float = Field(60.0, gt=0, description="Median session length of phase-2 prompts.")
    short_sigma: float = Field(0.5, ge=0, description="Log-space spread of phase-2 session length.")
    short_train_s: float = Field(20.0, gt=0, description="Unit-seconds to train one phase-2 trajectory.")
    cycles: int = Field(
        0,
        ge=0,
        description="0: one finite batch (phase 1 then phase 2) run to completion. N > 0: prompts keep "
        "coming, cycling through both phases, and the run lasts until N cycles' worth are trained.",
    )
    trajectories_per_shard: int = Field(4, ge=1, description="Trajectories committed together as one shard.")
    max_ahead: int | None = Field(
        64,
        ge=1,
        description="Admission bound: most trajectories in flight or waiting for the trainer "
        "(None: no such bound).",
    )
    batch_size: int = Field(64, ge=1, description="Trajectories per optimizer step of the trainer.")
    publish_every: int = Field(4, ge=1, description="Optimizer steps per published weight version.")
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Versions a trajectory's first token may lag the trainer before the trainer drops it "
        "(None: never dropped).",
    )
    max_backlog: int | None = Field(
        None,
        ge=1,
        description="Trajectories awaiting the trainer at which the orchestrator stops launching (None: never).",
    )
    concurrency: int | None = Field(
        None,
        ge=1,
        description="Sessions the orchestrator keeps launched; those beyond the free slots wait in the "
        "engine queue (None: as many as the admission bound allows).",
    )
    switch_s: float = Field(
        60.0, ge=0, description="Seconds a unit needs to change sides (load weights, rebuild state)."
    )
    tick_s: float = Field(30.0, gt=0, description="Seconds between controller decisions.")
    turn_s: float = Field(
        30.0,
        gt=0,
        description="Seconds of one turn of a session (a generation and its tool step); sessions migrate "
        "only between turns.",
    )
    prompt_tokens: int = Field(
        2000, ge=0, description="Tokens of a session's prompt (its context at turn 0)."
    )
    context_tokens_per_s: float = Field(
        100.0,
        ge=0,
        description="Tokens a session's context grows by per second of its turns (actions and observations).",
    )
    prefill_tokens_per_s: float = Field(
        10000.0,
        gt=0,
        description="Tokens a replica prefills per second; a migrated session's history is re-prefilled at "
        "this rate, holding up every session on the replica it moves to.",
    )
    seed: int = Field(0, description="Random seed.")


@dataclass(frozen=True)
class Sample:
    """The pipeline at one controller tick (the run's time series).

    Unit counts are by role; ``moving`` units changed sides and are still loading (a
    training unit still finishing its item before it changes sides is not yet moving).
    The ``idle_*`` figures are capacity in units' worth standing idle now: empty session
    slots on accepting replicas, split by why no session fills them (the staleness control,
    ``max_ahead`` or ``max_backlog``, or kept for migrating sessions; or no prompt left),
    empty slots on draining replicas (held by their last sessions), and training units with
    nothing to train. ``prompts_left`` is ``None`` in a continuous run.
    """

    time: float
    rollout_units: int
    draining_units: int
    train_units: int
    moving_units: int
    live_sessions: int
    backlog: int
    prompts_left: int | None
    idle_rollout_staleness: float
    idle_rollout_no_prompts: float
    idle_draining: float
    idle_training: float


IDLE_CAUSES = (
    "idle_rollout_staleness",
    "idle_rollout_no_prompts",
    "idle_draining",
    "idle_training",
    "moving_units",
)

UNIT_SECOND_CAUSES = ("rollout_sessions", "draining_sessions", "training", *IDLE_CAUSES)
"""Where every unit-second of a run goes: session slots filled on accepting and on draining
replicas (a session held up by a re-prefill fills its slot), training (a unit finishing its
item before it changes sides included), then the idle causes."""


@dataclass
class SessionRecord:
    """One rollout session: launched ``id``-th at ``started`` with ``turns_s`` seconds of turns;
    ``held_s``: seconds it was held up by re-prefills on its replica; ``unit``: where it runs
    now; ``ended``: when it ended (``None`` while live); ``dropped``: its trajectory was
    too stale to train."""

    id: int
    started: float
    turns_s: float
    train_s: float
    born: int
    unit: str
    held_s: float = 0.0
    ended: float | None = None
    epoch: int = 0
    dropped: bool = False

    @property
    def end(self) -> float:
        """When it ends: its turns plus its holdups."""
        return self.started + self.turns_s + self.held_s

    def next_boundary(self, now: float, turn_s: float) -> tuple[int, float] | None:
        """The first turn boundary after ``now`` (turns completed there, time), or ``None`` if it ends first."""
        done = now - self.started - self.held_s
        turn = math.floor(done / turn_s + 1e-9) + 1 if done >= 0 else 1
        if turn * turn_s >= self.turns_s - 1e-9:
            return None
        return turn, self.started + self.held_s + turn * turn_s


@dataclass(frozen=True)
class Migration:
    """Session ``session`` (launched ``session``-th, at ``started``) moved from draining ``source``
    to accepting ``target`` at ``time``, the boundary after its turn ``turn``, after ``held_s``
    seconds of earlier holdups; ``reprefill_s``: seconds its history took to prefill there
    (``held``: sessions on ``target`` held up for it, the migrant included)."""

    time: float
    session: int
    started: float
    turn: int
    held_s: float
    source: str
    target: str
    reprefill_s: float
    held: int


@dataclass
class ElasticRun:
    """What a simulated rollout/training run measured."""

    trained: int
    makespan: float
    moves: int
    interrupted_sessions: int
    dropped: int = 0
    log: list[dict] = field(default_factory=list)
    trace: list[Sample] = field(default_factory=list)
    migrations: list[Migration] = field(default_factory=list)
    sessions: list[SessionRecord] = field(default_factory=list)
    unit_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def reprefill_replica_s(self) -> float:
        """Replica-seconds spent re-prefilling migrated sessions."""
        return sum(m.reprefill_s for m in self.migrations)

    @property
    def reprefill_slot_s(self) -> float:
        """Session-seconds of holdup the re-prefills caused (each holds up every session on its replica)."""
        return sum(m.reprefill_s * m.held for m in self.migrations)

    @property
    def dropped_session_s(self) -> float:
        """Session-seconds (turns and holdups) of the sessions whose trajectories were dropped as stale."""
        return sum(s.turns_s + s.held_s for s in self.sessions if s.dropped)

    @property
    def throughput(self) -> float:
        """Trained trajectories per second, end to end (``makespan``: when the last counted one trained)."""
        return self.trained / self.makespan

    def idle_unit_seconds(self) -> dict[str, float]:
        """Unit-seconds of capacity left idle over the run, by cause (``IDLE_CAUSES``).

        Integrated between events (``unit_seconds``), not sampled at the ticks: a tick
        sample misses what changes between ticks (a 60 s move begun just after a tick is
        sampled once, 30 s).
        """
        return {cause: self.unit_seconds[cause] for cause in IDLE_CAUSES}


def _cycle(w: ElasticWorkload, rng: random.Random) -> list[tuple[float, float]]:
    longs = [
        (rng.lognormvariate(math.log(w.long_median_s), w.long_sigma), w.long_train_s)
        for _ in range(w.long_sessions)
    ]
    shorts = [
        (rng.lognormvariate(math.log(w.short_median_s), w.short_sigma), w.short_train_s)
        for _ in range(w.short_sessions)
    ]
    return longs + shorts


def prompt_stream(w: ElasticWorkload) -> Iterator[tuple[float, float]]:
    """Prompts in arrival order, ``(session seconds, training unit-seconds)`` each, cycle after cycle."""
    if w.long_sessions + w.short_sessions == 0:
        raise ValueError("the workload has no prompts: long_sessions + short_sessions is 0")
    rng = random.Random(w.seed)
    while True:
        yield from _cycle(w, rng)


def workload_prompts(w: ElasticWorkload, cycles: int = 1) -> list[tuple[float, float]]:
    """The first ``cycles`` cycles of ``prompt_stream`` (one cycle: the finite batch)."""
    return list(itertools.islice(prompt_stream(w), cycles * (w.long_sessions + w.short_sessions)))


def target_trained(w: ElasticWorkload) -> int:
    """Trajectories a run trains before it ends: the batch, or ``cycles`` cycles' worth."""
    return max(w.cycles, 1) * (w.long_sessions + w.short_sessions)


def pending_limit(w: ElasticWorkload) -> int:
    """Most trajectories launched but not trained at once, under any split.

    At least one unit trains, so at most ``(units - 1) * sessions_per_replica`` sessions are
    live; the backlog grows while launching is allowed (below ``max_backlog``) and then by
    at most the sessions live when it closed. ``max_ahead`` caps live and backlog together,
    not the trajectories the trainer has taken: at least one unit serves rollout, so at
    most ``units - 1`` more are in training. Without either bound the backlog is unbounded.
    """
    live = (w.units - 1) * w.sessions_per_replica
    limits = []
    if w.max_ahead is not None:
        limits.append(w.max_ahead + w.units - 1)
    if w.max_backlog is not None:
        limits.append(live + w.max_backlog + live)
    if not limits:
        raise ValueError("launched trajectories are unbounded: set max_ahead or max_backlog")
    return min(limits)


def makespan_lower_bound(w: ElasticWorkload) -> float:
    """A makespan no split of the units, fixed or elastic, can beat on this workload.

    The larger of two bounds. Sessions start in arrival order and at most
    ``min(max_ahead, (units - 1) * sessions_per_replica)`` run at once, so even with
    training free and instant each ends no earlier than on that many slots filled
    greedily; its trajectory then still trains. And all the work, a replica's worth per
    ``sessions_per_replica`` concurrent sessions plus the training, shares ``units`` units.
    A finite batch (``cycles=0``) whose trajectories are never dropped for staleness.
    """
    if w.cycles or w.max_staleness is not None:
        raise ValueError("makespan_lower_bound is for a finite batch without staleness drops")
    prompts = workload_prompts(w)
    slots = [0.0] * min(w.max_ahead or len(prompts), (w.units - 1) * w.sessions_per_replica)
    last_trained = 0.0
    for length, train_s in prompts:
        end = heapq.heappop(slots) + length
        heapq.heappush(slots, end)
        last_trained = max(last_trained, end + train_s)
    work = sum(length / w.sessions_per_replica + train_s for length, train_s in prompts)
    return max(last_trained, work / w.units)


def continuous_lower_bound(w: ElasticWorkload) -> float:
    """Seconds before which no split, fixed or elastic, trains ``target_trained(w)`` trajectories.

    Total work over capacity. Prompts start in arrival order, and at the moment the N-th
    trajectory is trained at most ``pending_limit(w)`` launched ones are not, so the N
    trained are N of the first ``N + pending_limit(w)`` prompts. Each costs its session
    over ``sessions_per_replica`` replica-seconds of rollout plus its training; the
    cheapest N of those, spread over all ``units`` units with no switch cost and no idle
    time, take this long. Holds for runs that drop nothing for staleness (a dropped
    trajectory still costs its rollout, and a run reports how many it dropped).
    """
    n = target_trained(w)
    prompts = itertools.islice(prompt_stream(w), n + pending_limit(w))
    costs = sorted(length / w.sessions_per_replica + train_s for length, train_s in prompts)
    return sum(costs[:n]) / w.units


def simulate_elastic(
    w: ElasticWorkload, rollout_units: int, controller: ElasticController | None = None
) -> ElasticRun:
    """Run the pipeline with ``rollout_units`` rollout replicas at start; elastic if ``controller``
    (over the workload's units ``u0``, ``u1``, ..., that many of them in rollout, with its
    ``sessions_per_replica``).

    Ends when ``target_trained(w)`` trajectories are trained (a finite batch: when all are
    trained or dropped). A fixed split never drains, so its sessions never migrate.
    """
    if not 1 <= rollout_units < w.units:
        raise ValueError(f"rollout_units must be in [1, {w.units - 1}], got {rollout_units}")
    if w.cycles and w.concurrency is None and w.max_ahead is None:
        raise ValueError("a continuous run (cycles > 0) needs concurrency or max_ahead to bound its launches")
    stream = prompt_stream(w)
    target = target_trained(w)
    finite = w.cycles == 0
    prompts = deque(itertools.islice(stream, target)) if finite else deque()
    per_version = w.batch_size * w.publish_every
    names = [f"u{i}" for i in range(w.units)]
    if controller is None:
        controller = ElasticController.create(names[:rollout_units], names[rollout_units:])
        elastic = False
    else:
        elastic = True
        if sorted(controller.units) != sorted(names):
            raise ValueError(
                f"the controller's units must be the workload's {names}, got {sorted(controller.units)}"
            )
        if len(controller.units_in("rollout")) != rollout_units:
            raise ValueError(
                f"the controller starts with {len(controller.units_in('rollout'))} rollout units, not {rollout_units}"
            )
        if controller.config.sessions_per_replica != w.sessions_per_replica:
            raise ValueError(
                f"the controller's sessions_per_replica ({controller.config.sessions_per_replica}) must be the "
                f"workload's ({w.sessions_per_replica})"
            )
    migrate = controller.config.migrate_at_turns
    role_ready: dict[str, float] = dict.fromkeys(names, 0.0)
    training: dict[str, bool] = dict.fromkeys(names, False)
    train_end: dict[str, float] = dict.fromkeys(names, 0.0)
    live_on: dict[str, dict[int, SessionRecord]] = {n: {} for n in names}
    sessions: list[SessionRecord] = []
    migrations: list[Migration] = []
    backlog: deque[SessionRecord] = deque()
    in_flight = 0
    trained = 0
    dropped = 0
    interrupted = 0
    events: list = []
    seq = itertools.count()
    heapq.heappush(events, (0.0, next(seq), "tick", None))
    log: list[dict] = []
    trace: list[Sample] = []
    recent_train_s: deque[float] = deque(maxlen=32)
    unit_seconds = dict.fromkeys(UNIT_SECOND_CAUSES, 0.0)
    now = 0.0

    def admissible() -> int:
        """Sessions the orchestrator would start now if slots were free."""
        room = len(prompts) if finite else math.inf
        if w.max_ahead is not None:
            room = min(room, w.max_ahead - in_flight - len(backlog))
        if w.max_backlog is not None and len(backlog) >= w.max_backlog:
            room = 0
        if w.concurrency is not None:
            room = min(room, w.concurrency - in_flight)
        return int(max(0, room))

    def next_prompt() -> tuple[float, float]:
        return prompts.popleft() if finite else next(stream)

    def free_slot(t: float) -> str | None:
        """The first accepting, ready replica in the router's order with a free session slot."""
        for name in controller.routable():
            if role_ready[name] <= t and len(live_on[name]) < w.sessions_per_replica:
                return name
        return None

    def start_work(t: float) -> None:
        nonlocal in_flight, dropped
        version = trained // per_version
        for name in controller.units_in("train"):
            while not training[name] and role_ready[name] <= t and backlog:
                done = backlog.popleft()
                if w.max_staleness is not None and version - done.born > w.max_staleness:
                    dropped += 1
                    done.dropped = True
                    continue
                training[name] = True
                train_end[name] = t + done.train_s
                heapq.heappush(events, (t + done.train_s, next(seq), "trained", (name, done.train_s)))
        free = free_slots(t) - waiting_to_migrate()
        for name in controller.routable():
            while (
                free > 0
                and role_ready[name] <= t
                and len(live_on[name]) < w.sessions_per_replica
                and admissible()
            ):
                free -= 1
                length, train_s = next_prompt()
                controller.begin_session(name, t)
                session = SessionRecord(len(sessions), t, length, train_s, version, name)
                sessions.append(session)
                live_on[name][session.id] = session
                in_flight += 1
                heapq.heappush(events, (session.end, next(seq), "session", (session, session.end)))

    def hand_over(move: Move | None, t: float) -> None:
        """A drained replica goes to training after the switch time."""
        if move is not None:
            role_ready[move.unit] = t + w.switch_s
            heapq.heappush(events, (role_ready[move.unit], next(seq), "ready", move.unit))

    def schedule_turn(session: SessionRecord, t: float) -> None:
        boundary = session.next_boundary(t, w.turn_s)
        if boundary is not None:
            heapq.heappush(events, (boundary[1], next(seq), "turn", (session, session.epoch, boundary[0])))

    def migrate_at_boundary(session: SessionRecord, turn: int, t: float) -> None:
        """Move ``session`` off its draining replica to a free slot, or wait for its next turn."""
        source = session.unit
        dest = free_slot(t)
        if dest is None:
            schedule_turn(session, t)
            return
        tokens = w.prompt_tokens + w.context_tokens_per_s * turn * w.turn_s
        cost = tokens / w.prefill_tokens_per_s
        migrations.append(
            Migration(
                time=t,
                session=session.id,
                started=session.started,
                turn=turn,
                held_s=session.held_s,
                source=source,
                target=dest,
                reprefill_s=cost,
                held=1 + len(live_on[dest]),
            )
        )
        del live_on[source][session.id]
        session.unit = dest
        session.epoch += 1
        live_on[dest][session.id] = session
        for held in live_on[dest].values():
            held.held_s += cost
            heapq.heappush(events, (held.end, next(seq), "session", (held, held.end)))
        hand_over(controller.migrate_session(source, dest, t, session.started), t)

    def free_slots(t: float) -> int:
        """Free session slots on the accepting, ready replicas."""
        return sum(
            w.sessions_per_replica - len(live_on[n]) for n in controller.routable() if role_ready[n] <= t
        )

    def waiting_to_migrate() -> int:
        """Sessions on draining replicas that will move at their next turn boundary."""
        if not migrate:
            return 0
        return sum(len(live_on[n]) for n in controller.units_in("draining"))

    def _engine_queue_depth(t: float) -> int:
        """Sessions the orchestrator admits now but no rollout slot can take."""
        return max(0, admissible() - max(free_slots(t) - waiting_to_migrate(), 0))

    def _occupancy(t: float) -> dict[str, float]:
        """Units' worth of capacity in each of ``UNIT_SECOND_CAUSES`` now (they sum to ``w.units``)."""
        slots = w.sessions_per_replica
        use = dict.fromkeys(UNIT_SECOND_CAUSES, 0.0)
        empty_cause = "idle_rollout_staleness" if prompts or not finite else "idle_rollout_no_prompts"
        for unit in controller.units.values():
            name, role = unit.name, unit.role
            if training[name]:
                use["training"] += 1  # also a unit finishing its item before it changes sides
            elif role_ready[name] > t:
                use["moving_units"] += 1
            elif role == "train":
                use["idle_training"] += 1
            else:
                busy = len(live_on[name]) / slots
                use["draining_sessions" if role == "draining" else "rollout_sessions"] += busy
                use["idle_draining" if role == "draining" else empty_cause] += 1 - busy
        return use

    def _sample(t: float) -> Sample:
        use = _occupancy(t)
        return Sample(
            time=t,
            rollout_units=len(controller.units_in("rollout")),
            draining_units=len(controller.units_in("draining")),
            train_units=len(controller.units_in("train")),
            moving_units=round(use["moving_units"]),
            live_sessions=in_flight,
            backlog=len(backlog),
            prompts_left=len(prompts) if finite else None,
            idle_rollout_staleness=use["idle_rollout_staleness"],
            idle_rollout_no_prompts=use["idle_rollout_no_prompts"],
            idle_draining=use["idle_draining"],
            idle_training=use["idle_training"],
        )

    while trained + (dropped if finite else 0) < target:
        previous = now
        now, _, kind, payload = heapq.heappop(events)
        if now > previous:
            # the state is constant between events: integrate it exactly, not at the ticks
            for cause, units in _occupancy(previous).items():
                unit_seconds[cause] += units * (now - previous)
        if kind == "session":
            session, end = payload
            if session.ended is not None or end != session.end:
                continue  # held up since: a later event ends it
            name = session.unit
            if controller.units[name].role == "train":
                interrupted += 1
            session.ended = now
            del live_on[name][session.id]
            in_flight -= 1
            backlog.append(session)
            hand_over(controller.end_session(name, now, session.started), now)
        elif kind == "turn":
            session, epoch, turn = payload
            if session.ended is not None or epoch != session.epoch:
                continue
            if controller.units[session.unit].role == "draining":
                migrate_at_boundary(session, turn, now)
        elif kind == "trained":
            name, train_s = payload
            training[name] = False
            trained += 1
            recent_train_s.append(train_s)
        elif kind == "tick":
            trace.append(_sample(now))
            train_units = controller.units_in("train")
            idle = sum(1 for n in train_units if not training[n] and role_ready[n] <= now)
            if elastic:
                inputs = PolicyInputs(
                    unconsumed_shards=math.ceil(len(backlog) / w.trajectories_per_shard),
                    engine_queue_depth=_engine_queue_depth(now),
                    trainer_idle=idle / max(len(train_units), 1),
                    train_unit_s_per_trajectory=sum(recent_train_s) / len(recent_train_s)
                    if recent_train_s
                    else None,
                    unconsumed_trajectories=len(backlog),
                )
                for move in controller.step(inputs, now):
                    if "draining" not in (move.source, move.target):
                        # a training unit hands over at its step boundary: after its current item
                        role_ready[move.unit] = max(now, train_end[move.unit]) + w.switch_s
                        heapq.heappush(events, (role_ready[move.unit], next(seq), "ready", move.unit))
                    elif move.target == "draining" and migrate:
                        for session in live_on[move.unit].values():
                            session.epoch += 1
                            schedule_turn(session, now)
                    log.append(controller.log_record())
            heapq.heappush(events, (now + w.tick_s, next(seq), "tick", None))
        start_work(now)
    return ElasticRun(
        trained,
        now,
        controller.moves_made,
        interrupted,
        dropped,
        log,
        trace,
        migrations,
        sessions,
        unit_seconds,
    )
