"""``guess``: multi-turn — find a hidden number from higher/lower feedback.

User ``guess 1-16``; each action is a plain number; feedback ``higher``, ``lower`` or
``correct``. Progress is how far the interval consistent with the feedback has shrunk.
"""

from __future__ import annotations

import random

from pydantic import Field, model_validator

from envs.base import Env, EnvConfig, Split, StepResult, Task, in_eval_split, user


class GuessConfig(EnvConfig):
    """Range and turn budget of ``guess``."""

    low: int = Field(1, ge=0, description="Smallest possible hidden number.")
    high: int = Field(16, ge=1, le=9999, description="Largest possible hidden number.")
    max_turns: int = Field(6, ge=1, description="Guesses allowed (binary search needs log2(range) + 1).")
    eval_fraction: float = Field(0.25, gt=0, lt=1, description="Share of hidden numbers held out for eval.")

    @model_validator(mode="after")
    def _range(self) -> GuessConfig:
        if self.high <= self.low:
            raise ValueError(f"high ({self.high}) must be above low ({self.low})")
        return self


class GuessEnv(Env):
    """Binary search game; reward 1 when the number is found within ``max_turns``."""

    name = "guess"
    config_cls = GuessConfig

    @classmethod
    def tasks(cls, split: Split, seed: int, n: int, config: GuessConfig | None = None) -> list[Task]:
        cfg = config or GuessConfig()
        targets = [
            t
            for t in range(cfg.low, cfg.high + 1)
            if in_eval_split(f"guess/{cfg.low}-{cfg.high}/{t}", cfg.eval_fraction) == (split == "eval")
        ]
        if not targets:
            raise ValueError(f"the {split} split of guess {cfg.low}-{cfg.high} is empty; widen the range")
        rng = random.Random(f"{seed}/{split}")
        prompt = f"guess {cfg.low}-{cfg.high}"
        picks = [rng.choice(targets) for _ in range(n)]
        return [
            Task(
                env=cls.name,
                id=f"{cfg.low}-{cfg.high}:{t}#{i}",
                prompt=prompt,
                data={"target": t, "low": cfg.low, "high": cfg.high},
            )
            for i, t in enumerate(picks)
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
        self.low, self.high = task.data["low"], task.data["high"]
        self.found = False
        return user(task.prompt)

    def _progress(self) -> float:
        if self.found:
            return 1.0
        span = self.task.data["high"] - self.task.data["low"]
        return 1.0 - max(self.high - self.low, 0) / span

    async def step(self, action: str) -> StepResult:
        task = self._require_task()
        self.turns += 1
        target = task.data["target"]
        text = action.strip()
        if not text.lstrip("-").isdigit():
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
        return StepResult(user(feedback), float(self.found), done, self._progress(), {"turns": self.turns})

    async def evaluate(self) -> float:
        self._require_task()
        return float(self.found)
