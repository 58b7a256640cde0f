"""Tool calls: the Hermes parser on hand-worked replies, the tiny chat template's tool
rendering, and OpenAI function calling through the gateway's HTTP server end to end, with
the official client and a real TorchEngine whose tiny model was trained (here, in a few
hundred steps) to call a tool and then answer from its result."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import json
import shlex
import sys

import openai
import pytest
import torch

from envs import registry
from envs.sandbox import SandboxConfig, bwrap_path
from rl.models import TinyModelConfig, build_tiny_model
from rl.tokenizer import CHAT_TEMPLATE
from rollout.engines.torch_engine import TorchEngine
from rollout.gateway import ChatRenderer, Gateway, GatewayConfig
from rollout.gateway_http import SESSION_HEADER, GatewayServer
from rollout.router import Router
from rollout.service import RolloutRequest, RolloutService, ServiceConfig
from rollout.tool_calls import parse_hermes, same_calls, tool_call_message
from storage.schema import to_table, validate

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny."


def test_hermes_blocks_become_calls_and_the_rest_stays_content():
    text = f'Let me look.\n{CALL_TEXT}\n<tool_call>{{"name": "f", "arguments": {{}}}}</tool_call>'
    assert parse_hermes(text) == (
        "Let me look.",
        [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}],
    )
    # a call without arguments has an empty object; braces inside strings are JSON's business
    assert parse_hermes('<tool_call>{"name": "g"}</tool_call>') == ("", [{"name": "g", "arguments": {}}])
    # the model may stop right after the last call's JSON, before its closing tag
    assert parse_hermes('Sure.\n<tool_call>\n{"name": "g", "arguments": {"n": 1}}\n') == (
        "Sure.",
        [{"name": "g", "arguments": {"n": 1}}],
    )
    assert parse_hermes('<tool_call>{"name": "g", "arguments": {"s": "}</tool_call>"}}</tool_call>') == (
        "",
        [{"name": "g", "arguments": {"s": "}</tool_call>"}}],
    )


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": " ", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "f", "parameters": {"n": 1}}</tool_call>',  # not silently dropped
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # strict JSON readers refuse NaN
        '<tool_call>{"name": "f", "arguments": {"x": -1e400}}</tool_call>',  # re-serialised as -Infinity
        r'<tool_call>{"name": "f", "arguments": {"s": "\ud800"}}</tool_call>',  # a lone surrogate: no UTF-8
        r'<tool_call>{"name": "f\udc80", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} and more',  # unclosed, and not the end
        '<tool_call>\n{"name": "get_weather", "arguments": {"ci',  # cut by the token budget
        "<tool_call>" + "[" * 5000,  # nested deeper than the JSON decoder recurses
    ],
)
def test_what_is_not_a_well_formed_call_stays_in_the_content_as_written(text):
    assert parse_hermes(text) == (text.strip(), [])
    assert tool_call_message(text, "hermes") is None


def test_a_call_nested_just_below_the_decoders_limit_stays_content_and_never_raises():
    """The arguments are decoded, then encoded to check the reply can be sent: encoding takes
    a few frames more than decoding, so at the depth between the two limits the check raised
    RecursionError, the turn the engine had generated was lost and the client got HTTP 500."""
    for depth in range(1, sys.getrecursionlimit()):
        nested = "[" * depth + "]" * depth
        text = f'<tool_call>{{"name": "f", "arguments": {{"a": {nested}}}}}</tool_call>'
        content, calls = parse_hermes(text)
        assert (content, [call["name"] for call in calls]) in [("", ["f"]), (text, [])]


def test_the_content_around_a_call_keeps_its_inner_spacing():
    call = '<tool_call>{"name": "f"}</tool_call>'
    assert parse_hermes(f" before \n{call}\n after ") == (
        "before \n\n after",
        [{"name": "f", "arguments": {}}],
    )


def test_a_bad_block_between_good_ones_stays_where_it_was():
    bad = "<tool_call>oops</tool_call>"
    content, calls = parse_hermes(f"{CALL_TEXT} then {bad} end")
    assert content == f"then {bad} end" and [c["name"] for c in calls] == ["get_weather"]


def test_the_message_carries_ids_json_arguments_and_no_content_when_only_calls():
    message = tool_call_message(CALL_TEXT, "hermes")
    (call,) = message["tool_calls"]
    assert message["content"] is None and message["role"] == "assistant"
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert tool_call_message(CALL_TEXT, "hermes")["tool_calls"][0]["id"] != call["id"]
    # the arguments string keeps what is not ASCII as written, as vLLM's hermes parser does
    zurich = tool_call_message(
        '<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>', "hermes"
    )
    assert zurich["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'
    # an escaped surrogate pair is one character; a lone one (above) has no UTF-8 form, and the
    # reply holding it could not be sent (HTTP 500)
    emoji = tool_call_message(
        r'<tool_call>{"name": "f", "arguments": {"s": "\ud83d\ude00"}}</tool_call>', "hermes"
    )
    assert emoji["tool_calls"][0]["function"]["arguments"].encode() == '{"s": "😀"}'.encode()
    with pytest.raises(ValueError, match="unknown tool_call_format"):
        tool_call_message(CALL_TEXT, "mistral")


def test_a_resent_call_matches_by_function_and_argument_values():
    ours = tool_call_message(CALL_TEXT, "hermes")["tool_calls"]
    compact = [
        {
            "id": "other",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        }
    ]
    assert same_calls(ours, compact)
    assert not same_calls(ours, [{"function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}])
    assert not same_calls(ours, [{"function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}])
    assert not same_calls(ours, [{"function": {"name": "get_weather", "arguments": "{broken"}}])
    assert not same_calls(ours, [])
    assert not same_calls(ours, "get_weather")
    assert same_calls(None, None) and same_calls(None, [])


def test_a_resent_call_whose_booleans_became_numbers_differs():
    """Python's ``True == 1`` made ``{"verbose": true}`` resent as ``{"verbose": 1}`` (and
    ``false`` as ``0``, at any depth) count as the call the session holds, so a changed
    history was taken as unchanged; a number re-serialised (``1.0`` as ``1``) still matches."""
    ours = tool_call_message(
        '<tool_call>{"name": "f", "arguments": {"verbose": true, "n": [false, 1.0]}}</tool_call>', "hermes"
    )["tool_calls"]

    def resent(arguments: str) -> list[dict]:
        return [{"function": {"name": "f", "arguments": arguments}}]

    assert same_calls(ours, resent('{"verbose":true,"n":[false,1]}'))
    assert not same_calls(ours, resent('{"verbose": 1, "n": [false, 1.0]}'))
    assert not same_calls(ours, resent('{"verbose": true, "n": [0, 1.0]}'))
    assert not same_calls(ours, resent('{"verbose": true, "n": [false, true]}'))
    assert not same_calls(ours, [{"function": {"name": "f", "arguments": {"verbose": 1.0, "n": [0, 1]}}}])


def test_a_clients_own_calls_resent_as_they_were_sent_match_and_odd_shapes_never_raise():
    """A session's history also holds the assistant messages a client wrote itself, in any
    shape the chat template rendered: resent as sent they match (they raised TypeError or
    KeyError: HTTP 500, or were refused as changed), and no resent shape raises (a string
    nested past the JSON decoder's limit raised RecursionError)."""
    objects = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    assert same_calls(objects, copy.deepcopy(objects))
    assert same_calls(objects, [{"function": {"name": "f", "arguments": '{"x": 1}'}}])
    assert not same_calls(objects, [{"function": {"name": "f", "arguments": {"x": 2}}}])
    not_json = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "x=1"}}]
    assert same_calls(not_json, [{"function": {"name": "f", "arguments": "x=1"}}])
    assert not same_calls(not_json, [{"function": {"name": "f", "arguments": "x=2"}}])
    bare = [{"name": "f", "arguments": {"x": 1}}]  # Qwen's templates render a call without "function"
    assert same_calls(bare, copy.deepcopy(bare))
    assert not same_calls(bare, [{"function": {"name": "f", "arguments": {"x": 1}}}])
    assert not same_calls(bare, [{"name": "g", "arguments": {"x": 2}}])  # calls without "function" differ
    ours = tool_call_message(CALL_TEXT, "hermes")["tool_calls"]
    deep = {"name": "get_weather", "arguments": "[" * 100_000}
    assert not same_calls(ours, [{"function": deep}])
    assert same_calls([{"id": "c1", "function": deep}], [{"id": "c2", "function": dict(deep)}])


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_model(TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32))[
        1
    ]


