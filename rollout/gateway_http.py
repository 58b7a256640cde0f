"""The gateway over HTTP: a token endpoint and OpenAI-compatible endpoints keyed by session.

An agent scaffold that only speaks the OpenAI API is pointed at this server with the
session id in the ``X-Treadle-Session`` header; every request is recorded token-exactly:

- ``/v1/chat/completions``: the request resends the whole conversation; the messages the
  session already holds are matched (never re-tokenized) and only the messages beyond
  them are appended as tokens through the chat template; a session holding tokens no message
  placed (a text prompt's, token ids) refuses the request. A message's content is text: a list
  of text parts is their texts joined by newlines (vLLM's reading); other parts are refused, as
  is a message of a role the chat template leaves out of the prompt (Qwen's drop ``developer``).
- ``/v1/completions``: a text prompt must extend the session's transcript (prompts plus
  returned completions); only the new suffix is encoded, and a session holding tokens no text
  prompt sent (a chat turn's, token ids) refuses it. A token-id prompt must extend
  the session's tokens. Either way a request retried after an error appends nothing twice.
- ``/v1/generate``: token ids in (appended verbatim), token ids, log-probs and versions out.
  The tokens stay appended when the generation fails, so a retry must not send them again.

A request to either OpenAI endpoint that repeats the one the session's last turn answered
(the same body: conversation or prompt, sampling, tools and all), with nothing added to the
session since, is a client's retry of a reply it never got (its timeout ran out while the turn
queued or generated; OpenAI clients retry timeouts themselves): it waits for that turn, gets
its reply again (text, tool calls, token ids, log-probs, finish reason, usage) and records
nothing. ``/v1/generate`` replays nothing: its request holds only the tokens to append, so a
retry cannot be told from a request that appends the same tokens again (or none, to go on
generating), and it is served as a new turn; a client must not resend one whose reply it lost.

With ``stream: true`` the two OpenAI endpoints answer in server-sent events once the turn
is generated: the whole text in one chunk, then the finish reason, the usage when
``stream_options.include_usage`` asks for it, and ``[DONE]``.

Tool definitions (``tools``) go into the session's first prompt through the chat template,
and each reply's tool calls are parsed out of the model's text (``rollout.tool_calls``) into
the message's ``tool_calls``, with ``finish_reason`` ``tool_calls``, as vLLM does with a
tool-call parser. A session keeps the tools of its first request; a resent assistant message
matches the one returned when its calls name the same functions with equal arguments.
``tool_choice`` may be ``auto`` or ``none`` (nothing parsed; also without tools, as vLLM
takes it); forcing a call would need constrained decoding, so ``required`` and a named
function are refused, as are the deprecated ``functions`` and ``function_call``, and
``parallel_tool_calls: false``: a reply's calls are all the ones the model wrote, which one
request cannot limit.

``chat_template_kwargs`` (vLLM's) are template variables over the run's
``GatewayConfig.chat_template_kwargs`` (Qwen3's ``enable_thinking`` …). A session keeps those
of its first request, as it keeps its tools: its prompt holds what they rendered, so a later
request that sends others (or none, after some) is refused. ``seed`` is honoured (on a
training server a request's, on every endpoint, is first hashed with its session and the
session's length when its turn starts: an agent program that sends one seed on every request
would otherwise sample every rollout alike, and each turn with the same random numbers). A request
that sends none, on a session the rollout service opened with a seed (``Session.seed``, its
request's), samples with that seed hashed with the session's length: a self-driving env's rollout
is reproducible from its seed, each call sampling with its own; ``n`` > 1,
stop strings (but the text of a token a turn stops at anyway, ``<|im_end|>`` say), a text
completion's ``logprobs`` > 0, and a field of :data:`NEUTRAL` (``add_generation_prompt``,
``continue_final_message``, ``skip_special_tokens``, ``stop_token_ids``, ``min_tokens``,
``top_logprobs``, ``top_k`` …) set to ask for something the gateway does not do are refused,
naming the field. A text completion's ``add_special_tokens`` (vLLM's; default true) is honoured
for the session's first prompt (false: a prompt that holds its own BOS); a chat request's must
be false, as the template writes them.

A request that leaves ``temperature`` or ``top_p`` unset samples at the server's
:class:`RunSampling` (a rollout service's: its config's). A server of training rollouts
refuses a request for others (beyond ``SAMPLING_REL_TOL``): the engines record log-probs of the distribution they sampled
from, and the trainer takes the policy's at the run's temperature over the whole vocabulary,
so a token sampled otherwise carries a log-prob its DIS ratio cannot be compared with.

A ``POST /v1/sessions`` that names its ``session_id`` and is sent again (the same fields, null
as left out) is a client's retry of a reply it never got: while the session it opened holds no
token and no record, it is answered as it was (even under backpressure) and opens nothing more.

``DELETE /v1/sessions/{id}`` ends a session unrecorded; ``?continued_in=<session id>`` names
the open session its rollout goes on in (a compacted context's branch), so that the router
counts the rollout once, from its first context's start to its last one's end
(:meth:`Router.end_session <rollout.router.Router.end_session>`). A session opened over
``POST /v1/sessions`` with no request in progress and none for over ``GatewayServer``'s
``idle_timeout_s`` (:data:`IDLE_TIMEOUT_S` by default; None: never) is ended so too, with a
line logged, and a later request naming it is told so in its 404: a harness that crashed
leaves no session pinned to its replica for the server's life. The router counts it as
expired rather than as an ended rollout (no record of it reaches the trainer), unless its
``POST /v1/sessions/{id}/record`` was answered: its harness holds the record, and it counts
as an ended rollout, as long as up to its last request's end (its idle time left out). One
still open when the server stops is ended so at the stop (after its drain), idle or not: no
harness can reach it any more. Sessions opened in-process (the rollout service's) are not
ended so: their opener closes each, and their pauses (a tool call, a test run) are bounded
by its rollout's timeout.

A server without ``session_admin`` (the rollout service's, whose token a self-driving env's program
holds) serves only the inference endpoints (``/v1/chat/completions``, ``/v1/completions``,
``/v1/generate``, ``/v1/models``) on the sessions opened in-process: opening, recording, writing
or closing one is a 403, as a session the program opened would generate past its rollout's
budget and seed and never reach its result.

Every endpoint but ``/health`` needs ``Authorization: Bearer <token>``. Errors are JSON
``{"error": {"message", "type", "code"}}``: 401 bad token, 403 session administration on a
server without it, 404 unknown (or idle-ended)
session, 400 bad input (a prompt past the context in OpenAI's words, with its code
``context_length_exceeded``, which harnesses match to end an episode; else the code is the
status), 413 a body over the server's limit, 503 engine failure, a write that
failed (nothing written) or a request the stop's drain cut (type ``server_stopping``), 429 (with
``Retry-After``) a new rollout while the server's ``backpressure`` says why it must wait (a
rollout worker's: the trainer lags). Only ``POST /v1/sessions`` is held back so, and not for a
branch whose parent's execution has an open session: a rollout under way goes on to its end, as
the worker's own rollouts in flight do. One the gateway refuses for its fields is a 400 first.

A server given somewhere to write (``GatewayServer``'s ``write``: a rollout worker's raw shards)
writes records for its harness: ``POST /v1/records`` takes every record of one execution and
writes them together (the processor joins an execution's rows within one shard), and
``"write": true`` on a record writes that record alone, for an execution of one trajectory.
Records are checked first (fields, ``storage.schema``'s checks, one execution id, no trajectory
written before by this server): a refused body writes nothing. A resend of a write whose reply
was lost is refused so, saying that the same records were written already.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import pyarrow as pa
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.exceptions import HTTPException

from envs.base import Id, Text
from rollout.engines.base import ContextLimit, EngineError, InvalidRequest, SamplingParams, mixed_seed
from rollout.gateway import (
    TIMING_KEYS,
    Gateway,
    Session,
    TurnResult,
    UnknownSession,
    check_text,
)
from rollout.http_server import (
    DRAIN_TIMEOUT_S,
    READ_TIMEOUT_S,
    UDS_MODE,
    AppServer,
    bad_body,
    bearer_matches,
    bearer_token,
)
from rollout.tool_calls import same_calls
from storage.redaction import redact
from storage.schema import (
    MAX_ERROR_CHARS,
    STATUSES,
    TRAJECTORY_SCHEMA,
    SchemaError,
    rows_with_errors,
    to_table,
)

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Treadle-Session"

IDLE_TIMEOUT_S = 1800.0
"""Default of :class:`GatewayServer`'s ``idle_timeout_s``: a harness may run a test suite or a
long tool call between two requests of a session (the rollout service gives a whole rollout
300 s), and one that crashed has its sessions ended within the half hour."""
RETRY_AFTER_S = 5
"""``Retry-After`` (seconds) of a session open refused for backpressure: what holds it back clears
as the trainer steps (a new weight version, a shorter queue), seconds apart at the least, and a
run's harnesses all waiting would otherwise ask many times a second."""
REMEMBERED_WRITES = 1 << 16
"""Trajectories written by a server whose ids it keeps, to refuse writing one again."""
REMEMBERED_EXPIRIES = 1 << 16
"""Sessions ended for idling whose ids a server keeps, to say so to a later request (404)."""

