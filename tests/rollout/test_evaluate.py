"""Held-out evaluation through the real engine path: scores per environment, and nothing left
running when a rollout fails."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from envs import registry
from envs.arith import ArithEnv
from envs.base import StepResult
from envs.guess import GuessEnv
from rollout import service as service_module
from rollout.config import ServiceConfig
from rollout.engines.torch_engine import TorchEngine
from rollout.evaluate import evaluate
from tests.rollout.test_orchestrator import tiny  # noqa: F401
from tests.rollout.test_service import OneCallProgram, RecordingEngine, SamplingProgram, arith_task


class HeldArith(ArithEnv):
    """``arith`` whose step waits until cancelled; counts the envs closed."""

    name = "arith"
    closed = 0

    async def step(self, action):
        await asyncio.Event().wait()

    async def close(self) -> None:
        type(self).closed += 1
        await super().close()


class ScoredArith(ArithEnv):
    """``arith`` whose episode scores 1 on tasks with an odd first operand, else 0."""

    async def evaluate(self) -> float:
        return float(self._require_task().data["a"] % 2)


class ScoredGuess(GuessEnv):
    """``guess`` whose every episode scores 0.25."""

    async def evaluate(self) -> float:
        return 0.25


def test_scores_each_environment_of_the_eval_set(tiny):  # noqa: F811
    """Each env's reward is the mean of its own rollouts' scores, not of the whole set's."""
    model, tokenizer = tiny
    arith = registry.task_set("arith", "eval", seed=0, n=4)
    tasks = arith + registry.task_set("guess", "eval", seed=0, n=2)
    odd = sum(task.data["a"] % 2 for task in arith)
    assert 0 < odd < len(arith)
    envs = {"arith": ScoredArith, "guess": ScoredGuess}

    async def body():
        engine = TorchEngine(model, tokenizer, name="torch-0")
        try:
            return await evaluate(engine, tokenizer, tasks, lambda task: envs[task.env]())
        finally:
            await engine.close()

    result = asyncio.run(body())
    assert result.count == {"arith": 4, "guess": 2}
    assert result.reward == {"arith": pytest.approx(odd / 4), "guess": pytest.approx(0.25)}
    assert sum(sum(s.values()) for s in result.statuses.values()) == 6


def test_a_tasks_sampling_seed_does_not_depend_on_the_other_envs_evaluated_with_it(tiny, monkeypatch):  # noqa: F811
    """Rollout seeds are numbered within each env: an env's tasks sample alike whether or not
    other envs' tasks come before them in the list (a mix that gained, lost or reordered an
    env), as the setup recorded for the env, which names none of the others, says they do."""
    model, tokenizer = tiny
    arith = registry.task_set("arith", "eval", seed=0, n=3)
    guess = registry.task_set("guess", "eval", seed=0, n=2)
    process = service_module.RolloutService.process
    seeds: dict[tuple[str, str], list[int]] = {}

    async def recording(self, request):
        seeds.setdefault((request.task.env, request.task.id), []).append(request.seed)
        return await process(self, request)

    monkeypatch.setattr(service_module.RolloutService, "process", recording)
    envs = {"arith": ScoredArith, "guess": ScoredGuess}

    async def body(tasks):
        engine = TorchEngine(model, tokenizer, name="torch-0")
        try:
            return await evaluate(engine, tokenizer, tasks, lambda task: envs[task.env](), seed=7)
        finally:
            await engine.close()

    asyncio.run(body(arith))
    asyncio.run(body(guess + arith))
    asyncio.run(body(guess))
    assert {(env, tuple(s)) for (env, _), s in seeds.items()} == {
        ("arith", (7, 7)),
        ("arith", (8, 8)),
        ("arith", (9, 9)),
        ("guess", (7, 7)),
        ("guess", (8, 8)),
    }


class CrashingArith(ArithEnv):
    """``arith`` that scores every answer 1, and crashes on tasks whose first operand is even."""

    name = "arith"

    async def step(self, action):
        if self._require_task().data["a"] % 2 == 0:
            raise RuntimeError("the environment crashed")
        self.score = 1.0
        return StepResult([], 1.0, True, 1.0, {})

    async def evaluate(self) -> float:
        return 1.0


def test_rollouts_that_fail_outside_the_policy_are_left_out_of_the_reward(tiny):  # noqa: F811
    """A crashed environment (or a dead engine) says nothing of the policy: such rollouts
    count in the statuses only; an env with nothing else is unmeasured (NaN, count 0)."""
    model, tokenizer = tiny
    tasks = registry.task_set("arith", "eval", seed=0, n=8)
    crashing = sum(task.data["a"] % 2 == 0 for task in tasks)
    assert 0 < crashing < len(tasks)
    every_crash = [task for task in tasks if task.data["a"] % 2 == 0]

    async def body(tasks):
        engine = TorchEngine(model, tokenizer, name="torch-0")
        try:
            return await evaluate(engine, tokenizer, tasks, lambda task: CrashingArith())
        finally:
            await engine.close()

    result = asyncio.run(body(tasks))
    statuses = result.statuses["arith"]
    assert statuses.pop("env_error") == crashing and set(statuses) <= {"ok", "truncated"}
    assert result.count == {"arith": len(tasks) - crashing} and result.reward == {"arith": 1.0}
    unmeasured = asyncio.run(body(every_crash))
    assert unmeasured.count == {"arith": 0} and math.isnan(unmeasured.reward["arith"])
    assert unmeasured.errors == {"arith": "RuntimeError during run: the environment crashed"}


