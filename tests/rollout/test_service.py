"""Rollout service: every environment end to end with the tiny model through the gateway,
timing and timeouts, cancellation, failure classification, and the HTTP API over TCP and a
Unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import re
import sys
import time

import httpx
import pytest
import torch

from envs import registry
from envs.arith import ArithEnv
from envs.base import EnvConfig, EnvHostLost, ResourceRequest, StepResult, Task
from envs.sandbox import SandboxError
from rl.logprobs import token_logprobs
from rl.models import TinyModelConfig, build_tiny_model
from rollout import service as service_module
from rollout.engines.base import EngineError
from rollout.engines.torch_engine import TorchEngine
from rollout.gateway import Gateway, GatewayConfig
from rollout.router import Router, RouterConfig
from rollout.service import DuplicateRollout, RolloutRequest, RolloutResult, RolloutService, ServiceConfig
from rollout.service_http import ServiceServer, create_app
from storage.schema import MAX_ERROR_CHARS, to_table, validate

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=1024
)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny_model(TINY)


@contextlib.asynccontextmanager
async def running_service(
    tiny, config: ServiceConfig | None = None, replicas: int = 1, make_env=None, secrets=()
):
    model, tokenizer = tiny
    engines = [TorchEngine(model, tokenizer, name=f"torch-{i}") for i in range(replicas)]
    gateway = Gateway(Router(engines), tokenizer, GatewayConfig(max_context_tokens=1024))
    service = RolloutService(
        gateway, make_env or (lambda task: registry.make(task.env)), config, secrets=secrets
    )
    try:
        yield service
    finally:
        for engine in engines:
            await engine.close()


@pytest.mark.parametrize("env_name", ["arith", "guess", "pytool", "code", "shell"])
def test_each_environment_end_to_end_gives_a_valid_record(tiny, env_name):
    task = registry.task_set(env_name, "train", seed=0, n=1)[0]

    async def body():
        async with running_service(tiny, ServiceConfig(max_new_tokens=16, timeout_s=120)) as service:
            return await service.process(RolloutRequest(task=task, seed=1))

    result = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    assert result.reward is not None and 0.0 <= result.reward <= 1.0
    record = result.record
    validate(to_table([record]))
    assert record["task"] == env_name and record["prompt_id"] == task.id
    assert any(record["action_mask"]) and result.turns >= 1
    assert set(result.timing) == {"init", "run", "eval", "queue"}
    assert result.timing["run"] > 0


def test_concurrent_multi_turn_rollouts_record_the_log_probs_of_a_full_forward(tiny):
    """16 guess rollouts at once, so their turns are prefilled together on left-padded KV
    caches: on every turn, each action token's recorded log-prob is what one forward pass
    over the whole record gives (what the trainer computes)."""
    model, _ = tiny
    tasks = registry.task_set("guess", "train", seed=3, n=16)

    async def body():
        async with running_service(tiny, ServiceConfig(max_new_tokens=4, timeout_s=120)) as service:
            return await asyncio.gather(
                *(service.process(RolloutRequest(task=task, seed=i)) for i, task in enumerate(tasks))
            )

    turns = set()
    with torch.no_grad():
        for result in asyncio.run(body()):
            record = result.record
            ids = torch.tensor([record["tokens"]])
            forward = token_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool))[0]
            mask = torch.tensor(record["action_mask"])
            recorded = torch.tensor(record["logprobs"])
            torch.testing.assert_close(forward[mask], recorded[mask], atol=1e-4, rtol=0)
            turns |= {t for t, m in zip(record["turn"], record["action_mask"], strict=True) if m}
    assert max(turns) >= 2, "no rollout went past its second turn"


class SeedRecordingEngine(TorchEngine):
    """A real TorchEngine that keeps the sampling seed of every generation it is asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seeds: list[int | None] = []

    async def generate(self, session_id, prompt_ids, params):
        self.seeds.append(params.seed)
        return await super().generate(session_id, prompt_ids, params)


def test_no_two_turns_of_rollouts_with_consecutive_seeds_sample_with_one_seed(tiny):
    """The orchestrator gives rollouts consecutive seeds; turn t sampled with seed + t, so rollout
    n's second turn drew the very random numbers of rollout n + 1's first (one seed draws the
    same whatever the context: mostly the same tokens)."""
    model, tokenizer = tiny
    task = registry.task_set("guess", "train", seed=3, n=1)[0]

    async def body():
        engine = SeedRecordingEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
        service = RolloutService(
            gateway, lambda task: registry.make(task.env), ServiceConfig(max_new_tokens=4)
        )
        try:
            results = [await service.process(RolloutRequest(task=task, seed=seed)) for seed in (1, 2)]
        finally:
            await engine.close()
        return results, engine.seeds

    results, seeds = asyncio.run(body())
    assert all(result.turns >= 2 for result in results), [result.error for result in results]
    assert None not in seeds and len(set(seeds)) == len(seeds) == sum(result.turns for result in results)


class SlowEnv(ArithEnv):
    """``arith`` whose every step takes ``delay`` seconds (a slow tool)."""

    name = "arith"
    delay = 0.5

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(self.delay)
        return await super().step(action)


def arith_task() -> Task:
    return registry.task_set("arith", "train", seed=0, n=1)[0]


def test_a_rollout_past_its_budget_times_out_and_the_service_keeps_serving(tiny):
    async def body():
        config = ServiceConfig(timeout_s=0.3, max_new_tokens=4)
        async with running_service(tiny, config, make_env=lambda task: SlowEnv()) as service:
            slow = await service.process(RolloutRequest(task=arith_task()))
            service.make_env = lambda task: registry.make(task.env)
            service.config = ServiceConfig(timeout_s=120, max_new_tokens=4)
            fast = await service.process(RolloutRequest(task=arith_task()))
            return slow, fast, service.status()

    slow, fast, status = asyncio.run(body())
    assert slow.status == "timeout" and slow.reward is None
    assert "budget" in slow.error and slow.record["error"] == slow.error
    assert fast.status in ("ok", "truncated") and fast.record["error"] is None
    assert status["finished"]["timeout"] == 1 and sum(status["finished"].values()) == 2


def test_queue_time_does_not_count_toward_the_timeout(tiny):
    """Nine rollouts of at least 0.5 s each through one RUN slot: the last waits at least
    4 s in the queue, longer than its 3 s budget, and still finishes."""

    async def body():
        config = ServiceConfig(run_workers=1, timeout_s=3.0, max_new_tokens=4)
        async with running_service(tiny, config, make_env=lambda task: SlowEnv()) as service:
            return await asyncio.gather(
                *(service.process(RolloutRequest(task=arith_task())) for _ in range(9))
            )

    results = asyncio.run(body())
    assert all(r.status in ("ok", "truncated") for r in results), [r.error for r in results]
    assert max(r.timing["queue"] for r in results) >= 4.0
    assert all(r.timing["run"] >= SlowEnv.delay for r in results)


class ScheduledToolEnv(SlowEnv):
    """``SlowEnv`` whose steps are tool calls on one core granted by the scheduler."""

    delay = 0.05

    def action_request(self, action: str) -> ResourceRequest:
        return ResourceRequest(demand={"cpu": 1}, kind="tool", duration=self.delay)


def test_waiting_for_a_scheduler_grant_does_not_count_toward_the_timeout(tiny):
    """The only core is held for 3 s while the rollout's tool call waits for it: longer than
    its 2 s budget, but queue time, so the rollout still finishes."""

    async def body():
        config = ServiceConfig(
            timeout_s=2.0, max_new_tokens=4, scheduler="action", scheduler_cores=1, scheduler_pin=False
        )
        async with running_service(tiny, config, make_env=lambda task: ScheduledToolEnv()) as service:
            scheduler = service.scheduler
            async with scheduler.run(ResourceRequest(demand={"cpu": 1}, kind="other")):
                job = asyncio.create_task(service.process(RolloutRequest(task=arith_task())))

                async def tool_call_queued():
                    while not scheduler.policy.queued:
                        await asyncio.sleep(0.01)

                await asyncio.wait_for(tool_call_queued(), 30)
                await asyncio.sleep(3.0)
            return await asyncio.wait_for(job, 30)

    result = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    assert result.timing["queue"] > 2.0


def test_cancel_stops_an_in_flight_rollout(tiny):
    async def body():
        async with running_service(tiny, make_env=lambda task: SlowEnv()) as service:
            request = RolloutRequest(task=arith_task())
            job = asyncio.create_task(service.process(request))
            await asyncio.sleep(0.2)
            assert service.status()["in_flight"] == 1
            assert service.cancel(request.rollout_id)
            with pytest.raises(asyncio.CancelledError):
                await job
            assert not service.cancel(request.rollout_id)
            return service.status()

    status = asyncio.run(body())
    assert status["in_flight"] == 0


class BrokenEnv(ArithEnv):
    name = "arith"
    error = RuntimeError("the verifier crashed")

    async def step(self, action: str) -> StepResult:
        raise self.error


class ToolTimeoutEnv(BrokenEnv):
    error = TimeoutError("the verifier timed out")


class LostHostEnv(BrokenEnv):
    error = EnvHostLost("environment worker lost: ActorDiedError")


