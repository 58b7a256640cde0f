"""The gateway's HTTP server end to end: a real uvicorn server on 127.0.0.1 (and on a Unix
socket), a real httpx client, a real TorchEngine on the tiny model (and, for engine failures,
a VLLMEngine client whose server is down)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import json
import logging
import re
import signal
import socket
import threading
import time
import types
import weakref
from collections.abc import Callable

import httpx
import openai
import pytest
import torch
from tokenizers.processors import TemplateProcessing

from rl.models import TinyModelConfig, build_tiny_model
from rollout.engines.base import EngineError, SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from rollout.gateway import RENDER_INLINE_CHARS, Gateway, GatewayConfig
from rollout.gateway_http import (
    IDLE_TIMEOUT_S,
    RETRY_AFTER_S,
    SESSION_HEADER,
    GatewayServer,
    RunSampling,
    create_app,
)
from rollout.router import Router, RouterConfig
from storage.schema import MAX_ERROR_CHARS, to_table, validate
from tests.rollout.test_gateway import QWEN3_LIKE

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=512
)
USER = [{"role": "system", "content": "reply only digits"}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny_model(TINY)


class SlowTorchEngine(TorchEngine):
    """A real TorchEngine whose every generation starts ``delay`` seconds late, and not before
    ``gate`` is set where one is given, so that two requests on one session overlap;
    ``params`` holds the sampling of each generation."""

    def __init__(self, *args, delay: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay = delay
        self.gate: asyncio.Event | None = None
        self.params: list[SamplingParams] = []

    async def generate(self, session_id, prompt_ids, params):
        self.params.append(params)
        await asyncio.sleep(self.delay)
        if self.gate is not None:
            await self.gate.wait()
        return await super().generate(session_id, prompt_ids, params)


class WatchedLock(asyncio.Lock):
    """A session's lock that sets ``contended`` once a turn waits for it."""

    def __init__(self):
        super().__init__()
        self.contended = asyncio.Event()

    async def acquire(self):
        if self.locked():
            self.contended.set()
        return await super().acquire()


@contextlib.asynccontextmanager
async def serving(
    tiny,
    *,
    dead_replica: bool = False,
    uds: str | None = None,
    max_context_tokens: int = 256,
    delay: float = 0.0,
    sampling: RunSampling | None = None,
    idle_timeout_s: float | None = IDLE_TIMEOUT_S,
    backpressure: Callable[[], str | None] | None = None,
    session_admin: bool = True,
):
    model, tokenizer = tiny
    engines = [SlowTorchEngine(copy.deepcopy(model), tokenizer, name="live", delay=delay)]
    if dead_replica:
        dead = VLLMEngineConfig(base_url="http://127.0.0.1:9", connect_timeout_s=1.0)
        engines.append(VLLMEngine(dead, name="dead"))
    router = Router(engines, RouterConfig(failover=False))
    gateway = Gateway(
        router, tokenizer, GatewayConfig(max_context_tokens=max_context_tokens, max_new_tokens=8)
    )
    server = await GatewayServer(
        gateway,
        uds=uds,
        sampling=sampling,
        idle_timeout_s=idle_timeout_s,
        backpressure=backpressure,
        session_admin=session_admin,
    ).start()
    transport = httpx.AsyncHTTPTransport(uds=uds) if uds else None
    client = httpx.AsyncClient(
        base_url=server.url,
        transport=transport,
        headers={"Authorization": f"Bearer {server.token}"},
        timeout=60,
    )
    try:
        yield gateway, server, client
    finally:
        await client.aclose()
        await server.stop()
        for engine in engines:
            await engine.close()


async def open_session(client: httpx.AsyncClient, **fields) -> str:
    response = await client.post("/v1/sessions", json={"task": "arith", "prompt_id": "p1", **fields})
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


async def session_on(client: httpx.AsyncClient, router: Router, replica: str) -> str:
    """A new session that the router sends to ``replica``."""
    while True:
        sid = await open_session(client)
        if router.route(sid).name == replica:
            return sid


def test_bearer_token_is_required(tiny):
    async def body():
        async with serving(tiny) as (_, server, client):
            assert server.url.startswith("http://127.0.0.1:")
            assert (await client.get("/health")).status_code == 200
            async with httpx.AsyncClient(base_url=server.url) as anonymous:
                response = await anonymous.post("/v1/sessions", json={"task": "t", "prompt_id": "p"})
                assert response.status_code == 401
                assert response.json()["error"]["message"] == "missing or wrong bearer token"
                wrong = await anonymous.post(
                    "/v1/generate",
                    json={"token_ids": [1]},
                    headers={"Authorization": "Bearer nope", SESSION_HEADER: "x"},
                )
                assert wrong.status_code == 401 and server.token not in wrong.text
                # an auth scheme is read in any case (RFC 9110), the token as it is
                assert (await anonymous.get("/health")).status_code == 200
                for scheme, token, status in (
                    ("bearer", server.token, 200),
                    ("BEARER", server.token.upper(), 401),
                ):
                    headers = {"Authorization": f"{scheme} {token}"}
                    opened = await anonymous.post(
                        "/v1/sessions", json={"task": "t", "prompt_id": "p"}, headers=headers
                    )
                    assert opened.status_code == status, opened.text
                # FastAPI's own pages would describe every endpoint to anyone who can connect
                for page in ("/openapi.json", "/docs", "/redoc"):
                    assert (await anonymous.get(page)).status_code == 404, page
            # answered from its headers alone: a server that read the body (never sent whole) would wait
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            head = "POST /v1/generate HTTP/1.1\r\nHost: gateway\r\nContent-Length: 1000000\r\n\r\n"
            writer.write(head.encode() + b'{"token_ids": [')
            await writer.drain()
            # the response alone: the connection stays open after it (keep-alive, 5 s)
            reply = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(re.search(rb"(?i)content-length: *(\d+)", reply)[1])
            reply += await asyncio.wait_for(reader.readexactly(length), 10)
            writer.close()
            assert reply.startswith(b"HTTP/1.1 401") and b"missing or wrong bearer token" in reply
            assert (await client.get("/v1/models")).status_code == 200

    asyncio.run(body())


def test_the_model_list_is_as_openai_and_vllm_list_a_model(tiny):
    """OpenAI's model object has a ``created`` time (the client's ``Model.created`` was None)
    and vLLM's its ``max_model_len``, which harnesses read to budget their context: the most
    tokens a session may hold here."""

    async def body():
        async with serving(tiny, max_context_tokens=200) as (_, server, _client):
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.token, max_retries=0)
            (model,) = (await client.models.list()).data
            assert model.id == "treadle-policy" and model.object == "model"
            assert isinstance(model.created, int) and abs(model.created - time.time()) < 600
            assert model.max_model_len == 200
            await client.close()

    asyncio.run(body())


def test_a_client_of_an_endpoint_not_served_is_told_which_are(tiny):
    """An OpenAI client on the Responses API (the Agents SDK's default) got a bare "Not Found",
    as for a mistyped base URL; the 404 names the endpoints the gateway serves, to a client
    that holds the token."""

    async def body():
        async with serving(tiny) as (_, server, _client):
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.token, max_retries=0)
            with pytest.raises(openai.NotFoundError) as refused:
                await client.responses.create(model="any", input="What is 2 + 3?")
            message = refused.value.body["message"]
            assert "POST /v1/responses" in message and "/v1/chat/completions" in message
            assert refused.value.body["type"] == "not_found_error"
            await client.close()
            async with httpx.AsyncClient(base_url=server.url) as anonymous:
                response = await anonymous.post("/v1/responses", json={})
                assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"

    asyncio.run(body())


def test_a_server_without_session_admin_serves_only_inference_on_the_sessions_opened_in_process(tiny):
    """The rollout service's server (``session_admin=False``) is handed to self-driving programs
    with its token: opening, recording, writing or closing a session there is a 403 naming what
    is served (after the token's check), while a session opened in-process is served."""

    async def body():
        async with serving(tiny, session_admin=False) as (gateway, server, client):
            sid = gateway.open(task="arith", prompt_id="p1").session_id
            refused = [
                await client.post("/v1/sessions", json={"task": "arith", "prompt_id": "p2"}),
                await client.post(f"/v1/sessions/{sid}/record", json={"reward": 1.0}),
                await client.post("/v1/records", json={"records": [{}]}),
                await client.delete(f"/v1/sessions/{sid}"),
            ]
            for response in refused:
                assert response.status_code == 403, response.text
                error = response.json()["error"]
                assert error["type"] == "permission_error"
                assert error["message"].startswith(f"{response.request.method} {response.request.url.path} ")
                assert "only the inference endpoints" in error["message"]
                assert "/v1/chat/completions" in error["message"]
            assert gateway.sessions == [sid] and not gateway.session(sid).closed
            async with httpx.AsyncClient(base_url=server.url) as anonymous:
                assert (await anonymous.post("/v1/sessions", json={})).status_code == 401
            served = await client.post(
                "/v1/generate", json={"token_ids": [1, 2]}, headers={SESSION_HEADER: sid}
            )
            assert served.status_code == 200, served.text
            unknown = await client.post("/v1/responses", json={})
            assert unknown.status_code == 404 and "/v1/sessions" not in unknown.json()["error"]["message"]
            gateway.close(sid)

    asyncio.run(body())


def test_token_endpoint_round_trip_and_record(tiny):
    async def body():
        async with serving(tiny) as (gateway, _, client):
            sid = await open_session(client, execution_id="exec-9")
            headers = {SESSION_HEADER: sid}
            prompt = [1, 2, 40, 41, 42, 3]
            first = await client.post(
                "/v1/generate", json={"token_ids": prompt, "max_new_tokens": 5, "seed": 4}, headers=headers
            )
            assert first.status_code == 200, first.text
            out = first.json()
            assert len(out["token_ids"]) == len(out["logprobs"]) == len(out["versions"]) == 5
            assert out["versions"] == [0] * 5 and out["finish_reason"] == "length"
            assert all(lp <= 0 for lp in out["logprobs"])
            assert out["num_tokens"] == len(prompt) + 5
            second = await client.post(
                # unseeded; no stop ids, so the turn surely runs to its budget and the record says truncated
                "/v1/generate",
                json={"token_ids": [7, 8], "max_new_tokens": 3, "stop_ids": []},
                headers=headers,
            )
            assert second.status_code == 200 and second.json()["finish_reason"] == "length"
            assert (
                gateway.session(sid).tokens == prompt + out["token_ids"] + [7, 8] + second.json()["token_ids"]
            )
            # Python's JSON reader takes NaN: it must not come back as a record with reward null
            nan = await client.post(
                f"/v1/sessions/{sid}/record",
                content=b'{"reward": NaN}',
                headers={"Content-Type": "application/json"},
            )
            assert nan.status_code == 400 and "reward nan is not a finite number" in nan.text
            record = await client.post(f"/v1/sessions/{sid}/record", json={"reward": 1.0, "progress": 0.5})
            assert record.status_code == 200
            row = record.json()
            validate(to_table([row]))
            assert row["execution_id"] == "exec-9" and row["status"] == "truncated"
            assert row["tokens"] == gateway.session(sid).tokens
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200
            gone = await client.post("/v1/generate", json={"token_ids": [1]}, headers=headers)
            assert gone.status_code == 404 and sid in gone.json()["error"]["message"]

    asyncio.run(body())


def test_a_branch_opened_over_http_records_its_link_and_joins_its_parents_execution(tiny):
    async def body():
        async with serving(tiny) as (_, _, client):
            await open_session(client, trajectory_id="root")
            sid = await open_session(client, trajectory_id="retry", parent_id="root", branch_at=3)
            opened = (await client.post(f"/v1/sessions/{sid}/record", json={})).json()
            refused = [
                ({"branch_at": 3}, "branch_at 3 needs the parent_id it branched from"),
                ({"parent_id": "root", "branch_at": -1}, "branch_at"),
                ({"parent_id": "root", "branch_at": 2**31}, "branch_at"),
            ]
            for fields, message in refused:
                response = await client.post(
                    "/v1/sessions", json={"task": "arith", "prompt_id": "p1", **fields}
                )
                assert response.status_code == 400 and message in response.text, (fields, response.text)
            return opened

    row = asyncio.run(body())
    assert (row["execution_id"], row["parent_id"], row["branch_at"]) == ("root", "root", 3)


def test_only_a_session_that_starts_a_rollout_waits_for_the_servers_backpressure(tiny):
    """While ``backpressure`` says why, a new rollout is refused with a 429 in the gateway's
    error format. A turn, and a branch whose parent's execution (the one it was opened with, not
    its own id) has an open session, are part of a rollout under way and are served; a branch
    of a rollout that ended starts a new one."""
    waits_for: list[str] = []

    async def body():
        async with serving(tiny, backpressure=lambda: waits_for[-1] if waits_for else None) as (_, _, client):
            root = await open_session(client, trajectory_id="root", execution_id="e1")
            sibling = await open_session(client, trajectory_id="sibling", execution_id="e1")
            ended = await open_session(client, trajectory_id="ended")
            for session_id in (root, ended):
                await client.delete(f"/v1/sessions/{session_id}")
            waits_for.append("the trainer is far behind")
            new = {"task": "arith", "prompt_id": "p2"}
            answers = {
                "new": await client.post("/v1/sessions", json=new),
                "unauthorized": await client.post(
                    "/v1/sessions", json=new, headers={"Authorization": "Bearer wrong"}
                ),
                "bad body": await client.post("/v1/sessions", json={"task": "arith"}),
                "branch of a live rollout": await client.post(
                    "/v1/sessions", json={**new, "parent_id": "root"}
                ),
                "branch of an ended one": await client.post(
                    "/v1/sessions", json={**new, "parent_id": "ended"}
                ),
                "turn": await client.post(
                    "/v1/generate", json={"token_ids": [5]}, headers={SESSION_HEADER: sibling}
                ),
            }
            waits_for.clear()
            answers["new, once it may"] = await client.post("/v1/sessions", json=new)
            return answers

    answers = asyncio.run(body())
    assert {what: answer.status_code for what, answer in answers.items()} == {
        "new": 429,
        "unauthorized": 401,
        "bad body": 400,
        "branch of a live rollout": 200,
        "branch of an ended one": 429,
        "turn": 200,
        "new, once it may": 200,
    }
    refused = answers["new"]
    assert refused.headers["Retry-After"] == str(RETRY_AFTER_S)
    assert refused.json() == {
        "error": {
            "message": f"no new rollout opens while the trainer lags (the trainer is far behind); retry after "
            f"{RETRY_AFTER_S} s (the turns and branches of open rollouts are served meanwhile)",
            "type": "rate_limit_error",
            "code": 429,
        }
    }
    assert answers["branch of a live rollout"].json()["execution_id"] == "e1"


