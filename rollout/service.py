"""Rollout as a service: three pipelined worker pools (INIT, RUN, EVAL) per ProRL Agent.

``process(request)`` takes one task through the whole lifecycle:

- INIT creates the environment (and its sandbox) and resets it to the task;
- RUN is the multi-turn loop between the environment and the gateway session; an env
  that drives itself (``drives_itself = True``, e.g. ``agent``) is handed its session on
  the service's own HTTP gateway (:class:`~rollout.gateway_http.GatewayServer` on
  127.0.0.1, started once per service) and RUN awaits ``env.run()`` while its program
  calls the OpenAI endpoints, each call recorded token-exactly in the rollout's session (one
  that sends no seed samples with the rollout's, hashed with the session's length);
- EVAL scores the episode: the env's ``evaluate()``, or the reward model its config names
  (``rollout.reward_models``).

Each stage has its own concurrency limit, so a slow test suite in EVAL never blocks
agents in RUN. Inside the stages, every tool call and test run the environment declares
(``Env.action_request`` / ``Env.eval_request``; for a self-driving env, what its program
does between two model calls), and every reward-model call (one unit of
the ``reward`` resource, ``ServiceConfig.reward_slots``; the model loaded on the device
for the call), is granted its resources per action by
the scheduler chosen in ``ServiceConfig.scheduler`` (``rollout.scheduler``: ``action`` for
ARL-Tangram's per-action scheduler, ``static`` for the per-trajectory reservation baseline),
with the sandbox's persistent process pinned to the granted cores while the action runs.
Time spent waiting for a stage's slot or for a scheduler grant is queue time: it is reported
in the timing breakdown and does not count toward the rollout's timeout.

Failures are classified into the canonical ``status``: an engine that died, a sandbox
that failed to start, an environment's host that died (``EnvHostLost``) or a reward model
that failed to score the episode (``RewardModelError``) is ``infra_error`` (never scored,
never trained on); a sandbox that stopped the agent's command, or an environment that
raised (a ``CancelledError`` of its own included: only a cancel of the rollout cancels it),
whose output the gateway rejects (a malformed message, a token outside the vocabulary) or
whose reward or progress the record cannot hold (not a number, not finite, no reward,
progress outside [0, 1]), or whose program's conversation its reward model cannot read (text
prompts or token ids: :func:`program_chat`), is ``env_error``; running out of the time budget is ``timeout``
(a stage whose env call returns past it included: one that blocked the event loop, or went
on when cancelled; and one that, cancelled at it, raised an error of its own instead);
running out of turns or context is ``truncated``. The record's ``error`` says why (``None``
for ``ok``, and for a truncation at ``max_turns`` or the token budget, which the status and
the record's turns and tokens say): the reason the warning of an ``env_error``
or ``infra_error`` gives, credentials masked and cut to ``storage.schema.MAX_ERROR_CHARS``.

An env's calls run on the service's event loop, so one that blocks inside its async code
(``time.sleep``, a blocking subprocess call, heavy work not moved to a thread) holds every
other rollout, the gateway and the worker's heartbeats. Each stretch an env's ``reset``,
``step``, ``evaluate``, ``run`` or ``close`` runs without yielding is timed (two clock reads
per resumption); the first stretch past ``ServiceConfig.loop_block_warn_s`` of each env
class and call is logged as a warning naming them, and every one is counted in ``status()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import numbers
import os
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from envs.agent import GatewaySession
from envs.base import Env, EnvHostLost, ResourceRequest, Task
from envs.sandbox import SandboxError
from rollout.config import ServiceConfig
from rollout.engines.base import ContextLimit, EngineError, SamplingParams, mixed_seed
from rollout.gateway import Gateway, Session
from rollout.gateway_http import GatewayServer, RunSampling
from rollout.resources import CpuManager
from rollout.reward_models import REWARD_RESOURCE, RewardModelError, RewardModels
from rollout.scheduler import ActionScheduler, StaticReservation
from storage.redaction import redact
from storage.schema import EXCLUDED_STATUSES, error_text

log = logging.getLogger(__name__)

STAGES = ("init", "run", "eval")

ENV_CLOSE_TIMEOUT_S = 60.0
"""Longest wait for an env's ``close`` in a rollout's cleanup: a hung one is logged and left, so
the gateway session still closes and a cancel waiting for the cleanup is not held forever."""

T = TypeVar("T")


@dataclass
class RolloutRequest:
    """One task to roll out; ids left out are generated."""

    task: Task
    execution_id: str | None = None
    trajectory_id: str | None = None
    group_id: str | None = None
    seed: int | None = None
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class RolloutResult:
    """What a rollout produced: the canonical record plus a summary. A rollout whose context
    was compacted (``ServiceConfig.compact_at``) holds one record per context: ``branches``
    are those it left, oldest first, and ``record`` the last; all have its status, reward and
    progress, and only ``record`` its timing."""

    rollout_id: str
    record: dict[str, Any]
    status: str
    reward: float | None
    progress: float | None
    timing: dict[str, float]
    turns: int
    error: str | None = None
    branches: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every record of the rollout, ``record`` last."""
        return [*self.branches, self.record]

    def summary(self) -> dict[str, Any]:
        """The result without the per-token columns (for logs and HTTP status)."""
        return {
            "rollout_id": self.rollout_id,
            "trajectory_id": self.record["trajectory_id"],
            "task": self.record["task"],
            "prompt_id": self.record["prompt_id"],
            "status": self.status,
            "reward": self.reward,
            "progress": self.progress,
            "timing": self.timing,
            "turns": self.turns,
            "num_tokens": len(self.record["tokens"]),
            "num_branches": len(self.branches),
            "error": self.error,
        }


