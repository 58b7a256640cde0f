"""``agent``: any agent program, given as a command, runs in the sandbox against its gateway session.

The program sees ``OPENAI_BASE_URL`` (``http://127.0.0.1:<port>/v1`` inside the sandbox) and a
dummy ``OPENAI_API_KEY``, plus the task as ``TREADLE_TASK`` and ``task.json`` in its working
directory (written again before EVAL, which reads it: what the program did to it is undone).
The sandbox keeps its network namespace closed: a relay inside listens on its own loopback and
forwards each connection over a Unix socket in the working directory to this process, which
forwards the HTTP request to the gateway with the real bearer token and the session header put
in (the agent can neither see the token nor pick another session). Only the inference endpoints
in :data:`FORWARDED` are forwarded; anything else (the gateway's session admin included) is
answered 403. Every model call the agent makes is therefore recorded token-exactly by the
gateway; it samples at the run's ``service.temperature`` and ``top_p`` (leave them unset: a
training rollout's call asking for others is refused with HTTP 400, as the trainer could not
compare its log-probs). After the program ends (the relay then takes no more connections), the
EVAL command runs in the same sandbox and prints the score (a number in [0, 1]; NaN scores 0)
as the last line of its output.

Between model calls the program acts (runs its tools), and that is what the rollout service's
scheduler grants resources to (``attach_actions``): the program starts on the cores granted
for its first action; each model call gives them back (the program is parked while it
waits), and the reply reaches the program once its next action is granted.

The program and EVAL hold no worker thread while they run (``Sandbox.run_async``): there may
be hundreds at once, and ``asyncio.to_thread`` calls elsewhere share the default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import urllib.parse
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from envs.base import (
    ActionGate,
    Env,
    EnvConfig,
    Id,
    ResourceRequest,
    Split,
    StepResult,
    Task,
    clamp_score,
    in_eval_split,
    user,
    write_anew,
)
from envs.sandbox import ExecResult, python_in_sandbox

RELAY = r"""
import os, socket, sys, threading
sock_path, command = sys.argv[1], sys.argv[2]
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(64)
port = server.getsockname()[1]

