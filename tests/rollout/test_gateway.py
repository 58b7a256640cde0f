"""TITO gateway sessions: chat rendering, verbatim multi-turn tokens, the trajectory
record, truncation and bad input, with a real tokenizer and real TorchEngine replicas on the
tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import math
import random
import threading

import pytest
import torch

import rollout.gateway as gateway_module
import storage.schema as schema
from rl.models import TinyModelConfig, build_tiny_model, model_eos_ids, publish_policy
from rl.processor import process_shard
from rollout.engines.base import ContextLimit, EngineError, InvalidRequest, SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.gateway import RENDER_INLINE_CHARS, ChatRenderer, Gateway, GatewayConfig, UnknownSession
from rollout.router import Router, RouterConfig
from storage.schema import TRAJECTORY_SCHEMA, to_table, validate
from storage.weights import WeightStore

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=512
)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny_model(TINY)


@contextlib.asynccontextmanager
async def running_gateway(
    tiny, replicas: int = 1, config: GatewayConfig | None = None, router: RouterConfig | None = None
):
    model, tokenizer = tiny
    engines = [TorchEngine(copy.deepcopy(model), tokenizer, name=f"engine-{i}") for i in range(replicas)]
    gateway = Gateway(Router(engines, router), tokenizer, config or GatewayConfig(max_context_tokens=512))
    try:
        yield gateway
    finally:
        for engine in engines:
            await engine.close()


def render(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


USER = [{"role": "system", "content": "reply only digits"}, {"role": "user", "content": "What is 2 + 3?"}]


def test_first_turn_is_the_chat_template_and_later_turns_append_only_new_tokens(tiny):
    _, tokenizer = tiny

    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="arith", prompt_id="p1")
            session.add_messages(USER)
            turn = await session.generate(
                SamplingParams(max_new_tokens=16, stop_ids=gateway.stop_ids, seed=1)
            )
            prompt = tokenizer.encode(render(tokenizer, USER), add_special_tokens=False)
            assert session.tokens == prompt + turn.token_ids
            held = list(session.tokens)
            session.add_messages([{"role": "user", "content": "try again"}])
            second = await session.generate(SamplingParams(max_new_tokens=4, seed=2))
            assert session.tokens[: len(held)] == held, "earlier tokens are kept verbatim"
            delta = session.tokens[len(held) : len(session.tokens) - len(second.token_ids)]
            text = tokenizer.decode(delta, skip_special_tokens=False)
            if turn.finish_reason == "stop" and turn.token_ids[-1] == tokenizer.eos_token_id:
                assert text == "\n<|im_start|>user\ntry again<|im_end|>\n<|im_start|>assistant\n"
            else:
                assert text == "<|im_end|>\n<|im_start|>user\ntry again<|im_end|>\n<|im_start|>assistant\n"
            assert session.tokens[-len(second.token_ids) :] == second.token_ids

    asyncio.run(body())


def test_an_action_cut_on_a_prefix_of_the_closing_text_is_followed_by_the_whole_closing(tiny):
    """The closing <|im_end|> is written in full after an action cut at the length limit,
    even when its last token decodes to "<", the start of the closing's text; after an
    action that stopped on <|im_end|>, only the rest of the closing is."""
    _, tokenizer = tiny
    renderer = ChatRenderer(tokenizer)
    new = [{"role": "user", "content": "again"}]
    body = "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    cut = tokenizer.encode("12<", add_special_tokens=False)
    assert tokenizer.decode(cut[-1:]) == "<", "precondition: the action's last token is '<'"
    assert renderer.delta(new, cut) == tokenizer.encode("<|im_end|>\n" + body, add_special_tokens=False)
    stopped = [
        *tokenizer.encode("12", add_special_tokens=False),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    assert renderer.delta(new, stopped) == tokenizer.encode("\n" + body, add_special_tokens=False)


def test_a_template_that_marks_only_the_last_assistant_turn_still_takes_deltas(tiny):
    """Qwen3's template writes an empty <think> block before the content of the last
    assistant turn only: once messages follow, that turn opens as the generation prompt the
    model continued, and the delta is what follows it; a template that rewrites the earlier
    messages themselves is still refused."""
    _, tokenizer = tiny
    turns = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
        "{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = turns
    renderer = ChatRenderer(thinking)
    new = [{"role": "user", "content": "again"}]
    body = "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    stopped = [
        *tokenizer.encode("12", add_special_tokens=False),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    assert renderer.delta(new, stopped) == tokenizer.encode("\n" + body, add_special_tokens=False)
    assert renderer.delta([{"role": "tool", "content": "t"}], None) == tokenizer.encode(
        "<|im_start|>tool\nt<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    counting = copy.deepcopy(tokenizer)
    counting.chat_template = (
        "{{ '<|im_start|>system\\n' + (messages | length | string) + '<|im_end|>\\n' }}" + turns
    )
    with pytest.raises(InvalidRequest, match="renders earlier messages differently"):
        ChatRenderer(counting).delta(new, stopped)


def test_a_template_that_counts_turns_in_the_prompt_it_leaves_out_of_earlier_turns_is_refused(tiny):
    """Like Qwen3's block, the turn number opens the prompt and the last assistant turn
    only; but it changes: a delta rendered after the one probe turn would prompt turn 2
    on every later turn (the template prompts turn 3 on the third)."""
    _, tokenizer = tiny
    numbered = copy.deepcopy(tokenizer)
    numbered.chat_template = (
        "{% set ns = namespace(n=0) %}{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}"
        "{% set ns.n = ns.n + 1 %}{% if loop.last %}{{ '[' ~ ns.n ~ ']\\n' }}{% endif %}{% endif %}"
        "{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n[' ~ (ns.n + 1) ~ ']\\n' }}{% endif %}"
    )
    with pytest.raises(InvalidRequest, match="renders earlier messages differently"):
        ChatRenderer(numbered).delta([{"role": "user", "content": "again"}], None)


def test_a_template_that_closes_earlier_assistant_turns_otherwise_than_the_last_is_refused(tiny):
    """The closing the session writes after an action is the one the template gives the last
    assistant turn; a template closing earlier turns with other text would follow the action
    with something the model never saw in that place."""
    _, tokenizer = tiny
    closing_by_place = copy.deepcopy(tokenizer)
    closing_by_place.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
        "{% if message['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>\\n' }}"
        "{% else %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(InvalidRequest, match="renders earlier messages differently"):
        ChatRenderer(closing_by_place).delta([{"role": "user", "content": "again"}], None)


def test_a_message_the_template_leaves_out_of_the_prompt_is_refused(tiny):
    """Qwen2.5's and Qwen3's templates write only the roles they know: a ``developer`` message
    (OpenAI's newer name for system, which OpenAI clients send) vanished from the prompt, and the
    policy was trained as if it had followed instructions it never saw. A message whose text the
    template does not write is refused, in a first prompt and in a delta; a template that writes
    every role takes it."""
    _, tokenizer = tiny
    known_roles = copy.deepcopy(tokenizer)
    known_roles.chat_template = (
        "{% for message in messages %}{% if message['role'] in ['system', 'user', 'assistant', 'tool'] %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    developer = {"role": "developer", "content": "Reply only digits."}
    renderer = ChatRenderer(known_roles)
    with pytest.raises(InvalidRequest, match="writes no text of a 'developer' message"):
        renderer.first([developer, USER[1]])
    with pytest.raises(InvalidRequest, match="writes no text of a 'developer' message"):
        renderer.delta([developer], None)
    assert renderer.first(USER) == ChatRenderer(tokenizer).first(USER)
    assert renderer.first([{"role": "developer", "content": " "}, USER[1]])  # no text to miss
    as_json = copy.deepcopy(tokenizer)  # as Llama 3.1's writes a tool message's content
    as_json.chat_template = known_roles.chat_template.replace(
        "{% if message['role'] in ['system', 'user', 'assistant', 'tool'] %}", "{% if true %}"
    ).replace("message['content'] +", "(message['content'] | tojson) +")
    quoted = {"role": "developer", "content": 'Say "5".\nNothing else. '}
    assert '"Say \\"5\\".\\nNothing else. "' in as_json.decode(ChatRenderer(as_json).first([quoted, USER[1]]))
    rendered = tokenizer.decode(ChatRenderer(tokenizer).first([developer, USER[1]]))
    assert "<|im_start|>developer\nReply only digits." in rendered


QWEN3_LIKE = (
    "{% set quiet = enable_thinking is defined and enable_thinking is false %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and loop.last and quiet %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if quiet %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)
"""A template that, like Qwen3's, writes an empty thinking block into the generation prompt
(and the last assistant turn) when ``enable_thinking`` is false."""


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_the_chat_template_gets_the_configured_variables_on_every_turn(tiny, kwargs):
    model, tokenizer = tiny
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = QWEN3_LIKE
    prompt_end = "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if kwargs else "")
    config = GatewayConfig(max_context_tokens=512, chat_template_kwargs=kwargs)

    async def body():
        async with running_gateway((model, thinking), config=config) as gateway:
            session = gateway.open(task="arith", prompt_id="p1")
            session.add_messages(USER)
            first = await session.generate(SamplingParams(max_new_tokens=4, seed=1))
            assert thinking.decode(session.tokens[: -len(first.token_ids)]).endswith(prompt_end)
            held = len(session.tokens)
            session.add_messages([{"role": "user", "content": "again"}])
            second = await session.generate(SamplingParams(max_new_tokens=4, seed=2))
            appended = thinking.decode(session.tokens[held : -len(second.token_ids)])
            assert appended.endswith("again<|im_end|>\n" + prompt_end)

    asyncio.run(body())


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


def test_a_session_keeps_the_tools_and_template_variables_of_its_first_messages(tiny):
    """Messages still queued were rendered with neither yet, but they will be: the tools and
    variables of the first ``add_messages`` hold from then on, not only once tokens exist."""
    model, tokenizer = tiny
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = QWEN3_LIKE
    again = [{"role": "user", "content": "again"}]

    async def body():
        async with running_gateway((model, thinking)) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(USER, template_kwargs={"enable_thinking": False})
            with pytest.raises(InvalidRequest, match="differ from the {'enable_thinking': False}"):
                session.add_messages(again)
            await session.generate(SamplingParams(max_new_tokens=2, seed=0))
            with pytest.raises(InvalidRequest, match="differ from the {'enable_thinking': False}"):
                session.add_messages(again, template_kwargs={"enable_thinking": True})
            assert session.messages[: len(USER)] == USER and len(session.messages) == len(USER) + 1
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(USER, [WEATHER_TOOL])
            with pytest.raises(InvalidRequest, match="tool definitions differ"):
                session.add_messages(again)
            assert session.tools == [WEATHER_TOOL] and session._pending == USER

    asyncio.run(body())


def test_the_templates_closing_token_stops_a_turn_beside_the_eos_only_if_it_is_special(tiny):
    """A tokenizer whose EOS is not its turns' closing token (a Qwen base model's is
    ``<|endoftext|>``): both stop, the closing one whether the tokenizer names it among its
    special tokens or only marks it special (here, once EOS moves off it, it is unnamed), and
    a closing of plain text does not."""
    _, tokenizer = tiny
    qwen_like = copy.deepcopy(tokenizer)
    qwen_like.eos_token = "<|bos|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ChatRenderer(qwen_like).stop_ids() == (qwen_like.eos_token_id, im_end)
    plain = copy.deepcopy(qwen_like)
    plain.chat_template = plain.chat_template.replace("<|im_end|>", "END")
    assert ChatRenderer(plain).stop_ids() == (qwen_like.eos_token_id,)


def test_an_eos_id_configured_past_the_vocabulary_is_refused(tiny):
    _, tokenizer = tiny
    with pytest.raises(ValueError, match=rf"holds {len(tokenizer)}, outside the vocabulary"):
        Gateway(Router([]), tokenizer, GatewayConfig(eos_token_ids=[len(tokenizer)]))
    assert Gateway(Router([]), tokenizer, GatewayConfig(eos_token_ids=[len(tokenizer) - 1])).stop_ids[-1] == (
        len(tokenizer) - 1
    )


@pytest.mark.parametrize("name", ["tokenize", "add_generation_prompt", "continue_final_message"])
def test_a_rendering_argument_given_as_a_template_variable_is_refused_with_the_config(name):
    with pytest.raises(ValueError, match=rf"\['{name}'\] are set by the gateway itself"):
        GatewayConfig(chat_template_kwargs={name: True, "enable_thinking": False})


def test_generated_tokens_are_never_re_tokenized(tiny):
    """The sampled action is not the canonical tokenization of its own text; the record
    keeps the sampled ids, including after the next turn is appended."""
    _, tokenizer = tiny

    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="arith", prompt_id="p1")
            session.add_messages(USER)
            turn = await session.generate(SamplingParams(max_new_tokens=24, seed=11))
            text = tokenizer.decode(turn.token_ids, skip_special_tokens=False)
            assert tokenizer.encode(text, add_special_tokens=False) != turn.token_ids, (
                "precondition: decode-then-encode changes this action's tokens"
            )
            start = len(session.tokens) - len(turn.token_ids)
            session.add_messages([{"role": "user", "content": "again"}])
            await session.generate(SamplingParams(max_new_tokens=4, seed=12))
            assert session.tokens[start : start + len(turn.token_ids)] == turn.token_ids
            record = session.record(reward=1.0)
            assert record["tokens"][start : start + len(turn.token_ids)] == turn.token_ids

    asyncio.run(body())


def test_a_branch_opened_without_an_execution_id_joins_its_parents_execution(tiny):
    async def body():
        async with running_gateway(tiny) as gateway:
            root = gateway.open(task="arith", prompt_id="p1", trajectory_id="root")
            root.add_messages(USER)
            await root.generate(SamplingParams(max_new_tokens=4, seed=1))
            records = [root.record(reward=0.0)]
            gateway.close(root.session_id)
            parent = "root"
            for name in ("retry", "retry-of-retry"):
                branch = gateway.open(task="arith", prompt_id="p1", trajectory_id=name, parent_id=parent)
                branch.add_messages(USER)
                await branch.generate(SamplingParams(max_new_tokens=4, seed=len(name)))
                records.append(branch.record(reward=1.0))
                gateway.close(branch.session_id)
                parent = name
            return records

    records = asyncio.run(body())
    assert [r["execution_id"] for r in records] == ["root"] * 3
    result = process_shard(to_table(records, TRAJECTORY_SCHEMA), shard_id="s")
    assert result.counters.executions_in == 1 and result.counters.errors == []


def test_a_branch_takes_the_execution_its_parent_was_given_or_else_its_parents_id(tiny):
    async def body():
        async with running_gateway(tiny) as gateway:
            gateway.open(task="arith", prompt_id="p1", trajectory_id="a", execution_id="exec-a")
            opened = {
                "child": gateway.open(task="arith", prompt_id="p1", parent_id="a"),
                "explicit": gateway.open(task="arith", prompt_id="p1", parent_id="a", execution_id="mine"),
                # a parent this gateway never opened: the execution a root gets by default
                "elsewhere": gateway.open(task="arith", prompt_id="p1", parent_id="other-gateways"),
            }
            return {name: session.info.execution_id for name, session in opened.items()}

    assert asyncio.run(body()) == {"child": "exec-a", "explicit": "mine", "elsewhere": "other-gateways"}


def test_a_branch_leaves_its_parent_where_their_tokens_part_and_carries_its_rollouts_ids(tiny):
    """``Gateway.branch`` (a compacted context's continuation): a branch whose messages render
    to a prefix of its parent's tokens (its first messages alone) parts from it at their end,
    one whose messages differ at the first token that does; either holds those messages and
    is a trajectory of the parent's execution, task, prompt and group, linked to it, whose
    later messages must keep the parent's template variables. A branch one token over ``max_context_tokens`` is a
    :class:`ContextLimit` recorded on the parent; one that just fits opens."""
    model, tokenizer = tiny
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = QWEN3_LIKE
    variables = {"enable_thinking": False}
    other = [USER[0], {"role": "user", "content": "What is 4 + 4?"}]
    longer = [
        *USER,
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "now say it in words"},
    ]
    size = len(ChatRenderer(thinking, variables).first(longer))

    async def body(max_context_tokens: int):
        config = GatewayConfig(max_context_tokens=max_context_tokens)
        async with running_gateway((model, thinking), config=config) as gateway:
            parent = gateway.open(task="arith", prompt_id="p1", execution_id="e1", group_id="g1")
            parent.add_messages(USER, template_kwargs=variables)
            await parent.generate(SamplingParams(max_new_tokens=2, seed=0))
            prefix = len(ChatRenderer(thinking, variables).first(USER))
            assert len(parent.tokens) > prefix, (
                "precondition: the parent's tokens go on past its first messages"
            )
            first = await gateway.branch(parent, USER)
            assert first.info.branch_at == prefix and first.tokens == parent.tokens[:prefix]
            differing = await gateway.branch(parent, other)
            at = differing.info.branch_at
            assert differing.tokens[:at] == parent.tokens[:at] and differing.tokens[at] != parent.tokens[at]
            for child, messages in ((first, USER), (differing, other)):
                assert child.messages == messages  # its conversation, as a scorer reads it
                info = child.info
                assert (info.execution_id, info.task, info.prompt_id, info.group_id, info.parent_id) == (
                    "e1",
                    "arith",
                    "p1",
                    "g1",
                    parent.info.trajectory_id,
                )
                child.add_messages([{"role": "user", "content": "again"}], template_kwargs=variables)
            try:
                return await gateway.branch(parent, longer), parent
            except ContextLimit as exc:
                return exc, parent

    fits, parent = asyncio.run(body(max_context_tokens=size))
    assert len(fits.tokens) == size and parent.context_limit is None
    over, parent = asyncio.run(body(max_context_tokens=size - 1))
    assert isinstance(over, ContextLimit)
    assert parent.context_limit.endswith(f"would hold {size} tokens, over max_context_tokens={size - 1}")


def test_a_sessions_prompt_size_is_the_length_of_the_prompt_its_next_turn_generates_from(tiny):
    """``prompt_size`` (what a rollout asks before it takes an observation, to compact first)
    counts the messages still queued, the new ones and the tokens held, as the next turn
    renders them; with nothing new it is the tokens held. Nothing is queued by asking."""
    again = [{"role": "user", "content": "try again"}]

    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="arith", prompt_id="p1")
            assert await session.prompt_size([]) == 0
            session.add_messages(USER[:1])
            asked = await session.prompt_size(USER[1:])
            session.add_messages(USER[1:])
            assert await session.prompt_size([]) == asked
            turn = await session.generate(SamplingParams(max_new_tokens=2, seed=0))
            assert len(session.tokens) - len(turn.token_ids) == asked
            assert await session.prompt_size([]) == len(session.tokens)
            asked = await session.prompt_size(again)
            session.add_messages(again)
            turn = await session.generate(SamplingParams(max_new_tokens=2, seed=1))
            assert len(session.tokens) - len(turn.token_ids) == asked

    asyncio.run(body())


def test_a_gateway_forgets_the_executions_of_its_oldest_trajectories_first(tiny, monkeypatch):
    monkeypatch.setattr(gateway_module, "REMEMBERED_EXECUTIONS", 2)

    async def body():
        async with running_gateway(tiny) as gateway:
            for name in ("a", "b", "c"):
                gateway.open(task="arith", prompt_id="p1", trajectory_id=name, execution_id=f"exec-{name}")
            return [
                gateway.open(task="arith", prompt_id="p1", parent_id=parent).info.execution_id
                for parent in ("b", "c", "a")
            ]

    assert asyncio.run(body()) == ["exec-b", "exec-c", "a"]


def test_an_executions_size_counts_its_remembered_trajectories_as_a_scan_of_them_does(tiny, monkeypatch):
    """``execution_size`` against :meth:`Gateway.trajectories_of`'s scan, on random opens: roots,
    branches, explicit executions, trajectory ids reopened (their session deleted first) and
    the oldest forgotten past ``REMEMBERED_EXECUTIONS``."""
    monkeypatch.setattr(gateway_module, "REMEMBERED_EXECUTIONS", 7)
    rng = random.Random(0)

    async def body():
        async with running_gateway(tiny) as gateway:
            for _ in range(200):
                tid = f"t{rng.randrange(12)}"
                for session_id in gateway.sessions:
                    if gateway.session(session_id).info.trajectory_id == tid:
                        gateway.close(session_id)
                kind = rng.randrange(3)
                opened = gateway.open(
                    task="arith",
                    prompt_id="p1",
                    trajectory_id=tid,
                    parent_id=f"t{rng.randrange(12)}" if kind == 1 else None,
                    execution_id=f"e{rng.randrange(3)}" if kind == 2 else None,
                )
                executions = {
                    opened.info.execution_id,
                    *(f"e{i}" for i in range(3)),
                    *(f"t{i}" for i in range(12)),
                }
                for execution in executions:
                    assert gateway.execution_size(execution) == len(gateway.trajectories_of(execution))
                # a forgotten execution's count goes with it: what the gateway keeps is bounded
                assert len(gateway._execution_sizes) <= 7

    asyncio.run(body())


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("p-\udce9", "'\\\\udce9' at character 2 is a lone surrogate"),
        ("", "is blank: an id must hold something other than whitespace"),
        (" \t", "is blank: an id must hold something other than whitespace"),
    ],
    ids=["lone-surrogate", "empty", "whitespace"],
)
def test_open_refuses_an_id_that_is_no_text_or_blank(tiny, value, reason):
    """Its record could not be sent over HTTP nor written to a shard (the schema wants the ids
    of a trajectory to hold something other than whitespace); an empty id is no id left out."""

    async def body():
        async with running_gateway(tiny) as gateway:
            for name in ("task", "prompt_id", "execution_id", "trajectory_id", "group_id", "parent_id"):
                with pytest.raises(InvalidRequest, match=f"^{name}.*{reason}"):
                    gateway.open(**{"task": "arith", "prompt_id": "p1", name: value})
            return gateway.sessions

    assert asyncio.run(body()) == []


def test_an_open_sessions_trajectory_id_is_refused_after_the_gateway_forgot_its_execution(tiny, monkeypatch):
    monkeypatch.setattr(gateway_module, "REMEMBERED_EXECUTIONS", 1)

    async def body():
        async with running_gateway(tiny) as gateway:
            gateway.open(task="arith", prompt_id="p1", trajectory_id="a")
            gateway.open(task="arith", prompt_id="p1", trajectory_id="b")
            with pytest.raises(InvalidRequest, match="trajectory 'a' is open"):
                gateway.open(task="arith", prompt_id="p1", trajectory_id="a")
            return len(gateway.sessions)

    assert asyncio.run(body()) == 2


def test_record_is_canonical_and_marks_actions_turns_versions(tiny):
    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="arith", prompt_id="p7", execution_id="exec-1", group_id="g")
            session.add_messages(USER)
            first = await session.generate(SamplingParams(max_new_tokens=5, seed=1))
            session.add_messages([{"role": "user", "content": "more"}])
            second = await session.generate(SamplingParams(max_new_tokens=6, seed=2))
            record = session.record(reward=0.5, progress=0.25, timing={"run": 1.5, "queue": 0.1})
            table = validate(to_table([record], TRAJECTORY_SCHEMA))
            assert table.num_rows == 1
            assert (
                record["execution_id"] == "exec-1" and record["group_id"] == "g" and record["task"] == "arith"
            )
            mask = record["action_mask"]
            n = len(record["tokens"])
            assert len(mask) == len(record["logprobs"]) == len(record["turn"]) == len(record["versions"]) == n
            actions = [i for i in range(n) if mask[i]]
            assert [record["tokens"][i] for i in actions] == first.token_ids + second.token_ids
            assert [record["logprobs"][i] for i in actions] == pytest.approx(first.logprobs + second.logprobs)
            assert all(
                record["logprobs"][i] == 0.0 and record["versions"][i] == -1 for i in range(n) if not mask[i]
            )
            assert all(record["versions"][i] == 0 for i in actions)
            first_len = len(tiny[1].encode(render(tiny[1], USER), add_special_tokens=False)) + len(
                first.token_ids
            )
            assert record["turn"] == [0] * first_len + [1] * (n - first_len)
            assert record["status"] == "truncated", "the last action hit its token budget"
            assert record["timing"] == {"init": 0.0, "run": 1.5, "eval": 0.0, "queue": pytest.approx(0.1)}
            assert record["engine"] == "engine-0"
            with pytest.raises(ValueError, match="unknown status"):
                session.record(status="fine")
            with pytest.raises(ValueError, match="reward nan is not a finite number"):
                session.record(reward=math.nan)
            with pytest.raises(ValueError, match=r"progress 7 is outside \[0, 1\]"):
                session.record(progress=7)

    asyncio.run(body())


def test_stop_token_is_kept_and_status_ok(tiny):
    """The status follows the last action: one that stopped after a truncated one is ok."""
    model, tokenizer = tiny

    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(USER)
            cut = await session.generate(SamplingParams(max_new_tokens=1, stop_ids=(), seed=0))
            assert cut.truncated and session.record()["status"] == "truncated"
            session.add_messages([{"role": "user", "content": "go on"}])
            every_id = tuple(range(len(tokenizer)))
            turn = await session.generate(SamplingParams(max_new_tokens=5, stop_ids=every_id, seed=0))
            assert turn.finish_reason == "stop" and len(turn.token_ids) == 1
            assert session.tokens[-1] == turn.token_ids[0] and session.action_mask[-1]
            assert session.record()["status"] == "ok"

    asyncio.run(body())


def test_a_turn_stops_at_every_eos_id_of_the_models_generation_config(tiny, local_store):
    """vLLM stops at the EOS ids of a model's generation_config (Qwen2.5 instruct lists
    <|im_end|> and <|endoftext|>), but the engines stop at ``stop_ids`` only: a published
    version keeps the model's list and the gateway of a worker or an evaluation stops there."""
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=16, seed=3)

    async def turn(config: GatewayConfig):
        async with running_gateway(tiny, config=config) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(USER)
            return gateway.stop_ids, await session.generate(
                dataclasses.replace(params, stop_ids=gateway.stop_ids)
            )

    stop_ids, before = asyncio.run(turn(GatewayConfig(max_context_tokens=512)))
    sampled = before.token_ids[0]
    assert sampled not in stop_ids and len(before.token_ids) > 1
    weights = WeightStore(local_store)
    assert model_eos_ids(weights.load(publish_policy(weights, model, tokenizer), "serving")) == [
        tokenizer.eos_token_id
    ]
    listing = copy.deepcopy(model)
    listing.generation_config.eos_token_id = [tokenizer.eos_token_id, sampled]
    eos_ids = model_eos_ids(weights.load(publish_policy(weights, listing, tokenizer), "serving"))
    assert eos_ids == [tokenizer.eos_token_id, sampled]
    _, after = asyncio.run(turn(GatewayConfig(max_context_tokens=512, eos_token_ids=eos_ids)))
    assert after.token_ids == [sampled] and after.finish_reason == "stop"