def test_an_open_the_gateway_refuses_is_a_bad_request_under_backpressure_too(tiny):
    """Under backpressure an open whose ids the gateway refuses (a blank id, ``branch_at``
    without a parent, an id an open session holds) was answered 429 and counted as a new
    rollout held back: its harness waited and sent it again, to be told it is bad only once
    the trainer caught up. It is a 400 saying why, counted in no refusal."""

    async def body():
        async with serving(tiny, backpressure=lambda: "the trainer is far behind") as (
            gateway,
            server,
            client,
        ):
            held = gateway.open(task="arith", prompt_id="p1", trajectory_id="held", session_id="held")
            new = {"task": "arith", "prompt_id": "p1"}
            answers = {
                "blank id": await client.post("/v1/sessions", json={**new, "group_id": " "}),
                "branch_at alone": await client.post("/v1/sessions", json={**new, "branch_at": 3}),
                "open session id": await client.post("/v1/sessions", json={**new, "session_id": "held"}),
                "open trajectory id": await client.post(
                    "/v1/sessions", json={**new, "trajectory_id": "held"}
                ),
            }
            assert server.sessions_refused == 0
            assert (await client.post("/v1/sessions", json=new)).status_code == 429
            assert server.sessions_refused == 1 and gateway.sessions == [held.session_id]
            return answers

    answers = asyncio.run(body())
    assert {why: answer.status_code for why, answer in answers.items()} == dict.fromkeys(answers, 400)
    assert all(answer.json()["error"]["type"] == "invalid_request_error" for answer in answers.values())


def test_a_session_open_retried_after_its_lost_reply_answers_the_session_it_opened(tiny):
    """A harness whose ``POST /v1/sessions`` with its own ``session_id`` succeeded but whose reply
    was lost (its timeout ran out) and that sent it again got a 400, the session it opened left
    pinned until its idle timeout. The same request again (the same fields, null as left out),
    before any request has named the session, is its retry: answered as the first was, even
    while backpressure refuses new rollouts, opening nothing more. Other fields, a session
    already used, or one opened in-process are refused as before."""
    waits_for: list[str] = []

    async def body():
        async with serving(tiny, backpressure=lambda: waits_for[-1] if waits_for else None) as (
            gateway,
            server,
            client,
        ):
            request = {"task": "arith", "prompt_id": "p1", "session_id": "s1"}
            first = await client.post("/v1/sessions", json=request)
            assert first.status_code == 200, first.text
            # the second with the session's header, as a client that sends it on every request does
            for retry, headers in ((request, {}), ({**request, "group_id": None}, {SESSION_HEADER: "s1"})):
                again = await client.post("/v1/sessions", json=retry, headers=headers)
                assert again.status_code == 200, again.text
                assert again.json() == first.json()
                waits_for.append("the trainer is far behind")
            assert gateway.sessions == ["s1"] and server.sessions_refused == 0
            waits_for.clear()

            other = await client.post("/v1/sessions", json={**request, "prompt_id": "p2"})
            assert other.status_code == 400 and "session 's1' is already open" in other.text, other.text
            turn = await client.post(
                "/v1/generate",
                json={"token_ids": [1, 2], "max_new_tokens": 2},
                headers={SESSION_HEADER: "s1"},
            )
            assert turn.status_code == 200, turn.text
            used = await client.post("/v1/sessions", json=request)
            assert used.status_code == 400 and "session 's1' is already open" in used.text, used.text
            gateway.open(task="arith", prompt_id="p1", session_id="mine")
            mine = await client.post("/v1/sessions", json={**request, "session_id": "mine"})
            assert mine.status_code == 400 and "session 'mine' is already open" in mine.text, mine.text
            assert sorted(gateway.sessions) == ["mine", "s1"]

    asyncio.run(body())


def test_a_trajectory_id_an_open_session_holds_is_refused_naming_it(tiny):
    async def body():
        async with serving(tiny) as (gateway, _, client):
            first = await open_session(client, trajectory_id="mine")
            for branch in ({}, {"parent_id": "mine"}):
                response = await client.post(
                    "/v1/sessions",
                    json={"task": "arith", "prompt_id": "p1", "trajectory_id": "mine", **branch},
                )
                assert response.status_code == 400, response.text
                message = response.json()["error"]["message"]
                assert "trajectory 'mine' is open" in message and "\n" not in message, message
            assert gateway.sessions == [first]
            # a rollout abandoned unrecorded is retried under its id once its session is gone
            await client.delete(f"/v1/sessions/{first}")
            again = await open_session(client, trajectory_id="mine")
            assert gateway.sessions == [again]
            # the ids the gateway generates, a branch's included, are new
            sid = await open_session(client, parent_id="mine")
            assert (await client.post(f"/v1/sessions/{sid}/record", json={})).json()["execution_id"] == "mine"

    asyncio.run(body())


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        # the record of such a session could not be sent (a bare 500), nor written to a shard
        ("p-\udce9", "holds a lone surrogate at character 2"),
        ("", "an id must hold something other than whitespace"),
        (" \t", "an id must hold something other than whitespace"),
    ],
    ids=["lone-surrogate", "empty", "whitespace"],
)
def test_a_session_whose_ids_are_no_text_or_blank_is_refused_at_open(tiny, value, reason):
    async def body():
        async with serving(tiny) as (gateway, _, client):
            for name in ("task", "prompt_id", "execution_id", "trajectory_id", "group_id", "parent_id"):
                response = await client.post(
                    "/v1/sessions",
                    # json.dumps escapes a lone surrogate; httpx's json= would fail to encode it
                    content=json.dumps({"task": "arith", "prompt_id": "p1", name: value}),
                    headers={"Content-Type": "application/json"},
                )
                assert response.status_code == 400, (name, response.text)
                message = response.json()["error"]["message"]
                assert f"{name}: Value error, {reason}" in message and "\n" not in message, message
            assert gateway.sessions == []

    asyncio.run(body())


def test_bad_input_gets_clear_errors_and_the_server_keeps_serving(tiny):
    async def body():
        async with serving(tiny, max_context_tokens=32) as (gateway, _, client):
            sid = await open_session(client)
            headers = {SESSION_HEADER: sid}
            cases = [
                ({"token_ids": [1, 999999]}, "outside the vocabulary"),
                ({"token_ids": [1, "x"]}, "token_ids"),
                ({"token_ids": [1, -3]}, "outside the vocabulary"),
                ({"token_ids": []}, "empty prompt"),
                ({"token_ids": [5] * 40}, "over max_context_tokens=32"),
                ({"token_ids": [5], "temperature": 0}, "temperature must be a finite number >= 1e-05"),
                ({"token_ids": [5], "temperature": 5e-6}, "temperature must be a finite number >= 1e-05"),
                ({"token_ids": [5], "seed": 2**64}, "seed must be a 64-bit integer"),
                (
                    {"token_ids": [5], "max_new_tokens": 0},
                    "max_new_tokens: Input should be greater than or equal to 1",
                ),
                # JSON true and "3" are no token ids: not recorded as tokens 1 and 3
                ({"token_ids": [True, 2]}, "token_ids.0: Input should be a valid integer"),
                ({"token_ids": ["3"]}, "token_ids.0: Input should be a valid integer"),
                ({"token_ids": [5], "stop_ids": [True]}, "stop_ids.0: Input should be a valid integer"),
                ({"token_ids": [5], "stop_ids": [999999]}, "stop_ids[0] = 999999 is outside the vocabulary"),
            ]
            for payload, message in cases:
                response = await client.post("/v1/generate", json=payload, headers=headers)
                assert response.status_code == 400, (payload, response.text)
                assert message in response.json()["error"]["message"]
            for prompt in ([True], ["3"]):  # to the OpenAI API, ["3"] is a batch of one text prompt
                response = await client.post("/v1/completions", json={"prompt": prompt}, headers=headers)
                assert response.status_code == 400, (prompt, response.text)
                assert "prompt.list[int].0: Input should be a valid integer" in response.text
            assert gateway.session(sid).tokens == []
            not_a_number = await client.post(  # JSON has no NaN; Python's parser takes it anyway
                "/v1/generate",
                content=b'{"token_ids": [5], "temperature": NaN}',
                headers={**headers, "Content-Type": "application/json"},
            )
            assert not_a_number.status_code == 400
            assert "temperature must be a finite number" in not_a_number.json()["error"]["message"]
            unknown = await client.post(
                "/v1/generate", json={"token_ids": [1]}, headers={SESSION_HEADER: "ghost"}
            )
            assert unknown.status_code == 404 and "ghost" in unknown.json()["error"]["message"]
            for missing_headers in ({}, {SESSION_HEADER: ""}):
                missing = await client.post("/v1/generate", json={"token_ids": [1]}, headers=missing_headers)
                assert missing.status_code == 400 and SESSION_HEADER in missing.json()["error"]["message"]
            ok = await client.post(
                "/v1/generate", json={"token_ids": [5, 6], "max_new_tokens": 2}, headers=headers
            )
            assert ok.status_code == 200 and len(ok.json()["token_ids"]) == 2
            chat = await client.post(
                "/v1/chat/completions", json={"messages": USER, "max_tokens": 0}, headers=headers
            )
            assert (
                chat.status_code == 400
                and "max_tokens: Input should be greater than or equal to 1" in chat.text
            )
            # an id with a slash could be opened, then never closed: DELETE's path splits it
            slashed = await client.post(
                "/v1/sessions", json={"task": "arith", "prompt_id": "p", "session_id": "run/1"}
            )
            assert slashed.status_code == 400 and "session_id" in slashed.json()["error"]["message"]

    asyncio.run(body())


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"{not json",
            "bad request body: not valid JSON: Expecting property name enclosed in double quotes (char 1)",
        ),
        (b'{"token_ids": [5]} x', "bad request body: not valid JSON: Extra data (char 19)"),
        (b"", "bad request body: the request has no body; send a JSON object"),
        (b"[5]", "bad request body: Input should be a valid dictionary or object to extract fields from"),
    ],
)
def test_a_body_that_is_no_json_object_is_refused_saying_why(tiny, content, message):
    async def body():
        async with serving(tiny) as (gateway, _, client):
            sid = await open_session(client)
            headers = {SESSION_HEADER: sid, "Content-Type": "application/json"}
            for path in ("/v1/generate", "/v1/chat/completions"):
                response = await client.post(path, content=content, headers=headers)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["message"].startswith(message), response.text
            assert gateway.session(sid).tokens == []

    asyncio.run(body())


@pytest.mark.parametrize(
    ("timing", "message"),
    [
        (b'{"run": NaN}', "run=nan is not a finite number of seconds >= 0"),
        (b'{"run": Infinity}', "run=inf is not a finite number of seconds >= 0"),
        (b'{"eval": -1.5}', "eval=-1.5 is not a finite number of seconds >= 0"),
        (b'{"init": 1.0, "sandbox": 2.0}', "unknown entry 'sandbox'"),
    ],
)
def test_a_record_with_a_bad_timing_entry_is_refused_naming_it(tiny, timing, message):
    """NaN would come back as null, a negative stay, an unknown entry be dropped unseen."""

    async def body():
        async with serving(tiny) as (_, _, client):
            sid = await open_session(client)
            refused = await client.post(
                f"/v1/sessions/{sid}/record",
                content=b'{"reward": 1.0, "timing": ' + timing + b"}",
                headers={"Content-Type": "application/json"},
            )
            assert refused.status_code == 400 and message in refused.json()["error"]["message"]
            recorded = await client.post(
                f"/v1/sessions/{sid}/record", json={"timing": {"init": 0.0, "run": 1.5}}
            )
            assert recorded.status_code == 200
            assert recorded.json()["timing"] == {"init": 0.0, "run": 1.5, "eval": 0.0, "queue": 0.0}

    asyncio.run(body())


def test_a_harness_states_why_its_rollout_failed_within_the_bound(tiny):
    """An outside harness's ``error`` goes into the record as the service's does: at most
    ``MAX_ERROR_CHARS`` characters (one more is refused, with nothing recorded), text UTF-8
    can encode, AWS key ids masked; a shard holds the record."""

    async def body():
        async with serving(tiny) as (_, _, client):
            sid = await open_session(client)
            path = f"/v1/sessions/{sid}/record"
            too_long = await client.post(
                path, json={"status": "env_error", "error": "x" * (MAX_ERROR_CHARS + 1)}
            )
            assert too_long.status_code == 400
            assert (
                f"error holds 1001 characters, over {MAX_ERROR_CHARS}" in too_long.json()["error"]["message"]
            )
            surrogate = await client.post(
                path,
                content=b'{"status": "env_error", "error": "bad \\udc80 byte"}',
                headers={"Content-Type": "application/json"},
            )
            assert surrogate.status_code == 400 and "lone surrogate" in surrogate.json()["error"]["message"]
            said = "harness: tests crashed (key AKIAABCDEFGHIJKLMNOP) "
            stated = said + "x" * (MAX_ERROR_CHARS - len(said))
            recorded = await client.post(path, json={"status": "env_error", "error": stated})
            assert recorded.status_code == 200, recorded.text
            record = recorded.json()
            assert record["error"] == stated.replace("AKIAABCDEFGHIJKLMNOP", "**********")
            assert (await client.post(path, json={"status": "ok"})).json()["error"] is None
            return record

    record = asyncio.run(body())
    assert validate(to_table([record])).column("error").to_pylist() == [record["error"]]


def same_reply(retry: dict, original: dict) -> bool:
    """Whether two OpenAI responses hold the same reply (all but their ids and times)."""
    return retry["choices"] == original["choices"] and retry["usage"] == original["usage"]


async def turn_running(session) -> None:
    """Until ``session`` has a turn in progress (its lock taken): a request sent then overlaps it."""
    deadline = time.monotonic() + 30
    while not session._lock.locked():
        assert time.monotonic() < deadline, "the first request never started its turn"
        await asyncio.sleep(0.005)


