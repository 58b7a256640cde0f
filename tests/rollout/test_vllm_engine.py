"""VLLMEngine against the vLLM TEST STAND-IN (tests/rollout/vllm_standin.py), a real
uvicorn server on 127.0.0.1 backed by the real tiny model."""

from __future__ import annotations

import asyncio
import copy
import socket
import struct

import pytest
import torch
from safetensors.torch import save_file

from rl.models import TinyModelConfig, build_tiny_model
from rl.trainer import VALUE_MODEL_FILE
from rollout.engines.base import ContextLimit, EngineError, InvalidRequest, NotServing, SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.engines.vllm_engine import UNKNOWN_VERSION, VLLMEngine, VLLMEngineConfig
from rollout.router import Router, RouterConfig
from tests.rollout.vllm_standin import StandinServer

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=256
)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny_model(TINY)


def _fresh_model(tiny):
    return copy.deepcopy(tiny[0])


async def _refuses_until_reloaded(engine, weights) -> None:
    """An engine whose reload failed midway, or whose server restarted: version unknown,
    generation refused (``NotServing``) until version 1 loads from ``weights``, whose tokens it
    then tags."""
    assert engine.version == UNKNOWN_VERSION
    with pytest.raises(NotServing, match="unknown version"):
        await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=3, seed=1))
    await engine.load_version(1, str(weights))
    after = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=3, seed=1))
    assert after.versions == [1] * 3


def reference_logprobs(
    model, prompt: list[int], tokens: list[int], temperature: float, top_p: float
) -> list[float]:
    """Sampling log-probs of ``tokens`` from one full forward pass, nucleus by a plain loop."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    out = []
    for i, token in enumerate(tokens):
        probs = torch.softmax(logits[len(prompt) - 1 + i] / temperature, dim=-1).tolist()
        order = sorted(range(len(probs)), key=lambda j: -probs[j])
        kept, mass = [], 0.0
        for j in order:
            if mass >= top_p:
                break
            kept.append(j)
            mass += probs[j]
        assert token in kept, "a sampled token must lie in the nucleus"
        out.append(float(torch.tensor(probs[token] / sum(probs[j] for j in kept)).log()))
    return out


async def _with_server(model, body, max_num_seqs=None, **engine_kwargs):
    server = await StandinServer(model, max_model_len=128, max_num_seqs=max_num_seqs).start()
    engine = VLLMEngine(VLLMEngineConfig(base_url=server.url, **engine_kwargs), name="vllm-0")
    try:
        return await body(server, engine)
    finally:
        await engine.close()
        await server.stop()


PROMPT = [1, 2, 40, 41, 42, 3, 2, 50]


def test_generate_logprobs_match_a_forward_pass(tiny):
    model = _fresh_model(tiny)

    async def body(server, engine):
        assert await engine.health()
        params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=3)
        gen = await engine.generate("s1", PROMPT, params)
        assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) == 12
        assert gen.finish_reason == "length"
        assert gen.versions == [0] * 12 and gen.engine == "vllm-0" and gen.prompt_tokens == len(PROMPT)
        expected = reference_logprobs(model, PROMPT, gen.token_ids, 0.7, 0.9)
        assert max(abs(a - b) for a, b in zip(gen.logprobs, expected, strict=True)) < 1e-4
        again = await engine.generate("s1", PROMPT, params)
        assert again.token_ids == gen.token_ids, "same seed, same tokens"
        assert again.cached_tokens == len(PROMPT) - 1
        stats = await asyncio.to_thread(engine.stats)  # it asks the server, served by this loop
        assert stats.requests == 2 and stats.decode_tokens == 24
        assert stats.prefill_reused == len(PROMPT) - 1
        assert stats.prefill_computed == 2 * len(PROMPT) - (len(PROMPT) - 1)

    asyncio.run(_with_server(model, body))


def test_stop_token_is_kept_in_the_action(tiny):
    model = _fresh_model(tiny)

    async def body(server, engine):
        every_id = tuple(range(model.config.vocab_size))
        gen = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=8, stop_ids=every_id, seed=1))
        assert gen.finish_reason == "stop" and len(gen.token_ids) == 1
        assert gen.token_ids[0] in every_id and gen.logprobs[0] <= 0

    asyncio.run(_with_server(model, body))


def test_a_stop_token_sampled_at_the_budget_ends_the_action_as_in_the_torch_engine(tiny):
    """vLLM versions whose ``check_stop`` tests the length cap before the stop ids answer
    ``length`` for a stop token sampled as the last one allowed: the action ended at its stop
    token all the same (TorchEngine's ``stop``), not truncated."""
    model = _fresh_model(tiny)

    def length_first(answer):
        answer["choices"][0]["finish_reason"] = "length"
        return answer

    async def body(server, engine):
        every_id = tuple(range(model.config.vocab_size))
        server.app.state.reshape_next["/v1/completions"] = length_first
        gen = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=1, stop_ids=every_id, seed=1))
        assert gen.finish_reason == "stop" and len(gen.token_ids) == 1
        server.app.state.reshape_next["/v1/completions"] = length_first
        cut = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=2, stop_ids=(), seed=1))
        assert cut.finish_reason == "length"

    asyncio.run(_with_server(model, body))


