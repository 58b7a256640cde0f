"""Tool calls in the policy's text, as OpenAI chat messages.

A model trained for function calling writes its calls into its reply in the format its
chat template teaches it. The gateway returns them to OpenAI clients as the assistant
message's ``tool_calls``, the way vLLM's ``--tool-call-parser`` does, while the session
keeps the tokens exactly as sampled.

Formats (``GatewayConfig.tool_call_format``):

- ``hermes``: each call is a JSON object ``{"name": ..., "arguments": {...}}`` between
  ``<tool_call>`` and ``</tool_call>``, as the Hermes, Qwen2.5 and Qwen3 chat templates (and
  treadle's tiny model's) ask for. The text outside the calls is the message's content.

A call without ``arguments`` has none (``{}``), and the last block may lack its closing tag
when the reply ends right after its JSON (the model stopped there). A block that does not
hold a call (JSON that does not parse or holds ``NaN``/``Infinity``, a number past a
float's range or the escape of a lone surrogate such as ``\\ud800``, which no UTF-8 reply
can hold, no ``name``, arguments that are not an object, keys other than those two, a block
the token budget cut short) stays in the content as written: the client sees what the model
wrote, and the reward can judge it.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ToolCallFormat = Literal["hermes"]
"""Tool-call formats the gateway parses."""

TAGS: dict[str, tuple[str, ...]] = {"hermes": ("<tool_call>", "</tool_call>")}
"""The markers each format writes around a call: a tokenizer may hold them as special
tokens, which a plain decode would drop."""

_OPEN, _CLOSE = TAGS["hermes"]
_SPACE = re.compile(r"\s*")


def _not_json(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


def _finite(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):  # 1e400: json.dumps would write the arguments as Infinity
        raise ValueError(f"{number} overflows a float")
    return value


_JSON = json.JSONDecoder(parse_float=_finite, parse_constant=_not_json)


def parse_hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The content left outside well-formed ``<tool_call>`` blocks (stripped) and the calls
    they hold, in order, as ``{"name": str, "arguments": dict}``."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    end = searched = 0
    while (start := text.find(_OPEN, searched)) >= 0:
        call, after = _hermes_call(text, start + len(_OPEN))
        searched = after
        if call is not None:
            kept.append(text[end:start])
            calls.append(call)
            end = after
    kept.append(text[end:])
    return "".join(kept).strip(), calls


def _hermes_call(text: str, at: int) -> tuple[dict[str, Any] | None, int]:
    """The call whose JSON object starts at ``at`` (after spaces) and is closed by
    ``</tool_call>`` or ends the text, and the index after it; ``(None, at)`` when there is
    none. The JSON is decoded whole, so a closing tag inside one of its strings does not end it."""
    try:
        value, after = _JSON.raw_decode(text, _SPACE.match(text, at).end())
    except (ValueError, RecursionError):  # a degenerate reply may nest "[" past the recursion limit
        return None, at
    after = _SPACE.match(text, after).end()
    closed = text.startswith(_CLOSE, after)
    if not (closed or after == len(text)) or not isinstance(value, dict):
        return None, at
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name.strip() or not isinstance(arguments, dict):
        return None, at
    if set(value) - {"name", "arguments"}:  # e.g. "parameters": dropping it would lose the arguments
        return None, at
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):  # the reply holding it could not be sent (HTTP 500)
        return None, at
    return {"name": name, "arguments": arguments}, after + len(_CLOSE) * closed


def tool_call_message(text: str, tool_call_format: ToolCallFormat) -> dict[str, Any] | None:
    """The OpenAI assistant message for a reply ``text`` written in ``tool_call_format`` that
    calls tools (None when it calls none): ``content`` (None when the reply is only calls) and
    ``tool_calls`` with fresh ids and the arguments as a JSON string."""
    if tool_call_format != "hermes":
        raise ValueError(f"unknown tool_call_format {tool_call_format!r}; known: {list(TAGS)}")
    content, calls = parse_hermes(text)
    if not calls:
        return None
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(call["arguments"], ensure_ascii=False),
                },
            }
            for call in calls
        ],
    }


def with_object_arguments(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``messages`` with each assistant call's ``arguments`` JSON string read as the object it
    holds (a string that holds none stays as sent), for a chat template to render: Qwen2.5's
    and Llama 3.1's write arguments through ``tojson``, which would quote the string a second
    time, never as the model writes a call. vLLM reads them so too. ``messages`` are not changed."""
    return [
        {**message, "tool_calls": [_with_object_arguments(call) for call in message["tool_calls"]]}
        if isinstance(message, Mapping) and isinstance(message.get("tool_calls"), list)
        else message
        for message in messages
    ]


def _with_object_arguments(call: Any) -> Any:
    if not isinstance(call, Mapping):
        return call
    function = call.get("function")
    if isinstance(function, Mapping):
        return {**call, "function": _with_object_arguments(function)}
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError, RecursionError):
            value = json.loads(arguments)
            if isinstance(value, dict):
                return {**call, "arguments": value}
    return call


def same_calls(seen: Any, sent: Any) -> bool:
    """Whether a resent assistant message's ``tool_calls`` are the ones the session holds
    (those the gateway returned, or a client's own assistant message as it first sent it):
    equal as sent, or the same functions in the same order with equal arguments (a client
    may re-serialise the JSON string, or drop the ids). Any shape a client sent is compared,
    never raises."""
    seen, sent = seen or [], sent or []
    if _same_json(seen, sent):
        return True
    if not isinstance(seen, list) or not isinstance(sent, list) or len(seen) != len(sent):
        return False
    for ours, theirs in zip(seen, sent, strict=True):
        key, other = _call_key(ours), _call_key(theirs)
        if key is None or other is None or not _same_json(key, other):
            return False
    return True


def _same_json(a: Any, b: Any) -> bool:
    """Whether two JSON-like values are equal, a boolean equal only to the same boolean
    (Python's ``True == 1`` would take ``true`` resent as ``1`` for the same argument) and a
    number to an equal number (``1.0`` re-serialised as ``1``). Iterative: any depth a client
    sent is compared without a RecursionError."""
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if isinstance(x, Mapping) and isinstance(y, Mapping):
            if x.keys() != y.keys():
                return False
            pending += [(x[key], y[key]) for key in x]
        elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            if len(x) != len(y):
                return False
            pending += zip(x, y, strict=True)
        elif isinstance(x, bool) != isinstance(y, bool) or x != y:
            return False
    return True


def _call_key(call: Any) -> tuple[Any, Any] | None:
    """A call's function name and arguments, a JSON string read as its value (as written
    when it does not parse); None when the call has no ``function`` object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return None
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        # not JSON, or nested past the decoder's limit: compared as written
        with contextlib.suppress(ValueError, RecursionError):
            arguments = json.loads(arguments)
    return function.get("name"), arguments