def test_overlapping_requests_on_one_session_are_recorded_turn_after_turn(tiny):
    """A second request arriving while the first one's turn generates (a client's retry, or a
    careless agent) waits for that turn: its tokens never land in front of the first turn's
    action, and a retry of the same chat or completion request gets the same reply instead of
    adding a turn."""

    async def body():
        async with serving(tiny, delay=0.3) as (gateway, _, client):
            sid = await open_session(client)
            headers = {SESSION_HEADER: sid}
            first = asyncio.create_task(
                client.post(
                    "/v1/generate", json={"token_ids": [1, 2, 3], "max_new_tokens": 3}, headers=headers
                )
            )
            await turn_running(gateway.session(sid))
            second = await client.post(
                "/v1/generate", json={"token_ids": [50, 51], "max_new_tokens": 3}, headers=headers
            )
            first = await first
            assert first.status_code == second.status_code == 200, (first.text, second.text)
            a, b = first.json()["token_ids"], second.json()["token_ids"]
            session = gateway.session(sid)
            assert session.tokens == [1, 2, 3, *a, 50, 51, *b]
            assert session.turn == [0] * (3 + len(a)) + [1] * (2 + len(b))

            chat_sid = await open_session(client)
            chat_headers = {SESSION_HEADER: chat_sid}
            request = {"messages": USER, "max_tokens": 3, "logprobs": True}
            original = asyncio.create_task(
                client.post("/v1/chat/completions", json=request, headers=chat_headers)
            )
            await turn_running(gateway.session(chat_sid))
            retry = await client.post("/v1/chat/completions", json=request, headers=chat_headers)
            original = await original
            assert original.status_code == retry.status_code == 200, (original.text, retry.text)
            assert same_reply(retry.json(), original.json())
            chat = gateway.session(chat_sid)
            roles = [m["role"] for m in chat.messages]
            assert chat.num_turns == 1 and roles == ["system", "user", "assistant"]
            assert chat.tokens[-len(chat.turns[0].token_ids) :] == original.json()["choices"][0]["token_ids"]

            text_sid = await open_session(client)
            text_headers = {SESSION_HEADER: text_sid}
            completion = {"prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 0}
            original = asyncio.create_task(
                client.post("/v1/completions", json=completion, headers=text_headers)
            )
            await turn_running(gateway.session(text_sid))
            retry = await client.post("/v1/completions", json=completion, headers=text_headers)
            original = await original
            assert original.status_code == retry.status_code == 200, (original.text, retry.text)
            assert same_reply(retry.json(), original.json())
            text = gateway.session(text_sid)
            assert text.num_turns == 1 and text.tokens == [
                1,
                2,
                3,
                *original.json()["choices"][0]["token_ids"],
            ]

    asyncio.run(body())


async def turn_recorded(session, turns: int) -> None:
    """Until ``session`` holds ``turns`` turns."""
    deadline = time.monotonic() + 30
    while session.num_turns < turns:
        assert time.monotonic() < deadline, "the request never completed its turn"
        await asyncio.sleep(0.005)


def test_a_request_retried_after_its_client_timed_out_gets_the_recorded_reply(tiny):
    """A client whose timeout runs out before the slow engine answers leaves the turn
    generating; the turn is recorded, and the client's retry of the same request (as the
    OpenAI client makes on a timeout) gets that turn's reply, recording nothing more."""
    _, tokenizer = tiny

    async def body():
        async with serving(tiny, delay=0.5) as (gateway, server, _):
            sid = gateway.open(task="agent", prompt_id="p1").session_id
            client = openai.AsyncOpenAI(
                base_url=f"{server.url}/v1",
                api_key=server.token,
                default_headers={SESSION_HEADER: sid},
                max_retries=0,
            )
            request = {"model": "any", "messages": USER, "max_tokens": 6, "seed": 2, "logprobs": True}
            with pytest.raises(openai.APITimeoutError):
                await client.with_options(timeout=0.1).chat.completions.create(**request)
            session = gateway.session(sid)
            await turn_recorded(session, 1)
            record = session.record()
            retried = await client.chat.completions.create(**request)
            (turn,) = session.turns
            choice = retried.choices[0]
            assert choice.message.content == turn.message["content"]
            assert choice.token_ids == turn.token_ids
            assert [lp.logprob for lp in choice.logprobs.content] == turn.logprobs
            assert choice.finish_reason == turn.finish_reason
            assert retried.usage.completion_tokens == len(turn.token_ids)
            assert retried.usage.total_tokens == len(session.tokens)
            assert session.num_turns == 1 and session.record() == record
            conversation = [
                *USER,
                choice.message.model_dump(exclude_none=True),
                {"role": "user", "content": "more"},
            ]
            later = await client.chat.completions.create(model="any", messages=conversation, max_tokens=2)
            assert later.choices[0].token_ids == session.turns[1].token_ids
            assert session.tokens[: len(record["tokens"])] == record["tokens"]
            await client.close()

            text_sid = gateway.open(task="agent", prompt_id="p2").session_id
            headers = {SESSION_HEADER: text_sid, "Authorization": f"Bearer {server.token}"}
            completion = {"prompt": "What is 2 + 3?", "max_tokens": 4, "seed": 1, "logprobs": 0}
            async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=0.1) as hasty:
                with pytest.raises(httpx.ReadTimeout):
                    await hasty.post("/v1/completions", json=completion)
            text = gateway.session(text_sid)
            await turn_recorded(text, 1)
            record = text.record()
            async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as patient:
                retried = await patient.post("/v1/completions", json=completion)
                assert retried.status_code == 200, retried.text
                choice = retried.json()["choices"][0]
                (turn,) = text.turns
                assert (choice["text"], choice["token_ids"]) == (turn.text, turn.token_ids)
                assert choice["logprobs"]["token_logprobs"] == turn.logprobs
                assert text.num_turns == 1 and text.record() == record
                # the transcript holds the completion once: the next prompt appends only its own text
                prompt = completion["prompt"] + choice["text"] + " answer:"
                later = await patient.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                assert later.status_code == 200, later.text
            suffix = tokenizer.encode(" answer:", add_special_tokens=False)
            assert text.tokens == record["tokens"] + suffix + text.turns[1].token_ids

    asyncio.run(body())


def test_a_resent_request_with_other_parameters_or_after_a_later_turn_is_refused(tiny):
    """Only the request the session's last turn answered is replayed: the same conversation
    with other sampling, or an earlier turn's request, is refused as before and adds nothing."""

    async def body():
        async with serving(tiny) as (gateway, _, client):
            headers = {SESSION_HEADER: await open_session(client)}
            session = gateway.session(headers[SESSION_HEADER])
            request = {"model": "any", "messages": USER, "max_tokens": 3, "seed": 1}
            first = await client.post("/v1/chat/completions", json=request, headers=headers)
            assert first.status_code == 200, first.text
            record = session.record()
            for other in [{"max_tokens": 4}, {"seed": 2}, {"temperature": 0.5}, {"model": "other"}]:
                refused = await client.post("/v1/chat/completions", json=request | other, headers=headers)
                assert refused.status_code == 400, (other, refused.text)
                assert "send the whole conversation" in refused.json()["error"]["message"]
            answered = [*USER, first.json()["choices"][0]["message"]]
            for other in [{}, {"seed": 2}]:  # the conversation with its reply and nothing new
                refused = await client.post(
                    "/v1/chat/completions", json=request | other | {"messages": answered}, headers=headers
                )
                assert refused.status_code == 400, (other, refused.text)
                assert "send the whole conversation" in refused.json()["error"]["message"]
            assert session.record() == record
            conversation = [*answered, {"role": "user", "content": "more"}]
            later = {"model": "any", "messages": conversation, "max_tokens": 2}
            second = await client.post("/v1/chat/completions", json=later, headers=headers)
            assert second.status_code == 200, second.text
            record = session.record()
            stale = await client.post("/v1/chat/completions", json=request, headers=headers)
            assert (
                stale.status_code == 400 and "send the whole conversation" in stale.json()["error"]["message"]
            )
            again = await client.post("/v1/chat/completions", json=later, headers=headers)
            assert again.status_code == 200 and same_reply(again.json(), second.json())
            assert session.num_turns == 2 and session.record() == record

            text_headers = {SESSION_HEADER: await open_session(client)}
            text = gateway.session(text_headers[SESSION_HEADER])
            completion = {"prompt": "What is 2 + 3?", "max_tokens": 3, "seed": 1}
            first = await client.post("/v1/completions", json=completion, headers=text_headers)
            assert first.status_code == 200, first.text
            assert first.json()["choices"][0]["text"], (
                "precondition: the prompt alone does not extend the transcript"
            )
            other = await client.post("/v1/completions", json=completion | {"seed": 2}, headers=text_headers)
            assert other.status_code == 400 and "does not extend" in other.json()["error"]["message"]
            prompt = completion["prompt"] + first.json()["choices"][0]["text"] + " answer:"
            second = await client.post("/v1/completions", json={"prompt": prompt}, headers=text_headers)
            assert second.status_code == 200, second.text
            record = text.record()
            stale = await client.post("/v1/completions", json=completion, headers=text_headers)
            assert stale.status_code == 400 and "does not extend" in stale.json()["error"]["message"]
            assert text.num_turns == 2 and text.record() == record

    asyncio.run(body())


def test_a_prompt_past_the_context_is_refused_in_openais_words_and_code(tiny):
    """Agent harnesses end an episode gracefully on a context overflow they recognise by
    OpenAI's ``context_length_exceeded`` code or its words (litellm's ContextWindowExceededError
    matches "This model's maximum context length is"); the gateway's 400 had neither, so they
    failed the episode as an error."""

    async def body():
        async with serving(tiny, max_context_tokens=48) as (gateway, server, _):
            sid = gateway.open(task="agent", prompt_id="p1").session_id
            client = openai.AsyncOpenAI(
                base_url=f"{server.url}/v1",
                api_key=server.token,
                default_headers={SESSION_HEADER: sid},
                max_retries=0,
            )
            long = [{"role": "user", "content": "What is 2 + 3? " * 20}]
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="any", messages=long, max_tokens=2)
            assert refused.value.code == "context_length_exceeded"
            assert refused.value.type == "invalid_request_error"
            message = refused.value.body["message"]
            assert message.startswith("This model's maximum context length is")
            assert "over max_context_tokens=48" in message
            with pytest.raises(openai.BadRequestError) as bad:  # other refusals keep their code
                await client.chat.completions.create(model="any", messages=USER, max_tokens=2, n=2)
            assert bad.value.code == "400"
            assert gateway.session(sid).context_limit is not None
            await client.close()

    asyncio.run(body())


def test_engine_failure_is_503_and_other_sessions_are_served(tiny):
    async def body():
        async with serving(tiny, dead_replica=True) as (gateway, _, client):
            assert (await client.get("/health")).json() == {"ok": True, "replicas": 2}
            on_dead = on_live = None
            while on_dead is None or on_live is None:
                sid = await open_session(client)
                if gateway.router.route(sid).name == "dead":
                    on_dead = on_dead or sid
                else:
                    on_live = on_live or sid
            failed = await client.post(
                "/v1/generate", json={"token_ids": [1, 2]}, headers={SESSION_HEADER: on_dead}
            )
            assert failed.status_code == 503 and "unreachable" in failed.json()["error"]["message"]
            served = await client.post(
                "/v1/generate",
                json={"token_ids": [1, 2], "max_new_tokens": 2},
                headers={SESSION_HEADER: on_live},
            )
            assert served.status_code == 200

    asyncio.run(body())


def test_openai_chat_resending_the_conversation_is_recorded_token_exactly(tiny):
    _, tokenizer = tiny

    async def body():
        async with serving(tiny) as (gateway, _, client):
            sid = await open_session(client)
            headers = {SESSION_HEADER: sid}
            request = {"model": "any", "messages": USER, "max_tokens": 12, "seed": 11, "logprobs": True}
            first = await client.post("/v1/chat/completions", json=request, headers=headers)
            assert first.status_code == 200, first.text
            choice = first.json()["choices"][0]
            action = choice["token_ids"]
            assert choice["message"]["content"] == tokenizer.decode(action, skip_special_tokens=True)
            assert len(choice["logprobs"]["content"]) == len(action)
            session = gateway.session(sid)
            prompt = tokenizer.encode(
                tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )
            assert session.tokens == prompt + action
            assert tokenizer.encode(choice["message"]["content"], add_special_tokens=False) != action, (
                "precondition: re-encoding the returned text would change the tokens"
            )
            # a scaffold that strips (or pads) the returned text resends the same message
            resent = choice["message"] | {"content": f" {choice['message']['content']}\n"}
            conversation = [*USER, resent, {"role": "user", "content": "again"}]
            second = await client.post(
                "/v1/chat/completions",
                json={"messages": conversation, "max_tokens": 4, "seed": 1},
                headers=headers,
            )
            assert second.status_code == 200, second.text
            assert session.tokens[: len(prompt) + len(action)] == prompt + action
            assert session.tokens[len(prompt) : len(prompt) + len(action)] == action
            assert session.num_turns == 2 and len(session.messages) == 5
            later = [
                *conversation[3:],
                {"role": "assistant", "content": "y"},
                {"role": "user", "content": "z"},
            ]
            for other in [
                {"role": "assistant", "content": "something else"},
                choice["message"] | {"role": "user"},
            ]:
                diverged = [*USER, other, *later]
                bad = await client.post("/v1/chat/completions", json={"messages": diverged}, headers=headers)
                assert (
                    bad.status_code == 400
                    and "message 2 (" in bad.json()["error"]["message"]
                    and "differs from the session's history" in bad.json()["error"]["message"]
                ), other

    asyncio.run(body())