def test_a_resent_request_gets_the_last_turn_again_until_the_session_grows(tiny):
    """The last turn's ``request`` is answered with that turn, nothing generated or recorded,
    while nothing was added after it; then, or without a request, a new turn is generated."""

    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            params = SamplingParams(max_new_tokens=3, seed=0)
            session.add_messages(USER)
            turn = await session.generate(params, request="r")
            record = session.record()
            resent = await session.generate(params, prepare=lambda: session.add_tokens([5]), request="r")
            assert resent is turn and session.record() == record, "nothing prepared, generated or recorded"
            await session.generate(params, request="other")
            assert session.num_turns == 2
            session.add_tokens([5])
            await session.generate(params, request="other")
            session.add_messages([{"role": "user", "content": "more"}])
            await session.generate(params, request="other")
            await session.generate(params)
            await session.generate(params)
            assert session.num_turns == 6

    asyncio.run(body())


def test_sessions_stick_to_one_replica_and_close_releases_it(tiny):
    async def body():
        async with running_gateway(tiny, replicas=3) as gateway:
            sessions = [gateway.open(task="t", prompt_id=f"p{i}") for i in range(6)]
            for turn in range(3):
                for session in sessions:
                    session.add_messages([{"role": "user", "content": f"turn {turn}"}])
                    await session.generate(SamplingParams(max_new_tokens=2, seed=turn))
            for session in sessions:
                engines = {t.engine for t in session.turns}
                assert len(engines) == 1
                assert session.turns[-1].cached_tokens > 0, "later turns reuse the replica's prefix cache"
                assert session.record()["engine"] == engines.pop()
            router = gateway.router
            name = router.assignment(sessions[0].session_id)
            load = router.load(name)
            gateway.close(sessions[0].session_id)
            assert router.assignment(sessions[0].session_id) is None and router.load(name) == load - 1
            with pytest.raises(UnknownSession):
                gateway.session(sessions[0].session_id)

    asyncio.run(body())


