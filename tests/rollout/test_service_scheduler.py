"""The rollout service under the resource scheduler: sandbox processes really run on the
cores granted to each action, cores return to the pool after, static mode holds a
reservation for the whole rollout."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest
import torch
from pydantic import ValidationError

from envs import registry
from envs.arith import ArithEnv
from envs.base import StepResult
from envs.code import CodeEnv
from envs.pytool import PyToolEnv
from rl.models import TinyModelConfig, build_tiny_model
from rollout.engines.torch_engine import TorchEngine
from rollout.gateway import Gateway, GatewayConfig
from rollout.resources import CpuManager
from rollout.router import Router
from rollout.scheduler import ActionScheduler, ResourceRequest
from rollout.service import (
    RolloutRequest,
    RolloutService,
    ServiceConfig,
    _Clock,
    _ProgramActions,
    make_scheduler,
)

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=1024
)
SHOW_CORES = "run: import os; print(sorted(os.sched_getaffinity(0)))"


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny_model(TINY)


class ScriptedPyTool(PyToolEnv):
    """``pytool`` that plays a fixed script whatever the model says, and records what it saw."""

    script = (SHOW_CORES, "answer: 0")

    def __init__(self, service: RolloutService, **kwargs):
        super().__init__(**kwargs)
        self.service = service
        self.seen: list[str] = []
        self.free_between_actions = None
        self.parked = None

    def action_request(self, action):
        return super().action_request(self.script[self.turns])

    async def step(self, action):
        result = await super().step(self.script[self.turns])
        self.seen += [m["content"] for m in result.observation]
        return result

    async def evaluate(self):
        policy = self.service.scheduler.policy
        self.free_between_actions = dict(policy.free) if isinstance(policy.free, dict) else list(policy.free)
        cpu = self.service.scheduler.cpu
        self.parked = {frozenset(os.sched_getaffinity(tid)) for tid in _tree(self.resource_pid())}
        assert cpu is not None
        return await super().evaluate()


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for tid in os.listdir(f"/proc/{p}/task"):
            with open(f"/proc/{p}/task/{tid}/children") as handle:
                todo += [int(c) for c in handle.read().split()]
    return pids


def _service(tiny, config: ServiceConfig, make_env) -> tuple[RolloutService, TorchEngine]:
    model, tokenizer = tiny
    engine = TorchEngine(model, tokenizer)
    gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
    return RolloutService(gateway, make_env, config), engine


def _run(tiny, config: ServiceConfig, env_cls, task_env: str, hold_one_core: bool):
    """One rollout; with ``hold_one_core`` another action holds the lowest core meanwhile."""
    envs = []

    def make_env(task):
        env = env_cls(service)
        envs.append(env)
        return env

    service, engine = _service(tiny, config, make_env)
    task = registry.task_set(task_env, "train", seed=0, n=1)[0]

    async def body():
        try:
            if hold_one_core:
                other = ResourceRequest(demand={"cpu": 1}, duration=1.0, trajectory_id="other")
                async with service.scheduler.run(other) as grant:
                    held = grant.cores
                    result = await service.process(RolloutRequest(task=task, seed=0))
                service.scheduler.end_trajectory("other")
            else:
                held = frozenset()
                result = await service.process(RolloutRequest(task=task, seed=0))
            return result, held
        finally:
            await service.close()
            await engine.close()

    result, held = asyncio.run(body())
    return service, envs[0], result, held


def test_action_scheduler_pins_the_sandbox_to_the_granted_core_and_reclaims_it(tiny):
    config = ServiceConfig(max_new_tokens=4, timeout_s=120, scheduler="action", scheduler_cores=2)
    service, env, result, _ = _run(tiny, config, ScriptedPyTool, "pytool", hold_one_core=False)
    assert result.status in ("ok", "truncated"), result.error
    pool = service.scheduler.cpu.pool
    # a free core no parked sandbox sits on is granted before the parking core
    (granted,) = pool - service.scheduler.cpu.parking
    # the interpreter inside the sandbox saw only the granted core while the action ran
    assert env.seen == [str([granted])]
    # between actions the whole sandbox tree sat on the parking core, not on the granted one
    assert env.parked == {service.scheduler.cpu.parking}
    # every core is back in the pool, nothing held, nothing queued
    assert service.scheduler.cpu.available == pool
    assert service.scheduler.policy.free == [2.0]
    assert service.scheduler.policy.queued == 0


class ResetOnlyPyTool(ScriptedPyTool):
    """Answers at once: its interpreter, started by ``reset``, never runs an action."""

    script = ("answer: 0",)


class RestartedPyTool(ScriptedPyTool):
    """Its first action ends the interpreter, which the env restarts; records the pids around each step."""

    script = ("run: import os; os._exit(3)", "answer: 0")

    async def step(self, action):
        before = self.resource_pid()
        result = await super().step(action)
        self.pids = [*getattr(self, "pids", []), (before, self.resource_pid())]
        return result


@pytest.mark.parametrize("env_cls", [ResetOnlyPyTool, RestartedPyTool])
def test_an_interpreter_started_by_reset_or_restarted_in_an_action_is_parked(tiny, env_cls):
    config = ServiceConfig(max_new_tokens=4, timeout_s=120, scheduler="action", scheduler_cores=2)
    service, env, result, _ = _run(tiny, config, env_cls, "pytool", hold_one_core=False)
    assert result.status in ("ok", "truncated"), result.error
    if env_cls is RestartedPyTool:
        (first, restarted), _ = env.pids
        assert None not in (first, restarted) and first != restarted  # a new interpreter
    # not on all the worker's cores until its next action: on the parking core like the first
    assert env.parked == {service.scheduler.cpu.parking}
    assert service.scheduler.cpu.available == service.scheduler.cpu.pool


class StatefulPyTool(ScriptedPyTool):
    """Sets a variable in one action and reads it in the next."""

    script = ("run: x = 41", "run: print(x + 1)", "answer: 0")


def test_the_sandbox_keeps_its_memory_across_actions_while_parked_in_between(tiny):
    config = ServiceConfig(max_new_tokens=4, timeout_s=120, scheduler="action", scheduler_cores=2)
    service, env, result, _ = _run(tiny, config, StatefulPyTool, "pytool", hold_one_core=False)
    assert result.status in ("ok", "truncated"), result.error
    assert env.seen[1].strip() == "42"  # the interpreter that ran the first action ran the second
    assert env.parked == {service.scheduler.cpu.parking}
    assert service.scheduler.cpu.available == service.scheduler.cpu.pool


def test_static_mode_holds_the_reservation_for_the_whole_rollout(tiny):
    config = ServiceConfig(
        max_new_tokens=4, timeout_s=120, scheduler="static", scheduler_cores=2, scheduler_static_cores=1
    )
    service, env, result, _ = _run(tiny, config, ScriptedPyTool, "pytool", hold_one_core=False)
    assert result.status in ("ok", "truncated"), result.error
    assert env.seen and env.seen[0] in ("[0]", "[1]")
    # after the action, before the rollout ends, the rollout still holds its core
    assert env.free_between_actions == {"cpu": 1}
    # the end of the rollout returns it
    assert service.scheduler.policy.free == {"cpu": 2}
    assert service.scheduler.cpu.available == service.scheduler.cpu.pool


def test_action_mode_holds_nothing_between_actions(tiny):
    config = ServiceConfig(max_new_tokens=4, timeout_s=120, scheduler="action", scheduler_cores=2)
    _, env, result, _ = _run(tiny, config, ScriptedPyTool, "pytool", hold_one_core=False)
    assert result.status in ("ok", "truncated"), result.error
    assert env.free_between_actions == [2.0]


class OverlappingReplies(ArithEnv):
    """A self-driving env whose program, while the pool is full, has two model replies
    waiting for a grant at once: two calls in flight, a third sent between their replies."""

    name = "arith"
    drives_itself = True

    def __init__(self, service: RolloutService, **kwargs):
        super().__init__(**kwargs)
        self.service = service
        self.gate = None
        self.free_while_acting = None

    def attach_gateway(self, gateway) -> None:
        pass

    def attach_actions(self, gate) -> None:
        self.gate = gate

    def action_request(self, action):
        return ResourceRequest(demand={"cpu": 1}, kind="agent")

    async def run(self) -> StepResult:
        gate, scheduler = self.gate, self.service.scheduler
        await gate.acting()  # the program starts
        gate.waiting()
        gate.waiting()  # two model calls at once
        async with scheduler.run(ResourceRequest(demand={"cpu": 2}, kind="other")):
            await gate.acting()  # the first reply: a call is still out
            second = asyncio.create_task(gate.acting())  # the second reply waits for a grant
            await asyncio.sleep(0)
            gate.waiting()  # the program sends a third call
            third = asyncio.create_task(gate.acting())  # and its reply waits too
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(second, third), 30)
        self.free_while_acting = list(scheduler.policy.free)
        gate.waiting()  # the program ends
        return StepResult([], 1.0, True, 1.0)

    async def evaluate(self):
        return 1.0


def test_overlapping_model_calls_of_a_program_hold_one_grant_and_give_it_back(tiny):
    config = ServiceConfig(timeout_s=120, scheduler="action", scheduler_cores=2)
    service, env, result, _ = _run(tiny, config, OverlappingReplies, "arith", hold_one_core=False)
    assert result.status == "ok", result.error
    assert env.free_while_acting == [1.0]
    assert service.scheduler.policy.free == [2.0] and service.scheduler.policy.queued == 0
    assert service.scheduler.cpu.available == service.scheduler.cpu.pool


class StrayAction(ArithEnv):
    """``arith`` whose step starts an action of its own trajectory and never ends it."""

    def __init__(self, service: RolloutService, **kwargs):
        super().__init__(**kwargs)
        self.service = service
        self.closed = False

    async def step(self, action):
        request = ResourceRequest(demand={"cpu": 1}, kind="tool", trajectory_id="stray")
        await self.service.scheduler.acquire(request)
        return await super().step(action)

    async def close(self):
        self.closed = True
        await super().close()


def test_the_env_and_its_session_are_closed_when_ending_the_trajectory_fails(tiny):
    """A static reservation cannot end while an action of its trajectory runs: that is logged,
    and the env and the gateway session are closed all the same."""
    config = ServiceConfig(
        timeout_s=120, max_new_tokens=4, scheduler="static", scheduler_cores=2, scheduler_pin=False
    )
    envs = []

    def make_env(task):
        envs.append(StrayAction(service))
        return envs[-1]

    service, engine = _service(tiny, config, make_env)
    task = registry.task_set("arith", "train", seed=0, n=1)[0]

    async def body():
        try:
            return await service.process(RolloutRequest(task=task, rollout_id="stray"))
        finally:
            await engine.close()

    result = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    assert envs[0].closed
    assert service.gateway.sessions == []


class AffinityCode(CodeEnv):
    """``code`` whose solution writes the cores its test process runs on, read back at EVAL."""

    SOLUTION = (
        "import os\n"
        "open('cores.txt', 'w').write(repr(sorted(os.sched_getaffinity(0))))\n"
        "def f(x):\n    return x\n"
    )

    def __init__(self, service: RolloutService, **kwargs):
        super().__init__(**kwargs)
        self.test_cores = None

    async def step(self, action):
        return await super().step(self.SOLUTION)

    async def evaluate(self):
        reward = await super().evaluate()
        with open(os.path.join(self.sandbox.workdir, "cores.txt")) as handle:
            self.test_cores = handle.read()
        return reward


def test_code_test_run_is_elastic_and_starts_on_the_granted_cores(tiny):
    config = ServiceConfig(max_new_tokens=4, timeout_s=120, scheduler="action", scheduler_cores=2)
    service, env, result, held = _run(tiny, config, AffinityCode, "code", hold_one_core=True)
    assert result.status in ("ok", "truncated"), result.error
    (granted,) = service.scheduler.cpu.pool - held
    assert env.test_cores == str([granted])
    request = env.eval_request()
    assert request.elastic == "cpu" and request.max_units == env.config.test_cores
    _, env, result, _ = _run(tiny, config, AffinityCode, "code", hold_one_core=False)
    assert env.test_cores == str(sorted(service.scheduler.cpu.pool))
    assert service.scheduler.cpu.available == service.scheduler.cpu.pool


def test_scheduler_config_errors_name_the_field():
    with pytest.raises(ValueError, match="scheduler_cores"):
        make_scheduler(ServiceConfig(scheduler_cores=len(os.sched_getaffinity(0)) + 1))
    with pytest.raises(ValueError, match="scheduler_static_cores"):  # over the cores this process may use
        make_scheduler(
            ServiceConfig(scheduler="static", scheduler_static_cores=len(os.sched_getaffinity(0)) + 1)
        )
    assert make_scheduler(ServiceConfig(scheduler="none")) is None
    unpinned = make_scheduler(ServiceConfig(scheduler_cores=64, scheduler_pin=False))
    assert unpinned.cpu is None and unpinned.policy.capacity == {"cpu": 64}


def test_a_static_reservation_over_the_scheduler_cores_is_refused_as_the_config_loads():
    """The rollout service refused it as it started: at the first evaluation, after the warm start."""
    with pytest.raises(ValidationError, match=r"scheduler_static_cores \(2\) exceeds scheduler_cores \(1\)"):
        ServiceConfig(scheduler="static", scheduler_cores=1, scheduler_static_cores=2)
    # only the static scheduler reserves them; with the machine's cores, the service checks as it starts
    assert ServiceConfig(scheduler="action", scheduler_cores=1, scheduler_static_cores=2).scheduler_cores == 1
    assert ServiceConfig(scheduler="static", scheduler_static_cores=2).scheduler_cores is None


def test_closing_a_gate_whose_acquire_has_not_started_gives_everything_back():
    # a model reply and the rollout's end in one pass of the loop: the acquire the reply
    # starts is cancelled before it ever runs, and closing must still finish normally
    async def body():
        scheduler = make_scheduler(ServiceConfig(scheduler="action", scheduler_cores=1, scheduler_pin=False))
        gate = _ProgramActions(scheduler, OverlappingReplies(service=None), "r1", _Clock(60))
        gate.waits = 1  # the program waits on a model call
        reply = asyncio.create_task(gate.acting())
        await asyncio.sleep(0)  # the reply has created its acquire, which has not run yet
        await gate.close()
        await asyncio.gather(reply, return_exceptions=True)
        return scheduler

    scheduler = asyncio.run(body())
    assert scheduler.policy.free == [1.0] and scheduler.policy.queued == 0


def test_a_grant_that_lands_after_the_program_called_again_is_no_duration_sample():
    # the reply's acquire waits for the only core; the program sends another model call
    # meanwhile, so the grant goes back unused the moment it lands: no 0 s sample of "agent"
    async def body():
        scheduler = make_scheduler(ServiceConfig(scheduler="action", scheduler_cores=1, scheduler_pin=False))
        gate = _ProgramActions(scheduler, OverlappingReplies(service=None), "r1", _Clock(60))
        gate.waits = 1  # the program waits on a model call
        held = await scheduler.acquire(ResourceRequest(demand={"cpu": 1}, kind="other"))
        reply = asyncio.create_task(gate.acting())
        await asyncio.sleep(0)  # the reply's acquire is queued
        gate.waiting()  # the program calls the model again
        scheduler.release(held)
        await asyncio.wait_for(reply, 5)
        await gate.close()
        return scheduler

    scheduler = asyncio.run(body())
    assert scheduler.policy.free == [1.0] and scheduler.policy.queued == 0
    assert scheduler.policy.estimates.t1(ResourceRequest(demand={"cpu": 1}, kind="agent")) == 1.0


def test_the_run_deadline_stands_still_only_while_the_program_waits_for_its_grant():
    # the reply's acquire waits for the only core: the deadline stands still. The program
    # then calls the model again: it no longer waits for the grant (which goes back unused
    # when it lands), and its model call is RUN time, so the deadline runs again until that
    # call's reply waits for the same acquire
    async def body():
        scheduler = make_scheduler(ServiceConfig(scheduler="action", scheduler_cores=1, scheduler_pin=False))
        clock = _Clock(60)
        gate = _ProgramActions(scheduler, OverlappingReplies(service=None), "r1", clock)
        gate.waits = 1  # the program waits on a model call
        held = await scheduler.acquire(ResourceRequest(demand={"cpu": 1}, kind="other"))
        async with asyncio.timeout(60) as clock.deadline:
            first = asyncio.create_task(gate.acting())
            while not scheduler.policy.queued:
                await asyncio.sleep(0)
            standing = [clock.deadline.when() is None]
            gate.waiting()  # the program calls the model again
            standing.append(clock.deadline.when() is None)
            second = asyncio.create_task(gate.acting())  # that call's reply shares the acquire
            await asyncio.sleep(0)
            standing.append(clock.deadline.when() is None)
            scheduler.release(held)
            await asyncio.wait_for(asyncio.gather(first, second), 5)
            standing.append(clock.deadline.when() is None)
            gate.waiting()
        await gate.close()
        return standing

    assert asyncio.run(body()) == [True, False, True, False]


class PinnedProgram(ArithEnv):
    """A self-driving env whose program is the process ``pid``."""

    drives_itself = True

    def __init__(self, pid: int, **kwargs):
        super().__init__(**kwargs)
        self.pid = pid

    def action_request(self, action):
        return ResourceRequest(demand={"cpu": 1}, kind="agent")

    def resource_pid(self):
        return self.pid


def test_a_program_whose_park_fails_still_gives_its_cores_back():
    core = min(os.sched_getaffinity(0))
    # parking on a core that does not exist fails (EINVAL) once the program has acted
    scheduler = ActionScheduler({"cpu": 1}, cpu=CpuManager({core}, parking={4095}))
    program = subprocess.Popen(["sleep", "30"])
    try:

        async def body():
            gate = _ProgramActions(scheduler, PinnedProgram(program.pid), "r1", _Clock(60))
            await gate.acting()
            assert os.sched_getaffinity(program.pid) == {core}
            with pytest.raises(OSError):
                gate.waiting()

        asyncio.run(body())
    finally:
        program.kill()
        program.wait()
    assert scheduler.policy.free == [1.0] and scheduler.cpu.available == {core}


def test_a_program_that_cannot_be_bound_to_its_grant_gives_it_back_unused():
    core = min(os.sched_getaffinity(0))
    # binding to a core that does not exist fails (EINVAL, as when the cpuset shrinks)
    scheduler = ActionScheduler({"cpu": 1}, cpu=CpuManager({4095}, parking={core}))
    program = subprocess.Popen(["sleep", "30"])
    try:

        async def body():
            gate = _ProgramActions(scheduler, PinnedProgram(program.pid), "r1", _Clock(60))
            with pytest.raises(OSError):
                await gate.acting()
            assert scheduler.policy.free == [1.0]  # not held while the program acts unpinned
            gate.waiting()  # the program's next model call
            await gate.close()

        asyncio.run(body())
    finally:
        program.kill()
        program.wait()
    assert scheduler.policy.free == [1.0] and scheduler.cpu.available == {4095}
    assert scheduler.policy.estimates.t1(ResourceRequest(demand={"cpu": 1}, kind="agent")) == 1.0


def test_a_program_action_cut_short_by_its_rollouts_end_is_no_duration_sample():
    # the program acts 3 s to its next model call, then its rollout is cancelled 1 s into
    # the next action; a reply that lands as the rollout ends holds a grant when the gate
    # closes. The agent's estimate keeps the finished 3 s
    async def body():
        scheduler = make_scheduler(ServiceConfig(scheduler="action", scheduler_cores=1, scheduler_pin=False))
        now = [0.0]
        scheduler._now = lambda: now[0]
        gate = _ProgramActions(scheduler, OverlappingReplies(service=None), "r1", _Clock(60))
        acting = asyncio.Event()

        async def program():  # as the agent env's run: the gate waits once the program stops
            await gate.acting()
            now[0] += 3
            gate.waiting()  # a model call
            await gate.acting()  # its reply
            try:
                acting.set()
                await asyncio.Event().wait()
            finally:
                gate.waiting()

        run = asyncio.create_task(program())
        await acting.wait()
        now[0] += 1
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await gate.acting()  # a reply of a call the program sent before it was stopped
        now[0] += 1
        await gate.close()
        return scheduler

    scheduler = asyncio.run(body())
    assert scheduler.policy.free == [1.0] and scheduler.policy.queued == 0
    assert scheduler.policy.estimates.t1(ResourceRequest(demand={"cpu": 1}, kind="agent")) == 3.0


def test_a_program_gate_told_of_a_wait_outside_any_task_gives_its_grant_back():
    # an env may learn of its program's model call in a callback (a protocol's, a future's),
    # which the event loop runs outside any task
    async def body():
        scheduler = make_scheduler(ServiceConfig(scheduler="action", scheduler_cores=1, scheduler_pin=False))
        now = [0.0]
        scheduler._now = lambda: now[0]
        gate = _ProgramActions(scheduler, OverlappingReplies(service=None), "r1", _Clock(60))
        await gate.acting()
        now[0] += 2
        called = asyncio.get_running_loop().create_future()
        called.add_done_callback(lambda _: gate.waiting())
        called.set_result(None)
        await asyncio.sleep(0)  # the callback runs
        assert gate.grant is None and scheduler.policy.free == [1.0]
        await gate.close()
        return scheduler

    scheduler = asyncio.run(body())
    assert scheduler.policy.estimates.t1(ResourceRequest(demand={"cpu": 1}, kind="agent")) == 2.0


class EvalOnOneCore(ArithEnv):
    """``arith`` whose EVAL needs a core. The first rollout made also runs an action on one in
    RUN, and that action waits until another rollout waits for the core."""

    def __init__(self, service: RolloutService, first: bool, **kwargs):
        super().__init__(**kwargs)
        self.service = service
        self.first = first

    def action_request(self, action):
        return ResourceRequest(demand={"cpu": 1}, kind="tool") if self.first else None

    async def step(self, action):
        if self.first:
            policy = self.service.scheduler.policy
            while not any(policy._queues.values()):
                await asyncio.sleep(0.01)
        return await super().step(action)

    def eval_request(self):
        return ResourceRequest(demand={"cpu": 1}, kind="eval")


def test_a_static_rollout_waiting_for_its_reservation_does_not_hold_the_eval_slot(tiny):
    """One core, one reservation at a time, one EVAL slot: the first rollout holds the
    reservation from its RUN action, the second reaches EVAL needing one. The second waits
    for the reservation without the EVAL slot, which the first needs to finish and give its
    reservation back (holding the slot while it waited, the two waited on each other forever)."""
    config = ServiceConfig(
        max_new_tokens=4,
        timeout_s=120,
        eval_workers=1,
        scheduler="static",
        scheduler_cores=1,
        scheduler_static_cores=1,
        scheduler_pin=False,
    )
    envs = []

    def make_env(task):
        envs.append(EvalOnOneCore(service, first=not envs))
        return envs[-1]

    service, engine = _service(tiny, config, make_env)
    tasks = registry.task_set("arith", "train", seed=0, n=2)

    async def body():
        try:
            rollouts = [service.process(RolloutRequest(task=task, seed=0)) for task in tasks]
            return await asyncio.wait_for(asyncio.gather(*rollouts), 60)
        finally:
            await service.close()
            await engine.close()

    results = asyncio.run(body())
    assert [r.status in ("ok", "truncated") for r in results] == [True, True], [r.error for r in results]
    assert service.scheduler.policy.free == {"cpu": 1}


class EndsWhileWaiting(OverlappingReplies):
    """A self-driving env whose program ends (its process died) while its gate waits for a grant."""

    async def run(self) -> StepResult:
        self.started = asyncio.create_task(self.gate.acting())  # the program starts: no core is free
        await asyncio.sleep(0.3)
        return StepResult([], 1.0, True, 1.0)


def test_a_wait_the_program_left_when_it_ended_is_run_time_not_taken_from_eval(tiny):
    """The gate's wait that RUN's end cut off is ended when the gate closes, after RUN's
    stage has booked its time: it is not carried into EVAL (whose time it would make
    negative, and whose budget check it would loosen) nor booked as queue time."""
    config = ServiceConfig(timeout_s=120, scheduler="action", scheduler_cores=2)
    service, engine = _service(tiny, config, lambda task: EndsWhileWaiting(service))
    task = registry.task_set("arith", "train", seed=0, n=1)[0]

    async def body():
        try:
            every_core = ResourceRequest(demand={"cpu": 2}, duration=1.0, trajectory_id="other")
            async with service.scheduler.run(every_core):
                result = await service.process(RolloutRequest(task=task, seed=0))
            service.scheduler.end_trajectory("other")
            return result
        finally:
            await service.close()
            await engine.close()

    result = asyncio.run(body())
    assert result.status == "ok", result.error
    assert result.timing["run"] >= 0.3 and result.timing["eval"] >= 0.0
    assert service.scheduler.policy.free == [2.0] and service.scheduler.policy.queued == 0


class EvalOnlyOnOneCore(ArithEnv):
    """``arith`` whose only scheduled action is its evaluation."""

    def eval_request(self):
        return ResourceRequest(demand={"cpu": 1}, kind="eval")


def test_a_static_rollouts_wait_for_its_reservation_before_eval_is_queue_time(tiny):
    config = ServiceConfig(
        max_new_tokens=4,
        timeout_s=120,
        scheduler="static",
        scheduler_cores=1,
        scheduler_static_cores=1,
        scheduler_pin=False,
    )
    service, engine = _service(tiny, config, lambda task: EvalOnlyOnOneCore())
    task = registry.task_set("arith", "train", seed=0, n=1)[0]

    async def body():
        try:
            await service.scheduler.admit("other")  # holds the only core's reservation
            job = asyncio.create_task(service.process(RolloutRequest(task=task, seed=0)))
            policy = service.scheduler.policy
            while not any(policy._queues.values()):  # the rollout waits for its reservation
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            service.scheduler.end_trajectory("other")
            return await asyncio.wait_for(job, 60)
        finally:
            await service.close()
            await engine.close()

    result = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    assert result.timing["queue"] >= 0.3


class CoresSeen(ArithEnv):
    """``arith`` whose steps are scheduled and whose evaluation is not; records the cores it is told of."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen: list[frozenset[int] | None] = []

    def action_request(self, action):
        return ResourceRequest(demand={"cpu": 1}, kind="tool")

    async def step(self, action):
        self.seen.append(self.cores)
        return await super().step(action)

    async def evaluate(self):
        self.seen.append(self.cores)
        return await super().evaluate()


def test_an_env_is_told_of_its_granted_cores_only_while_its_action_runs(tiny):
    """The cores of a step's grant are the env's while the step runs; its unscheduled
    evaluation, after the grant went back, is told of none (a test run started on them
    would run on cores the scheduler has given to another rollout)."""
    config = ServiceConfig(
        max_new_tokens=4, timeout_s=120, max_turns=1, scheduler="action", scheduler_cores=2
    )
    envs = []

    def make_env(task):
        envs.append(CoresSeen())
        return envs[-1]

    service, engine = _service(tiny, config, make_env)
    task = registry.task_set("arith", "train", seed=0, n=1)[0]

    async def body():
        try:
            return await service.process(RolloutRequest(task=task, seed=0))
        finally:
            await service.close()
            await engine.close()

    result = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    step, evaluation = envs[0].seen
    assert step is not None and len(step) == 1 and evaluation is None
