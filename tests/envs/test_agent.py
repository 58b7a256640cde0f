"""The agent env: an agent program in the sandbox reaches its gateway session over the relay.

The upstream here is a small HTTP server in the test that answers chat completions with
scripted shell commands and records what reached it; it checks the relay (session header and
bearer token put in by the worker, never visible to the agent), not the gateway's recording;
``tests/rollout/test_agent_rollout.py`` runs the same agent against the real gateway and
checks its record token by token.
"""

import asyncio
import gc
import json
import logging
import os
import shlex
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from envs.agent import MAX_BODY, AgentConfig, AgentEnv, GatewaySession
from envs.base import Task, in_eval_split
from envs.registry import make, task_set
from envs.sandbox import SandboxConfig, SandboxError, bwrap_path

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")
SCRIPT = (Path(__file__).parent / "agent_script.py").read_text()
REPLIES = ["echo hello > out.txt", "cat out.txt", "echo $OPENAI_API_KEY; env | grep -c secret-token || true"]


class Upstream(BaseHTTPRequestHandler):
    replies: list = REPLIES
    seen: list = []
    requests: list = []  # (method, path) of every request that reached the upstream

    def parse_request(self):
        parsed = super().parse_request()
        if parsed:
            Upstream.requests.append((self.command, self.path))
        return parsed

    def do_GET(self):
        data = json.dumps({"object": "list", "data": []}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Upstream.seen.append((self.path, self.headers, body))
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        answer = {"choices": [{"message": {"role": "assistant", "content": Upstream.replies[turn]}}]}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Upstream.replies = REPLIES
    Upstream.seen = []
    Upstream.requests = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def config(**extra):
    return {
        "command": "python3 -I agent.py",
        "eval_command": "python3 -c \"import json; t = json.load(open('transcript.json')); "
        "print(float(open('out.txt').read() == 'hello\\n' and len(t) == 7))\"",
        "tasks": [{"id": f"t{i}", "prompt": f"make out.txt ({i})"} for i in range(20)],
        "sandbox": SandboxConfig(timeout_s=30, memory_mb=512, cpu_seconds=10).model_dump(),
    } | extra


def run_agent_script(upstream):
    """The agent program's episode against ``upstream``: its result, score and transcript."""
    task = task_set("agent", "train", 0, 1, config())[0]

    async def episode():
        env = make("agent", config())
        env.attach_gateway(GatewaySession(upstream, "secret-token", "session-42"))
        await env.reset(task)
        Path(env.sandbox.workdir, "agent.py").write_text(SCRIPT)
        result = await env.run()
        score = await env.evaluate()
        transcript = json.loads(Path(env.sandbox.workdir, "transcript.json").read_text())
        await env.close()
        return result, score, transcript

    return (*asyncio.run(episode()), task)


def test_agent_runs_several_turns_through_its_session(upstream):
    result, score, transcript, task = run_agent_script(upstream)
    assert result.info["exit_code"] == 0 and result.info["gateway_requests"] == 3
    assert score == 1.0
    assert transcript[0]["content"] == task.prompt and transcript[4]["content"] == "hello\n"
    assert transcript[6]["content"] == "sandbox\n0\n"
    assert len(Upstream.seen) == 3
    for path, headers, _ in Upstream.seen:
        assert path == "/v1/chat/completions"
        assert headers["X-Treadle-Session"] == "session-42"
        assert headers["Authorization"] == "Bearer secret-token"


def test_agent_script_reports_a_command_it_cannot_run_and_goes_on(upstream):
    """A tiny model samples NUL bytes, which no command line can hold, and bytes that are not
    UTF-8: the agent's shell tool answers those as tool output instead of crashing the program."""
    Upstream.replies = ["echo a\x00b", "printf '\\377'", REPLIES[0]]
    result, score, transcript, _ = run_agent_script(upstream)
    assert result.info["exit_code"] == 0 and score == 1.0
    assert transcript[2]["content"] == "error: the command holds a NUL byte"
    assert transcript[4]["content"] == "\ufffd"


ONE_REQUEST = "import os, urllib.request; urllib.request.urlopen(os.environ['OPENAI_BASE_URL'] + '/models')"

CALL_ADMIN = r"""python3 - <<'PY'
import os, urllib.error, urllib.request
base = os.environ["OPENAI_BASE_URL"]
calls = [("POST", "/sessions"), ("DELETE", "/sessions/other"), ("POST", "/sessions/other/record"),
         ("POST", "/chat/completions/../../sessions"), ("GET", "/chat/completions"), ("DELETE", "/models"),
         ("GET", "/models?x=1")]
for method, path in calls:
    request = urllib.request.Request(base + path, data=b"{}" if method == "POST" else None, method=method)
    try:
        print(urllib.request.urlopen(request, timeout=30).status)
    except urllib.error.HTTPError as exc:
        print(exc.code)
PY"""


def relayed_statuses(upstream: str, command: str) -> list[str]:
    """The HTTP statuses an agent running ``command`` printed, one per request it made."""
    cfg = config(command=command)

    async def episode():
        env = make("agent", cfg)
        env.attach_gateway(GatewaySession(upstream, "secret-token", "session-42"))
        await env.reset(task_set("agent", "train", 0, 1, cfg)[0])
        try:
            return await env.run(), env.result.output.split()
        finally:
            await env.close()

    result, statuses = asyncio.run(episode())
    assert result.info["exit_code"] == 0
    return statuses


def test_agent_relay_forwards_inference_only_never_session_admin(upstream):
    statuses = relayed_statuses(upstream, CALL_ADMIN)
    assert statuses == ["403", "403", "403", "403", "403", "403", "200"]
    assert Upstream.requests == [("GET", "/v1/models")]


SMUGGLE = r"""python3 - <<'PY'
import os, socket, urllib.parse
base = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
heads = ["GET /v1/models HTTP/1.1\r\nHost: x\r\n" + extra for extra in (
    "Accept: */*\nX-Treadle-Session: victim", "Accept: */*\rX-Treadle-Session: victim",
    "Bad Name: x", ": x", "NoColon", "Accept: a\0b")]
heads.append("GET /v1/models HTTP/1.1\nX-Treadle-Session: victim\r\nHost: x")
for head in heads:
    with socket.create_connection((base.hostname, base.port)) as s:
        s.sendall((head + "\r\n\r\n").encode())
        print(s.recv(100).split()[1].decode())
PY"""


def test_agent_relay_refuses_malformed_headers_so_no_session_is_smuggled(upstream):
    """A bare line feed or carriage return in a header value would reach the gateway as a
    second session header, ahead of the relay's own; such requests, one with a line break in
    its request line, and other malformed header lines (an empty name too) get 400."""
    statuses = relayed_statuses(upstream, SMUGGLE)
    assert statuses == ["400"] * 7
    assert Upstream.requests == []


CHUNKED = r"""python3 - <<'PY'
import os, socket, urllib.parse
base = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
for coding in ("chunked", "Chunked", "gzip, CHUNKED", "chunked\r\nTransfer-Encoding: gzip"):
    with socket.create_connection((base.hostname, base.port)) as s:
        s.sendall(("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding
                   + "\r\nContent-Length: 5\r\n\r\n0\r\n\r\n").encode())
        print(s.recv(100).split()[1].decode())
PY"""


def test_agent_relay_refuses_a_transfer_coded_body_whatever_the_case_or_the_headers(upstream):
    """The relay reads a body by its Content-Length only: a transfer-coded one (the coding's
    name in any case, RFC 9112; or a second header) is refused, never forwarded with both
    framings for the gateway to pick."""
    assert relayed_statuses(upstream, CHUNKED) == ["411", "411", "411", "411"]
    assert Upstream.requests == []


OWN_HEADERS = r"""python3 - <<'PY'
import os, socket, urllib.parse
base = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
body = b'{"messages": []}'
head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer sandbox\r\n"
        "X-Treadle-Session: victim\r\nx-treadle-session: victim\r\nConnection: keep-alive\r\n"
        "Content-Length: %d\r\n\r\n" % (base.netloc, len(body)))
with socket.create_connection((base.hostname, base.port)) as s:
    s.sendall(head.encode() + body)
    print(b"".join(iter(lambda: s.recv(65536), b"")).split()[1].decode())  # to the end: the relay closes it
PY"""


def test_agent_relay_puts_its_own_framing_and_credentials_in_place_of_the_programs(upstream):
    """The program's own Host, Authorization, session header (in any case), Connection and
    Content-Length never reach the gateway beside the relay's: each arrives once, the relay's.
    The answer ends with the connection, as its ``Connection: close`` says."""
    assert relayed_statuses(upstream, OWN_HEADERS) == ["200"]
    [(_, headers, _)] = Upstream.seen
    assert headers.get_all("Host") == [urllib.parse.urlsplit(upstream).netloc]
    assert headers.get_all("Authorization") == ["Bearer secret-token"]
    assert headers.get_all("X-Treadle-Session") == ["session-42"]
    assert headers.get_all("Connection") == ["close"]
    assert headers.get_all("Content-Length") == [str(len(b'{"messages": []}'))]


def test_agent_relay_forwards_to_the_gateways_path_prefix(upstream):
    """A gateway base_url with a prefix (and a trailing slash) is where the endpoints go."""
    prefixed = upstream.removesuffix("/v1") + "/gateway/v1/"
    assert relayed_statuses(prefixed, f"python3 -c {shlex.quote(ONE_REQUEST)}") == []
    assert Upstream.requests == [("GET", "/gateway/v1/models")]


# The program's side of one exchange on the relay's socket: the request (its write side shut
# when asked), then the whole answer; one answered and closed before the request was read
# may break the pipe or reset the connection after the answer.
EXCHANGE = r"""python3 - %s <<'PY'
import contextlib, json, socket, sys
def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect(".gateway.sock")
    return s
def exchange(s, data, shut=False):
    with contextlib.suppress(BrokenPipeError):
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
    reply = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            reply += chunk
    return reply
def status(reply):
    return reply.split()[1].decode()
%s
PY"""

CONNECTION_LIMIT = """
limit = int(sys.argv[1])
for _ in range(limit + 1):  # one after another: each gives its place back when answered
    with connect() as s:
        print(status(exchange(s, b"GET /v1/models HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")))
held = [connect() for _ in range(limit)]
with connect() as s:
    print(status(exchange(s, b"GET /v1/models HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")))
"""


def test_agent_relay_serves_max_processes_connections_at_once_and_frees_each(upstream):
    """More connections one after another than ``max_processes`` are all served; with
    ``max_processes`` held open, the next is answered 503."""
    limit = SandboxConfig().max_processes
    statuses = relayed_statuses(upstream, EXCHANGE % (limit, CONNECTION_LIMIT))
    assert statuses == ["200"] * (limit + 1) + ["503"]


EXPECT_CONTINUE = """
body = b'{"messages": []}'
head = b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\nExpect: 100-continue\\r\\nContent-Length: %d\\r\\n\\r\\n"
with connect() as s:
    s.settimeout(60)  # no answer at all: the relay waits for the body, the program for its go-ahead
    s.sendall(head % len(body))
    interim = b""
    while not interim.endswith(b"\\r\\n\\r\\n") and (chunk := s.recv(1)):
        interim += chunk
    print(status(interim))
    print(status(exchange(s, body)))
"""


def test_agent_relay_tells_a_program_that_expects_100_continue_to_send_its_body(upstream):
    """curl asks for it (``Expect: 100-continue``) before a large body: the relay answers it
    and reads the body, which it forwards whole, without the expectation."""
    assert relayed_statuses(upstream, EXCHANGE % ("", EXPECT_CONTINUE)) == ["100", "200"]
    [(_, headers, body)] = Upstream.seen
    assert body == {"messages": []} and "Expect" not in headers


BODY_LIMIT = """
limit = int(sys.argv[1])
empty = json.dumps({"messages": [], "pad": ""})
body = json.dumps({"messages": [], "pad": "x" * (limit - len(empty))}).encode()
head = "POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: %d\\r\\n\\r\\n"
with connect() as s:
    print(status(exchange(s, (head % len(body)).encode() + body)))
with connect() as s:
    reply = exchange(s, (head % (limit + 1)).encode(), shut=True)
    print(status(reply), json.loads(reply.split(b"\\r\\n\\r\\n", 1)[1])["error"]["message"])
with connect() as s:
    print(status(exchange(s, b"GET /v1/models HTTP/1.1\\r\\nX-Pad: " + b"a" * 65536 + b"\\r\\n\\r\\n")))
"""


def test_agent_relay_forwards_a_body_of_max_body_bytes_and_refuses_a_longer_one_or_a_long_head(upstream):
    """A request announcing more than ``MAX_BODY`` bytes is answered 400 before its body is
    read; so is one whose head runs past 64 KiB (the worker would buffer it all)."""
    statuses = relayed_statuses(upstream, EXCHANGE % (MAX_BODY, BODY_LIMIT))
    assert statuses == ["200", "400", "request", "too", "large", "400"]
    assert len(Upstream.seen) == 1


UNREACHABLE = r"""python3 - <<'PY'
import os, socket, urllib.error, urllib.parse, urllib.request
base = os.environ["OPENAI_BASE_URL"]
request = urllib.request.Request(base + "/chat/completions", data=b"{}", method="POST")
try:
    print(urllib.request.urlopen(request, timeout=30).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
url = urllib.parse.urlsplit(base)
with socket.create_connection((url.hostname, url.port)) as s:
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: many\r\n\r\n")
    print(s.recv(100).split()[1].decode())
PY"""


def test_agent_relay_answers_502_when_the_gateway_is_unreachable():
    """An unreachable gateway is a 5xx, which OpenAI clients retry; a malformed request stays 400."""
    assert relayed_statuses("http://127.0.0.1:9/v1", UNREACHABLE) == ["502", "400"]


FLOOD = r"""python3 - <<'PY'
import os, socket, time
held = []
for _ in range(300):
    held.append(socket.socket(socket.AF_UNIX))
    held[-1].connect(".gateway.sock")
open("held", "w").close()
while not os.path.exists("counted"):
    time.sleep(0.01)
with socket.socket(socket.AF_UNIX) as s:
    s.connect(".gateway.sock")
    try:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    except BrokenPipeError:  # answered and closed before the request was read
        pass
    print(s.recv(100).split()[1].decode())
PY"""


def test_agent_relay_connections_held_open_take_a_bounded_share_of_the_workers_descriptors(upstream):
    """A program that opens connection after connection to the relay's socket and never sends
    a request held one descriptor of the worker for each, all the worker's (and with them the
    other rollouts') in the end; past ``max_processes`` at once it is answered 503."""
    cfg = config(command=FLOOD, agent_timeout_s=30)

    async def episode():
        env = make("agent", cfg)
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        await env.reset(task_set("agent", "train", 0, 1, cfg)[0])
        try:
            before = len(os.listdir("/proc/self/fd"))
            run = asyncio.ensure_future(env.run())
            workdir = Path(env.sandbox.workdir)
            deadline = time.monotonic() + 20
            while not (workdir / "held").exists() and not run.done():
                assert time.monotonic() < deadline, "the program never held its connections"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # the worker accepts what is still queued
            during = len(os.listdir("/proc/self/fd"))
            (workdir / "counted").touch()
            return before, during, await run, env.result.output
        finally:
            await env.close()

    before, during, result, output = asyncio.run(episode())
    assert result.info["exit_code"] == 0, output
    assert during - before <= cfg["sandbox"]["max_processes"] + 8
    assert output.split() == ["503"]


def test_agent_needs_a_gateway_and_reports_eval_failures(upstream):
    env = AgentEnv(**config(command="true", eval_command="echo no score"))
    task = task_set("agent", "train", 0, 1, config())[0]
    with pytest.raises(RuntimeError, match="attach_gateway"):
        asyncio.run(env.reset(task))
    for url in ("ftp://x", "http:///v1"):
        with pytest.raises(ValueError, match="http://"):
            env.attach_gateway(GatewaySession(url, "k", "s"))

    async def episode():
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        await env.reset(task)
        await env.run()
        try:
            await env.evaluate()
        finally:
            await env.close()

    with pytest.raises(ValueError, match="printed no score"):
        asyncio.run(episode())


def test_agent_program_runs_once_per_reset(upstream):
    """A second run would act again in the sandbox EVAL scores: it is refused."""
    cfg = config(
        command="echo run >> runs.txt",
        eval_command="python3 -c \"print(float(open('runs.txt').read() == 'run\\n'))\"",
    )

    async def episode():
        env = make("agent", cfg)
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        await env.reset(task_set("agent", "train", 0, 1, cfg)[0])
        try:
            assert (await env.run()).done
            with pytest.raises(RuntimeError, match="is done; reset before another step"):
                await env.run()
            return await env.evaluate()
        finally:
            await env.close()

    assert asyncio.run(episode()) == 1.0


def test_agent_counts_the_model_calls_of_each_episode_alone(upstream):
    """An env reset for a second episode reports that episode's gateway requests, not the sum."""
    cfg = config(command=f"python3 -c {shlex.quote(ONE_REQUEST)}")
    tasks = task_set("agent", "train", 0, 2, cfg)

    async def episodes():
        env = make("agent", cfg)
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        try:
            counts = []
            for task in tasks:
                await env.reset(task)
                counts.append((await env.run()).info["gateway_requests"])
            return counts
        finally:
            await env.close()

    assert asyncio.run(episodes()) == [1, 1]


def test_agent_env_needs_a_command_and_scores_zero_without_an_eval_command(upstream):
    """With no EVAL command (a reward model scores the rollout instead) nothing runs to score it."""
    task = task_set("agent", "train", 0, 1, config())[0]
    with pytest.raises(ValueError, match="needs config.command"):
        asyncio.run(make("agent", config(command="")).reset(task))

    assert scored(upstream, config(command="true", eval_command="")) == 0.0


def test_agent_env_refuses_a_split_with_no_tasks():
    one = config(tasks=[{"id": "t0", "prompt": "p"}])
    split = "train" if in_eval_split("t0", AgentConfig().eval_fraction) else "eval"
    with pytest.raises(
        ValueError, match=f"^none of its 1 tasks falls in the {split} split \\(eval_fraction 0.1,"
    ):
        task_set("agent", split, 0, 1, one)


def test_a_closed_agent_env_keeps_no_descriptor_of_the_worker(upstream):
    """Each episode's relay socket is closed with it: one episode after another holds no more."""
    cfg = config(command="true")
    tasks = task_set("agent", "train", 0, 2, cfg)

    async def episodes():
        env = make("agent", cfg)
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        counts = []
        for task in tasks:
            await env.reset(task)
            await env.run()
            await env.close()
            counts.append(len(os.listdir("/proc/self/fd")))
        return counts

    first, second = asyncio.run(episodes())
    assert second == first


class CancelledAsItsRelayStarts(AgentEnv):
    """An agent env whose reset is cancelled at its first wait after the sandbox is made: as
    its relay server starts (a rollout cancelled, or out of time, in INIT)."""

    async def _new_sandbox(self):
        sandbox = await super()._new_sandbox()
        asyncio.get_running_loop().call_soon(asyncio.current_task().cancel)
        return sandbox


def test_an_agent_env_whose_reset_is_cancelled_as_its_relay_starts_keeps_no_descriptor_once_closed(upstream):
    cfg = config(command="true")
    task = task_set("agent", "train", 0, 1, cfg)[0]

    async def episodes():
        env = make("agent", cfg)
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        await env.reset(task)
        await env.close()
        before = len(os.listdir("/proc/self/fd"))
        cancelled = CancelledAsItsRelayStarts(env.config)
        cancelled.attach_gateway(GatewaySession(upstream, "k", "s"))
        (outcome,) = await asyncio.gather(asyncio.create_task(cancelled.reset(task)), return_exceptions=True)
        await cancelled.close()
        return outcome, before, len(os.listdir("/proc/self/fd"))

    outcome, before, after = asyncio.run(episodes())
    assert isinstance(outcome, asyncio.CancelledError)
    assert after == before


async def relaying_to(gateway: socket.socket) -> tuple[AgentEnv, socket.socket]:
    """An agent env reset to talk to ``gateway``, and the program's connection to its relay,
    whose request the relay has sent on to ``gateway``."""
    cfg = config(command="true")
    env = make("agent", cfg)
    env.attach_gateway(GatewaySession(f"http://127.0.0.1:{gateway.getsockname()[1]}/v1", "k", "s"))
    await env.reset(task_set("agent", "train", 0, 1, cfg)[0])
    program = socket.socket(socket.AF_UNIX)
    program.connect(env.socket_path)
    program.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    deadline = time.monotonic() + 10
    while env.requests == 0:
        assert time.monotonic() < deadline, "the relay never reached the gateway"
        await asyncio.sleep(0.01)
    return env, program


def test_closing_an_agent_env_ends_its_relays_in_flight_and_their_gateway_connections(caplog):
    """A relay waiting for the gateway's answer when its env closed (the rollout cancelled or
    out of time while the model was called) went on holding the program's connection and the
    gateway's, and a task on the loop, until the gateway answered. It ends quietly."""
    gateway = socket.create_server(("127.0.0.1", 0))  # takes the connection, never answers

    async def episode():
        env, program = await relaying_to(gateway)
        await env.close()
        program.close()
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    gc.disable()  # a relay left behind is unreachable: a collection would close its sockets
    try:
        left = asyncio.run(episode())
        relayed, _ = gateway.accept()
    finally:
        gc.enable()
        gateway.close()
    with relayed:
        relayed.settimeout(10)
        while relayed.recv(65536):  # the request, then the end of the connection
            pass
    assert left == []
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []


def test_an_agent_env_close_cancelled_while_its_relays_end_still_closes_the_sandbox():
    gateway = socket.create_server(("127.0.0.1", 0))

    async def episode():
        env, program = await relaying_to(gateway)
        sandbox = env.sandbox
        closing = asyncio.create_task(env.close())
        await asyncio.sleep(0)  # it waits for the relay it cancelled
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        program.close()
        return sandbox

    with gateway:
        sandbox = asyncio.run(episode())
    assert sandbox.closed
    assert not os.path.exists(sandbox.workdir)


def test_agent_task_data_cannot_replace_the_id_or_prompt_in_task_json():
    for key in ("id", "prompt"):
        with pytest.raises(ValueError, match=f"must not hold \\['{key}'\\]"):
            make("agent", config(tasks=[{"id": "t", "prompt": "p", "data": {key: "other"}}]))


def scored(upstream: str, cfg) -> float:
    """The score of one episode of the agent env configured by ``cfg``, its program run to its end."""

    async def episode() -> float:
        env = make("agent", cfg)
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        await env.reset(task_set("agent", "train", 0, 1, cfg)[0])
        try:
            await env.run()
            return await env.evaluate()
        finally:
            await env.close()

    return asyncio.run(episode())


# EVAL runs the tests task.json names; a program that passes none rewrites it to name none
CHECK_NAMED_TESTS = (
    "python3 -c \"import json; print(float(json.load(open('task.json'))['tests'] == ['t1', 't2']))\""
)


@pytest.mark.parametrize(
    "tamper",
    [
        "rm task.json && echo '{\"tests\": []}' > task.json",
        "rm task.json && echo '{\"tests\": []}' > forged.json && ln -s forged.json task.json",
        "rm task.json && ln -s {outside} task.json",
        "rm task.json && mkdir task.json && touch task.json/x",
    ],
)
def test_agent_eval_reads_task_json_as_reset_wrote_it_not_as_the_program_left_it(upstream, tmp_path, tamper):
    """task.json is the task for the agent and for EVAL: the program (the model's commands)
    could rewrite it to name no test, and EVAL scored what it forged. It is written again
    before EVAL, in place of whatever is there, through no link the program made (here to a
    file of the worker's, outside the sandbox)."""
    outside = tmp_path / "worker_file"
    outside.write_text("the worker's own")
    tasks = [{"id": f"t{i}", "prompt": "pass t1 and t2", "data": {"tests": ["t1", "t2"]}} for i in range(20)]
    cfg = config(
        command=tamper.replace("{outside}", str(outside)), eval_command=CHECK_NAMED_TESTS, tasks=tasks
    )
    assert scored(upstream, cfg) == 1.0
    assert outside.read_text() == "the worker's own"


def test_agent_eval_printing_nan_scores_zero(upstream):
    assert scored(upstream, config(command="true", eval_command="echo passed 0 of 0; echo nan")) == 0.0


@pytest.mark.parametrize("printed", ["", "tests ran: see above"])
def test_an_eval_that_prints_no_score_is_an_error_of_its_command_not_of_the_sandbox(upstream, printed):
    """It was raised as the sandbox dying ("sandbox died during eval"), which sent a user
    looking at the sandbox; the command is at fault, and what it printed says why."""
    cfg = config(command="true", eval_command=f"echo '{printed}'; exit 3")
    with pytest.raises(
        ValueError, match=r"^eval_command printed no score on its last line \(exit 3\)"
    ) as raised:
        scored(upstream, cfg)
    assert not isinstance(raised.value, SandboxError)
    assert repr(printed) in str(raised.value)


def test_what_the_agents_work_printed_never_turns_its_program_or_eval_into_a_sandbox_error(upstream):
    """The program's log and EVAL's report hold what the model's commands and code printed:
    a program that logged a tool's refused connection and exited 1, and an EVAL whose failing
    test printed ``MemoryError`` and exited 1 after the score, were raised as the sandbox's
    ``network`` and ``memory_limit`` (env_error, the episode never trained on, its score lost)."""
    cfg = config(
        command="echo 'tool: curl: (7) Connection refused'; exit 1",
        eval_command="echo 'test_big FAILED: MemoryError'; echo 0.5; exit 1",
    )

    async def episode():
        env = make("agent", cfg)
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        await env.reset(task_set("agent", "train", 0, 1, cfg)[0])
        try:
            return await env.run(), await env.evaluate()
        finally:
            await env.close()

    result, score = asyncio.run(episode())
    assert result.info["exit_code"] == 1
    assert score == 0.5


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_agent_eval_asks_for_cores_and_runs_on_those_granted(upstream):
    core = max(os.sched_getaffinity(0))
    check = f"import os; print(float(os.sched_getaffinity(0) == {{{core}}}))"
    cfg = config(command="true", eval_command=f"python3 -c '{check}'", action_cores=2)

    async def episode():
        env = make("agent", cfg)
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        await env.reset(task_set("agent", "train", 0, 1, cfg)[0])
        try:
            await env.run()
            env.cores = frozenset({core})  # what the rollout service sets for a grant
            return env.eval_request(), await env.evaluate()
        finally:
            await env.close()

    request, score = asyncio.run(episode())
    assert request.demand == {"cpu": 2} and request.kind == "agent.eval"
    assert score == 1.0


def test_agent_programs_hold_no_thread_of_the_default_executor(upstream):
    """More programs than the default executor has threads run at once, and other
    ``asyncio.to_thread`` calls (sandbox creation, weight reads) do not queue behind them."""
    threads = 2
    tasks = task_set("agent", "train", 0, 2 * threads + 1, config())
    # each program says it started, then waits for the test to let it end (or its workdir to go)
    command = "touch started; while [ ! -e release ] && [ -e started ]; do sleep 0.01; done"

    async def episodes():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(threads))
        envs = [make("agent", config(command=command, agent_timeout_s=600)) for _ in tasks]
        try:
            for env, task in zip(envs, tasks, strict=True):
                env.attach_gateway(GatewaySession(upstream, "k", "s"))
                await env.reset(task)
            runs = asyncio.gather(*(env.run() for env in envs))
            workdirs = [Path(env.sandbox.workdir) for env in envs]
            deadline = time.monotonic() + 60
            # queued on the executor's threads, only as many programs as it has threads would start
            while not all((workdir / "started").exists() for workdir in workdirs):
                assert time.monotonic() < deadline, "not every program started while the others ran"
                await asyncio.sleep(0.01)
            # with every program running: a thread holding one would keep this from ever running
            await asyncio.wait_for(asyncio.to_thread(lambda: None), 60)
            for workdir in workdirs:
                (workdir / "release").touch()
            return await runs
        finally:
            for env in envs:  # a failed check must not leave programs holding threads
                if env.sandbox is not None:
                    (Path(env.sandbox.workdir) / "release").touch()
            for env in envs:
                await env.close()

    results = asyncio.run(episodes())
    assert [result.info["exit_code"] for result in results] == [0] * len(tasks)


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        ("exec > /dev/null; sleep 30", "timeout"),
        ("yes", "output_limit"),
        ("echo 'tool: BlockingIOError: [Errno 11] Resource temporarily unavailable'; sleep 30", "timeout"),
    ],
)
def test_an_agent_program_past_its_limits_is_stopped(upstream, command, kind):
    """The wall-clock limit (also after the program closes its stdout) and the output cap hold,
    and are what the error says: a program that ran past its limit was reported as having hit
    the process limit when its log held a tool's ``Errno 11`` (its output read all the same)."""
    cfg = config(command=command, agent_timeout_s=1)
    env = make("agent", cfg)

    async def episode():
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        await env.reset(task_set("agent", "train", 0, 1, cfg)[0])
        try:
            await env.run()
        finally:
            await env.close()

    started = time.monotonic()
    with pytest.raises(SandboxError) as error:
        asyncio.run(episode())
    assert error.value.kind == kind
    assert time.monotonic() - started < 10