def test_the_openai_client_chats_streams_and_cannot_add_tools_to_a_running_session(tiny):
    """The client agent scaffolds use: a chat turn, a streamed one (text, finish reason and
    usage in chunks), a streamed text completion, and a clear refusal of tool definitions
    sent only once the session's prompt was rendered without them (tool calls themselves:
    ``test_tool_calls.py``)."""
    _, tokenizer = tiny

    async def body():
        async with serving(tiny) as (gateway, server, _):
            sid = gateway.open(task="agent", prompt_id="p1").session_id
            client = openai.AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key=server.token, default_headers={SESSION_HEADER: sid}
            )
            session = gateway.session(sid)
            first = await client.chat.completions.create(model="any", messages=USER, max_tokens=8, seed=3)
            reply = first.choices[0].message.content
            assert reply == tokenizer.decode(session.turns[0].token_ids, skip_special_tokens=True)

            conversation = [
                *USER,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "again"},
            ]
            stream = await client.chat.completions.create(
                model="any",
                messages=conversation,
                max_tokens=8,
                seed=4,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert session.num_turns == 2
            action = session.turns[1].token_ids
            assert text == tokenizer.decode(action, skip_special_tokens=True)
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
            assert chunks[-1].usage.completion_tokens == len(action)
            assert chunks[-1].usage.total_tokens == len(session.tokens)

            with pytest.raises(
                openai.BadRequestError, match="tool definitions differ from those the session"
            ):
                await client.chat.completions.create(
                    model="any",
                    messages=[
                        *conversation,
                        {"role": "assistant", "content": text},
                        {"role": "user", "content": "x"},
                    ],
                    tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                )
            assert session.num_turns == 2

            completion_sid = gateway.open(task="agent", prompt_id="p2").session_id
            streamed = await client.with_options(
                default_headers={SESSION_HEADER: completion_sid}
            ).completions.create(model="any", prompt="What is 2 + 3?", max_tokens=6, seed=5, stream=True)
            text = "".join([choice.text async for chunk in streamed for choice in chunk.choices])
            completion = gateway.session(completion_sid)
            assert text == tokenizer.decode(completion.turns[0].token_ids, skip_special_tokens=True)
            await client.close()

    asyncio.run(body())


def test_parameters_an_openai_client_sends_as_null_take_their_defaults(tiny):
    """A caller's ``temperature=None`` (and the like) reaches the server as JSON null, which
    the OpenAI API reads as the parameter's default: not a bad request."""

    async def body():
        async with serving(tiny) as (gateway, server, _):
            sid = gateway.open(task="agent", prompt_id="p1").session_id
            client = openai.AsyncOpenAI(
                base_url=f"{server.url}/v1",
                api_key=server.token,
                default_headers={SESSION_HEADER: sid},
                max_retries=0,
            )
            nulls = {"temperature": None, "top_p": None, "n": None, "logprobs": None, "seed": None}
            chat = await client.chat.completions.create(model="any", messages=USER, max_tokens=4, **nulls)
            assert chat.choices[0].message.role == "assistant"
            completion = await client.with_options(
                default_headers={SESSION_HEADER: gateway.open(task="agent", prompt_id="p2").session_id}
            ).completions.create(model="any", prompt="What is 2 + 3?", max_tokens=4, stream=None, **nulls)
            assert completion.choices[0].logprobs is None
            assert gateway.session(sid).num_turns == 1
            await client.close()

    asyncio.run(body())


@pytest.mark.parametrize("fixed", [True, False], ids=["training", "evaluation"])
def test_a_request_that_leaves_sampling_unset_samples_at_the_runs(tiny, fixed):
    """Requests that leave temperature and top_p unset (or null) sample at the server's; a
    training server refuses others, naming the run's, and an evaluation's samples at them."""
    asked = [
        {"temperature": 0.9},
        {"top_p": 0.5},
        {"temperature": 0.7, "top_p": 0.9},
    ]

    async def body():
        run = RunSampling(temperature=0.7, top_p=1.0, fixed=fixed)
        async with serving(tiny, sampling=run) as (gateway, _, client):
            engine = gateway.router.engine("live")
            unset = [{}, {"temperature": None, "top_p": None}, {"temperature": 0.7, "top_p": 1.0}]
            for sampling in unset:
                headers = {SESSION_HEADER: await open_session(client)}
                chat = {"messages": USER, "max_tokens": 2, **sampling}
                response = await client.post("/v1/chat/completions", json=chat, headers=headers)
                assert response.status_code == 200, response.text
            assert [(p.temperature, p.top_p) for p in engine.params] == [(0.7, 1.0)] * 3
            engine.params.clear()
            for sampling in asked:
                headers = {SESSION_HEADER: await open_session(client)}
                response = await client.post(
                    "/v1/generate", json={"token_ids": [5], **sampling}, headers=headers
                )
                if fixed:
                    assert response.status_code == 400, response.text
                    message = response.json()["error"]["message"]
                    assert "at the run's temperature 0.7 and top_p 1.0" in message
                else:
                    assert response.status_code == 200, response.text
            expected = [] if fixed else [(0.9, 1.0), (0.7, 0.5), (0.7, 0.9)]
            assert [(p.temperature, p.top_p) for p in engine.params] == expected

    asyncio.run(body())


@pytest.mark.parametrize("fixed", [True, False], ids=["training", "evaluation"])
def test_a_training_server_makes_a_clients_seed_its_sessions_and_turns(tiny, fixed):
    """An agent program that sends one seed on every request: on a training server each
    session's turns sample with seeds of their own (one seed draws the same random numbers
    whatever the context, so every rollout would sample alike); an evaluation's keeps it."""

    async def body():
        run = RunSampling(temperature=1.0, top_p=1.0, fixed=fixed)
        async with serving(tiny, sampling=run) as (gateway, _, client):
            engine = gateway.router.engine("live")
            for _ in range(2):
                headers = {SESSION_HEADER: await open_session(client)}
                messages = list(USER)
                for _ in range(2):
                    chat = {"messages": messages, "max_tokens": 2, "seed": 7}
                    response = await client.post("/v1/chat/completions", json=chat, headers=headers)
                    assert response.status_code == 200, response.text
                    messages = [*messages, response.json()["choices"][0]["message"], USER[-1]]
            seeds = [p.seed for p in engine.params]
            if fixed:
                assert len(set(seeds)) == 4 and 7 not in seeds
            else:
                assert seeds == [7] * 4

    asyncio.run(body())


def test_two_requests_waiting_on_one_session_sample_with_seeds_of_their_own_turns(tiny):
    """A resent ``/v1/generate`` (or an agent's concurrent calls) while a turn generates: each
    waits for the turn before it, and its seed is hashed with the length the session has
    then, not the one both found when they arrived."""

    async def body():
        async with serving(tiny, sampling=RunSampling(fixed=True)) as (gateway, _, client):
            engine = gateway.router.engine("live")
            headers = {SESSION_HEADER: await open_session(client)}
            first = {"token_ids": [1, 2, 40, 41, 42, 3], "max_new_tokens": 2, "stop_ids": [], "seed": 7}
            assert (await client.post("/v1/generate", json=first, headers=headers)).status_code == 200
            session = gateway.session(headers[SESSION_HEADER])
            session._lock = lock = WatchedLock()
            engine.gate = asyncio.Event()
            resent = {"max_new_tokens": 2, "stop_ids": [], "seed": 7}
            requests = [
                asyncio.ensure_future(client.post("/v1/generate", json=resent, headers=headers))
                for _ in range(2)
            ]
            await lock.contended.wait()  # one turn holds the session, the other waits for it
            engine.gate.set()
            for response in await asyncio.gather(*requests):
                assert response.status_code == 200, response.text
            assert len(session.tokens) == 6 + 3 * 2
            seeds = [p.seed for p in engine.params]
            assert len(seeds) == len(set(seeds)) == 3

    asyncio.run(body())


@pytest.mark.parametrize("fixed", [True, False], ids=["training", "evaluation"])
def test_a_training_server_makes_a_token_requests_seed_its_sessions_and_turns_too(tiny, fixed):
    """The token endpoint is an agent program's as much as the OpenAI ones: one seed sent on
    every ``/v1/generate`` of a group's rollouts would sample them all alike on a training
    server; there each session's turns sample with seeds of their own, and the same rollouts
    come out different."""

    async def body():
        run = RunSampling(temperature=1.0, top_p=1.0, fixed=fixed)
        async with serving(tiny, sampling=run) as (gateway, _, client):
            engine = gateway.router.engine("live")
            actions = []
            for rollout in range(2):
                headers = {SESSION_HEADER: await open_session(client, trajectory_id=f"rollout-{rollout}")}
                for token_ids in ([1, 2, 40, 41, 42, 3], [7, 8]):
                    request = {"token_ids": token_ids, "max_new_tokens": 8, "stop_ids": [], "seed": 7}
                    response = await client.post("/v1/generate", json=request, headers=headers)
                    assert response.status_code == 200, response.text
                    actions.append(response.json()["token_ids"])
            seeds = [p.seed for p in engine.params]
            if fixed:
                assert len(set(seeds)) == 4 and 7 not in seeds
                assert actions[:2] != actions[2:]
            else:
                assert seeds == [7] * 4
                assert actions[:2] == actions[2:]

    asyncio.run(body())


def test_a_training_server_samples_a_near_equal_request_at_the_runs_exact_values(tiny):
    """A temperature or top_p off the run's by a rounding (float32, decimal formatting) is the
    run's: served, at exactly the run's; one clearly different is still refused."""

    async def body():
        run = RunSampling(temperature=0.7, top_p=0.9, fixed=True)
        async with serving(tiny, sampling=run) as (gateway, _, client):
            engine = gateway.router.engine("live")
            for sampling in [
                {"temperature": 0.7000000001, "top_p": 0.9},
                {"temperature": 0.7, "top_p": 0.8999999},
            ]:
                headers = {SESSION_HEADER: await open_session(client)}
                response = await client.post(
                    "/v1/generate", json={"token_ids": [5], **sampling}, headers=headers
                )
                assert response.status_code == 200, response.text
            assert [(p.temperature, p.top_p) for p in engine.params] == [(0.7, 0.9)] * 2
            for sampling in [{"temperature": 0.70001}, {"top_p": 0.9001}]:
                headers = {SESSION_HEADER: await open_session(client)}
                response = await client.post(
                    "/v1/generate", json={"token_ids": [5], **sampling}, headers=headers
                )
                assert response.status_code == 400, response.text
            assert len(engine.params) == 2

    asyncio.run(body())


def test_a_messages_text_parts_are_its_content_as_vllm_joins_them(tiny):
    """The OpenAI API's content may be a list of parts, which agent SDKs send: their texts,
    joined by newlines as vLLM joins them for a text model's template, are the content. It
    was refused (``Input should be a valid string``)."""
    _, tokenizer = tiny
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 3?"}]
    joined = [USER[0], {"role": "user", "content": "What is\n2 + 3?"}]

    async def body():
        async with serving(tiny) as (gateway, _, client):
            headers = {SESSION_HEADER: await open_session(client)}
            system = {"role": "system", "content": [{"type": "text", "text": USER[0]["content"]}]}
            sent = [system, {"role": "user", "content": parts}]
            first = await client.post(
                "/v1/chat/completions", json={"messages": sent, "max_tokens": 2}, headers=headers
            )
            assert first.status_code == 200, first.text
            session = gateway.session(headers[SESSION_HEADER])
            prompt = tokenizer.apply_chat_template(joined, add_generation_prompt=True, tokenize=False)
            assert session.tokens[: -len(session.turns[0].token_ids)] == tokenizer.encode(
                prompt, add_special_tokens=False
            )
            reply = first.json()["choices"][0]["message"]["content"]
            as_parts = [
                *sent,
                {"role": "assistant", "content": [{"type": "text", "text": reply}]},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
            ]
            second = await client.post(
                "/v1/chat/completions", json={"messages": as_parts, "max_tokens": 2}, headers=headers
            )
            assert second.status_code == 200, second.text
            as_text = [
                *joined,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "again"},
                second.json()["choices"][0]["message"],
                {"role": "user", "content": "once more"},
            ]
            third = await client.post(
                "/v1/chat/completions", json={"messages": as_text, "max_tokens": 2}, headers=headers
            )
            assert third.status_code == 200, third.text
            assert session.num_turns == 3

    asyncio.run(body())


def test_chat_messages_the_template_cannot_take_are_bad_requests(tiny):
    parts = [{"type": "text", "text": "What is"}, {"type": "image_url", "image_url": {"url": "x"}}]

    async def body():
        async with serving(tiny) as (gateway, _, client):
            sid = await open_session(client)
            headers = {SESSION_HEADER: sid}
            cases = [
                (
                    {"role": "user", "content": parts},
                    "messages.0.content: Value error, content part 1 (type 'image_url') is no text part",
                ),
                (
                    {"role": "user", "content": ["hi"]},
                    "messages.0.content: Value error, content part 0 (type 'str') is no text part",
                ),
                ({"role": "user", "content": 7}, "messages.0.content: Input should be a valid string"),
                ({"role": 7, "content": "hi"}, "messages.0.role: Input should be a valid string"),
                ({"role": "user"}, "the chat template cannot render these messages"),
                ({"role": "user", "content": None}, "the chat template cannot render these messages"),
            ]
            for message, reason in cases:
                response = await client.post(
                    "/v1/chat/completions", json={"messages": [message], "max_tokens": 2}, headers=headers
                )
                assert response.status_code == 400, (message, response.text)
                assert reason in response.json()["error"]["message"]
            first = await client.post(
                "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, headers=headers
            )
            assert first.status_code == 200, first.text
            conversation = [*USER, first.json()["choices"][0]["message"], {"role": "user", "content": parts}]
            later = await client.post(
                "/v1/chat/completions", json={"messages": conversation}, headers=headers
            )
            assert later.status_code == 400 and "messages.3.content" in later.json()["error"]["message"]
            assert gateway.session(sid).num_turns == 1

    asyncio.run(body())


def test_text_holding_a_lone_surrogate_is_a_bad_request_that_changes_nothing(tiny):
    """A program's tool output decoded with ``surrogateescape`` (a file name that is not UTF-8)
    reaches the gateway as a JSON ``\\udce9`` escape (Python's json, JavaScript's JSON.stringify):
    no tokenizer takes it, so the request is a 400 naming it (a 500 before, which OpenAI clients
    retry), and the session is as it was."""
    odd = "ls: report-\udce9.txt"

    def post(client, path, body, headers):
        # json.dumps escapes the surrogate; httpx's json= would fail to encode it
        headers = headers | {"content-type": "application/json"}
        return client.post(path, content=json.dumps(body), headers=headers)

    async def body():
        async with serving(tiny) as (gateway, _, client):
            fresh = {SESSION_HEADER: await open_session(client)}
            chat = {SESSION_HEADER: await open_session(client)}
            first = await client.post(
                "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, headers=chat
            )
            assert first.status_code == 200, first.text
            conversation = [*USER, first.json()["choices"][0]["message"], {"role": "tool", "content": odd}]
            for headers, messages in [(fresh, [{"role": "user", "content": odd}]), (chat, conversation)]:
                session = gateway.session(headers[SESSION_HEADER])
                held = list(session.tokens), list(session.messages)
                response = await post(
                    client, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}, headers
                )
                assert response.status_code == 400, response.text
                message = response.json()["error"]["message"]
                assert (
                    "the rendered messages: '\\udce9' at character" in message and "lone surrogate" in message
                )
                assert (session.tokens, session.messages) == held

            text = {SESSION_HEADER: await open_session(client)}
            response = await post(client, "/v1/completions", {"prompt": odd, "max_tokens": 2}, text)
            assert response.status_code == 400, response.text
            assert "the prompt: '\\udce9' at character 11" in response.json()["error"]["message"]
            assert gateway.session(text[SESSION_HEADER]).tokens == []
            served = await client.post(
                "/v1/completions", json={"prompt": "ls: report.txt", "max_tokens": 2}, headers=text
            )
            assert served.status_code == 200, served.text

    asyncio.run(body())


