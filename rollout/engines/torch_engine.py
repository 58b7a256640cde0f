"""A continuous-batching inference engine on plain PyTorch + transformers (CPU or GPU).

One background thread owns the model. Each iteration it applies a pending weight update,
admits waiting requests (prefilling only the tokens not already in the session's KV cache),
then runs one decode step over every active request together; finished requests leave and
their KV cache goes into a memory-bounded LRU keyed by session id.

Log-probs: each returned log-prob is that of the chosen token under the distribution it
was sampled from — logits divided by ``temperature``, restricted to the top-p nucleus
(the smallest set of most likely tokens whose mass reaches ``top_p``) and renormalised.

Weight updates: a new version is applied between decode steps. KV caches computed by the
old weights are dropped (the session LRU is cleared) and every in-flight request is
re-prefilled under the new weights, so each token tagged with version ``v`` was sampled
from exactly what the weights of ``v`` give for the whole context.
"""

from __future__ import annotations

import asyncio
import glob
import inspect
import math
import numbers
import os
import random
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import DynamicCache, PreTrainedModel

from rl.models import OWN_LAYERS, converts_checkpoint_layout, load_checked, load_tokenizer, placed
from rollout.config import TorchEngineConfig
from rollout.engines.base import (
    ContextLimit,
    EngineError,
    EngineStats,
    Generation,
    InvalidRequest,
    SamplingParams,
)
from storage.weights import PRETRAINED_LOAD_LOCK

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per-layer (keys, values), each (B, H_kv, L, D)."""

MAX_PREFILL_SPREAD = 8
"""Most difference in new-token counts within one batched prefill: the forward keeps the
logits of that many trailing positions for every row."""


def sampling_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from.

    Args:
        logits: (B, V) raw next-token logits.
        temperature: (B,) positive temperatures.
        top_p: (B,) nucleus masses in (0, 1].

    Returns:
        (B, V) log-probs of softmax(logits / temperature) restricted to the top-p nucleus and
        renormalised; ``-inf`` outside the nucleus. The most likely token is always kept.
    """
    logprobs = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)  # (B, V)
    if bool((top_p < 1).any()):
        sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)  # (B, V)
        sorted_probs = sorted_logprobs.exp()
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
        # a row with top_p 1 keeps every token: its float32 mass sums reach 1 before the tail
        outside_sorted = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
        outside = torch.zeros_like(outside_sorted).scatter(-1, order, outside_sorted)
        logprobs = torch.log_softmax(logprobs.masked_fill(outside, -math.inf), dim=-1)
    return logprobs


@dataclass
class _SessionCache:
    tokens: list[int]
    kv: KV
    version: int
    nbytes: int


@dataclass(eq=False)  # compared and hashed by identity: the engine keeps a set of live requests
class _Request:
    session_id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    """Prompt and generated tokens so far; the last one is fed at the next step."""
    cached: int = 0
    """How many leading ``tokens`` have their keys/values computed."""
    kv: KV | None = None
    """This request's cache while it is outside the decode batch (each (1, H_kv, cached, D))."""
    reused: int = 0
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    error: EngineError | None = None
    """Why the request failed on the engine thread (its caller gets this error)."""
    cancelled: bool = False
    session_ended: bool = False
    """``end_session`` ran while this request was live: its cache is not kept."""


