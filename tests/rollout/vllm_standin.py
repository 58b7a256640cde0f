"""TEST STAND-IN for a vLLM server — used only by the tests, never in production.

A small FastAPI app that speaks the subset of the vLLM server protocol that
``rollout.engines.vllm_engine.VLLMEngine`` uses, backed by a real (tiny) Hugging Face
model doing a plain forward pass per token:

- ``GET /health``, ``GET /v1/models`` (with each model's ``max_model_len``), ``GET /metrics`` (the scheduler's
  ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` gauges, and the
  ``process_start_time_seconds`` of prometheus_client's process collector, distinct for each
  app as for each server process, in Prometheus' text format; 404 while ``app.state.metrics``
  is False)
- ``POST /v1/completions`` with the prompt as a list of token ids, ``logprobs``,
  ``return_tokens_as_token_ids``, ``return_token_ids``, ``stop_token_ids``, ``ignore_eos``,
  ``seed``; log-probs are those of the sampling distribution (as vLLM's
  ``--logprobs-mode processed_logprobs``): temperature, then top-p, renormalised. As vLLM,
  it also stops at the model's EOS ids (``eos_ids``) unless ``ignore_eos`` is set. As vLLM,
  it refuses a temperature above 2 and samples one below 0.01 at 0.01, and refuses a request
  past ``max_model_len`` with vLLM's 400 and words.
- only with ``dev_mode`` (vLLM's ``VLLM_SERVER_DEV_MODE=1``; 404 otherwise): ``POST /collective_rpc``
  with method ``treadle_reload_weights`` (as the worker extension in
  ``deployments/vllm/treadle_vllm_ext.py``, whose choice of files it uses; another method
  answers vLLM's bare 500), ``POST /reset_prefix_cache``
  (answering ``{"success": bool}`` as vLLM's ``vllm/frontend/entrypoints/serve/dev/cache/api_router.py``
  does: false, resetting nothing, while a request is running and holds blocks; an empty 200, as
  vLLM answered before, while ``app.state.empty_reset`` is True; its next call answers 500 while
  ``"/reset_prefix_cache"`` is in ``app.state.fail_next``).
- only with ``dev_mode``: ``GET /server_info?config_format=json``, of which only
  ``vllm_config.model_config.logprobs_mode`` (``app.state.logprobs_mode``, vLLM's ``--logprobs-mode``).
- any path in ``app.state.garble_next``: its next call answers 200 with an HTML page, as a
  proxy in front of a server can; any path in ``app.state.reshape_next`` (path -> function of
  the JSON answer, None for an empty one): its next answer is the function's result, JSON of a
  shape of its own.

As vLLM's scheduler, it runs at most ``max_num_seqs`` requests at once (None: no limit);
the others wait. While ``app.state.hold`` is an ``asyncio.Event``, a request that got its
turn waits for it to be set before it generates, so tests can hold requests running.

Its "prefix cache" only counts the longest cached prefix of each prompt (what vLLM reports
as ``cached_tokens``); it does not skip compute. ``events`` logs completions and reloads in
order so tests can check that a reload never overlaps a generation.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from safetensors.torch import load_file

from deployments.vllm.treadle_vllm_ext import policy_files

_MAX_TEMP = 1e-2
"""vLLM's name for the smallest temperature it samples at (``vllm/sampling_params.py``): it
raises a lower one (above 0) to this, with a warning in its log only."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": status}}, status)


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution sampled from: ``logits / temperature``, restricted to
    the smallest set of top tokens whose mass reaches ``top_p``, renormalised.

    logits: (V,) -> (V,) with -inf outside the nucleus.
    """
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logprobs, descending=True)
        mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
        drop = order[mass_before >= top_p]
        logprobs = logprobs.clone()
        logprobs[drop] = float("-inf")
        logprobs = torch.log_softmax(logprobs, dim=-1)
    return logprobs


_STARTS = itertools.count()
"""Numbers the apps, so that each reports a start time of its own."""


def create_standin_app(
    model,
    model_name: str = "standin",
    max_model_len: int = 1024,
    max_num_seqs: int | None = None,
    dev_mode: bool = True,
) -> FastAPI:
    """The stand-in app serving ``model`` (a Hugging Face causal LM on the CPU); without
    ``dev_mode`` (a vLLM server started without ``VLLM_SERVER_DEV_MODE=1``) it has no
    ``/collective_rpc`` nor ``/reset_prefix_cache``: they answer 404, as any unknown path."""
    app = FastAPI(title="vLLM TEST STAND-IN")
    scheduler = {"running": 0, "waiting": 0}
    seqs = asyncio.Semaphore(max_num_seqs) if max_num_seqs is not None else None
    vocab = model.config.vocab_size
    cache: list[list[int]] = []
    events: list[tuple[str, Any]] = []
    app.state.events = events
    app.state.model = model
    app.state.fail_next = set()  # endpoint paths whose next call answers 500 (fault injection)
    app.state.garble_next = set()  # endpoint paths whose next call answers 200 with HTML
    app.state.reshape_next = {}  # endpoint path -> function rewriting its next JSON answer
    app.state.metrics = True
    app.state.hold = None
    app.state.scheduler = scheduler
    app.state.empty_reset = False
    app.state.logprobs_mode = "processed_logprobs"  # vLLM's --logprobs-mode, in /server_info
    started = 1.7e9 + next(_STARTS)

    @app.middleware("http")
    async def garble(request: Request, call_next):
        if request.url.path in app.state.garble_next:
            app.state.garble_next.discard(request.url.path)
            return HTMLResponse("<html><body>Sign in to continue</body></html>", 200)
        response = await call_next(request)
        reshape = app.state.reshape_next.pop(request.url.path, None)
        if reshape is None:
            return response
        body = b"".join([chunk async for chunk in response.body_iterator])
        answer = json.loads(body) if body else None
        return JSONResponse(reshape(answer), response.status_code)

    @app.get("/health")
    async def health():
        return JSONResponse({}, 200)

    @app.get("/metrics")
    async def metrics():
        if not app.state.metrics:
            return PlainTextResponse("Not Found", 404)
        labels = f'engine="0",model_name="{model_name}"'
        return PlainTextResponse(
            "".join(
                f"# HELP vllm:num_requests_{state} Number of requests {state}.\n"
                f"# TYPE vllm:num_requests_{state} gauge\n"
                f"vllm:num_requests_{state}{{{labels}}} {float(count)}\n"
                for state, count in scheduler.items()
            )
            + "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {started}\n"
        )

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "max_model_len": max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("model") != model_name:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            return _error(400, "prompt must be a non-empty list of token ids")
        if any(not 0 <= t < vocab for t in prompt):
            return _error(400, f"Token id out of vocabulary (size {vocab})")
        max_tokens = int(body.get("max_tokens") or 16)
        # vLLM's words (vllm/renderers/params.py, TokenizeParams), its typo included
        if max_tokens > max_model_len:
            return _error(
                400,
                f"max_tokens={max_tokens}cannot be greater than max_model_len=max_total_tokens={max_model_len}. "
                f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
            )
        if len(prompt) > max_model_len - max_tokens:
            return _error(
                400,
                f"You passed {len(prompt)} input tokens and requested {max_tokens} output tokens. However, the "
                f"model's context length is only {max_model_len} tokens, resulting in a maximum input length of "
                f"{max_model_len - max_tokens} tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={len(prompt)})",
            )
        if body.get("logprobs") is None or not body.get("return_tokens_as_token_ids"):
            return _error(400, "the stand-in only serves token-id requests with logprobs")
        temperature = float(body.get("temperature", 1.0))
        # as vLLM's SamplingParams (vllm/sampling_params.py): above 2 refused, below 0.01 raised to 0.01
        if temperature > 2.0:
            return _error(
                400,
                f"temperature must be in [0, 2], got {temperature}. (parameter=temperature, value={temperature})",
            )
        if 0 < temperature < _MAX_TEMP:
            temperature = _MAX_TEMP
        top_p = float(body.get("top_p", 1.0))
        stop_ids = set(body.get("stop_token_ids") or [])
        eos = set() if body.get("ignore_eos") else eos_ids(model)
        seed = body.get("seed")
        if seed is not None and not -(2**63) <= seed < 2**63:  # vLLM's bound: a signed 64-bit integer
            return _error(400, f"seed: Input should be less than or equal to {2**63 - 1}")
        if seed == -1:  # as vLLM's SamplingParams (vllm/sampling_params.py): no seed
            seed = None
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        scheduler["waiting"] += 1
        try:
            if seqs is not None:
                await seqs.acquire()
        finally:
            scheduler["waiting"] -= 1
        scheduler["running"] += 1
        try:
            if app.state.hold is not None:
                await app.state.hold.wait()
            cached = max((_common_prefix(prompt, seen) for seen in cache), default=0)
            cached = min(cached, len(prompt) - 1)
            events.append(("completion-start", len(events)))
            tokens, logprobs, finish = [], [], "length"
            past = None
            step_input = torch.tensor([prompt])
            for _ in range(max_tokens):
                lp, past = _next_logprobs(model, step_input, past, temperature, top_p)
                token = int(torch.multinomial(lp.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(lp[token]))
                step_input = torch.tensor([[token]])
                await asyncio.sleep(0)
                if token in stop_ids or token in eos:
                    finish = "stop"
                    break
            events.append(("completion-end", len(events)))
            cache.append(prompt + tokens)
            return {
                "id": "cmpl-standin",
                "object": "text_completion",
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "token_ids": tokens,
                        "logprobs": {
                            "tokens": [f"token_id:{t}" for t in tokens],
                            "token_logprobs": logprobs,
                            "top_logprobs": None,
                            "text_offset": [0] * len(tokens),
                        },
                        "finish_reason": finish,
                        # as vLLM: the stop token id, None at EOS
                        "stop_reason": tokens[-1] if tokens[-1] in stop_ids else None,
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(tokens),
                    "total_tokens": len(prompt) + len(tokens),
                    "prompt_tokens_details": {"cached_tokens": cached},
                },
            }
        finally:
            scheduler["running"] -= 1
            if seqs is not None:
                seqs.release()

    if dev_mode:
        _add_dev_endpoints(app, model, cache, events, scheduler)
    return app


def _add_dev_endpoints(app: FastAPI, model, cache: list[list[int]], events: list, scheduler: dict) -> None:
    """The endpoints vLLM serves only in dev mode (``vllm/entrypoints/serve/dev/``)."""

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        body = await request.json()
        if body.get("method") != "treadle_reload_weights":
            # as vLLM: the workers' NotImplementedError reaches its HTTP server as an unhandled
            # exception, answered by Starlette's plain 500
            return PlainTextResponse("Internal Server Error", 500)
        path = body.get("kwargs", {}).get("path", "")
        try:
            files = policy_files(path)
        except FileNotFoundError as exc:
            return JSONResponse({"error": str(exc)}, 500)
        state = {}
        for file in files:
            state.update(load_file(file))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            return JSONResponse(
                {"error": f"weights do not fit: missing {missing}, unexpected {unexpected}"}, 500
            )
        events.append(("reload", path))
        return {"results": [f"loaded {len(state)} tensors from {path}"]}

    @app.get("/server_info")
    async def server_info(config_format: str = "text"):
        # vLLM's answer holds the whole VllmConfig (and more): only the field the engine reads
        model_config = {"logprobs_mode": app.state.logprobs_mode}
        config = {"model_config": model_config} if config_format == "json" else str(model_config)
        return {"vllm_config": config}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        if "/reset_prefix_cache" in app.state.fail_next:
            app.state.fail_next.discard("/reset_prefix_cache")
            return JSONResponse({"error": "prefix cache reset failed (injected)"}, 500)
        if scheduler["running"]:
            events.append(("reset_prefix_cache_refused", None))
            return {"success": False}
        cache.clear()
        events.append(("reset_prefix_cache", None))
        return Response(status_code=200) if app.state.empty_reset else {"success": True}


def eos_ids(model) -> set[int]:
    """The ids vLLM ends a generation at unless the request sets ``ignore_eos``: the model's
    EOS and those of its ``generation_config`` (an id or a list of ids each)."""
    ids = set()
    for eos in (model.config.eos_token_id, model.generation_config.eos_token_id):
        ids |= {eos} if isinstance(eos, int) else set(eos or ())
    return ids


@torch.no_grad()
def _next_logprobs(model, step_input: torch.Tensor, past, temperature: float, top_p: float):
    """One decode step (no await inside, so grad mode cannot leak between requests)."""
    out = model(input_ids=step_input, cache=past, use_cache=True)
    return sampling_logprobs(out.logits[0, -1], temperature, top_p), out.cache


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class StandinServer:
    """Runs the stand-in under uvicorn on 127.0.0.1 (``port``, a free one when 0) in the current
    event loop."""

    def __init__(
        self,
        model,
        model_name: str = "standin",
        max_model_len: int = 1024,
        max_num_seqs: int | None = None,
        dev_mode: bool = True,
        port: int = 0,
    ):
        self.app = create_standin_app(model, model_name, max_model_len, max_num_seqs, dev_mode)
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        self._task: asyncio.Task | None = None
        self.url = ""

    @property
    def events(self) -> list[tuple[str, Any]]:
        return self.app.state.events

    async def start(self) -> StandinServer:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
            self._task = None