# EVAL runs what the program left (its code under test); that code calls the model itself
CALL_FROM_EVAL = r"""python3 - <<'PY'
import socket
try:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(".gateway.sock")
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        s.recv(100)
except OSError:
    pass
print(1.0)
PY"""


def test_agent_relay_forwards_no_model_call_once_the_program_has_ended(upstream):
    """The relay kept serving after the program ended: code the program left, run by EVAL,
    made model calls through the socket in its folder, recorded in the episode after its end
    and outside its action grants."""
    assert scored(upstream, config(command="true", eval_command=CALL_FROM_EVAL)) == 1.0
    assert Upstream.requests == []


def test_agent_task_whose_prompt_no_environment_variable_can_hold_is_refused_at_reset(upstream):
    """A prompt past Linux's 128 KiB for one environment string (or holding a NUL) cannot be
    given as ``TREADLE_TASK``: the program never started ("Argument list too long", reported as
    its exit status 1, or as the sandbox's ``start_failed``) and EVAL scored the nothing it did.
    The longest prompt that fits still runs; a task config with a longer one is refused."""
    longest = (128 * 1024 - len("TREADLE_TASK=") - 1 - 2) * "x" + "é"
    same_as_task_json = (
        "import json, os; assert os.environ['TREADLE_TASK'] == json.load(open('task.json'))['prompt']"
    )
    cfg = config(command=f"python3 -c {shlex.quote(same_as_task_json)}")
    env = make("agent", cfg)
    env.attach_gateway(GatewaySession(upstream, "k", "s"))

    async def episode(prompt):
        try:
            await env.reset(Task(env="agent", id="t", prompt=prompt))
            return (await env.run()).info["exit_code"]
        finally:
            await env.close()

    assert asyncio.run(episode(longest)) == 0
    for prompt in (longest + "x", "a\0b"):
        with pytest.raises(ValueError, match="agent task 't': its prompt cannot be passed as TREADLE_TASK"):
            asyncio.run(episode(prompt))
    with pytest.raises(ValueError, match="cannot be passed as TREADLE_TASK: 131073 bytes"):
        make("agent", config(tasks=[{"id": "t", "prompt": longest + "x"}]))