def test_only_stop_ids_end_a_generation_as_in_the_torch_engine(tiny):
    """EOS ends a generation only when ``stop_ids`` list it, in both engines: vLLM stops at
    the model's EOS ids unless told to ignore them. Here every id is an EOS of the model."""
    model = _fresh_model(tiny)
    model.generation_config.eos_token_id = list(range(model.config.vocab_size))
    params = SamplingParams(max_new_tokens=8, seed=1)

    async def body(server, engine):
        local = TorchEngine(copy.deepcopy(model), name="torch")
        try:
            return [await e.generate("s", PROMPT, params) for e in (engine, local)]
        finally:
            await local.close()

    for gen in asyncio.run(_with_server(model, body)):
        assert gen.finish_reason == "length" and len(gen.token_ids) == 8, gen.engine


def test_a_generation_stops_where_the_context_ends_as_in_the_torch_engine(tiny):
    """max_new_tokens past the context is clamped to the room the prompt leaves (vLLM would
    refuse the request); a prompt that fills the context is a ContextLimit, in both engines
    (the server's max_model_len is the model's positions here)."""
    model = _fresh_model(tiny)
    positions = model.config.max_position_embeddings
    params = SamplingParams(max_new_tokens=8, seed=1)

    async def body():
        server = await StandinServer(model, max_model_len=positions).start()
        engines = [
            VLLMEngine(VLLMEngineConfig(base_url=server.url), name="vllm-0"),
            TorchEngine(copy.deepcopy(model), name="torch"),
        ]
        try:
            for engine in engines:
                gen = await engine.generate("s", [5] * (positions - 3), params)
                assert (len(gen.token_ids), gen.finish_reason) == (3, "length"), engine.name
                with pytest.raises(ContextLimit, match=f"prompt has {positions} tokens"):
                    await engine.generate("s", [5] * positions, params)
        finally:
            for engine in engines:
                await engine.close()
            await server.stop()

    asyncio.run(body())


def test_a_server_refusing_a_prompt_past_its_context_is_a_context_limit_and_its_length_is_read_again(tiny):
    """/v1/models listed more room than the server holds (it restarted with a smaller
    --max-model-len): vLLM refuses the request with 400 "...the model's context length is only
    128 tokens...", a ContextLimit (the rollout is truncated), not an InvalidRequest; the next
    request reads the server's max_model_len again and is clamped to it."""
    model = _fresh_model(tiny)

    async def body(server, engine):
        server.app.state.reshape_next["/v1/models"] = lambda answer: {
            "data": [answer["data"][0] | {"max_model_len": 256}]
        }
        params = SamplingParams(max_new_tokens=8, seed=0)
        with pytest.raises(ContextLimit, match="context length is only 128 tokens"):
            await engine.generate("s", [5] * 125, params)
        gen = await engine.generate("s", [5] * 125, params)
        assert (len(gen.token_ids), gen.finish_reason) == (3, "length")

    asyncio.run(_with_server(model, body))


def test_a_temperature_below_vllms_floor_is_sampled_at_the_floor_as_vllm_does(tiny):
    """vLLM samples a temperature in (0, 0.01) at 0.01 and reports that distribution's
    log-probs (an evaluation's near-greedy 1e-3 is served so; a run's service.temperature below
    it is refused by its config). One above 2 vLLM refuses itself."""
    model = _fresh_model(tiny)

    async def body(server, engine):
        with pytest.raises(InvalidRequest, match=r"temperature must be in \[0, 2\], got 2.5"):
            await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=3, temperature=2.5, seed=0))
        gen = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=3, temperature=0.005, seed=0))
        expected = reference_logprobs(model, PROMPT, gen.token_ids, 0.01, 1.0)
        assert max(abs(a - b) for a, b in zip(gen.logprobs, expected, strict=True)) < 1e-3

    asyncio.run(_with_server(model, body))


def test_every_64_bit_seed_is_served_as_the_torch_generator_takes_it(tiny):
    """vLLM takes signed 64-bit seeds; SamplingParams also takes [2**63, 2**64), which
    torch.Generator.manual_seed (vLLM's too) reads as the same 64 bits: 2**64 - 1 is -1. But
    vLLM takes a seed of -1 as no seed (it samples at random): refused, as it cannot be served."""
    model = _fresh_model(tiny)

    async def body(server, engine):
        for seed in (-1, 2**64 - 1):
            with pytest.raises(InvalidRequest, match=f"seed {seed} .*no seed"):
                await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=8, seed=seed))
        unsigned = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=8, seed=2**64 - 2))
        signed = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=8, seed=-2))
        assert unsigned.token_ids == signed.token_ids
        highest = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=8, seed=2**63))
        lowest = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=8, seed=-(2**63)))
        assert highest.token_ids == lowest.token_ids

    asyncio.run(_with_server(model, body))


def test_bad_requests_are_invalid_and_the_server_keeps_serving(tiny):
    model = _fresh_model(tiny)

    async def body(server, engine):
        params = SamplingParams(max_new_tokens=4, seed=0)
        with pytest.raises(InvalidRequest, match="out of vocabulary") as bad_token:
            await engine.generate("s", [1, 10**6], params)
        with pytest.raises(InvalidRequest, match="empty prompt"):
            await engine.generate("s", [], params)
        assert not isinstance(bad_token.value, ContextLimit)
        with pytest.raises(ContextLimit, match="200 tokens.*max_model_len=128"):  # the rollout is truncated
            await engine.generate("s", [5] * 200, params)
        gen = await engine.generate("s", PROMPT, params)
        assert len(gen.token_ids) == 4

    asyncio.run(_with_server(model, body))