SAMPLING_REL_TOL = 1e-6
"""How far (relatively) a training request's temperature or top_p may be from the run's and
still count as the run's, then sampled at exactly the run's. Wide enough for a value that went
through float32 (6e-8) or a client's decimal formatting, narrow enough that a deliberately other
setting (0.70001 for 0.7 is 1.4e-5) is refused; a log-prob moves by about the relative change
times the spread of ``logits / temperature``, far inside DIS's masking bounds."""


@dataclass(frozen=True)
class RunSampling:
    """The sampling of the rollouts a server serves: a request that leaves ``temperature`` or
    ``top_p`` unset samples at these; with ``fixed`` (training rollouts) one that asks for
    others (beyond ``SAMPLING_REL_TOL``) is refused."""

    temperature: float = 1.0
    top_p: float = 1.0
    fixed: bool = False


class _Sampling(BaseModel):
    temperature: float | None = Field(
        None, description="Sampling temperature (finite, >= 1e-5); default: the run's."
    )
    top_p: float | None = Field(None, description="Nucleus mass in (0, 1]; default: the run's.")
    seed: int | None = Field(None, description="Seed of this request's sampler.")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # OpenAI clients send null for a parameter the caller left unset (temperature=None),
        # as the OpenAI API and vLLM take it: its default
        if isinstance(data, dict):
            return {
                key: value for key, value in data.items() if value is not None or key not in cls.model_fields
            }
        return data


class OpenSessionRequest(BaseModel):
    """Body of ``POST /v1/sessions``."""

    model_config = ConfigDict(extra="forbid")

    task: Id = Field(description="Environment name.")
    prompt_id: Id = Field(description="Prompt id within the task.")
    execution_id: Id | None = Field(
        None,
        description="Agent execution id; defaults to the parent's for a branch (parent_id), else to the "
        "trajectory id.",
    )
    trajectory_id: Id | None = Field(
        None,
        description="Trajectory id; generated when left out. One an open session of this gateway holds is "
        "refused: two records may not share it.",
    )
    group_id: Id | None = Field(None, description="Group id (group sampling only).")
    parent_id: Id | None = Field(None, description="Trajectory this one branched from.")
    branch_at: int | None = Field(
        None,
        ge=0,
        lt=2**31,
        description="Token index where this one diverged from its parent (with parent_id); where "
        "their tokens first differ when left out.",
    )
    session_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._:~-]{1,256}$",
        description="Session id (letters, digits and . _ : ~ -, as it goes in URL paths); generated when "
        "left out. One an open session holds is refused, but by the request that opened it sent again (the "
        "same fields, null as left out: a retry after its reply was lost), answered as it was while the "
        "session holds no token and no record.",
    )


class RecordRequest(BaseModel):
    """Body of ``POST /v1/sessions/{id}/record``."""

    model_config = ConfigDict(extra="forbid")

    reward: float | None = Field(None, description="Final reward.")
    progress: float | None = Field(None, description="Partial-progress score in [0, 1].")
    status: str | None = Field(None, description="ok, truncated, env_error, infra_error or timeout.")
    timing: dict[str, float] | None = Field(None, description="Seconds in init, run, eval, queue.")
    error: Text | None = Field(
        None,
        description=f"Why the rollout failed or was truncated, at most {MAX_ERROR_CHARS} characters "
        "(credentials in it are masked); refused with status ok, sent or defaulted.",
    )
    write: bool = Field(
        False,
        description="Also write the record into a raw shard of the server's run, as an execution of this "
        "one row; refused where the server writes nothing, or where another trajectory opened on it "
        "shares the execution (send the execution's records to POST /v1/records).",
    )

    @field_validator("timing")
    @classmethod
    def _seconds(cls, timing: dict[str, float] | None) -> dict[str, float] | None:
        for key, seconds in (timing or {}).items():
            if key not in TIMING_KEYS:
                raise ValueError(f"unknown entry {key!r}; expected some of {TIMING_KEYS}")
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"{key}={seconds} is not a finite number of seconds >= 0")
        return timing


