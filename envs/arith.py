"""``arith``: single-turn verifiable arithmetic (user ``12+35=``, assistant ``47``).

Problems are split by a canonical key (``35+12`` is ``12+35``), so a sum held out for eval
never has its commuted twin in train.
"""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field

from envs.base import Env, EnvConfig, Split, StepResult, Task, in_eval_split, sample_unique, user


class ArithConfig(EnvConfig):
    """Operand range and operators of ``arith``."""

    max_turns: int = Field(1, ge=1, le=1, description="Single turn.")
    max_operand: int = Field(99, ge=1, le=10**6, description="Operands are drawn from 0..max_operand.")
    ops: list[Literal["+", "-"]] = Field(["+"], min_length=1, description="Operators to draw from.")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Share of all problems held out for eval.")


def solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def add_without_carry(a: int, b: int, rng: random.Random, drop: float) -> int:
    """Column addition that forgets each carry with probability ``drop`` (the flawed demonstrator)."""
    digits, carry, place = 0, 0, 1
    while a or b or carry:
        column = a % 10 + b % 10 + carry
        digits += (column % 10) * place
        carry = column // 10 if rng.random() >= drop else 0
        a, b, place = a // 10, b // 10, place * 10
    return digits


def subtract_without_borrow(a: int, b: int, rng: random.Random, drop: float) -> int:
    """Column subtraction that forgets each borrow with probability ``drop`` (the flawed
    demonstrator; the analogue of a dropped carry). ``a < b`` is done as ``-(b - a)``."""
    if a < b:
        return -subtract_without_borrow(b, a, rng, drop)
    digits, borrow, place = 0, 0, 1
    while a or b:
        column = a % 10 - b % 10 - borrow
        borrow = 0
        if column < 0:
            column += 10
            borrow = int(rng.random() >= drop)
        digits += column * place
        a, b, place = a // 10, b // 10, place * 10
    return digits


def split_key(a: int, op: str, b: int) -> str:
    """The problem with the operands of a commutative ``op`` in order: both orders share a split."""
    if op == "+":
        a, b = sorted((a, b))
    return f"{a}{op}{b}="


INTEGER = re.compile(r"([+\-\u2212]?)([0-9]+)\.?")
"""An integer as a model may write one: a sign (``+``, or U+2212, the typeset minus) and a
period ending its sentence."""


def written_number(answer: str) -> str:
    """``answer`` less the whitespace around it, as ``str(int)`` writes the integer it holds
    (``+047.`` is ``47``); one that holds none, as it is. No ``int()``: past 4300 digits it raises."""
    text = answer.strip()
    match = INTEGER.fullmatch(text)
    if match is None:
        return text
    sign, digits = match.groups()
    digits = digits.lstrip("0") or "0"
    return f"-{digits}" if sign in ("-", "\u2212") and digits != "0" else digits


def digit_progress(answer: str, expected: int) -> float:
    """Share of the expected digits the answer has right, aligned from the right."""
    want = str(expected)
    got = answer.strip()
    right = sum(1 for x, y in zip(reversed(want), reversed(got), strict=False) if x == y)
    return right / max(len(want), len(got), 1)


class ArithEnv(Env):
    """Answer ``a+b=`` with the number; reward 1 when exact (however its sign is written, with
    leading zeros or a period after it), progress = share of right digits."""

    name = "arith"
    config_cls = ArithConfig

    @classmethod
    def tasks(cls, split: Split, seed: int, n: int, config: ArithConfig | None = None) -> list[Task]:
        cfg = config or ArithConfig()

        def make(rng: random.Random) -> Task:
            a, b, op = rng.randint(0, cfg.max_operand), rng.randint(0, cfg.max_operand), rng.choice(cfg.ops)
            text = f"{a}{op}{b}="
            return Task(env=cls.name, id=text, prompt=text, data={"a": a, "b": b, "op": op})

        def accept(task: Task) -> bool:
            key = split_key(task.data["a"], task.data["op"], task.data["b"])
            return in_eval_split(key, cfg.eval_fraction) == (split == "eval")

        return sample_unique(random.Random(f"{seed}/{split}"), make, accept, n)

    @classmethod
    def demonstrate(cls, task: Task, flawed: bool = False, seed: int = 0) -> list[str]:
        """The answer (``flawed``: column arithmetic that drops most carries or borrows)."""
        a, b, op = task.data["a"], task.data["b"], task.data["op"]
        if not flawed:
            return [str(solve(a, op, b))]
        flaw = add_without_carry if op == "+" else subtract_without_borrow
        return [str(flaw(a, b, random.Random(f"{seed}/{task.id}"), drop=0.8))]

    async def reset(self, task: Task) -> list[dict[str, str]]:
        self._start(task)
        require_task_data(task)
        self.answer: str | None = None
        return user(task.prompt)

    async def step(self, action: str) -> StepResult:
        task = self._next_turn()
        self.answer = written_number(action)
        expected = solve(task.data["a"], task.data["op"], task.data["b"])
        reward = float(self.answer == str(expected))
        return self._ended(
            StepResult([], reward, True, digit_progress(self.answer, expected), {"expected": expected})
        )

    async def evaluate(self) -> float:
        task = self._require_task()
        return float(self.answer == str(solve(task.data["a"], task.data["op"], task.data["b"])))


def require_task_data(task: Task) -> None:
    """Raise ValueError unless ``task.data`` holds int operands ``a`` and ``b`` and an operator
    :func:`solve` knows: a task sent by a client with another operator (``*``) was scored as a
    subtraction, and one with text operands as their concatenation."""
    data = task.data
    if not (all(type(data.get(name)) is int for name in ("a", "b")) and data.get("op") in ("+", "-")):
        raise ValueError(
            f"arith task {task.id!r}: data must hold int a and b and op '+' or '-', got {data!r:.200}"
        )