def test_a_rollout_that_raises_leaves_no_other_rollout_running(tiny, monkeypatch):  # noqa: F811
    model, tokenizer = tiny
    tasks = registry.task_set("arith", "eval", seed=0, n=4)
    process = service_module.RolloutService.process

    async def failing_one(self, request):
        if request.seed == 2:
            raise RuntimeError("a bug in one rollout (injected)")
        return await process(self, request)

    monkeypatch.setattr(service_module.RolloutService, "process", failing_one)
    HeldArith.closed = 0

    async def body():
        engine = TorchEngine(model, tokenizer, name="torch-0")
        try:
            with pytest.raises(RuntimeError, match="injected"):
                await evaluate(engine, tokenizer, tasks, lambda task: HeldArith())
            return HeldArith.closed
        finally:
            await engine.close()

    assert asyncio.run(asyncio.wait_for(body(), 60)) == 3


class SlowClosingProgram(OneCallProgram):
    """A self-driving program that runs until cancelled; its close waits for ``release``."""

    def __init__(self):
        super().__init__()
        self.running, self.closing, self.release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def run(self):
        self.running.set()
        await asyncio.Event().wait()

    async def close(self) -> None:
        self.closing.set()
        await self.release.wait()
        await super().close()


def test_a_cancel_while_an_evaluation_winds_down_still_stops_its_gateway_server(tiny, monkeypatch):  # noqa: F811
    """One rollout raises, so the evaluation cancels the other and waits for it to close its
    env; a cancel that lands meanwhile used to end that wait by raising out of it, skipping the
    service's close: the HTTP gateway of its self-driving programs went on serving."""
    model, tokenizer = tiny
    tasks = registry.task_set("arith", "eval", seed=0, n=2)
    program = SlowClosingProgram()
    process = service_module.RolloutService.process

    async def failing_one(self, request):
        if request.seed == 0:
            await program.running.wait()
            raise RuntimeError("a bug in one rollout (injected)")
        return await process(self, request)

    monkeypatch.setattr(service_module.RolloutService, "process", failing_one)

    async def body():
        engine = TorchEngine(model, tokenizer, name="torch-0")
        try:
            evaluation = asyncio.create_task(evaluate(engine, tokenizer, tasks, lambda task: program))
            await program.closing.wait()
            evaluation.cancel()
            program.release.set()
            with pytest.raises(asyncio.CancelledError):
                await evaluation
            async with httpx.AsyncClient() as client:
                with pytest.raises(httpx.ConnectError):
                    await client.get(program.gateway.base_url)
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_self_driving_program_samples_at_the_eval_temperature_unless_it_asks_another(tiny):  # noqa: F811
    """Nothing evaluated is trained on: a program's call that leaves the temperature unset
    samples at the eval temperature, and one that asks for another is served at it."""
    model, tokenizer = tiny
    env = SamplingProgram()

    async def body():
        engine = RecordingEngine(model, tokenizer, name="torch-0")
        try:
            await evaluate(engine, tokenizer, [arith_task()], lambda task: env, temperature=1e-3)
        finally:
            await engine.close()
        return [(p.temperature, p.top_p) for p in engine.params]

    assert asyncio.run(body()) == [(1e-3, 1.0), (0.9, 1.0)]
    assert env.answers == [(200, None), (200, None)]


class CountedArith(ArithEnv):
    """``arith`` whose step holds its RUN slot a moment; counts the steps running at once."""

    name = "arith"
    running = 0
    most = 0

    async def step(self, action):
        cls = type(self)
        cls.running += 1
        cls.most = max(cls.most, cls.running)
        try:
            await asyncio.sleep(0.05)
        finally:
            cls.running -= 1
        return await super().step(action)


def test_an_evaluation_keeps_the_runs_limit_of_rollouts_in_the_run_stage(tiny):  # noqa: F811
    """``service.run_workers`` bounds the rollouts in RUN at once (sandboxes, agent programs)
    in an evaluation too; it used to be replaced by the evaluation's concurrency (64)."""
    model, tokenizer = tiny
    tasks = registry.task_set("arith", "eval", seed=0, n=8)
    CountedArith.running = CountedArith.most = 0

    async def body():
        engine = TorchEngine(model, tokenizer, name="torch-0")
        try:
            return await evaluate(
                engine,
                tokenizer,
                tasks,
                lambda task: CountedArith(),
                service_config=ServiceConfig(run_workers=2),
            )
        finally:
            await engine.close()

    result = asyncio.run(body())
    assert sum(result.statuses["arith"].values()) == len(tasks)
    assert CountedArith.most == 2
