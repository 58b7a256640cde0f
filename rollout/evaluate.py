"""Held-out evaluation: roll out every eval task once through the real engine path."""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from envs.base import Env, Task
from rollout.config import ServiceConfig
from rollout.engines.base import Engine
from rollout.gateway import Gateway, GatewayConfig
from rollout.orchestrator import wait_through_cancels
from rollout.router import Router
from rollout.service import RolloutRequest, RolloutService
from storage.schema import EXCLUDED_STATUSES

EVAL_CONCURRENCY = 64
"""Rollouts an evaluation runs at once, unless its caller asks for fewer."""


@dataclass
class EvalResult:
    """Mean reward, rollouts measured and rollouts by status, per environment; ``errors``:
    the reason of the last rollout (in task order) of each env that failed outside the policy."""

    version: int
    reward: dict[str, float]
    count: dict[str, int]
    statuses: dict[str, dict[str, int]]
    errors: dict[str, str] = field(default_factory=dict)


async def evaluate(
    engine: Engine,
    tokenizer,
    tasks: Sequence[Task],
    make_env: Callable[[Task], Env],
    *,
    service_config: ServiceConfig | None = None,
    temperature: float = 1e-3,
    concurrency: int = EVAL_CONCURRENCY,
    gateway_config: GatewayConfig | None = None,
    seed: int = 0,
) -> EvalResult:
    """Roll out each task once on ``engine``: per env, the mean reward of its rollouts (one
    the policy failed scores 0) and how many there are. A rollout that failed outside the
    policy (``env_error``, ``infra_error``: a crashed environment, a dead engine) measures
    nothing about it and is left out of both, counted in ``statuses`` (and the reason of the
    last in task order kept in ``errors``); an env whose every rollout failed so has reward
    NaN and count 0.

    ``service_config`` is the run's: the episodes are scored under the turn, time and token
    budgets, stage limits and by the reward models the policy trains with, at ``temperature``
    and at most ``concurrency`` rollouts at once. The ``i``-th task of an env samples with seed
    ``seed + i``, whatever the tasks of other envs in ``tasks``. A self-driving program's model call samples at
    ``temperature`` unless it asks for another: nothing here is trained on.
    """
    gateway = Gateway(Router([engine]), tokenizer, gateway_config)
    config = service_config or ServiceConfig()
    service = RolloutService(
        gateway,
        make_env,
        config.model_copy(
            update={"temperature": temperature, "run_workers": min(concurrency, config.run_workers)}
        ),
        fixed_sampling=False,
    )
    slots = asyncio.Semaphore(concurrency)

    async def one(task_seed: int, task: Task):
        async with slots:
            return await service.process(RolloutRequest(task=task, seed=task_seed))

    # numbered within each env: numbered across the list, an env's tasks sampled otherwise once
    # the mix gained, lost or reordered another env, though the setup recorded was the same
    placed: dict[str, int] = defaultdict(int)
    jobs = []
    for task in tasks:
        jobs.append(asyncio.ensure_future(one(seed + placed[task.env], task)))
        placed[task.env] += 1
    try:
        results = await asyncio.gather(*jobs)
    finally:  # one that raised (or a cancel) leaves no sibling rollout running
        for job in jobs:
            job.cancel()
        # a cancel while they wind down neither ends the wait nor skips the close of the
        # service (its self-driving programs' HTTP gateway): it is raised after both
        interrupted = await wait_through_cancels(jobs)
        await service.close()
        if interrupted:
            raise asyncio.CancelledError
    rewards: dict[str, list[float]] = defaultdict(list)
    statuses: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    errors: dict[str, str] = {}
    for result in results:
        env = result.record["task"]
        statuses[env][result.status] += 1
        if result.status in EXCLUDED_STATUSES:
            errors[env] = result.error
        else:
            rewards[env].append(result.reward or 0.0)
    return EvalResult(
        version=engine.version,
        reward={env: sum(rewards[env]) / len(rewards[env]) if rewards[env] else math.nan for env in statuses},
        count={env: len(rewards[env]) for env in statuses},
        statuses={env: dict(s) for env, s in statuses.items()},
        errors=errors,
    )