def _kv_nbytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, length, D) with zeros in front."""
    return F.pad(tensor, (0, 0, length - tensor.shape[2], 0))


def _kv_of(cache: DynamicCache) -> KV:
    return [(keys, values) for keys, values, *_ in cache]


class TorchEngine:
    """An inference engine replica running a Hugging Face causal LM in this process.

    Args:
        model: a local model directory (a weight version or any HF checkpoint), or a
            loaded ``PreTrainedModel``; the engine owns it from then on (``load_version``
            overwrites its weights in place).
        tokenizer: optional; kept for callers (``self.tokenizer``), never used to re-tokenize.
        name: replica name reported in every ``Generation``.
        version: weight version of ``model``.
        device, dtype, max_batch, kv_cache_bytes, max_prefill_tokens: see ``TorchEngineConfig``.
        on_step: called on the engine thread after every scheduler iteration with the
            current stats (metrics, tracing); it must not call back into the engine.
    """

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel,
        tokenizer=None,
        *,
        name: str = "torch",
        version: int = 0,
        device: str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_batch: int = 64,
        kv_cache_bytes: int = 256 * 2**20,
        max_prefill_tokens: int = 16384,
        on_step: Callable[[EngineStats], None] | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if kv_cache_bytes < 0:
            raise ValueError(f"kv_cache_bytes must be >= 0, got {kv_cache_bytes}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if isinstance(model, str | os.PathLike):
            from transformers import AutoModelForCausalLM

            path = str(model)
            model = load_checked(AutoModelForCausalLM, path, dtype)
            tokenizer = tokenizer or load_tokenizer(path)
        self.model = placed(model, device, dtype).eval()
        self.tokenizer = tokenizer
        self.name = name
        self.version = version
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.kv_cache_bytes = kv_cache_bytes
        self.max_prefill_tokens = max_prefill_tokens
        self.dtype = dtype
        self._converts_layout = converts_checkpoint_layout(self.model)
        text_config = self.model.config.get_text_config()  # a model with a vision tower keeps them there
        self.vocab_size = int(text_config.vocab_size)
        self.max_positions = int(getattr(text_config, "max_position_embeddings", 0) or 2**31)
        self._on_step = on_step
        forward_parameters = inspect.signature(self.model.forward).parameters
        self._cache_argument = "cache" if "cache" in forward_parameters else "past_key_values"
        self._seeds = random.Random()

        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._updates: list[
            tuple[int, dict[str, torch.Tensor], asyncio.AbstractEventLoop, asyncio.Future]
        ] = []
        # Every request from queuing until its caller stops waiting, wherever the engine
        # thread holds it (pending, admitted, re-prefilling, decoding): _fail_all fails them all.
        self._live: set[_Request] = set()
        self._closed = False
        self._failure: BaseException | None = None

        self._batch: list[_Request] = []
        self._reprefill: list[_Request] = []
        self._batch_cache: DynamicCache | None = None
        self._sessions: OrderedDict[str, _SessionCache] = OrderedDict()
        self._sessions_lock = threading.Lock()
        self._session_bytes = 0

        self._stats = EngineStats()
        self._counters = {
            "steps": 0,
            "batched_rows": 0,
            "evictions": 0,
            "updates": 0,
            "max_batch_seen": 0,
            "prefill_forwards": 0,
        }
        self._thread = threading.Thread(target=self._run, name=f"torch-engine-{name}", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls, config: TorchEngineConfig, model: str | os.PathLike | PreTrainedModel, **kwargs
    ) -> TorchEngine:
        """An engine with the settings of ``config``; ``kwargs`` are name, version, tokenizer, on_step."""
        return cls(
            model,
            device=config.device,
            dtype=config.dtype,
            max_batch=config.max_batch,
            kv_cache_bytes=config.kv_cache_bytes,
            max_prefill_tokens=config.max_prefill_tokens,
            **kwargs,
        )

    # -- public API (event-loop side) ----------------------------------------------------

    async def generate(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample a continuation of ``prompt_ids``; see the module docstring for log-probs."""
        prompt = self._validate(session_id, prompt_ids, params)
        loop = asyncio.get_running_loop()
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed if params.seed is not None else self._seeds.getrandbits(63))
        request = _Request(
            session_id=session_id,
            prompt=prompt,
            params=params,
            loop=loop,
            future=loop.create_future(),
            generator=generator,
            max_tokens=min(len(prompt) + params.max_new_tokens, self.max_positions),
            tokens=list(prompt),
        )
        with self._cond:
            self._check_serving()
            self._pending.append(request)
            self._live.add(request)
            self._cond.notify()
        try:
            return await asyncio.shield(request.future)
        except asyncio.CancelledError:
            request.cancelled = True
            raise
        finally:
            with self._cond:
                self._live.discard(request)

    async def load_version(self, version: int, path: str) -> None:
        """Load weights from ``path`` (a local version directory); applied between decode steps.
        Cancelled before they are applied, it leaves the engine on its version."""
        self._check_serving()
        state_dict = await asyncio.to_thread(self._read_weights, path)
        loop = asyncio.get_running_loop()
        applied = loop.create_future()
        with self._cond:
            self._check_serving()
            self._updates.append((version, state_dict, loop, applied))
            self._cond.notify()
        await applied

    def end_session(self, session_id: str) -> None:
        """Forget the KV cache kept for ``session_id`` (no error if there is none), and the one
        a request of it still running would keep: a caller that cancels a turn and ends its
        session at once (the gateway) may see the turn finish before the cancellation lands."""
        with self._cond, self._sessions_lock:
            for request in self._live:
                if request.session_id == session_id:
                    request.session_ended = True
            entry = self._sessions.pop(session_id, None)
            if entry is not None:
                self._session_bytes -= entry.nbytes

    def stats(self) -> EngineStats:
        with self._cond:
            queue_depth = len(self._pending)
            pending_updates = len(self._updates)
        with self._sessions_lock:
            cache_bytes, cache_sessions = self._session_bytes, len(self._sessions)
        counters = dict(self._counters)
        return EngineStats(
            prefill_computed=self._stats.prefill_computed,
            prefill_reused=self._stats.prefill_reused,
            decode_tokens=self._stats.decode_tokens,
            queue_depth=queue_depth,
            requests=self._stats.requests,
            extra={
                "active": float(len(self._batch)),
                "pending_updates": float(pending_updates),
                "cache_bytes": float(cache_bytes),
                "cache_sessions": float(cache_sessions),
                "evictions": float(counters["evictions"]),
                "weight_updates": float(counters["updates"]),
                "decode_steps": float(counters["steps"]),
                "mean_batch": counters["batched_rows"] / counters["steps"] if counters["steps"] else 0.0,
                "max_batch_seen": float(counters["max_batch_seen"]),
                "prefill_forwards": float(counters["prefill_forwards"]),
            },
        )

    async def health(self) -> bool:
        return self._thread.is_alive() and not self._closed and self._failure is None

    async def close(self) -> None:
        """Stop the engine thread; requests still waiting fail with ``EngineError``."""
        self._stop_thread()
        await asyncio.to_thread(self._thread.join)

    def close_now(self) -> None:
        """:meth:`close` for a caller outside an event loop (``build_engines``): returns once
        the engine thread has stopped."""
        self._stop_thread()
        self._thread.join()

    def _stop_thread(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    # -- validation and weight loading -----------------------------------------------------

    def _check_serving(self) -> None:
        """Raise ``EngineError`` when the engine is closed, has failed or its thread is gone."""
        if self._closed or self._failure is not None or not self._thread.is_alive():
            reason = self._failure or ("closed" if self._closed else "its thread has stopped")
            raise EngineError(f"engine {self.name!r} is not serving: {reason}")

    def _validate(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        if not isinstance(session_id, str) or not session_id:
            raise InvalidRequest(f"session_id must be a non-empty string, got {session_id!r}")
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        if len(prompt_ids) == 0:
            raise InvalidRequest("prompt_ids is empty: a generation needs at least one prompt token")
        if len(prompt_ids) >= self.max_positions:
            raise ContextLimit(
                f"prompt has {len(prompt_ids)} tokens, leaving no room to generate in the model's "
                f"{self.max_positions} positions"
            )
        prompt = []
        for index, token in enumerate(prompt_ids):
            # numpy ids (an np.array prompt) are the ints they equal; an id out of range and
            # anything else (a bool, a float, a tensor's element) are refused. A plain int is
            # taken first: the ABC check alone costs 2.7 ms an 8,000-token prompt, on the loop
            if type(token) is not int and (
                not isinstance(token, numbers.Integral) or isinstance(token, bool)
            ):
                raise InvalidRequest(
                    f"prompt_ids[{index}] = {token!r} is a {type(token).__name__}, not a token id "
                    f"(an integer in [0, {self.vocab_size}))"
                )
            if not 0 <= token < self.vocab_size:
                raise InvalidRequest(
                    f"prompt_ids[{index}] = {token!r} is not a token id in [0, {self.vocab_size})"
                )
            prompt.append(int(token))
        return prompt

    def _read_weights(self, path: str) -> dict[str, torch.Tensor]:
        # model.safetensors or HF shards model-0000k-of-0000n; a version directory also
        # holds other safetensors files (the trainer's value model) that are not the policy.
        files = sorted(glob.glob(os.path.join(path, "model*.safetensors")))
        if not files:
            raise EngineError(f"no *.safetensors files in {path!r} (looked for model*.safetensors)")
        if self._converts_layout:
            state_dict = self._read_converted(path)
        else:
            state_dict = {}
            for file in files:
                state_dict.update(load_file(file))
        expected = self.model.state_dict()
        tied = {name for name in expected if name not in state_dict and self._is_tied(name, expected)}
        missing = sorted(set(expected) - set(state_dict) - tied)
        unexpected = sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise EngineError(
                f"weights in {path!r} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, tensor in state_dict.items():
            if tensor.shape != expected[name].shape:
                raise EngineError(
                    f"weights in {path!r}: {name} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(expected[name].shape)}"
                )
        self._check_ties(path, state_dict, expected)
        return state_dict

    @staticmethod
    def _check_ties(
        path: str, state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
    ) -> None:
        """Refuse a checkpoint that holds apart tensors the model ties (an untied checkpoint's
        output head and input embedding): both would load into the model's one tensor, the
        later overwriting the earlier, serving a model that is neither."""
        tied: dict[tuple, str] = {}
        for name, tensor in expected.items():
            if name not in state_dict or tensor.numel() == 0:
                continue
            # one tensor under two names, not a view of another tensor's first elements
            first = tied.setdefault((tensor.data_ptr(), tensor.shape, tensor.stride()), name)
            if first != name and not torch.equal(state_dict[first], state_dict[name]):
                raise EngineError(
                    f"weights in {path!r}: the checkpoint holds {first} and {name} apart, which the "
                    "model ties (one tensor): a checkpoint of a model with other tie_word_embeddings"
                )

    def _read_converted(self, path: str) -> dict[str, torch.Tensor]:
        """The version's tensors in the model's layout where the checkpoint's differs
        (``converts_checkpoint_layout``), converted by ``from_pretrained`` into a copy."""
        from transformers import AutoModelForCausalLM

        try:
            with PRETRAINED_LOAD_LOCK:
                model, info = AutoModelForCausalLM.from_pretrained(
                    path, dtype=self.dtype, output_loading_info=True, **OWN_LAYERS
                )
        except (OSError, RuntimeError, ValueError) as exc:
            raise EngineError(
                f"weights in {path!r} do not load into {type(self.model).__name__}: {exc}"
            ) from exc
        wrong = {
            kind: sorted(info.get(kind) or ())[:5]
            for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
        }
        if any(wrong.values()):
            raise EngineError(f"weights in {path!r} do not fit the model: {wrong}")
        return model.state_dict()

    @staticmethod
    def _is_tied(name: str, expected: dict[str, torch.Tensor]) -> bool:
        pointer = expected[name].data_ptr()
        return any(other != name and tensor.data_ptr() == pointer for other, tensor in expected.items())

    # -- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._pending or self._batch or self._updates):
                        self._cond.wait()
                    if self._closed:
                        break
                    updates = list(self._updates)
                    room = self.max_batch - len(self._batch)
                    admitted, self._pending = self._pending[:room], self._pending[room:]
                for version, state_dict, loop, applied in updates:
                    # a caller that stopped waiting (a load timeout) counts the engine as not loaded
                    if not applied.cancelled():
                        self._apply_update(version, state_dict)
                    with self._cond:  # queued until applied, so _fail_all fails one that was not
                        del self._updates[0]
                    loop.call_soon_threadsafe(_resolve, applied, None)
                with torch.inference_mode():
                    self._step([r for r in admitted if not r.cancelled])
                if self._on_step is not None:
                    self._on_step(self.stats())
        except BaseException as error:  # noqa: BLE001 - any failure must reach the waiting callers
            self._failure = error
        finally:
            self._fail_all()

    def _fail_all(self) -> None:
        reason = f"engine {self.name!r} stopped: {self._failure!r}" if self._failure else "engine closed"
        with self._cond:
            waiting = list(self._live)
            updates, self._updates = self._updates, []
            self._pending = []
        self._batch, self._reprefill, self._batch_cache = [], [], None
        for request in waiting:
            request.loop.call_soon_threadsafe(_reject, request.future, EngineError(reason))
        for *_, loop, applied in updates:
            loop.call_soon_threadsafe(_reject, applied, EngineError(reason))

    def _apply_update(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=False)
        self.version = version
        self._counters["updates"] += 1
        with self._sessions_lock:
            self._sessions.clear()
            self._session_bytes = 0
        for request in self._batch:  # their caches came from the old weights
            request.kv, request.cached = None, 0
        self._reprefill += [r for r in self._batch if not r.cancelled]
        self._batch, self._batch_cache = [], None

    def _step(self, admitted: list[_Request]) -> None:
        joining, self._reprefill = self._reprefill, []
        for request in admitted:
            self._attach_session_cache(request)
        self._prefill([*joining, *admitted])
        self._join([r for r in [*joining, *admitted] if r.finish is None])
        if self._batch:
            self._decode()

    def _attach_session_cache(self, request: _Request) -> None:
        with self._sessions_lock:
            entry = self._sessions.pop(request.session_id, None)
            if entry is not None:
                self._session_bytes -= entry.nbytes
        if entry is None or entry.version != self.version:
            return
        common = 0
        for cached_token, prompt_token in zip(entry.tokens, request.prompt, strict=False):
            if cached_token != prompt_token:
                break
            common += 1
        reuse = min(common, len(request.prompt) - 1)  # the last prompt token must be fed for its logits
        if reuse > 0:
            request.kv = [(k[:, :, :reuse], v[:, :, :reuse]) for k, v in entry.kv]
            request.cached = request.reused = reuse
            self._stats.prefill_reused += reuse

    def _prefill(self, requests: list[_Request]) -> None:
        """Feed every token of each request not yet cached and sample its next token.

        Requests go through the model together in chunks (sorted by how many new tokens
        they have, so right padding stays short); one forward per request made the prefill
        of a multi-turn agent's next turn cost most of the engine's time.
        """
        pending = sorted(requests, key=lambda r: len(r.tokens) - r.cached)
        while pending:
            chunk = [pending.pop(0)]
            while pending and self._fits(chunk + pending[:1]):
                chunk.append(pending.pop(0))
            self._prefill_chunk(chunk)

    def _fits(self, requests: list[_Request]) -> bool:
        """Whether ``requests`` make one prefill forward within the engine's bounds."""
        new = [len(r.tokens) - r.cached for r in requests]
        context = max(r.cached for r in requests) + max(new)
        return len(requests) * context <= self.max_prefill_tokens and max(new) - min(new) < MAX_PREFILL_SPREAD

    def _prefill_chunk(self, requests: list[_Request]) -> None:
        """One forward over ``requests``: each row is its cache, left-padded to the longest,
        then its new tokens, right-padded to the most new tokens. Padding is masked out of
        attention, so every row computes what it would alone."""
        cached = torch.tensor([r.cached for r in requests], device=self.device)  # (B,)
        new = torch.tensor([len(r.tokens) - r.cached for r in requests], device=self.device)  # (B,)
        width, longest = int(new.max()), int(cached.max())
        input_ids = torch.tensor(
            [r.tokens[r.cached :] + [0] * (width - len(r.tokens) + r.cached) for r in requests],
            device=self.device,
        )  # (B, N)
        positions = cached[:, None] + torch.arange(width, device=self.device)[None]  # (B, N)
        # padding, never attended to, may run past the last position (a learned position
        # table such as GPT-2's has no row there)
        positions = positions.clamp(max=self.max_positions - 1)
        columns = torch.arange(longest + width, device=self.device)  # (L + N,)
        attention_mask = (
            (columns[None] >= (longest - cached)[:, None]) & (columns[None] < (longest + new)[:, None])
        ).long()  # (B, L + N)
        cache = self._padded_cache(requests, longest)
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=width - int(new.min()) + 1,
            **{self._cache_argument: cache},
        )
        last = output.logits.shape[1] - 1 - (width - new)  # (B,) each row's last real token
        logits = output.logits[torch.arange(len(requests), device=self.device), last]  # (B, V)
        kv = _kv_of(cache)
        for row, request in enumerate(requests):
            start, end = longest - request.cached, longest + len(request.tokens) - request.cached
            request.kv = [(k[row : row + 1, :, start:end], v[row : row + 1, :, start:end]) for k, v in kv]
            self._stats.prefill_computed += len(request.tokens) - request.cached
            request.cached = len(request.tokens)
        self._counters["prefill_forwards"] += 1
        self._sample(requests, logits)
        for request in requests:
            if request.finish is not None:
                self._finish(request, request.kv)

    def _padded_cache(self, requests: list[_Request], length: int) -> DynamicCache:
        """The requests' caches, each left-padded with zeros to ``length`` tokens."""
        reference = next((r.kv for r in requests if r.kv), None)
        if reference is None:
            return DynamicCache()
        layers = []
        for layer, (keys, values) in enumerate(reference):
            rows_k = [_left_pad(r.kv[layer][0] if r.kv else keys[:, :, :0], length) for r in requests]
            rows_v = [_left_pad(r.kv[layer][1] if r.kv else values[:, :, :0], length) for r in requests]
            layers.append((torch.cat(rows_k), torch.cat(rows_v)))
        return DynamicCache(ddp_cache_data=layers)

    def _join(self, requests: list[_Request]) -> None:
        """Add prefilled requests to the decode batch (left-padding every cache to one length)."""
        if not requests:
            return
        old_kv = _kv_of(self._batch_cache) if self._batch else []
        length = max([r.cached for r in requests] + ([old_kv[0][0].shape[2]] if old_kv else []))
        merged = []
        for layer in range(len(requests[0].kv)):
            parts_k = [_left_pad(old_kv[layer][0], length)] if old_kv else []
            parts_v = [_left_pad(old_kv[layer][1], length)] if old_kv else []
            parts_k += [_left_pad(r.kv[layer][0], length) for r in requests]
            parts_v += [_left_pad(r.kv[layer][1], length) for r in requests]
            merged.append((torch.cat(parts_k), torch.cat(parts_v)))
        for request in requests:
            request.kv = None
        self._batch = self._batch + requests
        self._batch_cache = DynamicCache(ddp_cache_data=merged)

    def _decode(self) -> None:
        """One decode step over the whole batch: feed each row's last token, sample the next."""
        batch = self._batch
        cache_length = self._batch_cache.get_seq_length()
        lengths = torch.tensor([r.cached for r in batch], device=self.device)  # (B,)
        columns = torch.arange(cache_length + 1, device=self.device)  # (L + 1,)
        attention_mask = (columns[None] >= (cache_length - lengths)[:, None]).long()  # (B, L + 1)
        output = self.model(
            input_ids=torch.tensor([[r.tokens[-1]] for r in batch], device=self.device),
            attention_mask=attention_mask,
            position_ids=lengths[:, None],
            use_cache=True,
            **{self._cache_argument: self._batch_cache},
        )
        for request in batch:
            request.cached += 1
        self._counters["steps"] += 1
        self._counters["batched_rows"] += len(batch)
        self._counters["max_batch_seen"] = max(self._counters["max_batch_seen"], len(batch))
        self._sample(batch, output.logits[:, -1])
        self._leave()

    def _leave(self) -> None:
        """Remove finished or cancelled rows; their caches go to the session LRU."""
        keep = [i for i, r in enumerate(self._batch) if r.finish is None and not r.cancelled]
        if len(keep) == len(self._batch):
            return
        kv = _kv_of(self._batch_cache)
        cache_length = kv[0][0].shape[2]
        for index, request in enumerate(self._batch):
            if index not in keep:
                start = cache_length - request.cached
                self._finish(
                    request,
                    [(k[index : index + 1, :, start:], v[index : index + 1, :, start:]) for k, v in kv],
                )
        self._batch = [self._batch[i] for i in keep]
        if not keep:
            self._batch_cache = None
            return
        rows = torch.tensor(keep, device=self.device)
        trim = cache_length - max(r.cached for r in self._batch)
        self._batch_cache = DynamicCache(
            ddp_cache_data=[(k[rows, :, trim:], v[rows, :, trim:]) for k, v in kv]
        )

    def _sample(self, requests: list[_Request], logits: torch.Tensor) -> None:
        """Sample one token per request from ``logits`` (B, V) and record it.

        A row whose distribution is not finite (NaN or inf logits) fails only its own
        request: sampling it would raise on the engine thread and fail every request.
        """
        temperature = torch.tensor([r.params.temperature for r in requests], device=self.device)
        top_p = torch.tensor([r.params.top_p for r in requests], device=self.device)
        logprobs = sampling_logprobs(logits, temperature, top_p)  # (B, V)
        probs = logprobs.exp()
        finite = torch.isfinite(probs).all(dim=-1).tolist()  # (B,)
        for request, ok in zip(requests, finite, strict=True):
            if not ok:
                request.finish = "abort"
                request.error = EngineError(
                    f"engine {self.name!r} got a non-finite next-token distribution for session "
                    f"{request.session_id!r} (NaN or inf logits)"
                )
        rows = [row for row, ok in enumerate(finite) if ok]
        if not rows:
            return
        sampled = [requests[row] for row in rows]
        chosen = [
            torch.multinomial(probs[row], 1, generator=request.generator)
            for row, request in zip(rows, sampled, strict=True)
        ]
        chosen_ids = torch.cat(chosen)  # (R,)
        rows_index = torch.tensor(rows, device=self.device)  # (R,)
        chosen_logprobs = logprobs[rows_index, chosen_ids].tolist()
        for request, token, logprob in zip(sampled, chosen_ids.tolist(), chosen_logprobs, strict=True):
            request.tokens.append(token)
            request.generated.append(token)
            request.logprobs.append(logprob)
            request.versions.append(self.version)
            self._stats.decode_tokens += 1
            if token in request.params.stop_ids:
                request.finish = "stop"
            elif (
                len(request.generated) >= request.params.max_new_tokens
                or len(request.tokens) >= request.max_tokens
            ):
                request.finish = "length"

    def _finish(self, request: _Request, kv: KV) -> None:
        """Keep the session's cache (tokens[:cached]), then resolve the caller's future.

        In that order, so a caller's next turn (or ``end_session``) always sees the cache.
        A cancelled request does neither: its caller is gone and has usually ended the
        session already, so its cache would only push live sessions out of the LRU. A
        failed request keeps no cache and fails its caller's future with its error.
        """
        if request.cancelled:
            return
        if request.error is not None:
            request.loop.call_soon_threadsafe(_reject, request.future, request.error)
            return
        self._remember(request, kv)
        self._stats.requests += 1
        generation = Generation(
            token_ids=request.generated,
            logprobs=request.logprobs,
            versions=request.versions,
            finish_reason=request.finish or "abort",
            prompt_tokens=len(request.prompt),
            cached_tokens=request.reused,
            engine=self.name,
        )
        request.loop.call_soon_threadsafe(_resolve, request.future, generation)

    def _remember(self, request: _Request, kv: KV) -> None:
        """Keep ``kv`` as the cache of ``request.tokens[:cached]`` for its session."""
        kv = [(k.clone(), v.clone()) for k, v in kv]
        nbytes = _kv_nbytes(kv)
        if nbytes > self.kv_cache_bytes:
            return
        session_id, tokens = request.session_id, request.tokens[: request.cached]
        with self._sessions_lock:
            if request.session_ended:  # checked under the lock end_session sets it with
                return
            previous = self._sessions.pop(session_id, None)
            if previous is not None:
                self._session_bytes -= previous.nbytes
            self._sessions[session_id] = _SessionCache(tokens, kv, self.version, nbytes)
            self._session_bytes += nbytes
            while self._session_bytes > self.kv_cache_bytes:
                _, evicted = self._sessions.popitem(last=False)
                self._session_bytes -= evicted.nbytes
                self._counters["evictions"] += 1


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
        # A cancelled caller no longer awaits this future (generate shields it); mark the
        # error seen so closing the engine does not log "exception was never retrieved".
        future.exception()