def test_closing_a_round_robin_session_drops_its_cache_on_every_replica_that_served_it(tiny):
    """Round robin pins nothing, so closing a session released no replica's cache of it: its
    turns' caches stayed in every engine's LRU, pushing out the caches of live sessions."""

    async def body():
        async with running_gateway(tiny, replicas=2, router=RouterConfig(policy="round_robin")) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            for turn in range(2):
                session.add_messages([{"role": "user", "content": f"turn {turn}"}])
                await session.generate(SamplingParams(max_new_tokens=2, seed=turn))
            engines = [gateway.router.engine(name) for name in gateway.router.replicas]
            served = [engine.stats().extra["cache_sessions"] for engine in engines]
            gateway.close(session.session_id)
            return served, [engine.stats().extra["cache_sessions"] for engine in engines]

    served, after_close = asyncio.run(body())
    assert served == [1.0, 1.0]
    assert after_close == [0.0, 0.0]


def test_bad_input_is_a_clear_error_and_other_sessions_keep_working(tiny):
    async def body():
        async with running_gateway(tiny, config=GatewayConfig(max_context_tokens=64)) as gateway:
            good = gateway.open(task="t", prompt_id="good")
            bad = gateway.open(task="t", prompt_id="bad")
            with pytest.raises(InvalidRequest, match=r"token_ids\[1\] = 100000 is outside the vocabulary"):
                bad.add_tokens([5, 100000])
            with pytest.raises(InvalidRequest, match="not an integer"):
                bad.add_tokens([5, "7"])
            with pytest.raises(InvalidRequest, match="empty prompt"):
                await bad.generate()
            with pytest.raises(InvalidRequest, match="over max_context_tokens=64"):
                bad.add_tokens([5] * 65)
            with pytest.raises(InvalidRequest, match="over max_context_tokens=64"):
                bad.add_messages([{"role": "user", "content": "word " * 80}])
                await bad.generate()
            assert bad.tokens == [] and bad.messages == [], "a rejected request leaves the session untouched"
            with pytest.raises(UnknownSession, match="no open session 'nope'"):
                gateway.session("nope")
            with pytest.raises(InvalidRequest, match="already open"):
                gateway.open(task="t", prompt_id="x", session_id=good.session_id)
            good.add_messages(USER)
            turn = await good.generate(SamplingParams(max_new_tokens=3, seed=0))
            assert len(turn.token_ids) == 3
            bad.add_tokens([5, 6, 7])
            assert len((await bad.generate(SamplingParams(max_new_tokens=2, seed=0))).token_ids) == 2

    asyncio.run(body())