def test_any_session_id_is_served_as_by_the_torch_engine(tiny):
    """The session id names the request to the server in a header, which takes ASCII only:
    one outside it failed with a UnicodeEncodeError, one with a line break as the server
    unreachable (counted against a healthy replica by the router)."""
    model = _fresh_model(tiny)

    async def body(server, engine):
        for session_id in ("sessão-1", "tâche/漢字", "a\r\nX-Injected: 1"):
            gen = await engine.generate(session_id, PROMPT, SamplingParams(max_new_tokens=2, seed=0))
            assert len(gen.token_ids) == 2

    asyncio.run(_with_server(model, body))


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions"])
def test_an_answer_that_is_not_json_is_an_engine_error_and_the_server_keeps_serving(tiny, path):
    """A proxy in front of the server may answer 200 with a page of its own: that is the
    infrastructure failing (a rollout's infra_error, a router's failover), not a ValueError
    that would count as the environment's bug."""
    model = _fresh_model(tiny)

    async def body(server, engine):
        params = SamplingParams(max_new_tokens=3, seed=0)
        server.app.state.garble_next.add(path)
        with pytest.raises(EngineError, match=f"not JSON on {path}"):
            await engine.generate("s", PROMPT, params)
        assert len((await engine.generate("s", PROMPT, params)).token_ids) == 3

    asyncio.run(_with_server(model, body))


def _first_choice(answer: dict, **fields) -> dict:
    return answer | {"choices": [answer["choices"][0] | fields]}


def _without_token_ids(answer: dict) -> dict:
    """As a server that was not asked for ids: no ``token_ids``, the tokens as plain ids."""
    choice = {key: value for key, value in answer["choices"][0].items() if key != "token_ids"}
    ids = [int(token.removeprefix("token_id:")) for token in choice["logprobs"]["tokens"]]
    return answer | {"choices": [choice | {"logprobs": choice["logprobs"] | {"tokens": ids}}]}


@pytest.mark.parametrize(
    ("path", "reshape"),
    [
        pytest.param(
            "/v1/completions", lambda answer: answer | {"usage": [answer["usage"]]}, id="usage-a-list"
        ),
        pytest.param(
            "/v1/completions",
            lambda answer: answer | {"usage": answer["usage"] | {"prompt_tokens_details": [7]}},
            id="usage-details-a-list",
        ),
        pytest.param(
            "/v1/completions",
            lambda answer: answer | {"usage": answer["usage"] | {"prompt_tokens": "many"}},
            id="prompt-tokens-a-word",
        ),
        pytest.param(
            "/v1/completions",
            lambda answer: {key: value for key, value in answer.items() if key != "choices"},
            id="choices-missing",
        ),
        pytest.param(
            "/v1/completions", lambda answer: answer | {"choices": answer["choices"][0]}, id="choices-a-dict"
        ),
        pytest.param(
            "/v1/completions", lambda answer: _first_choice(answer, logprobs=None), id="logprobs-null"
        ),
        pytest.param("/v1/completions", _without_token_ids, id="tokens-without-token-ids"),
        pytest.param(
            "/v1/models", lambda answer: answer | {"data": answer["data"][0]["id"]}, id="data-a-name"
        ),
        pytest.param("/v1/models", lambda answer: answer | {"data": answer["data"][0]}, id="data-a-dict"),
        pytest.param("/v1/models", lambda answer: [answer], id="answer-a-list"),
        pytest.param(
            "/v1/models", lambda answer: {"data": [answer["data"][0] | {"id": None}]}, id="model-id-null"
        ),
        pytest.param(
            "/v1/models",
            lambda answer: {"data": [answer["data"][0] | {"max_model_len": -1}]},
            id="max-model-len-negative",
        ),
    ],
)
def test_json_of_another_shape_is_an_engine_error_naming_the_path_and_the_server_keeps_serving(
    tiny, path, reshape
):
    """A server (or a proxy in front of it) answering 200 with JSON of another shape is the
    infrastructure failing, as a body that is not JSON is: an EngineError (a rollout's
    infra_error, a router's failover), never an AttributeError or TypeError counted as the
    environment's bug, nor a ContextLimit truncating the rollout."""
    model = _fresh_model(tiny)

    async def body(server, engine):
        params = SamplingParams(max_new_tokens=3, seed=0)
        server.app.state.reshape_next[path] = reshape
        with pytest.raises(EngineError, match=f"vLLM server vllm-0 .* on {path}"):
            await engine.generate("s", PROMPT, params)
        assert not server.app.state.reshape_next, "the reshaped answer was the one read"
        assert len((await engine.generate("s", PROMPT, params)).token_ids) == 3

    asyncio.run(_with_server(model, body))


def test_reload_tags_versions_resets_prefix_cache_and_uses_new_weights(tiny, tmp_path):
    model = _fresh_model(tiny)
    updated = _fresh_model(tiny)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn_like(p))
    updated.save_pretrained(tmp_path / "v1")
    # a version the trainer publishes also holds its value model, which is not the policy
    value_model = {"backbone.embed_tokens.weight": torch.zeros(4, 2), "head.weight": torch.zeros(1, 2)}
    save_file(value_model, tmp_path / "v1" / VALUE_MODEL_FILE)

    async def body(server, engine):
        params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
        before = await engine.generate("s", PROMPT, params)
        assert before.versions == [0] * 6
        await engine.load_version(1, str(tmp_path / "v1"))
        assert engine.version == 1
        kinds = [kind for kind, _ in server.events]
        assert kinds[-2:] == ["reload", "reset_prefix_cache"]
        after = await engine.generate("s", PROMPT, params)
        assert after.versions == [1] * 6
        assert after.cached_tokens == 0, "the prefix cache was reset with the new weights"
        expected = reference_logprobs(updated, PROMPT, after.token_ids, 1.0, 1.0)
        assert max(abs(a - b) for a, b in zip(after.logprobs, expected, strict=True)) < 1e-4
        stale = reference_logprobs(tiny[0], PROMPT, after.token_ids, 1.0, 1.0)
        assert max(abs(a - b) for a, b in zip(after.logprobs, stale, strict=True)) > 1e-3

    asyncio.run(_with_server(model, body))