class _Clock:
    """Active (non-queue) time of one rollout against its budget."""

    def __init__(self, budget: float):
        self.budget = budget
        self.timing = {"init": 0.0, "run": 0.0, "eval": 0.0, "queue": 0.0}
        self.resource_wait = 0.0
        self.deadline: asyncio.Timeout | None = None  # the running stage's

    def remaining(self) -> float:
        return self.budget - (self.timing["init"] + self.timing["run"] + self.timing["eval"])

    def pause(self) -> Callable[[], None]:
        """A wait for a scheduler grant (cancelled or not) begins; the function returned ends it
        (call it once). The wait is queue time: it is booked as such, and the running stage's
        deadline stands still meanwhile. A rollout waits for one grant at a time (its actions
        run one after another, a program's gate has at most one acquire in flight and is closed
        when RUN ends)."""
        deadline = self.deadline
        loop = asyncio.get_running_loop()
        left = None
        if deadline is not None and not deadline.expired() and deadline.when() is not None:
            left = deadline.when() - loop.time()
            deadline.reschedule(None)
        asked = time.perf_counter()

        def resume() -> None:
            self.resource_wait += time.perf_counter() - asked
            if left is not None and self.deadline is deadline and not deadline.expired():
                deadline.reschedule(loop.time() + left)

        return resume

    @contextlib.contextmanager
    def waiting_for_grant(self) -> Iterator[None]:
        """The body is a wait for a scheduler grant (see ``pause``)."""
        resume = self.pause()
        try:
            yield
        finally:
            resume()


class RolloutTimeout(Exception):
    """The rollout used up its active-time budget."""


class DuplicateRollout(ValueError):
    """A rollout with this id is already in flight."""


class InvalidScore(ValueError):
    """An env scored a reward or reported a progress that the record cannot hold (an env error)."""


def checked_reward(reward: object, env: str) -> float:
    """The reward ``env`` scored, as a float: a finite real number; anything else raises
    :class:`InvalidScore` (None included: the trainer would take an episode scored ``ok``
    without a reward as a failure, reward 0)."""
    if reward is None:
        raise InvalidScore(f"{env} scored no reward: its evaluate returned None")
    if not isinstance(reward, numbers.Real):
        raise InvalidScore(
            f"{env} scored a reward of type {type(reward).__name__} ({reward!r}), not a number"
        )
    if not math.isfinite(reward):
        raise InvalidScore(f"{env} scored a non-finite reward {float(reward)!r}")
    return float(reward)


