"""TorchEngine: exact log-probs, continuous batching, session KV cache, weight updates, bad input.

Every log-prob is checked against a separate full forward pass of the same weights, with
the temperature / top-p distribution written out by hand.
"""

from __future__ import annotations

import asyncio
import copy
import math
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from rl.models import TinyModelConfig, build_tiny_model, load_policy, publish_policy
from rollout.engines.base import MIN_TEMPERATURE, Engine, EngineError, InvalidRequest, SamplingParams
from rollout.engines.factory import EngineConfig, build_engines, replica_device
from rollout.engines.torch_engine import TorchEngine, TorchEngineConfig, sampling_logprobs
from rollout.ray_engine import actor_device
from rollout.router import Router, RouterConfig
from storage.config import RunStore, StorageConfig
from storage.weights import MODEL_FILE, WeightStore
from tests.rl.moe import tiny_mixture_of_experts

SMALL = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_position_embeddings=96
)
TOLERANCE = 1e-4
DEADLINE_S = 30.0
"""Bound on waiting for an engine answer: a hang fails the test instead of blocking the suite."""


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(SMALL)


@pytest.fixture(scope="module")
def other_model():
    model, _ = build_tiny_model(SMALL.model_copy(update={"seed": 1}))
    return model


@pytest.fixture(scope="module")
def weights(tmp_path_factory, tiny, other_model) -> WeightStore:
    """Version 0 = ``tiny``, version 1 = ``other_model``."""
    store = WeightStore(RunStore(StorageConfig(root=str(tmp_path_factory.mktemp("runs"))), "run"))
    publish_policy(store, tiny[0], tiny[1])
    publish_policy(store, other_model, tiny[1], parent=0, step=1)
    return store


def engine_for(model, **kwargs) -> TorchEngine:
    return TorchEngine(copy.deepcopy(model), name="torch-test", **kwargs)


def reference_logprobs(model, prompt, generated, temperature=1.0, top_p=1.0) -> list[float]:
    """Log-prob of each generated token from one full forward pass, nucleus built by a loop."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].double()  # (T, V)
    result = []
    for index, token in enumerate(generated):
        probs = torch.softmax(logits[len(prompt) - 1 + index] / temperature, dim=-1).tolist()
        kept, mass = [], 0.0
        for candidate in sorted(range(len(probs)), key=lambda t: -probs[t]):
            if mass >= top_p:
                break
            kept.append(candidate)
            mass += probs[candidate]
        assert token in kept, f"token {token} at {index} was sampled outside the nucleus"
        result.append(math.log(probs[token] / sum(probs[t] for t in kept)))
    return result


def assert_logprobs_match(actual, expected):
    assert len(actual) == len(expected)
    worst = max(abs(a - b) for a, b in zip(actual, expected, strict=True))
    assert worst < TOLERANCE, f"log-probs differ by {worst}"


def wait_for(condition, what: str, deadline_s: float = 60.0) -> None:
    """Block (on the engine thread) until ``condition()``; fail loudly instead of hanging."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.005)


def held_step(blocked: threading.Event, release: threading.Event, what: str, after_tokens: int | None = None):
    """An ``on_step`` hook that holds the engine thread, once, at its first step (or at the
    step after which it has decoded ``after_tokens`` tokens) until ``release`` is set;
    ``blocked`` says it is held."""

    def hold(stats) -> None:
        if (after_tokens is None or stats.decode_tokens == after_tokens) and not blocked.is_set():
            blocked.set()
            wait_for(release.is_set, what)

    return hold


def held_until_arrived(box: dict, count: int):
    """An ``on_step`` hook that holds the engine thread after its first decode step until
    ``count`` requests are queued or decoding on ``box["engine"]``, so they share the batch."""

    def hold(stats) -> None:
        if stats.extra["decode_steps"] == 1:
            engine = box["engine"]
            wait_for(
                lambda: engine.stats().queue_depth + engine.stats().extra["active"] == count,
                "all requests to arrive",
            )

    return hold


def kv_bytes_per_token(model) -> int:
    """Bytes of the float32 keys and values the engine keeps per cached token of ``model``."""
    config = model.config
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4


def crash(*args, **kwargs):
    """Stands in for a model call that hits a CUDA error on the engine thread."""
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_sampling_logprobs_match_a_slow_reference():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 17, generator=generator) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.8, 1.3])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.05, 0.999])
    fast = sampling_logprobs(logits, temperature, top_p)
    for row in range(5):
        probs = torch.softmax(logits[row].double() / temperature[row].double(), dim=-1).tolist()
        kept, mass = [], 0.0
        for token in sorted(range(17), key=lambda t: -probs[t]):
            if mass >= float(top_p[row]):
                break
            kept.append(token)
            mass += probs[token]
        total = sum(probs[t] for t in kept)
        for token in range(17):
            if token in kept:
                assert abs(fast[row, token].item() - math.log(probs[token] / total)) < 1e-5
            else:
                assert fast[row, token].item() == -math.inf
    assert (fast[3] > -math.inf).sum() == 1  # a tiny nucleus keeps only the top token


def test_a_nucleus_ends_with_the_token_whose_mass_reaches_top_p():
    """Four equally likely tokens (their float32 masses exact): top_p 0.5 is reached by two
    tokens, so the third, whose mass before it is exactly 0.5, is outside the nucleus."""
    logits = torch.zeros(2, 4)
    fast = sampling_logprobs(logits, torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.75]))
    assert (fast > -math.inf).sum(dim=-1).tolist() == [2, 3]
    kept = fast[fast > -math.inf]
    torch.testing.assert_close(kept[:2], torch.full((2,), math.log(1 / 2)))
    torch.testing.assert_close(kept[2:], torch.full((3,), math.log(1 / 3)))


def test_a_full_nucleus_keeps_every_token_beside_a_row_with_a_smaller_one():
    """top_p 1 samples from the whole distribution whatever the other rows of the batch ask:
    over a large vocabulary the float32 running mass reaches 1 before the last tokens, which
    then fell outside the nucleus (here 1418 tokens that could never be sampled)."""
    logits = torch.randn(2, 50_000, generator=torch.Generator().manual_seed(0)) * 3
    temperature = torch.tensor([1.0, 1.0])
    batched = sampling_logprobs(logits, temperature, torch.tensor([1.0, 0.5]))
    alone = sampling_logprobs(logits[:1], temperature[:1], torch.tensor([1.0]))
    assert torch.isfinite(batched[0]).all()
    torch.testing.assert_close(batched[0], alone[0])
    torch.testing.assert_close(batched[0], torch.log_softmax(logits[0], dim=-1))


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.85), (MIN_TEMPERATURE, 1.0)])
def test_logprobs_match_a_separate_forward_pass(tiny, temperature, top_p):
    model, tokenizer = tiny
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12+30?"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=24, temperature=temperature, top_p=top_p, seed=3)

    async def run():
        engine = engine_for(model, version=7)
        assert isinstance(engine, Engine)
        try:
            return await engine.generate("s", prompt_ids, params), engine.stats()
        finally:
            await engine.close()

    generation, stats = asyncio.run(run())
    assert len(generation.token_ids) == 24 and generation.finish_reason == "length"
    assert generation.versions == [7] * 24 and generation.engine == "torch-test"
    assert generation.prompt_tokens == len(prompt_ids) and generation.cached_tokens == 0
    assert stats.prefill_computed == len(prompt_ids) and stats.decode_tokens == 24
    assert_logprobs_match(
        generation.logprobs, reference_logprobs(model, prompt_ids, generation.token_ids, temperature, top_p)
    )