def test_messages_refused_for_one_without_a_role_queue_none_of_the_others(tiny):
    _, tokenizer = tiny

    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="arith", prompt_id="p1")
            with pytest.raises(InvalidRequest, match="a chat message needs a 'role'"):
                session.add_messages([{"role": "user", "content": "first try"}, {"content": "no role"}])
            session.add_messages(USER)
            turn = await session.generate(SamplingParams(max_new_tokens=2, seed=0))
            prompt = tokenizer.encode(render(tokenizer, USER), add_special_tokens=False)
            assert session.tokens == prompt + turn.token_ids
            assert session.messages[:-1] == USER  # and the reply

    asyncio.run(body())


def test_closing_a_session_cancels_its_generating_turn_and_fails_the_queued_one(tiny):
    """The rollout is gone (its env closed the session): the turn on the engine is cancelled
    there rather than generating tokens nobody reads, and a turn waiting behind it fails
    instead of pinning the closed session to a replica again."""

    async def body():
        async with running_gateway(tiny) as gateway:
            (engine,) = gateway.router._engines.values()
            calls = []
            real_generate = engine.generate

            async def generate(*args, **kwargs):
                calls.append("started")
                try:
                    generation = await real_generate(*args, **kwargs)
                except asyncio.CancelledError:
                    calls.append("cancelled")
                    raise
                calls.append("finished")
                return generation

            engine.generate = generate
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(USER)
            first = asyncio.create_task(session.generate(SamplingParams(max_new_tokens=400, seed=0)))
            queued = asyncio.create_task(session.generate(SamplingParams(max_new_tokens=4, seed=1)))
            while not calls:  # the first turn is on the engine, the second waits for it
                await asyncio.sleep(0)
            gateway.close(session.session_id)
            with pytest.raises(UnknownSession, match="closed while its turn generated"):
                await first
            with pytest.raises(UnknownSession, match="was closed"):
                await queued
            assert calls == ["started", "cancelled"]
            router = gateway.router
            assert router.assignment(session.session_id) is None
            assert router.load(router.replicas[0]) == 0 and router.session_ages() == {router.replicas[0]: []}

    asyncio.run(body())