def checked_progress(progress: object, env: str) -> float | None:
    """The progress ``env`` reported, as a float: a real number in [0, 1], or None (not
    reported); anything else raises :class:`InvalidScore`."""
    if progress is None:
        return None
    if not isinstance(progress, numbers.Real):
        raise InvalidScore(
            f"{env} reported progress of type {type(progress).__name__} ({progress!r}), not a number"
        )
    if not 0.0 <= progress <= 1.0:  # NaN included
        raise InvalidScore(f"{env} reported progress {float(progress)!r}, outside [0, 1]")
    return float(progress)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn ``turn`` of a rollout seeded ``seed``: a 64-bit hash of both.

    Not ``seed + turn``: rollouts take consecutive seeds (``OrchestratorConfig.seed``), so rollout
    n's turn t + 1 sampled with rollout n + 1's seed of turn t, and one seed draws the same random
    numbers whatever the context: the two turns' tokens were largely the same draws (9 first
    tokens in 10 alike on the tiny model, none with unrelated seeds).
    """
    return mixed_seed(seed, turn)


class _Stretches:
    """Awaits ``work``, driving it step by step (as a task would), and calls ``stretch`` with
    the seconds of each step: a stretch it ran without yielding to the event loop."""

    def __init__(self, work: Awaitable[Any], stretch: Callable[[float], None]):
        self.work = work
        self.stretch = stretch

    def __await__(self):
        steps = self.work.__await__()
        resume, value = steps.send, None
        while True:
            started = time.perf_counter()
            try:
                yielded = resume(value)
            except StopIteration as returned:
                self.stretch(time.perf_counter() - started)
                return returned.value
            except BaseException:
                self.stretch(time.perf_counter() - started)
                raise
            self.stretch(time.perf_counter() - started)
            try:
                value = yield yielded
                resume = steps.send
            except GeneratorExit:
                steps.close()
                raise
            except BaseException as exc:  # a cancel, thrown in by the task: into ``work``
                value, resume = exc, steps.throw


def _declared(env: Env, method: str, *args: Any) -> ResourceRequest | None:
    """What the env declares an action needs; an env proxy running elsewhere (a Ray actor) declares nothing."""
    declare = getattr(env, method, None)
    return declare(*args) if declare is not None else None


def program_chat(session: Session, scorer: str) -> list[dict[str, Any]]:
    """The conversation a self-driving program held through ``session``, for reward model
    ``scorer`` to read; ``ValueError`` when some of its tokens are no chat message's (text
    prompts, token ids): the messages would hold the replies without what they answered."""
    unplaced = len(session.tokens) - session.message_tokens
    if unplaced:
        raise ValueError(
            f"reward model {scorer!r} reads the rollout's chat messages, but {unplaced} of its "
            f"{len(session.tokens)} tokens are in none (the program sent text prompts or token ids); "
            "have the program call /v1/chat/completions only, or score the env with its own evaluate()"
        )
    return session.messages


def _out_of_turns(session: Session) -> bool:
    """Whether ``session`` has generated its ``max_turns``: a self-driving program's call past
    them is refused as out of context (``Session.context_limit``), though it is out of turns."""
    return session.max_turns is not None and session.num_turns >= session.max_turns


def _raise_engine_error(session: Session) -> None:
    """Raise the engine failure of ``session``'s last turn, if it failed."""
    if session.engine_error is not None:
        raise EngineError(f"the program's last model call failed: {session.engine_error}")


@contextlib.contextmanager
def _logged(what: str, rollout_id: str, secrets: Sequence[str | None]) -> Iterator[None]:
    """Log what the body raises instead of raising it (``secrets`` and credentials masked, as in
    a record's error), a ``CancelledError`` of its own included (an env's close that awaited a
    future cancelled under it): only a cancel of the task is raised."""
    try:
        yield
    except Exception as exc:
        log.warning("%s of rollout %s failed: %s", what, rollout_id, redact(str(exc), secrets))
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        log.warning("%s of rollout %s failed: CancelledError, not from a cancel", what, rollout_id)


def make_scheduler(config: ServiceConfig) -> ActionScheduler | StaticReservation | None:
    """The per-action resource scheduler ``config`` asks for (``None`` for ``scheduler='none'``)."""
    if config.scheduler == "none":
        return None
    usable = sorted(os.sched_getaffinity(0))
    cores = config.scheduler_cores or len(usable)
    cpu = None
    if config.scheduler_pin:
        if cores > len(usable):
            raise ValueError(
                f"ServiceConfig.scheduler_cores={cores} but this process may use only {len(usable)} "
                "cores; lower it or set scheduler_pin=false"
            )
        cpu = CpuManager(usable[:cores])
    capacity = {"cpu": cores}
    if config.scheduler == "static":
        if config.scheduler_static_cores > cores:
            raise ValueError(
                f"ServiceConfig.scheduler_static_cores={config.scheduler_static_cores} exceeds "
                f"the {cores} scheduler cores"
            )
        return StaticReservation(capacity, {"cpu": config.scheduler_static_cores}, cpu=cpu)
    if config.reward_models:
        capacity[REWARD_RESOURCE] = config.reward_slots
    return ActionScheduler(capacity, cpu=cpu)


def make_reward_models(config: ServiceConfig) -> RewardModels | None:
    """The reward-model services of ``config`` (None when it names none). Under the 'action'
    scheduler they share the device budget; otherwise each stays resident (the baseline's
    model pinned on its own device memory)."""
    if not config.reward_models:
        return None
    budget = None
    if config.scheduler == "action" and config.reward_budget_mb is not None:
        budget = int(config.reward_budget_mb * 2**20)
    return RewardModels(config.reward_models, device=config.reward_device, budget_bytes=budget)


