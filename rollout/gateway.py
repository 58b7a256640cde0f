"""The token-in, token-out (TITO) gateway: sessions that record every token exactly.

Each rollout opens a :class:`Session`. The first turn renders the chat messages through
the tokenizer's chat template; every later turn keeps the previous tokens verbatim and
appends only the new messages, rendered as a delta (the end of the assistant turn the
template would have written, the new messages, the generation prompt). Generated tokens
are never decoded and re-encoded, so the record holds exactly what the policy sampled,
with its sampling log-prob and the weight version that produced it.

``session.record(...)`` returns the canonical trajectory record (``storage.schema``).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import json
import math
import re
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tokenizers import AddedToken, Tokenizer

from rollout.engines.base import ContextLimit, EngineError, Generation, InvalidRequest, SamplingParams
from rollout.router import Router, check_end
from rollout.tool_calls import TAGS, ToolCallFormat, tool_call_message, with_object_arguments
from storage.schema import LOGPROB_SLACK, MAX_ERROR_CHARS, MAX_TURN, STATUSES, error_text

TIMING_KEYS = ("init", "run", "eval", "queue")
"""The entries of a record's ``timing``, in seconds (``storage.schema.TIMING_TYPE``)."""
REMEMBERED_EXECUTIONS = 1 << 16
"""Trajectories whose execution id a gateway keeps for the branches opened from them later."""

_MARK = "\u2063treadle-assistant-content\u2063"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "treadle_probe_tool", "parameters": {"type": "object", "properties": {}}},
}


class UnknownSession(LookupError):
    """No open session has this id."""


RENDERING_ARGUMENTS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip
"""Arguments of ``apply_chat_template`` that the gateway sets: not template variables."""


