"""The agent env through the rollout service and the real HTTP gateway.

A small agent program (``tests/envs/agent_script.py``) runs inside the sandbox, talks plain
HTTP (OpenAI chat completions) to the service's gateway through the env's relay over three
turns, runs every reply with a shell tool, and the rollout's record is checked token by
token against what the real ``TorchEngine`` (tiny model) was sent and generated.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from pathlib import Path

import pytest
import torch

from envs import registry
from envs.sandbox import SandboxConfig, bwrap_path
from rl.models import TinyModelConfig, build_tiny_model
from rollout.engines.torch_engine import TorchEngine
from rollout.gateway import ChatRenderer, Gateway, GatewayConfig
from rollout.router import Router
from rollout.service import RolloutRequest, RolloutService, ServiceConfig
from storage.schema import to_table, validate

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")
SCRIPT = (Path(__file__).parents[1] / "envs" / "agent_script.py").read_text()
TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=1024
)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny_model(TINY)


class RecordingEngine(TorchEngine):
    """The real ``TorchEngine``, keeping every prompt it was sent and every generation it returned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    async def generate(self, session_id, prompt_ids, params):
        generation = await super().generate(session_id, prompt_ids, params)
        self.calls.append((list(prompt_ids), generation))
        return generation


def agent_config() -> dict:
    return {
        "command": f"python3 -I -c {shlex.quote(SCRIPT)}",
        "eval_command": "python3 -c \"import json; print(float(len(json.load(open('transcript.json'))) == 7))\"",
        "tasks": [{"id": f"t{i}", "prompt": f"list the files ({i})"} for i in range(20)],
        "sandbox": SandboxConfig(timeout_s=60, memory_mb=512, cpu_seconds=20).model_dump(),
    }


def action_spans(mask: list[bool]) -> list[tuple[int, int]]:
    """``[start, end)`` of every run of generated tokens."""
    spans, start = [], None
    for i, generated in enumerate([*mask, False]):
        if generated and start is None:
            start = i
        elif not generated and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_agent_program_through_the_real_gateway_gives_a_token_exact_record(tiny):
    model, tokenizer = tiny
    task = registry.task_set("agent", "train", 0, 1, agent_config())[0]
    envs = []

    def make_env(task):
        envs.append(registry.make("agent", agent_config()))
        return envs[-1]

    async def body():
        engine = RecordingEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
        service = RolloutService(gateway, make_env, ServiceConfig(timeout_s=120))
        try:
            result = await service.process(RolloutRequest(task=task))
            return result, engine.calls, gateway.sessions
        finally:
            await service.close()
            await engine.close()

    result, calls, open_sessions = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    env = envs[0]
    assert env.result.exit_code == 0, env.result.output
    assert env.requests == 3 and result.turns == 3 and len(calls) == 3
    assert result.reward == 1.0
    assert open_sessions == []

    record = result.record
    validate(to_table([record]))
    assert record["task"] == "agent" and record["prompt_id"] == task.id
    tokens = record["tokens"]
    spans = action_spans(record["action_mask"])
    assert len(spans) == 3
    actions = []
    for turn, ((start, end), (prompt_ids, generation)) in enumerate(zip(spans, calls, strict=True)):
        assert prompt_ids == tokens[:start], "the engine must see exactly the record's prefix"
        assert tokens[start:end] == generation.token_ids
        assert record["logprobs"][start:end] == generation.logprobs
        assert record["versions"][start:end] == generation.versions
        assert set(record["turn"][start:end]) == {turn}
        actions.append(generation.token_ids)
    generated = {i for start, end in spans for i in range(start, end)}
    outside = [i for i in range(len(tokens)) if i not in generated]
    assert all(record["logprobs"][i] == 0.0 and record["versions"][i] == -1 for i in outside)

    # What the agent saw: each reply is the decoded action, and every tool output came back
    # as the next user message, appended as tokens through the chat template.
    transcript = json.loads(env.result.output.strip().splitlines()[-1])
    assert len(transcript) == 7 and transcript[0]["content"] == task.prompt
    assert any(transcript[2 * turn + 2]["content"] for turn in range(3)), "the shell tool printed nothing"
    for turn, action in enumerate(actions):
        assert transcript[2 * turn + 1]["content"] == tokenizer.decode(action, skip_special_tokens=True)
    renderer = ChatRenderer(tokenizer)
    first = tokenizer.apply_chat_template(transcript[:1], add_generation_prompt=True, tokenize=False)
    expected = tokenizer.encode(first, add_special_tokens=False) + actions[0]
    for turn in (1, 2):
        expected += renderer.delta([transcript[2 * turn]], actions[turn - 1]) + actions[turn]
    assert tokens == expected