def test_a_session_closed_while_its_turn_prepares_is_not_pinned_again(tiny):
    """``prepare`` may be awaitable: a session closed while it ran is not routed, which would
    pin the closed session to a replica for good (its load never back to 0, so a draining
    replica never empties)."""

    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(USER)

            async def prepare() -> None:
                await asyncio.sleep(0)
                gateway.close(session.session_id)  # the rollout's env ends it meanwhile

            with pytest.raises(UnknownSession, match="was closed while its turn prepared"):
                await session.generate(SamplingParams(max_new_tokens=2, seed=0), prepare=prepare)
            router = gateway.router
            assert router.assignment(session.session_id) is None
            assert router.load(router.replicas[0]) == 0 and router.session_ages() == {router.replicas[0]: []}

    asyncio.run(body())


def test_a_turn_cancelled_by_its_caller_stays_cancelled_when_its_session_closes_meanwhile(tiny):
    """A rollout cancelled (a worker stopping) while its env closes the session: the caller's
    cancellation goes on up, not swallowed into an ``UnknownSession`` error."""

    async def body():
        async with running_gateway(tiny) as gateway:
            (engine,) = gateway.router._engines.values()
            started = asyncio.Event()
            real_generate = engine.generate

            async def generate(*args, **kwargs):
                started.set()
                return await real_generate(*args, **kwargs)

            engine.generate = generate
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(USER)
            turn = asyncio.create_task(session.generate(SamplingParams(max_new_tokens=400, seed=0)))
            await started.wait()
            turn.cancel()
            gateway.close(session.session_id)
            with pytest.raises(asyncio.CancelledError):
                await turn
            assert turn.cancelled()

    asyncio.run(body())


