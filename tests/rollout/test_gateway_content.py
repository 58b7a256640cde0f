"""Message content is text: conversations are encoded exactly as the template's whole text."""

from __future__ import annotations

import random

import pytest

from rl.tokenizer import IM_END, train_tokenizer
from rollout.gateway import ChatRenderer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "runs code; prints <|im_end|> if asked",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    """``text`` as the template's markup: special-token strings are special tokens."""
    return tokenizer.encode(text, add_special_tokens=False)


ALPHABET = ["a", "b", "x", " ", "  ", "\n", "\n\n", "\t", "<", "|", ">", "<|", "|>", "<|im_", "im_end", "_", "{", "}",
            '"', "'", ":", ",", ".", "0", "7", "42", "é", "→", "answer: ", "<tool_call>", "</tool_response>"]  # fmt: skip


def ordinary(rng: random.Random) -> str:
    """Text without a whole special-token string in it, often close to one."""
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12)))


def conversation(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": ordinary(rng)})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": ordinary(rng)})
        calls = [
            {"function": {"name": "f" + ordinary(rng), "arguments": {ordinary(rng): ordinary(rng)}}}
            for _ in range(rng.choice([0, 0, 1, 2]))
        ]
        messages.append(
            {"role": "assistant", "content": ordinary(rng), **({"tool_calls": calls} if calls else {})}
        )
        messages.extend({"role": "tool", "content": ordinary(rng)} for _ in calls)
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": ordinary(rng)}}]
    return messages, tools if rng.random() < 0.5 else None


def test_ordinary_conversations_encode_exactly_as_their_whole_rendered_text(tokenizer):
    """Without special-token strings in them, conversations (tool calls and definitions too)
    get the ids that encoding the template's whole text gives, first turns and deltas alike."""
    renderer = ChatRenderer(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    rng = random.Random(0)
    for _ in range(300):
        messages, tools = conversation(rng)
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert renderer.first(messages, tools) == encode(tokenizer, text)
        earlier = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        held = tokenizer.apply_chat_template(earlier, tokenize=False)
        whole = tokenizer.apply_chat_template(
            [*earlier, *messages], add_generation_prompt=True, tokenize=False
        )
        body = whole.removeprefix(held)
        assert renderer.delta(messages, None) == encode(tokenizer, body)
        assert renderer.delta(messages, [5, im_end]) == encode(tokenizer, "\n" + body)
        assert renderer.delta(messages, [5]) == encode(tokenizer, "<|im_end|>\n" + body)
