"""The agent env: an agent program in the sandbox reaches its gateway session over the relay.

The upstream here is a small HTTP server in the test that answers chat completions with
scripted shell commands and records what reached it; it checks the relay (session header and
bearer token put in by the worker, never visible to the agent), not the gateway's recording;
``tests/rollout/test_agent_rollout.py`` runs the same agent against the real gateway and
checks its record token by token.
"""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from envs.agent import AgentEnv, GatewaySession
from envs.registry import make, task_set
from envs.sandbox import SandboxConfig, SandboxError, bwrap_path

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")
SCRIPT = (Path(__file__).parent / "agent_script.py").read_text()
REPLIES = ["echo hello > out.txt", "cat out.txt", "echo $OPENAI_API_KEY; env | grep -c secret-token || true"]


class Upstream(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Upstream.seen.append((self.path, dict(self.headers), body))
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        answer = {"choices": [{"message": {"role": "assistant", "content": REPLIES[turn]}}]}
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
    Upstream.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def config(**extra):
    return {
        "command": "python3 -I agent.py",
        "eval_command": "python3 -c \"import json; t = json.load(open('transcript.json')); "
        "print(float(open('out.txt').read() == 'hello\\n' and len(t) == 7))\"",
        "tasks": [{"id": f"t{i}", "prompt": f"make out.txt ({i})"} for i in range(20)],
        "sandbox": SandboxConfig(timeout_s=30, memory_mb=512, cpu_seconds=10).model_dump(),
    } | extra


def test_agent_runs_several_turns_through_its_session(upstream):
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

    result, score, transcript = asyncio.run(episode())
    assert result.info["exit_code"] == 0 and result.info["gateway_requests"] == 3
    assert score == 1.0
    assert transcript[0]["content"] == task.prompt and transcript[4]["content"] == "hello\n"
    assert transcript[6]["content"] == "sandbox\n0\n"
    assert len(Upstream.seen) == 3
    for path, headers, _ in Upstream.seen:
        assert path == "/v1/chat/completions"
        assert headers["X-Treadle-Session"] == "session-42"
        assert headers["Authorization"] == "Bearer secret-token"


def test_agent_needs_a_gateway_and_reports_eval_failures(upstream):
    env = AgentEnv(**config(command="true", eval_command="echo no score"))
    task = task_set("agent", "train", 0, 1, config())[0]
    with pytest.raises(RuntimeError, match="attach_gateway"):
        asyncio.run(env.reset(task))
    with pytest.raises(ValueError, match="http://"):
        env.attach_gateway(GatewaySession("ftp://x", "k", "s"))

    async def episode():
        env.attach_gateway(GatewaySession(upstream, "k", "s"))
        await env.reset(task)
        await env.run()
        try:
            await env.evaluate()
        finally:
            await env.close()

    with pytest.raises(SandboxError, match="no score"):
        asyncio.run(episode())