def test_a_session_generates_exactly_its_max_turns(tiny):
    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.max_turns = 2
            session.add_messages(USER)
            for _ in range(2):
                await session.generate(SamplingParams(max_new_tokens=2, seed=0))
                session.add_tokens([7])
            with pytest.raises(ContextLimit, match="max_turns=2"):
                await session.generate(SamplingParams(max_new_tokens=2, seed=0))
            assert session.num_turns == 2 and "max_turns=2" in session.context_limit

    asyncio.run(body())


def test_a_session_without_max_turns_stops_at_the_turns_a_records_turn_index_holds(tiny, monkeypatch):
    """A record's turn index is an int16 (at most ``MAX_TURN``): a session past it, one a harness
    steps a token at a time through a long context, would make a record refused when written, the
    rollout lost after it counted as done; its turn past the bound is a context limit instead."""
    monkeypatch.setattr(schema, "MAX_TURN", 2)
    monkeypatch.setattr(gateway_module, "MAX_TURN", 2, raising=False)

    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(USER)
            with pytest.raises(ContextLimit, match="turn index"):
                for _ in range(4):
                    await session.generate(SamplingParams(max_new_tokens=1, seed=0))
                    session.add_tokens([7])
            assert session.num_turns == 2 and "turn index" in session.context_limit
            validate(to_table([session.record()], TRAJECTORY_SCHEMA))

    asyncio.run(body())