@pytest.mark.parametrize(
    ("env", "status"), [(BrokenEnv, "env_error"), (ToolTimeoutEnv, "env_error"), (LostHostEnv, "infra_error")]
)
def test_an_environment_that_raises_is_an_env_error_with_its_reason(tiny, env, status):
    # a TimeoutError of the env's own is its error, not the rollout running out of budget;
    # the env's host dying is not the env's failure
    async def body():
        async with running_service(tiny, make_env=lambda task: env()) as service:
            return await service.process(RolloutRequest(task=arith_task()))

    result = asyncio.run(body())
    assert result.status == status and result.reward is None
    assert str(env.error) in result.error and result.record["error"] == result.error


class LeakingEnv(ArithEnv):
    """``arith`` whose step raises with ``message`` (what a failing tool printed, say)."""

    name = "arith"

    def __init__(self, message: str):
        super().__init__()
        self.message = message

    async def step(self, action: str) -> StepResult:
        raise RuntimeError(self.message)


def test_a_failed_rollouts_error_holds_no_secret_and_is_bounded_in_its_record_and_warning(tiny, caplog):
    """An env's exception may quote what the process holds (the run's storage secret, the
    service gateway's token, an AWS key id) and run to megabytes (a test suite's whole
    output): the record and the warning hold it masked and cut to ``MAX_ERROR_CHARS``."""
    key_id = "AKIAABCDEFGHIJKLMNOP"

    async def body():
        async with running_service(tiny, secrets=["storage-secret-value"]) as service:
            token = (await service.gateway_server()).token
            message = (
                f"curl -H 'Bearer {token}' -u {key_id}:storage-secret-value failed\n" + "log line\n" * 10_000
            )
            service.make_env = lambda task: LeakingEnv(message)
            result = await service.process(RolloutRequest(task=arith_task()))
            await service.close()
            return result, token

    result, token = asyncio.run(body())
    error = result.record["error"]
    assert result.status == "env_error" and result.error == error
    assert error.startswith(
        "RuntimeError during run: curl -H 'Bearer **********' -u **********:********** failed"
    )
    assert len(error) == MAX_ERROR_CHARS and error.endswith("…")
    validate(to_table([result.record]))
    warned = [r.getMessage() for r in caplog.records if r.name == "rollout.service.arith"]
    assert warned == [f"rollout {result.rollout_id} of arith/{arith_task().id}: env_error: {error}"]
    for secret in (token, key_id, "storage-secret-value"):
        assert secret not in error and secret not in caplog.text


def test_each_envs_failed_rollouts_are_warned_on_a_logger_of_its_own(tiny, caplog):
    """The Prefect UI takes a few records a minute per logger and message template: with one
    logger for every env, an env whose sandbox failed every rollout kept the failures of the
    others out of the UI for as long as it failed."""
    tasks = [arith_task(), arith_task().model_copy(update={"env": "code"})]
    envs = {"arith": BrokenEnv, "code": type("BrokenCodeEnv", (BrokenEnv,), {"name": "code"})}

    async def body():
        async with running_service(tiny, make_env=lambda task: envs[task.env]()) as service:
            return [await service.process(RolloutRequest(task=task)) for task in tasks]

    assert [result.status for result in asyncio.run(body())] == ["env_error", "env_error"]
    warned = [record.name for record in caplog.records if "the verifier crashed" in record.getMessage()]
    assert warned == ["rollout.service.arith", "rollout.service.code"]


class SandboxDiedEnv(BrokenEnv):
    error = SandboxError("died", "the shell exited with status 1")


class SandboxStartFailedEnv(ArithEnv):
    name = "arith"

    async def reset(self, task: Task) -> list[dict[str, str]]:
        raise SandboxError("start_failed", "bwrap cannot create namespaces")


class SandboxStartFailedInRunEnv(BrokenEnv):
    error = SandboxError("start_failed", "could not start bash: no such file")


class SandboxStartFailedInEvalEnv(ArithEnv):
    """Scores in a sandbox of its own (as code's tester runs), which cannot start."""

    name = "arith"

    async def evaluate(self) -> float:
        raise SandboxError("start_failed", "the test harness never started")


@pytest.mark.parametrize(
    ("env", "status", "error"),
    [
        (
            SandboxStartFailedEnv,
            "infra_error",
            "sandbox start_failed during init: bwrap cannot create namespaces",
        ),
        (
            SandboxStartFailedInRunEnv,
            "infra_error",
            "sandbox start_failed during run: could not start bash: no such file",
        ),
        (
            SandboxStartFailedInEvalEnv,
            "infra_error",
            "sandbox start_failed during eval: the test harness never started",
        ),
        (SandboxDiedEnv, "env_error", "sandbox died during run: the shell exited with status 1"),
    ],
)
def test_a_sandbox_that_cannot_start_is_an_infra_error_and_one_that_dies_after_init_an_env_error(
    tiny, env, status, error, caplog
):
    """A sandbox that could not start is the machine's failure in any stage (one started for
    a step or for EVAL's tests too: they were env errors); what stops the agent's commands
    after the env started may be their own doing."""

    async def body():
        async with running_service(tiny, make_env=lambda task: env()) as service:
            return await service.process(RolloutRequest(task=arith_task()))

    result = asyncio.run(body())
    assert (result.status, result.error, result.reward) == (status, error, None)
    # the record holds the reason the worker's warning gives
    assert result.record["error"] == error
    assert f"{status}: {error}" in caplog.text


class ExitingEnv(ArithEnv):
    """``arith`` whose ``exits`` ("step" or "close") calls ``sys.exit`` (a user's env wrapping a CLI tool)."""

    name = "arith"

    def __init__(self, exits: str):
        super().__init__()
        self.exits = exits

    async def step(self, action: str) -> StepResult:
        if self.exits == "step":
            sys.exit(3)
        return await super().step(action)

    async def close(self) -> None:
        await super().close()
        if self.exits == "close":
            sys.exit(3)


@pytest.mark.parametrize(("exits", "status"), [("step", "env_error"), ("close", "ok")])
def test_an_env_that_calls_sys_exit_fails_its_rollout_alone(tiny, exits, status, caplog):
    """A SystemExit that escaped the rollout would end the event loop: every other rollout,
    the gateway and the worker with it."""

    async def body():
        envs = [ExitingEnv(exits), SlowEnv()]
        async with running_service(
            tiny, ServiceConfig(max_new_tokens=4), make_env=lambda task: envs.pop(0)
        ) as service:
            results = await asyncio.gather(
                *(service.process(RolloutRequest(task=arith_task())) for _ in range(2))
            )
            return results, service.gateway.sessions

    (exiting, other), sessions = asyncio.run(body())
    assert other.status in ("ok", "truncated"), other.error
    assert sessions == []
    if status == "env_error":
        assert exiting.status == "env_error"
        assert exiting.error == "RuntimeError during run: ExitingEnv.step called sys.exit(3)"
    else:
        assert exiting.status in ("ok", "truncated"), exiting.error
        assert "closing the env of rollout" in caplog.text


class LeakyCloseEnv(ArithEnv):
    """``arith`` whose close fails quoting a secret of the run and a key id (an S3 error body)."""

    async def close(self) -> None:
        await super().close()
        raise OSError("cleanup refused: secret storage-secret-value, key AKIAABCDEFGHIJKLMNOP")


def test_an_env_close_that_fails_quoting_credentials_is_logged_masked(tiny, caplog):
    async def body():
        async with running_service(
            tiny,
            ServiceConfig(max_new_tokens=4),
            make_env=lambda task: LeakyCloseEnv(),
            secrets=["storage-secret-value"],
        ) as service:
            return await service.process(RolloutRequest(task=arith_task()))

    result = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    assert "closing the env of rollout" in caplog.text and "cleanup refused" in caplog.text
    assert "storage-secret-value" not in caplog.text and "AKIAABCDEFGHIJKLMNOP" not in caplog.text


class BadObservationEnv(ArithEnv):
    """``arith`` whose step answers with ``observation`` and goes on."""

    name = "arith"
    observation: list[dict] = []

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=self.observation, reward=0.0, done=False, progress=0.5)


class RolelessObservationEnv(BadObservationEnv):
    observation = [{"content": "tool output"}]  # an env bug: no role


class LongObservationEnv(BadObservationEnv):
    observation = [{"role": "user", "content": "word " * 2000}]  # past max_context_tokens=1024


@pytest.mark.parametrize(
    ("env", "status", "reason"),
    [
        (RolelessObservationEnv, "env_error", "a chat message needs a 'role'"),
        (LongObservationEnv, "truncated", "context limit: session"),
    ],
)
def test_only_running_out_of_context_is_truncated_other_output_the_gateway_rejects_is_an_env_error(
    tiny, env, status, reason
):
    async def body():
        async with running_service(
            tiny, ServiceConfig(max_new_tokens=4), make_env=lambda task: env()
        ) as service:
            return await service.process(RolloutRequest(task=arith_task()))

    result = asyncio.run(body())
    assert result.status == status and reason in result.error
    assert result.record["error"] == result.error
    assert result.reward == (0.0 if status == "truncated" else None)


class NanRewardEnv(ArithEnv):
    name = "arith"
    reward = float("nan")

    async def evaluate(self) -> float:
        return self.reward


class StringRewardEnv(NanRewardEnv):
    reward = "1.0"


class NoRewardEnv(NanRewardEnv):
    reward = None  # an evaluate that forgot its return


class OutOfRangeProgressEnv(ArithEnv):
    name = "arith"
    progress = 5.0

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=[], reward=1.0, done=True, progress=self.progress)