def test_multi_turn_session_prefills_only_new_tokens(tiny):
    model, _ = tiny
    first_prompt = [2, 40, 41, 42, 43, 44, 3]
    observation = [2, 50, 51, 52]
    params = SamplingParams(max_new_tokens=10, seed=11)

    async def run():
        engine = engine_for(model)
        try:
            first = await engine.generate("s", first_prompt, params)
            after_first = engine.stats()
            second_prompt = first_prompt + first.token_ids + observation
            second = await engine.generate("s", second_prompt, params)
            after_second = engine.stats()
            diverging = await engine.generate("s", [*second_prompt[:5], 60, 61], params)
            engine.end_session("s")
            ended = engine.stats()
            forgotten = await engine.generate("s", [*second_prompt, *second.token_ids], params)
            retried = await engine.generate("s", [*second_prompt, *second.token_ids], params)
            return (
                first,
                second,
                second_prompt,
                diverging,
                forgotten,
                retried,
                after_first,
                after_second,
                ended,
            )
        finally:
            await engine.close()

    first, second, second_prompt, diverging, forgotten, retried, after_first, after_second, ended = (
        asyncio.run(run())
    )
    assert after_first.prefill_computed == len(first_prompt)
    cached = len(first_prompt) + len(first.token_ids) - 1  # the last sampled token was never fed
    assert second.cached_tokens == cached
    assert after_second.prefill_reused == cached
    assert after_second.prefill_computed - after_first.prefill_computed == len(observation) + 1
    assert_logprobs_match(second.logprobs, reference_logprobs(model, second_prompt, second.token_ids))
    assert diverging.cached_tokens == 5
    assert_logprobs_match(
        diverging.logprobs, reference_logprobs(model, [*second_prompt[:5], 60, 61], diverging.token_ids)
    )
    assert forgotten.cached_tokens == 0
    assert ended.extra["cache_sessions"] == 0 and ended.extra["cache_bytes"] == 0
    # the same prompt again reuses all of it but its last token, which is fed for its logits
    retried_prompt = [*second_prompt, *second.token_ids]
    assert retried.cached_tokens == len(retried_prompt) - 1
    assert_logprobs_match(retried.logprobs, reference_logprobs(model, retried_prompt, retried.token_ids))


def test_concurrent_requests_share_decode_steps_and_equal_unbatched_runs(tiny):
    model, _ = tiny
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20], [30, 31, 32, 33, 34], [40, 41], [50] * 9]
    params = [
        SamplingParams(
            max_new_tokens=12 + 3 * i, temperature=0.6 + 0.2 * i, top_p=1.0 - 0.05 * i, seed=100 + i
        )
        for i in range(len(prompts))
    ]
    engine_box = {}

    async def run():
        batched_engine = engine_for(model, on_step=held_until_arrived(engine_box, len(prompts)))
        engine_box["engine"] = batched_engine
        alone_engine = engine_for(model)
        try:
            batched = await asyncio.gather(
                *[
                    batched_engine.generate(f"b{i}", p, sp)
                    for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
                ]
            )
            alone = [
                await alone_engine.generate(f"a{i}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            return batched, alone, batched_engine.stats(), alone_engine.stats()
        finally:
            await batched_engine.close()
            await alone_engine.close()

    batched, alone, batched_stats, alone_stats = asyncio.run(run())
    assert batched_stats.extra["max_batch_seen"] == len(prompts)
    assert alone_stats.extra["max_batch_seen"] == 1
    assert batched_stats.extra["decode_steps"] < alone_stats.extra["decode_steps"]
    for prompt, sampling, together, single in zip(prompts, params, batched, alone, strict=True):
        assert together.token_ids == single.token_ids
        assert len(together.token_ids) == sampling.max_new_tokens
        assert max(abs(a - b) for a, b in zip(together.logprobs, single.logprobs, strict=True)) < 1e-5
        assert_logprobs_match(
            together.logprobs,
            reference_logprobs(model, prompt, together.token_ids, sampling.temperature, sampling.top_p),
        )


@pytest.mark.parametrize("max_prefill_tokens", [16384, 1])
def test_next_turns_of_concurrent_sessions_prefill_in_one_forward(tiny, max_prefill_tokens):
    """Sessions with caches of different lengths and different new-token counts are
    prefilled together (or one by one under a tiny bound) and each computes what it would
    alone: the log-probs of a full forward pass over its whole history."""
    model, _ = tiny
    first_prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20], [30, 31, 32, 33, 34]]
    observations = [[40, 41], [42], [43, 44, 45, 46], [47, 48, 49]]
    box: dict = {"hold_at": None}

    def hold_until_every_turn_queued(stats):
        if stats.requests == box["hold_at"]:  # the step that served the gate request
            box["hold_at"] = None
            engine = box["engine"]
            wait_for(lambda: engine.stats().queue_depth == len(first_prompts), "every next turn to queue")

    async def run():
        engine = engine_for(
            model, on_step=hold_until_every_turn_queued, max_prefill_tokens=max_prefill_tokens
        )
        box["engine"] = engine
        try:
            firsts = await asyncio.gather(
                *[
                    engine.generate(f"s{i}", prompt, SamplingParams(max_new_tokens=3 + 2 * i, seed=i))
                    for i, prompt in enumerate(first_prompts)
                ]
            )
            prompts = [
                p + f.token_ids + o for p, f, o in zip(first_prompts, firsts, observations, strict=True)
            ]
            box["hold_at"] = len(firsts) + 1
            await engine.generate("gate", [1, 2], SamplingParams(max_new_tokens=1, seed=0))
            before = engine.stats()
            seconds = await asyncio.gather(
                *[
                    engine.generate(f"s{i}", prompt, SamplingParams(max_new_tokens=6, seed=10 + i))
                    for i, prompt in enumerate(prompts)
                ]
            )
            return firsts, prompts, seconds, before, engine.stats()
        finally:
            await engine.close()

    firsts, prompts, seconds, before, after = asyncio.run(run())
    forwards = after.extra["prefill_forwards"] - before.extra["prefill_forwards"]
    assert forwards == (1 if max_prefill_tokens > 1 else len(prompts))
    for first_prompt, first, prompt, second in zip(first_prompts, firsts, prompts, seconds, strict=True):
        assert second.cached_tokens == len(first_prompt) + len(first.token_ids) - 1
        assert len(second.token_ids) == 6
        assert_logprobs_match(second.logprobs, reference_logprobs(model, prompt, second.token_ids))