def test_reload_waits_for_in_flight_generation(tiny, tmp_path):
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v7")

    async def body(server, engine):
        params = SamplingParams(max_new_tokens=40, seed=2)
        running = asyncio.create_task(engine.generate("a", PROMPT, params))
        while not any(kind == "completion-start" for kind, _ in server.events):
            await asyncio.sleep(0)
        reload = asyncio.create_task(engine.load_version(7, str(tmp_path / "v7")))
        await asyncio.sleep(0)
        queued = asyncio.create_task(engine.generate("b", PROMPT, SamplingParams(max_new_tokens=3, seed=1)))
        first, _, second = await asyncio.gather(running, reload, queued)
        kinds = [kind for kind, _ in server.events]
        assert kinds == [
            "completion-start",
            "completion-end",
            "reload",
            "reset_prefix_cache",
            "completion-start",
            "completion-end",
        ]
        assert first.versions == [0] * 40
        assert second.versions == [7] * 3

    asyncio.run(_with_server(model, body))


async def _until(condition, timeout_s: float = 30.0):
    """Wait (polling every 10 ms) until ``condition()``, an async callable, holds."""
    async with asyncio.timeout(timeout_s):
        while not await condition():
            await asyncio.sleep(0.01)


def test_queue_depth_counts_requests_the_server_holds_waiting_not_those_generating(tiny):
    """The elastic controller reads ``queue_depth`` as sessions waiting for room: requests
    generating (within vLLM's max_num_seqs) are not queued; the server's waiting ones are."""
    model = _fresh_model(tiny)

    async def body(server, engine):
        server.app.state.hold = asyncio.Event()
        params = SamplingParams(max_new_tokens=3, seed=1)
        running = [asyncio.create_task(engine.generate(f"s{i}", PROMPT, params)) for i in range(2)]

        async def stats_when(queue_depth: int, in_flight: int):
            stats = await asyncio.to_thread(engine.stats)
            return stats.queue_depth == queue_depth and stats.extra["in_flight"] == in_flight

        await _until(lambda: stats_when(0, 2))
        waiting = [asyncio.create_task(engine.generate(f"w{i}", PROMPT, params)) for i in range(3)]
        await _until(lambda: stats_when(3, 5))
        server.app.state.hold.set()
        assert all(len(g.token_ids) == 3 for g in await asyncio.gather(*running, *waiting))
        stats = await asyncio.to_thread(engine.stats)
        assert stats.queue_depth == 0 and stats.extra["in_flight"] == 0 and stats.requests == 5

    asyncio.run(_with_server(model, body, max_num_seqs=2))


def test_queue_depth_counts_requests_waiting_for_one_of_the_clients_connections(tiny):
    """Past ``max_connections`` a request waits in the client for a connection, unseen by the
    server's gauge: it waits for room all the same (vLLM's own default max_num_seqs is up to 1024)."""
    model = _fresh_model(tiny)

    async def body(server, engine):
        await engine.max_model_len()
        server.app.state.hold = asyncio.Event()
        params = SamplingParams(max_new_tokens=2, seed=1)
        tasks = [asyncio.create_task(engine.generate(f"s{i}", PROMPT, params)) for i in range(5)]
        try:
            await _until(lambda: asyncio.to_thread(lambda: server.app.state.scheduler["running"] == 2))
            stats = await asyncio.to_thread(engine.stats)
        finally:
            server.app.state.hold.set()
            await asyncio.gather(*tasks)
        assert (stats.queue_depth, stats.extra["in_flight"]) == (3, 5)
        assert (await asyncio.to_thread(engine.stats)).queue_depth == 0

    asyncio.run(_with_server(model, body, max_connections=2))


def test_queue_depth_counts_requests_held_back_by_a_reload(tiny, tmp_path):
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v7")

    async def body(server, engine):
        server.app.state.hold = asyncio.Event()
        running = asyncio.create_task(engine.generate("a", PROMPT, SamplingParams(max_new_tokens=3, seed=2)))
        await _until(lambda: asyncio.to_thread(lambda: engine.stats().extra["in_flight"] == 1))
        reload = asyncio.create_task(engine.load_version(7, str(tmp_path / "v7")))
        await asyncio.sleep(0)
        held = [
            asyncio.create_task(engine.generate(f"b{i}", PROMPT, SamplingParams(max_new_tokens=3, seed=1)))
            for i in range(2)
        ]
        await _until(lambda: asyncio.to_thread(lambda: engine.stats().queue_depth == 2))
        server.app.state.hold.set()
        await asyncio.gather(running, reload, *held)
        assert (await asyncio.to_thread(engine.stats)).queue_depth == 0

    asyncio.run(_with_server(model, body))