class StringProgressEnv(OutOfRangeProgressEnv):
    progress = "0.5"


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        (NanRewardEnv, "non-finite reward nan"),
        (StringRewardEnv, "scored a reward of type str ('1.0'), not a number"),
        (NoRewardEnv, "scored no reward: its evaluate returned None"),
        (OutOfRangeProgressEnv, "progress 5.0, outside [0, 1]"),
        (StringProgressEnv, "reported progress of type str ('0.5'), not a number"),
    ],
)
def test_a_score_the_record_cannot_hold_is_an_env_error_and_the_record_stays_valid(tiny, env, reason):
    async def body():
        async with running_service(tiny, make_env=lambda task: env()) as service:
            return await service.process(RolloutRequest(task=arith_task()))

    result = asyncio.run(body())
    assert result.status == "env_error" and reason in result.error
    assert result.reward is None and (result.progress is None) == issubclass(env, OutOfRangeProgressEnv)
    validate(to_table([result.record]))  # the worker writes it like any other


class LateEvalEnv(ArithEnv):
    """``arith`` done in one step, whose evaluate takes longer than the whole 3 s budget: it
    ``blocks`` the event loop, or goes on when cancelled at the deadline."""

    name = "arith"
    blocks = True
    takes = 3.5

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=[], reward=1.0, done=True, progress=1.0)

    async def evaluate(self) -> float:
        if self.blocks:
            time.sleep(self.takes)
            return 1.0
        end = time.perf_counter() + self.takes
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(self.takes)
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        return 1.0


class CancelIgnoringEvalEnv(LateEvalEnv):
    blocks = False


@pytest.mark.parametrize("env", [LateEvalEnv, CancelIgnoringEvalEnv])
def test_an_evaluate_that_returns_past_the_budget_is_a_timeout_not_scored(tiny, env):
    # as a RUN past the budget is: its EVAL finds no time left. The budget leaves RUN room on
    # a loaded machine (1 s did not: "run ran past the rollout's 1 s budget")
    async def body():
        config = ServiceConfig(timeout_s=3.0, max_new_tokens=4)
        async with running_service(tiny, config, make_env=lambda task: env()) as service:
            return await service.process(RolloutRequest(task=arith_task()))

    result = asyncio.run(body())
    assert (result.status, result.reward, result.error) == (
        "timeout",
        None,
        "eval ran past the rollout's 3 s budget",
    )
    assert result.timing["eval"] > 3.0


class CancelledUnderEnv(ArithEnv):
    """``arith`` whose step awaits a reply that is cancelled under it (a sandbox's reader that died)."""

    name = "arith"

    async def step(self, action: str) -> StepResult:
        reply = asyncio.get_running_loop().create_future()
        reply.cancel()
        return await reply


def test_a_cancelled_error_the_env_raises_itself_is_an_env_error_with_its_reason(tiny, caplog):
    # only a cancel of the rollout cancels it: this one would vanish with no record
    async def body():
        async with running_service(tiny, make_env=lambda task: CancelledUnderEnv()) as service:
            return await service.process(RolloutRequest(task=arith_task())), service.status()

    result, status = asyncio.run(body())
    assert result.status == "env_error" and result.reward is None
    assert result.error == "CancelledError during run, not from a cancel of the rollout"
    assert result.error in caplog.text
    assert status["in_flight"] == 0 and status["finished"] == {"env_error": 1}
    validate(to_table([result.record]))


class HeldEnv(ArithEnv):
    """``arith`` that, in ``holds`` ("step" or "close"), sets ``reached`` and waits for
    ``release``; ``closed`` once its close has returned."""

    name = "arith"

    def __init__(self, holds: str, reached: asyncio.Event, release: asyncio.Event):
        super().__init__()
        self.holds, self.reached, self.release = holds, reached, release
        self.closed = False

    async def step(self, action: str) -> StepResult:
        if self.holds == "step":
            self.reached.set()
            await self.release.wait()
        return await super().step(action)

    async def close(self) -> None:
        if self.holds == "close":
            self.reached.set()
            await self.release.wait()
        await super().close()
        self.closed = True


@pytest.mark.parametrize("cancels", [1, 3])
def test_a_cancel_while_the_env_closes_keeps_the_finished_rollout_and_closes_its_session(tiny, cancels):
    """Cancelled while its env closes (after EVAL: its record is complete), a rollout waits
    for the close, ends its gateway session (releasing its replica) and returns its result;
    however many cancels come (an orchestrator stopping, then its own task cancelled). The
    cancels are dropped: the calling task is left with none pending, so the next rollout it
    runs tells its env's own CancelledError from a cancel (an env error, not a cancel)."""

    async def caller(service, request):
        result = await service.process(request)
        pending = asyncio.current_task().cancelling()
        try:
            after = await service.process(RolloutRequest(task=arith_task()))
        except asyncio.CancelledError:
            return result, pending, "cancelled"
        return result, pending, after.error

    async def body():
        reached, release = asyncio.Event(), asyncio.Event()
        envs = []

        def make_env(task):
            envs.append(CancelledUnderEnv() if envs else HeldEnv("close", reached, release))
            return envs[-1]

        async with running_service(tiny, ServiceConfig(max_new_tokens=4), make_env=make_env) as service:
            request = RolloutRequest(task=arith_task())
            job = asyncio.create_task(caller(service, request))
            await asyncio.wait_for(reached.wait(), 60)
            assert service.cancel(request.rollout_id)
            for _ in range(cancels - 1):
                await asyncio.sleep(0)
                job.cancel()
            await asyncio.sleep(0)  # the cancels land while the env is closing
            release.set()
            result, pending, later = await job
            assert envs[0].closed, "the env is closed before process() returns"
            router = service.gateway.router
            return (
                result,
                pending,
                later,
                service.gateway.sessions,
                router.load(router.replicas[0]),
                service.status(),
            )

    result, pending, later, sessions, load, status = asyncio.run(body())
    assert later == "CancelledError during run, not from a cancel of the rollout"
    assert pending == 0
    assert result.status in ("ok", "truncated") and result.reward is not None, result.error
    validate(to_table([result.record]))
    assert sessions == [] and load == 0 and status["in_flight"] == 0
    assert sum(status["finished"].values()) == 2


class StubbornCloseEnv(HeldEnv):
    """``HeldEnv`` whose close goes on waiting when cancelled (a close that waits for its thread)."""

    async def close(self) -> None:
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                return await super().close()


@pytest.mark.parametrize("env", [HeldEnv, StubbornCloseEnv])
def test_an_env_whose_close_hangs_is_left_and_the_rollout_still_ends(tiny, monkeypatch, caplog, env):
    """The hung close is cancelled as it is left: one that stops when cancelled never
    finishes; one that goes on when cancelled finishes once it is let."""
    monkeypatch.setattr(service_module, "ENV_CLOSE_TIMEOUT_S", 0.2)
    hung = env("close", asyncio.Event(), asyncio.Event())

    async def body():
        async with running_service(
            tiny, ServiceConfig(max_new_tokens=4), make_env=lambda task: hung
        ) as service:
            request = RolloutRequest(task=arith_task())
            result = await asyncio.wait_for(service.process(request), 60)
            sessions = service.gateway.sessions
            hung.release.set()  # the close left running may end now
            await asyncio.sleep(0.05)
            return result, request.rollout_id, sessions

    result, rollout_id, sessions = asyncio.run(body())
    assert result.status in ("ok", "truncated") and sessions == []
    assert hung.closed == (env is StubbornCloseEnv)
    assert (
        f"closing the env of rollout {rollout_id} failed: {env.__name__}.close did not return "
        "within 0.2 s; left running" in caplog.text
    )


class CancelledCloseEnv(HeldEnv):
    """``HeldEnv`` whose close, once done, awaits a future cancelled under it."""

    async def close(self) -> None:
        await super().close()
        gone = asyncio.get_running_loop().create_future()
        gone.cancel()
        await gone


@pytest.mark.parametrize("cancelled", [False, True])
def test_an_env_whose_close_raises_its_own_cancelled_error_still_has_its_session_closed(
    tiny, cancelled, caplog
):
    """The CancelledError of an env's close is one more failing cleanup step: logged, and the
    gateway session (its replica, the engine's cache of it) is still closed."""

    async def body():
        reached, release = asyncio.Event(), asyncio.Event()
        env = CancelledCloseEnv("step" if cancelled else "none", reached, release)
        async with running_service(
            tiny, ServiceConfig(max_new_tokens=4), make_env=lambda task: env
        ) as service:
            request = RolloutRequest(task=arith_task())
            job = asyncio.create_task(service.process(request))
            if cancelled:
                await asyncio.wait_for(reached.wait(), 60)
                service.cancel(request.rollout_id)
            outcome = (await asyncio.gather(job, return_exceptions=True))[0]
            return outcome, env.closed, service.gateway.sessions

    outcome, closed, sessions = asyncio.run(body())
    if cancelled:
        assert isinstance(outcome, asyncio.CancelledError)
    else:
        assert outcome.status in ("ok", "truncated") and outcome.reward is not None, outcome.error
    assert closed and sessions == []
    assert "closing the env of rollout" in caplog.text