@pytest.mark.parametrize(("max_prefill_tokens", "forwards"), [(8, 1), (7, 2)])
def test_max_prefill_tokens_bounds_a_forward_inclusively(tiny, max_prefill_tokens, forwards):
    """Two queued 4-token prompts make 8 padded tokens: one forward under a bound of 8, two under 7."""
    model, _ = tiny
    blocked = threading.Event()
    release = threading.Event()
    hold_first_step = held_step(blocked, release, "both prompts to queue")

    async def run():
        engine = engine_for(model, on_step=hold_first_step, max_prefill_tokens=max_prefill_tokens)
        try:
            gate = asyncio.create_task(engine.generate("gate", [3], SamplingParams(max_new_tokens=1)))
            await asyncio.to_thread(blocked.wait, DEADLINE_S)
            before = engine.stats()
            both = [
                asyncio.create_task(
                    engine.generate(f"s{i}", [5 + i, 6, 7, 8], SamplingParams(max_new_tokens=1))
                )
                for i in range(2)
            ]
            await asyncio.sleep(0)
            release.set()
            await asyncio.wait_for(asyncio.gather(gate, *both), DEADLINE_S)
            return before, engine.stats()
        finally:
            release.set()
            await engine.close()

    before, after = asyncio.run(run())
    assert after.extra["prefill_forwards"] - before.extra["prefill_forwards"] == forwards


