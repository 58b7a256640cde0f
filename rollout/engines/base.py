"""The protocol every inference engine speaks: token ids in, token ids and log-probs out."""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


class EngineError(RuntimeError):
    """The engine failed (crashed, unreachable, out of memory): an infrastructure error."""


class NotServing(EngineError):
    """The engine is up (it passes its health check) but serves nothing until its weights are
    loaded again: a reload failed midway, or the server restarted onto its launch weights. A
    router takes it out of service as if down and fails the request over; its health check's
    ``restore`` loads the weights."""


class InvalidRequest(ValueError):
    """The request itself is wrong (empty prompt, token id out of vocabulary, too long)."""


class ContextLimit(InvalidRequest):
    """The request does not fit the context: the prompt is longer than a session or model allows."""


MIN_TEMPERATURE = 1e-5
"""Smallest sampling temperature. Far below it, logits divided by the temperature overflow
to inf and the distribution cannot be sampled. vLLM's floor is higher
(``rollout.engines.vllm_engine.VLLM_MIN_TEMPERATURE``): it samples a smaller one at 0.01."""


def mixed_seed(*parts: object) -> int:
    """A sampling seed in ``[0, 2**64)`` hashed from ``parts``. One seed draws the same random
    numbers whatever the context, so seeds of related samplings (a rollout's turns, consecutive
    rollouts) must not be related as numbers (``seed + 1``): each is hashed from what sets it
    apart."""
    text = "/".join(map(str, parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _integer(value: object) -> bool:
    """An exact integer: a Python or numpy one, never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: object) -> bool:
    """A real number: a Python or numpy one, never a bool (numpy's is not a number)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one generation.

    ``logprobs`` returned by engines are log-probabilities of the chosen tokens under the
    distribution actually sampled from: logits divided by ``temperature``, then restricted
    to the top-p nucleus and renormalised.

    A generation ends at the first of ``stop_ids`` it samples (kept as its last token), or
    after ``max_new_tokens``: the model's EOS ends it only when ``stop_ids`` list it.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        # a float budget (2.5) generated 3 tokens; a string temperature failed as a TypeError
        if not _integer(self.max_new_tokens):
            raise InvalidRequest(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (
            _real(self.temperature)
            and math.isfinite(self.temperature)
            and self.temperature >= MIN_TEMPERATURE
        ):
            raise InvalidRequest(
                f"temperature must be a finite number >= {MIN_TEMPERATURE}, got {self.temperature!r}"
            )
        if not (_real(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        # checked here: a stop_ids the engine cannot test tokens against (None) failed on the
        # torch engine's thread, stopping it for every request
        if not isinstance(self.stop_ids, tuple | list):
            raise InvalidRequest(f"stop_ids must be a tuple of token ids, got {type(self.stop_ids).__name__}")
        bad = [token for token in self.stop_ids if not _integer(token)]
        if bad:
            raise InvalidRequest(f"stop_ids must be token ids, got {bad[0]!r}")
        if self.seed is not None and not (_integer(self.seed) and -(2**63) <= int(self.seed) < 2**64):
            raise InvalidRequest(f"seed must be a 64-bit integer in [-2**63, 2**64), got {self.seed!r}")
        # numpy numbers (a seed drawn with numpy) as the Python ones they equal: engines put
        # them in JSON (vLLM) and compare token ids with them
        for name, kind in (("max_new_tokens", int), ("temperature", float), ("top_p", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        object.__setattr__(self, "stop_ids", tuple(int(token) for token in self.stop_ids))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))


@dataclass
class Generation:
    """One engine response: the new tokens with their sampling log-probs and versions."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    prompt_tokens: int = 0
    cached_tokens: int = 0
    engine: str = ""


@dataclass
class EngineStats:
    """Counters since the engine started."""

    prefill_computed: int = 0
    prefill_reused: int = 0
    decode_tokens: int = 0
    queue_depth: int = 0
    requests: int = 0
    extra: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """An inference engine replica.

    ``generate`` is a coroutine so that many rollouts can wait on one engine at once;
    engines batch concurrent requests internally.
    """

    name: str
    version: int

    async def generate(
        self, session_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> Generation: ...

    async def load_version(self, version: int, path: str) -> None:
        """Load weight version ``version`` from the local directory ``path``."""

    def end_session(self, session_id: str) -> None:
        """Forget any cache kept for ``session_id``."""

    def stats(self) -> EngineStats: ...

    async def health(self) -> bool: ...

    async def close(self) -> None: ...