def test_a_rollout_id_in_flight_is_refused_and_the_first_rollout_stays_cancellable(tiny):
    task = arith_task()

    async def body():
        reached, release = asyncio.Event(), asyncio.Event()

        def make_env(task):
            return HeldEnv("step", reached, release)

        config = ServiceConfig(max_new_tokens=4)
        async with (
            running_service(tiny, config, make_env=make_env) as service,
            ServiceServer(service) as server,
        ):
            first = asyncio.create_task(service.process(RolloutRequest(task=task, rollout_id="job-1")))
            await asyncio.wait_for(reached.wait(), 60)
            with pytest.raises(DuplicateRollout, match="'job-1' is already in flight"):
                await asyncio.wait_for(service.process(RolloutRequest(task=task, rollout_id="job-1")), 60)
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                duplicate = await client.post(
                    "/process",
                    json={"task": task.model_dump(), "rollout_id": "job-1"},
                    headers={"Authorization": f"Bearer {server.token}"},
                )
            cancelled = service.cancel("job-1")
            with pytest.raises(asyncio.CancelledError):
                await first
            return duplicate, cancelled, service.status()

    duplicate, cancelled, status = asyncio.run(body())
    assert duplicate.status_code == 409 and "already in flight" in duplicate.json()["detail"]
    assert cancelled and status["in_flight"] == 0


def test_a_cancelled_process_handler_stays_cancelled_and_so_does_its_rollout(tiny):
    """The client's request is cancelled (the server shuts down, say): the handler ends
    cancelled, not with a 409 as when the rollout alone is cancelled, and takes the rollout with it."""

    async def body():
        reached, never = asyncio.Event(), asyncio.Event()
        async with running_service(
            tiny, ServiceConfig(max_new_tokens=4), make_env=lambda task: HeldEnv("step", reached, never)
        ) as service:
            app = create_app(service, "token")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
                call = asyncio.create_task(
                    client.post(
                        "/process",
                        json={"task": arith_task().model_dump()},
                        headers={"Authorization": "Bearer token"},
                    )
                )
                await asyncio.wait_for(reached.wait(), 60)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            return service.status()

    assert asyncio.run(body())["in_flight"] == 0


@pytest.mark.parametrize("failover", [False, True])
def test_a_killed_engine_replica_gives_infra_errors_and_the_run_continues(tiny, failover):
    """Without failover the rollouts routed to the dead replica end as ``infra_error``
    (never scored); with it they move to the live replica. Either way the run goes on."""

    async def body():
        model, tokenizer = tiny
        engines = [TorchEngine(model, tokenizer, name=f"torch-{i}") for i in range(2)]
        router = Router(engines, RouterConfig(failover=failover))
        gateway = Gateway(router, tokenizer, GatewayConfig(max_context_tokens=1024))
        service = RolloutService(
            gateway, lambda task: registry.make(task.env), ServiceConfig(max_new_tokens=4)
        )
        await engines[0].close()
        results = await asyncio.gather(
            *(service.process(RolloutRequest(task=arith_task(), seed=i)) for i in range(16))
        )
        await router.check_health()
        after = await asyncio.gather(
            *(service.process(RolloutRequest(task=arith_task(), seed=i)) for i in range(8))
        )
        await engines[1].close()
        return results, after, router.replicas

    results, after, replicas = asyncio.run(body())
    failed = [r for r in results if r.status == "infra_error"]
    if failover:
        assert not failed
    else:
        assert failed and len(failed) < len(results)
        assert all(r.reward is None and "engine" in r.error for r in failed)
    assert all(r.status in ("ok", "truncated") for r in after)
    assert replicas == ["torch-1"]


class OneCallProgram(ArithEnv):
    """A self-driving env whose program makes ``calls`` chat calls on the service's HTTP
    gateway and ends whatever they answer (as a scaffold that gives up on an error does)."""

    name = "arith"
    drives_itself = True
    calls = 1
    # max_turns bounds a program's calls, and arith's config allows one turn
    config_cls = EnvConfig

    def attach_gateway(self, gateway) -> None:
        self.gateway = gateway

    async def run(self) -> StepResult:
        gateway = self.gateway
        headers = {"Authorization": f"Bearer {gateway.api_key}", gateway.header: gateway.session_id}
        messages = [{"role": "user", "content": "2+2?"}]
        async with httpx.AsyncClient() as client:
            for _ in range(self.calls):
                await client.post(
                    f"{gateway.base_url}/chat/completions",
                    headers=headers,
                    json={"model": "policy", "messages": messages, "max_tokens": 4},
                )
        return StepResult([], 0.0, True, 0.0)

    async def evaluate(self) -> float:
        return 0.0


class AdministeringProgram(OneCallProgram):
    """A self-driving program that, besides its one chat call, tries the gateway's session
    administration with the token it was handed, and keeps each answer's status and error."""

    async def run(self) -> StepResult:
        gateway = self.gateway
        headers = {"Authorization": f"Bearer {gateway.api_key}"}
        own = f"{gateway.base_url}/sessions/{gateway.session_id}"
        async with httpx.AsyncClient(headers=headers) as client:
            answers = [
                await client.post(f"{gateway.base_url}/sessions", json={"task": "arith", "prompt_id": "p"}),
                await client.post(f"{own}/record", json={"reward": 1.0}),
                await client.post(f"{gateway.base_url}/records", json={"records": [{}]}),
                await client.delete(own),
            ]
        self.answers = [
            (a.status_code, a.json()["error"]["message"] if a.is_error else None) for a in answers
        ]
        return await super().run()


def test_a_self_driving_program_may_not_open_record_or_close_sessions_with_its_token(tiny):
    """A custom self-driving env holds the token of the service's HTTP gateway: it opened
    sessions of its own (generating past its rollout's budget and seed, never recorded in its
    result, open until the idle timeout) and could record or delete its rollout's. The service's
    gateway refuses session administration with a 403 naming what it serves."""

    async def body():
        model, tokenizer = tiny
        engine = TorchEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig())
        env = AdministeringProgram()
        service = RolloutService(gateway, lambda task: env, ServiceConfig(scheduler="none", max_new_tokens=4))
        try:
            result = await service.process(RolloutRequest(task=arith_task()))
            return result, env.answers, gateway.sessions
        finally:
            await service.close()
            await engine.close()

    result, answers, still_open = asyncio.run(body())
    assert [status for status, _ in answers] == [403] * 4, answers
    assert all("only the inference endpoints" in message for _, message in answers), answers
    assert still_open == []
    assert result.status in ("ok", "truncated"), result.error
    assert result.turns == 1


class FailingOnceEngine(TorchEngine):
    """Fails its first ``failures`` generations (a replica that died, or a transient failure)."""

    failures = 1

    async def generate(self, session_id, prompt_ids, params):
        if self.failures:
            self.failures -= 1
            raise EngineError(f"{self.name} died (injected)")
        return await super().generate(session_id, prompt_ids, params)


async def one_program_rollout(engine, gateway: Gateway, env) -> RolloutResult:
    """One rollout of self-driving ``env`` on a service over ``gateway``; closes both after."""
    service = RolloutService(gateway, lambda task: env, ServiceConfig(scheduler="none", max_new_tokens=4))
    try:
        return await service.process(RolloutRequest(task=arith_task()))
    finally:
        await service.close()
        await engine.close()


class LeakyCloseProgram(OneCallProgram):
    """A self-driving env whose close fails quoting its program's environment, the token of
    the service's HTTP gateway in it (a harness's command line in its error)."""

    async def close(self) -> None:
        await super().close()
        raise OSError(f"harness exited 1: OPENAI_API_KEY={self.gateway.api_key} agent --task 1")


def test_a_self_driving_env_close_that_fails_quoting_the_gateway_token_is_logged_masked(tiny, caplog):
    """The token of the service's HTTP gateway, masked in a record's error and its warning,
    was logged as it was when the env's close (or another cleanup step) quoted it."""

    async def body():
        model, tokenizer = tiny
        engine = TorchEngine(model, tokenizer, name="torch-0")
        env = LeakyCloseProgram()
        result = await one_program_rollout(engine, Gateway(Router([engine]), tokenizer, GatewayConfig()), env)
        return result, env.gateway.api_key

    result, token = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    assert "closing the env of rollout" in caplog.text and "harness exited 1" in caplog.text
    assert token not in caplog.text


class SamplingProgram(OneCallProgram):
    """Goes on with one conversation, one chat call with each of ``asked`` (sampling fields),
    and keeps the answers' status codes and error messages."""

    asked: list[dict] = [{}, {"temperature": 0.9}]

    async def run(self) -> StepResult:
        gateway = self.gateway
        headers = {"Authorization": f"Bearer {gateway.api_key}", gateway.header: gateway.session_id}
        messages = [{"role": "user", "content": "2+2?"}]
        self.answers = []
        async with httpx.AsyncClient() as client:
            for sampling in self.asked:
                response = await client.post(
                    f"{gateway.base_url}/chat/completions",
                    headers=headers,
                    json={"model": "policy", "messages": messages, "max_tokens": 2, **sampling},
                )
                answer = response.json()
                self.answers.append((response.status_code, answer.get("error", {}).get("message")))
                if response.status_code == 200:
                    messages += [answer["choices"][0]["message"], {"role": "user", "content": "and 3+3?"}]
        return StepResult([], 0.0, True, 0.0)