def test_a_sessions_chat_template_kwargs_are_those_of_its_first_request(tiny):
    """vLLM's per-request ``chat_template_kwargs`` (Qwen3's ``enable_thinking``) render the
    session's prompts; a later request that sends others is refused: the prompt already holds
    what the first ones rendered."""
    model, tokenizer = tiny
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = QWEN3_LIKE
    quiet = {"chat_template_kwargs": {"enable_thinking": False}}
    prompt_end = "<|im_start|>assistant\n<think>\n\n</think>\n\n"

    async def body():
        async with serving((model, thinking)) as (gateway, _, client):
            headers = {SESSION_HEADER: await open_session(client)}
            first = await client.post(
                "/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **quiet}, headers=headers
            )
            assert first.status_code == 200, first.text
            session = gateway.session(headers[SESSION_HEADER])
            action = first.json()["choices"][0]["token_ids"]
            assert thinking.decode(session.tokens[: -len(action)]).endswith(prompt_end)
            held = len(session.tokens)
            message = first.json()["choices"][0]["message"]
            conversation = [*USER, message, {"role": "user", "content": "again"}]
            for other in [{}, {"chat_template_kwargs": {"enable_thinking": True}}]:
                refused = await client.post(
                    "/v1/chat/completions", json={"messages": conversation, **other}, headers=headers
                )
                assert refused.status_code == 400, refused.text
                assert "chat_template_kwargs" in refused.json()["error"]["message"]
            second = await client.post(
                "/v1/chat/completions",
                json={"messages": conversation, "max_tokens": 2, **quiet},
                headers=headers,
            )
            assert second.status_code == 200, second.text
            action = second.json()["choices"][0]["token_ids"]
            appended = thinking.decode(session.tokens[held : -len(action)])
            assert appended.endswith("again<|im_end|>\n" + prompt_end)
            rendering = await client.post(
                "/v1/chat/completions",
                json={"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}},
                headers={SESSION_HEADER: await open_session(client)},
            )
            assert rendering.status_code == 400 and "set by the gateway itself" in rendering.text

    asyncio.run(body())


def test_request_fields_the_gateway_does_not_do_are_refused_naming_them(tiny):
    """vLLM's request extras are honoured at the values that ask for what the gateway does,
    and refused otherwise, never ignored."""

    async def body():
        async with serving(tiny) as (gateway, _, client):
            headers = {SESSION_HEADER: await open_session(client)}
            other_id = next(t for t in range(10) if t not in gateway.stop_ids)
            refused = [
                ("add_generation_prompt", False),
                ("continue_final_message", True),
                ("skip_special_tokens", False),
                ("include_stop_str_in_output", True),
                ("stop_token_ids", [other_id]),
                ("stop_token_ids", [*gateway.stop_ids, other_id]),
                ("n", 2),
                ("stop", ["\n"]),
                ("stop", ["<|im_end|>", "\n"]),
                ("min_tokens", 2),
                ("top_logprobs", 2),
                ("top_k", 5),
                ("response_format", {"type": "json_object"}),
                ("truncate_prompt_tokens", 8),
                ("return_tokens_as_token_ids", True),
                ("reasoning_effort", "low"),
                ("logits_processors", ["my_module.MyProcessor"]),
                ("parallel_tool_calls", False),
                ("function_call", {"name": "f"}),
            ]
            for name, value in refused:
                chat = {"messages": USER, "max_tokens": 2, name: value}
                response = await client.post("/v1/chat/completions", json=chat, headers=headers)
                assert response.status_code == 400, (name, response.text)
                assert name in response.json()["error"]["message"]
            for name, value in [
                ("logprobs", 2),
                ("echo", True),
                ("suffix", " is 5."),
                ("max_completion_tokens", 1),  # a chat field: the budget would be the default
            ]:
                completion = {"prompt": [1, 2, 3], "max_tokens": 2, name: value}
                response = await client.post("/v1/completions", json=completion, headers=headers)
                assert response.status_code == 400, (name, response.text)
                assert name in response.json()["error"]["message"]
            assert gateway.session(headers[SESSION_HEADER]).num_turns == 0
            neutral = {
                "add_generation_prompt": True,
                "skip_special_tokens": True,
                "include_stop_str_in_output": False,
                "stop_token_ids": list(gateway.stop_ids),
                "min_tokens": 0,
                "top_k": -1,
                "top_logprobs": None,
                "parallel_tool_calls": True,
                "stop": ["<|im_end|>"],  # the text of a token it stops at: stops there anyway
                "user": "someone",
            }
            chat = {"messages": USER, "max_tokens": 2, **neutral}
            response = await client.post("/v1/chat/completions", json=chat, headers=headers)
            assert response.status_code == 200, response.text
            completion = {"prompt": "What is 2 + 3?", "max_tokens": 2, "stop": "<|im_end|>"}
            headers = {SESSION_HEADER: await open_session(client)}
            response = await client.post("/v1/completions", json=completion, headers=headers)
            assert response.status_code == 200, response.text

    asyncio.run(body())


def test_tool_choice_none_without_tools_asks_for_nothing_and_is_served(tiny):
    """As vLLM serves it: a harness that turns tool calls off on a request without tools asks
    for nothing the gateway does not do; ``auto`` without tools is still refused."""

    async def body():
        async with serving(tiny) as (gateway, _, client):
            headers = {SESSION_HEADER: await open_session(client)}
            chat = {"messages": USER, "max_tokens": 2, "tool_choice": "none"}
            response = await client.post("/v1/chat/completions", json=chat, headers=headers)
            assert response.status_code == 200, response.text
            assert "tool_calls" not in response.json()["choices"][0]["message"]
            headers = {SESSION_HEADER: await open_session(client)}
            chat = {"messages": USER, "max_tokens": 2, "tool_choice": "auto"}
            response = await client.post("/v1/chat/completions", json=chat, headers=headers)
            assert response.status_code == 400, response.text
            assert "tool_choice 'auto' without tools" in response.json()["error"]["message"]

    asyncio.run(body())


def test_a_token_budget_below_one_is_refused_naming_the_field_the_client_sent(tiny):
    """A client that sends ``max_tokens: 0`` is told about ``max_tokens``, not about the
    engines' ``max_new_tokens``, which it never sent."""

    async def body():
        async with serving(tiny) as (gateway, _, client):
            headers = {SESSION_HEADER: await open_session(client)}
            for path, field, request in [
                ("/v1/chat/completions", "max_tokens", {"messages": USER}),
                ("/v1/chat/completions", "max_completion_tokens", {"messages": USER, "max_tokens": 4}),
                ("/v1/completions", "max_tokens", {"prompt": "What is 2 + 3?"}),
                ("/v1/generate", "max_new_tokens", {"token_ids": [5]}),
            ]:
                for budget in (0, -1):
                    response = await client.post(path, json={**request, field: budget}, headers=headers)
                    assert response.status_code == 400, (path, field, response.text)
                    assert re.search(rf"\b{field}\b", response.json()["error"]["message"]), (
                        field,
                        response.text,
                    )
            assert gateway.session(headers[SESSION_HEADER]).tokens == []

    asyncio.run(body())


def test_a_text_completion_retried_after_an_engine_failure_appends_its_prompt_once(tiny):
    """A first and a later turn each fail on a dead replica (503) after their prompt was
    appended; the client's retry of the same request appends nothing again."""
    _, tokenizer = tiny
    prompt = "What is 2 + 3?"

    async def body():
        async with serving(tiny, dead_replica=True) as (gateway, _, client):
            router = gateway.router
            sid = await session_on(client, router, "dead")
            headers = {SESSION_HEADER: sid}

            async def failed_then_retried(text: str) -> dict:
                request = {"prompt": text, "max_tokens": 3, "seed": 0}
                failed = await client.post("/v1/completions", json=request, headers=headers)
                assert failed.status_code == 503, failed.text
                router.remove(router.assignment(sid))  # the session moves to the live replica ...
                if router.draining:
                    router.undrain("live")  # ... that takes sessions again
                retried = await client.post("/v1/completions", json=request, headers=headers)
                assert retried.status_code == 200, retried.text
                return retried.json()["choices"][0]

            first = await failed_then_retried(prompt)
            dead = VLLMEngine(
                VLLMEngineConfig(base_url="http://127.0.0.1:9", connect_timeout_s=1.0), name="dead-2"
            )
            router.add(dead)
            router.drain("live")  # the session's next turn moves to the dead replica
            try:
                second = await failed_then_retried(prompt + first["text"] + " answer:")
            finally:
                await dead.close()
            return gateway.session(sid).tokens, first["token_ids"], second["token_ids"]

    tokens, first, second = asyncio.run(body())
    suffix = tokenizer.encode(" answer:", add_special_tokens=False)
    assert tokens == tokenizer.encode(prompt) + first + suffix + second


def test_without_a_chat_template_a_completion_stops_at_eos(tiny):
    """A base model's tokenizer has no chat template: a text completion or a token turn that
    names no stop ids still ends at EOS, as ``TokenRequest.stop_ids`` says and as vLLM ends
    one, instead of sampling on past it to the token budget."""
    model, tokenizer = tiny
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = None
    eos = tokenizer.eos_token_id
    text = "What is 2 + 3?"

    async def body():
        async with serving((model, tokenizer)) as (_, _, client):
            for seed in range(100):  # a seed whose 64 tokens sampled past EOS hold it early on
                headers = {SESSION_HEADER: await open_session(client)}
                request = {
                    "token_ids": tokenizer.encode(text),
                    "max_new_tokens": 64,
                    "stop_ids": [],
                    "seed": seed,
                }
                unstopped = (await client.post("/v1/generate", json=request, headers=headers)).json()[
                    "token_ids"
                ]
                if eos in unstopped[:-1]:
                    break
            else:
                pytest.fail("no seed samples EOS within 63 tokens")
            action = unstopped[: unstopped.index(eos) + 1]
            headers = {SESSION_HEADER: await open_session(client)}
            completion = {"prompt": text, "max_tokens": 64, "seed": seed, "logprobs": 0}
            response = await client.post("/v1/completions", json=completion, headers=headers)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "stop" and choice["token_ids"] == action
            # each log-prob names its token as sampled, the special ones too
            assert choice["logprobs"]["tokens"][-1] == tokenizer.eos_token
            headers = {SESSION_HEADER: await open_session(client)}
            request = {"token_ids": tokenizer.encode(text), "max_new_tokens": 64, "seed": seed}
            token_turn = (await client.post("/v1/generate", json=request, headers=headers)).json()
            assert token_turn["finish_reason"] == "stop" and token_turn["token_ids"] == action

    asyncio.run(body())


def test_openai_text_completions_append_only_the_new_suffix(tiny):
    _, tokenizer = tiny

    async def body():
        async with serving(tiny) as (gateway, _, client):
            sid = await open_session(client)
            headers = {SESSION_HEADER: sid}
            first = await client.post(
                "/v1/completions",
                json={"prompt": "What is 2 + 3?", "max_tokens": 6, "seed": 3, "logprobs": 0},
                headers=headers,
            )
            assert first.status_code == 200, first.text
            choice = first.json()["choices"][0]
            session = gateway.session(sid)
            held = list(session.tokens)
            assert held[-len(choice["token_ids"]) :] == choice["token_ids"]
            assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
            prompt = "What is 2 + 3?" + choice["text"] + " answer:"
            second = await client.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 3}, headers=headers
            )
            assert second.status_code == 200, second.text
            new = second.json()["choices"][0]["token_ids"]
            assert session.tokens == held + tokenizer.encode(" answer:", add_special_tokens=False) + new
            bad = await client.post("/v1/completions", json={"prompt": "Something else"}, headers=headers)
            assert bad.status_code == 400 and "does not extend" in bad.json()["error"]["message"]
            token_sid = await open_session(client)
            tokens = await client.post(
                "/v1/completions",
                json={"prompt": [1, 40, 41], "max_tokens": 2},
                headers={SESSION_HEADER: token_sid},
            )
            assert tokens.status_code == 200
            assert gateway.session(token_sid).tokens[:3] == [1, 40, 41]

    asyncio.run(body())


def test_a_completion_prompt_must_be_non_empty_and_extend_the_session(tiny):
    """An empty prompt, text or tokens, is refused as the token endpoint refuses one; a token
    prompt that rewrites the session's tokens is refused and changes nothing."""

    async def body():
        async with serving(tiny) as (gateway, _, client):
            headers = {SESSION_HEADER: await open_session(client)}
            for prompt in ("", []):
                empty = await client.post("/v1/completions", json={"prompt": prompt}, headers=headers)
                assert empty.status_code == 400 and empty.json()["error"]["message"] == "empty prompt"
            session = gateway.session(headers[SESSION_HEADER])
            assert session.tokens == []
            first = await client.post(
                "/v1/completions", json={"prompt": [1, 40, 41], "max_tokens": 2}, headers=headers
            )
            assert first.status_code == 200, first.text
            held = list(session.tokens)
            for prompt in ([1, 40, 99], [1, 40], [7, *held]):
                other = await client.post("/v1/completions", json={"prompt": prompt}, headers=headers)
                assert other.status_code == 400, (prompt, other.text)
                assert "does not extend the session's tokens" in other.json()["error"]["message"]
            assert session.tokens == held and session.num_turns == 1
            # the session's tokens as they are: the next turn goes on from them
            again = await client.post(
                "/v1/completions", json={"prompt": held, "max_tokens": 2, "seed": 3}, headers=headers
            )
            assert again.status_code == 200, again.text
            assert session.tokens == held + again.json()["choices"][0]["token_ids"]

    asyncio.run(body())