def test_a_batched_prefill_near_the_context_limit_keeps_within_the_models_positions():
    """A row prefilled beside one with more new tokens is right-padded: its padding must not
    take positions past the model's last, which a learned position table (GPT-2) has no
    row for; the engine died of the IndexError."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2
        )
        model = AutoModelForCausalLM.from_config(config).eval()
    box: dict = {"hold_at": None}

    def hold_until_both_queued(stats):
        if stats.requests == box["hold_at"]:  # the step that served the gate request
            box["hold_at"] = None
            engine = box["engine"]
            wait_for(lambda: engine.stats().queue_depth == 2, "both requests to queue")

    first_prompt = list(range(3, 27))
    short = list(range(3, 15))  # 12 new tokens

    async def run():
        engine = engine_for(model, on_step=hold_until_both_queued)
        box["engine"] = engine
        try:
            first = await engine.generate("near", first_prompt, SamplingParams(max_new_tokens=1, seed=0))
            # 24 cached tokens and 6 new ones (positions 24-29), padded to 12 beside the short prompt
            near = first_prompt + first.token_ids + [5, 6, 7, 8, 9]
            box["hold_at"] = 2
            await engine.generate("gate", [3], SamplingParams(max_new_tokens=1, seed=0))
            before = engine.stats()
            both = await asyncio.gather(
                engine.generate("near", near, SamplingParams(max_new_tokens=2, seed=1)),
                engine.generate("short", short, SamplingParams(max_new_tokens=2, seed=2)),
            )
            return near, both, before, engine.stats()
        finally:
            await engine.close()

    near, (near_turn, short_turn), before, after = asyncio.run(run())
    assert after.extra["prefill_forwards"] - before.extra["prefill_forwards"] == 1
    assert near_turn.cached_tokens == len(first_prompt)
    assert_logprobs_match(near_turn.logprobs, reference_logprobs(model, near, near_turn.token_ids))
    assert_logprobs_match(short_turn.logprobs, reference_logprobs(model, short, short_turn.token_ids))


def test_seeded_sampling_is_reproducible_and_stops_on_stop_ids(tiny):
    model, _ = tiny

    async def run():
        engine = engine_for(model)
        try:
            first = await engine.generate("x", [5, 6, 7], SamplingParams(max_new_tokens=16, seed=5))
            again = await engine.generate("y", [5, 6, 7], SamplingParams(max_new_tokens=16, seed=5))
            other = await engine.generate("z", [5, 6, 7], SamplingParams(max_new_tokens=16, seed=6))
            stop_id = first.token_ids[3]
            stopped = await engine.generate(
                "w", [5, 6, 7], SamplingParams(max_new_tokens=16, seed=5, stop_ids=(stop_id,))
            )
            # its last allowed token: a stop, as vLLM (its check_stop tests stop tokens before
            # the budget), so the gateway does not call the action truncated
            at_budget = await engine.generate(
                "v",
                [5, 6, 7],
                SamplingParams(max_new_tokens=len(stopped.token_ids), seed=5, stop_ids=(stop_id,)),
            )
            return first, again, other, stopped, at_budget, stop_id
        finally:
            await engine.close()

    first, again, other, stopped, at_budget, stop_id = asyncio.run(run())
    assert first.token_ids == again.token_ids and first.logprobs == again.logprobs
    assert other.token_ids != first.token_ids
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_id
    cut = first.token_ids.index(stop_id) + 1
    assert stopped.token_ids == first.token_ids[:cut]
    assert at_budget.token_ids == stopped.token_ids and at_budget.finish_reason == "stop"


def test_weight_update_mid_generation_tags_tokens_with_the_version_that_produced_them(
    tiny, other_model, weights
):
    model, _ = tiny
    new_path = weights.load(1)
    prompt = [2, 40, 41, 42]
    params = SamplingParams(max_new_tokens=20, seed=9)
    blocked = threading.Event()
    box = {}

    def hold_after_five_tokens(stats):
        if stats.decode_tokens == 5 and not blocked.is_set():
            blocked.set()
            engine = box["engine"]
            wait_for(lambda: engine.stats().extra["pending_updates"] == 1, "the weight update to be queued")

    async def run():
        engine = engine_for(model, on_step=hold_after_five_tokens)
        box["engine"] = engine
        try:
            long_run = asyncio.create_task(engine.generate("long", prompt, params))
            await asyncio.to_thread(blocked.wait, 60)
            await engine.load_version(1, new_path)
            later = await engine.generate("later", prompt, SamplingParams(max_new_tokens=5, seed=1))
            return await long_run, later, engine.version, engine.stats()
        finally:
            await engine.close()

    generation, later, version, stats = asyncio.run(run())
    assert version == 1 and stats.extra["weight_updates"] == 1
    assert generation.versions == [0] * 5 + [1] * 15
    assert later.versions == [1] * 5
    tokens = generation.token_ids
    assert_logprobs_match(generation.logprobs[:5], reference_logprobs(model, prompt, tokens[:5]))
    assert_logprobs_match(
        generation.logprobs[5:], reference_logprobs(other_model, prompt + tokens[:5], tokens[5:])
    )
    assert_logprobs_match(later.logprobs, reference_logprobs(other_model, prompt, later.token_ids))


def test_weight_update_mid_decode_of_a_padded_batch_tags_each_token_with_the_weights_that_sampled_it(
    tiny, other_model, weights
):
    """Three requests of different lengths, one a next turn on its session's cache, decode
    together when a version loads: each is re-prefilled beside the others (padded) under the
    new weights, and every token's log-prob is that of the version it is tagged with, over
    its whole context (the trainer's importance ratio divides by it)."""
    model, _ = tiny
    first_prompt = [2, 40, 41, 42]
    box: dict = {"phase": None}
    blocked = threading.Event()

    def hold(stats):
        engine = box["engine"]
        if box["phase"] == "arrive":  # the first step after the three were sent
            box["phase"] = "decode"
            wait_for(
                lambda: engine.stats().queue_depth + engine.stats().extra["active"] == 3,
                "all three requests to arrive",
            )
        elif box["phase"] == "decode" and stats.decode_tokens >= box["reload_at"]:
            box["phase"] = None
            blocked.set()
            wait_for(lambda: engine.stats().extra["pending_updates"] == 1, "the weight update to be queued")

    async def run():
        engine = engine_for(model, on_step=hold)
        box["engine"] = engine
        try:
            first = await engine.generate("a", first_prompt, SamplingParams(max_new_tokens=4, seed=1))
            prompts = [first_prompt + first.token_ids + [50, 51], list(range(60, 71)), [7]]
            params = [
                SamplingParams(max_new_tokens=14, seed=2),
                SamplingParams(max_new_tokens=12, temperature=0.7, seed=3),
                SamplingParams(max_new_tokens=16, temperature=1.3, top_p=0.8, seed=4),
            ]
            box["reload_at"] = engine.stats().decode_tokens + 15  # five tokens each
            box["phase"] = "arrive"
            running = [
                asyncio.create_task(engine.generate(session, prompt, sampling))
                for session, prompt, sampling in zip("abc", prompts, params, strict=True)
            ]
            await asyncio.to_thread(blocked.wait, DEADLINE_S)
            await engine.load_version(1, weights.load(1))
            return prompts, params, await asyncio.wait_for(asyncio.gather(*running), DEADLINE_S)
        finally:
            await engine.close()

    prompts, params, generations = asyncio.run(run())
    assert generations[0].cached_tokens == len(prompts[0]) - 3  # all but the observation and its last token
    for prompt, sampling, generation in zip(prompts, params, generations, strict=True):
        switch = generation.versions.index(1)
        assert generation.versions == [0] * switch + [1] * (sampling.max_new_tokens - switch)
        assert switch >= 5
        tokens = generation.token_ids
        t, p = sampling.temperature, sampling.top_p
        expected = reference_logprobs(model, prompt, tokens[:switch], t, p) + reference_logprobs(
            other_model, prompt + tokens[:switch], tokens[switch:], t, p
        )
        assert_logprobs_match(generation.logprobs, expected)


def test_a_weight_update_its_caller_stopped_waiting_for_is_not_applied(tiny, weights):
    """A worker gives up on a load after ``load_timeout_s`` (cancelling ``load_version``) and
    counts the replica as still on its old version; the queued update was applied anyway at
    the next step, moving the replica to a version behind the worker's back."""
    model, _ = tiny
    blocked = threading.Event()
    release = threading.Event()

    hold_after_two_tokens = held_step(blocked, release, "the weight update to be given up", after_tokens=2)

    async def run():
        engine = engine_for(model, on_step=hold_after_two_tokens)
        try:
            running = asyncio.create_task(engine.generate("a", [5, 6, 7], SamplingParams(max_new_tokens=8)))
            await asyncio.to_thread(blocked.wait, DEADLINE_S)
            loading = asyncio.create_task(engine.load_version(1, weights.load(1)))
            await asyncio.to_thread(
                wait_for,
                lambda: engine.stats().extra["pending_updates"] == 1,
                "the update to queue",
                DEADLINE_S,
            )
            loading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await loading
            release.set()
            generation = await asyncio.wait_for(running, DEADLINE_S)
            return generation, engine.version, engine.stats()
        finally:
            release.set()
            await engine.close()

    generation, version, stats = asyncio.run(run())
    assert version == 0 and stats.extra["weight_updates"] == 0 and stats.extra["pending_updates"] == 0
    assert generation.versions == [0] * 8
    assert_logprobs_match(generation.logprobs, reference_logprobs(model, [5, 6, 7], generation.token_ids))


def test_weight_update_drops_session_caches_of_the_old_weights(tiny, other_model, weights):
    model, _ = tiny
    prompt = [2, 40, 41, 42, 43]
    params = SamplingParams(max_new_tokens=6, seed=2)

    async def run():
        engine = TorchEngine(weights.load(0), name="from-dir")
        assert engine.tokenizer is not None
        try:
            first = await engine.generate("s", prompt, params)
            await engine.load_version(1, weights.load(1))
            loaded = engine.stats()
            second_prompt = prompt + first.token_ids + [50, 51]
            second = await engine.generate("s", second_prompt, params)
            return first, second, second_prompt, loaded
        finally:
            await engine.close()

    first, second, second_prompt, loaded = asyncio.run(run())
    assert loaded.extra["cache_sessions"] == 0 and loaded.extra["cache_bytes"] == 0
    assert_logprobs_match(first.logprobs, reference_logprobs(model, prompt, first.token_ids))
    assert second.cached_tokens == 0 and second.versions == [1] * 6
    assert_logprobs_match(second.logprobs, reference_logprobs(other_model, second_prompt, second.token_ids))


def test_session_cache_is_a_memory_bounded_lru(tiny):
    model, _ = tiny
    bytes_per_token = kv_bytes_per_token(model)
    prompts = {name: [2, 40 + i, 41, 42, 43, 44, 45, 46, 47, 48] for i, name in enumerate("abc")}
    params = SamplingParams(max_new_tokens=6, seed=0)
    per_session = (10 + 6 - 1) * bytes_per_token
    budget = 2 * per_session + per_session // 2

    async def run():
        engine = engine_for(model, kv_cache_bytes=budget)
        try:
            outputs = {name: await engine.generate(name, prompt, params) for name, prompt in prompts.items()}
            after = engine.stats()
            again_a = await engine.generate("a", prompts["a"] + outputs["a"].token_ids, params)
            again_c = await engine.generate("c", prompts["c"] + outputs["c"].token_ids, params)
            return outputs, after, again_a, again_c
        finally:
            await engine.close()

    outputs, after, again_a, again_c = asyncio.run(run())
    assert after.extra["evictions"] == 1 and after.extra["cache_sessions"] == 2
    assert after.extra["cache_bytes"] == 2 * per_session <= budget
    assert again_a.cached_tokens == 0  # the least recently used session was evicted
    assert again_c.cached_tokens == 15
    for name, again in (("a", again_a), ("c", again_c)):  # re-prefilled or cached, the same log-probs
        prompt = prompts[name] + outputs[name].token_ids
        assert_logprobs_match(again.logprobs, reference_logprobs(model, prompt, again.token_ids))


def test_a_session_too_large_for_the_cache_is_not_kept_and_pushes_no_other_out(tiny):
    model, _ = tiny
    params = SamplingParams(max_new_tokens=2, seed=0)
    budget = 10 * kv_bytes_per_token(model)

    async def run():
        engine = engine_for(model, kv_cache_bytes=budget)
        try:
            await engine.generate("small", [5, 6, 7], params)
            await engine.generate("large", list(range(5, 45)), params)
            return engine.stats()
        finally:
            await engine.close()

    stats = asyncio.run(run())
    assert stats.extra["cache_sessions"] == 1 and stats.extra["evictions"] == 0
    assert stats.extra["cache_bytes"] == 4 * kv_bytes_per_token(model)


def test_two_live_turns_of_one_session_leave_one_cache_counted_once(tiny):
    """The turn that finishes last replaces the other's cache: the byte count must drop the
    replaced one, or the LRU believes itself fuller than it is and evicts live sessions."""
    model, _ = tiny
    box: dict = {}
    lengths = (4, 9)

    async def run():
        engine = box["engine"] = engine_for(model, on_step=held_until_arrived(box, 2))
        try:
            await asyncio.gather(
                *[engine.generate("s", [5, 6, 7], SamplingParams(max_new_tokens=n, seed=n)) for n in lengths]
            )
            return engine.stats()
        finally:
            await engine.close()

    stats = asyncio.run(run())
    assert stats.extra["max_batch_seen"] == 2 and stats.extra["cache_sessions"] == 1
    kept_tokens = 3 + max(lengths) - 1  # the longer turn finishes last
    assert stats.extra["cache_bytes"] == kept_tokens * kv_bytes_per_token(model)


def test_the_decode_batch_holds_at_most_max_batch_requests(tiny):
    model, _ = tiny
    prompts = [[5, 6, 7], [8, 9], [20, 21, 22, 23]]
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=4)
    box: dict = {}

    async def run():
        engine = box["engine"] = engine_for(model, max_batch=2, on_step=held_until_arrived(box, len(prompts)))
        try:
            generations = await asyncio.gather(
                *[engine.generate(f"s{i}", prompt, params) for i, prompt in enumerate(prompts)]
            )
            return generations, engine.stats()
        finally:
            await engine.close()

    generations, stats = asyncio.run(run())
    assert stats.extra["max_batch_seen"] == 2
    for prompt, generation in zip(prompts, generations, strict=True):
        assert len(generation.token_ids) == 6
        assert_logprobs_match(
            generation.logprobs, reference_logprobs(model, prompt, generation.token_ids, temperature=0.8)
        )