class RecordingEngine(TorchEngine):
    """Keeps the sampling of each generation in ``params``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params = []

    async def generate(self, session_id, prompt_ids, params):
        self.params.append(params)
        return await super().generate(session_id, prompt_ids, params)


def test_a_self_driving_program_samples_at_the_services_temperature_and_may_not_ask_another(tiny):
    """A training rollout's program that leaves the temperature unset samples at
    ServiceConfig.temperature; asking for another is a 400 (never sampled)."""

    async def body():
        model, tokenizer = tiny
        engine = RecordingEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig())
        env = SamplingProgram()
        service = RolloutService(
            gateway, lambda task: env, ServiceConfig(scheduler="none", max_new_tokens=4, temperature=0.7)
        )
        try:
            await service.process(RolloutRequest(task=arith_task()))
        finally:
            await service.close()
            await engine.close()
        return env.answers, [(p.temperature, p.top_p) for p in engine.params]

    (first, second), sampled = asyncio.run(body())
    assert first == (200, None)
    assert second[0] == 400 and "at the run's temperature 0.7 and top_p 1.0" in second[1]
    assert sampled == [(0.7, 1.0)]


class TokenBudgetProgram(SamplingProgram):
    """Two chat calls: one that leaves its token budget unset, one that asks for more than the service's."""

    asked = [{"max_tokens": None}, {"max_tokens": 50}]


def test_a_self_driving_programs_calls_generate_at_most_the_services_max_new_tokens(tiny):
    """As the actions of a driven env do: a call that left its budget unset took the
    gateway's max_new_tokens (256 by default), and one that asked for more got it."""

    async def body():
        model, tokenizer = tiny
        engine = RecordingEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig())
        env = TokenBudgetProgram()
        service = RolloutService(gateway, lambda task: env, ServiceConfig(scheduler="none", max_new_tokens=3))
        try:
            result = await service.process(RolloutRequest(task=arith_task()))
        finally:
            await service.close()
            await engine.close()
        return result, env.answers, [p.max_new_tokens for p in engine.params]

    result, answers, budgets = asyncio.run(body())
    assert answers == [(200, None), (200, None)]
    assert budgets == [3, 3] and result.turns == 2


class UnseededProgram(SamplingProgram):
    """Three chat calls, the first two sending no seed (as most scaffolds do), the last its own."""

    asked = [{}, {}, {"seed": 5}]


def two_turns(result: RolloutResult) -> list[int]:
    """The tokens of the first two turns of ``result``'s record (prompts and actions)."""
    record = result.record
    return [token for token, turn in zip(record["tokens"], record["turn"], strict=True) if turn < 2]


@pytest.mark.parametrize("fixed", [True, False], ids=["training", "evaluation"])
def test_a_self_driving_programs_unseeded_calls_sample_with_seeds_of_the_rollouts_seed(tiny, fixed):
    """A program's calls that send no seed were unseeded whatever the rollout's seed, so an
    evaluation of a self-driving env was not reproducible from its seed. They now sample with
    the rollout's seed hashed with the session's length: each call its own, the same for the
    same rollout seed; unseeded for a rollout without one. A seed the program sends keeps its
    meaning (its own in an evaluation, hashed with its session in training)."""

    async def body():
        model, tokenizer = tiny
        engine = RecordingEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig())
        config = ServiceConfig(scheduler="none", max_new_tokens=4, temperature=1.0)
        service = RolloutService(gateway, lambda task: UnseededProgram(), config, fixed_sampling=fixed)
        results = []
        try:
            for seed in (1, 1, 2, None):
                results.append(await service.process(RolloutRequest(task=arith_task(), seed=seed)))
        finally:
            await service.close()
            await engine.close()
        return results, [p.seed for p in engine.params]

    results, seeds = asyncio.run(body())
    assert [r.turns for r in results] == [3] * 4, [r.error for r in results]
    first, again, other, unseeded = (seeds[i : i + 3] for i in range(0, 12, 3))
    assert None not in first and len(set(first)) == 3 and 5 not in first[:2]
    assert first[:2] == again[:2] and two_turns(results[0]) == two_turns(results[1])
    assert not set(other[:2]) & set(first[:2])
    assert unseeded[:2] == [None, None]
    if fixed:
        assert 5 not in (first[2], unseeded[2])
    else:
        assert first[2] == again[2] == other[2] == unseeded[2] == 5


@pytest.mark.parametrize("retried", [False, True])
def test_an_engine_failure_a_self_driving_program_gives_up_on_is_an_infra_error(tiny, retried):
    """The program of a self-driving env sees an engine failure only as an HTTP 503: when it
    ends on that failure the rollout is an ``infra_error`` (never scored), as a failure in
    the service's own loop is, not an ``ok`` trajectory scored 0. One it retried past is not."""

    async def body():
        model, tokenizer = tiny
        engine = FailingOnceEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine], RouterConfig(failover=False)), tokenizer, GatewayConfig())
        env = OneCallProgram()
        env.calls = 2 if retried else 1
        return await one_program_rollout(engine, gateway, env)

    result = asyncio.run(body())
    if retried:
        assert result.status in ("ok", "truncated") and result.turns == 1, result.error
    else:
        assert result.status == "infra_error" and result.reward is None
        assert "died (injected)" in result.error


class RaisingOnFailureProgram(OneCallProgram):
    """Makes one chat call and raises on its HTTP error (a scaffold that fails on a 503)."""

    async def run(self) -> StepResult:
        gateway = self.gateway
        headers = {"Authorization": f"Bearer {gateway.api_key}", gateway.header: gateway.session_id}
        async with httpx.AsyncClient() as client:
            response = await client.post(
                f"{gateway.base_url}/chat/completions",
                headers=headers,
                json={"model": "policy", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 4},
            )
        response.raise_for_status()
        return StepResult([], 0.0, True, 0.0)


def test_a_self_driving_program_that_raises_on_an_engine_failure_is_an_infra_error(tiny):
    # not an env_error: the program failed because the engine did
    async def body():
        model, tokenizer = tiny
        engine = FailingOnceEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine], RouterConfig(failover=False)), tokenizer, GatewayConfig())
        return await one_program_rollout(engine, gateway, RaisingOnFailureProgram())

    result = asyncio.run(body())
    assert result.status == "infra_error" and result.reward is None
    assert "died (injected)" in result.error


class LongMessageProgram(OneCallProgram):
    """Sends one message too long for the context (HTTP 400), then, as ``then`` says, ends
    there, fails on it, or retries with a short one."""

    then = "ends"

    async def run(self) -> StepResult:
        gateway = self.gateway
        headers = {"Authorization": f"Bearer {gateway.api_key}", gateway.header: gateway.session_id}
        async with httpx.AsyncClient() as client:
            for content in ["2+2? " * 200, "2+2?"]:
                response = await client.post(
                    f"{gateway.base_url}/chat/completions",
                    headers=headers,
                    json={
                        "model": "policy",
                        "messages": [{"role": "user", "content": content}],
                        "max_tokens": 4,
                    },
                )
                if self.then == "ends" or response.status_code == 200:
                    break
                if self.then == "fails":
                    response.raise_for_status()
        return StepResult([], 1.0, True, 1.0)

    async def evaluate(self) -> float:
        return 1.0


@pytest.mark.parametrize("then", ["ends", "fails", "retries"])
def test_a_self_driving_program_whose_last_call_is_over_the_context_is_truncated(tiny, then):
    """The program sees the context limit only as an HTTP 400. Ending on it is a truncated
    rollout, still scored (its work is there to evaluate); failing on it is truncated with
    reward 0, as the service's own loop is; one it retried past with a shorter call is not."""

    async def body():
        model, tokenizer = tiny
        engine = TorchEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=256))
        env = LongMessageProgram()
        env.then = then
        return await one_program_rollout(engine, gateway, env)

    result = asyncio.run(body())
    if then == "retries":
        assert result.status in ("ok", "truncated") and result.turns == 1 and result.reward == 1.0
        assert result.error is None
        return
    assert result.status == "truncated" and result.turns == 0
    assert "max_context_tokens=256" in result.error
    assert result.reward == (1.0 if then == "ends" else 0.0)


class TurnsProgram(OneCallProgram):
    """Goes on calling the model until a call is refused (HTTP 400: past its max_turns), then,
    as ``then`` says, ends there or fails on it; its work scores 1."""

    then = "ends"

    async def run(self) -> StepResult:
        gateway = self.gateway
        headers = {"Authorization": f"Bearer {gateway.api_key}", gateway.header: gateway.session_id}
        messages = [{"role": "user", "content": "2+2?"}]
        async with httpx.AsyncClient() as client:
            while True:
                response = await client.post(
                    f"{gateway.base_url}/chat/completions",
                    headers=headers,
                    json={"model": "policy", "messages": messages, "max_tokens": 2},
                )
                if response.status_code != 200:
                    break
                messages += [response.json()["choices"][0]["message"], {"role": "user", "content": "and?"}]
        if self.then == "fails":
            response.raise_for_status()
        return StepResult([], 0.0, True, 0.5)

    async def evaluate(self) -> float:
        return 1.0


@pytest.mark.parametrize("then", ["ends", "fails"])
def test_a_self_driving_program_refused_past_max_turns_is_truncated_and_still_scored(tiny, then):
    """As a driven env's rollout out of turns is: a program that fails on the refusal (a
    scaffold that raises on an HTTP error) was truncated with reward 0, never evaluated. Its
    error is None, as a driven one's is (the status and turns say why): it read "context
    limit: ... max_turns=2", counted among the rollouts out of context."""

    async def body():
        model, tokenizer = tiny
        engine = TorchEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig())
        env = TurnsProgram()
        env.then = then
        config = ServiceConfig(scheduler="none", max_new_tokens=2, max_turns=2)
        service = RolloutService(gateway, lambda task: env, config)
        try:
            return await service.process(RolloutRequest(task=arith_task()))
        finally:
            await service.close()
            await engine.close()

    result = asyncio.run(body())
    assert (result.status, result.turns, result.reward) == ("truncated", 2, 1.0)
    assert (result.error, result.record["error"]) == (None, None)