def recording_threads(renderer: ChatRenderer, threads: list[int], gate: threading.Event | None = None):
    """Make ``renderer`` note the thread of each encode in ``threads``, and wait for ``gate``."""
    real_encode = renderer.encode

    def encode(text):
        threads.append(threading.get_ident())
        if gate is not None:
            assert gate.wait(30)
        return real_encode(text)

    renderer.encode = encode


def test_a_long_message_is_rendered_off_the_event_loop_and_a_short_one_on_it(tiny):
    """Tokenizing 15 MB of chat text took 14 s, every rollout, the gateway and the heartbeats
    waiting on the event loop meanwhile."""

    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            threads = []
            recording_threads(session.renderer, threads)
            session.add_messages(USER)
            await session.generate(SamplingParams(max_new_tokens=2, seed=0))
            assert threads == [threading.get_ident()]
            session.add_messages([{"role": "user", "content": "7" * RENDER_INLINE_CHARS}])
            with pytest.raises(ContextLimit, match="over max_context_tokens=512"):
                await session.generate(SamplingParams(max_new_tokens=2, seed=0))
            assert len(threads) > 1 and threading.get_ident() not in threads[1:]

    asyncio.run(body())


def test_a_session_closed_while_its_long_message_renders_appends_nothing(tiny):
    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            gate = threading.Event()
            threads = []
            recording_threads(session.renderer, threads, gate)
            session.add_messages([{"role": "user", "content": "7" * RENDER_INLINE_CHARS}])
            turn = asyncio.create_task(session.generate(SamplingParams(max_new_tokens=2, seed=0)))
            while not threads:
                await asyncio.sleep(0.01)
            gateway.close(session.session_id)
            gate.set()
            with pytest.raises(UnknownSession, match="closed while its messages rendered"):
                await turn
            assert session.tokens == [] and session.context_limit is None

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_failed_or_malformed_engine_turn_is_an_engine_error_the_session_records(tiny):
    """An engine that fails a turn, or answers one with a generation that does not hold
    together, fails it with ``EngineError``: the session records why (what the rollout
    service reads for a self-driving env) and keeps no token of it; a good turn clears it."""

    async def body():
        async with running_gateway(tiny) as gateway:
            (engine,) = gateway.router._engines.values()
            real_generate = engine.generate
            faults = []

            async def generate(*args, **kwargs):
                generation = await real_generate(*args, **kwargs)
                return faults.pop(0)(generation) if faults else generation

            def fails(generation):
                raise EngineError("the replica went away")

            def one_logprob_short(generation):
                return dataclasses.replace(generation, logprobs=generation.logprobs[:-1])

            def one_version_short(generation):
                return dataclasses.replace(generation, versions=generation.versions[:-1])

            def outside_the_vocabulary(generation):
                return dataclasses.replace(generation, token_ids=[10**9] * len(generation.token_ids))

            def just_past_the_vocabulary(generation):
                return dataclasses.replace(
                    generation, token_ids=[gateway.vocab_size] * len(generation.token_ids)
                )

            def a_nan_logprob(generation):
                return dataclasses.replace(generation, logprobs=[math.nan, *generation.logprobs[1:]])

            def a_positive_logprob(generation):
                return dataclasses.replace(generation, logprobs=[0.5, *generation.logprobs[1:]])

            def a_negative_version(generation):
                return dataclasses.replace(generation, versions=[-1, *generation.versions[1:]])

            def no_tokens(generation):
                return dataclasses.replace(generation, token_ids=[], logprobs=[], versions=[])

            def past_the_budget(generation):
                return dataclasses.replace(
                    generation,
                    token_ids=[*generation.token_ids, generation.token_ids[-1]],
                    logprobs=[*generation.logprobs, generation.logprobs[-1]],
                    versions=[*generation.versions, generation.versions[-1]],
                )

            engine.generate = generate
            session = gateway.open(task="t", prompt_id="p")
            prompt = tiny[1].encode("What is 2 + 3?")
            session.add_tokens(prompt)
            params = SamplingParams(max_new_tokens=4, seed=0)
            for fault, why in [
                (fails, "the replica went away"),
                (one_logprob_short, "returned 4 tokens, 3 log-probs and 4 versions"),
                (one_version_short, "returned 4 tokens, 4 log-probs and 3 versions"),
                (outside_the_vocabulary, "a token id outside the vocabulary"),
                (just_past_the_vocabulary, "a token id outside the vocabulary"),
                (a_nan_logprob, "a log-prob that is not finite"),
                (a_positive_logprob, "a log-prob above 0"),
                (a_negative_version, "a negative weight version"),
                (no_tokens, "returned no tokens"),
                (past_the_budget, "returned 5 tokens for a budget of 4"),
            ]:
                faults.append(fault)
                with pytest.raises(EngineError, match=why):
                    await session.generate(params)
                assert why in session.engine_error
                assert session.tokens == prompt and session.turns == [] and session._generating is None
            turn = await session.generate(params)
            assert session.engine_error is None and session.tokens == prompt + turn.token_ids

    asyncio.run(body())


def test_generation_budget_is_clamped_to_the_context(tiny):
    async def body():
        async with running_gateway(tiny, config=GatewayConfig(max_context_tokens=20)) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_tokens(list(range(10, 27)))
            turn = await session.generate(SamplingParams(max_new_tokens=50, seed=0))
            assert len(turn.token_ids) == 3 and len(session.tokens) == 20
            with pytest.raises(InvalidRequest, match="leaves no room"):
                await session.generate(SamplingParams(max_new_tokens=5))
            full = gateway.open(task="t", prompt_id="p")
            full.add_tokens(list(range(10, 30)))
            assert len(full.tokens) == 20, "a session may hold exactly max_context_tokens"
            with pytest.raises(ContextLimit, match="21 tokens"):
                gateway.open(task="t", prompt_id="p").add_tokens(list(range(10, 31)))

    asyncio.run(body())