class WriteRequest(BaseModel):
    """Body of ``POST /v1/records``."""

    model_config = ConfigDict(extra="forbid")

    records: list[dict[str, Any]] = Field(
        min_length=1,
        description="Every record of one execution (one execution_id), as POST /v1/sessions/{id}/record "
        "answered them: written together into one raw shard, where the processor joins them.",
    )


class TokenRequest(_Sampling):
    """Body of ``POST /v1/generate``."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[StrictInt] = Field(
        default_factory=list, description="New tokens appended before generating."
    )
    max_new_tokens: int | None = Field(None, ge=1, description="Token budget of this turn.")
    stop_ids: list[StrictInt] | None = Field(None, description="Token ids that end the action; default EOS.")


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CompletionRequest(_Sampling):
    """OpenAI ``/v1/completions`` body (the fields the gateway honours; others are checked
    against :data:`NEUTRAL`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # strict: a list holding "3" is a batch of text prompts to the OpenAI API, true no token id
    prompt: str | list[StrictInt]
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: int | None = None
    add_special_tokens: bool = Field(
        True,
        description="Whether the session's first text prompt is encoded with the tokenizer's special "
        "tokens (a BOS); false for a prompt that holds its own (vLLM's). A later prompt's suffix never is.",
    )


class ChatMessage(BaseModel):
    """One chat message; fields beyond ``role`` and ``content`` go to the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | None = Field(
        None,
        description="Text; a list of text parts is read as their texts joined by newlines, as vLLM reads "
        "it for a text model's template. Other parts (images, audio, files) are refused.",
    )

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_joined(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"content part {i} (type {kind!r}) is no text part with a string 'text': the gateway "
                    "takes text only"
                )
            texts.append(part["text"])
        return "\n".join(texts)


class FunctionDefinition(BaseModel):
    """An OpenAI function definition; fields beyond these go to the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Function name (as OpenAI allows).")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments object.")


class ToolDefinition(BaseModel):
    """One entry of an OpenAI ``tools`` list."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class ChatRequest(_Sampling):
    """OpenAI ``/v1/chat/completions`` body (the fields the gateway honours; others are checked
    against :data:`NEUTRAL`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="Template variables over the run's (vLLM's); a session keeps those of its first request.",
    )


NEUTRAL: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "echo": (False,),
    "suffix": (),
    "chat_template": (),
    "documents": (),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "stop_token_ids": ([],),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "top_k": (-1, 0),
    "min_p": (0,),
    "repetition_penalty": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "logits_processors": (),
    "top_logprobs": (0,),
    "prompt_logprobs": (),
    "best_of": (1,),
    "use_beam_search": (False,),
    "response_format": ({"type": "text"},),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "truncate_prompt_tokens": (),
    "return_tokens_as_token_ids": (False,),
    "reasoning_effort": (),
    "add_special_tokens": (False,),
    "parallel_tool_calls": (True,),
    "function_call": (),
    "max_completion_tokens": (),  # a chat request's field; a text completion's budget is max_tokens
}
"""vLLM's (and OpenAI's) request fields the gateway does not do, with the values (besides
null) that ask for nothing it does not do; any other value is refused, naming the field.
Fields outside this table and the request models (``user``, ``metadata`` …) are ignored, as
vLLM ignores the fields it does not know."""


def _error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, kind), status, headers=headers)


