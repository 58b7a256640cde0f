"""``pytool``: multi-turn — run Python in a persistent sandboxed interpreter, then answer.

User ``calc 123*456%97``; an action is ``run: <code>`` (observation: what it printed; code
written in Markdown code blocks after ``run:`` is the last block's) or ``answer: <number>``
(ends the episode). The interpreter keeps its variables between runs.
Progress is 0.5 once a run's whole output is the right number, 1 with the right answer.
Output past ``max_observation_chars`` is cut to its end, after a line saying how many
characters were cut. When the sandbox stops a run (too long, too much output, into the
isolation) the observation says so (``[stopped: KIND: ...]``); an interpreter it killed
starts afresh, variables gone.
Problems are split by a canonical key (``456*123%97`` is ``123*456%97``), so a problem held
out for eval never has its commuted twin in train.
"""

from __future__ import annotations

import asyncio
import random

from pydantic import Field

from envs.base import (
    Env,
    EnvConfig,
    ResourceRequest,
    Split,
    StepResult,
    Task,
    fenced_blocks,
    in_eval_split,
    sample_unique,
    stopped,
    tail,
    user,
)
from envs.pyrepl import PythonRepl
from envs.sandbox import SandboxError
from envs.threads import to_thread_to_the_end


class PyToolConfig(EnvConfig):
    """Turn budget and observation size of ``pytool``."""

    max_turns: int = Field(4, ge=1, description="Actions allowed (runs plus the answer).")
    max_observation_chars: int = Field(200, ge=16, description="Printed output shown back to the model.")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Share of problems held out for eval.")


def split_key(expr: str) -> str:
    """``a*b%m`` with the factors in order: both orders share a split."""
    product, modulus = expr.split("%")
    a, b = sorted(product.split("*"), key=int)
    return f"{a}*{b}%{modulus}"


class PyToolEnv(Env):
    """Compute ``a*b%m`` (too long to do in the head of a tiny model); reward 1 for the right answer."""

    name = "pytool"
    config_cls = PyToolConfig
    makes_sandboxes = True

    @classmethod
    def tasks(cls, split: Split, seed: int, n: int, config: PyToolConfig | None = None) -> list[Task]:
        cfg = config or PyToolConfig()

        def make(rng: random.Random) -> Task:
            expr = f"{rng.randint(100, 999)}*{rng.randint(100, 999)}%{rng.randint(11, 97)}"
            return Task(
                env=cls.name, id=expr, prompt=f"calc {expr}", data={"expr": expr, "answer": eval(expr)}
            )

        def accept(task: Task) -> bool:
            return in_eval_split(split_key(task.data["expr"]), cfg.eval_fraction) == (split == "eval")

        return sample_unique(random.Random(f"{seed}/{split}"), make, accept, n)

    @classmethod
    def demonstrate(cls, task: Task, flawed: bool = False, seed: int = 0) -> list[str]:
        """Run the expression, then answer (``flawed``: half the time answers a guess without running)."""
        rng = random.Random(f"{seed}/{task.id}")
        if flawed and rng.random() < 0.5:
            return [f"answer: {rng.randint(0, 96)}"]
        return [f"run: print({task.data['expr']})", f"answer: {task.data['answer']}"]

    async def reset(self, task: Task) -> list[dict[str, str]]:
        self._start(task)
        require_task_data(task)
        sandbox = await self._new_sandbox()
        self.repl = await to_thread_to_the_end(PythonRepl, sandbox, discard=PythonRepl.close)
        self.answer: str | None = None
        self.seen_answer = False
        return user(task.prompt)

    async def close(self) -> None:
        """Close the interpreter (its pipes, its process reaped), then the sandbox; safe to call twice."""
        try:
            await self._close_process("repl")
        finally:  # a cancel leaves the interpreter closing on its thread, not the sandbox
            await super().close()

    def action_request(self, action: str) -> ResourceRequest | None:
        """A ``run:`` executes in the interpreter on one core; an answer needs nothing."""
        if action.strip().startswith("run:"):
            return ResourceRequest(demand={"cpu": 1}, kind="pytool.run")
        return None

    def resource_pid(self) -> int | None:
        repl = getattr(self, "repl", None)
        return repl.proc.pid if repl is not None and repl.alive else None

    async def step(self, action: str) -> StepResult:
        task = self._next_turn()
        text = action.strip()
        expected = str(task.data["answer"])
        if text.startswith("answer:"):
            self.answer = text.removeprefix("answer:").strip()
            reward = float(self.answer == expected)
            return self._ended(StepResult([], reward, True, max(reward, 0.5 * self.seen_answer), {}))
        if text.startswith("run:"):
            code = text.removeprefix("run:").strip()
            feedback = await self._run((fenced_blocks(code) or [code])[-1], expected)
        else:
            feedback = "use run: or answer:"
        done = self.turns >= self.config.max_turns
        return self._ended(StepResult(user(feedback), 0.0, done, 0.5 * self.seen_answer, {}))

    async def _run(self, code: str, expected: str) -> str:
        """Run ``code`` in the interpreter; what the model sees of it."""
        try:
            result = await asyncio.to_thread(self.repl.run, code)
        except SandboxError as exc:
            if not self._by_action(exc):
                raise
            if not self.repl.alive:
                self.repl = await to_thread_to_the_end(PythonRepl, self.sandbox, discard=PythonRepl.close)
            return stopped(exc, self.config.max_observation_chars)
        # the run computed the answer: its whole output is that number (printing many is no proof)
        self.seen_answer = self.seen_answer or result.output.strip() == expected
        return tail(result.output.strip(), self.config.max_observation_chars) or "(no output)"

    async def evaluate(self) -> float:
        task = self._require_task()
        return float(self.answer == str(task.data["answer"]))


def require_task_data(task: Task) -> None:
    """Raise ValueError unless ``task.data`` holds an int ``answer``: a task sent by a client
    with ``42.0`` scored the right answer ``42`` 0, and one without failed its step."""
    answer = task.data.get("answer")
    if type(answer) is not int:
        raise ValueError(f"pytool task {task.id!r}: data must hold an int answer, got {task.data!r:.200}")