def test_bad_requests_fail_clearly_while_the_engine_keeps_serving(tiny, tmp_path):
    model, _ = tiny
    vocab = model.config.vocab_size
    blocked = threading.Event()
    release = threading.Event()

    hold_first_step = held_step(blocked, release, "the bad requests to be sent")

    async def run():
        engine = engine_for(model, on_step=hold_first_step)
        try:
            long_run = asyncio.create_task(
                engine.generate("good", [5, 6, 7], SamplingParams(max_new_tokens=30, seed=1))
            )
            await asyncio.to_thread(blocked.wait, 60)
            params = SamplingParams(max_new_tokens=4)
            cases = [
                ([], "prompt_ids is empty"),
                ([5, vocab], rf"prompt_ids\[1\] = {vocab} is not a token id in \[0, {vocab}\)"),
                ([-1], r"prompt_ids\[0\] = -1 is not a token id"),
                ([5, True], r"prompt_ids\[1\] = True is a bool, not a token id \(an integer in \[0, "),
                ([5] * 97, "prompt has 97 tokens, leaving no room to generate in the model's 96 positions"),
                ([5] * 96, "prompt has 96 tokens, leaving no room to generate in the model's 96 positions"),
            ]
            for prompt, message in cases:
                with pytest.raises(InvalidRequest, match=message):
                    await engine.generate("bad", prompt, params)
            with pytest.raises(InvalidRequest, match="session_id must be a non-empty string"):
                await engine.generate("", [5], params)
            with pytest.raises(EngineError, match="no \\*.safetensors files"):
                await engine.load_version(3, str(tmp_path))
            release.set()
            good = await long_run
            edge = await engine.generate("edge", [0] + [5] * 93, SamplingParams(max_new_tokens=10, seed=0))
            return good, edge, engine.version, await engine.health()
        finally:
            release.set()
            await engine.close()

    good, edge, version, healthy = asyncio.run(run())
    assert len(good.token_ids) == 30 and good.finish_reason == "length" and version == 0 and healthy
    assert len(edge.token_ids) == 2 and edge.finish_reason == "length"  # stopped at the position limit
    with pytest.raises(InvalidRequest, match="temperature must be a finite number >= 1e-05"):
        SamplingParams(temperature=0)


@pytest.mark.parametrize("temperature", [-1.0, math.nan, math.inf, 1e-40, 5e-6])
def test_temperatures_that_cannot_be_sampled_are_invalid_requests(temperature):
    """vLLM samples below 1e-5 greedily and reports temperature 1's log-probs for it."""
    with pytest.raises(
        InvalidRequest, match=f"temperature must be a finite number >= 1e-05, got {temperature}"
    ):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seeds_outside_64_bits_are_invalid_requests(seed):
    with pytest.raises(InvalidRequest, match=r"seed must be a 64-bit integer in \[-2\*\*63, 2\*\*64\)"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stop_ids": None}, "stop_ids must be a tuple of token ids, got NoneType"),
        ({"stop_ids": 3}, "stop_ids must be a tuple of token ids, got int"),
        ({"stop_ids": (3, "4")}, "stop_ids must be token ids, got '4'"),
        ({"seed": 1.5}, r"seed must be a 64-bit integer in \[-2\*\*63, 2\*\*64\), got 1.5"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer, got 2.5"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer, got True"),
        ({"temperature": "0.7"}, "temperature must be a finite number >= 1e-05, got '0.7'"),
        ({"top_p": None}, r"top_p must be in \(0, 1\], got None"),
    ],
)
def test_malformed_stop_ids_and_seeds_are_invalid_requests(kwargs, message):
    """A stop_ids the engine cannot look a token up in failed on the engine thread, stopping
    the engine for every request; a float seed failed inside torch with a RuntimeError; a
    float token budget (2.5) generated 3 tokens, a string temperature was a TypeError."""
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)


def test_numpy_numbers_are_sampling_params_of_their_python_values():
    """A seed drawn with numpy (np.int64) was refused as "seed must be a 64-bit integer …,
    got 3", a np.float32 temperature as not a finite number: exact numbers of another type
    now stand for their Python values, which a vLLM request can put in its JSON."""
    params = SamplingParams(
        max_new_tokens=np.int64(3),
        temperature=np.float32(0.5),
        top_p=np.float64(0.9),
        stop_ids=[np.int32(4), 5],
        seed=np.uint64(2**64 - 1),
    )
    assert params == SamplingParams(
        max_new_tokens=3, temperature=0.5, top_p=0.9, stop_ids=(4, 5), seed=2**64 - 1
    )
    fields = (params.max_new_tokens, params.temperature, params.top_p, *params.stop_ids, params.seed)
    assert [type(value) for value in fields] == [int, float, float, int, int, int]
    with pytest.raises(InvalidRequest, match=r"seed must be a 64-bit integer .*, got np.float64\(3.0\)"):
        SamplingParams(seed=np.float64(3))
    with pytest.raises(InvalidRequest, match="max_new_tokens must be an integer, got np.True_"):
        SamplingParams(max_new_tokens=np.bool_(True))


def test_a_prompt_of_numpy_token_ids_samples_what_its_list_does_and_a_tensor_is_refused_clearly(tiny):
    """A prompt of numpy ids (``np.array``) was refused as "prompt_ids[0] = np.int64(5) is
    not a token id in [0, V)", although 5 is; a tensor's elements are refused as tensors."""
    model, _ = tiny
    params = SamplingParams(max_new_tokens=4, seed=5)

    async def run():
        engine = engine_for(model)
        try:
            from_numpy = await engine.generate("numpy", np.array([5, 6, 7]), params)
            from_list = await engine.generate("list", [5, 6, 7], params)
            with pytest.raises(
                InvalidRequest, match=r"prompt_ids\[0\] = tensor\(5\) is a Tensor, not a token id"
            ):
                await engine.generate("tensor", torch.tensor([5, 6, 7]), params)
            return from_numpy, from_list
        finally:
            await engine.close()

    from_numpy, from_list = asyncio.run(run())
    assert from_numpy.token_ids == from_list.token_ids and from_numpy.logprobs == from_list.logprobs


