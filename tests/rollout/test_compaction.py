"""Context compaction (``ServiceConfig.compact_at``): a rollout whose prompt grows past the
threshold goes on in branches of its execution, each holding the task's first messages and
its last turns, and the processor trains their shared prefix once."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import types

import httpx
import pytest
import torch

from envs.arith import ArithEnv
from envs.base import StepResult
from envs.pytool import PyToolEnv
from envs.sandbox import bwrap_path
from envs.shell_env import ShellEnv
from rl.models import TinyModelConfig, build_tiny_model
from rl.processor import ProcessorConfig, process_shard
from rollout import router as router_module
from rollout import service as service_module
from rollout.config import OrchestratorConfig
from rollout.elastic import ElasticConfig
from rollout.elastic_plan import ElasticPlanner
from rollout.engines.torch_engine import TorchEngine
from rollout.gateway import Gateway, GatewayConfig
from rollout.orchestrator import Orchestrator
from rollout.router import Router, RouterConfig
from rollout.service import RolloutRequest, RolloutService, ServiceConfig
from rollout.service_http import create_app
from storage.schema import to_table, validate
from storage.status import RolloutStatus

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=1024
)
TURNS = 8
needs_bwrap = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny_model(TINY)


class NotesEnv(ArithEnv):
    """``arith`` that answers each of its ``TURNS`` actions with a numbered note, then scores 1."""

    name = "arith"

    async def step(self, action: str) -> StepResult:
        self.turns += 1
        note = [{"role": "user", "content": f"note {self.turns} of the task"}]
        return StepResult(observation=note, reward=0.0, done=self.turns == TURNS, progress=self.turns / TURNS)

    async def evaluate(self) -> float:
        return 1.0


def task():
    return ArithEnv.tasks("train", seed=0, n=1)[0]


def gateway_for(tiny, engine) -> Gateway:
    return Gateway(Router([engine]), tiny[1], GatewayConfig(max_context_tokens=1024))


def rollout(tiny, config: ServiceConfig, env: type[NotesEnv] = NotesEnv):
    async def body():
        engine = TorchEngine(*tiny)
        gateway = gateway_for(tiny, engine)
        service = RolloutService(gateway, lambda t: env(), config)
        try:
            result = await service.process(RolloutRequest(task=task(), seed=3))
            return result, gateway.sessions
        finally:
            await engine.close()

    return asyncio.run(body())


def prompts(record) -> list[int]:
    """The length of the prompt each action of ``record`` was generated from."""
    mask = record["action_mask"]
    return [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]


def first_prompt_size(tiny) -> int:
    messages = asyncio.run(NotesEnv().reset(task()))
    return len(Gateway(Router([]), tiny[1]).renderer.first(messages))


@pytest.mark.parametrize("keep", [1, 2])
def test_a_rollout_past_compact_at_goes_on_in_branches_holding_the_first_messages_and_its_last_turns(
    tiny, keep
):
    _, tokenizer = tiny
    compact_at = first_prompt_size(tiny) + 70
    config = ServiceConfig(max_new_tokens=4, compact_at=compact_at, compact_keep_turns=keep)
    result, still_open = rollout(tiny, config)

    assert still_open == []  # every branch's session, and the last one's, closed
    # truncated: the untrained model's last action may run to max_new_tokens; scored all the same
    assert result.status in ("ok", "truncated") and result.reward == 1.0 and result.turns == TURNS
    records = result.records
    assert len(records) >= 2 and records[-1] is result.record
    validate(to_table(records))
    assert sum(len(prompts(r)) for r in records) == TURNS
    assert [r["trajectory_id"] for r in records[:-1]] == [r["parent_id"] for r in records[1:]]
    assert records[0]["parent_id"] is None and records[0]["branch_at"] is None
    assert len({r["execution_id"] for r in records}) == 1
    for record in records:
        assert (record["reward"], record["status"], record["progress"]) == (1.0, result.status, 1.0)
        assert all(p <= compact_at for p in prompts(record))
    assert [r["timing"] is None for r in records] == [True] * (len(records) - 1) + [False]

    seen = 0
    for parent, child in zip(records, records[1:], strict=False):
        at = child["branch_at"]
        assert child["tokens"][:at] == parent["tokens"][:at]
        assert child["tokens"][at] != parent["tokens"][at]
        assert not any(child["action_mask"][:at])
        seen += len(prompts(parent))
        context = tokenizer.decode(child["tokens"][: prompts(child)[0]])
        # the task, then the last ``keep`` turns: their notes, and none before them
        assert context.startswith(tokenizer.decode(parent["tokens"][:at]))
        kept = range(seen - keep + 1, seen + 1)
        assert [n for n in range(1, seen + 1) if f"note {n} " in context] == list(kept)
        # and their actions: one each, then the header of the action the branch goes on with
        assert context.count("<|im_start|>assistant\n") == keep + 1


def test_without_compact_at_a_rollout_is_one_record_however_long(tiny):
    result, _ = rollout(tiny, ServiceConfig(max_new_tokens=4))
    assert result.branches == [] and result.records == [result.record]
    assert len(prompts(result.record)) == TURNS
    assert max(prompts(result.record)) > first_prompt_size(tiny) + 70


def test_a_prompt_of_exactly_compact_at_tokens_stays_in_its_context(tiny):
    """``compact_at`` is the longest prompt a context takes: a rollout whose last prompt is
    that long is one record, and one a token past it goes on in a branch."""
    whole, _ = rollout(tiny, ServiceConfig(max_new_tokens=4))
    longest = prompts(whole.record)[-1]
    at_limit, _ = rollout(tiny, ServiceConfig(max_new_tokens=4, compact_at=longest))
    assert at_limit.records == [at_limit.record] and at_limit.record["tokens"] == whole.record["tokens"]
    past, _ = rollout(tiny, ServiceConfig(max_new_tokens=4, compact_at=longest - 1))
    assert len(past.records) >= 2


class LongNoteEnv(NotesEnv):
    """:class:`NotesEnv` whose third note is longer than the whole context."""

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        if self.turns == 3:
            result.observation[0]["content"] += " word" * 1000
        return result


def test_a_branch_that_cannot_fit_the_context_truncates_the_rollout(tiny):
    result, still_open = rollout(
        tiny, ServiceConfig(max_new_tokens=4, compact_at=first_prompt_size(tiny) + 70), env=LongNoteEnv
    )
    assert still_open == []
    assert result.status == "truncated" and result.reward == 0.0 and result.turns == 3
    assert (
        result.error.startswith("context limit: a branch of session")
        and "over max_context_tokens=1024" in result.error
    )
    assert result.branches == []  # the rollout's one context, cut short where the branch failed


class TwoNotesEnv(NotesEnv):
    """:class:`NotesEnv` whose every observation is two messages: its note, then a reminder."""

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        result.observation.append({"role": "user", "content": f"reminder {self.turns} of the task"})
        return result


def test_a_branch_keeps_every_message_of_an_observation_of_its_kept_turns(tiny):
    _, tokenizer = tiny
    config = ServiceConfig(max_new_tokens=4, compact_at=first_prompt_size(tiny) + 90, compact_keep_turns=2)
    result, still_open = rollout(tiny, config, env=TwoNotesEnv)
    assert still_open == [] and result.turns == TURNS and len(result.records) >= 2
    seen = 0
    for parent, child in itertools.pairwise(result.records):
        seen += len(prompts(parent))
        context = tokenizer.decode(child["tokens"][: prompts(child)[0]])
        for word in ("note", "reminder"):
            assert [n for n in range(1, seen + 1) if f"{word} {n} " in context] == [seen - 1, seen]


def test_a_rollout_compacts_once_it_holds_more_turns_than_a_branch_keeps(tiny):
    """Past compact_at from its first turn, a rollout that keeps 3 turns stays in its first
    context until it holds 4, then goes on in a new branch every turn but the last."""
    config = ServiceConfig(max_new_tokens=4, compact_at=first_prompt_size(tiny) + 1, compact_keep_turns=3)
    result, still_open = rollout(tiny, config)
    assert still_open == [] and result.turns == TURNS
    assert [len(prompts(record)) for record in result.records] == [4, 1, 1, 1, 1]


def test_the_processor_trains_the_shared_first_messages_once_and_every_action_of_each_branch(tiny):
    compact_at = first_prompt_size(tiny) + 70
    result, _ = rollout(tiny, ServiceConfig(max_new_tokens=4, compact_at=compact_at))
    records = result.records
    processed = process_shard(to_table(records), ProcessorConfig(j_max=None), shard_id="s")

    assert processed.counters.errors == []
    assert processed.counters.trajectories_out == len(records)
    train_masks = processed.processed.column("train_mask").to_pylist()
    for record, trained in zip(records, train_masks, strict=True):
        assert trained == record["action_mask"]  # a branch's actions are its own
    rows = processed.trajectories
    assert {row["drop_reason"] for row in rows} == {None}


class ListSink:
    def __init__(self):
        self.writes: list[list[dict]] = []

    def write_many(self, records):
        self.writes.append(list(records))

    def flush(self):
        return None


def test_the_orchestrator_writes_a_compacted_rollouts_records_together(tiny):
    sink = ListSink()
    compact_at = first_prompt_size(tiny) + 70

    async def body():
        engine = TorchEngine(*tiny)
        config = ServiceConfig(max_new_tokens=4, compact_at=compact_at)
        service = RolloutService(gateway_for(tiny, engine), lambda t: NotesEnv(), config)
        tasks = {"arith": itertools.cycle(ArithEnv.tasks("train", seed=0, n=8))}
        orchestrator = Orchestrator(
            service, tasks, sink, OrchestratorConfig(mix={"arith": 1.0}, concurrency=2, max_rollouts=3)
        )
        try:
            await orchestrator.run()
        finally:
            await engine.close()
        return orchestrator.stats.as_dict()

    stats = asyncio.run(body())
    # the worker's count of finished rollouts (its status's ``finished``): rollouts, not rows;
    # their rows (``finished_rows``) are the trainer's rollout rate
    assert stats["finished"] == 3
    assert len(sink.writes) == 3
    assert stats["finished_rows"] == sum(len(records) for records in sink.writes)
    for records in sink.writes:
        assert len(records) >= 2
        assert len({r["execution_id"] for r in records}) == 1
        assert sum(r["parent_id"] is None for r in records) == 1
    ids = [r["trajectory_id"] for records in sink.writes for r in records]
    assert len(set(ids)) == len(ids)


def test_a_rollout_cut_at_max_turns_opens_no_branch_after_its_last_action(tiny):
    """The last turn service.max_turns allows is past compact_at: no branch is opened for a
    turn that will never be generated (it would be a row of the rollout without an action)."""
    config = ServiceConfig(max_new_tokens=4, max_turns=3, compact_at=first_prompt_size(tiny) + 1)
    result, still_open = rollout(tiny, config)

    assert still_open == []
    assert result.status == "truncated" and result.turns == 3
    assert [len(prompts(r)) for r in result.records] == [2, 1]


def test_the_service_http_api_counts_a_rollouts_branches_under_one_name_and_returns_them_under_another(tiny):
    """``/process`` without tokens gives the summary; with them, the same summary (the count
    of branches an int either way) plus the records."""
    config = ServiceConfig(max_new_tokens=4, compact_at=first_prompt_size(tiny) + 70)

    async def body():
        engine = TorchEngine(*tiny)
        service = RolloutService(gateway_for(tiny, engine), lambda t: NotesEnv(), config)
        transport = httpx.ASGITransport(app=create_app(service, "token"))
        try:
            async with httpx.AsyncClient(
                transport=transport, base_url="http://service", timeout=60
            ) as client:
                return [
                    (
                        await client.post(
                            "/process",
                            json={"task": task().model_dump(), "seed": 3, "include_tokens": tokens},
                            headers={"Authorization": "Bearer token"},
                        )
                    ).json()
                    for tokens in (False, True)
                ]
        finally:
            await engine.close()

    summary, whole = asyncio.run(body())
    assert summary["num_branches"] == whole["num_branches"] == len(whole["branches"]) >= 1
    assert "branches" not in summary and "record" not in summary
    assert [b["parent_id"] for b in whole["branches"][1:]] == [
        b["trajectory_id"] for b in whole["branches"][:-1]
    ]
    assert whole["record"]["parent_id"] == whole["branches"][-1]["trajectory_id"]


class HeldNotesEnv(NotesEnv):
    """:class:`NotesEnv` whose last step sets ``reached`` and never returns."""

    def __init__(self, reached: asyncio.Event):
        super().__init__()
        self.reached = reached

    async def step(self, action: str) -> StepResult:
        if self.turns == TURNS - 1:
            self.reached.set()
            await asyncio.Event().wait()
        return await super().step(action)


def routing_status(router: Router) -> RolloutStatus:
    """What a rollout worker publishes of ``router`` (``RolloutWorker.status``, ``tasks.rollout``)."""
    loads = {name: router.load(name) for name in router.replicas}
    return RolloutStatus(
        worker="w0",
        time=0.0,
        engine_queue_depth=0,
        live_sessions=sum(loads.values()),
        running=True,
        replica_sessions=loads,
        draining=router.draining,
        session_ages=router.session_ages(),
        sessions_ended=router.sessions_ended,
        session_lengths=list(router.session_lengths),
        session_contexts=list(router.session_contexts),
    )


def test_the_elastic_forecast_counts_a_compacted_rollout_once_from_its_start_and_drains_at_its_contexts(
    tiny, monkeypatch
):
    """The elastic controller takes a session's end as trajectories on their way to the
    trainer and learns session lengths to forecast those ends; a compacted rollout's rows,
    one per context, are written only when it ends, so its contexts are one session to the
    forecast: it ends once, 80 s long (8 steps of 10 s on the router's clock), bringing its
    rows, and a live one is as old as its rollout. A replica drained under it still empties
    at a context boundary: with sessions left where they run (no migration), the branch
    opened after the drain goes to the other replica."""
    clock = [0.0]
    monkeypatch.setattr(router_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    seen: list[RolloutStatus] = []  # the worker's status at each step of the two rollouts
    engines = [TorchEngine(*tiny, name=f"torch-{i}") for i in range(2)]
    router = Router(engines, RouterConfig(migrate_on_drain=False))

    class ClockedNotesEnv(NotesEnv):
        async def step(self, action: str) -> StepResult:
            clock[0] += 10.0
            if not seen:
                (first,) = [name for name, ages in router.session_ages().items() if ages]
                router.drain(first)
            seen.append(routing_status(router))
            return await super().step(action)

    config = ServiceConfig(max_new_tokens=4, compact_at=first_prompt_size(tiny) + 70)

    async def body():
        gateway = Gateway(router, tiny[1], GatewayConfig(max_context_tokens=1024))
        service = RolloutService(gateway, lambda t: ClockedNotesEnv(), config)
        try:
            return [await service.process(RolloutRequest(task=task(), seed=3)) for _ in range(2)]
        finally:
            for engine in engines:
                await engine.close()

    results = asyncio.run(body())
    assert [len(result.records) >= 2 for result in results] == [True, True]  # compacted
    assert (router.sessions_ended, list(router.session_lengths)) == (2, [80.0, 80.0])
    rows = [len(result.records) for result in results]
    assert list(router.session_contexts) == rows
    first_steps, second_steps = seen[:TURNS], seen[TURNS:]
    for steps in (first_steps, second_steps):
        assert [[a for ages in s.session_ages.values() for a in ages] for s in steps] == [
            [10.0 * (k + 1)] for k in range(TURNS)
        ]
    (drained,) = first_steps[0].draining
    assert first_steps[0].replica_sessions[drained] == 1
    assert first_steps[-1].replica_sessions[drained] == 0 and first_steps[-1].live_sessions == 1

    planner = ElasticPlanner(ElasticConfig(forecast_horizon_s=20))
    planner.observe([first_steps[0]], now=1000.0)  # sets where the worker's counts start
    planner.observe([second_steps[4]], now=1000.0)
    assert (planner.controller.lengths.ordered, planner.controller.lengths.rows) == ([80.0], rows[:1])
    assert planner.controller.forecast_completions(1000.0) == 0.0  # 50 s into a rollout of 80
    planner.observe([second_steps[6]], now=1000.0)
    # 70 s in, it ends within 20 s, bringing as many rows as the first
    assert planner.controller.forecast_completions(1000.0) == rows[0]


@pytest.mark.parametrize("end", ["cancel", "timeout"])
def test_a_rollout_cancelled_or_timed_out_in_a_branch_leaves_no_session_open(tiny, end, monkeypatch):
    clocks = []

    class RecordedClock(service_module._Clock):
        """The rollout's clock, kept: the test ends its budget once the rollout is held in a
        branch, however long the turns before took (a 3 s budget hung the test past it)."""

        def __init__(self, budget: float):
            super().__init__(budget)
            clocks.append(self)

    monkeypatch.setattr(service_module, "_Clock", RecordedClock)
    config = ServiceConfig(max_new_tokens=4, compact_at=first_prompt_size(tiny) + 70, timeout_s=600)

    async def body():
        engine = TorchEngine(*tiny)
        gateway = gateway_for(tiny, engine)
        reached = asyncio.Event()
        service = RolloutService(gateway, lambda t: HeldNotesEnv(reached), config)
        try:
            job = asyncio.create_task(service.process(RolloutRequest(task=task(), seed=3, rollout_id="r")))
            await reached.wait()
            if end == "cancel":
                assert service.cancel("r")
                with pytest.raises(asyncio.CancelledError):
                    await job
                return None, gateway.sessions
            (clock,) = clocks
            clock.deadline.reschedule(asyncio.get_running_loop().time())  # out of time in its branch
            return await job, gateway.sessions
        finally:
            await engine.close()

    result, still_open = asyncio.run(body())
    assert still_open == []
    if end == "timeout":
        assert result.status == "timeout" and result.branches
        assert {r["status"] for r in result.records} == {"timeout"}
        # every context of the rollout says why it ended, as its status does
        assert {r["error"] for r in result.records} == {result.error} and "budget" in result.error


def test_a_compact_at_below_a_compacted_context_is_warned_once(tiny, caplog):
    """A threshold the first messages and the kept turns already pass makes a branch of every
    turn past it: said once, with what a compacted context holds."""
    size = first_prompt_size(tiny)
    with caplog.at_level(logging.WARNING, logger="rollout.service"):
        result, _ = rollout(tiny, ServiceConfig(max_new_tokens=4, compact_at=size + 5, compact_keep_turns=2))
    warned = [r.getMessage() for r in caplog.records if "compact_at" in r.getMessage()]
    assert len(result.branches) == TURNS - 3  # a branch after each turn from the third on
    assert len(warned) == 1 and warned[0].startswith(
        f"service.compact_at {size + 5} is below a compacted context"
    )
    assert "the last 2 turns of a rollout of arith" in warned[0]
    assert warned[0].endswith("raise compact_at or lower compact_keep_turns")


def test_a_compact_at_below_a_context_of_one_kept_turn_is_warned_only_to_be_raised(tiny, caplog):
    """compact_keep_turns is at its least (1): the warning does not ask to lower it."""
    size = first_prompt_size(tiny)
    with caplog.at_level(logging.WARNING, logger="rollout.service"):
        result, _ = rollout(tiny, ServiceConfig(max_new_tokens=4, compact_at=size + 2, compact_keep_turns=1))
    (warned,) = [r.getMessage() for r in caplog.records if "compact_at" in r.getMessage()]
    assert result.branches
    assert "the last 1 turns of a rollout of arith" in warned
    assert warned.endswith("raise compact_at") and "compact_keep_turns" not in warned


def test_a_compact_at_above_every_compacted_context_is_not_warned(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="rollout.service"):
        result, _ = rollout(tiny, ServiceConfig(max_new_tokens=4, compact_at=first_prompt_size(tiny) + 70))
    assert result.branches
    assert not [r for r in caplog.records if "compact_at" in r.getMessage()]


SCRIPTS = {
    "pytool": ["run: x = 41", "run: y = 1", "run: print(x + y)", "answer: 42"],
    "shell": ["mkdir deep", "cd deep", "echo kept > here.txt", "cat here.txt; basename $PWD", "done"],
}
SEEN = {"pytool": "\n42<|im_end|>", "shell": "\nkept\ndeep<|im_end|>"}


@needs_bwrap
@pytest.mark.parametrize("name", ["pytool", "shell"])
def test_a_tool_env_keeps_its_sandbox_across_a_compaction(tiny, name):
    """Only the model's context is compacted: the interpreter's variables and the shell's
    directory, made in turns the last context no longer holds, are still there."""
    base = PyToolEnv if name == "pytool" else ShellEnv
    script = SCRIPTS[name]
    workdirs = []

    class Scripted(base):
        async def reset(self, task):
            first = await super().reset(task)
            workdirs.append(self.sandbox.workdir)
            return first

        async def step(self, action: str) -> StepResult:
            return await super().step(script[self.turns])

    config = base.config_cls(max_turns=len(script))
    task = base.tasks("train", seed=0, n=1)[0]

    async def body():
        engine = TorchEngine(*tiny)
        gateway = gateway_for(tiny, engine)
        service = RolloutService(
            gateway, lambda t: Scripted(config), ServiceConfig(max_new_tokens=4, compact_at=60)
        )
        try:
            return await service.process(RolloutRequest(task=task, seed=3)), gateway.sessions
        finally:
            await engine.close()

    result, still_open = asyncio.run(body())
    assert still_open == [] and len(workdirs) == 1 and not os.path.exists(workdirs[0])
    assert result.turns == len(script) and result.branches
    last = tiny[1].decode(result.record["tokens"])
    assert script[0].removeprefix("run: ") not in last and SEEN[name] in last
