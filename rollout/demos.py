"""Demonstrations as token sequences laid out exactly as the gateway lays out rollouts.

A scripted solver's actions are played against the environment; the tokens are rendered
with the gateway's :class:`~rollout.gateway.ChatRenderer` (first turn in full, later
turns as deltas) and each action ends with the turn's stop token, as a sampled action
does. The loss mask is true on action tokens, so supervised warm start teaches the policy
exactly the tokens RL will later sample.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from envs.base import Env, Task
from rollout.gateway import ChatRenderer


async def demonstration(
    renderer: ChatRenderer, env: Env, task: Task, actions: Sequence[str]
) -> tuple[list[int], list[bool]]:
    """Play ``actions`` on ``env`` from ``task``; return (token ids, loss mask)."""
    stop_ids = renderer.stop_ids()
    if not stop_ids:
        raise ValueError("the tokenizer has no stop token to end an action with")
    tokens: list[int] = []
    mask: list[bool] = []
    try:
        observation = await env.reset(task)
        last_action: list[int] | None = None
        for action in actions:
            context = (
                renderer.first(observation)
                if last_action is None
                else renderer.delta(observation, last_action)
            )
            tokens += context
            mask += [False] * len(context)
            last_action = renderer.encode(action) + [stop_ids[-1]]
            tokens += last_action
            mask += [True] * len(last_action)
            result = await env.step(action)
            if result.done:
                break
            observation = result.observation
    finally:
        await env.close()
    return tokens, mask


async def demonstrations(
    renderer: ChatRenderer,
    make_env: Callable[[Task], Env],
    tasks: Sequence[Task],
    solve: Callable[[Task], Sequence[str]],
    concurrency: int = 1,
    on_done: Callable[[], None] | None = None,
) -> tuple[list[list[int]], list[list[bool]]]:
    """Token sequences and loss masks of ``solve(task)`` for every task, in task order. At
    most ``concurrency`` are played at once (an env in a sandbox waits on its processes: one
    at a time, two thousand shell demonstrations took minutes); ``on_done`` is called as each
    ends. The first error raised stops the others, each closing its env."""
    actions = [solve(task) for task in tasks]
    slots = asyncio.Semaphore(concurrency)

    async def play(task: Task, moves: Sequence[str]) -> tuple[list[int], list[bool]]:
        async with slots:
            played = await demonstration(renderer, make_env(task), task, moves)
        if on_done is not None:
            on_done()
        return played

    try:
        async with asyncio.TaskGroup() as group:
            jobs = [group.create_task(play(task, moves)) for task, moves in zip(tasks, actions, strict=True)]
    except ExceptionGroup as errors:
        first = errors.exceptions[0]
    else:
        return [job.result()[0] for job in jobs], [job.result()[1] for job in jobs]
    raise first  # out of the except: raised as it is, its cause kept and no group as its context