def test_a_text_prompt_on_a_session_whose_tokens_no_text_prompt_placed_is_refused(tiny):
    """A text prompt is checked against the text earlier prompts and completions hold; after a
    chat turn or token ids (a token prompt, /v1/generate) the session holds tokens that text does
    not show, so a text prompt would be appended whole behind context its client never sent: it
    is refused and changes nothing. Token prompts, checked against the tokens, may follow text."""

    async def body():
        async with serving(tiny) as (gateway, _, client):
            chat_sid, token_sid, text_sid = [await open_session(client) for _ in range(3)]
            before = [
                ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}, chat_sid),
                ("/v1/completions", {"prompt": [1, 40, 41], "max_tokens": 2}, token_sid),
                ("/v1/completions", {"prompt": "What is 2 + 3?", "max_tokens": 2}, text_sid),
            ]
            for path, request, sid in before:
                response = await client.post(path, json=request, headers={SESSION_HEADER: sid})
                assert response.status_code == 200, response.text
            text = gateway.session(text_sid)
            extended = await client.post(
                "/v1/completions",
                json={"prompt": [*text.tokens, 42], "max_tokens": 2},
                headers={SESSION_HEADER: text_sid},
            )
            assert extended.status_code == 200, extended.text
            for sid in (chat_sid, token_sid, text_sid):
                session = gateway.session(sid)
                held, turns = list(session.tokens), session.num_turns
                response = await client.post(
                    "/v1/completions",
                    json={"prompt": session.transcript + " 5", "max_tokens": 2},
                    headers={SESSION_HEADER: sid},
                )
                assert response.status_code == 400, (sid, response.text)
                assert "no text prompt sent" in response.json()["error"]["message"]
                assert session.tokens == held and session.num_turns == turns

    asyncio.run(body())


def test_a_chat_request_on_a_session_whose_tokens_no_chat_message_placed_is_refused(tiny):
    """A conversation is checked against the messages that placed the session's tokens; after a
    text or token prompt, or tokens sent to /v1/generate, the session holds tokens no message
    shows, so new messages would be appended behind context the client's conversation lacks:
    the request is refused saying so and changes nothing."""

    async def body():
        async with serving(tiny) as (gateway, _, client):
            text_sid, generate_sid = await open_session(client), await open_session(client)
            text = await client.post(
                "/v1/completions",
                json={"prompt": "What is 2 + 3?", "max_tokens": 2},
                headers={SESSION_HEADER: text_sid},
            )
            assert text.status_code == 200, text.text
            chat = await client.post(
                "/v1/chat/completions",
                json={"messages": USER, "max_tokens": 2},
                headers={SESSION_HEADER: generate_sid},
            )
            assert chat.status_code == 200, chat.text
            tokens = await client.post(
                "/v1/generate",
                json={"token_ids": [40, 41], "max_new_tokens": 2},
                headers={SESSION_HEADER: generate_sid},
            )
            assert tokens.status_code == 200, tokens.text
            for sid in (text_sid, generate_sid):
                session = gateway.session(sid)
                held, turns = list(session.tokens), session.num_turns
                # the session's history as it holds it, which the check of a resent one accepts
                conversation = [*session.messages, {"role": "user", "content": "and 4 + 4?"}]
                response = await client.post(
                    "/v1/chat/completions",
                    json={"messages": conversation, "max_tokens": 2},
                    headers={SESSION_HEADER: sid},
                )
                assert response.status_code == 400, (sid, response.text)
                assert "no chat message placed" in response.json()["error"]["message"]
                assert session.tokens == held and session.num_turns == turns

    asyncio.run(body())


def sse_chunks(response: httpx.Response) -> list:
    """The JSON chunks of a server-sent event stream, which must end with ``[DONE]``."""
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]", events
    return [json.loads(event) for event in events[:-1]]


def test_a_replys_budget_usage_and_log_probs_are_as_the_request_asks(tiny):
    """``max_completion_tokens`` (the OpenAI API's newer name) wins over ``max_tokens`` and
    neither falls back to the gateway's budget; usage counts the prompt the turn saw; log-probs
    and a stream's usage chunk come only when asked for."""
    _, tokenizer = tiny

    async def body():
        async with serving(tiny) as (gateway, _, client):
            engine = gateway.router.engine("live")
            headers = {SESSION_HEADER: await open_session(client)}
            chat = {"messages": USER, "max_tokens": 6, "max_completion_tokens": 2, "seed": 1}
            response = await client.post("/v1/chat/completions", json=chat, headers=headers)
            assert response.status_code == 200, response.text
            reply = response.json()
            prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
            action = reply["choices"][0]["token_ids"]
            assert reply["usage"] == {
                "prompt_tokens": len(tokenizer.encode(prompt, add_special_tokens=False)),
                "completion_tokens": len(action),
                "total_tokens": len(gateway.session(headers[SESSION_HEADER]).tokens),
            }
            assert reply["choices"][0]["logprobs"] is None
            turn = await client.post(
                "/v1/generate", json={"token_ids": [5]}, headers={SESSION_HEADER: await open_session(client)}
            )
            assert turn.status_code == 200, turn.text
            assert [p.max_new_tokens for p in engine.params] == [2, gateway.config.max_new_tokens]

            for options, chunks in [
                ({}, 2),
                ({"stream_options": {"include_usage": False}}, 2),
                ({"stream_options": {"include_usage": True}}, 3),
            ]:
                headers = {SESSION_HEADER: await open_session(client)}
                streamed = {"messages": USER, "max_tokens": 2, "stream": True, **options}
                response = await client.post("/v1/chat/completions", json=streamed, headers=headers)
                assert response.status_code == 200, response.text
                events = sse_chunks(response)
                assert len(events) == chunks, (options, events)
                assert all("usage" not in event for event in events[:2])
                assert {event["object"] for event in events} == {"chat.completion.chunk"}
                text, end = (event["choices"][0] for event in events[:2])
                assert text["finish_reason"] is None and end["finish_reason"] in ("stop", "length")

    asyncio.run(body())


def test_a_chat_request_retried_after_an_engine_failure_appends_its_messages_once(tiny):
    """As a text completion's: the failed turn left the conversation's new messages in the
    session, so the client's retry of the same request sends nothing new and is served."""
    _, tokenizer = tiny

    async def body():
        async with serving(tiny, dead_replica=True) as (gateway, _, client):
            router = gateway.router
            sid = await session_on(client, router, "dead")
            headers = {SESSION_HEADER: sid}
            request = {"messages": USER, "max_tokens": 3, "seed": 0}
            failed = await client.post("/v1/chat/completions", json=request, headers=headers)
            assert failed.status_code == 503, failed.text
            router.remove(router.assignment(sid))
            retried = await client.post("/v1/chat/completions", json=request, headers=headers)
            assert retried.status_code == 200, retried.text
            session = gateway.session(sid)
            assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
            return session.tokens, retried.json()["choices"][0]["token_ids"]

    tokens, action = asyncio.run(body())
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert tokens == tokenizer.encode(prompt, add_special_tokens=False) + action


def test_an_app_without_a_bearer_token_is_refused(tiny):
    model, tokenizer = tiny

    async def body():
        engine = TorchEngine(copy.deepcopy(model), tokenizer, name="live")
        try:
            with pytest.raises(ValueError, match="the gateway needs a non-empty bearer token"):
                create_app(Gateway(Router([engine]), tokenizer), "")
        finally:
            await engine.close()

    asyncio.run(body())


def test_a_text_completions_later_suffix_gets_no_special_tokens_of_a_tokenizer_that_adds_bos(tiny):
    """A Llama-like tokenizer begins every encoding with BOS: only the session's first prompt
    holds it, not each suffix a later prompt adds."""
    model, tokenizer = tiny
    bos = copy.deepcopy(tokenizer)
    bos.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos.bos_token} $A", special_tokens=[(bos.bos_token, bos.bos_token_id)]
    )
    assert bos.encode(" answer:")[0] == bos.bos_token_id, "precondition: the tokenizer adds BOS"

    async def body():
        async with serving((model, bos)) as (gateway, _, client):
            headers = {SESSION_HEADER: await open_session(client)}
            prompt = "What is 2 + 3?"
            first = await client.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 3}, headers=headers
            )
            assert first.status_code == 200, first.text
            prompt += first.json()["choices"][0]["text"] + " answer:"
            second = await client.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=headers
            )
            assert second.status_code == 200, second.text
            turns = [response.json()["choices"][0]["token_ids"] for response in (first, second)]
            return gateway.session(headers[SESSION_HEADER]).tokens, turns

    tokens, (first, second) = asyncio.run(body())
    suffix = bos.encode(" answer:", add_special_tokens=False)
    assert tokens == bos.encode("What is 2 + 3?") + first + suffix + second


def test_a_text_prompt_that_holds_its_own_bos_is_sent_without_special_tokens_as_to_vllm(tiny):
    """A client that renders its chat template itself sends the prompt with its BOS and
    ``add_special_tokens: false`` (vLLM's field): the gateway added a second BOS all the same.
    A chat request, whose template writes every special token, refuses ``true``."""
    model, tokenizer = tiny
    bos = copy.deepcopy(tokenizer)
    bos.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos.bos_token} $A", special_tokens=[(bos.bos_token, bos.bos_token_id)]
    )
    prompt = f"{bos.bos_token}What is 2 + 3?"

    async def body():
        async with serving((model, bos)) as (gateway, _, client):
            headers = {SESSION_HEADER: await open_session(client)}
            completion = {"prompt": prompt, "max_tokens": 2, "add_special_tokens": False}
            response = await client.post("/v1/completions", json=completion, headers=headers)
            assert response.status_code == 200, response.text
            tokens = gateway.session(headers[SESSION_HEADER]).tokens
            assert tokens[: -len(response.json()["choices"][0]["token_ids"])] == bos.encode(
                prompt, add_special_tokens=False
            )
            assert tokens.count(bos.bos_token_id) == 1

            headers = {SESSION_HEADER: await open_session(client)}
            chat = {"messages": USER, "max_tokens": 2, "add_special_tokens": True}
            refused = await client.post("/v1/chat/completions", json=chat, headers=headers)
            assert refused.status_code == 400, refused.text
            assert "add_special_tokens" in refused.json()["error"]["message"]
            chat["add_special_tokens"] = False
            assert (await client.post("/v1/chat/completions", json=chat, headers=headers)).status_code == 200

    asyncio.run(body())


def test_a_long_text_prompt_is_tokenized_off_the_event_loop_and_a_short_one_on_it(tiny, monkeypatch):
    """As queued chat text: a long text completion prompt tokenized on the event loop stalled
    every rollout, the gateway and the heartbeats for as long (about a microsecond a character)."""
    _, tokenizer = tiny
    threads = []
    real_encode = tokenizer.encode

    def encode(text, *args, **kwargs):
        threads.append(threading.get_ident())
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)

    async def body():
        async with serving(tiny) as (_, _, client):
            headers = {SESSION_HEADER: await open_session(client)}
            threads.clear()
            short = await client.post(
                "/v1/completions", json={"prompt": "What is 2 + 3?", "max_tokens": 2}, headers=headers
            )
            assert short.status_code == 200, short.text
            assert threads == [threading.get_ident()]
            prompt = "What is 2 + 3?" + short.json()["choices"][0]["text"] + "7" * (RENDER_INLINE_CHARS + 1)
            threads.clear()
            long = await client.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=headers
            )
            assert long.status_code == 400 and "max_context_tokens=256" in long.json()["error"]["message"]
            assert threads and threading.get_ident() not in threads

    asyncio.run(body())


def test_serves_on_a_unix_domain_socket(tiny, tmp_path):
    async def body():
        async with serving(tiny, uds=str(tmp_path / "gateway.sock")) as (_, _, client):
            sid = await open_session(client)
            response = await client.post(
                "/v1/chat/completions",
                json={"messages": USER, "max_tokens": 3},
                headers={SESSION_HEADER: sid},
            )
            assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) <= 3

    asyncio.run(body())


def test_a_start_cancelled_before_the_socket_is_bound_leaves_no_server_running(tiny):
    """As the rollout service's first self-driving rollout does when a stop cancels it while
    it starts the service's gateway: no server task is left serving for nobody."""
    model, tokenizer = tiny

    async def body():
        engine = TorchEngine(copy.deepcopy(model), tokenizer, name="live")
        try:
            starting = asyncio.create_task(GatewayServer(Gateway(Router([engine]), tokenizer)).start())
            await asyncio.sleep(0)  # start() has created the server task and waits for it to bind
            starting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await starting
            assert asyncio.all_tasks() == {asyncio.current_task()}
        finally:
            await engine.close()

    asyncio.run(body())


def test_a_port_already_taken_is_an_error_the_caller_can_handle(tiny):
    """uvicorn exits the process when it cannot bind; the server raises instead."""
    model, tokenizer = tiny

    async def body():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            engine = TorchEngine(copy.deepcopy(model), tokenizer, name="live")
            try:
                with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
                    await GatewayServer(Gateway(Router([engine]), tokenizer), port=port).start()
            finally:
                await engine.close()

    asyncio.run(body())