class TextPromptProgram(OneCallProgram):
    """A self-driving env scored by a reward model whose program prompts with text (``/v1/completions``)."""

    async def run(self) -> StepResult:
        gateway = self.gateway
        headers = {"Authorization": f"Bearer {gateway.api_key}", gateway.header: gateway.session_id}
        async with httpx.AsyncClient() as client:
            await client.post(
                f"{gateway.base_url}/completions",
                headers=headers,
                json={"model": "policy", "prompt": "2+2=", "max_tokens": 4},
            )
        return StepResult([], 0.0, True, 0.0)


class RecordingJudge:
    """Stands for ``service.rewards``: scores every conversation 0.5 and keeps what it read."""

    def __init__(self):
        self.read: list[list[dict]] = []

    def check(self, name: str) -> None:
        pass

    async def score(self, name, messages, waiting) -> float:
        self.read.append(list(messages))
        return 0.5


def test_a_reward_model_is_not_given_a_self_driving_conversation_without_its_text_prompts(tiny):
    # the session's messages hold only the replies to text prompts: the judge scored the
    # replies without what the policy was asked
    async def body():
        model, tokenizer = tiny
        engine = TorchEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig())
        env = TextPromptProgram(EnvConfig(reward_model="judge"))
        service = RolloutService(gateway, lambda task: env, ServiceConfig(scheduler="none", max_new_tokens=4))
        service.rewards = judge = RecordingJudge()
        try:
            return await service.process(RolloutRequest(task=arith_task())), judge.read
        finally:
            await service.close()
            await engine.close()

    result, read = asyncio.run(body())
    assert read == []
    assert (result.status, result.reward, result.turns) == ("env_error", None, 1)
    assert "/v1/chat/completions" in result.error and "judge" in result.error


def test_a_client_that_drops_its_process_request_cancels_its_rollout(tiny):
    """A client gone (its timeout ran out, its process died) gets no answer: its rollout
    must not go on holding a slot and its env until it ends on its own (here: never)."""

    async def body():
        reached, never = asyncio.Event(), asyncio.Event()
        envs = []

        def make_env(task):
            envs.append(HeldEnv("step", reached, never))
            return envs[-1]

        async with (
            running_service(tiny, ServiceConfig(max_new_tokens=4), make_env=make_env) as service,
            ServiceServer(service) as server,
        ):
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                call = asyncio.create_task(
                    client.post(
                        "/process",
                        json={"task": arith_task().model_dump(), "rollout_id": "job-1"},
                        headers={"Authorization": f"Bearer {server.token}"},
                    )
                )
                await asyncio.wait_for(reached.wait(), 60)
                call.cancel()  # closes the connection
                with pytest.raises(asyncio.CancelledError):
                    await call
            try:
                await asyncio.wait_for(ended(service), 60)
                return envs[0].closed
            finally:
                never.set()  # lets the server stop when the rollout was left running

    async def ended(service):
        while service.status()["in_flight"]:
            await asyncio.sleep(0.01)

    assert asyncio.run(body())


@contextlib.asynccontextmanager
async def dropped_while_closing(tiny):
    """A service's HTTP API whose client dropped /process of rollout ``job-1`` (its connection
    closed), the rollout held closing its env: yields the client, the request to retry it
    with, the event that lets the close finish, and the envs made (later ones are arith's)."""
    stepping, step_release = asyncio.Event(), asyncio.Event()
    closing, close_release = asyncio.Event(), asyncio.Event()

    class SlowToClose(HeldEnv):
        async def close(self) -> None:
            closing.set()
            await close_release.wait()
            await super().close()

    envs = []

    def make_env(task):
        envs.append(SlowToClose("step", stepping, step_release) if not envs else ArithEnv())
        return envs[-1]

    async with (
        running_service(tiny, ServiceConfig(max_new_tokens=4), make_env=make_env) as service,
        ServiceServer(service) as server,
        httpx.AsyncClient(
            base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {server.token}"}
        ) as client,
    ):
        request = {"task": arith_task().model_dump(), "rollout_id": "job-1", "include_tokens": False}
        dropped = asyncio.create_task(client.post("/process", json=request))
        await asyncio.wait_for(stepping.wait(), 60)
        dropped.cancel()  # closes the connection
        await asyncio.wait_for(closing.wait(), 60)
        yield client, request, close_release, envs


def test_a_retry_right_after_the_client_dropped_waits_for_the_dropped_rollout_to_unwind(tiny):
    """A client that drops its /process (its timeout ran out) and retries it with the same
    rollout id got a 409 "already in flight" while the dropped rollout still unwound (its env
    closing): the retry must run once that one has ended."""

    async def body():
        async with dropped_while_closing(tiny) as (client, request, close_release, envs):
            retry = asyncio.create_task(client.post("/process", json=request))
            # a 409 comes back at once; the retry otherwise waits for the close
            await asyncio.wait([retry], timeout=1)
            close_release.set()
            reply = await retry
            return reply.status_code, reply.json(), len(envs)

    status, reply, envs_made = asyncio.run(body())
    assert status == 200, reply
    assert (reply["rollout_id"], envs_made) == ("job-1", 2)


def rollout_tasks() -> int:
    """The rollouts of the service's HTTP API in flight (their tasks started), a retry
    waiting for a dropped one included."""
    return sum(
        task.get_coro().__qualname__.endswith("after_dropped")
        and inspect.getcoroutinestate(task.get_coro()) != inspect.CORO_CREATED
        for task in asyncio.all_tasks()
    )


def test_a_retry_waiting_for_its_dropped_rollout_is_cancelled_by_cancel(tiny):
    """A retry that waits for the rollout its client dropped was out of reach of /cancel:
    the cancel reached the dropped rollout alone (already cancelled, closing its env) and
    answered 200, and the retry then ran its rollout all the same."""

    async def body():
        async with dropped_while_closing(tiny) as (client, request, close_release, envs):
            retry = asyncio.create_task(client.post("/process", json=request))
            while rollout_tasks() != 2:  # the dropped one and the retry's, run up to its wait
                await asyncio.sleep(0.01)
            cancelled = await client.post("/cancel", json={"rollout_id": "job-1"})
            close_release.set()
            reply = await retry
            return cancelled.status_code, reply.status_code, reply.json(), len(envs)

    cancelled, status, reply, envs_made = asyncio.run(body())
    assert cancelled == 200
    assert (status, reply) == (409, {"detail": "rollout job-1 was cancelled"})
    assert envs_made == 1


def test_a_retry_dropped_while_it_waits_leaves_the_next_retry_waiting_too(tiny):
    """A retry whose client dropped it in turn while it waited took the place of the rollout
    it waited for among those dropped, and was gone once its wait was cancelled: the next
    retry found nothing to wait for and was refused 409 while that rollout still unwound."""

    async def body():
        async with dropped_while_closing(tiny) as (client, request, close_release, envs):
            first_retry = asyncio.create_task(client.post("/process", json=request))
            while rollout_tasks() != 2:
                await asyncio.sleep(0.01)
            first_retry.cancel()
            while rollout_tasks() != 1:  # its wait cancelled
                await asyncio.sleep(0.01)
            retry = asyncio.create_task(client.post("/process", json=request))
            while rollout_tasks() != 2 and not retry.done():
                await asyncio.sleep(0.01)
            close_release.set()
            reply = await retry
            return reply.status_code, reply.json(), len(envs)

    status, reply, envs_made = asyncio.run(body())
    assert status == 200, reply
    assert (reply["rollout_id"], envs_made) == ("job-1", 2)


def test_a_stop_returns_once_the_requests_its_drain_cut_short_have_ended(tiny):
    """uvicorn cancels the requests still running when the drain ends but does not wait for
    them: the stop returned while a cut /process still unwound (its rollout in flight, its env
    open, its 503 unsent), and whatever the caller closed next went from under it."""

    async def body():
        reached, never = asyncio.Event(), asyncio.Event()
        envs = []

        def make_env(task):
            envs.append(HeldEnv("step", reached, never))
            return envs[-1]

        async with running_service(tiny, ServiceConfig(max_new_tokens=4), make_env=make_env) as service:
            server = await ServiceServer(service, drain_timeout_s=0).start()
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                call = asyncio.create_task(
                    client.post(
                        "/process",
                        json={"task": arith_task().model_dump()},
                        headers={"Authorization": f"Bearer {server.token}"},
                    )
                )
                await asyncio.wait_for(reached.wait(), 60)
                await asyncio.wait_for(server.stop(), 60)
                ended = {"in_flight": service.status()["in_flight"], "env_closed": envs[0].closed}
                return ended, await call

    ended, reply = asyncio.run(body())
    assert ended == {"in_flight": 0, "env_closed": True}
    assert reply.status_code == 503
    assert reply.json()["detail"].startswith("the rollout-service server is stopping")


def test_a_stop_waits_a_bounded_time_for_a_request_that_never_ends_unwinding(monkeypatch, caplog):
    """A request whose unwinding hangs (its cancel swallowed) must not hold the stop for ever."""
    from rollout import http_server

    monkeypatch.setattr(http_server, "UNWIND_TIMEOUT_S", 0.2)
    reached, released = asyncio.Event(), asyncio.Event()

    async def app(scope, receive, send):
        reached.set()
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await released.wait()

    async def body():
        server = http_server.AppServer(app, drain_timeout_s=0)
        await server.start()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as client:
            call = asyncio.create_task(client.get("/"))
            await asyncio.wait_for(reached.wait(), 60)
            await asyncio.wait_for(server.stop(), 30)
            released.set()
            with contextlib.suppress(httpx.HTTPError):
                await call

    with caplog.at_level(logging.WARNING, logger="rollout.http_server"):
        asyncio.run(body())
    assert "stopped with 1 requests still unwinding 0.2 s after their cancel" in caplog.text