def test_a_server_without_metrics_counts_no_waiting_requests_and_warns_once(tiny, caplog):
    model = _fresh_model(tiny)

    async def body(server, engine):
        server.app.state.metrics = False
        with caplog.at_level("WARNING", logger="rollout.engines.vllm_engine"):
            first = await asyncio.to_thread(engine.stats)
            second = await asyncio.to_thread(engine.stats)
        assert first.queue_depth == second.queue_depth == 0 and first.extra["queue_read"] == 0.0
        warnings = [r.getMessage() for r in caplog.records if "/metrics" in r.getMessage()]
        assert len(warnings) == 1 and "answered 404" in warnings[0], warnings
        server.app.state.metrics = True
        recovered = await asyncio.to_thread(engine.stats)
        assert recovered.queue_depth == 0 and recovered.extra["queue_read"] == 1.0
        server.app.state.metrics = False
        await asyncio.to_thread(engine.stats)
        assert len([r for r in caplog.records if "/metrics" in r.getMessage()]) == 2, (
            "warns again after a recovery"
        )

    asyncio.run(_with_server(model, body))


def test_a_reload_cancelled_while_it_waits_lets_requests_through_again(tiny, tmp_path):
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v7")

    async def body(server, engine):
        running = asyncio.create_task(engine.generate("a", PROMPT, SamplingParams(max_new_tokens=40, seed=2)))
        while not any(kind == "completion-start" for kind, _ in server.events):
            await asyncio.sleep(0)
        reload = asyncio.create_task(engine.load_version(7, str(tmp_path / "v7")))
        await asyncio.sleep(0)  # the reload waits for the running generation
        reload.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reload
        later = await asyncio.wait_for(
            engine.generate("b", PROMPT, SamplingParams(max_new_tokens=3, seed=1)), 60
        )
        first = await running
        assert first.versions == [0] * 40 and later.versions == [0] * 3 and engine.version == 0
        assert "reload" not in [kind for kind, _ in server.events]

    asyncio.run(_with_server(model, body))


def test_a_reload_that_fails_midway_refuses_to_generate_until_a_reload_succeeds(tiny, tmp_path):
    """The server loaded the new weights but its prefix-cache reset failed: no token may be
    tagged with the old version, so the engine refuses to generate until a load succeeds."""
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body(server, engine):
        server.app.state.fail_next.add("/reset_prefix_cache")
        with pytest.raises(EngineError, match="answered 500 on /reset_prefix_cache"):
            await engine.load_version(1, str(tmp_path / "v1"))
        assert [kind for kind, _ in server.events] == ["reload"]
        await _refuses_until_reloaded(engine, tmp_path / "v1")

    asyncio.run(_with_server(model, body))


def test_a_reload_on_a_server_returning_raw_log_probs_is_refused_naming_the_flag(tiny, tmp_path):
    """vLLM's default ``--logprobs-mode raw_logprobs`` returns log-probs before temperature and
    top-p, not those of the distribution sampled from, which the trainer's ratios assume."""
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body(server, engine):
        server.app.state.logprobs_mode = "raw_logprobs"
        with pytest.raises(EngineError, match="--logprobs-mode raw_logprobs.*processed_logprobs"):
            await engine.load_version(1, str(tmp_path / "v1"))
        assert engine.version == 0 and not [e for e in server.events if e[0] == "reload"]
        server.app.state.logprobs_mode = "processed_logprobs"
        await engine.load_version(1, str(tmp_path / "v1"))
        assert engine.version == 1

    asyncio.run(_with_server(model, body))


def test_a_reload_on_a_server_without_dev_mode_names_the_setting_it_needs(tiny, tmp_path):
    """vLLM serves /collective_rpc and /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1;
    without it they answer 404 as any unknown path: the error says what to set."""
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body():
        server = await StandinServer(model, max_model_len=128, dev_mode=False).start()
        engine = VLLMEngine(VLLMEngineConfig(base_url=server.url), name="vllm-0")
        try:
            with pytest.raises(EngineError, match="no /collective_rpc .*VLLM_SERVER_DEV_MODE=1"):
                await engine.load_version(1, str(tmp_path / "v1"))
            assert engine.version == UNKNOWN_VERSION
        finally:
            await engine.close()
            await server.stop()

    asyncio.run(body())


def test_a_reload_on_a_server_without_the_worker_extension_names_how_launch_sh_loads_it(tiny, tmp_path):
    """vLLM answers a method its workers lack with a bare 500, as any failure of the call: the
    error says where the cause is and how the extension is loaded."""
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body(server, engine):
        with pytest.raises(EngineError) as failed:
            await engine.load_version(1, str(tmp_path / "v1"))
        message = str(failed.value)
        assert "answered 500 on /collective_rpc: Internal Server Error" in message
        assert "its log has the cause" in message and "treadle_reload_v2" in message
        assert "deployments/vllm/launch.sh" in message
        assert "--worker-extension-cls treadle_vllm_ext.WeightReloadExtension" in message
        assert engine.version == UNKNOWN_VERSION

    asyncio.run(_with_server(model, body, reload_method="treadle_reload_v2"))


@pytest.mark.parametrize(
    ("empty", "reshape"),
    [
        pytest.param(False, None, id="success-true-as-vllm"),
        pytest.param(True, None, id="empty-as-older-vllm"),
        pytest.param(False, lambda _: {}, id="success-left-out"),
    ],
)
def test_a_reload_reads_whether_the_prefix_cache_was_reset_from_an_empty_or_json_answer(
    tiny, tmp_path, empty, reshape
):
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body(server, engine):
        server.app.state.empty_reset = empty
        if reshape is not None:
            server.app.state.reshape_next["/reset_prefix_cache"] = reshape
        await engine.load_version(1, str(tmp_path / "v1"))
        assert engine.version == 1
        assert [kind for kind, _ in server.events] == ["reload", "reset_prefix_cache"]
        assert not server.app.state.reshape_next, "the reshaped answer was the one read"

    asyncio.run(_with_server(model, body))


