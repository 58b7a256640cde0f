"""Demonstrations played several at once come out as one at a time gives them, in task
order; the first error stops the others, every env closed."""

from __future__ import annotations

import asyncio
import re

import pytest

from envs import registry
from envs.arith import ArithEnv
from rl.models import TinyModelConfig, build_tiny_model
from rollout.demos import demonstrations
from rollout.gateway import ChatRenderer


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    _, tokenizer = build_tiny_model(TinyModelConfig())
    return ChatRenderer(tokenizer)


class CountedArith(ArithEnv):
    """The arith env, counting the episodes open at once; one whose task is ``fails``
    raises as it steps."""

    open_now = 0
    most_open = 0
    closed = 0
    fails: str | None = None

    async def reset(self, task):
        cls = type(self)
        cls.open_now += 1
        cls.most_open = max(cls.most_open, cls.open_now)
        await asyncio.sleep(0.01)  # a sandbox's start: the others go on meanwhile
        return await super().reset(task)

    async def step(self, action):
        if self.task.id == type(self).fails:
            raise RuntimeError(f"the demonstrator's bug on {self.task.id}")
        return await super().step(action)

    async def close(self):
        type(self).open_now -= 1
        type(self).closed += 1
        await super().close()


@pytest.fixture
def counted(monkeypatch):
    for name in ("open_now", "most_open", "closed"):
        monkeypatch.setattr(CountedArith, name, 0)
    monkeypatch.setattr(CountedArith, "fails", None)
    return CountedArith


def play(renderer, tasks, concurrency, on_done=None):
    return asyncio.run(
        demonstrations(
            renderer,
            lambda task: CountedArith(),
            tasks,
            lambda task: registry.demonstrate(task),
            concurrency=concurrency,
            on_done=on_done,
        )
    )


def test_demonstrations_played_at_once_are_those_played_one_at_a_time_in_task_order(renderer, counted):
    tasks = registry.task_set("arith", "train", 0, 40)
    one_at_a_time = play(renderer, tasks, 1)
    assert counted.most_open == 1
    done = []
    at_once = play(renderer, tasks, 8, on_done=lambda: done.append(1))
    assert at_once == one_at_a_time
    assert counted.most_open == 8
    assert len(done) == 40 and counted.closed == 80


def test_a_demonstrations_error_is_raised_as_it_is_and_every_env_is_closed(renderer, counted):
    tasks = registry.task_set("arith", "train", 0, 40)
    counted.fails = tasks[5].id
    with pytest.raises(RuntimeError, match=rf"^the demonstrator's bug on {re.escape(tasks[5].id)}$"):
        play(renderer, tasks, 8)
    assert counted.open_now == 0, "an env left open"


def test_a_demonstrations_error_keeps_the_error_it_was_raised_from(renderer, counted, monkeypatch):
    """Unwrapped from the task group with ``from None``, the error lost its cause (the
    sandbox's error a demonstrator's was raised from), which one at a time it had kept."""
    tasks = registry.task_set("arith", "train", 0, 4)

    async def step(self, action):
        try:
            raise OSError("the sandbox went away")
        except OSError as gone:
            raise RuntimeError("the demonstrator's bug") from gone

    monkeypatch.setattr(CountedArith, "step", step)
    with pytest.raises(RuntimeError, match="^the demonstrator's bug$") as raised:
        play(renderer, tasks, 2)
    assert isinstance(raised.value.__cause__, OSError)
    assert str(raised.value.__cause__) == "the sandbox went away"


def test_demonstrations_cancelled_close_every_env_and_end_cancelled(renderer, counted):
    """A signal cancels the warm start's demonstrations (``run_async``): the episodes open
    then are closed, and the cancel is not taken for a demonstration's error."""
    tasks = registry.task_set("arith", "train", 0, 40)

    async def cancelled_midway():
        job = asyncio.ensure_future(
            demonstrations(renderer, lambda task: CountedArith(), tasks, registry.demonstrate, concurrency=8)
        )
        while counted.open_now < 8:
            await asyncio.sleep(0)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(cancelled_midway())
    assert counted.most_open == 8
    assert counted.open_now == 0, "an env left open"
    assert counted.closed < 40