def test_a_signal_to_the_process_reaches_its_handler_and_the_gateway_keeps_serving(tiny):
    """The gateway serves inside its process's event loop: a SIGTERM (or Ctrl-C) goes to the
    handler the process set (a worker's clean shutdown), not to uvicorn, which would shut
    the gateway down under the rollouts still talking to it."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: received.append(sig))

    async def body():
        async with serving(tiny) as (_, _, client):
            sid = await open_session(client)
            signal.raise_signal(signal.SIGTERM)
            assert received == [signal.SIGTERM]
            turn = await client.post(
                "/v1/generate",
                json={"token_ids": [1, 2, 3], "max_new_tokens": 2},
                headers={SESSION_HEADER: sid},
            )
            assert turn.status_code == 200, turn.text

    try:
        asyncio.run(body())
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_client_stalled_mid_body_does_not_hold_the_servers_stop_for_ever(tiny):
    """A stop lets the requests in flight finish, but not without end: one whose client sent
    half its body and went quiet held the stop (and a worker's shutdown behind it) for ever.
    Past the drain timeout it is cancelled and answered 503 (the server stops), and the stop returns."""
    model, tokenizer = tiny

    async def body():
        engine = TorchEngine(copy.deepcopy(model), tokenizer, name="live")
        server = await GatewayServer(Gateway(Router([engine]), tokenizer), drain_timeout_s=1).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            head = (
                f"POST /v1/sessions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {server.token}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            )
            writer.write(head.encode() + b'{"task"')
            await writer.drain()
            while not server._server.server_state.tasks:  # the request is in flight, reading its body
                await asyncio.sleep(0.01)
            started = time.monotonic()
            await asyncio.wait_for(server.stop(), 20)
            stopped = time.monotonic() - started
            reply = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        finally:
            await engine.close()
        return stopped, reply

    stopped, reply = asyncio.run(body())
    assert stopped < 10
    assert reply.startswith(b"HTTP/1.1 503") and b"the gateway server is stopping" in reply


async def closed(gateway: Gateway, session_id: str) -> None:
    """Until ``session_id`` is no open session of ``gateway``."""
    deadline = time.monotonic() + 30
    while session_id in gateway.sessions:
        assert time.monotonic() < deadline, f"session {session_id!r} was never ended"
        await asyncio.sleep(0.01)


def live_sessions(router: Router) -> int:
    return sum(len(ages) for ages in router.session_ages().values())


def test_a_session_abandoned_over_http_is_ended_after_its_idle_time_and_a_later_request_told_why(
    tiny, caplog
):
    """A harness that opened a session and never deleted it (it crashed) left it open and
    pinned for the server's life: a live session for the worker's status, its tokens in
    memory, its trajectory_id held. Past the idle time (the server's clock, set by hand, run
    past it) the server's sweep ends it as DELETE ends it, logs it in one line, and a request
    naming it is told why it is gone; a session opened in-process (the rollout service's,
    which closes its own) is not ended."""
    now = [0.0]

    async def body():
        async with serving(tiny, idle_timeout_s=0.3) as (gateway, server, client):
            server.idle.clock = lambda: now[0]
            router = gateway.router
            own = gateway.open(task="arith", prompt_id="p1")
            sid = await open_session(client, trajectory_id="abandoned")
            headers = {SESSION_HEADER: sid}
            turn = await client.post(
                "/v1/generate", json={"token_ids": [1, 2], "max_new_tokens": 2}, headers=headers
            )
            assert turn.status_code == 200, turn.text
            assert live_sessions(router) == 1 and router.load("live") == 1

            now[0] = 100.0
            await closed(gateway, sid)
            assert gateway.sessions == [own.session_id]
            assert live_sessions(router) == 0 and router.load("live") == 0 and router.assignment(sid) is None
            # no record of it reaches the trainer: no ended rollout for the elastic forecast
            assert (router.sessions_expired, router.sessions_ended, list(router.session_lengths)) == (
                1,
                0,
                [],
            )
            requests = [
                client.post("/v1/generate", json={"token_ids": [3]}, headers=headers),
                client.post("/v1/chat/completions", json={"messages": USER}, headers=headers),
                client.post(f"/v1/sessions/{sid}/record", json={}),
                client.delete(f"/v1/sessions/{sid}"),
            ]
            for request in requests:
                response = await request
                assert response.status_code == 404, response.text
                assert response.json()["error"]["message"] == (
                    f"session '{sid}' was closed after 100.0 s idle (no request for over "
                    "idle_timeout_s=0.3 s); open a new one"
                )
            other = await open_session(client)
            refused = await client.delete(f"/v1/sessions/{other}", params={"continued_in": sid})
            assert refused.status_code == 400 and refused.json()["error"]["message"] == (
                f"continued_in '{sid}' is no open session: session '{sid}' was closed after 100.0 s "
                "idle (no request for over idle_timeout_s=0.3 s); open a new one"
            )
            # its trajectory_id is free for a retry
            await open_session(client, trajectory_id="abandoned")
            # its id opened again and deleted is no longer said to have idled out
            await open_session(client, session_id=sid)
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200
            gone = await client.delete(f"/v1/sessions/{sid}")
            assert gone.status_code == 404 and "idle" not in gone.json()["error"]["message"], gone.text
            return sid

    with caplog.at_level(logging.WARNING, logger="rollout.gateway_http"):
        sid = asyncio.run(body())
    logged = [r.getMessage() for r in caplog.records if r.name == "rollout.gateway_http"]
    assert logged == [f"closed session '{sid}' after 100.0 s idle (idle_timeout_s=0.3)"]


def test_a_session_whose_record_was_answered_and_that_idles_out_is_an_ended_rollout(tiny, monkeypatch):
    """A harness that got its session's record (a 200), which may well reach the trainer, and
    never deleted the session: the sweep counted it as expired, as a crashed harness's, out of
    the ended rollouts and lengths the elastic controller forecasts from. It counts as an
    ended rollout, as long as up to its last request's end; a session whose record was refused
    (a 400) still counts as expired. The server's and the router's clocks are set by hand."""
    now = [0.0]
    monkeypatch.setattr("rollout.router.time", types.SimpleNamespace(monotonic=lambda: now[0]))

    async def body():
        async with serving(tiny, idle_timeout_s=60) as (gateway, server, client):
            server.idle.clock = lambda: now[0]
            router = gateway.router
            recorded, refused = await open_session(client), await open_session(client)
            now[0] = 2.0
            for sid in (recorded, refused):
                turn = await client.post(
                    "/v1/generate",
                    json={"token_ids": [1, 2], "max_new_tokens": 2},
                    headers={SESSION_HEADER: sid},
                )
                assert turn.status_code == 200, turn.text
            now[0] = 7.0
            answered = await client.post(f"/v1/sessions/{recorded}/record", json={"reward": 1.0})
            assert answered.status_code == 200, answered.text
            bad = await client.post(f"/v1/sessions/{refused}/record", json={"status": "ok", "error": "boom"})
            assert bad.status_code == 400, bad.text

            now[0] = 107.0
            server.idle.sweep()
            assert gateway.sessions == []
            assert (router.sessions_ended, router.sessions_expired) == (1, 1)
            assert (list(router.session_lengths), list(router.session_contexts)) == ([5.0], [1])
            gone = await client.post(
                "/v1/generate", json={"token_ids": [3]}, headers={SESSION_HEADER: recorded}
            )
            assert gone.status_code == 404 and "closed after 100.0 s idle" in gone.text, gone.text

    asyncio.run(body())


def test_a_session_that_idles_out_before_its_first_turn_counts_as_expired(tiny):
    """A harness that crashed between opening its session and its first turn left a session the
    router never routed: the sweep ended it, but the worker's status counted it in neither
    ``sessions_expired`` nor ``sessions_ended``, as if it had never been. It counts as expired,
    as one that idled out after a turn does (the server's clock set by hand)."""
    now = [0.0]

    async def body():
        async with serving(tiny, idle_timeout_s=60) as (gateway, server, client):
            server.idle.clock = lambda: now[0]
            router = gateway.router
            sid = await open_session(client)
            now[0] = 100.0
            assert server.idle.sweep() == [sid]
            assert (router.sessions_expired, router.sessions_ended) == (1, 0)

    asyncio.run(body())


def test_a_session_with_requests_in_flight_is_not_idle_and_counts_idle_from_their_end(tiny):
    """A turn generating or queued across the idle time does not count as idle: the session
    is ended only once it has had no request for the idle time since its last one ended
    (driven by the server's clock, set by hand)."""
    now = [0.0]

    async def body():
        async with serving(tiny, idle_timeout_s=60) as (gateway, server, client):
            server.idle.clock = lambda: now[0]
            engine = gateway.router.engine("live")
            engine.gate = asyncio.Event()
            sid = await open_session(client)
            headers = {SESSION_HEADER: sid}
            session = gateway.session(sid)
            session._lock = WatchedLock()
            generating = asyncio.create_task(
                client.post("/v1/generate", json={"token_ids": [1, 2], "max_new_tokens": 2}, headers=headers)
            )
            await turn_running(session)
            queued = asyncio.create_task(
                client.post("/v1/generate", json={"token_ids": [3], "max_new_tokens": 2}, headers=headers)
            )
            await session._lock.contended.wait()
            now[0] = 1000.0
            assert server.idle.sweep() == [] and gateway.sessions == [sid]
            engine.gate.set()
            for response in (await generating, await queued):
                assert response.status_code == 200, response.text
            # each request's end is stamped as its reply is made, before it is sent
            assert server.idle.idle_for(sid) == 0.0
            now[0] = 1060.0  # idle for the idle time, not over it
            assert server.idle.sweep() == [] and gateway.sessions == [sid]
            now[0] = 1061.0
            assert server.idle.sweep() == [sid] and gateway.sessions == []
            gone = await client.post("/v1/generate", json={"token_ids": [3]}, headers=headers)
            assert gone.status_code == 404 and "closed after 61.0 s idle" in gone.text, gone.text

    asyncio.run(body())


def test_with_the_idle_timeout_off_an_abandoned_session_stays_open(tiny):
    """``idle_timeout_s=None`` ends no session; a server ends only the sessions opened over it
    (here: while another server of the same gateway, with a short idle time, ends its own)."""

    async def body():
        async with serving(tiny, idle_timeout_s=None) as (gateway, server, client):
            assert server.idle.idle_timeout_s is None
            # a sweep every quarter of the idle time, but at least every 15 s: a session idle
            # for the default half hour is ended within 15 s of it, not 7.5 minutes
            assert GatewayServer(gateway).idle.sweep_every_s == 15.0
            for bad in (0, -1, float("inf"), float("nan")):
                with pytest.raises(
                    ValueError, match=r"idle_timeout_s=\S+ is not a finite number of seconds > 0"
                ):
                    GatewayServer(gateway, idle_timeout_s=bad)
            kept = await open_session(client)
            async with (
                GatewayServer(gateway, idle_timeout_s=0.3) as sweeping,
                httpx.AsyncClient(
                    base_url=sweeping.url, headers={"Authorization": f"Bearer {sweeping.token}"}, timeout=60
                ) as other,
            ):
                ended = await open_session(other)
                await closed(gateway, ended)
            assert gateway.sessions == [kept]
            turn = {"token_ids": [1, 2], "max_new_tokens": 2}
            assert (
                await client.post("/v1/generate", json=turn, headers={SESSION_HEADER: kept})
            ).status_code == 200

    asyncio.run(body())


@pytest.mark.parametrize("idle_timeout_s", [IDLE_TIMEOUT_S, None])
def test_the_sessions_opened_over_a_server_are_ended_at_its_stop(tiny, idle_timeout_s):
    """A server stopped (the worker's end) left the sessions its harnesses opened open in the
    gateway, pinned to their replicas, their tokens held, until the process ended: no request
    could reach them any more to end them. Its stop ends them as the sweep would (one whose
    record was answered an ended rollout, any other expired), whatever its idle timeout, and
    leaves the sessions opened in-process, and over another server, to their openers."""

    async def body():
        async with serving(tiny, idle_timeout_s=idle_timeout_s) as (gateway, server, client):
            router = gateway.router
            own = gateway.open(task="arith", prompt_id="p1")
            async with (
                GatewayServer(gateway, idle_timeout_s=idle_timeout_s) as other_server,
                httpx.AsyncClient(
                    base_url=other_server.url,
                    headers={"Authorization": f"Bearer {other_server.token}"},
                    timeout=60,
                ) as other,
            ):
                kept = await open_session(other)
                recorded, abandoned = await open_session(client), await open_session(client)
                for sid in (recorded, abandoned):
                    turn = await client.post(
                        "/v1/generate",
                        json={"token_ids": [1, 2], "max_new_tokens": 2},
                        headers={SESSION_HEADER: sid},
                    )
                    assert turn.status_code == 200, turn.text
                answered = await client.post(f"/v1/sessions/{recorded}/record", json={"reward": 1.0})
                assert answered.status_code == 200, answered.text
                assert live_sessions(router) == 2

                await server.stop()
                assert sorted(gateway.sessions) == sorted([own.session_id, kept])
                assert live_sessions(router) == 0 and router.load("live") == 0
                assert (router.sessions_ended, router.sessions_expired) == (1, 1)

    asyncio.run(body())


def test_a_delete_continued_in_a_branch_counts_the_rollout_once(tiny):
    """An outside harness that continues a compacted rollout in a branch and deletes the
    parent with ``continued_in`` has the router count one ended rollout of two contexts, as
    the in-process rollout service does; a ``continued_in`` that is no id, the session itself
    or no open session is refused with a one-line 400 that closes nothing; a session that is not
    open is a 404, whatever its ``continued_in``."""

    async def body():
        async with serving(tiny) as (gateway, _, client):
            router = gateway.router
            turn = {"token_ids": [1, 2], "max_new_tokens": 2}
            parent = await open_session(client, trajectory_id="context-1")
            branch = await open_session(client, trajectory_id="context-2", parent_id="context-1")
            for sid in (parent, branch):
                response = await client.post("/v1/generate", json=turn, headers={SESSION_HEADER: sid})
                assert response.status_code == 200, response.text
            refused = [
                ("", "continued_in '': an id must hold something other than whitespace"),
                (" ", "continued_in ' ': an id must hold something other than whitespace"),
                (parent, f"session '{parent}' cannot continue in itself"),
                ("elsewhere", "continued_in 'elsewhere' is no open session"),
            ]
            for continued_in, message in refused:
                response = await client.delete(
                    f"/v1/sessions/{parent}", params={"continued_in": continued_in}
                )
                assert response.status_code == 400, response.text
                text = response.json()["error"]["message"]
                assert text.startswith(message) and "\n" not in text, text
            for continued_in in (branch, "nobody", "elsewhere"):
                unknown = await client.delete("/v1/sessions/nobody", params={"continued_in": continued_in})
                assert unknown.status_code == 404, (continued_in, unknown.text)
            assert sorted(gateway.sessions) == sorted([parent, branch]) and live_sessions(router) == 2

            response = await client.delete(f"/v1/sessions/{parent}", params={"continued_in": branch})
            assert response.status_code == 200, response.text
            assert gateway.sessions == [branch] and router.sessions_ended == 0 and live_sessions(router) == 1
            assert (await client.delete(f"/v1/sessions/{branch}")).status_code == 200
            assert (router.sessions_ended, list(router.session_contexts)) == (1, [2])

    asyncio.run(body())


def test_a_request_whose_body_is_still_arriving_keeps_its_session_from_the_sweep(tiny):
    """A request is in progress from when it is routed, not from when its body has arrived:
    a harness that sends a turn just before the idle time runs out, its body slow to arrive
    (a long conversation, a slow link), had its session ended by a sweep that came meanwhile,
    and a 404 saying it was idle. The body held back until a sweep has run past the idle time
    (the server's clock, set by hand), the turn is answered."""
    now = [0.0]

    async def body():
        async with serving(tiny, idle_timeout_s=60) as (gateway, server, client):
            server.idle.clock = lambda: now[0]
            sid = await open_session(client)
            release = asyncio.Event()

            async def slow_body():
                yield b'{"token_ids": [1, 2], '
                await release.wait()
                yield b'"max_new_tokens": 2}'

            turn = asyncio.create_task(
                client.post(
                    "/v1/generate",
                    content=slow_body(),
                    headers={SESSION_HEADER: sid, "Content-Type": "application/json"},
                )
            )
            deadline = time.monotonic() + 30
            while server.idle.idle_for(sid) is not None:
                assert time.monotonic() < deadline, "the request arriving was never counted in progress"
                await asyncio.sleep(0.01)
            now[0] = 1000.0
            assert server.idle.sweep() == [] and gateway.sessions == [sid]
            release.set()
            response = await turn
            assert response.status_code == 200, response.text

    asyncio.run(body())


def test_a_request_refused_for_its_token_does_not_keep_a_session_from_idling(tiny):
    """Only an authorized request counts as the session's: one with a wrong or no bearer
    token naming a session (whoever learned its id) is refused 401 and leaves its idle time
    running (the server's clock, set by hand)."""
    now = [0.0]

    async def body():
        async with serving(tiny, idle_timeout_s=60) as (gateway, server, client):
            server.idle.clock = lambda: now[0]
            sid = await open_session(client)
            now[0] = 50.0
            turn = {"token_ids": [1, 2], "max_new_tokens": 2}
            for authorization in ("Bearer wrong", ""):
                refused = [
                    await client.post(
                        "/v1/generate",
                        json=turn,
                        headers={SESSION_HEADER: sid, "Authorization": authorization},
                    ),
                    await client.delete(f"/v1/sessions/{sid}", headers={"Authorization": authorization}),
                ]
                assert [response.status_code for response in refused] == [401, 401]
            assert server.idle.idle_for(sid) == 50.0
            now[0] = 61.0
            assert server.idle.sweep() == [sid]

    asyncio.run(body())


def test_a_session_the_sweep_cannot_close_is_logged_once_and_the_others_still_expire(
    tiny, caplog, monkeypatch
):
    """A sweep whose close of one session raised ended the sweeping task, silently: no session
    expired for the rest of the server's life. The failure is logged once, naming the session
    (its message masked); the other idle session is ended all the same, the failing one is
    tried again each round, silently, and ended once its close works. A round that fails as a
    whole (here its clock) is logged and the next rounds run (the server's clock set by hand)."""
    now = [0.0]
    clock_broken = [False]

    def clock() -> float:
        if clock_broken[0]:
            raise RuntimeError("clock unavailable")
        return now[0]

    async def body():
        async with serving(tiny, idle_timeout_s=0.3) as (gateway, server, client):
            server.idle.clock = clock
            stuck = await open_session(client, session_id="stuck")
            other = await open_session(client, session_id="other")
            close = gateway.close

            def close_but_stuck(session_id, *args, **kwargs):
                if session_id == stuck:
                    raise RuntimeError("replica release failed (key AKIAABCDEFGHIJKLMNOP)")
                close(session_id, *args, **kwargs)

            monkeypatch.setattr(gateway, "close", close_but_stuck)
            now[0] = 100.0
            await closed(gateway, other)
            assert server.idle.sweep() == [] and server.idle.sweep() == []
            assert gateway.sessions == [stuck]
            monkeypatch.setattr(gateway, "close", close)
            await closed(gateway, stuck)

            later = await open_session(client, session_id="later")
            clock_broken[0] = True
            deadline = time.monotonic() + 30
            while not any("sweep failed" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the failed round was never logged"
                await asyncio.sleep(0.01)
            clock_broken[0] = False
            now[0] = 200.0
            await closed(gateway, later)
            assert not server._sweeping.done()

    with caplog.at_level(logging.WARNING, logger="rollout.gateway_http"):
        asyncio.run(body())
    logged = [r.getMessage() for r in caplog.records if r.name == "rollout.gateway_http"]
    assert logged == [
        "could not close session 'stuck' idle for 100.0 s (RuntimeError: replica release failed "
        "(key **********)); the sweep tries it again each round",
        "closed session 'other' after 100.0 s idle (idle_timeout_s=0.3)",
        "closed session 'stuck' after 100.0 s idle (idle_timeout_s=0.3)",
        "the idle-session sweep failed (RuntimeError: clock unavailable); it runs again every 0.075 s",
        "closed session 'later' after 100.0 s idle (idle_timeout_s=0.3)",
    ]


def test_the_sweeps_failures_are_logged_once_for_each_run_of_them(tiny, caplog):
    """A sweep that fails each round is logged once, not every round (a line every
    ``sweep_every_s``), and again when it fails after a round that worked: each run of failures
    is one line. The sweep's outcomes are scripted; the rounds are waited for, not timed."""

    async def body():
        async with serving(tiny, idle_timeout_s=0.3) as (_, server, _client):
            outcomes = [RuntimeError("first"), RuntimeError("again"), None, RuntimeError("after one worked")]
            swept = asyncio.Event()

            def sweep() -> list[str]:
                outcome = outcomes.pop(0) if outcomes else None
                if not outcomes:
                    swept.set()
                if outcome is not None:
                    raise outcome
                return []

            server.idle.sweep = sweep
            await asyncio.wait_for(swept.wait(), 30)

    with caplog.at_level(logging.WARNING, logger="rollout.gateway_http"):
        asyncio.run(body())
    logged = [r.getMessage() for r in caplog.records if r.name == "rollout.gateway_http"]
    assert logged == [
        f"the idle-session sweep failed (RuntimeError: {why}); it runs again every 0.075 s"
        for why in ("first", "after one worked")
    ]


def test_a_deleted_session_is_let_go_by_the_next_sweep(tiny):
    """The sweep keeps each session opened over HTTP until it ends; one deleted (or closed
    in-process) is let go at the next round, its tokens with it, not held for the server's life."""

    async def body():
        async with serving(tiny, idle_timeout_s=60) as (gateway, server, client):
            sid = await open_session(client)
            turn = await client.post(
                "/v1/generate", json={"token_ids": [1, 2], "max_new_tokens": 2}, headers={SESSION_HEADER: sid}
            )
            assert turn.status_code == 200, turn.text
            session = weakref.ref(gateway.session(sid))
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200
            assert server.idle.sweep() == []
            gc.collect()
            assert session() is None, "the server still holds the deleted session"

    asyncio.run(body())


def test_a_server_remembers_the_last_sessions_it_ended_for_idling(tiny, monkeypatch):
    """The ids of the sessions ended for idling are kept to tell a later request why its session
    is gone, the last ``REMEMBERED_EXPIRIES`` of them (here 1): a server's memory of them is
    bounded, the oldest forgotten first (the server's clock set by hand)."""
    monkeypatch.setattr("rollout.gateway_http.REMEMBERED_EXPIRIES", 1)
    now = [0.0]

    async def body():
        async with serving(tiny, idle_timeout_s=60) as (_, server, client):
            server.idle.clock = lambda: now[0]
            older = await open_session(client)
            now[0] = 10.0
            newer = await open_session(client)
            now[0] = 100.0
            assert server.idle.sweep() == [older, newer]
            gone = {sid: await client.delete(f"/v1/sessions/{sid}") for sid in (older, newer)}
            assert [response.status_code for response in gone.values()] == [404, 404]
            assert "idle" not in gone[older].json()["error"]["message"], gone[older].text
            assert "closed after 90.0 s idle" in gone[newer].json()["error"]["message"], gone[newer].text

    asyncio.run(body())


def test_a_record_saying_ok_with_an_error_is_refused_and_its_session_stays_open(tiny):
    """``ok`` says the rollout ended as it should and ``error`` why it did not: a record with
    both (``ok`` sent, or the default of a session whose last action was not cut at its budget)
    is refused with a one-line 400 that does not echo the error, and the session stays open
    for the harness to resend it with the status the error explains. A session whose last
    action hit its budget defaults to ``truncated``, which an error may explain."""

    async def body():
        async with serving(tiny) as (gateway, _, client):
            sid = await open_session(client)
            path = f"/v1/sessions/{sid}/record"
            contradictory = [
                ({"status": "ok", "error": "tests failed"}, "status ok"),
                ({"error": "tests failed"}, "status ok (the default: its last action was not truncated)"),
                ({"status": "ok", "error": ""}, "status ok"),
            ]
            for sent, said in contradictory:
                refused = await client.post(path, json={"reward": 1.0, **sent})
                assert refused.status_code == 400, refused.text
                assert refused.json()["error"]["message"] == (
                    f"{said} with an error: an ok rollout has none; send the status the error "
                    "explains (truncated, env_error, infra_error, timeout) or leave error out"
                )
            assert gateway.sessions == [sid]
            resent = await client.post(path, json={"status": "env_error", "error": "tests failed"})
            assert resent.status_code == 200, resent.text
            assert (resent.json()["status"], resent.json()["error"]) == ("env_error", "tests failed")

            cut = await client.post(
                "/v1/generate",
                json={"token_ids": [1, 2], "max_new_tokens": 2, "stop_ids": []},
                headers={SESSION_HEADER: sid},
            )
            assert cut.json()["finish_reason"] == "length", cut.text
            truncated = await client.post(path, json={"error": "context limit: 256 tokens"})
            assert truncated.status_code == 200, truncated.text
            assert truncated.json()["status"] == "truncated"

    asyncio.run(body())


def test_a_record_with_an_empty_status_and_an_error_is_refused_for_its_status(tiny):
    """An empty status was taken for none: a record sending ``""`` with an error was told it
    said ``ok`` by default, and one sending it without an error that its status is unknown. It
    is refused for the status it sent, error or not."""

    async def body():
        async with serving(tiny) as (gateway, _, client):
            sid = await open_session(client)
            for sent in ({"status": ""}, {"status": "", "error": "tests failed"}):
                refused = await client.post(f"/v1/sessions/{sid}/record", json=sent)
                assert refused.status_code == 400, refused.text
                assert refused.json()["error"]["message"].startswith("unknown status ''; expected one of")
            assert gateway.sessions == [sid]

    asyncio.run(body())


def test_a_request_cut_by_the_drain_or_too_large_is_answered_as_the_gateways_errors_are(tiny):
    """The gateway's errors are ``{"error": {"message", "type", "code"}}``, which a harness (an
    OpenAI client) reads; the 503 of a request still in flight when the stop's drain ran out, and
    the 413 of a body over the limit (and FastAPI's own errors: an unknown path) came as
    ``{"detail": ...}``, the service server's shape."""
    model, tokenizer = tiny

    async def body():
        engine = SlowTorchEngine(copy.deepcopy(model), tokenizer, name="live", delay=0)
        engine.gate = asyncio.Event()  # never set: the turn outlasts the drain
        server = await GatewayServer(Gateway(Router([engine]), tokenizer), drain_timeout_s=0.2).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            head = f"POST /v1/sessions HTTP/1.1\r\nHost: g\r\nConnection: close\r\nContent-Length: {2**40}\r\n\r\n"
            writer.write(head.encode())
            await writer.drain()
            head, _, huge = (await asyncio.wait_for(reader.read(), 10)).partition(b"\r\n\r\n")
            writer.close()
            async with httpx.AsyncClient(
                base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}
            ) as client:
                unknown = await client.post("/v1/chat/completion", json={})
                sid = await open_session(client)
                turn = asyncio.create_task(
                    client.post("/v1/generate", json={"token_ids": [1, 2, 3]}, headers={SESSION_HEADER: sid})
                )
                while not engine.params:  # the turn is generating
                    await asyncio.sleep(0.01)
                await server.stop()
                huge = json.loads(huge[huge.index(b"{") : huge.rindex(b"}") + 1])
                return head, huge, unknown, await turn
        finally:
            await server.stop()
            await engine.close()

    head, huge, unknown, cut = asyncio.run(body())
    assert head.startswith(b"HTTP/1.1 413")
    assert huge["error"]["code"] == 413 and huge["error"]["type"] == "invalid_request_error"
    assert "bytes" in huge["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert cut.status_code == 503
    assert cut.json()["error"]["code"] == 503 and cut.json()["error"]["type"] == "server_stopping"
    assert "the gateway server is stopping" in cut.json()["error"]["message"]


class LeakyEngine(TorchEngine):
    """A real TorchEngine that fails every generation with an error echoing a credential, as
    an S3 error body (a weight load's) or a proxy's page relayed in an EngineError may."""

    async def generate(self, session_id, prompt_ids, params):
        raise EngineError(
            "vLLM server vllm@x answered 500 on /v1/completions: <AWSAccessKeyId>AKIAIOSFODNN7EXAMPLE"
            "</AWSAccessKeyId> for key ASIAIOSFODNN7EXAMPLE"
        )


def test_an_engine_failure_answered_to_a_harness_masks_the_credentials_it_echoes(tiny):
    """The 503 of an engine failure carried the engine's words as they were: the AWS key ids
    an S3 error body or a proxy's page echoes left the process to the harness (the record of
    such a turn, and the gateway's logs, mask them: ``storage.redaction``)."""
    model, tokenizer = tiny

    async def body():
        engine = LeakyEngine(copy.deepcopy(model), tokenizer, name="live")
        server = await GatewayServer(Gateway(Router([engine]), tokenizer)).start()
        try:
            async with httpx.AsyncClient(
                base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}
            ) as client:
                sid = await open_session(client)
                return await client.post(
                    "/v1/generate", json={"token_ids": [1, 2, 3]}, headers={SESSION_HEADER: sid}
                )
        finally:
            await server.stop()
            await engine.close()

    failed = asyncio.run(body())
    assert failed.status_code == 503
    message = failed.json()["error"]["message"]
    assert "answered 500 on /v1/completions" in message and "AWSAccessKeyId" in message
    assert "AKIA" not in message and "ASIA" not in message