def test_a_request_whose_distribution_cannot_be_sampled_fails_alone():
    """A NaN in one token's input embedding gives NaN logits to a request whose prompt holds
    that token: that request fails; the request decoding beside it and the engine go on."""
    model, _ = build_tiny_model(SMALL.model_copy(update={"tie_word_embeddings": False}))
    poisoned = 9
    with torch.no_grad():
        model.get_input_embeddings().weight[poisoned] = math.nan
    blocked = threading.Event()
    release = threading.Event()

    hold_first_step = held_step(blocked, release, "the unsamplable request to be queued")

    async def run():
        engine = engine_for(model, on_step=hold_first_step)
        try:
            victim = asyncio.create_task(
                engine.generate("victim", [5, 6, 7], SamplingParams(max_new_tokens=20, seed=1))
            )
            await asyncio.to_thread(blocked.wait, DEADLINE_S)
            bad = asyncio.create_task(
                engine.generate("bad", [5, poisoned, 7], SamplingParams(max_new_tokens=20))
            )
            await asyncio.sleep(0)  # queued while the victim is mid-generation
            release.set()
            with pytest.raises(EngineError, match="non-finite next-token distribution for session 'bad'"):
                await asyncio.wait_for(bad, DEADLINE_S)
            good = await asyncio.wait_for(victim, DEADLINE_S)
            after = await asyncio.wait_for(
                engine.generate("after", [5, 6], SamplingParams(max_new_tokens=3, seed=0)), DEADLINE_S
            )
            return good, after, await engine.health(), engine.stats()
        finally:
            release.set()
            await engine.close()

    good, after, healthy, stats = asyncio.run(run())
    assert poisoned not in good.token_ids, "precondition: the victim never feeds the poisoned token"
    assert len(good.token_ids) == 20 and len(after.token_ids) == 3 and healthy
    assert stats.requests == 2 and stats.extra["cache_sessions"] == 2, "the failed request kept no cache"


def test_close_fails_waiting_requests_and_refuses_new_ones(tiny):
    model, _ = tiny
    blocked = threading.Event()
    release = threading.Event()

    hold = held_step(blocked, release, "close to be requested")

    async def run():
        engine = engine_for(model, on_step=hold, max_batch=1)
        running = asyncio.create_task(engine.generate("a", [5, 6], SamplingParams(max_new_tokens=50)))
        await asyncio.to_thread(blocked.wait, 60)
        queued = asyncio.create_task(engine.generate("b", [5, 6], SamplingParams(max_new_tokens=5)))
        await asyncio.sleep(0)
        closing = asyncio.create_task(engine.close())
        await asyncio.sleep(0)
        release.set()
        await closing
        for task in (running, queued):
            with pytest.raises(EngineError, match="engine closed"):
                await task
        assert not await engine.health()
        with pytest.raises(EngineError, match="not serving"):
            await engine.generate("c", [5], SamplingParams())
        with pytest.raises(EngineError, match="not serving"):  # refused before reading any weights
            await engine.load_version(1, "/no/such/version")

    asyncio.run(run())


def test_a_crash_in_prefill_fails_the_request_so_the_router_fails_over(tiny, weights):
    model, _ = tiny
    params = SamplingParams(max_new_tokens=4, seed=0)

    async def run():
        dying = TorchEngine(copy.deepcopy(model), name="dying")
        spare = TorchEngine(copy.deepcopy(model), name="spare")
        dying.model.forward = crash  # fails the prefill of a request the engine thread admitted
        router = Router([dying, spare], RouterConfig(policy="round_robin", failover=True))
        try:
            generation = await asyncio.wait_for(router.generate("s", [5, 6, 7], params), DEADLINE_S)
            with pytest.raises(EngineError, match="not serving: CUDA error"):
                await asyncio.wait_for(dying.generate("t", [5], params), DEADLINE_S)
            with pytest.raises(EngineError, match="not serving: CUDA error"):
                await asyncio.wait_for(dying.load_version(1, weights.load(1)), DEADLINE_S)
            return generation, router.replicas, await dying.health()
        finally:
            await asyncio.gather(dying.close(), spare.close())

    generation, replicas, healthy = asyncio.run(run())
    assert generation.engine == "spare" and len(generation.token_ids) == 4
    assert replicas == ["spare"] and not healthy


def test_a_crash_in_the_re_prefill_after_a_weight_update_fails_the_request(tiny, weights):
    model, _ = tiny
    blocked = threading.Event()
    box = {}

    def crash_after_three_tokens(stats):
        if stats.decode_tokens == 3 and not blocked.is_set():
            blocked.set()
            engine = box["engine"]
            wait_for(lambda: engine.stats().extra["pending_updates"] == 1, "the weight update to be queued")
            engine.model.forward = crash  # the update re-prefills the request: that forward fails

    async def run():
        engine = box["engine"] = engine_for(model, on_step=crash_after_three_tokens)
        try:
            running = asyncio.create_task(engine.generate("a", [5, 6, 7], SamplingParams(max_new_tokens=20)))
            await asyncio.to_thread(blocked.wait, DEADLINE_S)
            await asyncio.wait_for(engine.load_version(1, weights.load(1)), DEADLINE_S)
            with pytest.raises(EngineError, match="stopped: RuntimeError\\('CUDA error"):
                await asyncio.wait_for(running, DEADLINE_S)
        finally:
            await engine.close()

    asyncio.run(run())


def test_a_crash_while_applying_a_weight_update_fails_the_update(tiny, weights):
    model, _ = tiny

    async def run():
        engine = engine_for(model)
        engine.model.load_state_dict = crash
        try:
            with pytest.raises(EngineError, match="stopped: RuntimeError\\('CUDA error"):
                await asyncio.wait_for(engine.load_version(1, weights.load(1)), DEADLINE_S)
        finally:
            await engine.close()

    asyncio.run(run())


def test_a_cancelled_generation_leaves_no_session_cache(tiny):
    model, _ = tiny
    blocked = threading.Event()
    release = threading.Event()

    hold_after_three_tokens = held_step(blocked, release, "the generation to be cancelled", after_tokens=3)

    async def run():
        engine = engine_for(model, on_step=hold_after_three_tokens)
        try:
            running = asyncio.create_task(
                engine.generate("gone", [5, 6, 7], SamplingParams(max_new_tokens=50))
            )
            await asyncio.to_thread(blocked.wait, DEADLINE_S)
            running.cancel()  # the rollout timed out ...
            with pytest.raises(asyncio.CancelledError):
                await running
            engine.end_session("gone")  # ... and the gateway ended its session
            release.set()
            await asyncio.to_thread(
                wait_for,
                lambda: engine.stats().extra["active"] == 0,
                "the cancelled row to leave",
                DEADLINE_S,
            )
            return engine.stats()
        finally:
            release.set()
            await engine.close()

    stats = asyncio.run(run())
    assert stats.extra["cache_sessions"] == 0 and stats.extra["cache_bytes"] == 0
    assert stats.decode_tokens <= 4, "the cancelled row decoded past the step in flight when it was cancelled"