AFFINITY_SCRIPT = """
import json, os, urllib.request
seen = [sorted(os.sched_getaffinity(0))]
messages = [{"role": "user", "content": os.environ["TREADLE_TASK"]}]
for turn in range(2):
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages, "max_tokens": 4, "seed": turn}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer x"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        reply = json.load(response)["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    seen.append(sorted(os.sched_getaffinity(0)))
print(json.dumps(seen))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_the_agent_program_runs_on_granted_cores_between_model_calls_and_is_parked_while_it_waits(tiny):
    model, tokenizer = tiny
    config = agent_config() | {"command": f"python3 -I -c {shlex.quote(AFFINITY_SCRIPT)}", "action_cores": 2}
    config["eval_command"] = "echo 1"
    task = registry.task_set("agent", "train", 0, 1, config)[0]
    envs, parked = [], []

    class ParkedWhileGenerating(TorchEngine):
        async def generate(self, session_id, prompt_ids, params):
            parked.append(os.sched_getaffinity(envs[0].resource_pid()))
            return await super().generate(session_id, prompt_ids, params)

    def make_env(task):
        envs.append(registry.make("agent", config))
        return envs[-1]

    async def body():
        engine = ParkedWhileGenerating(model, tokenizer)
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
        service = RolloutService(
            gateway, make_env, ServiceConfig(timeout_s=120, scheduler="action", scheduler_cores=2)
        )
        try:
            return service, await service.process(RolloutRequest(task=task))
        finally:
            await service.close()
            await engine.close()

    service, result = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    cpu = service.scheduler.cpu
    granted = sorted(cpu.pool)
    assert envs[0].result.exit_code == 0, envs[0].result.output
    assert json.loads(envs[0].result.output.strip().splitlines()[-1]) == [granted] * 3
    assert parked == [cpu.parking] * 2
    assert cpu.available == cpu.pool and service.scheduler.policy.free == [2.0]


@pytest.mark.parametrize(
    ("env_turns", "service_turns"), [(2, 32), (8, 2)], ids=["env-max_turns", "service-max_turns"]
)
def test_the_agent_programs_model_calls_are_capped_by_max_turns(tiny, env_turns, service_turns):
    """``envs.agent.max_turns`` and ``service.max_turns`` bounded a driven env's turns alone:
    an agent program's model calls went through however many it made. The call past them is
    refused (HTTP 400), nothing of it recorded, and the rollout ends truncated."""
    model, tokenizer = tiny
    config = agent_config() | {"max_turns": env_turns, "eval_command": "echo 1"}
    task = registry.task_set("agent", "train", 0, 1, config)[0]
    envs = []

    def make_env(task):
        envs.append(registry.make("agent", config))
        return envs[-1]

    async def body():
        engine = RecordingEngine(model, tokenizer, name="torch-0")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
        service = RolloutService(gateway, make_env, ServiceConfig(timeout_s=120, max_turns=service_turns))
        try:
            return await service.process(RolloutRequest(task=task)), engine.calls
        finally:
            await service.close()
            await engine.close()

    result, calls = asyncio.run(body())
    assert envs[0].requests == 3, "the program asked for its third turn"
    assert len(calls) == 2 and result.turns == 2
    assert envs[0].result.exit_code != 0 and "HTTP Error 400" in envs[0].result.output
    assert (result.status, result.error) == ("truncated", None), "out of turns, not of context"
    assert result.reward == 1.0, "the program's work is scored, as a truncated rollout's is"
    assert len(action_spans(result.record["action_mask"])) == 2
