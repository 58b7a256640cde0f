"""``guess``: multi-turn — find a hidden number from higher/lower feedback.

User ``guess 9-20`` (a window of ``min_width..max_width`` numbers at any offset inside
``low..high``); each action is a plain number; feedback ``higher``, ``lower`` or ``correct``.
Progress is the share of the window's numbers the feedback has ruled out (1 once found).

A problem is a (window, hidden number) pair. For each hidden number, a hashed
``eval_fraction`` share of the windows that contain it is held out for eval, so the splits
never share a problem and every number occurs in both (in different windows). Splitting by
the hidden number alone, in one fixed window, let RL memorise the few numbers it met
instead of learning to search; here the policy has to bisect relative to the window it is
given.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import defaultdict

from pydantic import Field, model_validator

from envs.base import Env, EnvConfig, Split, StepResult, Task, user

# ASCII digits only (str.isdigit() also passes "²", which int() refuses); 32 digits is far
# past any window and well under int()'s limit on digits.
NUMBER = re.compile(r"-?[0-9]{1,32}")
# tasks() indexes the sorted split, and a problem's split hangs on the hash ranks of every
# problem of its number, so the whole space is listed and ranked (~1 s and 150 MB a million).
MAX_PROBLEMS = 1_000_000


class GuessConfig(EnvConfig):
    """Windows, turn budget and held-out share of ``guess``."""

    low: int = Field(1, ge=0, description="Smallest number of any window.")
    high: int = Field(24, ge=1, le=9999, description="Largest number of any window.")
    min_width: int = Field(8, ge=2, description="Fewest numbers in a window.")
    max_width: int = Field(16, ge=2, description="Most numbers in a window (see MAX_PROBLEMS).")
    max_turns: int = Field(
        6, ge=1, description="Guesses allowed (binary search needs floor(log2(max_width)) + 1)."
    )
    eval_fraction: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="Share of the windows holding each hidden number that is held out for eval.",
    )

    @model_validator(mode="after")
    def _windows(self) -> GuessConfig:
        if self.min_width > self.max_width:
            raise ValueError(f"min_width ({self.min_width}) must not exceed max_width ({self.max_width})")
        if self.high - self.low + 1 < self.max_width:
            raise ValueError(
                f"low..high ({self.low}..{self.high}) must hold at least max_width ({self.max_width}) numbers"
            )
        span = self.high - self.low + 1
        count = sum((span - width + 1) * width for width in range(self.min_width, self.max_width + 1))
        if count > MAX_PROBLEMS:
            raise ValueError(
                f"max_width ({self.max_width}): windows of {self.min_width}..{self.max_width} numbers in "
                f"{self.low}..{self.high} make {count} problems, over the limit of {MAX_PROBLEMS}; "
                "lower max_width or narrow low..high"
            )
        return self


def _rank(low: int, high: int, target: int) -> bytes:
    return hashlib.sha256(f"guess/{low}-{high}/{target}".encode()).digest()


def problems(cfg: GuessConfig, split: Split) -> list[tuple[int, int, int]]:
    """Every ``(window low, window high, hidden number)`` of ``split``, sorted.

    The problems of each hidden number are ranked by a hash; the first
    ``round(eval_fraction * count)`` (at least one, and never all) are eval, the rest train.
    """
    by_target: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for width in range(cfg.min_width, cfg.max_width + 1):
        for start in range(cfg.low, cfg.high - width + 2):
            for target in range(start, start + width):
                by_target[target].append((start, start + width - 1, target))
    chosen = []
    for pairs in by_target.values():
        ranked = sorted(pairs, key=lambda p: _rank(*p))
        held = min(max(1, round(cfg.eval_fraction * len(ranked))), len(ranked) - 1)
        chosen += ranked[:held] if split == "eval" else ranked[held:]
    return sorted(chosen)


class GuessEnv(Env):
    """Binary search game; reward 1 when the number is found within ``max_turns``."""

    name = "guess"
    config_cls = GuessConfig

    @classmethod
    def tasks(cls, split: Split, seed: int, n: int, config: GuessConfig | None = None) -> list[Task]:
        cfg = config or GuessConfig()
        pool = problems(cfg, split)
        if not pool:
            raise ValueError(f"the {split} split of guess {cfg.low}-{cfg.high} is empty; widen the range")
        # each problem once before any twice: an evaluation's mean weighs none of them double
        drawn = random.Random(f"{seed}/{split}").sample(pool, min(n, len(pool)))
        picks = [drawn[i % len(drawn)] for i in range(n)]
        return [
            Task(
                env=cls.name,
                id=f"{low}-{high}:{target}#{i}",
                prompt=f"guess {low}-{high}",
                data={"target": target, "low": low, "high": high},
            )
            for i, (low, high, target) in enumerate(picks)
        ]

    @classmethod
    def demonstrate(cls, task: Task, flawed: bool = False, seed: int = 0) -> list[str]:
        """Binary search (``flawed``: half of the guesses random within the remaining interval)."""
        rng = random.Random(f"{seed}/{task.id}")
        low, high, target = task.data["low"], task.data["high"], task.data["target"]
        actions = []
        while True:
            guess = rng.randint(low, high) if flawed and rng.random() < 0.5 else (low + high) // 2
            actions.append(str(guess))
            if guess == target:
                return actions
            low, high = (guess + 1, high) if guess < target else (low, guess - 1)

    async def reset(self, task: Task) -> list[dict[str, str]]:
        self._start(task)
        require_task_data(task)
        self.low, self.high = task.data["low"], task.data["high"]
        self.found = False
        return user(task.prompt)

    def _progress(self) -> float:
        """Share of the window's numbers the feedback ruled out; 1.0 only once the number is found
        (one candidate left that was never guessed is not a win)."""
        if self.found:
            return 1.0
        span = self.task.data["high"] - self.task.data["low"]
        return 1.0 - max(self.high - self.low + 1, 0) / (span + 1)

    async def step(self, action: str) -> StepResult:
        task = self._next_turn()
        target = task.data["target"]
        text = action.strip()
        if not NUMBER.fullmatch(text):
            feedback = "number?"
        else:
            guess = int(text)
            if guess == target:
                self.found, feedback = True, "correct"
            elif guess < target:
                self.low, feedback = max(self.low, guess + 1), "higher"
            else:
                self.high, feedback = min(self.high, guess - 1), "lower"
        done = self.found or self.turns >= self.config.max_turns
        return self._ended(
            StepResult(user(feedback), float(self.found), done, self._progress(), {"turns": self.turns})
        )

    async def evaluate(self) -> float:
        self._require_task()
        return float(self.found)


def require_task_data(task: Task) -> None:
    """Raise ValueError unless ``task.data`` holds int ``low``, ``target`` and ``high`` in that
    order: a task sent by a client with its number outside its window reached full progress
    without it being found, and an empty window divided by zero."""
    values = [task.data.get(name) for name in ("low", "target", "high")]
    if not (all(type(value) is int for value in values) and values == sorted(values)):
        raise ValueError(
            f"guess task {task.id!r}: data must hold int low <= target <= high, got {task.data!r:.200}"
        )