async def _given_up_on_while_it_runs(server, engine) -> None:
    """A request the client cancelled (its session closed mid-turn) that the server still
    runs (held by ``app.state.hold``), holding blocks of its prefix cache."""
    server.app.state.hold = asyncio.Event()
    given_up = asyncio.create_task(engine.generate("a", PROMPT, SamplingParams(max_new_tokens=3, seed=2)))

    async def running():
        return server.app.state.scheduler["running"] == 1

    await _until(running)
    given_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await given_up


def test_a_reload_retries_a_prefix_cache_reset_refused_while_a_request_given_up_on_still_runs(tiny, tmp_path):
    """vLLM answers {"success": false} while blocks are held, by a request whose client gave up
    but which the server has not aborted yet, and says callers may retry: the reload does,
    instead of failing midway and taking the replica out until its health check reloads it."""
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body(server, engine):
        await _given_up_on_while_it_runs(server, engine)
        reload = asyncio.create_task(engine.load_version(1, str(tmp_path / "v1")))

        async def refused():
            return ("reset_prefix_cache_refused", None) in server.events

        await _until(refused)
        server.app.state.hold.set()
        await asyncio.wait_for(reload, 30)
        assert engine.version == 1
        kinds = [kind for kind, _ in server.events]
        assert kinds[0] == "reload" and kinds[-1] == "reset_prefix_cache", kinds
        assert set(kinds[1:-1]) == {"reset_prefix_cache_refused", "completion-start", "completion-end"}, kinds
        after = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=3, seed=1))
        assert after.versions == [1] * 3

    asyncio.run(_with_server(model, body, reset_wait_s=30.0))


def test_a_prefix_cache_reset_refused_for_reset_wait_s_fails_the_reload_midway(tiny, tmp_path):
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body(server, engine):
        await _given_up_on_while_it_runs(server, engine)
        with pytest.raises(
            EngineError, match=r"vLLM server vllm-0 could not reset its prefix cache within 0\.3 s"
        ):
            await engine.load_version(1, str(tmp_path / "v1"))
        assert engine.version == UNKNOWN_VERSION
        refusals = [kind for kind, _ in server.events].count("reset_prefix_cache_refused")
        assert refusals > 1, "retried before giving up"
        server.app.state.hold.set()
        await _refuses_until_reloaded(engine, tmp_path / "v1")

    asyncio.run(_with_server(model, body, reset_wait_s=0.3))


@pytest.mark.parametrize(
    ("fault", "match"),
    [
        pytest.param("garble", "not JSON", id="a-page"),
        pytest.param(lambda answer: [{"success": True}], "JSON of another shape", id="a-list"),
        pytest.param(lambda answer: "success", "JSON of another shape", id="a-string"),
    ],
)
def test_a_prefix_cache_reset_answer_of_another_shape_fails_the_reload_midway(tiny, tmp_path, fault, match):
    """The weights were loaded but whether the cache was reset is unknown: an EngineError
    naming the server and the path (the worker's infra failure), never a ValueError or
    AttributeError, and the engine refuses to generate until a reload succeeds."""
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body(server, engine):
        if fault == "garble":
            server.app.state.garble_next.add("/reset_prefix_cache")
        else:
            server.app.state.reshape_next["/reset_prefix_cache"] = fault
        with pytest.raises(EngineError, match=f"vLLM server vllm-0 .*{match}.* on /reset_prefix_cache"):
            await engine.load_version(1, str(tmp_path / "v1"))
        assert not server.app.state.garble_next and not server.app.state.reshape_next
        await _refuses_until_reloaded(engine, tmp_path / "v1")

    asyncio.run(_with_server(model, body))


def test_a_replica_whose_reload_failed_midway_is_failed_over_and_restored_by_the_health_check(tiny, tmp_path):
    """It passes its health check, yet refuses every request until a reload succeeds: the
    router takes it out as if down, instead of failing every turn of its sessions, and the
    health check's restore loads the weights before it is back."""
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")
    path = str(tmp_path / "v1")

    async def body(server, failed):
        other = VLLMEngine(VLLMEngineConfig(base_url=server.url), name="vllm-1")
        try:
            await other.load_version(1, path)
            server.app.state.fail_next.add("/reset_prefix_cache")
            with pytest.raises(EngineError):
                await failed.load_version(1, path)
            router = Router([failed, other], RouterConfig(policy="sticky"))
            session = next(s for s in (f"s{i}" for i in range(40)) if router.route(s) is failed)
            params = SamplingParams(max_new_tokens=3, seed=0)
            gen = await router.generate(session, PROMPT, params)
            assert (gen.engine, gen.versions) == ("vllm-1", [1] * 3)
            assert router.down == [failed.name]
            await router.check_health(restore=lambda engine: engine.load_version(1, path))
            assert router.replicas == ["vllm-1", failed.name] and failed.version == 1
            again = await failed.generate("t", PROMPT, params)
            assert again.versions == [1] * 3
        finally:
            await other.close()

    asyncio.run(_with_server(model, body))