def test_a_cancelled_next_turn_leaves_its_session_no_cache(tiny):
    """The next turn takes its session's cache; cancelled, it gives none back: the cache of the
    turn before would only push live sessions out of the LRU."""
    model, _ = tiny
    blocked = threading.Event()
    release = threading.Event()
    hold = held_step(blocked, release, "the next turn to be cancelled", after_tokens=7)

    async def run():
        engine = engine_for(model, on_step=hold)
        try:
            first = await engine.generate("s", [5, 6, 7], SamplingParams(max_new_tokens=4, seed=0))
            after_first = engine.stats()
            running = asyncio.create_task(
                engine.generate("s", [5, 6, 7, *first.token_ids, 8], SamplingParams(max_new_tokens=50))
            )
            await asyncio.to_thread(blocked.wait, DEADLINE_S)
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            release.set()
            await asyncio.to_thread(
                wait_for,
                lambda: engine.stats().extra["active"] == 0,
                "the cancelled row to leave",
                DEADLINE_S,
            )
            return after_first, engine.stats()
        finally:
            release.set()
            await engine.close()

    after_first, stats = asyncio.run(run())
    assert after_first.extra["cache_sessions"] == 1
    assert (
        stats.prefill_reused == 6 and stats.extra["cache_sessions"] == 0 and stats.extra["cache_bytes"] == 0
    )


def test_a_request_cancelled_while_queued_is_never_prefilled(tiny):
    model, _ = tiny
    blocked = threading.Event()
    release = threading.Event()
    hold_first_step = held_step(blocked, release, "the queued request to be cancelled")

    async def run():
        engine = engine_for(model, on_step=hold_first_step)
        try:
            running = asyncio.create_task(engine.generate("a", [5, 6, 7], SamplingParams(max_new_tokens=5)))
            await asyncio.to_thread(blocked.wait, DEADLINE_S)
            queued = asyncio.create_task(engine.generate("b", list(range(10, 30)), SamplingParams()))
            await asyncio.sleep(0)
            assert engine.stats().queue_depth == 1
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            release.set()
            await asyncio.wait_for(running, DEADLINE_S)
            return engine.stats()
        finally:
            release.set()
            await engine.close()

    stats = asyncio.run(run())
    assert stats.prefill_computed == 3 and stats.decode_tokens == 5 and stats.queue_depth == 0


def test_a_request_cancelled_mid_decode_leaves_the_batch_and_the_others_go_on_unchanged(tiny):
    """The middle row of a batch of three is cancelled after a few decode steps: it keeps no
    cache, and the rows beside it sample what they would alone, with exact log-probs."""
    model, _ = tiny
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20, 21]]
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=i) for i in range(3)]
    blocked = threading.Event()
    release = threading.Event()
    box = {}

    def hold(stats):
        if stats.extra["decode_steps"] == 1:  # every request in the batch before the second step
            engine = box["engine"]
            wait_for(
                lambda: engine.stats().queue_depth + engine.stats().extra["active"] == len(prompts),
                "all requests to arrive",
            )
        elif stats.extra["decode_steps"] == 4 and not blocked.is_set():
            blocked.set()
            wait_for(release.is_set, "the middle request to be cancelled")

    async def run():
        engine = box["engine"] = engine_for(model, on_step=hold)
        alone_engine = engine_for(model)
        try:
            tasks = [
                asyncio.create_task(engine.generate(f"s{i}", p, sp))
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            await asyncio.to_thread(blocked.wait, DEADLINE_S)
            tasks[1].cancel()
            with pytest.raises(asyncio.CancelledError):
                await tasks[1]
            release.set()
            kept = await asyncio.wait_for(asyncio.gather(tasks[0], tasks[2]), DEADLINE_S)
            alone = [await alone_engine.generate(f"a{i}", prompts[i], params[i]) for i in (0, 2)]
            return kept, alone, engine.stats()
        finally:
            release.set()
            await asyncio.gather(engine.close(), alone_engine.close())

    kept, alone, stats = asyncio.run(run())
    assert stats.extra["max_batch_seen"] == 3 and stats.extra["active"] == 0
    assert stats.requests == 2 and stats.extra["cache_sessions"] == 2, "the cancelled request kept no cache"
    for index, together, single in zip((0, 2), kept, alone, strict=True):
        assert together.token_ids == single.token_ids and len(together.token_ids) == 12
        assert_logprobs_match(
            together.logprobs, reference_logprobs(model, prompts[index], together.token_ids, 0.8, 0.9)
        )


def test_a_session_ended_while_its_last_turn_finishes_keeps_no_cache(tiny):
    """The gateway closes a session by cancelling its turn and ending the session at once;
    the engine may finish the turn before the cancellation reaches ``generate``. The cache
    of that turn was then kept for a session that had ended, taking LRU room from live ones."""
    model, _ = tiny
    blocked = threading.Event()
    release = threading.Event()

    hold_after_three_tokens = held_step(blocked, release, "the session to be ended", after_tokens=3)

    async def run():
        engine = engine_for(model, on_step=hold_after_three_tokens)
        try:
            running = asyncio.create_task(
                engine.generate("gone", [5, 6, 7], SamplingParams(max_new_tokens=4))
            )
            await asyncio.to_thread(blocked.wait, DEADLINE_S)
            running.cancel()
            engine.end_session("gone")
            release.set()
            # the event loop is busy: the engine finishes the turn before the task sees its cancellation
            wait_for(lambda: engine.stats().extra["active"] == 0, "the turn to finish", DEADLINE_S)
            with pytest.raises(asyncio.CancelledError):
                await running
            return engine.stats()
        finally:
            release.set()
            await engine.close()

    stats = asyncio.run(run())
    assert stats.extra["cache_sessions"] == 0 and stats.extra["cache_bytes"] == 0


def test_a_bfloat16_engine_keeps_the_rope_frequencies_of_its_checkpoint(tiny, weights):
    """Built from a float32 model in memory or from the version's folder, a bfloat16 engine
    computes what the checkpoint loaded in bfloat16 does: its RoPE frequencies stay float32."""
    checkpoint, _ = load_policy(weights.load(0), dtype=torch.bfloat16)
    from_memory = engine_for(tiny[0], dtype="bfloat16")
    from_folder = TorchEngine(weights.load(0), name="from-folder", dtype=torch.bfloat16)
    try:
        ids = torch.tensor([list(range(5, 85))])
        with torch.no_grad():
            expected = checkpoint(ids).logits
            for engine in (from_memory, from_folder):
                torch.testing.assert_close(engine.model(ids).logits, expected, rtol=0, atol=0)
    finally:
        for engine in (from_memory, from_folder):
            asyncio.run(engine.close())


def test_engine_devices_and_dtypes_are_checked_at_load():
    for bad in ({"dtype": "bf16"}, {"device": "gpu"}, {"device": "cuda:x"}):
        with pytest.raises(ValueError, match="dtype|not a torch device"):
            EngineConfig.model_validate({"torch": bad})
    assert TorchEngineConfig(device="cuda:1", dtype="bfloat16").device == "cuda:1"


def test_plain_cuda_spreads_replicas_over_the_visible_gpus():
    assert [replica_device("cuda", i, gpus=4) for i in range(6)] == [
        "cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"
    ]  # fmt: skip
    assert [replica_device("cuda:2", i, gpus=4) for i in range(2)] == ["cuda:2", "cuda:2"]
    assert replica_device("cuda", 3, gpus=1) == "cuda"
    assert replica_device("cpu", 3, gpus=4) == "cpu"


def test_an_engine_actor_uses_the_gpu_ray_gave_it_whatever_index_was_configured():
    assert [actor_device(d) for d in ("cuda:3", "cuda", "cpu")] == ["cuda", "cuda", "cpu"]


def edited_version(source: str, folder, edit) -> str:
    """A copy of the version folder ``source`` whose policy tensors ``edit`` changed in place."""
    shutil.copytree(source, folder)
    tensors = load_file(folder / MODEL_FILE)
    edit(tensors)
    save_file(tensors, folder / MODEL_FILE)
    return str(folder)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"max_batch": 0}, "max_batch must be >= 1, got 0"),
        ({"kv_cache_bytes": -1}, "kv_cache_bytes must be >= 0, got -1"),
        ({"max_prefill_tokens": 0}, "max_prefill_tokens must be >= 1, got 0"),
    ],
)
def test_engine_settings_out_of_range_are_refused(tiny, setting, message):
    with pytest.raises(ValueError, match=message):
        engine_for(tiny[0], **setting)