def test_a_stop_cancelled_midway_still_stops_the_server(tiny):
    """A cancelled stop (a worker's shutdown cancelled in turn) cancelled uvicorn's serve task
    with it, before that closed its socket: the server went on accepting and serving for the
    process's life, and a later stop raised that task's CancelledError."""

    async def body():
        async with running_service(tiny, ServiceConfig(max_new_tokens=4)) as service:
            server = await ServiceServer(service).start()
            stopping = asyncio.create_task(server.stop())
            await asyncio.sleep(0)  # the stop has begun
            stopping.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stopping
            await asyncio.wait_for(server.stop(), 60)
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection("127.0.0.1", server.port)

    asyncio.run(body())


def test_a_stopped_server_serves_again_once_started_again(tiny):
    # uvicorn's server runs once: a second start took its stale state for a bound socket (IndexError)
    async def body():
        async with running_service(tiny, ServiceConfig(max_new_tokens=4)) as service:
            server = ServiceServer(service)
            answers = []
            for _ in range(2):
                async with server, httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                    status = await client.get("/status", headers={"Authorization": f"Bearer {server.token}"})
                    answers.append(status.status_code)
            return answers

    assert asyncio.run(body()) == [200, 200]


@pytest.mark.parametrize("sent", ["with a length", "chunked"])
def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(tiny, sent):
    """A body is read and parsed before the app looks at it: without a limit, a client could
    make the server hold one as large as its memory (one without the bearer token is never
    read: the next test)."""
    body = b'{"task": "' + b"x" * 5000 + b'"}'

    async def chunks():
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    async def run():
        async with (
            running_service(tiny, ServiceConfig(max_new_tokens=4)) as service,
            ServiceServer(service, max_body_bytes=4096) as server,
        ):
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                refused = await client.post(
                    "/process",
                    content=body if sent == "with a length" else chunks(),
                    headers={"Authorization": f"Bearer {server.token}"},
                )
                served = await client.get("/health")
            return refused, served

    refused, served = asyncio.run(run())
    assert refused.status_code == 413 and "4096 bytes" in refused.json()["detail"]
    assert served.status_code == 200


@pytest.mark.parametrize("authorization", [None, "Bearer wrong"])
def test_a_request_without_the_bearer_token_is_answered_401_without_its_body_read(tiny, authorization):
    """The app reads and parses a body before it checks the token: parsed, a body under the
    size limit still takes several times its size (8 bytes for each item of a list of ints).
    Here the body is never sent whole: a server that reads it never answers."""

    async def run():
        async with (
            running_service(tiny, ServiceConfig(max_new_tokens=4)) as service,
            ServiceServer(service) as server,
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            auth = f"Authorization: {authorization}\r\n" if authorization else ""
            head = (
                f"POST /process HTTP/1.1\r\nHost: service\r\n{auth}Content-Type: application/json\r\n"
                "Content-Length: 1000000\r\n\r\n"
            )
            writer.write(head.encode() + b'{"task": [')
            await writer.drain()
            try:
                # the response alone: the connection stays open after it (keep-alive, 5 s)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
                return head + await asyncio.wait_for(reader.readexactly(length), 10)
            finally:
                writer.close()

    reply = asyncio.run(run())
    assert reply.startswith(b"HTTP/1.1 401")
    assert b"missing or wrong bearer token" in reply


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"])
def test_nothing_but_health_answers_without_the_bearer_token(tiny, path):
    # FastAPI's own pages described every endpoint to anyone who could connect
    async def body():
        async with running_service(tiny, ServiceConfig(max_new_tokens=4)) as service:
            transport = httpx.ASGITransport(app=create_app(service, "token"))
            async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
                return await client.get(path)

    response = asyncio.run(body())
    assert response.status_code == 404, response.text


def test_the_bearer_scheme_is_read_in_any_case_and_the_token_as_it_is(tiny):
    """RFC 9110 reads an auth scheme in any case: a client sending ``bearer`` got a 401."""

    async def body():
        async with running_service(tiny, ServiceConfig(max_new_tokens=4)) as service:
            server = await ServiceServer(service, token="Token-1").start()
            try:
                async with httpx.AsyncClient(base_url=server.url) as client:
                    return [
                        (await client.get("/status", headers={"Authorization": value})).status_code
                        for value in ("bearer Token-1", "BEARER Token-1", "Bearer token-1", "Bearer  Token-1")
                    ]
            finally:
                await server.stop()

    assert asyncio.run(body()) == [200, 200, 401, 401]


@pytest.mark.parametrize("token", ["secret\n", "secret ", "s\u00e9cret", "sec\x00ret"])
def test_a_bearer_token_no_authorization_header_can_carry_is_refused(tiny, token):
    """A header loses the whitespace around a value and carries ASCII alone (httpx refuses
    the rest): a server given such a token (a secret file's last newline) answered every
    request 401, saying nothing of why."""

    async def body():
        async with running_service(tiny, ServiceConfig(max_new_tokens=4)) as service:
            with pytest.raises(ValueError, match="an Authorization header cannot carry it"):
                ServiceServer(service, token=token)

    asyncio.run(body())


@pytest.mark.parametrize("seed", [2**70, -(2**63) - 1, 2**63])
def test_a_seed_that_is_not_a_signed_64_bit_integer_is_refused_with_400(tiny, seed):
    # the caller's mistake, not an env error: no rollout runs
    async def body():
        async with running_service(tiny, ServiceConfig(max_new_tokens=4)) as service:
            transport = httpx.ASGITransport(app=create_app(service, "token"))
            async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
                response = await client.post(
                    "/process",
                    json={"task": arith_task().model_dump(), "seed": seed},
                    headers={"Authorization": "Bearer token"},
                )
            return response, service.status()

    response, status = asyncio.run(body())
    assert response.status_code == 400 and response.json()["detail"].startswith("bad request body: seed: ")
    assert status["finished"] == {}


@pytest.mark.parametrize("field", ["rollout_id", "execution_id", "group_id", "task.id", "task.env"])
@pytest.mark.parametrize("blank", ["", "  ", "\t\n", "\x1f"])
def test_a_blank_id_is_refused_with_400_before_any_rollout_runs(tiny, field, blank):
    """A blank group id would pool every such rollout into one GRPO group; a blank task id
    would get the trajectory refused when its shard is written, after the rollout ran; a
    blank env name is the caller's mistake, not an env error (an empty one was a 500)."""
    request = {"task": arith_task().model_dump()}
    if field.startswith("task."):
        request["task"][field.removeprefix("task.")] = blank
    else:
        request[field] = blank

    async def body():
        async with running_service(tiny, ServiceConfig(max_new_tokens=4)) as service:
            transport = httpx.ASGITransport(app=create_app(service, "token"))
            async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
                response = await client.post(
                    "/process", json=request, headers={"Authorization": "Bearer token"}
                )
            return response, service.status()

    response, status = asyncio.run(body())
    assert response.status_code == 400
    assert response.json()["detail"].startswith(f"bad request body: {field}: "), response.text
    assert status["finished"] == {}


async def refused_process(tiny, request: dict | bytes) -> tuple[httpx.Response, dict]:
    """The answer of ``/process`` to ``request`` (a dict as JSON escapes it: a lone surrogate
    is ``\\udc80``; bytes as they are) and the service's status after it."""
    async with running_service(tiny, ServiceConfig(max_new_tokens=4)) as service:
        transport = httpx.ASGITransport(app=create_app(service, "token"))
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            response = await client.post(
                "/process",
                content=request if isinstance(request, bytes) else json.dumps(request),
                headers={"Authorization": "Bearer token", "Content-Type": "application/json"},
            )
        return response, service.status()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "not valid JSON: Expecting property name enclosed in double quotes (char 1)"),
        (b"", "the request has no body; send a JSON object"),
        (
            b'{"task": {"env": "arith", "id": "a-0", "prompt": "1 + 1?"}} x',
            "not valid JSON: Extra data (char 60)",
        ),
        (b'{"task": {"env": "arith", "id": "a-0"}}', "task.prompt: Field required"),
        (b'{"task": {"env": "arith", "id": "a-0", "prompt": "1 + 1?"}, "tokens": 1}', "tokens: Extra inputs"),
        (b'{"task": {"env": "arith", "id": "a-0", "prompt": "1 + 1?"}, "x\\ny": 1}', "'x\\ny': Extra inputs"),
    ],
)
def test_a_malformed_body_is_refused_with_a_one_line_400_saying_why(tiny, content, message):
    # as the gateway's endpoints answer one, not FastAPI's 422 that leaves the parser's reason out
    response, status = asyncio.run(refused_process(tiny, content))
    assert response.status_code == 400, response.text
    assert response.json()["detail"].startswith(f"bad request body: {message}"), response.text
    assert "\n" not in response.json()["detail"]
    assert status["finished"] == {}


@pytest.mark.parametrize("env", ["nope", "arith\x00", "ARITH"])
def test_a_task_of_an_unknown_environment_is_refused_with_400_naming_the_known_ones(tiny, env):
    # the caller's mistake: not an env error of the service (nor a NUL written into its log)
    request = {"task": arith_task().model_dump() | {"env": env}}
    response, status = asyncio.run(refused_process(tiny, request))
    assert response.status_code == 400
    error = response.json()["detail"]
    assert error.startswith("bad request body: task.env: Value error, unknown environment"), error
    assert "'arith'" in error and "'shell'" in error
    assert status["finished"] == {}