class GatewayConfig(BaseModel):
    """Limits the gateway enforces before a request reaches an engine."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    max_context_tokens: int = Field(
        4096, ge=2, description="Most tokens one session may hold; a longer prompt is rejected."
    )
    vocab_size: int | None = Field(
        None,
        ge=1,
        description="Token ids must be below this; defaults to the model's vocab_size (its embedding rows, "
        "often past the tokenizer's tokens) in rollout workers and evaluations, else the tokenizer's length.",
    )
    eos_token_ids: list[int] | None = Field(
        None,
        description="Token ids that end a turn besides the tokenizer's EOS and the chat template's closing "
        "token; default: the model's generation_config eos_token_id(s) in rollout workers and evaluations "
        "(Qwen2.5/Qwen3 instruct list <|endoftext|> too), which vLLM would stop at but the engines ignore.",
    )
    max_new_tokens: int = Field(256, ge=1, description="Default generation budget per turn.")
    tool_call_format: ToolCallFormat | None = Field(
        "hermes",
        description="How the policy writes tool calls, parsed into the OpenAI reply's tool_calls "
        "(hermes: <tool_call> JSON blocks, as Qwen2.5/Qwen3 templates ask); null refuses tool definitions.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Variables given to the chat template on every rendering (vLLM's chat_template_kwargs), "
        "e.g. {enable_thinking: false} for Qwen3 to answer without a thinking block.",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(value) & RENDERING_ARGUMENTS)
        if taken:
            raise ValueError(f"{taken} are set by the gateway itself, not template variables")
        return value


class ChatRenderer:
    """Renders chat messages into token ids through the tokenizer's chat template.

    ``first`` renders a whole conversation; ``delta`` renders only new messages as they
    would follow an assistant turn, so earlier tokens never need re-encoding.
    ``template_kwargs`` are variables the template reads (``enable_thinking`` …).

    Messages and tools are text: a special token's string in them (a sandbox that prints
    ``<|im_end|>``) is encoded as ordinary tokens, not as the control token, which would forge
    a turn boundary in the policy's context. Only the template's own markup gives control
    tokens. Text without such strings encodes exactly as the template's whole output does.
    """

    def __init__(self, tokenizer, template_kwargs: Mapping[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        nonce = uuid.uuid4().hex
        self._quotes = (f"\ue000{nonce}\ue001", f"\ue001{nonce}\ue000")
        """What :meth:`_render` wraps each special-token string of the messages and tools in,
        for :meth:`encode` to tell it from the template's markup."""
        self._anchor = f"\ue002{nonce}\ue002"
        """A token only :attr:`_plain_encoder` knows, that text is encoded after (see :meth:`_encode_plain`)."""
        self._base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        self._prefix = self._render(self._base, add_generation_prompt=False)
        if _MARK not in self._prefix:
            raise ValueError("the chat template does not render assistant content verbatim")
        self.closing = self._prefix[self._prefix.rindex(_MARK) + len(_MARK) :]
        """Text the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        self._asked = self._render(self._base[:1], add_generation_prompt=False)
        """The messages before the assistant turn, rendered alone."""
        self._leads = (
            self._prefix[: self._prefix.rindex(_MARK)],
            self._render(self._base[:1], add_generation_prompt=True),
        )
        """What an earlier assistant message's content may be preceded by in a delta's
        rendering, or a prefix of it that holds :attr:`_asked`."""
        self._opening = self._leads[1].removeprefix(self._asked)
        """How the generation prompt opens an assistant turn (e.g. ``<|im_start|>assistant\\n``)."""

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The template's text; where the messages or tools hold special-token strings, with
        each of them quoted (:attr:`_quotes`) where the template wrote it. Assistant calls'
        arguments sent as JSON strings are rendered as their objects (:func:`with_object_arguments`)."""
        messages = with_object_arguments(messages)
        text = self._apply(messages, add_generation_prompt, tools)
        _check_written(messages, text)
        if not _holds(self._specials, [messages, tools]):
            return text
        quoted = self._apply(self._quote(messages), add_generation_prompt, self._quote(tools))
        if self._unquote(quoted)[0] != text:
            raise InvalidRequest(
                "the chat template rewrites the messages' special-token text (escapes, splits or compares "
                "it): it cannot be told from the template's own control tokens, so it cannot be encoded as "
                "plain text"
            )
        return quoted

    def _apply(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.template_kwargs,
            )
        except (TemplateError, TypeError) as exc:  # a field the template cannot take (no content, a number …)
            raise InvalidRequest(f"the chat template cannot render these messages: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: special-token strings are control tokens, except where
        :meth:`_render` quoted them, which are encoded as plain text (see :meth:`_plain_ids`)."""
        check_text(text, "the rendered messages")
        if self._quotes[0] not in text:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._plain_ids(*self._unquote(text))

    @functools.cached_property
    def _specials(self) -> re.Pattern | None:
        """Matches the strings of the tokenizer's special tokens, longest first (None if it has none)."""
        added = self.tokenizer.added_tokens_decoder
        strings = {
            added[i].content if i in added else self.tokenizer.convert_ids_to_tokens(i) for i in self._special
        }
        ordered = sorted(filter(None, strings), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, ordered))) if ordered else None

    @functools.cached_property
    def _special(self) -> frozenset[int]:
        return special_ids(self.tokenizer)

    def _quote(self, value: Any) -> Any:
        """``value`` (messages, tools: JSON-like data) with every special-token string in its
        strings wrapped in :attr:`_quotes`, keys too (a tool's parameter names, a call's argument
        names)."""
        if isinstance(value, str):
            return self._specials.sub(lambda match: self._quotes[0] + match[0] + self._quotes[1], value)
        if isinstance(value, Mapping):
            return {
                self._quote(key) if isinstance(key, str) else key: self._quote(item)
                for key, item in value.items()
            }
        if isinstance(value, (list, tuple)):
            return [self._quote(item) for item in value]
        return value

    def _unquote(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """``text`` without its quotes and the character spans in it of the quoted strings;
        :class:`InvalidRequest` if the template broke a quote (it cut or changed the string)."""
        opening, closing = self._quotes
        quoted = re.compile(f"{re.escape(opening)}({self._specials.pattern}){re.escape(closing)}")
        parts, spans, at, length = [], [], 0, 0
        for match in quoted.finditer(text):
            parts.append(text[at : match.start()])
            length += match.start() - at
            spans.append((length, length + len(match[1])))
            parts.append(match[1])
            length += len(match[1])
            at = match.end()
        plain = "".join([*parts, text[at:]])
        if opening in plain or closing in plain:
            raise InvalidRequest(
                "the chat template cuts or rewrites the messages' special-token text: it cannot be told "
                "from the template's own control tokens, so it cannot be encoded as plain text"
            )
        return plain, spans

    def _plain_ids(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Token ids of ``text`` where the special-token strings at ``spans`` are plain text.

        ``text`` is encoded whole; the control tokens found at ``spans`` are forged. The
        tokenizer encodes the text between two special tokens on its own, so only a stretch
        between two of the template's control tokens that holds a forged one is encoded again,
        as plain text; every other token is as the whole text's encoding has it. Needs a fast
        tokenizer (the offsets of its tokens).
        """
        try:
            encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # a Python tokenizer keeps no offsets
            raise InvalidRequest(
                "the messages hold special-token text, which only a fast tokenizer (tokenizers' offsets) "
                "can encode as plain text; this tokenizer is not one"
            ) from None
        ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
        starts = [start for start, _ in spans]

        def forged(k: int) -> bool:
            start, end = offsets[k]
            last = bisect.bisect_left(starts, end) - 1  # the last span starting before the token ends
            return last >= 0 and spans[last][1] > start

        markup = [k for k, i in enumerate(ids) if i in self._special and not forged(k)]
        result, first, after = [], 0, 0
        for k in [*markup, len(ids)]:
            stretch = ids[first:k]
            if any(i in self._special for i in stretch):
                end = offsets[k][0] if k < len(ids) else len(text)
                stretch = self._encode_plain(text[after:end], after_token=first > 0)
            result += stretch
            if k < len(ids):
                result.append(ids[k])
                first, after = k + 1, offsets[k][1]
        return result

    def _encode_plain(self, text: str, after_token: bool) -> list[int]:
        """Token ids of ``text`` as plain text, as the tokenizer encodes it at the start of
        the whole text, or ``after_token``: after an added token. The two differ where the
        pre-tokenizer marks the start alone (a Metaspace prefix "▁" with prepend_scheme
        "first"); text encoded after :attr:`_anchor` is encoded as after any added token."""
        encoder, anchor = self._plain_encoder
        if not after_token:
            ids = encoder.encode(text, add_special_tokens=False).ids
        else:
            ids = encoder.encode(self._anchor + text, add_special_tokens=False).ids
            if ids[:1] != [anchor]:
                raise InvalidRequest("the tokenizer does not encode an added token's text as that token")
            ids = ids[1:]
        if any(i in self._special for i in ids):
            raise InvalidRequest(
                "the tokenizer encodes the messages' special-token text as a special token even as plain text"
            )
        return ids

    @functools.cached_property
    def _plain_encoder(self) -> tuple[Tokenizer, int]:
        """A copy of the fast tokenizer's backend that encodes special-token strings as text,
        with :attr:`_anchor` added, and the anchor's id. A copy: ``tokenizer.encode(...,
        split_special_tokens=True)`` sets that on the shared backend for every caller, and
        renderings of long messages run on worker threads."""
        encoder = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
        encoder.no_truncation()
        encoder.no_padding()
        encoder.encode_special_tokens = True
        encoder.add_tokens([AddedToken(self._anchor, special=False, normalized=False)])
        return encoder, encoder.token_to_id(self._anchor)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the template writes tool definitions into the prompt (many ignore them)."""
        probe = self._render(self._base[:1], True, [_PROBE_TOOL])
        return _PROBE_TOOL["function"]["name"] in probe

    def first(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a whole conversation (with the tool definitions, where the template
        puts them) followed by the generation prompt."""
        return self.encode(self._render(messages, add_generation_prompt=True, tools=tools))

    def delta(self, messages: Sequence[Mapping[str, Any]], after_action: list[int] | None) -> list[int]:
        """Token ids of ``messages`` plus the generation prompt, appended to a session.

        ``after_action`` is the action that ends the session's tokens, if its last tokens
        were generated: the rest of that assistant turn's closing text is written first
        (the part after the closing's first token when the action ends with that token, as
        it does when the model stopped on it; all of it otherwise, e.g. when the action was
        cut at the length limit, whatever text its last token decodes to).
        """
        full = self._render([*self._base, *messages], add_generation_prompt=True)
        # Before the assistant's content, the earlier messages must render as they do alone.
        # The assistant turn's opening may be as when it ends the conversation, as the prompt
        # the model continued, or shorter: Qwen3 writes an empty <think> block into the last
        # assistant turn only, and into the prompt with enable_thinking false; the session
        # holds what the model saw there. What a shorter opening leaves out must then be what
        # every prompt writes, not something that changes from turn to turn (a turn count).
        at = full.find(_MARK)
        head = full[:at]
        if (
            at < 0
            or not head.startswith(self._asked)
            or not any(lead.startswith(head) for lead in self._leads)
            or not full.startswith(self.closing, at + len(_MARK))
            or (head not in self._leads and not full.endswith(self._opening))
        ):
            raise InvalidRequest(
                "the chat template renders earlier messages differently when new ones follow; "
                "cannot append messages as a delta"
            )
        body = full[at + len(_MARK) + len(self.closing) :]
        if after_action is None:
            return self.encode(body)
        closing = self.closing
        closing_ids = self.encode(closing)
        if after_action and closing_ids and after_action[-1] == closing_ids[0]:
            closing = closing.removeprefix(self.tokenizer.decode(closing_ids[:1], skip_special_tokens=False))
        return self.encode(closing + body)

    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end an assistant turn: EOS and the template's closing token, where
        that is a special token (a plain one, a newline say, would end turns mid-text)."""
        ids = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        closing_ids = self.encode(self.closing)
        if closing_ids and closing_ids[0] in special_ids(self.tokenizer):
            ids.append(closing_ids[0])
        return tuple(dict.fromkeys(ids))


_ROLES = frozenset({"system", "user", "assistant", "tool"})
"""The roles chat templates are written for; a message of another (``developer``, ``function``
…) may be left out of the prompt."""


def _check_written(messages: Sequence[Mapping[str, Any]], text: str) -> None:
    """Raise :class:`InvalidRequest` for a message of a role beyond OpenAI's four (system, user,
    assistant, tool) whose text the template did not write into ``text``, as it is or as JSON
    (``tojson``): Qwen's templates write only the roles they know, so a ``developer`` message
    (OpenAI's newer system) vanished, and the policy was trained as if it had seen it."""
    for message in messages:
        content, role = message.get("content"), message.get("role")
        if role in _ROLES or not isinstance(content, str):
            continue
        written = content.strip()
        if written not in text and json.dumps(written, ensure_ascii=False)[1:-1] not in text:
            raise InvalidRequest(
                f"the chat template writes no text of a {role!r} message into the prompt, so the policy "
                "would never see it" + ("; send it as a system message" if role == "developer" else "")
            )


def _holds(pattern: re.Pattern | None, value: Any) -> bool:
    """Whether a string in ``value`` (JSON-like data, keys included) holds a match of ``pattern``."""
    if pattern is None:
        return False
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, Mapping):
        return any(_holds(pattern, key) or _holds(pattern, item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return any(_holds(pattern, item) for item in value)
    return False


def special_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens: those it names (EOS, pad …) and every added
    token marked special, which decoding drops too, named or not (a Llama 3 tokenizer whose
    EOS is ``<|end_of_text|>`` closes turns with ``<|eot_id|>``, special but unnamed)."""
    added = tokenizer.added_tokens_decoder
    return frozenset(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}


RENDER_INLINE_CHARS = 16_384
"""Queued chat text up to this many characters is rendered on the event loop (rendering takes
about a microsecond a character on one core); more goes to a worker thread: a client's 15 MB
message took 14 s to tokenize, the event loop stalled all that time."""


def _text_size(value: Any) -> int:
    """Characters of the strings in ``value`` (messages, tools: JSON-like data)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v) for v in value)
    return 0


def check_text(text: str, what: str) -> str:
    """``text``, or :class:`InvalidRequest` when it holds a lone surrogate (text decoded with
    ``surrogateescape``, or a JSON ``\\udc80`` escape): it has no UTF-8 form, and a tokenizer
    refuses it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{what}: {text[exc.start]!r} at character {exc.start} is a lone surrogate, not text "
            "(it has no UTF-8 form)"
        ) from None
    return text


def _check_id(value: str, name: str) -> None:
    """Raise :class:`InvalidRequest` unless ``value`` is text with something other than
    whitespace in it: a record carrying another id could neither be sent nor written."""
    check_text(value, name)
    if not value.strip():
        raise InvalidRequest(f"{name} {value!r} is blank: an id must hold something other than whitespace")


@dataclass(frozen=True)
class SessionInfo:
    """Ids that place one rollout in the run."""

    session_id: str
    trajectory_id: str
    execution_id: str
    task: str
    prompt_id: str
    group_id: str | None = None
    parent_id: str | None = None
    branch_at: int | None = None


@dataclass
class TurnResult:
    """One generated action as the session recorded it."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str
    engine: str
    prompt_tokens: int
    cached_tokens: int
    message: dict[str, Any]
    """The assistant message as OpenAI clients get it: ``content`` is ``text``, or, where the
    session parses tool calls, the text outside the calls (then in ``tool_calls``), tool-call
    markers kept even where they are special tokens."""

    @property
    def truncated(self) -> bool:
        """The action was cut at the token budget rather than ending at a stop token."""
        return self.finish_reason == "length"


@dataclass
class Session:
    """One rollout's token record, built turn by turn. Obtain it from :meth:`Gateway.open`."""

    info: SessionInfo
    gateway: Gateway
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as the gateway has seen it (assistant messages as returned:
    :attr:`TurnResult.message`)."""
    message_tokens: int = 0
    """How many of :attr:`tokens` :attr:`messages` stand for: all of them until tokens are
    placed otherwise (:meth:`add_tokens`)."""
    tools: list[dict[str, Any]] | None = None
    """The tool definitions rendered into the first prompt (fixed for the session's life)."""
    template_kwargs: dict[str, Any] | None = None
    """The chat template variables its first messages came with, over the config's (fixed
    for the session's life, like :attr:`tools`)."""
    renderer: ChatRenderer | None = None
    """What renders its messages: the gateway's, or one with :attr:`template_kwargs` (None
    without a tokenizer that has a chat template)."""
    transcript: str = ""
    """The text-completion history as the client has seen it (prompts plus completions)."""
    transcript_tokens: int = 0
    """How many of :attr:`tokens` :attr:`transcript` stands for (see :meth:`keep_transcript`)."""
    turns: list[TurnResult] = field(default_factory=list)
    closed: bool = False
    """Set by :meth:`Gateway.close`; a turn still waiting for the session's lock then fails."""
    engine_error: str | None = None
    """Why the engine failed the session's last turn (``EngineError``); None once a turn
    succeeds. A self-driving env's program sees such a failure only as an HTTP error: the
    rollout service reads it here to classify the rollout."""
    context_limit: str | None = None
    """Why the session's last turn did not fit under ``max_context_tokens``, in the engine's
    context or in :attr:`max_turns` (``ContextLimit``); None once a turn succeeds. Read, like
    :attr:`engine_error`, to classify a self-driving env's rollout."""
    max_turns: int | None = None
    """Most turns the session may generate (a self-driving env's program's model calls, which
    the rollout service bounds as it bounds the turns it drives); None: no limit."""
    max_new_tokens: int | None = None
    """Most tokens one turn may generate, whatever its request asks (a self-driving env's
    program's model calls, which the rollout service holds to the budget of a driven env's
    action); None: the request's."""
    seed: int | None = None
    """The rollout's sampling seed (the rollout service's request's): a model call over HTTP that
    sends no seed samples with it hashed with the session's length, so a self-driving env's
    rollout is reproducible from it; None: such calls are unseeded."""
    _pending: list[dict[str, Any]] = field(default_factory=list)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _generating: asyncio.Future | None = None
    """The engine call of the turn generating now (cancelled when the session is closed)."""
    _last_request: tuple[Any, int] | None = None
    """The ``request`` the last turn was generated for (see :meth:`generate`) and the number
    of tokens the turn left."""

    @property
    def session_id(self) -> str:
        return self.info.session_id

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def last_action(self) -> list[int] | None:
        """The last generated tokens, when they end the session (nothing appended after)."""
        if self.turns and self.action_mask and self.action_mask[-1]:
            return self.turns[-1].token_ids
        return None

    def add_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Queue chat messages; they are rendered into tokens by the next :meth:`generate`.

        ``tools`` (OpenAI tool definitions) go into the first prompt, where the chat template
        writes them; every later call must pass the same ones (or none, if the first had
        none), since the prompt already holds them. While a session has tools, each reply's
        tool calls are parsed (``GatewayConfig.tool_call_format``).

        ``template_kwargs`` (vLLM's per-request ``chat_template_kwargs``) are template
        variables over ``GatewayConfig.chat_template_kwargs``; likewise every later call must
        pass the same ones: the session's tokens were rendered with them, and a delta
        rendered with others would follow a prompt the template would now write otherwise.
        """
        self._check_no_turn_generating()
        for message in messages:  # all before any is queued: a refused request adds nothing
            if not isinstance(message, Mapping) or "role" not in message:
                raise InvalidRequest(f"a chat message needs a 'role', got {message!r}")
        template_kwargs = dict(template_kwargs) if template_kwargs else None
        if template_kwargs != self.template_kwargs:
            if self.tokens or self._pending:
                raise InvalidRequest(
                    f"chat_template_kwargs {template_kwargs} differ from the {self.template_kwargs} the "
                    "session's prompt was rendered with; a session keeps those of its first request"
                )
            self.renderer = self.gateway.renderer_with(template_kwargs)
            self.template_kwargs = template_kwargs
        tools = [dict(tool) for tool in tools] if tools else None
        if tools != self.tools:
            if self.tokens or self._pending:
                raise InvalidRequest(
                    "the tool definitions differ from those the session's prompt was rendered with; "
                    "a session keeps the tools of its first request"
                )
            if tools:
                self.gateway.check_tools_served()
            self.tools = tools
        self._pending.extend(dict(message) for message in messages)

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Append tokens verbatim as context (not generated, never trained on)."""
        self._check_no_turn_generating()
        self.gateway.check_ids(token_ids, what="token_ids")
        self._pending_flush()
        self._append(list(token_ids))

    def text_suffix(self, prompt: str) -> str:
        """What a text prompt adds to :attr:`transcript`; :class:`InvalidRequest` when it does
        not extend it, or when tokens past the transcript were placed otherwise (chat messages,
        token ids): the prompt cannot show them, and its client would not know the policy saw them."""
        unseen = len(self.tokens) - self.transcript_tokens
        if unseen:
            raise InvalidRequest(
                f"session {self.session_id!r} holds {unseen} tokens no text prompt sent (chat messages or "
                "token ids placed them), so a text prompt cannot be checked against its context; send "
                "the prompt as token ids, or use another session"
            )
        if not prompt.startswith(self.transcript):
            raise InvalidRequest(
                "the prompt does not extend the session's history (earlier prompts plus completions)"
            )
        return prompt[len(self.transcript) :]

    def keep_transcript(self, text: str) -> None:
        """Make ``text`` the :attr:`transcript`, standing for all of :attr:`tokens`."""
        self.transcript, self.transcript_tokens = text, len(self.tokens)

    def _check_no_turn_generating(self) -> None:
        # the turn generating now did not see them, yet they would sit before its action
        if self._generating is not None:
            raise InvalidRequest(
                f"session {self.session_id!r} is generating a turn: add context with the next "
                "generate (its prepare step) or after this turn ends"
            )

    def _pending_flush(self) -> None:
        if self._pending:
            new, self._pending = self._pending, []
            self._take(new, self._rendered(new))

    async def _pending_flush_off_loop(self) -> None:
        """:meth:`_pending_flush`, with queued text over :data:`RENDER_INLINE_CHARS` rendered
        on a worker thread (the tokenizer lets go of the GIL): a long message would otherwise
        stall the event loop, every rollout, the gateway and the heartbeats with it."""
        if not self._pending:
            return
        new, self._pending = self._pending, []
        chars = _text_size([new, self.tools if not self.tokens else None])
        self._take(new, await self.tokenized(chars, "messages rendered", self._rendered, new))

    async def prompt_size(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """Tokens the next prompt would hold with ``messages`` queued after what is queued
        now, rendered as :meth:`generate` will render them (nothing is queued)."""
        new = [*self._pending, *(dict(message) for message in messages)]
        if not new:
            return len(self.tokens)
        chars = _text_size([new, self.tools if not self.tokens else None])
        return len(self.tokens) + len(await self.tokenized(chars, "messages measured", self._rendered, new))

    async def tokenized(
        self, chars: int, what: str, tokenize: Callable[..., Sequence[int]], *args: Any, **kwargs: Any
    ) -> list[int]:
        """``tokenize(*args, **kwargs)`` of ``chars`` characters of text: on the event loop up
        to :data:`RENDER_INLINE_CHARS`, on a worker thread above (the tokenizer lets go of the
        GIL); a session closed meanwhile raises :class:`UnknownSession` naming ``what``."""
        if chars <= RENDER_INLINE_CHARS:
            return list(tokenize(*args, **kwargs))
        ids = await asyncio.to_thread(tokenize, *args, **kwargs)
        if self.closed:
            raise UnknownSession(f"session {self.session_id!r} was closed while its {what}")
        return list(ids)

    def _rendered(self, new: list[dict[str, Any]]) -> list[int]:
        renderer = self.renderer
        if renderer is None:
            raise InvalidRequest("this gateway has no tokenizer with a chat template; send token ids")
        return renderer.first(new, self.tools) if not self.tokens else renderer.delta(new, self.last_action)

    def _take(self, new: list[dict[str, Any]], ids: list[int]) -> None:
        self.gateway.check_ids(ids, what="rendered messages")
        covered = self.message_tokens == len(self.tokens)
        self._append(ids)
        self.messages.extend(new)
        if covered:
            self.message_tokens = len(self.tokens)

    def _append(self, ids: list[int]) -> None:
        n = len(ids)
        if len(self.tokens) + n > self.gateway.config.max_context_tokens:
            self._out_of_context(
                f"session {self.session_id!r} would hold {len(self.tokens) + n} tokens, over "
                f"max_context_tokens={self.gateway.config.max_context_tokens}"
            )
        self.tokens.extend(ids)
        self.logprobs.extend([0.0] * n)
        self.action_mask.extend([False] * n)
        self.turn.extend([self.num_turns] * n)
        self.versions.extend([-1] * n)

    def _out_of_context(self, why: str) -> NoReturn:
        self.context_limit, self.engine_error = why, None
        raise ContextLimit(why)

    async def generate(
        self,
        params: SamplingParams | Callable[[], SamplingParams] | None = None,
        prepare: Callable[[], Awaitable[None] | None] | None = None,
        parse_tool_calls: bool = True,
        request: Any = None,
    ) -> TurnResult:
        """Render queued messages, then generate one action from the whole token sequence.

        The reply's tool calls are parsed when the session has tools and
        ``parse_tool_calls`` (an OpenAI request's ``tool_choice: none`` turns it off).

        ``params`` may be a function that makes them, called under the session's lock before
        ``prepare``: sampling that depends on the session (a training server's seed, hashed
        with its length) is then of the history this turn follows, not of the one a request
        found before it waited for another turn.

        ``prepare`` runs first (awaited when it returns an awaitable), under the session's
        lock: what a request adds (its new messages or tokens, checked against the history)
        and the turn generated from it are one step, so a second request on the session (a
        client's retry while the first one still generates) waits for that turn and is
        checked against the history it left, instead of slipping its tokens in front of the
        turn's action.

        ``request`` stands for what the caller asked for, equal (``==``) for a resent request.
        When it equals the last turn's and nothing was added to the session since, that
        turn's result is returned again, without ``prepare``, generating or recording
        anything: a client's retry of a request whose reply it never got (its timeout ran
        out while the turn queued or generated).

        Raises :class:`UnknownSession` when the session was closed while this turn waited for
        the one before it or while ``prepare`` ran (routing it would pin the closed session to
        a replica again) or while it generated (the engine call is cancelled: nobody will read
        its tokens).
        """
        async with self._lock:
            if self.closed:
                raise UnknownSession(f"session {self.session_id!r} was closed")
            if (
                request is not None
                and self._last_request == (request, len(self.tokens))
                and not self._pending
            ):
                return self.turns[-1]
            if self.max_turns is not None and self.num_turns >= self.max_turns:
                self._out_of_context(
                    f"session {self.session_id!r} has generated its max_turns={self.max_turns} turns"
                )
            if self.num_turns >= MAX_TURN:  # context appended after the last turn takes the next index
                self._out_of_context(
                    f"session {self.session_id!r} has generated {MAX_TURN} turns, the most a record's "
                    "turn index holds"
                )
            if callable(params):
                params = params()
            if prepare is not None:
                prepared = prepare()
                if prepared is not None:
                    await prepared
                    if self.closed:
                        raise UnknownSession(
                            f"session {self.session_id!r} was closed while its turn prepared"
                        )
            await self._pending_flush_off_loop()
            if not self.tokens:
                raise InvalidRequest("empty prompt: add messages or token ids before generating")
            params = params or SamplingParams(
                max_new_tokens=self.gateway.config.max_new_tokens, stop_ids=self.gateway.stop_ids
            )
            room = self.gateway.config.max_context_tokens - len(self.tokens)
            if room < 1:
                self._out_of_context(
                    f"prompt of {len(self.tokens)} tokens leaves no room under "
                    f"max_context_tokens={self.gateway.config.max_context_tokens}"
                )
            budget = room if self.max_new_tokens is None else min(room, self.max_new_tokens)
            if params.max_new_tokens > budget:
                params = SamplingParams(
                    max_new_tokens=budget,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    stop_ids=params.stop_ids,
                    seed=params.seed,
                )
            self._generating = asyncio.ensure_future(
                self.gateway.router.generate(self.session_id, list(self.tokens), params)
            )
            try:
                generation = await self._generating
                _check_generation(generation, self.gateway.vocab_size, params.max_new_tokens)
            except asyncio.CancelledError:
                if self.closed and not asyncio.current_task().cancelling():
                    raise UnknownSession(
                        f"session {self.session_id!r} was closed while its turn generated"
                    ) from None
                raise
            except EngineError as exc:
                self.engine_error, self.context_limit = str(exc), None
                raise
            except ContextLimit as exc:  # the engine's own limit: the model's positions, vLLM's max_model_len
                self.context_limit, self.engine_error = str(exc), None
                raise
            finally:
                self._generating = None
            self.engine_error = self.context_limit = None
            text = self.gateway.decode(generation.token_ids)
            message = {"role": "assistant", "content": text}
            if self.tools and parse_tool_calls:
                # a block that holds no call stays in the content with its markers, as written
                written = self.gateway.tool_text(generation.token_ids)
                message = tool_call_message(written, self.gateway.config.tool_call_format) or {
                    "role": "assistant",
                    "content": written,
                }
            result = TurnResult(
                token_ids=list(generation.token_ids),
                logprobs=[float(x) for x in generation.logprobs],
                versions=[int(v) for v in generation.versions],
                finish_reason=generation.finish_reason,
                text=text,
                engine=generation.engine,
                prompt_tokens=generation.prompt_tokens,
                cached_tokens=generation.cached_tokens,
                message=message,
            )
            n = len(result.token_ids)
            covered = self.message_tokens == len(self.tokens)
            self.tokens.extend(result.token_ids)
            self.logprobs.extend(result.logprobs)
            self.action_mask.extend([True] * n)
            self.turn.extend([self.num_turns] * n)
            self.versions.extend(result.versions)
            self.turns.append(result)
            self.messages.append(result.message)
            if covered:
                self.message_tokens = len(self.tokens)
            self._last_request = (request, len(self.tokens))
            return result

    @property
    def default_status(self) -> str:
        """The status :meth:`record` gives when none is sent: ``truncated`` when the last action
        hit its token budget, else ``ok``."""
        return "truncated" if self.turns and self.turns[-1].truncated else "ok"

    def record(
        self,
        reward: float | None = None,
        progress: float | None = None,
        status: str | None = None,
        timing: Mapping[str, float] | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        """The canonical trajectory record of this session (valid under ``storage.schema``).

        ``status`` defaults to ``truncated`` when the last action hit its token budget and
        ``ok`` otherwise; ``timing`` holds seconds for ``init``, ``run``, ``eval``, ``queue``;
        ``error`` says why the rollout failed or was truncated, at most ``MAX_ERROR_CHARS``
        characters (credentials in it are masked: ``storage.schema.error_text``).
        """
        if status is None:
            status = self.default_status
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}; expected one of {STATUSES}")
        if error is not None and len(error) > MAX_ERROR_CHARS:
            raise ValueError(f"error holds {len(error)} characters, over {MAX_ERROR_CHARS}")
        if reward is not None and not math.isfinite(reward):
            raise ValueError(f"reward {reward} is not a finite number")
        if progress is not None and not 0 <= progress <= 1:
            raise ValueError(f"progress {progress} is outside [0, 1]")
        engines = list(dict.fromkeys(t.engine for t in self.turns if t.engine))
        info = self.info
        return {
            "trajectory_id": info.trajectory_id,
            "execution_id": info.execution_id,
            "parent_id": info.parent_id,
            "branch_at": info.branch_at,
            "task": info.task,
            "prompt_id": info.prompt_id,
            "group_id": info.group_id,
            "tokens": list(self.tokens),
            "logprobs": list(self.logprobs),
            "action_mask": list(self.action_mask),
            "turn": list(self.turn),
            "versions": list(self.versions),
            "reward": reward,
            "progress": progress,
            "status": status,
            "error": None if error is None else error_text(error),
            "engine": ",".join(engines) or None,
            "timing": {k: float(timing.get(k, 0.0)) for k in TIMING_KEYS} if timing else None,
        }


def _check_generation(generation: Generation, vocab_size: int, max_new_tokens: int) -> None:
    n = len(generation.token_ids)
    if len(generation.logprobs) != n or len(generation.versions) != n:
        raise EngineError(
            f"engine {generation.engine!r} returned {n} tokens, {len(generation.logprobs)} log-probs "
            f"and {len(generation.versions)} versions"
        )
    if not n:  # the next delta would follow the turn's prompt, leaving its assistant turn unclosed
        raise EngineError(f"engine {generation.engine!r} returned no tokens")
    if n > max_new_tokens:  # the session would hold more than max_context_tokens
        raise EngineError(
            f"engine {generation.engine!r} returned {n} tokens for a budget of {max_new_tokens}"
        )
    if any(not 0 <= t < vocab_size for t in generation.token_ids):
        raise EngineError(f"engine {generation.engine!r} returned a token id outside the vocabulary")
    if not all(math.isfinite(x) for x in generation.logprobs):  # the HTTP reply cannot hold NaN either
        raise EngineError(f"engine {generation.engine!r} returned a log-prob that is not finite")
    # a record holding either is refused when written, with its whole group, after the
    # rollout counted as done
    if any(x > LOGPROB_SLACK for x in generation.logprobs):
        raise EngineError(f"engine {generation.engine!r} returned a log-prob above 0")
    if any(v < 0 for v in generation.versions):
        raise EngineError(f"engine {generation.engine!r} returned a negative weight version")


class Gateway:
    """Opens sessions and sends their turns through the router to engine replicas."""

    def __init__(self, router: Router, tokenizer=None, config: GatewayConfig | None = None):
        self.router = router
        self.tokenizer = tokenizer
        self.config = config or GatewayConfig()
        self.renderer = (
            ChatRenderer(tokenizer, self.config.chat_template_kwargs)
            if tokenizer is not None and tokenizer.chat_template
            else None
        )
        if self.config.vocab_size is not None:
            self.vocab_size = self.config.vocab_size
        elif tokenizer is not None:
            self.vocab_size = len(tokenizer)
        else:
            raise ValueError("give the gateway a tokenizer or set GatewayConfig.vocab_size")
        stop_ids: tuple[int, ...] = ()
        if self.renderer is not None:
            stop_ids = self.renderer.stop_ids()
        elif tokenizer is not None and tokenizer.eos_token_id is not None:
            stop_ids = (int(tokenizer.eos_token_id),)
        for t in self.config.eos_token_ids or ():
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"GatewayConfig.eos_token_ids holds {t}, outside the vocabulary [0, {self.vocab_size})"
                )
        self.stop_ids = tuple(dict.fromkeys([*stop_ids, *(self.config.eos_token_ids or ())]))
        """Token ids that end a turn unless a request names others: EOS, the chat template's
        closing token where it has one, and ``GatewayConfig.eos_token_ids``."""
        self._skipped_in_tool_text = self._special_ids_but_tool_tags()
        self._sessions: dict[str, Session] = {}
        self._executions: OrderedDict[str, str] = OrderedDict()
        """Execution id of each trajectory opened here, newest last (at most
        :data:`REMEMBERED_EXECUTIONS`): what a branch of it opened later joins."""
        self._execution_sizes: Counter[str] = Counter()
        """How many trajectories of ``_executions`` each execution holds: a harness's write of a
        record asks it, and a scan of ``_executions`` took milliseconds once it was full."""

    def _special_ids_but_tool_tags(self) -> frozenset[int]:
        """Special token ids a reply's text for tool parsing leaves out: all but the tool-call
        format's markers (which some tokenizers hold as special tokens)."""
        if self.tokenizer is None or self.config.tool_call_format is None:
            return frozenset()
        vocab = self.tokenizer.get_vocab()
        tags = {vocab[tag] for tag in TAGS[self.config.tool_call_format] if tag in vocab}
        return special_ids(self.tokenizer) - tags

    def renderer_with(self, template_kwargs: Mapping[str, Any] | None) -> ChatRenderer | None:
        """The renderer of messages sent with ``template_kwargs`` over the config's."""
        if not template_kwargs:
            return self.renderer
        if self.renderer is None:
            raise InvalidRequest(
                "this gateway has no tokenizer with a chat template to give chat_template_kwargs"
            )
        taken = sorted(set(template_kwargs) & RENDERING_ARGUMENTS)
        if taken:
            raise InvalidRequest(
                f"chat_template_kwargs {taken} are set by the gateway itself, not template variables"
            )
        merged = self.config.chat_template_kwargs | dict(template_kwargs)
        if merged == self.config.chat_template_kwargs:
            return self.renderer
        try:
            return ChatRenderer(self.tokenizer, merged)
        except ValueError as exc:
            raise InvalidRequest(f"chat_template_kwargs {dict(template_kwargs)}: {exc}") from exc

    def check_tools_served(self) -> None:
        """Raise :class:`InvalidRequest` unless a session here can be given tool definitions."""
        if self.config.tool_call_format is None:
            raise InvalidRequest(
                "tool definitions are refused: this gateway parses no tool calls (tool_call_format is null)"
            )
        if self.renderer is None or not self.renderer.renders_tools:
            raise InvalidRequest(
                "tool definitions are refused: the policy's chat template does not write them into the prompt"
            )

    def open(
        self,
        *,
        task: str,
        prompt_id: str,
        execution_id: str | None = None,
        trajectory_id: str | None = None,
        group_id: str | None = None,
        parent_id: str | None = None,
        branch_at: int | None = None,
        session_id: str | None = None,
    ) -> Session:
        """Open a session for one rollout; ids given must hold text other than whitespace (no
        lone surrogate), ids left out (``None``) are generated, and a ``trajectory_id``
        given must be no open session's (a closed one's may open again: a rollout abandoned
        unrecorded and retried). A branch (``parent_id``)
        without ``execution_id`` joins its parent's execution: the one its parent was opened
        with here, else (a parent this gateway did not open, or opened long ago) the parent's
        id, which is a root's execution id by default."""
        self.check_open(
            task=task,
            prompt_id=prompt_id,
            execution_id=execution_id,
            trajectory_id=trajectory_id,
            group_id=group_id,
            parent_id=parent_id,
            branch_at=branch_at,
            session_id=session_id,
        )
        session_id = session_id or uuid.uuid4().hex
        trajectory_id = trajectory_id or uuid.uuid4().hex
        if not execution_id:
            execution_id = self._executions.get(parent_id, parent_id) if parent_id else trajectory_id
        self._remember(trajectory_id, execution_id)
        info = SessionInfo(
            session_id=session_id,
            trajectory_id=trajectory_id,
            execution_id=execution_id,
            task=task,
            prompt_id=prompt_id,
            group_id=group_id,
            parent_id=parent_id,
            branch_at=branch_at,
        )
        session = Session(info=info, gateway=self, renderer=self.renderer)
        self._sessions[session_id] = session
        return session

    def check_open(
        self,
        *,
        task: str,
        prompt_id: str,
        execution_id: str | None = None,
        trajectory_id: str | None = None,
        group_id: str | None = None,
        parent_id: str | None = None,
        branch_at: int | None = None,
        session_id: str | None = None,
    ) -> None:
        """Raise :class:`InvalidRequest` unless :meth:`open` takes these arguments now, saying why."""
        ids = {
            "task": task,
            "prompt_id": prompt_id,
            "execution_id": execution_id,
            "trajectory_id": trajectory_id,
            "group_id": group_id,
            "parent_id": parent_id,
        }
        for name, value in ids.items():
            if value is not None:
                _check_id(value, name)
        if branch_at is not None and parent_id is None:
            raise InvalidRequest(f"branch_at {branch_at} needs the parent_id it branched from")
        if session_id and session_id in self._sessions:
            raise InvalidRequest(f"session {session_id!r} is already open")
        if trajectory_id and any(s.info.trajectory_id == trajectory_id for s in self._sessions.values()):
            raise InvalidRequest(
                f"trajectory {trajectory_id!r} is open on this gateway already and two records may not "
                "share a trajectory_id (the processor drops one as duplicate_id): close that session, "
                "or send a new id or none"
            )

    async def branch(self, parent: Session, messages: Sequence[Mapping[str, Any]]) -> Session:
        """Open a branch of ``parent`` whose context is ``messages`` (rendered now, with the
        parent's tools and template variables): a new trajectory of the same execution, task,
        prompt and group, whose ``branch_at`` is where its tokens leave the parent's. Raises
        :class:`ContextLimit` (recorded on ``parent``) when they would not fit."""
        renderer = parent.renderer
        if renderer is None:
            raise InvalidRequest("this gateway has no tokenizer with a chat template; send token ids")
        messages = [dict(message) for message in messages]
        ids = await parent.tokenized(
            _text_size([messages, parent.tools]), "branch rendered", renderer.first, messages, parent.tools
        )
        self.check_ids(ids, what="rendered messages")
        if len(ids) > self.config.max_context_tokens:
            parent._out_of_context(
                f"a branch of session {parent.session_id!r} would hold {len(ids)} tokens, over "
                f"max_context_tokens={self.config.max_context_tokens}"
            )
        shared = min(len(ids), len(parent.tokens))
        branch_at = next((i for i in range(shared) if ids[i] != parent.tokens[i]), shared)
        info = parent.info
        child = self.open(
            task=info.task,
            prompt_id=info.prompt_id,
            execution_id=info.execution_id,
            group_id=info.group_id,
            parent_id=info.trajectory_id,
            branch_at=branch_at,
        )
        child.tools, child.template_kwargs, child.renderer = parent.tools, parent.template_kwargs, renderer
        child._take(messages, ids)
        return child

    def session(self, session_id: str) -> Session:
        """The open session ``session_id``."""
        try:
            return self._sessions[session_id]
        except KeyError:
            raise UnknownSession(f"no open session {session_id!r}") from None

    @property
    def sessions(self) -> list[str]:
        return list(self._sessions)

    def in_open_rollout(self, trajectory_id: str) -> bool:
        """Whether an open session belongs to the execution of trajectory ``trajectory_id`` (the
        one it was opened with here, else its own id: a root's by default), so its rollout is live."""
        execution = self._executions.get(trajectory_id, trajectory_id)
        return any(session.info.execution_id == execution for session in self._sessions.values())

    def _remember(self, trajectory_id: str, execution_id: str) -> None:
        """Keep ``trajectory_id``'s execution, the oldest forgotten past :data:`REMEMBERED_EXECUTIONS`."""
        previous = self._executions.pop(trajectory_id, None)
        if previous is not None:
            self._forget_member(previous)
        self._executions[trajectory_id] = execution_id
        self._execution_sizes[execution_id] += 1
        if len(self._executions) > REMEMBERED_EXECUTIONS:
            self._forget_member(self._executions.popitem(last=False)[1])

    def _forget_member(self, execution_id: str) -> None:
        self._execution_sizes[execution_id] -= 1
        if not self._execution_sizes[execution_id]:
            del self._execution_sizes[execution_id]

    def execution_size(self, execution_id: str) -> int:
        """How many trajectories opened on this gateway (the last ``REMEMBERED_EXECUTIONS``)
        belong to execution ``execution_id``."""
        return self._execution_sizes[execution_id]

    def trajectories_of(self, execution_id: str) -> list[str]:
        """The trajectories opened on this gateway (the last ``REMEMBERED_EXECUTIONS``) that
        belong to execution ``execution_id`` (a scan of them all: see :meth:`execution_size`)."""
        return [tid for tid, eid in self._executions.items() if eid == execution_id]

    def close(
        self, session_id: str, continued_in: str | None = None, expired: bool = False, idle_s: float = 0.0
    ) -> None:
        """End a session: release its replica assignment and the engine's cache for it; a turn
        of it still waiting to run or generating fails with :class:`UnknownSession` (its
        engine call cancelled). ``continued_in``: the session its rollout goes on in (a
        compacted context's branch), for the router's count of ended rollouts; ``expired``:
        ended for idling, its client gone, counted apart from them; ``idle_s``: how long it
        sat unused before this end, left out of its length
        (:meth:`Router.end_session <rollout.router.Router.end_session>`)."""
        session = self.session(session_id)
        check_end(session_id, continued_in, expired, idle_s)
        del self._sessions[session_id]
        session.closed = True
        if session._generating is not None:
            session._generating.cancel()
        self.router.end_session(session_id, continued_in, expired, idle_s, known=True)

    def check_ids(self, token_ids: Sequence[int], *, what: str) -> None:
        """Raise :class:`InvalidRequest` unless every id is an int in the vocabulary."""
        for i, t in enumerate(token_ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequest(f"{what}[{i}] is {t!r}, not an integer token id")
            if not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"{what}[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})")

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` for people and OpenAI clients (special tokens dropped)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def tool_text(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` that tool calls are parsed from: as :meth:`decode`, but the
        tool-call markers stay even where they are special tokens."""
        kept = [t for t in token_ids if t not in self._skipped_in_tool_text]
        return self.tokenizer.decode(kept, skip_special_tokens=False)
