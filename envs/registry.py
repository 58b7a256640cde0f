"""Environments by name: ``make(name, **config)`` and ``task_set(name, split, seed, n)``."""

from __future__ import annotations

import json
from typing import Any

from envs.agent import AgentEnv
from envs.arith import ArithEnv
from envs.base import Env, EnvConfig, Split, Task, TooFewTasks
from envs.code import CodeEnv
from envs.dataset import DatasetEnv
from envs.guess import GuessEnv
from envs.pytool import PyToolEnv
from envs.shell_env import ShellEnv

REGISTRY: dict[str, type[Env]] = {
    cls.name: cls for cls in (ArithEnv, GuessEnv, PyToolEnv, CodeEnv, ShellEnv, DatasetEnv, AgentEnv)
}


def register(cls: type[Env]) -> type[Env]:
    """Add a user environment class under ``cls.name`` (usable as a decorator)."""
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"an environment named {cls.name!r} is already registered")
    REGISTRY[cls.name] = cls
    return cls


def env_class(name: str) -> type[Env]:
    """The class registered as ``name``."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown environment {name!r}; known: {sorted(REGISTRY)}") from None


def make_config(name: str, config: EnvConfig | dict[str, Any] | None = None, **overrides: Any) -> EnvConfig:
    """The validated config of env ``name`` from a config object, a dict, or keyword overrides."""
    cls = env_class(name)
    data = config.model_dump() if isinstance(config, EnvConfig) else dict(config or {})
    return cls.config_cls.model_validate(data | overrides)


def make(name: str, config: EnvConfig | dict[str, Any] | None = None, **overrides: Any) -> Env:
    """A new instance of env ``name`` (one per rollout)."""
    return env_class(name)(make_config(name, config, **overrides))


def task_set(
    name: str, split: Split, seed: int, n: int = 64, config: EnvConfig | dict[str, Any] | None = None
) -> list[Task]:
    """``n`` tasks of env ``name`` from ``split`` (train or eval, disjoint), reproducible from ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if n < 0:
        raise ValueError(f"n (the number of tasks) must be >= 0, got {n}")
    return env_class(name).tasks(split, seed, n, make_config(name, config))


def task_pool(
    name: str,
    split: Split,
    seed: int,
    n: int,
    config: EnvConfig | dict[str, Any] | None = None,
    *,
    distinct: bool = False,
) -> list[Task]:
    """:func:`task_set`, but every distinct task of ``split`` when an env that draws distinct
    tasks holds fewer than ``n`` (``code``'s few hundred functions, a small ``max_operand``);
    one that holds none raises. Envs that repeat their tasks to make ``n`` (``dataset``,
    ``agent``, ``guess``) give ``n``; with ``distinct``, the first of each problem (prompt and
    data, and id where the env shows it: ``agent``'s task.json) only, ``n`` of them where the
    split holds ``n``: an evaluation's set, whose mean would weigh a repeated problem more."""
    try:
        tasks = task_set(name, split, seed, n, config)
    except TooFewTasks as exc:
        if not exc.available:
            raise
        tasks = task_set(name, split, seed, exc.available, config)
        return _first_of_each(name, tasks) if distinct else tasks
    if not distinct:
        return tasks
    problems, size = _first_of_each(name, tasks), n
    # a draw that repeats problems (rows sharing a prompt) holds fewer than n where the split
    # may hold more: draw twice as many until n come or a larger draw brings no new one
    while len(problems) < n:
        size *= 2
        try:
            more = _first_of_each(name, task_set(name, split, seed, size, config))
        except TooFewTasks:  # an env that draws distinct ids, some of one problem: it has no more
            break
        if len(more) <= len(problems):
            break
        problems = more
    return problems[:n]


def _first_of_each(name: str, tasks: list[Task]) -> list[Task]:
    """The first task of each problem in ``tasks``, in order (see :func:`task_pool`)."""
    shows_id = env_class(name).shows_task_id
    problems: dict[str, Task] = {}
    for task in tasks:
        problem = [task.prompt, task.data, task.id if shows_id else None]
        problems.setdefault(json.dumps(problem, sort_keys=True, default=str), task)
    return list(problems.values())


def demonstrate(task: Task, flawed: bool = False, seed: int = 0) -> list[str]:
    """The scripted solver's actions for ``task`` (``flawed``: the weaker demonstrator)."""
    return env_class(task.env).demonstrate(task, flawed=flawed, seed=seed)