@pytest.mark.parametrize("field", ["task.prompt", "task.id", "rollout_id", "group_id"])
def test_a_string_holding_a_lone_surrogate_is_refused_with_400_naming_its_field(tiny, field):
    # UTF-8 cannot encode it: the prompt was an env error ("InvalidRequest during run")
    request = {"task": arith_task().model_dump()}
    if field.startswith("task."):
        request["task"][field.removeprefix("task.")] = "what is 1 + 1? \udc80"
    else:
        request[field] = "r-\udc80"
    response, status = asyncio.run(refused_process(tiny, request))
    assert response.status_code == 400
    error = response.json()["detail"]
    assert error.startswith(f"bad request body: {field}: ") and "lone surrogate" in error, error
    assert status["finished"] == {}


def test_a_key_holding_a_lone_surrogate_is_refused_with_400_not_a_500(tiny):
    # FastAPI's own answer echoes the body, which UTF-8 cannot encode
    request = {"task": arith_task().model_dump(), "r-\udc80": 1}
    response, status = asyncio.run(refused_process(tiny, request))
    assert response.status_code == 400
    assert response.json()["detail"] == (
        "bad request body: Input should be a valid string, unable to parse raw data as a unicode string"
    )
    assert status["finished"] == {}


@pytest.mark.parametrize("transport", ["tcp", "uds"])
def test_http_api_process_status_cancel_and_auth(tiny, transport, tmp_path):
    task = arith_task()

    async def body():
        async with running_service(tiny, ServiceConfig(max_new_tokens=4)) as service:
            bind = {"uds": str(tmp_path / "rollout.sock")} if transport == "uds" else {}
            async with ServiceServer(service, **bind) as server:
                client_transport = httpx.AsyncHTTPTransport(uds=server.uds) if server.uds else None
                headers = {"Authorization": f"Bearer {server.token}"}
                async with httpx.AsyncClient(
                    base_url=server.url, transport=client_transport, timeout=60
                ) as client:
                    unauthorized = await client.get("/status")
                    wrong = await client.get("/status", headers={"Authorization": "Bearer nope"})
                    done = await client.post("/process", json={"task": task.model_dump()}, headers=headers)
                    bad = await client.post("/process", json={"task": {"env": "arith"}}, headers=headers)
                    missing = await client.post("/cancel", json={"rollout_id": "nope"}, headers=headers)
                    status = await client.get("/status", headers=headers)
                    return unauthorized, wrong, done, bad, missing, status

    unauthorized, wrong, done, bad, missing, status = asyncio.run(body())
    assert unauthorized.status_code == 401 and wrong.status_code == 401
    assert done.status_code == 200
    body = done.json()
    assert body["status"] in ("ok", "truncated") and body["task"] == "arith"
    assert set(body["timing"]) == {"init", "run", "eval", "queue"}
    validate(to_table([body["record"]]))
    assert bad.status_code == 400 and bad.json()["detail"].startswith("bad request body: task.id: ")
    assert missing.status_code == 404
    assert sum(status.json()["finished"].values()) == 1


class BlockingEnv(ArithEnv):
    """``arith`` whose step and evaluate block the event loop (``time.sleep`` in async code)."""

    async def step(self, action: str) -> StepResult:
        time.sleep(0.3)
        return await super().step(action)

    async def evaluate(self) -> float:
        time.sleep(0.3)
        return await super().evaluate()


@pytest.mark.parametrize("warn_s", [0.01, 60.0])
def test_an_env_that_blocks_the_event_loop_is_named_in_a_warning_once_and_counted(tiny, caplog, warn_s):
    """Thresholds far from the 0.3 s each call blocks: warned at 0.01 s, never at 60 s. A
    built-in env's rollout beside it goes on as usual."""
    task = arith_task()

    async def body():
        config = ServiceConfig(max_new_tokens=4, loop_block_warn_s=warn_s)
        async with running_service(tiny, config) as service:
            service.make_env = lambda task: (
                BlockingEnv() if task.id == "blocking" else registry.make(task.env)
            )
            blocking = task.model_copy(update={"id": "blocking"})
            results = await asyncio.gather(
                *(service.process(RolloutRequest(task=t)) for t in (blocking, blocking, task))
            )
            return results, service.status()

    with caplog.at_level(logging.WARNING, logger="rollout.service"):
        results, status = asyncio.run(body())
    assert all(r.status in ("ok", "truncated") for r in results), [r.error for r in results]
    warnings = [r.getMessage() for r in caplog.records if "blocked the event loop" in r.getMessage()]
    if warn_s > 1:
        assert warnings == [] and status["loop_blocks"] == {}
        return
    assert sorted(w.split()[1] for w in warnings) == ["BlockingEnv.evaluate", "BlockingEnv.step"]
    assert "asyncio.to_thread" in warnings[0]
    assert status["loop_blocks"]["BlockingEnv.evaluate"] == 2
    assert status["loop_blocks"]["BlockingEnv.step"] >= 2


class DoneAtOnceEnv(ArithEnv):
    """``arith`` done on its first step, scored ``reward`` however the action went."""

    name = "arith"
    reward = 0.75

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=[], reward=self.reward, done=True, progress=1.0)

    async def evaluate(self) -> float:
        return self.reward


def test_an_action_cut_at_its_token_budget_is_truncated_and_keeps_its_reward(tiny):
    # one token per action: the tiny model's action ends at the budget, not at a stop token
    async def body():
        config = ServiceConfig(max_new_tokens=1)
        async with running_service(tiny, config, make_env=lambda task: DoneAtOnceEnv()) as service:
            return await service.process(RolloutRequest(task=arith_task(), seed=0))

    result = asyncio.run(body())
    assert (result.status, result.reward, result.progress, result.error) == ("truncated", 0.75, 1.0, None)
    assert (result.record["status"], result.record["reward"]) == ("truncated", 0.75)


class NeverDoneEnv(ArithEnv):
    """``arith`` whose steps never end the episode, each reporting half the task done."""

    name = "arith"

    async def step(self, action: str) -> StepResult:
        return StepResult(
            observation=[{"role": "user", "content": "again"}], reward=0.0, done=False, progress=0.5
        )

    async def evaluate(self) -> float:
        return 0.25


def test_a_rollout_out_of_turns_is_truncated_after_max_turns_and_still_scored(tiny):
    async def body():
        config = ServiceConfig(max_new_tokens=4, max_turns=3)
        async with running_service(tiny, config, make_env=lambda task: NeverDoneEnv()) as service:
            return await service.process(RolloutRequest(task=arith_task(), seed=0))

    result = asyncio.run(body())
    assert (result.status, result.turns, result.reward, result.progress) == ("truncated", 3, 0.25, 0.5)
    assert (result.record["reward"], result.record["progress"]) == (0.25, 0.5)
    validate(to_table([result.record]))


class RaisesWhenCutEnv(ArithEnv):
    """``arith`` whose ``hangs`` call waits for ever and, cancelled at the budget, raises an
    error of its own instead of the cancel (a client that turns a cancel into its own error)."""

    name = "arith"
    hangs = "reset"

    async def _hang(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("connection closed while waiting for the command") from None

    async def reset(self, task: Task):
        if self.hangs == "reset":
            await self._hang()
        return await super().reset(task)

    async def step(self, action: str) -> StepResult:
        if self.hangs == "step":
            await self._hang()
        return await super().step(action)


@pytest.mark.parametrize("hangs", ["reset", "step"])
def test_an_env_that_raises_its_own_error_when_cut_at_the_budget_is_a_timeout(tiny, hangs):
    # an env_error would leave the hang out of training; a timeout trains it as a failure
    def make_env(task):
        env = RaisesWhenCutEnv()
        env.hangs = hangs
        return env

    async def body():
        config = ServiceConfig(timeout_s=1.0, max_new_tokens=4)
        async with running_service(tiny, config, make_env=make_env) as service:
            return await service.process(RolloutRequest(task=arith_task()))

    result = asyncio.run(body())
    stage = "init" if hangs == "reset" else "run"
    assert (result.status, result.reward, result.error) == (
        "timeout",
        None,
        f"{stage} ran past the rollout's 1 s budget",
    )


class Abort(BaseException):
    """Not an ``Exception``: what a library's own control flow may raise (a foreign cancel, an exit)."""


class AbortingEnv(ArithEnv):
    """``arith`` whose step raises :class:`Abort`; records its close."""

    name = "arith"
    closed = False

    async def step(self, action: str) -> StepResult:
        raise Abort("stop everything")

    async def close(self) -> None:
        self.closed = True
        await super().close()


def test_an_env_that_raises_a_base_exception_still_has_its_env_and_session_closed(tiny):
    # left open, its sandbox and its gateway session (the engine's cache of it) would be held for ever
    env = AbortingEnv()

    async def body():
        config = ServiceConfig(max_new_tokens=4)
        async with running_service(tiny, config, make_env=lambda task: env) as service:
            outcome = await asyncio.gather(
                service.process(RolloutRequest(task=arith_task())), return_exceptions=True
            )
            return outcome[0], service.gateway.sessions, service.status()["in_flight"]

    outcome, sessions, in_flight = asyncio.run(body())
    assert isinstance(outcome, Abort)
    assert env.closed and sessions == [] and in_flight == 0