def test_without_tools_the_template_is_plain_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "t"},
    ]
    rendered = tokenizer.apply_chat_template(messages[:3], add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
        "<|im_start|>assistant\na<|im_end|>\n<|im_start|>assistant\n"
    )
    with_tool = tokenizer.apply_chat_template(messages, tokenize=False)
    assert with_tool.endswith("<|im_start|>user\n<tool_response>\nt\n</tool_response><|im_end|>\n")


def test_with_tools_the_template_lists_them_and_writes_calls_as_the_parser_reads_them(tokenizer):
    system = {"role": "system", "content": "Be brief."}
    call = tool_call_message(f"Checking.\n{CALL_TEXT}", "hermes")
    results = [{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "20 C"}]
    rendered = tokenizer.apply_chat_template(
        [system, *CONVERSATION, call, *results], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    head = rendered[: rendered.index("<|im_start|>user")]
    assert head.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in head and head.count("<|im_start|>") == 1
    reply = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert reply == f"Checking.\n{CALL_TEXT}"
    assert parse_hermes(reply)[1] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert rendered.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n20 C\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    only_calls = tokenizer.apply_chat_template(
        [*CONVERSATION, tool_call_message(CALL_TEXT, "hermes")], tools=TOOLS, tokenize=False
    )
    assert only_calls.endswith(f"<|im_start|>assistant\n{CALL_TEXT}<|im_end|>\n")


def test_the_template_writes_a_call_without_function_as_qwens_templates_do(tokenizer):
    """Qwen2.5's and Qwen3's templates take a call as ``{"name", "arguments"}`` as well as
    wrapped in ``function``: a client's own assistant message in that shape was refused
    (HTTP 400) by the tiny model's template, which claims to write calls as they do."""
    wrapped = tool_call_message(CALL_TEXT, "hermes")
    bare = {**wrapped, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    render = functools.partial(tokenizer.apply_chat_template, tools=TOOLS, tokenize=False)
    assert render([*CONVERSATION, bare]) == render([*CONVERSATION, wrapped])


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _train_to_call_then_answer(model, tokenizer) -> dict[str, list[int]]:
    """Train ``model`` until greedy decoding writes the tool call for the first prompt and
    the answer after the tool's result; returns each turn's prompt and target ids."""
    first = _tokens(
        tokenizer,
        tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False),
    )
    call = _tokens(tokenizer, CALL_TEXT) + [tokenizer.eos_token_id]
    after = _tokens(
        tokenizer,
        "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    )
    answer = _tokens(tokenizer, ANSWER) + [tokenizer.eos_token_id]
    sequence = torch.tensor([first + call + after + answer])
    labels = sequence.clone()
    labels[0, : len(first)] = -100
    labels[0, len(first) + len(call) : len(first) + len(call) + len(after)] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    targets = labels[0, 1:]
    learned = targets != -100
    model.train()
    for _ in range(400):
        output = model(input_ids=sequence, labels=labels)
        greedy = output.logits[0, :-1].argmax(-1)
        if bool((greedy[learned] == targets[learned]).all()) and output.loss.item() < 0.05:
            break
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
    model.eval()
    return {"first": first, "call": call, "after": after, "answer": answer}


@pytest.fixture(scope="module")
def caller():
    torch.manual_seed(0)
    model, tokenizer = build_tiny_model(
        TinyModelConfig(
            hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_position_embeddings=1024
        )
    )
    ids = _train_to_call_then_answer(model, tokenizer)
    return model, tokenizer, ids


@contextlib.asynccontextmanager
async def serving(model, tokenizer, config: GatewayConfig | None = None):
    engine = TorchEngine(copy.deepcopy(model), tokenizer, name="caller")
    gateway = Gateway(
        Router([engine]), tokenizer, config or GatewayConfig(max_context_tokens=1024, max_new_tokens=96)
    )
    server = await GatewayServer(gateway).start()
    try:
        yield gateway, server
    finally:
        await server.stop()
        await engine.close()


def _client(server, session_id: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=server.token, default_headers={SESSION_HEADER: session_id}
    )


GREEDY = {"model": "any", "temperature": 1e-5, "max_tokens": 96}


def test_an_openai_client_calls_a_tool_and_reads_the_answer_recorded_token_exactly(caller):
    model, tokenizer, ids = caller

    async def body():
        async with serving(model, tokenizer) as (gateway, server):
            sid = gateway.open(task="agent", prompt_id="weather").session_id
            client = _client(server, sid)
            first = await client.chat.completions.create(messages=CONVERSATION, tools=TOOLS, **GREEDY)
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            session = gateway.session(sid)
            assert session.tokens == ids["first"] + ids["call"], (
                "the prompt holds the tools; the call is as sampled"
            )

            conversation = [
                *CONVERSATION,
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
            ]
            second = await client.chat.completions.create(messages=conversation, tools=TOOLS, **GREEDY)
            assert (
                second.choices[0].message.content == ANSWER and second.choices[0].message.tool_calls is None
            )
            assert second.choices[0].finish_reason == "stop"
            assert session.tokens == ids["first"] + ids["call"] + ids["after"] + ids["answer"]
            # what the policy saw is the template's rendering of the whole conversation
            whole = [*conversation, {"role": "assistant", "content": ANSWER}]
            assert tokenizer.decode(session.tokens) == tokenizer.apply_chat_template(
                whole, tools=TOOLS, tokenize=False
            ).removesuffix("\n")
            record = session.record(reward=1.0)
            actions = [t for t, m in zip(record["tokens"], record["action_mask"], strict=True) if m]
            assert actions == ids["call"] + ids["answer"]
            validate(to_table([record]))

            # the client may re-serialise the arguments and drop the id; other arguments diverge
            resent = copy.deepcopy(conversation)
            resent[1]["tool_calls"][0] = {
                "id": "x",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
            follow_up = [
                *resent,
                second.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Thanks"},
            ]
            third = await client.chat.completions.create(messages=follow_up, tools=TOOLS, **GREEDY)
            assert session.num_turns == 3
            next_turn = [
                *follow_up,
                third.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "And tomorrow?"},
            ]
            diverged = copy.deepcopy(next_turn)
            diverged[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Rome"}'
            with pytest.raises(
                openai.BadRequestError, match="message 1 .* differs from the session's history"
            ):
                await client.chat.completions.create(messages=diverged, tools=TOOLS, **GREEDY)
            with pytest.raises(openai.BadRequestError, match="tool definitions differ"):
                await client.chat.completions.create(messages=next_turn, **GREEDY)
            await client.chat.completions.create(messages=next_turn, tools=TOOLS, **GREEDY)
            assert session.num_turns == 4
            await client.close()

    asyncio.run(body())


def test_tool_calls_stream_with_their_index_and_tool_choice_none_leaves_the_text(caller):
    model, tokenizer, _ = caller

    async def body():
        async with serving(model, tokenizer) as (gateway, server):
            sid = gateway.open(task="agent", prompt_id="stream").session_id
            client = _client(server, sid)
            stream = await client.chat.completions.create(
                messages=CONVERSATION, tools=TOOLS, stream=True, **GREEDY
            )
            chunks = [chunk async for chunk in stream]
            calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
            assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
                (0, "get_weather", {"city": "Paris"})
            ]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"

            plain = _client(server, gateway.open(task="agent", prompt_id="none").session_id)
            reply = await plain.chat.completions.create(
                messages=CONVERSATION, tools=TOOLS, tool_choice="none", **GREEDY
            )
            assert (
                reply.choices[0].message.content == CALL_TEXT and reply.choices[0].message.tool_calls is None
            )
            assert reply.choices[0].finish_reason == "stop"

            refused = gateway.open(task="agent", prompt_id="refused").session_id
            refusing = _client(server, refused)
            cases = [
                ({"tool_choice": "required"}, "forcing a tool call needs constrained decoding"),
                ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "not supported"),
                ({"tools": None, "tool_choice": "auto"}, "tool_choice 'auto' without tools"),
                ({"tools": None, "functions": [{"name": "f"}]}, "deprecated form of tools"),
                (
                    {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
                    "tools.0.function.name",
                ),
            ]
            for extra, error in cases:
                request = {"messages": CONVERSATION, "tools": TOOLS, **GREEDY, **extra}
                request = {k: v for k, v in request.items() if v is not None}
                with pytest.raises(openai.BadRequestError, match=error):
                    await refusing.chat.completions.create(**request)
            assert gateway.session(refused).tokens == []
            for opened in (client, plain, refusing):
                await opened.close()

    asyncio.run(body())


def test_tools_are_refused_where_they_could_not_reach_the_prompt_or_be_parsed(caller):
    model, tokenizer, _ = caller
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )

    async def body():
        for tok, config, error in [
            (plain, None, "chat template does not write them into the prompt"),
            (
                tokenizer,
                GatewayConfig(max_context_tokens=1024, tool_call_format=None),
                "parses no tool calls",
            ),
        ]:
            async with serving(model, tok, config) as (gateway, server):
                sid = gateway.open(task="agent", prompt_id="p").session_id
                client = _client(server, sid)
                with pytest.raises(openai.BadRequestError, match=error):
                    await client.chat.completions.create(messages=CONVERSATION, tools=TOOLS, **GREEDY)
                reply = await client.chat.completions.create(messages=CONVERSATION, **GREEDY)
                assert reply.choices[0].message.tool_calls is None, "no tools, nothing parsed"
                await client.close()

    asyncio.run(body())


TOOL_AGENT = """
import json, os, urllib.request
tools = json.loads(os.environ["AGENT_TOOLS"])
weather = {"Paris": "sunny"}
messages = [{"role": "user", "content": os.environ["TREADLE_TASK"]}]
while True:
    body = {"model": "policy", "messages": messages, "tools": tools, "temperature": 1e-5, "max_tokens": 96}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer x"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        choice = json.load(response)["choices"][0]
    messages.append(choice["message"])
    if choice["finish_reason"] != "tool_calls":
        break
    for call in choice["message"]["tool_calls"]:
        city = json.loads(call["function"]["arguments"])["city"]
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": weather[city]})
open("answer.txt", "w").write(messages[-1]["content"])
print(json.dumps(messages))
"""


@pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")
def test_an_agent_program_in_the_sandbox_runs_its_tool_calls_and_the_rollout_is_token_exact(caller):
    """The agent env through the rollout service: the program sends tools, runs the call it
    gets back and answers from the result; the record holds the tools' prompt, the call and
    the answer exactly as sampled, and the eval scores the answer."""
    model, tokenizer, ids = caller
    config = {
        "command": f"AGENT_TOOLS={shlex.quote(json.dumps(TOOLS))} python3 -I -c {shlex.quote(TOOL_AGENT)}",
        "eval_command": f"python3 -c \"print(float(open('answer.txt').read() == {ANSWER!r}))\"",
        "tasks": [{"id": "paris", "prompt": CONVERSATION[0]["content"]}],
        "sandbox": SandboxConfig(timeout_s=60, memory_mb=512, cpu_seconds=20).model_dump(),
    }
    (task,) = registry.task_set("agent", "eval", 0, 1, config)  # the one task's id falls in eval
    envs = []

    def make_env(task):
        envs.append(registry.make("agent", config))
        return envs[-1]

    async def body():
        engine = TorchEngine(copy.deepcopy(model), tokenizer, name="caller")
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
        # the program asks for temperature 1e-5, which a training rollout grants only as the run's
        service = RolloutService(
            gateway, make_env, ServiceConfig(timeout_s=120, max_new_tokens=96, temperature=1e-5)
        )
        try:
            return await service.process(RolloutRequest(task=task))
        finally:
            await service.close()
            await engine.close()

    result = asyncio.run(body())
    assert result.status == "ok", (result.error, envs[0].result.output)
    transcript = json.loads(envs[0].result.output.strip().splitlines()[-1])
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool", "assistant"]
    assert transcript[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert result.reward == 1.0 and result.turns == 2
    record = result.record
    validate(to_table([record]))
    assert record["tokens"] == ids["first"] + ids["call"] + ids["after"] + ids["answer"]
    actions = [t for t, generated in zip(record["tokens"], record["action_mask"], strict=True) if generated]
    assert actions == ids["call"] + ids["answer"]


def test_tool_markers_held_as_special_tokens_are_kept_for_parsing():
    """Some tokenizers hold ``<tool_call>`` as a special token, which a plain decode drops:
    the text the calls are parsed from keeps it, and still drops the other special tokens."""
    model, tokenizer = build_tiny_model(
        TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    model.resize_token_embeddings(len(tokenizer))
    engine = TorchEngine(model, tokenizer)
    gateway = Gateway(Router([engine]), tokenizer)
    action = _tokens(tokenizer, CALL_TEXT) + [tokenizer.eos_token_id]
    assert tokenizer.convert_ids_to_tokens(action[0]) == "<tool_call>"
    assert "<tool_call>" not in gateway.decode(action)
    assert gateway.tool_text(action) == CALL_TEXT
    assert (
        tool_call_message(gateway.tool_text(action), "hermes")["tool_calls"][0]["function"]["name"]
        == "get_weather"
    )
    asyncio.run(engine.close())


def test_the_text_calls_are_parsed_from_drops_special_tokens_the_tokenizer_does_not_name():
    """A Llama 3 tokenizer whose EOS is ``<|end_of_text|>`` ends turns with ``<|eot_id|>``,
    an added special token it names nowhere: decoding drops it, and so must the text the
    calls are parsed from, or the reply's content ends with the marker."""
    model, tokenizer = build_tiny_model(
        TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    )
    tokenizer.eos_token = "<|bos|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in tokenizer.all_special_ids, "precondition: <|im_end|> is special but unnamed"
    engine = TorchEngine(model, tokenizer)
    gateway = Gateway(Router([engine]), tokenizer)
    action = _tokens(tokenizer, "Looking.\n" + CALL_TEXT) + [im_end]
    assert im_end in gateway.stop_ids
    assert gateway.tool_text(action) == gateway.decode(action) == "Looking.\n" + CALL_TEXT
    assert tool_call_message(gateway.tool_text(action), "hermes")["content"] == "Looking."
    asyncio.run(engine.close())


def test_a_block_without_a_call_keeps_its_special_token_markers_in_the_content():
    """Where ``<tool_call>`` is a special token, a reply whose block holds no call still shows
    the client the block as written, markers and all, as it does beside a well-formed call."""
    model, tokenizer = build_tiny_model(
        TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    model.resize_token_embeddings(len(tokenizer))
    engine = TorchEngine(model, tokenizer)
    written = "<tool_call>oops</tool_call>"
    action = _tokens(tokenizer, written) + [tokenizer.eos_token_id]
    real_generate = engine.generate

    async def generate(*args, **kwargs):
        generation = await real_generate(*args, **kwargs)  # this reply, as if the model wrote it
        return dataclasses.replace(
            generation, token_ids=action, logprobs=[-1.0] * len(action), versions=[0] * len(action)
        )

    engine.generate = generate

    async def body():
        gateway = Gateway(Router([engine]), tokenizer)
        try:
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(CONVERSATION, TOOLS)
            turn = await session.generate()
            assert turn.token_ids == action
            assert turn.message == {"role": "assistant", "content": written}
        finally:
            await engine.close()

    asyncio.run(body())


def test_a_clients_tool_call_arguments_sent_as_a_json_string_render_as_the_object_the_model_wrote(tokenizer):
    """OpenAI messages carry a call's arguments as a JSON string; Qwen2.5's template (and
    Llama 3.1's) write them through ``tojson``, which quoted that string a second time, so a
    client's own assistant call (a first prompt that holds one, a branch's context) reached
    the policy as ``"arguments": "{\\"city\\": ...}"``, never as it writes calls. They are
    read as JSON before rendering, as vLLM does; a string that is no JSON stays as sent."""
    qwen25 = copy.deepcopy(tokenizer)
    qwen25.chat_template = CHAT_TEMPLATE.replace(
        "{% if function['arguments'] is string %}{{ function['arguments'] }}"
        "{% else %}{{ function['arguments'] | tojson }}{% endif %}",
        "{{ function['arguments'] | tojson }}",
    )
    assert qwen25.chat_template != CHAT_TEMPLATE
    renderer = ChatRenderer(qwen25)
    called = tool_call_message(CALL_TEXT, "hermes")
    as_written = {**called, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    result = {"role": "tool", "content": "sunny"}
    sent = [*CONVERSATION, called, result]
    assert renderer.first(sent, TOOLS) == renderer.first([*CONVERSATION, as_written, result], TOOLS)
    assert CALL_TEXT in qwen25.decode(renderer.first(sent, TOOLS))
    assert renderer.delta([called, result], None) == renderer.delta([as_written, result], None)
    assert called["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}', "left as sent"

    not_json = copy.deepcopy(called)
    not_json["tool_calls"][0]["function"]["arguments"] = "city=Paris"
    assert '"arguments": "city=Paris"' in qwen25.decode(renderer.first([*CONVERSATION, not_json], TOOLS))