def _error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """The gateway's (OpenAI's) error shape; ``kind`` defaults by ``status``, for the errors the
    server answers outside the app (a body over the limit, a request the stop's drain cut)."""
    kind = kind or ("server_stopping" if status == 503 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": status}}


class _Unauthorized(Exception):
    pass


class _NoSessionAdmin(Exception):
    pass


INFERENCE = "/v1/chat/completions, /v1/completions, /v1/generate and /v1/models"
"""The endpoints a server without session administration serves (besides ``/health``)."""


_ID = TypeAdapter(Id)


def _query_id(name: str, value: str) -> str:
    """``value`` of query parameter ``name`` if it is an :data:`envs.base.Id`, else
    :class:`InvalidRequest` saying why."""
    try:
        return _ID.validate_python(value)
    except ValidationError as exc:
        (error,) = exc.errors()
        raise InvalidRequest(f"{name} {value!r}: {error.get('ctx', {}).get('error', error['msg'])}") from None


@dataclass
class _Activity:
    session: Session
    since: float
    """When its last request ended (or it opened)."""
    requests: int = 0
    """Its requests in progress (a turn queued or generating, a record …)."""
    close_failed: bool = False
    """Whether a sweep's close of it raised (logged once; each later round tries again)."""
    recorded: bool = False
    """Whether a record of it was answered: its harness holds what the trainer learns from."""
    opened_with: dict[str, Any] = field(default_factory=dict)
    """The fields of the ``POST /v1/sessions`` that opened it, to know that request's retry."""


@dataclass
class IdleSessions:
    """The sessions opened over HTTP (``POST /v1/sessions``), each ended by :meth:`sweep` as
    ``DELETE`` ends it once it has had no request in progress, and none for over
    ``idle_timeout_s`` seconds (None: never) since its last one ended: a harness that crashed
    or forgot leaves none pinned to its replica (a live session for the worker's status and the
    elastic controller) for the server's life. One whose record was answered counts as an ended
    rollout, as long as up to its last request's end; any other as expired (no record of it
    reaches the trainer). :meth:`end_all` ends those still open so at the server's stop.
    Sessions opened in-process (the rollout service's, which it always closes) are never ended
    here. ``clock`` gives seconds (monotonic)."""

    gateway: Gateway
    idle_timeout_s: float | None
    clock: Callable[[], float] = time.monotonic
    _open: dict[str, _Activity] = field(default_factory=dict)
    _expired: OrderedDict[str, float] = field(default_factory=OrderedDict)
    """Idle seconds of the last :data:`REMEMBERED_EXPIRIES` sessions ended here, by id."""

    def __post_init__(self) -> None:
        if self.idle_timeout_s is not None and not (
            math.isfinite(self.idle_timeout_s) and self.idle_timeout_s > 0
        ):
            raise ValueError(
                f"idle_timeout_s={self.idle_timeout_s} is not a finite number of seconds > 0 (None: never end "
                "a session for idling)"
            )

    @property
    def sweep_every_s(self) -> float:
        """Seconds between two sweeps of :meth:`run`: a session is ended at most this late (and
        one closed otherwise let go)."""
        return 15.0 if self.idle_timeout_s is None else min(self.idle_timeout_s / 4, 15.0)

    def opened(self, session: Session, request: OpenSessionRequest) -> None:
        """Track ``session``, just opened over HTTP by ``request`` (idle from now)."""
        self._expired.pop(session.session_id, None)
        self._open[session.session_id] = _Activity(session, self.clock(), opened_with=request.model_dump())

    def retried(self, request: OpenSessionRequest) -> Session | None:
        """The open session ``request`` opened already, if it is that open's retry (its reply was
        lost): the same fields, for a session still as it opened (no token, no record answered),
        which no harness can have used yet."""
        activity = self._open.get(request.session_id) if request.session_id else None
        if (
            activity is None
            or activity.session.closed
            or activity.session.tokens
            or activity.recorded
            or activity.opened_with != request.model_dump()
        ):
            return None
        activity.since = self.clock()
        return activity.session

    @contextlib.contextmanager
    def request(self, session_id: str | None) -> Iterator[None]:
        """A request naming ``session_id``: it is not idle until the request ends."""
        activity = self._open.get(session_id) if session_id else None
        if activity is None:
            yield
            return
        activity.requests += 1
        try:
            yield
        finally:
            activity.requests -= 1
            activity.since = self.clock()

    def recorded(self, session_id: str) -> None:
        """``session_id``'s record was answered (if it is a session opened over HTTP)."""
        activity = self._open.get(session_id)
        if activity is not None:
            activity.recorded = True

    def idle_for(self, session_id: str) -> float | None:
        """Seconds since ``session_id``'s last request ended (or it opened); None while it has
        one in progress, or when it is no session opened over HTTP that is still open."""
        activity = self._open.get(session_id)
        if activity is None or activity.session.closed or activity.requests:
            return None
        return self.clock() - activity.since

    def why_closed(self, session_id: str | None) -> str | None:
        """Why ``session_id`` is closed, if :meth:`sweep` ended it."""
        idle = self._expired.get(session_id) if session_id else None
        if idle is None:
            return None
        return (
            f"session {session_id!r} was closed after {idle:.1f} s idle (no request for over "
            f"idle_timeout_s={self.idle_timeout_s:g} s); open a new one"
        )

    def sweep(self) -> list[str]:
        """End the sessions idle for over ``idle_timeout_s``; returns their ids. A session whose
        close raises is logged (once) and left for the next sweep; the others are ended."""
        ended = []
        for session_id, activity in list(self._open.items()):
            if activity.session.closed:  # deleted, or closed in-process
                del self._open[session_id]
                continue
            idle = self.idle_for(session_id)
            if idle is None or self.idle_timeout_s is None or idle <= self.idle_timeout_s:
                continue
            try:
                self.gateway.close(session_id, expired=not activity.recorded, idle_s=idle)
            except Exception as exc:  # one session's failure must not keep the others open
                if not activity.close_failed:
                    activity.close_failed = True
                    logger.error(
                        "could not close session %r idle for %.1f s (%s); the sweep tries it again each round",
                        session_id,
                        idle,
                        _why(exc),
                    )
                continue
            del self._open[session_id]
            self._expired[session_id] = idle
            if len(self._expired) > REMEMBERED_EXPIRIES:
                self._expired.popitem(last=False)
            logger.warning(
                "closed session %r after %.1f s idle (idle_timeout_s=%g)",
                session_id,
                idle,
                self.idle_timeout_s,
            )
            ended.append(session_id)
        return ended

    def end_all(self) -> None:
        """End the sessions still open, counted as :meth:`sweep` counts them: the server stopped,
        and no request can reach them (their harness cannot end them) to release their replicas."""
        ended = 0
        for session_id, activity in list(self._open.items()):
            idle = self.idle_for(session_id) or 0.0
            del self._open[session_id]
            if activity.session.closed:
                continue
            try:
                self.gateway.close(session_id, expired=not activity.recorded, idle_s=idle)
            except Exception as exc:  # one session's failure must not keep the others open
                logger.error("could not close session %r at the server's stop (%s)", session_id, _why(exc))
                continue
            ended += 1
        if ended:
            logger.info("closed %d sessions still open at the server's stop", ended)

    async def run(self) -> None:
        """:meth:`sweep` every :attr:`sweep_every_s` seconds, until cancelled. A sweep that
        raises is logged, once until one succeeds, and the next one runs: a task that ended
        on it would leave every later idle session open for the server's life."""
        failing = False
        while True:
            await asyncio.sleep(self.sweep_every_s)
            try:
                self.sweep()
            except Exception as exc:
                if not failing:
                    logger.error(
                        "the idle-session sweep failed (%s); it runs again every %g s",
                        _why(exc),
                        self.sweep_every_s,
                    )
                failing = True
            else:
                failing = False


def _why(exc: Exception) -> str:
    """``exc`` in one line for a log, credentials masked (``storage.redaction.redact``)."""
    return f"{type(exc).__name__}: {redact(str(exc))}"


class NotWritten(Exception):
    """A :class:`RecordSink`'s ``write`` failed, keeping none of the records."""


@dataclass
class RecordSink:
    """Writes an execution's records through ``write`` (a table of ``storage.schema``'s
    trajectory records, which must land in one raw shard: a rollout worker's shard writer's
    ``write_table``), once they are checked: a body refused here writes nothing. A trajectory it
    wrote already (among the last :data:`REMEMBERED_WRITES`) is refused: a retry of a write
    whose answer was lost would otherwise train it twice; the refusal says whether the written
    record is the one sent again. ``write`` raises only when the
    records will not be committed (:class:`NotWritten`, 503: the harness may send them again);
    a writer that keeps them for a later commit when this one fails must not raise."""

    write: Callable[[pa.Table], Any]
    _written: OrderedDict[str, bytes] = field(default_factory=OrderedDict)
    """A digest of each trajectory written, by id (:func:`_digest`)."""

    def execution(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Check ``records`` (one execution's) and write them; raises :class:`InvalidRequest` saying
        what is wrong."""
        for i, record in enumerate(records):
            unknown = sorted(set(record) - set(TRAJECTORY_SCHEMA.names))
            if unknown:
                raise InvalidRequest(
                    f"record {i}: unknown fields {unknown}; send records as the record endpoint answers them"
                )
            timing = record.get("timing")
            # the table's timing struct would drop them without a word
            unknown = sorted(set(timing) - set(TIMING_KEYS)) if isinstance(timing, dict) else []
            if unknown:
                raise InvalidRequest(
                    f"record {i}: unknown timing entries {unknown}; expected some of {TIMING_KEYS}"
                )
        try:
            table = to_table(records)
            problems = rows_with_errors(table)
        except SchemaError as exc:
            raise InvalidRequest(f"the records do not fit the trajectory schema: {exc}") from None
        if problems:
            row, what = next(iter(problems.items()))
            raise InvalidRequest(
                f"record {row}: {'; '.join(what)}"
                + (f" (and {len(problems) - 1} more records)" if len(problems) > 1 else "")
            )
        executions = sorted(set(table.column("execution_id").to_pylist()))
        if len(executions) > 1:
            raise InvalidRequest(
                f"the records hold executions {executions}: write each execution by itself, all its records "
                "in one request (the processor joins an execution's rows within one shard)"
            )
        ids = table.column("trajectory_id").to_pylist()
        repeated = sorted(tid for tid, count in Counter(ids).items() if count > 1)
        if repeated:
            raise InvalidRequest(f"trajectory ids {repeated} repeat: two records may not share one")
        digests = dict(zip(ids, map(_digest, table.to_pylist()), strict=True))
        again = [tid for tid in ids if tid in self._written]
        if again:
            changed = [tid for tid in again if self._written[tid] != digests[tid]]
            if len(again) == len(ids) and not changed:
                raise InvalidRequest(
                    f"these records (trajectories {again}) were written already, by an earlier request of "
                    "the same records; a resend writes them no more"
                )
            raise InvalidRequest(
                f"trajectories {again} were written already by an earlier request"
                + (f", {changed} with other contents than these" if changed else "")
                + "; this request wrote nothing"
            )
        try:
            self.write(table)
        except Exception as exc:
            raise NotWritten(f"nothing of this request was written ({_why(exc)}); send it again") from exc
        self._written.update(digests)
        while len(self._written) > REMEMBERED_WRITES:
            self._written.popitem(last=False)
        return {"written": len(ids), "execution_id": executions[0]}


def _digest(record: dict[str, Any]) -> bytes:
    """A 16-byte digest of ``record`` (a row of a trajectory table) that tells it from another."""
    return hashlib.blake2b(json.dumps(record, sort_keys=True).encode(), digest_size=16).digest()


def create_app(
    gateway: Gateway,
    token: str,
    model_name: str = "treadle-policy",
    sampling: RunSampling | None = None,
    idle: IdleSessions | None = None,
    sink: RecordSink | None = None,
    backpressure: Callable[[], str | None] | None = None,
    session_admin: bool = True,
) -> FastAPI:
    """The FastAPI app serving ``gateway`` at ``sampling`` (default: temperature and top_p 1,
    not fixed); requests must carry ``Bearer token``. The sessions it opens are given to
    ``idle``, which is told of every request naming one (whoever sweeps it ends them). The
    records it is asked to write go to ``sink``; without one such a request is refused. While
    ``backpressure`` answers why (not None), a new rollout is refused with a 429, counted in
    ``app.state.sessions_refused``. Without ``session_admin`` it serves only the inference
    endpoints, on sessions opened in-process: opening, recording, writing or closing one is a 403."""
    sampling = sampling or RunSampling()
    if not token:
        raise ValueError("the gateway needs a non-empty bearer token")
    # no OpenAPI schema nor docs pages: they would answer without the token
    app = FastAPI(title="treadle TITO gateway", openapi_url=None)
    app.state.sessions_refused = 0
    created = int(time.time())
    expected = token.encode()

    def authorized(authorization: str | None) -> bool:
        return bearer_matches(authorization, expected)

    def authorize(authorization: str | None = Header(None)) -> None:
        if not authorized(authorization):
            raise _Unauthorized

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(request: Request, exc: _Unauthorized):
        return _error(
            401, "authentication_error", "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}
        )

    def administer() -> None:
        if not session_admin:
            raise _NoSessionAdmin

    @app.exception_handler(_NoSessionAdmin)
    async def _no_session_admin(request: Request, exc: _NoSessionAdmin):
        return _error(
            403,
            "permission_error",
            f"{request.method} {request.url.path} is session administration, which this server does not "
            f"serve: it serves only the inference endpoints ({INFERENCE}), on the session you were "
            f"handed (named in the {SESSION_HEADER} header)",
        )

    def named(request: Request) -> str | None:
        """The session a request names (in its path, else its header)."""
        return request.path_params.get("session_id") or request.headers.get(SESSION_HEADER)

    @app.exception_handler(UnknownSession)
    async def _unknown(request: Request, exc: UnknownSession):
        why = idle.why_closed(named(request)) if idle is not None else None
        return _error(404, "not_found_error", why or str(exc))

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest):
        return _error(400, "invalid_request_error", str(exc))

    @app.exception_handler(ContextLimit)
    async def _context_limit(request: Request, exc: ContextLimit):
        # OpenAI's words and code, which harnesses match to end an episode rather than fail it
        # (litellm's ContextWindowExceededError: "This model's maximum context length is")
        body = _error_body(400, f"This model's maximum context length is exceeded: {exc}")
        body["error"]["code"] = "context_length_exceeded"
        return JSONResponse(body, 400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        # FastAPI's own (an unknown path, a body over the limit while it is read) in the gateway's shape.
        # An unknown path is a client of another API (Responses) or a mistyped URL: told what is served
        # when it holds the token (the API is not described to anyone who can connect, as /docs is not)
        if exc.status_code == 404 and authorized(request.headers.get("authorization")):
            return _error(
                404,
                "not_found_error",
                f"{request.method} {request.url.path} is not served: the gateway serves "
                + (
                    "the OpenAI API's /v1/chat/completions, /v1/completions and /v1/models, and "
                    "/v1/sessions, /v1/generate and /v1/records"
                    if session_admin
                    else INFERENCE
                ),
                exc.headers,
            )
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, kind, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return _error(400, "invalid_request_error", bad_body(exc))

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError):
        return _error(503, "engine_unavailable", f"engine failure: {redact(str(exc))}")

    @app.exception_handler(NotWritten)
    async def _not_written(request: Request, exc: NotWritten):
        return _error(503, "write_unavailable", str(exc))

    class InProgress(APIRoute):
        """A route whose authorized request keeps the session it names from idling from when
        it is routed, before its body is read (a slow one would otherwise leave the sweep a
        gap), until its response is made."""

        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handle = super().get_route_handler()

            async def tracked(request: Request) -> Response:
                own = authorized(request.headers.get("authorization"))
                with idle.request(named(request) if own else None):
                    return await handle(request)

            return tracked

    if idle is not None:
        app.router.route_class = InProgress
    auth = [Depends(authorize)]
    admin = [*auth, Depends(administer)]  # the token's check first: a 401 before a 403

    def session_of(session_id: str | None) -> Session:
        if not session_id:
            raise InvalidRequest(f"missing {SESSION_HEADER} header naming the session")
        return gateway.session(session_id)

    def params(
        body: _Sampling,
        max_new_tokens: int | None,
        stop_ids: list[StrictInt] | None = None,
        session: Session | None = None,
    ) -> SamplingParams | Callable[[], SamplingParams]:
        temperature = sampling.temperature if body.temperature is None else body.temperature
        top_p = sampling.top_p if body.top_p is None else body.top_p
        if sampling.fixed:
            asked, run = (temperature, top_p), (sampling.temperature, sampling.top_p)
            if not all(math.isclose(a, r, rel_tol=SAMPLING_REL_TOL) for a, r in zip(asked, run, strict=True)):
                raise InvalidRequest(
                    f"temperature {temperature}, top_p {top_p}: a training rollout samples at the run's "
                    f"temperature {sampling.temperature} and top_p {sampling.top_p}, which the trainer's "
                    "log-probs assume; leave temperature and top_p unset or send these"
                )
            temperature, top_p = run
        stop = tuple(stop_ids) if stop_ids is not None else gateway.stop_ids
        gateway.check_ids(stop, what="stop_ids")
        asked = SamplingParams(
            max_new_tokens=gateway.config.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_ids=stop,
            seed=body.seed,
        )
        # made by the turn under the session's lock: two requests waiting on one turn would
        # otherwise hash the same length
        if sampling.fixed and session is not None and body.seed is not None:
            return lambda: replace(asked, seed=_session_seed(body.seed, session))
        if session is not None and body.seed is None and session.seed is not None:
            return lambda: replace(asked, seed=mixed_seed(session.seed, len(session.tokens)))
        return asked

    def openai_only(body: CompletionRequest | ChatRequest) -> None:
        if isinstance(body, ChatRequest):
            _check_tool_fields(body)
        if body.n != 1:
            raise InvalidRequest(f"n={body.n}: the gateway samples one choice per request")
        if body.stop:
            # the text of a token the turn stops at anyway (a client's stop=["<|im_end|>"]) asks nothing
            stops = [body.stop] if isinstance(body.stop, str) else body.stop
            ends = sorted(
                {gateway.tokenizer.decode([t], skip_special_tokens=False) for t in gateway.stop_ids}
                if gateway.tokenizer
                else ()
            )
            if not set(stops) <= set(ends):
                raise InvalidRequest(
                    f"stop={body.stop!r}: stop strings are not supported, the gateway stops at token ids only"
                    + (f" (it stops at the tokens of {ends}, which stop may name)" if ends else "")
                )
        if isinstance(body, CompletionRequest) and body.logprobs:
            raise InvalidRequest(
                f"logprobs={body.logprobs}: the engines return the log-prob of the sampled token only; "
                "send logprobs 0"
            )
        for name, value in (body.model_extra or {}).items():
            if name in NEUTRAL and value is not None and value not in NEUTRAL[name]:
                stop_ids = name == "stop_token_ids" and isinstance(value, list)
                if stop_ids and all(token in gateway.stop_ids for token in value):
                    continue
                raise InvalidRequest(
                    f"{name}={value!r} is not supported by the gateway: leave it unset"
                    + (f" or send {NEUTRAL[name][0]!r}" if NEUTRAL[name] else "")
                    + (f" (it stops at token ids {list(gateway.stop_ids)})" if stop_ids else "")
                )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "replicas": len(gateway.router.replicas)}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        model = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "treadle",
            "max_model_len": gateway.config.max_context_tokens,
        }
        return {"object": "list", "data": [model]}

    def opened(session: Session) -> dict[str, Any]:
        info = session.info
        return {
            "session_id": info.session_id,
            "trajectory_id": info.trajectory_id,
            "execution_id": info.execution_id,
        }

    @app.post("/v1/sessions", dependencies=admin)
    async def open_session(body: OpenSessionRequest) -> Any:
        retried = idle.retried(body) if idle is not None else None
        if retried is not None:
            return opened(retried)
        gateway.check_open(**body.model_dump())  # a bad request is no rollout held back
        why = backpressure() if backpressure is not None else None
        if why is not None and (body.parent_id is None or not gateway.in_open_rollout(body.parent_id)):
            app.state.sessions_refused += 1
            return _error(
                429,
                "rate_limit_error",
                f"no new rollout opens while the trainer lags ({why}); retry after {RETRY_AFTER_S} s "
                "(the turns and branches of open rollouts are served meanwhile)",
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        session = gateway.open(**body.model_dump())
        if idle is not None:
            idle.opened(session, body)
        return opened(session)

    def writing() -> RecordSink:
        if sink is None:
            raise InvalidRequest("this server writes no records: write them into a raw shard yourself")
        return sink

    @app.post("/v1/records", dependencies=admin)
    async def write_records(body: WriteRequest) -> dict[str, Any]:
        return writing().execution(body.records)

    @app.post("/v1/sessions/{session_id}/record", dependencies=admin)
    async def record(session_id: str, body: RecordRequest) -> dict[str, Any]:
        session = gateway.session(session_id)
        if body.write:
            writing()
            info = session.info
            if gateway.execution_size(info.execution_id) > 1:
                others = [t for t in gateway.trajectories_of(info.execution_id) if t != info.trajectory_id]
                raise InvalidRequest(
                    f"execution {info.execution_id!r} also holds trajectories {others}: record each without "
                    "write and send the execution's records together to POST /v1/records"
                )
        if (
            body.error is not None
            and (session.default_status if body.status is None else body.status) == "ok"
        ):
            said = (
                "status ok" if body.status else "status ok (the default: its last action was not truncated)"
            )
            others = ", ".join(status for status in STATUSES if status != "ok")
            raise InvalidRequest(
                f"{said} with an error: an ok rollout has none; send the status the error explains "
                f"({others}) or leave error out"
            )
        try:
            record = session.record(**body.model_dump(exclude={"write"}))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        if body.write:
            sink.execution([record])
        if idle is not None:
            idle.recorded(session_id)
        return record

    @app.delete("/v1/sessions/{session_id}", dependencies=admin)
    async def close_session(session_id: str, continued_in: str | None = None) -> dict[str, Any]:
        if continued_in is not None:
            _query_id("continued_in", continued_in)
        gateway.session(session_id)
        if continued_in == session_id:
            raise InvalidRequest(f"session {session_id!r} cannot continue in itself")
        if continued_in is not None and continued_in not in gateway.sessions:
            why = idle.why_closed(continued_in) if idle is not None else None
            raise InvalidRequest(
                f"continued_in {continued_in!r} is no open session: "
                + (why or "open the one the rollout goes on in before deleting this one")
            )
        gateway.close(session_id, continued_in)
        return {"closed": session_id}

    @app.post("/v1/generate", dependencies=auth)
    async def generate(body: TokenRequest, x_treadle_session: str | None = Header(None)) -> dict[str, Any]:
        session = session_of(x_treadle_session)
        sampling = params(body, body.max_new_tokens, body.stop_ids, session)
        turn = await session.generate(
            sampling, prepare=(lambda: session.add_tokens(body.token_ids)) if body.token_ids else None
        )
        return {
            "token_ids": turn.token_ids,
            "logprobs": turn.logprobs,
            "versions": turn.versions,
            "finish_reason": turn.finish_reason,
            "prompt_tokens": turn.prompt_tokens,
            "cached_tokens": turn.cached_tokens,
            "engine": turn.engine,
            "num_tokens": len(session.tokens),
        }

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, x_treadle_session: str | None = Header(None)) -> Any:
        session = session_of(x_treadle_session)
        openai_only(body)
        sampling = params(body, body.max_tokens, session=session)

        async def prepare() -> None:
            if isinstance(body.prompt, list):
                _append_token_prompt(gateway, session, body.prompt)
            else:
                await _append_text_prompt(gateway, session, body.prompt, body.add_special_tokens)

        turn = await session.generate(sampling, prepare=prepare, request=body)
        if isinstance(body.prompt, str):
            # no await since the turn released the session: the next request sees this (a
            # replayed turn leaves it as the original turn did)
            session.keep_transcript(body.prompt + turn.text)
        choice: dict[str, Any] = {
            "index": 0,
            "text": turn.text,
            "finish_reason": turn.finish_reason,
            "token_ids": turn.token_ids,
            "logprobs": _completion_logprobs(gateway, turn) if body.logprobs is not None else None,
        }
        return _answer(body, _response("text_completion", model_name, choice, session, turn))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatRequest, x_treadle_session: str | None = Header(None)) -> Any:
        session = session_of(x_treadle_session)
        openai_only(body)
        sampling = params(
            body,
            body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens,
            session=session,
        )
        messages = [message.model_dump(exclude_unset=True) for message in body.messages]
        tools = [tool.model_dump(exclude_unset=True) for tool in body.tools] if body.tools else None
        turn = await session.generate(
            sampling,
            prepare=lambda: session.add_messages(
                _new_messages(session, messages), tools, body.chat_template_kwargs
            ),
            parse_tool_calls=body.tool_choice != "none",
            request=body,
        )
        choice = {
            "index": 0,
            "message": turn.message,
            "finish_reason": "tool_calls" if "tool_calls" in turn.message else turn.finish_reason,
            "token_ids": turn.token_ids,
            "logprobs": _chat_logprobs(gateway, turn) if body.logprobs else None,
        }
        return _answer(body, _response("chat.completion", model_name, choice, session, turn))

    return app


def _answer(body: CompletionRequest | ChatRequest, response: dict[str, Any]) -> Any:
    """``response`` as it is, or as server-sent events when the request streams."""
    if not body.stream:
        return response
    usage = body.stream_options is not None and body.stream_options.include_usage
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in _chunks(response, usage)]
    return StreamingResponse(iter([*events, "data: [DONE]\n\n"]), media_type="text/event-stream")


def _chunks(response: dict[str, Any], usage: bool) -> Iterator[dict[str, Any]]:
    """A whole completion as OpenAI stream chunks: its text (with the token ids and
    log-probs) in one, its finish reason in the next, then the usage when asked for."""
    (choice,) = response["choices"]
    chat = response["object"] == "chat.completion"
    head = {key: response[key] for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    first = {key: value for key, value in choice.items() if key not in ("message", "finish_reason")}
    if chat:
        first["delta"] = dict(choice["message"])
        if "tool_calls" in first["delta"]:
            first["delta"]["tool_calls"] = [
                {"index": i, **call} for i, call in enumerate(first["delta"]["tool_calls"])
            ]
    yield {**head, "choices": [first | {"finish_reason": None}]}
    last = {"delta": {}} if chat else {"text": ""}
    yield {**head, "choices": [{"index": 0, **last, "finish_reason": choice["finish_reason"]}]}
    if usage:
        yield {**head, "choices": [], "usage": response["usage"]}


def _response(
    kind: str, model: str, choice: dict[str, Any], session: Session, turn: TurnResult
) -> dict[str, Any]:
    prompt_tokens = len(session.tokens) - len(turn.token_ids)
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(turn.token_ids),
            "total_tokens": len(session.tokens),
        },
    }


def _session_seed(seed: int, session: Session) -> int:
    """A client's sampling ``seed`` made its session's and its turn's: a 64-bit hash of the
    seed, the session's trajectory id and its length so far."""
    return mixed_seed(seed, session.info.trajectory_id, len(session.tokens))


def _check_tool_fields(body: ChatRequest) -> None:
    if body.functions:
        raise InvalidRequest("functions is the deprecated form of tools: send tools")
    if body.tool_choice is None or body.tool_choice in ("auto", "none"):
        if body.tool_choice == "auto" and not body.tools:  # "none" asks for nothing, as vLLM reads it
            raise InvalidRequest("tool_choice 'auto' without tools")
        return
    raise InvalidRequest(
        f"tool_choice {body.tool_choice!r} is not supported: forcing a tool call needs constrained "
        "decoding, which the gateway does not do; send auto or none"
    )


def _same_message(seen: dict[str, Any], sent: dict[str, Any]) -> bool:
    return (
        seen.get("role") == sent.get("role")
        and (seen.get("content") or "").strip() == (sent.get("content") or "").strip()
        and same_calls(seen.get("tool_calls"), sent.get("tool_calls"))
    )


def _new_messages(session: Session, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages beyond what ``session`` holds; the rest must match its history, which must
    stand for all its tokens."""
    if unseen := len(session.tokens) - session.message_tokens:
        raise InvalidRequest(
            f"session {session.session_id!r} holds {unseen} tokens no chat message placed (a text or "
            "token-id prompt, or /v1/generate), so the conversation cannot be checked against its "
            "context; use another session"
        )
    history = session.messages
    nothing_new = len(messages) == len(history) and bool(history) and history[-1].get("role") == "assistant"
    if len(messages) < len(history) or nothing_new:
        raise InvalidRequest(
            f"the request holds {len(messages)} messages and the session already has {len(history)}; "
            "send the whole conversation with its new messages"
        )
    for i, (seen, sent) in enumerate(zip(history, messages, strict=False)):
        if not _same_message(seen, sent):
            raise InvalidRequest(
                f"message {i} ({sent.get('role')!r}) differs from the session's history; "
                "a session's conversation can only grow"
            )
    return messages[len(history) :]


async def _append_text_prompt(
    gateway: Gateway, session: Session, prompt: str, add_special_tokens: bool = True
) -> None:
    """Append the tokens of what ``prompt`` adds to the session's transcript, which becomes
    ``prompt`` before the generation: a retry after a failed one appends nothing again. The
    session's first prompt is encoded with the tokenizer's special tokens when
    ``add_special_tokens``; a later suffix never is."""
    if gateway.tokenizer is None:
        raise InvalidRequest("this gateway has no tokenizer; send the prompt as token ids")
    check_text(prompt, "the prompt")
    if not session.tokens:
        if not prompt:
            raise InvalidRequest("empty prompt")
        session.add_tokens(
            await session.tokenized(
                len(prompt),
                "prompt was tokenized",
                gateway.tokenizer.encode,
                prompt,
                add_special_tokens=add_special_tokens,
            )
        )
    elif suffix := session.text_suffix(prompt):
        session.add_tokens(
            await session.tokenized(
                len(suffix),
                "prompt was tokenized",
                gateway.tokenizer.encode,
                suffix,
                add_special_tokens=False,
            )
        )
    session.keep_transcript(prompt)


def _append_token_prompt(gateway: Gateway, session: Session, prompt: list[int]) -> None:
    held = session.tokens
    if not prompt:
        raise InvalidRequest("empty prompt")
    if prompt[: len(held)] != held:
        raise InvalidRequest("the token prompt does not extend the session's tokens")
    if len(prompt) > len(held):
        session.add_tokens(prompt[len(held) :])


def _token_strings(gateway: Gateway, turn: TurnResult) -> list[str]:
    if gateway.tokenizer is None:
        return [f"token_id:{t}" for t in turn.token_ids]
    return [gateway.tokenizer.decode([t], skip_special_tokens=False) for t in turn.token_ids]


def _completion_logprobs(gateway: Gateway, turn: TurnResult) -> dict[str, Any]:
    return {"tokens": _token_strings(gateway, turn), "token_logprobs": turn.logprobs, "top_logprobs": None}


def _chat_logprobs(gateway: Gateway, turn: TurnResult) -> dict[str, Any]:
    return {
        "content": [
            {"token": s, "logprob": lp, "top_logprobs": []}
            for s, lp in zip(_token_strings(gateway, turn), turn.logprobs, strict=True)
        ]
    }


class GatewayServer(AppServer):
    """Serves a gateway on 127.0.0.1 (``port=0`` picks a free port) or a Unix domain socket
    (``uds``, made with ``uds_mode``; clients use ``http://gateway``) at ``sampling``. The
    bearer token is generated when not given; read it from ``.token``. A session opened over
    HTTP with no request for over ``idle_timeout_s`` seconds is ended (:class:`IdleSessions`);
    None keeps it until it is deleted or the server stops (:meth:`stop` ends those still open).
    With ``write`` (see :class:`RecordSink`) it writes the records it is asked to. While
    ``backpressure`` answers why a new rollout must wait for the trainer (not None),
    ``POST /v1/sessions`` of one is refused with a 429 (see the module docstring). Without
    ``session_admin`` (a server handed to programs that must use only the session they were
    given) it opens, records, writes and closes no session: those requests are a 403."""

    def __init__(
        self,
        gateway: Gateway,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        uds: str | None = None,
        uds_mode: int = UDS_MODE,
        token: str | None = None,
        model_name: str = "treadle-policy",
        sampling: RunSampling | None = None,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_connections: int | None = None,
        idle_timeout_s: float | None = IDLE_TIMEOUT_S,
        write: Callable[[pa.Table], Any] | None = None,
        backpressure: Callable[[], str | None] | None = None,
        session_admin: bool = True,
    ):
        self.token = bearer_token(token)
        self.idle = IdleSessions(gateway, idle_timeout_s)
        self._sweeping: asyncio.Task | None = None
        super().__init__(
            create_app(
                gateway,
                self.token,
                model_name,
                sampling,
                self.idle,
                RecordSink(write) if write else None,
                backpressure,
                session_admin,
            ),
            host=host,
            port=port,
            uds=uds,
            uds_mode=uds_mode,
            name="gateway",
            drain_timeout_s=drain_timeout_s,
            read_timeout_s=read_timeout_s,
            max_connections=max_connections,
            token=self.token,
            error_body=_error_body,
        )

    @property
    def sessions_refused(self) -> int:
        """New rollouts refused with a 429 for backpressure since the server was made."""
        return self.app.state.sessions_refused

    async def start(self):
        await super().start()
        self._sweeping = asyncio.create_task(self.idle.run())
        return self

    async def stop(self) -> None:
        """Stop serving (see :meth:`AppServer.stop`), then end the sessions opened over it that
        are still open (:meth:`IdleSessions.end_all`): no harness can reach them any more."""
        if self._sweeping is not None:
            self._sweeping.cancel()
            await asyncio.gather(self._sweeping, return_exceptions=True)
            self._sweeping = None
        await super().stop()
        self.idle.end_all()
