"""The environment protocol: tasks, step results, the ``Env`` base class and its config.

An environment is driven by the rollout service in three stages: INIT (``reset`` to a task,
which returns the first chat messages), RUN (``step`` with each action of the model, which
returns the observation messages, reward, done and partial progress), and EVAL (``evaluate``,
the final score). Blocking work (sandboxes) runs in threads via ``asyncio.to_thread``.
Failures of the sandbox are raised as :class:`envs.sandbox.SandboxError` (status ``env_error``).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from envs.sandbox import Sandbox, SandboxConfig

Split = Literal["train", "eval"]


class Task(BaseModel):
    """One instance of an environment: an id, the first user message, and private data (answer, tests)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env: str = Field(description="Name of the environment the task belongs to.")
    id: str = Field(description="Stable id of the task (the prompt id).")
    prompt: str = Field(description="First user message.")
    data: dict[str, Any] = Field(
        default_factory=dict, description="What the env needs to check it; never shown."
    )


@dataclass
class StepResult:
    """What one action produced: observation messages, reward, done, partial progress in [0, 1], info."""

    observation: list[dict[str, str]]
    reward: float
    done: bool
    progress: float
    info: dict[str, Any] = field(default_factory=dict)


class EnvConfig(BaseModel):
    """Settings every environment shares; each env subclasses it for its own fields."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(8, ge=1, description="Actions allowed before the episode ends unfinished.")
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="Isolation and limits of the env's sandbox."
    )


def user(text: str) -> list[dict[str, str]]:
    """A one-message observation from the user."""
    return [{"role": "user", "content": text}]


def in_eval_split(key: str, eval_fraction: float) -> bool:
    """Whether the task named ``key`` belongs to the eval split (a hash, so splits never overlap)."""
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return digest / 2**64 < eval_fraction


class Env(ABC):
    """Base class of every environment (async; one instance per rollout)."""

    name: ClassVar[str]
    config_cls: ClassVar[type[EnvConfig]] = EnvConfig

    def __init__(self, config: EnvConfig | None = None, **overrides: Any):
        data = (config.model_dump() if config is not None else {}) | overrides
        self.config = self.config_cls.model_validate(data)
        self.task: Task | None = None
        self.turns = 0
        self.sandbox: Sandbox | None = None

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
        """Apply the model's ``action``."""

    @abstractmethod
    async def evaluate(self) -> float:
        """Final score of the episode (EVAL stage)."""

    async def close(self) -> None:
        """Kill the env's sandbox and everything in it, if it has one; safe to call twice."""
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.close)
            self.sandbox = None

    async def _new_sandbox(self) -> Sandbox:
        """A fresh sandbox for this episode (the previous one, if any, is closed)."""
        await self.close()
        self.sandbox = await asyncio.to_thread(Sandbox, self.config.sandbox)
        return self.sandbox

    def _start(self, task: Task) -> None:
        if task.env != self.name:
            raise ValueError(f"task {task.id!r} belongs to env {task.env!r}, not {self.name!r}")
        self.task = task
        self.turns = 0

    def _require_task(self) -> Task:
        if self.task is None:
            raise RuntimeError(f"{self.name}: call reset(task) before step/evaluate")
        return self.task


def sample_unique(rng: random.Random, make, accept, n: int, limit: int = 100_000) -> list:
    """Draw ``n`` distinct items ``make(rng)`` (by ``.id``) that ``accept`` keeps; fail if too few exist."""
    seen: dict[str, Any] = {}
    for _ in range(limit):
        if len(seen) == n:
            break
        item = make(rng)
        if item.id not in seen and accept(item):
            seen[item.id] = item
    if len(seen) < n:
        raise ValueError(f"only {len(seen)} distinct tasks exist for this split; asked for {n}")
    return list(seen.values())
