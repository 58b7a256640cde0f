"""Sticky routing of rollout sessions over engine replicas.

Every turn of one session goes to the same replica, so that replica's prefix cache holds
the conversation and a turn prefills only its new tokens (GLM-5's DP-aware routing).
Three policies:

- ``sticky`` (default): consistent hashing of the session id over a ring of virtual nodes,
  with bounded loads (Mirrokni et al., 2018): a new session goes to the first replica
  clockwise from its hash whose load is below ``ceil((1 + ε) · average)``; once assigned
  it stays there.
- ``least_loaded``: the accepting replica with the fewest active sessions (the first in
  service order on a tie), sticky once assigned (ProRL Agent's backend balancing).
- ``round_robin``: every request goes to the next replica; no stickiness (the baseline).

A replica that fails a health check is taken out; its sessions are assigned afresh on
their next turn and that turn is prefilled in full on the new replica (the gateway holds
every token, so nothing is lost). So is one that passes its probe but fails the requests of
several sessions in a row (a wedged engine), for a quarantine that doubles each time it is
taken out again before it serves a request.

A replica can be set draining (:meth:`Router.drain`): no new session goes to it, and with
``migrate_on_drain`` each session pinned to it moves at its next turn boundary — its next
:meth:`Router.route` call with none of its requests in flight — to an accepting replica
(the policy's normal pick), which re-prefills the session's tokens; a generation in flight
finishes where it started, untouched. The draining replica empties in about one turn
instead of waiting for its longest session to end, and can then be handed elsewhere
(``rollout.elastic``). :meth:`Router.undrain` puts it back.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.engines.base import Engine, EngineError, Generation, NotServing, SamplingParams

logger = logging.getLogger(__name__)

Policy = Literal["sticky", "least_loaded", "round_robin"]

SESSION_LENGTHS_KEPT = 256
"""Lengths of the most recently ended sessions a router keeps (the elastic controller's
session-length model reads them from the worker's status)."""


class RouterConfig(BaseModel):
    """How sessions are spread over engine replicas."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    policy: Policy = Field("sticky", description="sticky (consistent hashing), least_loaded or round_robin.")
    virtual_nodes: int = Field(160, ge=1, description="Points each replica takes on the hash ring.")
    load_epsilon: float = Field(
        0.25, gt=0, description="Bounded-load slack ε: a replica takes at most ceil((1+ε)·average) sessions."
    )
    failover: bool = Field(
        True,
        description="On an engine error, probe the replica; if it is down, take it out and retry the "
        "request once on the session's new replica.",
    )
    migrate_on_drain: bool = Field(
        True,
        description="A session pinned to a draining replica moves to an accepting one at its next turn "
        "(re-prefilling its tokens there); off: it stays until it ends.",
    )
    migration_slots: int | None = Field(
        None,
        ge=1,
        description="Sessions an accepting replica may hold for a migrating session to move onto it; a "
        "session with no such replica stays on its draining one (None: no limit).",
    )
    health_check_s: float | None = Field(
        10.0,
        gt=0,
        description="Seconds between health probes of every replica by its rollout worker: a dead one "
        "leaves service before a request finds it, one that recovered comes back (None: only a failed "
        "request takes a replica out, and nothing brings it back).",
    )
    health_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a health probe may take; a replica whose probe hangs (a stuck actor) counts "
        "as down, and the other replicas' probes are not held up.",
    )
    failing_sessions: int | None = Field(
        3,
        ge=1,
        description="With failover, a replica whose probe answers up is taken out once the requests of "
        "this many sessions failed on it with an engine error, one after another with no request served "
        "between (a wedged engine: vLLM answering 500 to every generation while /health says OK). A "
        "failure counts only if neither its session nor its prompt failed on the replica since it last "
        "served: what a prompt makes fail fails wherever it goes, and a GRPO group's sessions all start "
        "on one prompt, at once; a request refused as invalid (too long, say) never counts (None: a "
        "replica whose probe answers up stays in service whatever its requests do).",
    )
    quarantine_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a replica taken out for failing sessions' requests stays out before a health "
        "check may bring it back (it passes its probe, so it would be back at once); doubled each time "
        "it is taken out again before it serves a request, up to quarantine_max_s.",
    )
    quarantine_max_s: float = Field(
        600.0, gt=0, description="The longest quarantine of a replica taken out for failing requests."
    )

    @model_validator(mode="after")
    def _quarantine_limit(self) -> RouterConfig:
        if self.quarantine_max_s < self.quarantine_s:
            raise ValueError(
                f"router.quarantine_max_s={self.quarantine_max_s} is below quarantine_s={self.quarantine_s}"
            )
        return self


class NoReplicas(EngineError):
    """No healthy engine replica is left to serve a request."""


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring of replica names, each placed at ``virtual_nodes`` points."""

    def __init__(self, names: Iterable[str] = (), virtual_nodes: int = 160):
        self.virtual_nodes = virtual_nodes
        self._points: list[int] = []
        self._owners: list[str] = []
        for name in names:
            self.add(name)

    def add(self, name: str) -> None:
        """Place ``name`` on the ring (its points depend only on its name)."""
        if name in self._owners:
            raise ValueError(f"replica {name!r} is already on the ring")
        for i in range(self.virtual_nodes):
            point = _hash(f"{name}#{i}")
            at = bisect.bisect(self._points, point)
            self._points.insert(at, point)
            self._owners.insert(at, name)

    def remove(self, name: str) -> None:
        """Take ``name`` off the ring."""
        if name not in self._owners:
            raise KeyError(f"replica {name!r} is not on the ring")
        keep = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != name]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    @property
    def names(self) -> list[str]:
        return sorted(set(self._owners))

    def walk(self, key: str) -> list[str]:
        """Distinct replicas in ring order starting at ``key``'s hash (the first is its owner)."""
        if not self._points:
            return []
        start = bisect.bisect(self._points, _hash(key)) % len(self._points)
        distinct = len(set(self._owners))
        seen: dict[str, None] = {}
        for i in range(len(self._points)):
            seen.setdefault(self._owners[(start + i) % len(self._points)])
            if len(seen) == distinct:
                break
        return list(seen)

    def owner(self, key: str) -> str:
        """The replica that owns ``key`` when loads are ignored."""
        walk = self.walk(key)
        if not walk:
            raise NoReplicas("the hash ring is empty")
        return walk[0]