def test_a_budget_clamped_to_the_context_keeps_the_requests_seed(tiny):
    """The clamped request is the one asked for with room's budget: the same seed samples the
    same tokens as a request that asked for that budget itself."""

    async def body():
        async with running_gateway(tiny, config=GatewayConfig(max_context_tokens=20)) as gateway:
            turns = []
            for max_new_tokens in (50, 3):
                session = gateway.open(task="t", prompt_id="p")
                session.add_tokens(list(range(10, 27)))
                turns.append(await session.generate(SamplingParams(max_new_tokens=max_new_tokens, seed=7)))
            assert len(turns[0].token_ids) == 3
            assert turns[0].token_ids == turns[1].token_ids
            assert turns[0].logprobs == turns[1].logprobs

    asyncio.run(body())


def test_a_turn_past_the_engines_context_is_a_context_limit_the_session_records(tiny):
    """A session under the gateway's max_context_tokens that the engine refuses (past the
    model's positions, vLLM's max_model_len) records why, as for the gateway's own limit:
    the rollout service reads it to call a self-driving env's rollout truncated."""

    async def body():
        async with running_gateway(tiny, config=GatewayConfig(max_context_tokens=4096)) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_tokens([7] * TINY.max_position_embeddings)
            with pytest.raises(ContextLimit, match="positions"):
                await session.generate(SamplingParams(max_new_tokens=4))
            assert session.context_limit is not None and "positions" in session.context_limit
            assert session.engine_error is None and session.turns == []

    asyncio.run(body())


def test_the_session_records_why_its_last_turn_failed_not_an_earlier_one(tiny):
    """``engine_error`` and ``context_limit`` say why the last turn failed: a context limit
    after an engine failure clears the engine error (the service would otherwise call the
    rollout an infra error instead of truncated), and an engine failure after a context
    limit clears the limit."""

    async def body():
        async with running_gateway(tiny, config=GatewayConfig(max_context_tokens=64)) as gateway:
            (engine,) = gateway.router._engines.values()
            real_generate = engine.generate
            failures = []

            async def generate(*args, **kwargs):
                if failures:
                    raise failures.pop()
                return await real_generate(*args, **kwargs)

            engine.generate = generate
            session = gateway.open(task="t", prompt_id="p")
            session.add_tokens([7] * 10)
            params = SamplingParams(max_new_tokens=4, seed=0)
            failures.append(EngineError("the replica went away"))
            with pytest.raises(EngineError):
                await session.generate(params)
            with pytest.raises(ContextLimit):
                await session.generate(params, prepare=lambda: session.add_tokens([7] * 60))
            assert session.context_limit is not None and session.engine_error is None
            failures.append(EngineError("the replica went away again"))
            with pytest.raises(EngineError):
                await session.generate(params)
            assert session.engine_error is not None and session.context_limit is None

    asyncio.run(body())


def test_versions_follow_a_weight_update_between_turns(tiny, tmp_path):
    model, _ = tiny
    model.save_pretrained(tmp_path / "v3")

    async def body():
        async with running_gateway(tiny) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(USER)
            first = await session.generate(SamplingParams(max_new_tokens=4, seed=0))
            engine = gateway.router.route(session.session_id)
            await engine.load_version(3, str(tmp_path / "v3"))
            session.add_messages([{"role": "user", "content": "next"}])
            second = await session.generate(SamplingParams(max_new_tokens=4, seed=0))
            assert first.versions == [0] * 4 and second.versions == [3] * 4
            record = session.record()
            tagged = [v for v, m in zip(record["versions"], record["action_mask"], strict=True) if m]
            assert tagged == [0] * 4 + [3] * 4
            validate(to_table([record]))

    asyncio.run(body())


def test_failed_replica_is_taken_out_and_the_next_turn_is_re_prefilled_elsewhere(tiny):
    async def body():
        async with running_gateway(tiny, replicas=2) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages(USER)
            first = await session.generate(SamplingParams(max_new_tokens=4, seed=0))
            failed = gateway.router.route(session.session_id)
            await failed.close()
            session.add_messages([{"role": "user", "content": "next"}])
            second = await session.generate(SamplingParams(max_new_tokens=4, seed=0))
            assert second.engine != first.engine and failed.name not in gateway.router.replicas
            assert second.cached_tokens == 0, "the new replica has no cache: the whole context is prefilled"
            assert second.prompt_tokens == len(session.tokens) - len(second.token_ids)
            record = session.record()
            assert record["engine"] == f"{first.engine},{second.engine}"
            assert sum(record["action_mask"]) == 8

    asyncio.run(body())


def test_a_close_the_router_refuses_leaves_the_session_open_and_routed(tiny):
    """A close with arguments the router refuses (an idle time that is no number of seconds, a
    session continuing in itself, an expired one continuing in another) raised only after the
    gateway had forgotten the session: its replica stayed pinned, and no close could release
    it. The close is refused before anything is ended."""

    async def body():
        async with running_gateway(tiny, replicas=2) as gateway:
            session = gateway.open(task="t", prompt_id="p")
            session.add_messages([{"role": "user", "content": "hi"}])
            await session.generate(SamplingParams(max_new_tokens=2, seed=0))
            sid = session.session_id
            name = gateway.router.assignment(sid)
            for bad in (
                {"idle_s": math.nan},
                {"continued_in": sid},
                {"expired": True, "continued_in": "next"},
            ):
                with pytest.raises(ValueError):
                    gateway.close(sid, **bad)
                assert gateway.session(sid) is session and not session.closed
                assert gateway.router.assignment(sid) == name
            gateway.close(sid, expired=True, idle_s=5.0)
            assert gateway.router.assignment(sid) is None and gateway.router.sessions_expired == 1

    asyncio.run(body())