def test_a_version_whose_tensors_do_not_fit_is_refused_and_the_engine_keeps_its_own(
    tiny, other_model, weights, tmp_path
):
    """A missing, an unexpected or a wrongly shaped tensor fails the load with a clear error
    before it reaches the engine thread (where ``load_state_dict`` would stop the engine);
    a trainer's value model saved beside the policy is not read as part of it."""
    model, _ = tiny
    source = weights.load(1)

    def missing(tensors):
        del tensors["model.layers.0.mlp.up_proj.weight"]

    def unexpected(tensors):
        tensors["model.layers.0.extra.weight"] = torch.zeros(3)

    def misshapen(tensors):
        tensors["model.norm.weight"] = torch.ones(31)

    cases = [
        (missing, r"missing \['model.layers.0.mlp.up_proj.weight'\], unexpected \[\]"),
        (unexpected, r"missing \[\], unexpected \['model.layers.0.extra.weight'\]"),
        (misshapen, r"model.norm.weight has shape \(31,\), the model expects \(32,\)"),
    ]
    with_value_model = tmp_path / "with-value-model"
    shutil.copytree(source, with_value_model)
    save_file({"score.weight": torch.zeros(1, 32)}, with_value_model / "value_model.safetensors")
    prompt = [2, 40, 41, 42]
    params = SamplingParams(max_new_tokens=4, seed=0)

    async def run():
        engine = engine_for(model)
        try:
            for edit, message in cases:
                path = edited_version(source, tmp_path / edit.__name__, edit)
                with pytest.raises(EngineError, match=message):
                    await engine.load_version(2, path)
            kept = engine.version, await engine.health()
            await engine.load_version(1, str(with_value_model))
            return kept, engine.version, await engine.generate("s", prompt, params)
        finally:
            await engine.close()

    kept, version, generation = asyncio.run(run())
    assert kept == (0, True) and version == 1 and generation.versions == [1] * 4
    assert_logprobs_match(generation.logprobs, reference_logprobs(other_model, prompt, generation.token_ids))


def test_mixture_of_experts_engine_loads_versions_in_their_checkpoint_layout(tiny, tmp_path):
    _, tokenizer = tiny
    first, second = (tiny_mixture_of_experts(len(tokenizer), seed) for seed in (0, 1))
    store = WeightStore(RunStore(StorageConfig(root=str(tmp_path / "runs")), "run"))
    publish_policy(store, first, tokenizer)
    publish_policy(store, second, tokenizer, parent=0, step=1)
    broken = edited_version(
        store.load(1),
        tmp_path / "broken",
        lambda tensors: tensors.pop("model.layers.0.mlp.experts.2.up_proj.weight"),
    )
    prompt = [2, 40, 41, 42, 43]
    params = SamplingParams(max_new_tokens=6, seed=3)

    async def run():
        engine = TorchEngine(store.load(0), name="moe")
        try:
            with pytest.raises(EngineError, match="do not load"):
                await engine.load_version(2, broken)
            before = await engine.generate("a", prompt, params)
            await engine.load_version(1, store.load(1))
            after = await engine.generate("b", prompt, params)
            return before, after, engine.version
        finally:
            await engine.close()

    before, after, version = asyncio.run(run())
    assert version == 1 and before.versions == [0] * 6 and after.versions == [1] * 6
    assert_logprobs_match(before.logprobs, reference_logprobs(first, prompt, before.token_ids))
    assert_logprobs_match(after.logprobs, reference_logprobs(second, prompt, after.token_ids))


def test_a_version_that_holds_the_models_tied_tensors_apart_is_refused(tiny, tmp_path):
    """The tiny model ties its output head to its input embedding (one tensor). A version
    holding the two apart (an untied checkpoint) loaded without a word: both names wrote
    into the one tensor, the later winning, so the engine served the checkpoint's head as
    its input embedding: a model no trainer has, whose log-probs match nobody's."""
    model, _ = tiny
    assert model.config.tie_word_embeddings, "precondition: the engine's model is tied"
    embedding = "model.embed_tokens.weight"
    untied = tmp_path / "untied"
    untied.mkdir()
    tensors = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    tensors["lm_head.weight"] = tensors[embedding] + 1
    save_file(tensors, untied / MODEL_FILE)
    same = tmp_path / "same"
    same.mkdir()
    tensors["lm_head.weight"] = tensors[embedding].clone()
    save_file(tensors, same / MODEL_FILE)
    prompt = [2, 40, 41, 42]
    params = SamplingParams(max_new_tokens=4, seed=0)

    async def run():
        engine = engine_for(model)
        try:
            with pytest.raises(
                EngineError, match=rf"holds {embedding} and lm_head.weight apart, which the model ties"
            ):
                await engine.load_version(1, str(untied))
            kept = engine.version, await engine.generate("s", prompt, params)
            await engine.load_version(2, str(same))  # both names, equal: what the model ties
            return kept, engine.version
        finally:
            await engine.close()

    (version, generation), loaded = asyncio.run(run())
    assert version == 0 and loaded == 2
    assert_logprobs_match(generation.logprobs, reference_logprobs(model, prompt, generation.token_ids))


def test_replicas_built_before_one_that_fails_to_load_are_stopped(weights, monkeypatch):
    """Local replicas load one after another; when one fails (out of GPU memory) the caller
    gets the error and never the replicas built before it, which went on running on their
    threads, holding their GPUs for the process's life (a retried start ran out of memory)."""
    built: list[TorchEngine] = []
    load = TorchEngine.from_config

    def second_runs_out_of_memory(config, model, **kwargs):
        if built:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        built.append(load(config, model, **kwargs))
        return built[-1]

    monkeypatch.setattr(TorchEngine, "from_config", second_runs_out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        build_engines(EngineConfig(replicas=3), weights.load(0), 0)
    (first,) = built
    assert not asyncio.run(first.health())
    with pytest.raises(EngineError, match="is not serving: closed"):
        asyncio.run(first.generate("s", [5, 6], SamplingParams(max_new_tokens=1)))