def check_end(session_id: str, continued_in: str | None, expired: bool, idle_s: float) -> None:
    """Raise ``ValueError`` unless :meth:`Router.end_session` takes these arguments."""
    if continued_in == session_id:
        raise ValueError(f"session {session_id!r} cannot continue in itself")
    if expired and continued_in is not None:
        raise ValueError(
            f"session {session_id!r} expired: it continues in no session ({continued_in!r} given)"
        )
    if not (math.isfinite(idle_s) and idle_s >= 0):
        raise ValueError(f"idle_s={idle_s} is not a finite number of seconds >= 0")


class Router:
    """Assigns sessions to engine replicas and forwards their generation requests.

    ``load`` of a replica is the number of sessions assigned to it that have not ended (under
    ``round_robin``, its requests generating); call :meth:`end_session` when a rollout
    finishes. ``migrations`` counts sessions moved off draining replicas; ``sessions_ended``
    counts ended sessions and ``session_lengths``
    holds the last ``SESSION_LENGTHS_KEPT`` of their lengths (seconds from first routing to
    end; not tracked under ``round_robin``, which pins nothing). A compacted rollout's
    contexts are sessions one after another, each ended as its branch opens
    (``end_session``'s ``continued_in``): for these counts, and ``session_ages``, they are
    one session, from the first context's routing to the last one's end, because the
    rollout's trajectories, one per context, go to the trainer only once it ends (the
    elastic controller's forecast reads them so); ``session_contexts`` holds the contexts of
    each session in ``session_lengths`` (1 for one never compacted). ``sessions_expired``
    counts the sessions (rollouts, as above) ended for idling, their client gone: released
    like the others, but no ended rollout, as none of them reaches the trainer (one whose
    client got its record before it idled out is an ended rollout, its idle time left out);
    those the gateway ends count even if never routed (``end_session``'s ``known``), but
    under ``round_robin``, which tracks no session, none counts.
    """

    def __init__(self, engines: Iterable[Engine], config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self._engines: dict[str, Engine] = {}
        self._down: dict[str, Engine] = {}
        self._ring = HashRing(virtual_nodes=self.config.virtual_nodes)
        self._assigned: dict[str, str] = {}
        self._load: Counter[str] = Counter()
        self._rr = 0
        self._draining: set[str] = set()
        self._in_flight: Counter[str] = Counter()
        self._requests: Counter[str] = Counter()
        """Per replica, the requests generating on it (``round_robin``'s load: it pins nothing)."""
        self.migrations = 0
        self._started: dict[str, float] = {}
        self.sessions_ended = 0
        self.sessions_expired = 0
        self.session_lengths: deque[float] = deque(maxlen=SESSION_LENGTHS_KEPT)
        self.session_contexts: deque[int] = deque(maxlen=SESSION_LENGTHS_KEPT)
        self._contexts_before: Counter[str] = Counter()
        self._failing: dict[str, tuple[set[str], set[int]]] = {}
        """Per replica in service, the sessions whose requests failed on it since it last served one
        and the hashes of their prompts (see ``_fails_too_often``)."""
        self._last_quarantine_s: dict[str, float] = {}
        """Per replica taken out for failing requests since it last served one, its last quarantine."""
        self._out_until: dict[str, float] = {}
        """Per replica down in quarantine, the ``time.monotonic()`` before which it stays out."""
        self._unrestored: dict[str, str] = {}
        """Per replica down that answers its probe, why its last restore failed (warned of once)."""
        for engine in engines:
            self.add(engine)

    @property
    def replicas(self) -> list[str]:
        """Names of the replicas in service."""
        return list(self._engines)

    def engine(self, name: str) -> Engine:
        return self._engines[name]

    def load(self, name: str) -> int:
        """Sessions currently assigned (pinned) to replica ``name``; under ``round_robin``, which
        pins nothing, the requests generating on it. A draining one is empty at 0."""
        if self.config.policy == "round_robin":
            return self._requests[name]
        return self._load[name]

    @property
    def down(self) -> list[str]:
        """Names of the replicas out of service until a health check finds them healthy again (past
        their quarantine, for one taken out for failing requests), sorted."""
        return sorted(self._down)

    @property
    def draining(self) -> list[str]:
        """Names of the draining replicas (in service or down), sorted."""
        return sorted(self._draining)

    def drain(self, name: str) -> None:
        """Route no new session to replica ``name``; with ``migrate_on_drain`` its sessions move
        off at their next turn. A generation in flight on it is not touched."""
        if name not in self._engines and name not in self._down:
            raise KeyError(f"replica {name!r} is not known; known: {sorted([*self._engines, *self._down])}")
        self._draining.add(name)

    def undrain(self, name: str) -> None:
        """Let replica ``name`` take new sessions again (sessions that moved off stay where they are)."""
        if name not in self._draining:
            raise KeyError(f"replica {name!r} is not draining; draining: {self.draining}")
        self._draining.discard(name)

    def assignment(self, session_id: str) -> str | None:
        """The replica ``session_id`` is pinned to, if any."""
        return self._assigned.get(session_id)

    def add(self, engine: Engine) -> None:
        """Put a replica in service; sessions already assigned stay where they are. One in
        quarantine is refused until its quarantine has passed."""
        if engine.name in self._engines:
            raise ValueError(f"replica {engine.name!r} is already in service")
        left_s = self._quarantine_left_s(engine.name)
        if left_s > 0:
            raise ValueError(
                f"replica {engine.name!r} is in quarantine for {left_s:.0f} s more: it failed the requests "
                "of several sessions though its probe answered up"
            )
        self._down.pop(engine.name, None)
        self._out_until.pop(engine.name, None)
        self._unrestored.pop(engine.name, None)
        self._engines[engine.name] = engine
        self._ring.add(engine.name)

    def remove(self, name: str) -> Engine:
        """Take a replica out of service; its sessions are reassigned on their next turn."""
        if name not in self._engines:
            raise KeyError(f"replica {name!r} is not in service")
        engine = self._engines.pop(name)
        self._failing.pop(name, None)
        self._draining.discard(name)
        self._ring.remove(name)
        for session_id in [s for s, r in self._assigned.items() if r == name]:
            del self._assigned[session_id]
        self._load.pop(name, None)
        return engine

    def route(self, session_id: str) -> Engine:
        """The replica that serves ``session_id``'s next request (assigning it if new).

        A session pinned to a draining replica, with no request in flight, moves here to an
        accepting replica when ``migrate_on_drain`` is on and one has room.
        """
        if not self._engines:
            raise NoReplicas("no engine replica is in service")
        accepting = [n for n in self._engines if n not in self._draining]
        if self.config.policy == "round_robin":
            if not accepting:
                raise NoReplicas(f"every replica in service is draining: {self.draining}")
            name = accepting[self._rr % len(accepting)]
            self._rr += 1
            return self._engines[name]
        name = self._assigned.get(session_id)
        if name is None:
            if not accepting:
                raise NoReplicas(f"every replica in service is draining: {self.draining}")
            self._pin(session_id, self._pick(session_id, accepting))
            self._started.setdefault(session_id, time.monotonic())
        elif name in self._draining and self.config.migrate_on_drain and not self._in_flight[session_id]:
            self._migrate(session_id, name, accepting)
        return self._engines[self._assigned[session_id]]

    def _pick(self, session_id: str, accepting: list[str]) -> str:
        if self.config.policy == "sticky":
            return self._pick_sticky(session_id, accepting)
        return min(accepting, key=lambda name: self._load[name])

    def _pin(self, session_id: str, name: str) -> None:
        self._assigned[session_id] = name
        self._load[name] += 1

    def _migrate(self, session_id: str, source: str, accepting: list[str]) -> None:
        """Re-pin ``session_id`` from draining ``source`` to the normal pick among the accepting
        replicas with room; it stays on ``source`` when none has."""
        limit = self.config.migration_slots
        room = [n for n in accepting if limit is None or self._load[n] < limit]
        if not room:
            return
        target = self._pick(session_id, room)
        self._release(session_id)
        self._pin(session_id, target)
        self.migrations += 1

    def _pick_sticky(self, session_id: str, candidates: list[str]) -> str:
        total = sum(self._load[n] for n in candidates) + 1
        capacity = math.ceil((1 + self.config.load_epsilon) * total / len(candidates))
        walk = [n for n in self._ring.walk(session_id) if n in candidates]
        for name in walk:
            if self._load[name] < capacity:
                return name
        return walk[0]

    def end_session(
        self,
        session_id: str,
        continued_in: str | None = None,
        expired: bool = False,
        idle_s: float = 0.0,
        known: bool = False,
    ) -> None:
        """Release ``session_id``'s assignment and let its replica drop its cache (under
        ``round_robin``, which pins nothing, every replica in service: any may hold one).

        ``continued_in``: the session its rollout goes on in (the branch a compacted context
        continues in). The replica is released all the same, so a draining one empties at
        this context boundary, but the rollout has not ended: ``continued_in`` takes over its
        start and its contexts, and the rollout counts in ``sessions_ended``,
        ``session_lengths`` and ``session_contexts`` when that one ends.

        ``expired``: the session was ended for idling, its client gone (a harness that
        crashed). Its replica is released all the same, but no record of its rollout reaches
        the trainer, so it counts in ``sessions_expired`` only: the elastic controller
        forecasts the trajectories live sessions will bring from ``session_lengths``.

        ``idle_s``: seconds the session sat unused before this end (one ended for idling whose
        client got its record, then never ended it), left out of its length: the rollout
        ended with its last request, and the idle timeout would lengthen the forecast's.

        ``known``: the caller knows the session was open until now and ends it once (the
        gateway does): expired, it counts in ``sessions_expired`` even if it was never routed
        (its client gone before its first turn), except under ``round_robin``, which counts no
        session. Otherwise a session the router never routed, or that ended already, counts
        nowhere.
        """
        check_end(session_id, continued_in, expired, idle_s)
        if self.config.policy == "round_robin":
            for engine in self._engines.values():
                engine.end_session(session_id)
        self._release(session_id)
        started = self._started.pop(session_id, None)
        if started is None:
            if expired and known and self.config.policy != "round_robin":
                self.sessions_expired += 1
            return
        contexts = self._contexts_before.pop(session_id, 0) + 1
        if expired:
            self.sessions_expired += 1
        elif continued_in is not None:
            self._started[continued_in] = started
            self._contexts_before[continued_in] = contexts
        else:
            self.sessions_ended += 1
            self.session_lengths.append(max(0.0, time.monotonic() - started - idle_s))
            self.session_contexts.append(contexts)

    def session_ages(self) -> dict[str, list[float]]:
        """Seconds since each live session was first routed, by the replica it is pinned to
        (every replica in service, an empty list when none is)."""
        now = time.monotonic()
        ages: dict[str, list[float]] = {name: [] for name in self._engines}
        for session_id, name in self._assigned.items():
            if name in ages:
                ages[name].append(now - self._started[session_id])
        return ages

    def _release(self, session_id: str) -> None:
        name = self._assigned.pop(session_id, None)
        if name is None:
            return
        self._load[name] -= 1
        if name in self._engines:
            self._engines[name].end_session(session_id)

    async def generate(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Generate on ``session_id``'s replica; with ``failover``, a replica found down (or
        :class:`NotServing`) is taken out and the request is retried once on the session's new
        replica (not when the session ended meanwhile: the error is raised, and the session
        stays unpinned). One found up fails the request, unless this session's is the
        ``failing_sessions``-th whose requests failed on it in a row, on distinct prompts: it is
        taken out for its quarantine and the request retried so (as is one taken out while this
        request failed).

        A generation the replica aborted is an :class:`EngineError` like a failed one: a vLLM
        server shutting down or paused mid-request ends it with ``abort``, an action cut short
        by the infrastructure rather than by the policy's stop token or budget."""
        engine = self.route(session_id)
        self._in_flight[session_id] += 1
        try:
            return await self._served_by(engine, session_id, prompt_ids, params)
        except EngineError as exc:
            if not self.config.failover:
                raise
            # one that is up but not serving (NotServing) goes out as if down: the health
            # check's restore loads its weights before it is back
            if isinstance(exc, NotServing) or not await probe_health(engine, self.config.health_timeout_s):
                logger.warning(
                    "replica %s failed (%s); taking it out and retrying elsewhere", engine.name, exc
                )
                self.take_down(engine.name)
            # up: retried only if it is out now, taken out by this failure or another request's
            elif engine.name in self._engines and not self._fails_too_often(
                engine.name, session_id, prompt_ids
            ):
                raise
            if self.config.policy != "round_robin" and session_id not in self._started:
                raise  # end_session ran during the probe: routing again would pin it for good
            retry = self.route(session_id)
            return await self._served_by(retry, session_id, prompt_ids, params)
        finally:
            self._in_flight[session_id] -= 1
            if not self._in_flight[session_id]:
                del self._in_flight[session_id]

    async def _served_by(
        self, engine: Engine, session_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> Generation:
        self._requests[engine.name] += 1
        try:
            generation = await _finished(engine, session_id, prompt_ids, params)
        finally:
            self._requests[engine.name] -= 1
            if not self._requests[engine.name]:
                del self._requests[engine.name]
        self._served(engine.name)
        return generation

    def _served(self, name: str) -> None:
        self._failing.pop(name, None)
        self._last_quarantine_s.pop(name, None)

    def _fails_too_often(self, name: str, session_id: str, prompt_ids: list[int]) -> bool:
        """Count ``session_id``'s failed request on replica ``name``, in service with its probe
        answering up; once ``failing_sessions`` sessions' requests failed in a row, take it
        out for its quarantine and answer True.

        A failure counts only when neither its session nor its exact prompt failed on ``name``
        since it last served: a prompt that makes vLLM answer 500 fails on every replica, and
        the sessions of a GRPO group send one prompt at once, so its failures are one piece of
        evidence against the replica, not one per session. Only the full prompt is compared: a
        shared prefix (a system prompt) would make every failure of a wedged replica look alike.
        """
        limit = self.config.failing_sessions
        if limit is None:  # nothing to count: a replica that never serves would grow its sets for ever
            return False
        sessions, prompts = self._failing.setdefault(name, (set(), set()))
        prompt = hash(tuple(prompt_ids))
        if session_id in sessions or prompt in prompts:
            return False
        sessions.add(session_id)
        prompts.add(prompt)
        if len(sessions) < limit:
            return False
        last = self._last_quarantine_s.get(name)
        quarantine_s = (
            self.config.quarantine_s if last is None else min(2 * last, self.config.quarantine_max_s)
        )
        self._last_quarantine_s[name] = quarantine_s
        logger.warning(
            "replica %s failed the requests of %d sessions in a row though its probe answers up; taking it "
            "out for %.0f s and retrying elsewhere",
            name,
            len(sessions),
            quarantine_s,
        )
        self.take_down(name)
        self._out_until[name] = time.monotonic() + quarantine_s
        return True

    async def check_health(
        self, restore: Callable[[Engine], Awaitable[None]] | None = None
    ) -> dict[str, bool]:
        """Probe every replica: take out those that fail, bring back those that recovered (one
        in quarantine once its quarantine has passed).

        A replica that was down may have restarted on other weights than it last loaded (a
        relaunched vLLM server serves its launch weights), so ``restore`` is awaited on a
        recovered replica before it goes back in service; one it fails on stays out.
        """
        names = [*self._engines, *self._down]
        engines = [self._engines.get(n) or self._down[n] for n in names]
        timeout = self.config.health_timeout_s
        results = await asyncio.gather(*(probe_health(e, timeout) for e in engines))
        for name, engine, ok in zip(names, engines, results, strict=True):
            if not ok and name in self._engines:
                logger.warning("replica %s failed its health check; taking it out", name)
                self.take_down(name)
            elif ok and name in self._down and self._quarantine_left_s(name) <= 0:
                if restore is not None:
                    try:
                        await restore(engine)
                    except Exception as exc:  # the next check tries again
                        # warned of once per error, not at every check while it lasts
                        if self._unrestored.get(name) != str(exc):
                            logger.warning(
                                "replica %s is healthy again but could not be restored (tried again at every "
                                "health check, warned of again if the error changes): %s",
                                name,
                                exc,
                            )
                        self._unrestored[name] = str(exc)
                        continue
                # a concurrent check may have put it back meanwhile, and a request into quarantine
                if name in self._down and self._quarantine_left_s(name) <= 0:
                    logger.info("replica %s is healthy again; putting it back", name)
                    self.add(engine)
                    self._keep_one_accepting(f"replica {name} is back")
        return dict(zip(names, results, strict=True))

    def _quarantine_left_s(self, name: str) -> float:
        return self._out_until.get(name, 0.0) - time.monotonic()

    def take_down(self, name: str) -> None:
        """Out of service until :meth:`check_health` finds it healthy again (and its ``restore``
        succeeds): a replica that failed, or one not ready to serve (it could not load its
        worker's weight version at start). A draining replica stays draining when it is back,
        unless no replica in service accepts then (the one that did is down too).

        A failure must not leave new sessions nowhere to go: when the replica that went down
        was the last one accepting, the least loaded draining replica accepts again (the
        elastic plan never drains a worker's last accepting replica either).
        """
        if name not in self._engines:
            return
        draining = name in self._draining
        self._down[name] = self.remove(name)
        if draining:
            self._draining.add(name)
        self._keep_one_accepting(f"replica {name} went down")

    def _keep_one_accepting(self, why: str) -> None:
        """When every replica in service is draining, the least loaded one accepts again."""
        draining = [n for n in self._engines if n in self._draining]
        if draining and len(draining) == len(self._engines):
            reopened = min(draining, key=self.load)
            self.undrain(reopened)
            logger.warning(
                "%s and every replica in service is draining: %s takes new sessions again", why, reopened
            )


async def _finished(
    engine: Engine, session_id: str, prompt_ids: list[int], params: SamplingParams
) -> Generation:
    generation = await engine.generate(session_id, prompt_ids, params)
    if generation.finish_reason == "abort":
        raise EngineError(
            f"replica {engine.name} aborted the generation after {len(generation.token_ids)} tokens"
        )
    return generation


async def probe_health(engine: Engine, timeout_s: float) -> bool:
    """Whether ``engine`` answers its health check as up within ``timeout_s``; a probe that
    hangs or raises counts as down."""
    try:
        return bool(await asyncio.wait_for(engine.health(), timeout_s))
    except TimeoutError:
        logger.warning("replica %s did not answer its health probe within %.0f s", engine.name, timeout_s)
        return False
    except Exception:  # a probe that raises means the replica is down, whatever the error
        return False