class _ProgramActions:
    """The action gate of a self-driving env: its program holds a grant of what the env
    declares per action while it acts (from its start, and from each model reply until its
    next model call; several calls in flight count as one wait), and is parked without one
    while it waits. At most one acquire is in flight: a reply that finds one waits for it and
    shares its grant. The wait is queue time only while the program has no model call out:
    one it sends meanwhile is RUN time (the grant goes back unused when it lands)."""

    def __init__(
        self, scheduler: ActionScheduler | StaticReservation, env: Env, rollout_id: str, clock: _Clock
    ):
        self.scheduler = scheduler
        self.env = env
        self.clock = clock
        needs = _declared(env, "action_request", "")
        self.needs = None if needs is None else dataclasses.replace(needs, trajectory_id=rollout_id)
        self.waits = 1  # the program has not started
        self.grant = None
        self.closed = False
        self._asking: asyncio.Task | None = None
        self._resume: Callable[[], None] | None = None  # ends the clock's pause of the wait

    async def acting(self) -> None:
        self.waits -= 1
        if self.waits or self.needs is None or self.closed:
            return
        if self._asking is None:
            self._asking = asyncio.create_task(self._ask())
        if self._resume is None:
            self._resume = self.clock.pause()
        # shielded: a caller that is cancelled does not cancel an acquire others may share
        await asyncio.shield(self._asking)

    async def _ask(self) -> None:
        """Acquire a grant and keep it if the program still acts; ends quietly when ``close`` cancels it."""
        try:
            grant = await self.scheduler.acquire(self.needs)
        except asyncio.CancelledError:
            return
        finally:
            self._asking = None
            self._end_wait()
        if self.closed or self.waits:  # the rollout ended, or the program called again meanwhile
            self.scheduler.release(grant, ran=False)
            return
        self.grant = grant
        self.env.cores = grant.cores or None
        pid = self.env.resource_pid()
        if pid is not None and self.scheduler.cpu is not None and grant.cores:
            try:
                self.scheduler.cpu.bind(pid, grant.cores)
            except BaseException:
                # the program is parked again and acts without the grant, which goes back unused
                self._give_back(ran=False)
                raise

    def waiting(self) -> None:
        self.waits += 1
        if self.waits == 1:
            self._end_wait()
            # a program stopped while it acts (its rollout cancelled or out of time) cut its
            # action short; an env may also report a wait from a callback, outside any task
            task = asyncio.current_task()
            self._give_back(ran=task is None or not task.cancelling())

    async def close(self) -> None:
        """The program is over: give back what it holds, drop the acquire in flight, refuse it more."""
        self.closed = True
        asking, self._asking = self._asking, None
        if asking is not None:
            asking.cancel()
            # wait, not await: an acquire cancelled before it ever ran raises CancelledError
            # when awaited, which would stop the rollout's cleanup
            await asyncio.wait([asking])
        self._end_wait()  # an acquire cancelled before it ever ran did not end it
        # a program's own end gives its grant back (``waiting``): one still held was cut short
        self._give_back(ran=False)

    def _end_wait(self) -> None:
        resume, self._resume = self._resume, None
        if resume is not None:
            resume()

    def _give_back(self, *, ran: bool = True) -> None:
        grant, self.grant = self.grant, None
        if grant is None:
            return
        try:
            pid = self.env.resource_pid()
            if pid is not None and self.scheduler.cpu is not None and grant.cores:
                self.scheduler.cpu.park(pid)
        finally:  # a park that fails must not keep the cores from the pool
            self.env.cores = None
            self.scheduler.release(grant, ran=ran)


