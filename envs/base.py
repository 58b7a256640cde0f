"""The environment protocol: tasks, step results, the ``Env`` base class and its config.

An environment is driven by the rollout service in three stages: INIT (``reset`` to a task,
which returns the first chat messages), RUN (``step`` with each action of the model, which
returns the observation messages, reward, done and partial progress), and EVAL (``evaluate``,
the final score). Blocking work (sandboxes) runs in threads via ``asyncio.to_thread``: these
calls run on the rollout worker's event loop, which a blocking one holds for every rollout
(the service warns naming the env and call, ``ServiceConfig.loop_block_warn_s``).
Failures of the sandbox are raised as :class:`envs.sandbox.SandboxError` (status ``env_error``;
``infra_error`` for one that could not start),
except those the model's own action brought on (:meth:`Env._by_action`): the action fails
and the model is told why (:func:`stopped`), or the episode scores 0.

An environment also declares what each action needs from the machine (``action_request``,
``eval_request``: a :class:`ResourceRequest`, or ``None`` for pure-Python work), so that the
rollout service can grant those resources per action (``rollout.scheduler``) and pin the
sandbox's persistent process (``resource_pid``) to the granted cores while the action runs.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from envs.sandbox import COMMAND_KINDS, Sandbox, SandboxConfig, SandboxError
from envs.threads import to_thread_to_the_end

Split = Literal["train", "eval"]


def _not_blank(value: str) -> str:
    # Python's whitespace, as the shard check's (a regex's \s differs: U+001C..U+001F)
    if not value.strip():
        raise ValueError("an id must hold something other than whitespace")
    return value


def _encodable(value: str) -> str:
    # JSON may carry a lone surrogate ("\udc80"): no tokenizer or table can take it
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds a lone surrogate at character {exc.start}, which UTF-8 cannot encode"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_encodable)]
"""A string UTF-8 can encode (no lone surrogate)."""

Id = Annotated[Text, AfterValidator(_not_blank)]
"""An id: something other than whitespace (a blank id names nothing, and a trajectory that
carries one is refused when its shard is written)."""


class Task(BaseModel):
    """One instance of an environment: an id, the first user message, and private data (answer, tests)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env: Id = Field(description="Name of the environment the task belongs to.")
    id: Id = Field(description="Stable id of the task (the prompt id).")
    prompt: Text = Field(description="First user message.")
    data: dict[str, Any] = Field(
        default_factory=dict, description="What the env needs to check it; never shown."
    )


class EnvHostLost(RuntimeError):
    """The process hosting an environment (a remote env worker) died or could not be reached:
    the environment is gone, by no fault of its own. The rollout service reports it as
    ``infra_error``."""


@dataclass
class StepResult:
    """What one action produced: observation messages, reward, done, partial progress in [0, 1], info."""

    observation: list[dict[str, str]]
    reward: float
    done: bool
    progress: float
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResourceRequest:
    """What one action needs from the machine (ARL-Tangram's resource vector).

    ``demand`` holds the fixed amount of each resource (``{"mem_gb": 2, "gpu": 1}``). An
    elastic action names one resource in ``elastic`` and gets between ``min_units`` and
    ``max_units`` of it; ``efficiency[m - 1]`` is ``E(m)`` in ``T(m) = T_1 / (E(m) * m)``
    (empty means perfect scaling). ``duration`` is the estimated single-unit time ``T_1`` in
    seconds (``None``: the scheduler's running estimate for ``kind``). ``trajectory_id`` is
    filled in by the rollout service.
    """

    demand: Mapping[str, float] = field(default_factory=dict)
    elastic: str | None = None
    min_units: int = 1
    max_units: int = 1
    duration: float | None = None
    efficiency: tuple[float, ...] = ()
    kind: str = "tool"
    trajectory_id: str = ""

    def __post_init__(self):
        for name, amount in self.demand.items():
            if not (math.isfinite(amount) and amount >= 0):
                raise ValueError(f"ResourceRequest.demand[{name!r}] must be finite and >= 0, got {amount}")
        if self.elastic is not None:
            if self.elastic in self.demand:
                raise ValueError(
                    f"ResourceRequest: elastic resource {self.elastic!r} must not also be in demand"
                )
            if not 1 <= self.min_units <= self.max_units:
                raise ValueError(
                    f"ResourceRequest needs 1 <= min_units <= max_units, got {self.min_units}, {self.max_units}"
                )
            if self.efficiency and len(self.efficiency) < self.max_units:
                raise ValueError(
                    f"ResourceRequest.efficiency has {len(self.efficiency)} entries, needs max_units={self.max_units}"
                )
            if any(not 0 < e <= 1 for e in self.efficiency):
                raise ValueError(
                    f"ResourceRequest.efficiency values must be in (0, 1], got {self.efficiency}"
                )
        if self.duration is not None and not (math.isfinite(self.duration) and self.duration >= 0):
            raise ValueError(f"ResourceRequest.duration must be finite and >= 0, got {self.duration}")

    def duration_on(self, units: int, t1: float | None = None) -> float:
        """``T(m) = T_1 / (E(m) * m)``; a non-elastic action always takes ``T_1``."""
        t1 = self.duration if t1 is None else t1
        if t1 is None:
            raise ValueError("ResourceRequest.duration_on needs a duration (T_1)")
        if self.elastic is None:
            return t1
        efficiency = self.efficiency[units - 1] if self.efficiency else 1.0
        return t1 / (efficiency * units)