def pipe(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

if os.fork() == 0:
    while True:
        conn, _ = server.accept()
        upstream = socket.socket(socket.AF_UNIX)
        upstream.connect(sock_path)
        threading.Thread(target=pipe, args=(conn, upstream), daemon=True).start()
        threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()
server.close()
os.environ["OPENAI_BASE_URL"] = "http://127.0.0.1:%d/v1" % port
os.execvp("bash", ["bash", "-c", command])
"""

# The inference endpoints of the program's own session: the only requests the relay forwards
# (never the gateway's session admin, which the worker's token would otherwise open to it).
FORWARDED = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/generate"),
    ("GET", "/v1/models"),
}
_DROP_HEADERS = {
    "host",
    "authorization",
    "connection",
    "keep-alive",
    "proxy-connection",
    "content-length",
    "expect",
}
MAX_BODY = 16 * 1024 * 1024
GATEWAY_SOCKET = ".gateway.sock"
"""The gateway's Unix socket in an episode's sandbox folder, which the program's relay reaches."""
SOCKET_PATH_MAX = 107
"""Bytes of the longest path a Unix socket address holds (``sun_path`` less its NUL)."""
ENV_STRING_MAX = 128 * 1024
"""Bytes of the longest environment string Linux passes to a program (``MAX_ARG_STRLEN``, its
NUL included): ``TREADLE_TASK=<prompt>`` must fit."""
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""An HTTP header name (RFC 9110 token)."""


@dataclass(frozen=True)
class GatewaySession:
    """What the rollout service hands the env: the gateway's OpenAI base URL, its key, the session."""

    base_url: str
    api_key: str
    session_id: str
    header: str = "X-Treadle-Session"

    def __repr__(self) -> str:
        return f"GatewaySession(base_url={self.base_url!r}, session_id={self.session_id!r})"


class AgentTask(BaseModel):
    """One task of the agent env (from config)."""

    model_config = ConfigDict(extra="forbid")

    id: Id = Field(description="Stable task id.")
    prompt: str = Field(description="What the agent is asked to do (TREADLE_TASK).")
    data: dict = Field(
        default_factory=dict, description="Extra fields written to task.json for the agent and EVAL."
    )

    @field_validator("prompt")
    @classmethod
    def _passable(cls, value: str) -> str:
        problem = prompt_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("data")
    @classmethod
    def _no_shadowing(cls, value: dict) -> dict:
        # task.json holds the task's id and prompt beside these: one here would replace them there
        shadowed = sorted({"id", "prompt"} & set(value))
        if shadowed:
            raise ValueError(f"must not hold {shadowed}: task.json takes them from the task itself")
        return value


class AgentConfig(EnvConfig):
    """The agent program, its EVAL command and its tasks."""

    required_fields: ClassVar[tuple[str, ...]] = ("command", "tasks")
    score_fields: ClassVar[tuple[str, ...]] = ("eval_command",)

    command: str = Field("", description="Shell command that runs the agent inside the sandbox.")
    eval_command: str = Field(
        "", description="Shell command run in the sandbox after the agent; last line = score."
    )
    max_turns: int = Field(
        32,
        ge=1,
        description="Model calls the program may make (with service.max_turns, the lower holds; a coding "
        "agent makes many, so the default is service.max_turns's); one past them is refused (HTTP 400) "
        "and the rollout ends truncated.",
    )
    agent_timeout_s: float = Field(600.0, gt=0, description="Wall-clock limit of the whole agent run.")
    action_cores: int = Field(
        1,
        ge=1,
        description="Cores the program is granted for each action (what it does between model calls).",
    )
    tasks: list[AgentTask] = Field(
        default_factory=list, description="The task set (split by a hash of the id)."
    )
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Share of tasks held out for eval.")


class AgentEnv(Env):
    """Runs a whole agent program per episode; call :meth:`run` instead of ``step``."""

    name = "agent"
    config_cls = AgentConfig
    makes_sandboxes = True
    drives_itself = True
    scripted_solver = False
    shows_task_id = True  # in task.json

    def __init__(self, config: AgentConfig | None = None, **overrides):
        super().__init__(config, **overrides)
        self.gateway: GatewaySession | None = None
        self._server: asyncio.AbstractServer | None = None
        self.requests = 0
        self.result: ExecResult | None = None
        self.actions: ActionGate | None = None
        self._connections = 0  # relay connections open now
        self._relays: set[asyncio.Task] = set()  # their handlers, ended by close()

    @classmethod
    def tasks(cls, split: Split, seed: int, n: int, config: AgentConfig | None = None) -> list[Task]:
        cfg = config or AgentConfig()
        chosen = [
            Task(env=cls.name, id=t.id, prompt=t.prompt, data=t.data)
            for t in cfg.tasks
            if in_eval_split(t.id, cfg.eval_fraction) == (split == "eval")
        ]
        if not chosen:
            raise ValueError(
                f"none of its {len(cfg.tasks)} tasks falls in the {split} split (eval_fraction "
                f"{cfg.eval_fraction}, by a hash of each id): add tasks or change eval_fraction"
            )
        random.Random(f"{seed}/{split}").shuffle(chosen)
        return [chosen[i % len(chosen)] for i in range(n)]

    @classmethod
    def demonstrate(cls, task: Task, flawed: bool = False, seed: int = 0) -> list[str]:
        raise NotImplementedError(
            "the agent env has no scripted solver: the agent program is the policy's scaffold"
        )

    def attach_gateway(self, gateway: GatewaySession) -> None:
        """Point this episode's agent at its gateway session (before ``reset``)."""
        parsed = urllib.parse.urlsplit(gateway.base_url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"gateway base_url must be http://host:port[/prefix], got {gateway.base_url!r}")
        self.gateway = gateway

    def attach_actions(self, gate: ActionGate) -> None:
        """Let ``gate`` grant the program its resources per action (before ``run``)."""
        self.actions = gate

    def action_request(self, action: str) -> ResourceRequest:
        """What one action of the program (its work between two model calls) needs."""
        return ResourceRequest(demand={"cpu": self.config.action_cores}, kind="agent")

    def eval_request(self) -> ResourceRequest:
        """What the EVAL command (often a whole test suite) needs: it runs on the granted cores."""
        return ResourceRequest(demand={"cpu": self.config.action_cores}, kind="agent.eval")

    def resource_pid(self) -> int | None:
        """The running program (its process group holds the tools it starts)."""
        running = self.sandbox.running if self.sandbox is not None else []
        return running[-1] if running else None

    async def reset(self, task: Task) -> list[dict[str, str]]:
        if not self.config.command:
            raise ValueError("agent env needs config.command")
        if self.gateway is None:
            raise RuntimeError("agent env: call attach_gateway(...) before reset")
        self._start(task)
        problem = prompt_problem(task.prompt)
        if problem is not None:
            # else the program never starts, and EVAL scores the nothing it did
            raise ValueError(f"agent task {task.id!r}: {problem}")
        sandbox = await self._new_sandbox()
        write_anew(sandbox.workdir, "task.json", task_json(task))
        self.socket_path = os.path.join(sandbox.workdir, GATEWAY_SOCKET)
        # held before it starts serving, whose start yields: a cancel there leaves it to close()
        self._server = await asyncio.start_unix_server(
            self._relay, self.socket_path, limit=65536, start_serving=False
        )
        await self._server.start_serving()
        os.chmod(self.socket_path, 0o666)
        self.result = None
        self.requests = 0
        return user(task.prompt)

    async def run(self) -> StepResult:
        """Run the agent program to its end (RUN stage); raises :class:`SandboxError` when it is
        stopped. The program is the whole episode: it runs once per ``reset``."""
        task = self._next_turn()
        self.done = True
        sandbox = self.sandbox
        sandbox.config.env.update(OPENAI_API_KEY="sandbox", TREADLE_TASK=task.prompt)
        argv = [python_in_sandbox(sandbox.config), "-I", "-c", RELAY, self.socket_path, self.config.command]
        if self.actions is not None:
            await self.actions.acting()
        try:
            # The program starts on its first action's cores. Its output is its log, which holds
            # what the model's commands printed: not read for what the isolation stopped.
            self.result = await sandbox.run_async(
                argv, self.config.agent_timeout_s, cores=self.cores, violations=False
            )
        finally:
            if self.actions is not None:
                self.actions.waiting()
            # what the program left runs on in EVAL: a model call from there is no turn of its
            self._stop_serving()
        info = {
            "exit_code": self.result.exit_code,
            "gateway_requests": self.requests,
            "seconds": self.result.seconds,
        }
        return StepResult([], 0.0, True, 0.0, info)

    async def step(self, action: str) -> StepResult:
        raise TypeError(
            "the agent env is driven by its own program through the gateway: call run(), not step()"
        )

    async def evaluate(self) -> float:
        task = self._require_task()
        if not self.config.eval_command or self.sandbox is None:
            return 0.0
        # the program may have rewritten it (to name no test, say), and EVAL reads it
        write_anew(self.sandbox.workdir, "task.json", task_json(task))
        result = await self.sandbox.run_async(self.config.eval_command, cores=self.cores, violations=False)
        lines = result.output.strip().splitlines()
        try:
            score = float(lines[-1])
        except (IndexError, ValueError):
            # the command's fault, not the sandbox's: what it printed last says why
            raise ValueError(
                f"eval_command printed no score on its last line (exit {result.exit_code}): "
                f"{result.output.strip()[-200:]!r}"
            ) from None
        return clamp_score(score)

    def _stop_serving(self) -> None:
        """Accept no more connections to the relay (those in flight go on until :meth:`close`)."""
        if self._server is not None:
            self._server.close()
            self._server = None

    async def close(self) -> None:
        self._stop_serving()
        # closing the server leaves the connections it accepted: a relay waiting for the
        # gateway's answer would hold its two connections until the gateway answered
        relays = list(self._relays)
        for relay in relays:
            relay.cancel()
        try:
            if relays:
                await asyncio.wait(relays)
        finally:
            await super().close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward one HTTP request from the sandbox to the gateway, with its key and session put in.

        At most ``max_processes`` connections are served at once (the relay inside serves each
        on threads of its own, so no more go through it); one past them is answered 503. The
        program can also connect to the socket itself, and each connection it holds open holds
        a descriptor of this worker, which every rollout here shares.
        """
        if self._server is None:  # accepted as the env closed
            writer.close()
            return
        if self._connections >= self.config.sandbox.max_processes:
            with contextlib.suppress(Exception):
                await _reply(writer, 503, "too many connections to the relay at once")
            writer.close()
            return
        self._connections += 1
        self._relays.add(asyncio.current_task())
        up_writer = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            headers = _header_fields([line for line in header_lines if line])
            if headers is None or any(c in request_line for c in "\r\n\0"):
                # a bare line break would smuggle a header (another session's) past the relay
                await _reply(writer, 400, "malformed request line or header")
                return
            method, target, _ = request_line.split(" ", 2)
            fields = {key.lower(): value for key, value in headers}
            if "transfer-encoding" in fields:
                # the relay frames a body by its Content-Length alone: forwarded, a transfer
                # coding (any case, any of several headers) would frame it twice for the gateway
                await _reply(
                    writer, 411, "transfer-coded request bodies are not supported; send Content-Length"
                )
                return
            endpoint = urllib.parse.urlsplit(target).path
            if (method, endpoint) not in FORWARDED:
                await _reply(writer, 403, f"the relay forwards only {sorted(FORWARDED)}")
                return
            length = int(fields.get("content-length", "0"))
            if length > MAX_BODY:
                await _reply(writer, 400, "request too large")
                return
            if fields.get("expect", "").lower() == "100-continue":
                # curl asks before a large body and waits a second for the go-ahead; the
                # gateway gets the body whole, so the relay gives it
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
            body = await reader.readexactly(length)
            gateway = self.gateway
            upstream_url = urllib.parse.urlsplit(gateway.base_url)
            path = upstream_url.path.rstrip("/") + endpoint[len("/v1") :]
            skip = _DROP_HEADERS | {gateway.header.lower()}
            lines = [f"{method} {path} HTTP/1.1", f"Host: {upstream_url.netloc}"]
            lines += [f"{key}: {value}" for key, value in headers if key.lower() not in skip]
            lines += [
                f"Authorization: Bearer {gateway.api_key}",
                f"{gateway.header}: {gateway.session_id}",
                f"Content-Length: {len(body)}",
                "Connection: close",
            ]
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    upstream_url.hostname, upstream_url.port or 80
                )
                self.requests += 1
                if self.actions is not None:
                    self.actions.waiting()
                try:
                    up_writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
                    await up_writer.drain()
                    reply = await up_reader.read()
                finally:
                    if self.actions is not None:
                        await self.actions.acting()
            except OSError as exc:  # the gateway is down or dropped the request: a 5xx, which clients retry
                await _reply(writer, 502, f"gateway unreachable: {exc}")
                return
            writer.write(reply)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ConnectionError, OSError):
            with contextlib.suppress(Exception):
                await _reply(writer, 400, "malformed request")
        except asyncio.CancelledError:
            pass  # close() ended it; asyncio would log a cancelled handler as an error
        finally:
            self._connections -= 1
            self._relays.discard(asyncio.current_task())
            for stream in (writer, up_writer):
                if stream is not None:
                    with contextlib.suppress(Exception):
                        stream.close()


def prompt_problem(prompt: str) -> str | None:
    """Why ``prompt`` cannot be passed as ``TREADLE_TASK`` (a NUL byte, or too long for an
    environment string: :data:`ENV_STRING_MAX`), or None when it can."""
    if "\0" in prompt:
        return "its prompt cannot be passed as TREADLE_TASK: it holds a NUL byte"
    size = len(f"TREADLE_TASK={prompt}".encode()) + 1
    if size > ENV_STRING_MAX:
        return (
            f"its prompt cannot be passed as TREADLE_TASK: {size} bytes as an environment string, "
            f"over Linux's {ENV_STRING_MAX}"
        )
    return None


def task_json(task: Task) -> str:
    """``task.json``: the task's id, prompt and data."""
    return json.dumps({"id": task.id, "prompt": task.prompt, **task.data})


def _header_fields(lines: list[str]) -> list[tuple[str, str]] | None:
    """``(name, value)`` of each header line; None when one is malformed: no colon, a name
    that is not a token, or a value holding a line break or NUL."""
    fields = []
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not _HEADER_NAME.fullmatch(name) or any(c in value for c in "\r\n\0"):
            return None
        fields.append((name, value.strip()))
    return fields


async def _reply(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "relay", "code": status}}).encode()
    head = f"HTTP/1.1 {status} Error\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    writer.write(head.encode() + body)
    await writer.drain()