class RolloutService:
    """Runs rollouts through INIT → RUN → EVAL pools against a gateway.

    Args:
        gateway: the TITO gateway that records every token.
        make_env: builds a fresh environment for a task (one instance per rollout).
        config: :class:`ServiceConfig`; a self-driving program's model call that leaves
            ``temperature`` or ``top_p`` unset samples at its ``temperature`` and ``top_p``,
            and every one generates at most its ``max_new_tokens`` (one that asks for more, or
            leaves its budget unset, gets that budget, as a driven env's action does).
        fixed_sampling: refuse (HTTP 400) a program's call that asks for another temperature or
            top_p: training rollouts, whose log-probs the trainer compares with its own at the
            run's; ``False`` (evaluation) lets the program choose.
        secrets: values masked wherever a rollout's error holds them, in its record and its
            warning, and in the warning of a cleanup step that fails (the run's storage
            credentials); the token of the service's HTTP gateway is masked too, and AWS key
            ids and echoed S3 credentials always are (``storage.schema.error_text``).
    """

    def __init__(
        self,
        gateway: Gateway,
        make_env: Callable[[Task], Env],
        config: ServiceConfig | None = None,
        *,
        fixed_sampling: bool = True,
        secrets: Iterable[str] = (),
    ):
        self.gateway = gateway
        self.make_env = make_env
        self.config = config or ServiceConfig()
        self.fixed_sampling = fixed_sampling
        self.secrets = list(secrets)
        self._slots = {
            "init": asyncio.Semaphore(self.config.init_workers),
            "run": asyncio.Semaphore(self.config.run_workers),
            "eval": asyncio.Semaphore(self.config.eval_workers),
        }
        self._waiting: Counter[str] = Counter()
        self._active: Counter[str] = Counter()
        self._inflight: dict[str, asyncio.Task] = {}
        self.finished: Counter[str] = Counter()
        self._gateway_server: GatewayServer | None = None
        self._gateway_server_lock = asyncio.Lock()
        self.scheduler = make_scheduler(self.config)
        self.rewards = make_reward_models(self.config)
        self._warned_compact_at = False
        self.loop_blocks: Counter[str] = Counter()
        """Stretches past ``loop_block_warn_s`` by ``<env>.<call>`` (its class's name)."""

    async def process(self, request: RolloutRequest) -> RolloutResult:
        """Roll out ``request`` to the end; raises ``asyncio.CancelledError`` if cancelled before
        its outcome is decided (a cancel that lands while its env closes waits for the close and
        the finished rollout is returned), and :class:`DuplicateRollout` if a rollout with its
        ``rollout_id`` is in flight (the id names the rollout to cancel)."""
        if request.rollout_id in self._inflight:
            raise DuplicateRollout(f"rollout {request.rollout_id!r} is already in flight")
        current = asyncio.current_task()
        if current is not None:
            self._inflight[request.rollout_id] = current
        try:
            result = await self._process(request)
        finally:
            self._inflight.pop(request.rollout_id, None)
        self.finished[result.status] += 1
        return result

    def cancel(self, rollout_id: str) -> bool:
        """Cancel an in-flight rollout; False when it is unknown or already done. One that is
        closing its env already has its outcome: it finishes with its result."""
        task = self._inflight.get(rollout_id)
        if task is None or task.done():
            return False
        task.cancel()
        return True

    async def gateway_server(self) -> GatewayServer:
        """The HTTP gateway that self-driving envs talk to (started on first use, 127.0.0.1).
        It serves no session administration: a program holding its token must use only the
        session it was handed (one it opened would generate past its rollout's budget and seed,
        and never reach the rollout's result)."""
        async with self._gateway_server_lock:
            if self._gateway_server is None:
                sampling = RunSampling(self.config.temperature, self.config.top_p, self.fixed_sampling)
                self._gateway_server = await GatewayServer(
                    self.gateway, sampling=sampling, session_admin=False
                ).start()
            return self._gateway_server

    async def close(self) -> None:
        """Stop the HTTP gateway, if one was started; in-flight rollouts are not touched."""
        if self._gateway_server is not None:
            await self._gateway_server.stop()
            self._gateway_server = None

    def status(self) -> dict[str, Any]:
        """Queue and pool occupancy per stage, and finished rollouts by status."""
        return {
            "in_flight": len(self._inflight),
            "waiting": {s: self._waiting[s] for s in STAGES},
            "active": {s: self._active[s] for s in STAGES},
            "finished": dict(self.finished),
            "loop_blocks": dict(self.loop_blocks),
        }

    def _masked(self) -> list[str | None]:
        """What a rollout's error or a cleanup's warning masks: ``secrets`` and the token of the
        HTTP gateway, which a self-driving env holds."""
        server = self._gateway_server
        return [*self.secrets, server.token if server is not None else None]

    async def _watched(self, env: Env, call: str, *args: Any) -> Any:
        """``env``'s ``call`` with ``args``, each stretch it holds the event loop timed."""
        what = f"{type(env).__name__}.{call}"

        def stretch(seconds: float) -> None:
            if seconds < self.config.loop_block_warn_s:
                return
            if not self.loop_blocks[what]:
                log.warning(
                    "env %s blocked the event loop for %.2f s without yielding (every rollout, the "
                    "gateway and the heartbeats waited): move blocking work to a thread "
                    "(asyncio.to_thread); later blocks of %s are counted in the service's status",
                    what,
                    seconds,
                    what,
                )
            self.loop_blocks[what] += 1

        try:
            return await _Stretches(getattr(env, call)(*args), stretch)
        except SystemExit as exc:  # one that escapes a task ends the event loop, every rollout with it
            raise RuntimeError(f"{what} called sys.exit({exc.code!r})") from None

    async def _stage(self, name: str, clock: _Clock, work):
        """Run ``work()`` in stage ``name``'s pool; queue time is kept out of the budget."""
        queued = time.perf_counter()
        self._waiting[name] += 1
        try:
            await self._slots[name].acquire()
        finally:
            self._waiting[name] -= 1
        clock.timing["queue"] += time.perf_counter() - queued
        self._active[name] += 1
        started = time.perf_counter()
        try:
            remaining = clock.remaining()
            if remaining <= 0:
                raise RolloutTimeout(f"no time left for {name}")
            past = f"{name} ran past the rollout's {clock.budget:g} s budget"
            try:
                async with asyncio.timeout(remaining) as clock.deadline:
                    result = await work()
            except Exception as exc:
                # past the deadline, what the work raised came of its cancel (a TimeoutError, or
                # an env's own error in its place); before it, a TimeoutError is the env's own
                if not clock.deadline.expired():
                    raise
                raise RolloutTimeout(past) from exc
            # work that held the event loop past the deadline, or went on when cancelled at it
            if time.perf_counter() - started - clock.resource_wait > remaining:
                raise RolloutTimeout(past)
            return result
        finally:
            clock.deadline = None
            # waiting for an action's resources is queue time, not stage time
            waited, clock.resource_wait = clock.resource_wait, 0.0
            clock.timing[name] += time.perf_counter() - started - waited
            clock.timing["queue"] += waited
            self._active[name] -= 1
            self._slots[name].release()

    async def _process(self, request: RolloutRequest) -> RolloutResult:
        task = request.task
        clock = _Clock(self.config.timeout_s)
        session = self.gateway.open(
            task=task.env,
            prompt_id=task.id,
            execution_id=request.execution_id,
            trajectory_id=request.trajectory_id,
            group_id=request.group_id,
        )
        env: Env | None = None
        actions: _ProgramActions | None = None
        state = {
            "reward": None,
            "progress": None,
            "done": False,
            "session": session,
            "left": [],
            "history": [],
        }
        status, error = "ok", None
        stage = "init"
        try:
            env = self.make_env(task)
            drives_itself = getattr(env, "drives_itself", False)
            if drives_itself:
                # its program's model calls are its turns: capped in number and length as a driven env's are
                session.max_turns = min(self.config.max_turns, env.config.max_turns)
                session.max_new_tokens = self.config.max_new_tokens
                session.seed = request.seed  # of its program's calls that send none
                server = await self.gateway_server()
                env.attach_gateway(GatewaySession(f"{server.url}/v1", server.token, session.session_id))
                attach_actions = getattr(env, "attach_actions", None)
                if self.scheduler is not None and attach_actions is not None:
                    actions = _ProgramActions(self.scheduler, env, request.rollout_id, clock)
                    attach_actions(actions)
            first = await self._stage("init", clock, lambda: self._watched(env, "reset", task))
            self._park(env)
            if not drives_itself:
                session.add_messages(first)
                state["history"] = list(first)
            stage = "run"
            run = self._drive if drives_itself else self._run
            await self._stage("run", clock, lambda: run(env, session, request, state, clock))
            if actions is not None:
                await actions.close()  # the program has ended: no wait of its gate runs into EVAL
                clock.resource_wait = 0.0  # a wait it dropped belongs to RUN, over by now
            stage = "eval"
            session = state["session"]
            scorer = getattr(getattr(env, "config", None), "reward_model", None)
            if scorer is not None:
                needs, evaluate = self._reward_call(
                    scorer, program_chat(session, scorer) if drives_itself else state["history"], clock
                )
            else:
                needs = _declared(env, "eval_request")
                evaluate = functools.partial(self._watched, env, "evaluate")
            if needs is not None and isinstance(self.scheduler, StaticReservation):
                # a rollout waits for its reservation before it takes an EVAL slot: the rollouts
                # holding reservations need those slots to finish and give theirs back
                queued = time.perf_counter()
                await self.scheduler.admit(request.rollout_id)
                clock.timing["queue"] += time.perf_counter() - queued
            reward = await self._stage("eval", clock, lambda: self._act(needs, env, request, clock, evaluate))
            state["reward"] = checked_reward(reward, task.env)
            if not state["done"] or session.turns and session.turns[-1].truncated:
                status = "truncated"
                if session.context_limit is not None and not _out_of_turns(session):
                    error = f"context limit: {session.context_limit}"
        except RolloutTimeout as exc:
            status, error = "timeout", str(exc)
        except EngineError as exc:
            status, error = "infra_error", f"engine failed: {exc}"
        except EnvHostLost as exc:
            status, error = "infra_error", f"environment host lost during {stage}: {exc}"
        except RewardModelError as exc:
            status, error = "infra_error", str(exc)
        except SandboxError as exc:
            # after init a sandbox's other failures may be the agent's commands' doing
            status = "infra_error" if stage == "init" or exc.kind == "start_failed" else "env_error"
            error = f"sandbox {exc.kind} during {stage}: {exc.reason}"
        except ContextLimit as exc:
            status, error = "truncated", f"context limit: {exc}"
        except InvalidScore as exc:
            status, error = "env_error", str(exc)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the rollout is cancelled
                await self._cleanup(env, state["session"], request, actions)
                raise
            # not the rollout's cancel: the env's own (it awaited a future cancelled under it)
            status, error = "env_error", f"CancelledError during {stage}, not from a cancel of the rollout"
        except Exception as exc:  # an environment's own bug must not take the worker down
            status, error = "env_error", f"{type(exc).__name__} during {stage}: {exc}"
        except BaseException:  # not an env's failure to classify, but its env and session still close
            await self._cleanup(env, state["session"], request, actions)
            raise
        if error is not None:
            error = error_text(error, self._masked())
        if status in EXCLUDED_STATUSES:
            # A logger per env: the flow run's logs take a few records of a logger a minute
            # (flows.run_logs), so an env failing every rollout does not keep the others'
            # failures out of the UI
            log.getChild(task.env).warning(
                "rollout %s of %s/%s: %s: %s", request.rollout_id, task.env, task.id, status, error
            )
        session = state["session"]
        await self._cleanup(env, session, request, actions)
        reward, progress = state["reward"], state["progress"]
        reward = reward if status in ("ok", "truncated") else None
        if status == "truncated" and reward is None:
            reward = 0.0
        left = [s.record(reward=reward, progress=progress, status=status, error=error) for s in state["left"]]
        record = session.record(
            reward=reward, progress=progress, status=status, timing=clock.timing, error=error
        )
        return RolloutResult(
            rollout_id=request.rollout_id,
            record=record,
            status=status,
            reward=reward,
            progress=progress,
            timing=dict(clock.timing),
            turns=session.num_turns + sum(s.num_turns for s in state["left"]),
            error=error,
            branches=left,
        )

    async def _run(
        self, env: Env, session: Session, request: RolloutRequest, state: dict, clock: _Clock
    ) -> None:
        """RUN for an env the service drives: a turn of the model, then the env's step, until
        the env is done. The whole conversation goes to ``state["history"]``; a prompt past
        ``compact_at`` goes on in a branch (:meth:`_compacted`), which becomes ``state["session"]``."""
        seed = request.seed
        history = state["history"]
        starts: list[int] = []  # where each turn's action sits in history
        for turn in range(self.config.max_turns):
            params = SamplingParams(
                max_new_tokens=self.config.max_new_tokens,
                temperature=self.config.temperature,
                top_p=self.config.top_p,
                stop_ids=self.gateway.stop_ids,
                seed=None if seed is None else turn_seed(seed, turn),
            )
            generated = await session.generate(params)
            action = generated.text
            starts.append(len(history))
            history.append(generated.message)
            result = await self._act(
                _declared(env, "action_request", action),
                env,
                request,
                clock,
                functools.partial(self._watched, env, "step", action),
            )
            state["progress"] = checked_progress(result.progress, request.task.env)
            if result.done:
                state["done"] = True
                return
            history.extend(result.observation)
            last = turn == self.config.max_turns - 1  # no turn follows to go on in a branch
            branch = None if last else await self._compacted(session, result.observation, history, starts)
            if branch is None:
                session.add_messages(result.observation)
            else:
                state["left"].append(session)
                state["session"] = session = branch

    async def _compacted(
        self,
        session: Session,
        observation: list[dict[str, Any]],
        history: list[dict[str, Any]],
        starts: list[int],
    ) -> Session | None:
        """A branch of ``session`` holding the first messages and the last
        ``compact_keep_turns`` turns of ``history`` (``session`` is then closed: it will not
        generate again) when its prompt with ``observation`` would pass ``compact_at`` and
        ``history`` holds more turns than that; else None."""
        keep = self.config.compact_keep_turns
        if self.config.compact_at is None or len(starts) <= keep:
            return None
        if await session.prompt_size(observation) <= self.config.compact_at:
            return None
        branch = await self.gateway.branch(session, [*history[: starts[0]], *history[starts[-keep] :]])
        self.gateway.close(session.session_id, continued_in=branch.session_id)
        if len(branch.tokens) > self.config.compact_at and not self._warned_compact_at:
            self._warned_compact_at = True
            log.warning(
                "service.compact_at %d is below a compacted context (%d tokens: the first messages and "
                "the last %d turns of a rollout of %s): a rollout whose compacted context passes it opens a "
                "branch on each turn after, a row of one action; raise compact_at%s",
                self.config.compact_at,
                len(branch.tokens),
                keep,
                session.info.task,
                " or lower compact_keep_turns" if keep > 1 else "",  # 1 is its least
            )
        return branch

    async def _drive(
        self, env: Env, session: Session, request: RolloutRequest, state: dict, clock: _Clock
    ) -> None:
        """RUN for a self-driving env: its program sends every model call through ``session``.
        A program that ended (or failed) on an engine failure, which it saw only as an HTTP
        error, ends the rollout as that failure: an infra error, never scored. One whose last
        model call did not fit in the context is truncated: scored when the program ended
        on it, 0 when it failed on it (as a rollout the service drives). One whose last call
        was refused past ``max_turns`` is truncated and scored either way, as a driven
        rollout out of turns is."""
        try:
            result = await self._watched(env, "run")
        except Exception:
            _raise_engine_error(session)
            if session.context_limit is not None and _out_of_turns(session):
                return  # not done: EVAL scores its work, truncated
            if session.context_limit is not None:
                raise ContextLimit(f"the program's last model call: {session.context_limit}") from None
            raise
        _raise_engine_error(session)
        state["progress"] = checked_progress(result.progress, request.task.env)
        state["done"] = result.done and session.context_limit is None

    async def _act(
        self,
        needs: ResourceRequest | None,
        env: Env,
        request: RolloutRequest,
        clock: _Clock,
        call: Callable[[], Awaitable[T]],
    ) -> T:
        """Run one env action inside a grant of what it declared (unscheduled when it needs nothing)."""
        if needs is None or self.scheduler is None:
            return await call()
        needs = dataclasses.replace(needs, trajectory_id=request.rollout_id)
        pid = env.resource_pid()
        async with contextlib.AsyncExitStack() as stack:
            with clock.waiting_for_grant():
                grant = await stack.enter_async_context(self.scheduler.run(needs, pid=pid))
            env.cores = grant.cores or None
            try:
                return await call()
            finally:
                env.cores = None
                # the grant's end parks ``pid``: a process the env restarted in the action is another
                if env.resource_pid() != pid:
                    self._park(env)

    def _park(self, env: Env) -> None:
        """Park the env's persistent process on the parking cores, when the scheduler pins: one
        that ``reset`` started, or an action restarted, runs on all the worker's cores until then."""
        cpu = None if self.scheduler is None else self.scheduler.cpu
        pid = env.resource_pid()
        if cpu is not None and pid is not None:
            cpu.park(pid)

    def _reward_call(
        self, name: str, messages: list[dict[str, Any]], clock: _Clock
    ) -> tuple[ResourceRequest | None, Callable[[], Awaitable[float]]]:
        """What a call of reward model ``name`` needs (one reward slot, under the action
        scheduler) and the call, which scores the conversation; its waits for device room
        are queue time on ``clock``, as a wait for a scheduler grant is."""
        if self.rewards is None:
            raise KeyError(f"the env names reward model {name!r} but ServiceConfig.reward_models is empty")
        self.rewards.check(name)
        needs = None
        if isinstance(self.scheduler, ActionScheduler):
            needs = ResourceRequest(demand={REWARD_RESOURCE: 1}, kind=f"reward:{name}")
        return needs, functools.partial(self.rewards.score, name, messages, clock.waiting_for_grant)

    async def _cleanup(
        self, env: Env | None, session: Session, request: RolloutRequest, actions: _ProgramActions | None
    ) -> None:
        """Give back the rollout's resources, close its env and its gateway session; a step that
        fails (or an env close past ``ENV_CLOSE_TIMEOUT_S``) is logged and the next ones still run.
        A cancel that arrives meanwhile (``cancel``, an orchestrator stopping) waits for every
        step to finish and is then dropped: the rollout's outcome is decided by now, and a
        finished trajectory is kept, not thrown away for a cancel that came too late (a
        rollout cancelled before its cleanup raises its own cancel after it)."""
        release = asyncio.create_task(self._release(env, session, request, actions))
        cancels = 0
        while not release.done():
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:  # every one of them, however many come
                cancels += 1
        for _ in range(cancels):
            asyncio.current_task().uncancel()

    async def _close_env(self, env: Env) -> None:
        """``env.close()``, left running past ``ENV_CLOSE_TIMEOUT_S``: cancelled and not awaited,
        since a close that goes on when cancelled (one waiting for its thread) would hold the
        rollout as long as it hangs."""
        closing = asyncio.ensure_future(self._watched(env, "close"))
        await asyncio.wait([closing], timeout=ENV_CLOSE_TIMEOUT_S)
        if not closing.done():
            closing.cancel()
            # what it raises once it ends has been reported as this timeout
            closing.add_done_callback(lambda task: task.cancelled() or task.exception())
            raise TimeoutError(
                f"{type(env).__name__}.close did not return within {ENV_CLOSE_TIMEOUT_S:g} s; left running"
            )
        closing.result()

    async def _release(
        self, env: Env | None, session: Session, request: RolloutRequest, actions: _ProgramActions | None
    ) -> None:
        rollout_id, secrets = request.rollout_id, self._masked()
        if actions is not None:
            with _logged("giving back the program's grant", rollout_id, secrets):
                await actions.close()
        if self.scheduler is not None:
            with _logged("ending the trajectory in the scheduler", rollout_id, secrets):
                self.scheduler.end_trajectory(rollout_id)
        if env is not None:
            with _logged("closing the env", rollout_id, secrets):
                await self._close_env(env)
        with (
            _logged("closing the gateway session", rollout_id, secrets),
            contextlib.suppress(LookupError),
        ):
            self.gateway.close(session.session_id)