def test_a_server_restarted_between_health_checks_is_found_by_the_probe_and_needs_its_weights_again(
    tiny, tmp_path
):
    """A relaunched server serves its launch weights, not the version loaded onto it before:
    the probe reads the server process's start time (/metrics), and on a new one takes the
    version for unknown, so the replica refuses to generate (a router fails it over) until its
    weights are loaded again, instead of tagging tokens with a version it no longer serves."""
    weights = tmp_path / "v1"
    tiny[0].save_pretrained(weights)

    async def body():
        server = await StandinServer(_fresh_model(tiny)).start()
        port = int(server.url.rsplit(":", 1)[1])
        engine = VLLMEngine(VLLMEngineConfig(base_url=server.url), name="vllm-0")
        try:
            await engine.load_version(1, str(weights))
            assert await engine.health() and await engine.health()
            assert engine.version == 1, "the same server process keeps its version"
            await server.stop()
            server = await StandinServer(_fresh_model(tiny), port=port).start()
            assert await engine.health(), "the restarted server is up"
            await _refuses_until_reloaded(engine, weights)
            assert await engine.health() and engine.version == 1
        finally:
            await engine.close()
            await server.stop()

    asyncio.run(body())


@pytest.mark.parametrize("restart_seen", [True, False])
def test_a_server_relaunched_under_another_model_name_is_asked_its_new_one(tiny, tmp_path, restart_seen):
    """launch.sh serves the model under its MODEL_DIR, so a server relaunched from another
    directory (a weight version's) lists another name. The name first read from /v1/models was
    sent with every generation after, each refused 404: the replica never served again, however
    often its weights were reloaded. A restart the probe sees, or a 404, has it read again."""
    weights = tmp_path / "v1"
    tiny[0].save_pretrained(weights)
    params = SamplingParams(max_new_tokens=3, seed=1)

    async def body():
        server = await StandinServer(_fresh_model(tiny), model_name="/models/base").start()
        port = int(server.url.rsplit(":", 1)[1])
        engine = VLLMEngine(VLLMEngineConfig(base_url=server.url), name="vllm-0")
        try:
            await engine.load_version(1, str(weights))
            await engine.generate("s", PROMPT, params)
            await server.stop()
            server = await StandinServer(_fresh_model(tiny), model_name="/models/v7", port=port).start()
            server.app.state.metrics = restart_seen
            assert await engine.health()
            if restart_seen:
                await _refuses_until_reloaded(engine, weights)
            else:  # the restart is not seen: the first generation is refused, and fails over
                with pytest.raises(EngineError, match="answered 404 on /v1/completions"):
                    await engine.generate("s", PROMPT, params)
            generation = await engine.generate("s", PROMPT, params)
            assert generation.versions == [1] * 3
        finally:
            await engine.close()
            await server.stop()

    asyncio.run(body())


def test_a_server_without_a_process_start_time_keeps_its_version_through_health_checks(tiny, tmp_path):
    """Without /metrics (or its process collector) a restart cannot be seen: the probe
    answers as before and leaves the version alone."""
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body(server, engine):
        server.app.state.metrics = False
        await engine.load_version(1, str(tmp_path / "v1"))
        assert await engine.health() and engine.version == 1
        server.app.state.metrics = True
        assert await engine.health() and engine.version == 1

    asyncio.run(_with_server(model, body))


def test_a_closed_engine_is_down_and_refuses_requests_with_engine_errors(tiny, tmp_path):
    """As a TorchEngine does once closed: a router sees it down and fails a request over."""
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body(server, engine):
        await engine.close()
        assert not await engine.health()
        with pytest.raises(EngineError, match="closed"):
            await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=2, seed=0))
        with pytest.raises(EngineError, match="closed"):
            await engine.load_version(1, str(tmp_path / "v1"))
        assert [kind for kind, _ in server.events] == []

    asyncio.run(_with_server(model, body))


def test_crashed_server_is_an_engine_error_and_router_fails_over(tiny):
    model = _fresh_model(tiny)

    async def body():
        dead = await StandinServer(model).start()
        live = await StandinServer(model).start()
        engines = [
            VLLMEngine(VLLMEngineConfig(base_url=dead.url, connect_timeout_s=2.0), name="dead"),
            VLLMEngine(VLLMEngineConfig(base_url=live.url), name="live"),
        ]
        router = Router(engines, RouterConfig(policy="sticky"))
        sessions = [f"s{i}" for i in range(40)]
        on_dead = [s for s in sessions if router.route(s).name == "dead"]
        assert on_dead, "some sessions hash to the replica that will die"
        await dead.stop()
        try:
            assert not await engines[0].health()
            with pytest.raises(EngineError, match="unreachable"):
                await engines[0].generate("x", PROMPT, SamplingParams(max_new_tokens=2))
            gen = await router.generate(on_dead[0], PROMPT, SamplingParams(max_new_tokens=3, seed=0))
            assert gen.engine == "live" and len(gen.token_ids) == 3
            assert router.replicas == ["live"]
            assert all(router.route(s).name == "live" for s in on_dead)
            health = await router.check_health()
            assert health == {"live": True, "dead": False}
        finally:
            for engine in engines:
                await engine.close()
            await live.stop()

    asyncio.run(body())


class DroppingProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target`` (host, port) that reads the first
    ``drop`` connections' requests and closes them without an answer, as a server does with
    a keep-alive connection it timed out; later connections are relayed. With ``reset_on``, the
    first request starting with those bytes is read and its connection reset (TCP RST), as
    a server's socket does that got a request after the server closed it."""

    def __init__(self, target: tuple[str, int], drop: int, reset_on: bytes | None = None):
        self.target, self.drop, self.dropped = target, drop, 0
        self.reset_on, self.resets = reset_on, 0
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.dropped < self.drop:
            self.dropped += 1
            await reader.read(65536)
            writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            while data := await source.read(65536):
                if (
                    sink is upstream_writer
                    and self.reset_on
                    and not self.resets
                    and data.startswith(self.reset_on)
                ):
                    self.resets += 1
                    # no linger: close sends RST instead of FIN
                    linger = struct.pack("ii", 1, 0)
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                    writer.close()
                    upstream_writer.close()
                    return
                sink.write(data)
                await sink.drain()
            sink.close()

        await asyncio.gather(
            pipe(reader, upstream_writer), pipe(upstream_reader, writer), return_exceptions=True
        )

    async def stop(self) -> None:
        self._server.close()


@pytest.mark.parametrize("retries", [0, 1])
def test_a_connection_closed_before_any_answer_is_retried_retries_times(tiny, retries):
    model = _fresh_model(tiny)

    async def body():
        server = await StandinServer(model).start()
        proxy = DroppingProxy(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), drop=1)
        engine = VLLMEngine(VLLMEngineConfig(base_url=await proxy.start(), retries=retries), name="vllm-0")
        try:
            params = SamplingParams(max_new_tokens=3, seed=0)
            if retries:
                assert len((await engine.generate("s", PROMPT, params)).token_ids) == 3
            else:
                with pytest.raises(EngineError, match="RemoteProtocolError"):
                    await engine.generate("s", PROMPT, params)
            assert proxy.dropped == 1
        finally:
            await engine.close()
            await proxy.stop()
            await server.stop()

    asyncio.run(body())


@pytest.mark.parametrize(
    "request_line", ["POST /v1/completions", "POST /collective_rpc", "POST /reset_prefix_cache"]
)
def test_a_connection_reset_after_the_request_went_out_is_retried_for_each_kind_of_request(
    tiny, tmp_path, request_line
):
    """A reset connection fails the read (httpx ``ReadError``), or the rest of the send
    (``WriteError``): a generation, a weight reload and its prefix-cache reset are each safe
    to send again, so each is retried."""
    model = _fresh_model(tiny)
    tiny[0].save_pretrained(tmp_path / "v1")

    async def body():
        server = await StandinServer(model).start()
        target = ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        proxy = DroppingProxy(target, drop=0, reset_on=request_line.encode())
        engine = VLLMEngine(VLLMEngineConfig(base_url=await proxy.start(), retries=1), name="vllm-0")
        try:
            await engine.load_version(1, str(tmp_path / "v1"))
            gen = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=3, seed=0))
            assert proxy.resets == 1 and engine.version == 1 and gen.versions == [1] * 3
        finally:
            await engine.close()
            await proxy.stop()
            await server.stop()

    asyncio.run(body())


def test_a_generation_that_times_out_is_an_engine_error_and_is_not_sent_again(tiny):
    """The server may still be running a generation its client stopped waiting for: it is an
    infrastructure failure (the router fails it over), never retried on the same server,
    which would run it twice."""
    model = _fresh_model(tiny)

    async def body(server, engine):
        await engine.max_model_len()  # read /v1/models before the server holds requests
        server.app.state.hold = asyncio.Event()
        try:
            with pytest.raises(
                EngineError, match=r"did not answer /v1/completions within 1 s \(timeout_s\)"
            ) as late:
                await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=3, seed=0))
            assert "ReadTimeout" in str(late.value) and "unreachable" not in str(late.value)
            assert server.app.state.scheduler["running"] == 1
        finally:
            server.app.state.hold.set()
        after = await engine.generate("s", PROMPT, SamplingParams(max_new_tokens=3, seed=0))
        stats = await asyncio.to_thread(engine.stats)  # it asks the server, served by this loop
        assert len(after.token_ids) == 3 and stats.extra["in_flight"] == 0

    asyncio.run(_with_server(model, body, timeout_s=1.0, retries=1))


def test_the_health_probe_and_the_queue_read_retry_a_connection_closed_before_any_answer(tiny):
    """As a generation does: a probe that fails on a stale keep-alive connection would take a
    healthy replica out of service, and a failed queue read shows the elastic controller an
    empty queue."""
    model = _fresh_model(tiny)

    async def body():
        server = await StandinServer(model).start()
        proxy = DroppingProxy(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), drop=1)
        engine = VLLMEngine(VLLMEngineConfig(base_url=await proxy.start(), retries=1), name="vllm-0")
        try:
            assert await engine.health()
            assert proxy.dropped == 1
            proxy.drop = 2  # the first connection of the queue read's own client
            stats = await asyncio.to_thread(engine.stats)
            assert proxy.dropped == 2 and stats.extra["queue_read"] == 1.0
        finally:
            await engine.close()
            await proxy.stop()
            await server.stop()

    asyncio.run(body())


def test_the_bearer_token_defaults_to_vllm_api_key(monkeypatch):
    """A deployment cannot carry the token (Prefect masks it), so a worker gives it in its
    environment, as ``vllm serve`` reads it; one in the config wins."""
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert VLLMEngine(VLLMEngineConfig())._client.headers["Authorization"] == "Bearer from-env"
    configured = VLLMEngine(VLLMEngineConfig(api_key="from-config"))
    assert configured._client.headers["Authorization"] == "Bearer from-config"
    monkeypatch.delenv("VLLM_API_KEY")
    assert "Authorization" not in VLLMEngine(VLLMEngineConfig())._client.headers