def amdahl_efficiency(serial_fraction: float, max_units: int) -> tuple[float, ...]:
    """``E(m)`` for Amdahl's law: ``T(m) = T_1 * (s + (1 - s) / m)``, for ``m = 1..max_units``."""
    if not 0 <= serial_fraction < 1:
        raise ValueError(f"serial_fraction must be in [0, 1), got {serial_fraction}")
    return tuple(1.0 / (m * (serial_fraction + (1 - serial_fraction) / m)) for m in range(1, max_units + 1))


class ActionGate(Protocol):
    """How a self-driving env tells the rollout service when its program acts (and needs the
    resources of ``action_request``) and when it waits on a model call (and needs none)."""

    async def acting(self) -> None:
        """The program starts, or a model reply arrived: returns once it is granted its resources."""

    def waiting(self) -> None:
        """The program sent a model call, or ended: its resources go back."""


class EnvConfig(BaseModel):
    """Settings every environment shares; each env subclasses it for its own fields."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", hide_input_in_errors=True)

    required_fields: ClassVar[tuple[str, ...]] = ()
    """Fields left empty by default that the env cannot run without (a run config with the
    env in its mix is refused without them)."""

    score_fields: ClassVar[tuple[str, ...]] = ()
    """Fields left empty by default that the env scores an episode with (its own EVAL):
    with none of them and no ``reward_model`` set, every episode scores 0 (a run config with
    the env in its mix is refused)."""

    max_turns: int = Field(8, ge=1, description="Actions allowed before the episode ends unfinished.")
    reward_model: str | None = Field(
        None,
        description="Score finished episodes with this reward-model service (service.reward_models) "
        "instead of the env's own evaluate().",
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="Isolation and limits of the env's sandbox."
    )


def user(text: str) -> list[dict[str, str]]:
    """A one-message observation from the user."""
    return [{"role": "user", "content": text}]


def clamp_score(score: float) -> float:
    """``score`` clamped to [0, 1]; NaN (a verifier's 0/0, an EVAL with no tests) scores 0."""
    return 0.0 if math.isnan(score) else min(max(score, 0.0), 1.0)


def tail(text: str, max_chars: int) -> str:
    """The last ``max_chars`` characters of ``text``, after a line saying how many were cut
    before them: cut silently, a number cut to its last digits reads as another number."""
    if len(text) <= max_chars:
        return text
    return f"[{len(text) - max_chars} characters cut]\n{text[-max_chars:]}"


def stopped(exc: SandboxError, max_chars: int) -> str:
    """What the model is told when the sandbox stopped its action: the end of its output
    (:func:`tail`), and why."""
    shown = tail(exc.output.strip(), max_chars)
    return f"{shown}\n[stopped: {exc.kind}: {exc.reason}]".strip()


# A fence is three or more backticks or tildes, indented up to three spaces (a block in a list
# item); its block ends at a line of at least as many of the same character, so a longer fence
# holds shorter ones. A backtick fence's tag holds no backtick (else the line is inline code),
# a tilde fence's may.
FENCED_BLOCK = re.compile(
    r"^(?P<indent> {0,3})(?P<fence>`{3,}(?![^\n]*`)|~{3,}(?!~))[^\n]*\n(?P<body>.*?)"
    r"^ {0,3}(?P=fence)(?:(?<=`)`*|(?<=~)~*)[ \t\r]*$",
    re.MULTILINE | re.DOTALL,
)


def fenced_blocks(text: str) -> list[str]:
    """The contents of the complete Markdown code blocks in ``text`` (fenced with backticks or
    tildes, any language tag or none), in order, each line less up to as many leading spaces as
    its opening fence had: where a chat model puts the code of its reply."""
    return [
        re.sub(rf"(?m)^ {{0,{len(match.group('indent'))}}}", "", match.group("body"))
        for match in FENCED_BLOCK.finditer(text)
    ]


def write_anew(folder: str, name: str, text: str) -> None:
    """Write ``text`` (UTF-8, what Python reads source as) to the file ``name`` in ``folder``,
    in place of whatever is there: staged in a new file, then renamed over it, so that no link
    a sandbox's code left in its folder takes the write out of it (onto a file of the worker's),
    and no folder it made there in its place fails the write."""
    staged = os.path.join(folder, f".{name}.{secrets.token_hex(8)}")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    target = os.path.join(folder, name)
    if os.path.isdir(target) and not os.path.islink(target):
        os.rename(target, f"{staged}.set-aside")
    os.replace(staged, target)


def in_eval_split(key: str, eval_fraction: float) -> bool:
    """Whether the task named ``key`` belongs to the eval split (a hash, so splits never overlap)."""
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return digest / 2**64 < eval_fraction


class Env(ABC):
    """Base class of every environment (async; one instance per rollout)."""

    name: ClassVar[str]
    config_cls: ClassVar[type[EnvConfig]] = EnvConfig
    scripted_solver: ClassVar[bool] = True
    """Whether :meth:`demonstrate` can solve a task (the warm start's demonstrations)."""
    makes_sandboxes: ClassVar[bool] = False
    """Whether its episodes run in sandboxes (made under ``config.sandbox.root_dir``)."""
    shows_task_id: ClassVar[bool] = False
    """Whether the env gives a task's id to what it runs (then part of the problem, beside its
    prompt and data)."""

    def __init__(self, config: EnvConfig | None = None, **overrides: Any):
        data = (config.model_dump() if config is not None else {}) | overrides
        self.config = self.config_cls.model_validate(data)
        self.task: Task | None = None
        self.turns = 0
        self.done = False
        self.sandbox: Sandbox | None = None
        # cores granted to the action now running, set by the rollout service (None: no grant)
        self.cores: frozenset[int] | None = None

    @classmethod
    @abstractmethod
    def tasks(cls, split: Split, seed: int, n: int, config: EnvConfig | None = None) -> list[Task]:
        """``n`` tasks of ``split``, reproducible from ``seed``; eval tasks never appear in train."""

    @classmethod
    @abstractmethod
    def demonstrate(cls, task: Task, flawed: bool = False, seed: int = 0) -> list[str]:
        """The actions of a scripted solver, one per turn (``flawed``: a deliberately weaker one)."""

    @abstractmethod
    async def reset(self, task: Task) -> list[dict[str, str]]:
        """Start ``task``; returns the first messages."""

    @abstractmethod
    async def step(self, action: str) -> StepResult:
        """Apply the model's ``action``; refused once the episode is done (:meth:`_next_turn`)."""

    @abstractmethod
    async def evaluate(self) -> float:
        """Final score of the episode (EVAL stage)."""

    def action_request(self, action: str) -> ResourceRequest | None:
        """What ``step(action)`` needs from the machine; ``None``: nothing worth scheduling (pure Python)."""
        return None

    def eval_request(self) -> ResourceRequest | None:
        """What ``evaluate()`` needs from the machine; ``None``: nothing worth scheduling."""
        return None

    def resource_pid(self) -> int | None:
        """The sandbox's persistent process (shell, interpreter) to pin to an action's cores, if any."""
        return None

    def _by_action(self, exc: SandboxError) -> bool:
        """Whether the model's action brought ``exc`` on (ran too long, printed too much, ran into
        the isolation, ended the shell or interpreter it ran in), not the environment failing.

        Such an action fails like any wrong one: a policy must not turn its episode into an
        ``env_error``, which never reaches the loss.
        """
        if exc.kind in COMMAND_KINDS:
            return True
        return exc.kind == "died" and self.sandbox is not None and not self.sandbox.closed

    async def _close_process(self, name: str) -> None:
        """Close the sandbox's persistent process (shell, interpreter) the attribute ``name``
        holds, if ``reset`` set it, and clear it: safe to call twice, or before ``reset``.
        Cancelled, it still closes it (as :meth:`close` the sandbox): ``asyncio.to_thread``
        drops work cancelled while it waits for a free thread."""
        process = getattr(self, name, None)
        if process is not None:
            setattr(self, name, None)
            await to_thread_to_the_end(process.close)

    async def close(self) -> None:
        """Kill the env's sandbox and everything in it, if it has one; safe to call twice."""
        if self.sandbox is not None:
            await to_thread_to_the_end(self.sandbox.close)
            self.sandbox = None

    async def _new_sandbox(self) -> Sandbox:
        """A fresh sandbox for this episode (the previous one, if any, is closed). A caller
        cancelled while it is built closes it once built, so its folder and uid are freed."""
        await self.close()
        self.sandbox = await to_thread_to_the_end(Sandbox, self.config.sandbox, discard=Sandbox.close)
        return self.sandbox

    def _start(self, task: Task) -> None:
        if task.env != self.name:
            raise ValueError(f"task {task.id!r} belongs to env {task.env!r}, not {self.name!r}")
        self.task = task
        self.turns = 0
        self.done = False

    def _require_task(self) -> Task:
        if self.task is None:
            raise RuntimeError(f"{self.name}: call reset(task) before step/evaluate")
        return self.task

    def _next_turn(self) -> Task:
        """The task, one more action counted; refused once the episode is done (an action after
        the end would change what EVAL scores: a lost game won, a wrong answer replaced)."""
        task = self._require_task()
        if self.done:
            raise RuntimeError(
                f"{self.name}: the episode of task {task.id!r} is done; reset before another step"
            )
        self.turns += 1
        return task

    def _ended(self, result: StepResult) -> StepResult:
        """``result``, the episode marked done when it is (a step's last word)."""
        self.done = result.done
        return result


class TooFewTasks(ValueError):
    """A split holds fewer distinct tasks than were asked for; ``available`` of them were found."""

    def __init__(self, available: int, asked: int):
        super().__init__(f"only {available} distinct tasks exist for this split; asked for {asked}")
        self.available = available


def sample_unique(rng: random.Random, make, accept, n: int, limit: int = 100_000, patience: int = 20) -> list:
    """Draw ``n`` distinct items ``make(rng)`` (by ``.id``) that ``accept`` keeps; raise
    :class:`TooFewTasks` if too few exist (asked again for that many, it gives the ones it found).

    It gives up after ``limit`` draws, or sooner once the last ``patience`` times as many draws
    as distinct ids made so far brought no new one: an id ``k`` times rarer than the average is
    then left out with a chance of about ``exp(-patience / k)``. Where ``n`` are found, the
    stop changes nothing: the items are the first ``n`` the draws give."""
    seen: dict[str, Any] = {}
    made: set[str] = set()
    since_new = 0
    for _ in range(limit):
        if len(seen) == n or since_new > patience * len(made):
            break
        item = make(rng)
        if item.id in made:
            since_new += 1
            continue
        since_new = 0
        made.add(item.id)
        if accept(item):
            seen[item.id] = item
    if len(seen) < n:
        raise TooFewTasks(len(seen), n)
    return list(seen.values())
