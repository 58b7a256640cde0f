"""A token-level client of a vLLM server running as its own process and environment.

vLLM cannot share an environment with Prefect, so it runs from ``deployments/vllm/``
(launch command there) and this client speaks to it over HTTP (or a Unix socket):

- generation: ``POST /v1/completions`` with the prompt as a list of token ids,
  ``logprobs=1`` and ``return_tokens_as_token_ids``/``return_token_ids`` so the new tokens
  come back as ids with the log-prob of each chosen token. The server must run with
  ``--logprobs-mode processed_logprobs`` so those log-probs are of the distribution
  actually sampled from (after temperature and top-p), as the Engine protocol requires.
  Sampling fields the model's ``generation_config`` could override (top-k, min-p,
  penalties) are sent explicitly as neutral values. ``stop_ids`` go as ``stop_token_ids``
  with ``ignore_eos``, so that they alone end a generation, as ``SamplingParams`` says.
  ``max_tokens`` is ``max_new_tokens`` clamped to the room the prompt leaves in the
  server's ``max_model_len`` (listed by ``GET /v1/models``), as TorchEngine clamps to the
  model's positions. vLLM samples a temperature below :data:`VLLM_MIN_TEMPERATURE` at that
  floor, and reports the log-probs of that: an evaluation's near-greedy one is served so, and a
  run's ``service.temperature`` (whose log-probs are trained on) below it is refused by the run's
  config. A server refusing a request past its context (its ``max_model_len`` changed since it
  was read) is a ``ContextLimit``. The served model's name and length are read again after a
  404 (a server relaunched under another name) or a restart the health check finds.
- weight reload (dev mode, ``VLLM_SERVER_DEV_MODE=1``): ``GET /server_info`` first, refused
  when it names a ``--logprobs-mode`` other than ``processed_logprobs``; ``POST /collective_rpc`` calling
  the worker extension ``treadle_reload_weights(path)`` of
  ``deployments/vllm/treadle_vllm_ext.py``, then ``POST /reset_prefix_cache`` so no cached
  block computed by the old weights is reused; vLLM refuses that reset (``{"success": false}``)
  while blocks are held, e.g. by a request whose client gave up but which it has not aborted
  yet, so it is retried for up to ``reset_wait_s``. A server started without dev mode answers
  404 there: an ``EngineError`` naming the setting. vLLM answers any failure of the call
  with a bare 500, one without the worker extension too: its ``EngineError`` names how
  ``deployments/vllm/launch.sh`` loads the extension.
- ``GET /health`` for health checks; ``GET /metrics`` (Prometheus text) for the
  scheduler's ``vllm:num_requests_waiting`` gauge, the engine's queue depth, and for the
  server process's ``process_start_time_seconds``, by which a health check finds a server
  restarted since its weights were loaded (it serves its launch weights again).

Version tags are exact: a reload waits for in-flight requests to finish and holds new ones
back until the new weights are loaded, so every token of a request comes from one version.
A reload that fails once the server may have begun loading leaves the weights unknown: the
engine's version is then :data:`UNKNOWN_VERSION` and it refuses to generate (``NotServing``,
which a router takes it out of service on) until a reload succeeds (the worker's health
check reloads it); so does a health check finding the server restarted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import urllib.parse
import uuid
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic.json_schema import SkipJsonSchema

from rollout.engines.base import (
    ContextLimit,
    EngineError,
    EngineStats,
    Generation,
    InvalidRequest,
    NotServing,
    SamplingParams,
)
from storage.config import is_http_url, not_masked

logger = logging.getLogger(__name__)

UNKNOWN_VERSION = -1
"""``VLLMEngine.version`` while the server's weights are unknown (a reload failed midway, or a
health check found the server restarted)."""

WAITING_GAUGE = "vllm:num_requests_waiting"
"""The server's gauge of requests its scheduler holds waiting for room (batch slots or KV
cache), summed over its label sets (one per engine core)."""
_WAITING_SAMPLE = re.compile(rf"^{re.escape(WAITING_GAUGE)}(?:\{{[^}}]*\}})?\s+(\S+)", re.MULTILINE)

_PROCESS_START = re.compile(r"^process_start_time_seconds\s+(\S+)", re.MULTILINE)
"""The start time of the server's process in its ``/metrics`` (prometheus_client's process
collector, in vLLM's registry unless it runs several API server processes): a new one is a
restarted server."""

_RESET_RETRY_S = 0.05
"""Seconds between tries of a prefix-cache reset the server refused."""

VLLM_MIN_TEMPERATURE = 1e-2
"""The smallest temperature vLLM samples at: it raises one in (0, 0.01) to 0.01
(``_MAX_TEMP`` in ``vllm/sampling_params.py``), so the log-probs it returns are of another
distribution than the one asked for."""

_TOO_LONG = ("context length", "maximum model length", "cannot be greater than max_model_len")
"""vLLM's words refusing a request past its ``max_model_len``: "...the model's context length is
only N tokens..." (``vllm/renderers/params.py``; "This model's maximum context length is" before),
"...longer than the maximum model length of N" (its engine core), "max_tokens=M cannot be greater
than max_model_len" (``max_tokens`` alone past it)."""

_DEV_MODE_PATHS = ("/collective_rpc", "/reset_prefix_cache")
"""Endpoints a vLLM server serves only when started with ``VLLM_SERVER_DEV_MODE=1``."""

_BROKEN = (httpx.ConnectError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError)
"""A connection that broke before any answer: a pooled keep-alive connection the server closed
meanwhile (closed or reset as the request reached it), or a server restarting. Sending again is
safe for every request this engine sends, even one the server may have run before the connection
broke (a read error after the request went out): a generation only costs its compute again, a
prefix-cache reset resets an empty cache, and a weight reload loads the same files again, after
the first (vLLM runs ``collective_rpc`` calls one at a time). A timeout is not retried."""

_WRONG_SHAPE = (AttributeError, KeyError, IndexError, TypeError, ValueError, OverflowError)
"""What reading the fields of a JSON answer of another shape raises (``int`` of ``1e999`` raises
``OverflowError``): an ``EngineError``, as the infrastructure failing."""


class VLLMEngineConfig(BaseModel):
    """Where the vLLM server is and how to talk to it."""

    # its inputs may hold credentials: errors name the field, never the value
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", hide_input_in_errors=True)

    base_url: str = Field("http://127.0.0.1:8000", description="Server URL (ignored host when uds is set).")
    uds: str | None = Field(None, description="Unix domain socket of the server (vllm serve --uds).")
    model: str | None = Field(None, description="Served model name; asked from /v1/models when left out.")
    # Left out of the form, and of a dump while unset, as storage's credentials are: Prefect
    # stores a SecretStr parameter as MASKED and hands that back to the run.
    api_key: SkipJsonSchema[SecretStr | None] = Field(
        None,
        description="Bearer token of the server (vllm serve --api-key); defaults to VLLM_API_KEY.",
        exclude_if=lambda value: value is None,
    )
    timeout_s: float = Field(600.0, gt=0, description="Seconds one generation request may take.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Seconds to wait for a connection.")
    max_connections: int = Field(256, ge=1, description="Concurrent HTTP connections to the server.")
    keepalive_s: float = Field(
        2.0, gt=0, description="Seconds an idle connection is reused; below the server's keep-alive (5 s)."
    )
    retries: int = Field(
        1,
        ge=0,
        description="Retries of a request whose connection broke before any answer (stale keep-alive).",
    )
    reload_method: str = Field(
        "treadle_reload_weights", description="Worker-extension method that loads a weight directory."
    )
    reset_wait_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a reload retries the prefix-cache reset that vLLM refuses while blocks are held.",
    )

    @field_validator("base_url")
    @classmethod
    def _base_url_is_an_http_url_without_credentials(cls, value: str) -> str:
        # httpx would send them as basic auth, but the URL is a plain flow parameter, which
        # the Prefect API keeps as sent for every reader and the UI to see
        parts = urllib.parse.urlsplit(value)
        if "@" in parts.netloc:
            raise ValueError(
                "base_url holds credentials (user:password@); give the server's key as api_key "
                "or as VLLM_API_KEY in the worker's environment"
            )
        # httpx cannot send to one (127.0.0.1:8000 has no scheme): the worker found that out
        # after the warm start; not echoed, as a scheme-less one may hold credentials unnoticed above
        if not is_http_url(value):
            raise ValueError(
                "base_url must be an http:// or https:// URL with a host and an optional port, "
                "e.g. http://127.0.0.1:8000"
            )
        return value

    @field_validator("api_key")
    @classmethod
    def _not_masked(cls, value: SecretStr | None) -> SecretStr | None:
        return not_masked(value, what="a token", env="VLLM_API_KEY")


class VLLMEngine:
    """Engine protocol over a vLLM server; see the module docstring for the endpoints used."""

    def __init__(self, config: VLLMEngineConfig | None = None, *, name: str | None = None, version: int = 0):
        self.config = config or VLLMEngineConfig()
        self.name = name or (f"vllm@{self.config.uds}" if self.config.uds else f"vllm@{self.config.base_url}")
        self.version = version
        headers = {}
        api_key = (
            self.config.api_key.get_secret_value() if self.config.api_key else os.environ.get("VLLM_API_KEY")
        )
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        transport = httpx.AsyncHTTPTransport(
            uds=self.config.uds,
            limits=httpx.Limits(
                max_connections=self.config.max_connections, keepalive_expiry=self.config.keepalive_s
            ),
        )
        base_url = "http://vllm" if self.config.uds else self.config.base_url
        self._client = httpx.AsyncClient(
            base_url=base_url,
            transport=transport,
            headers=headers,
            timeout=httpx.Timeout(self.config.timeout_s, connect=self.config.connect_timeout_s),
        )
        # stats() is synchronous (callers run it off their event loop), so it has a client of its own
        self._metrics_client = httpx.Client(
            base_url=base_url,
            transport=httpx.HTTPTransport(
                uds=self.config.uds, limits=httpx.Limits(keepalive_expiry=self.config.keepalive_s)
            ),
            headers=headers,
            timeout=self.config.connect_timeout_s,
        )
        self._metrics_failing = False
        self._model = self.config.model
        self._max_model_len: int | None = None
        """The server's ``max_model_len``, 0 when it lists none; None until asked."""
        self._stats = EngineStats()
        self._inflight = 0
        self._held = 0
        """Requests waiting here for a weight reload to end."""
        self._gate = asyncio.Condition()
        self._reloading = False
        self._server_start: float | None = None
        """The start time of the server process that ``version`` was loaded onto (or first
        probed, for a version given at construction); None while unread."""

    async def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One request, retried ``retries`` times while its connection breaks before any answer."""
        if self._client.is_closed:  # httpx would raise a RuntimeError, which no caller fails over on
            raise EngineError(f"vLLM engine {self.name} is closed")
        for attempt in range(self.config.retries + 1):
            try:
                response = await self._client.request(method, path, **kwargs)
                break
            except httpx.HTTPError as exc:
                broken = isinstance(exc, _BROKEN)
                if broken and attempt < self.config.retries:
                    logger.info("vLLM server %s: %s on %s, retrying", self.name, type(exc).__name__, path)
                    continue
                if isinstance(exc, httpx.ReadTimeout | httpx.WriteTimeout):
                    # the server was reached: a busy or stuck one, not a network fault
                    setting = "connect_timeout_s" if "timeout" in kwargs else "timeout_s"
                    raise EngineError(
                        f"vLLM server {self.name} did not answer {path} within "
                        f"{getattr(self.config, setting):g} s ({setting}): "
                        f"{type(exc).__name__}; it may still be running the request"
                    ) from exc
                raise EngineError(
                    f"vLLM server {self.name} unreachable on {path}: {type(exc).__name__}: {exc}"
                ) from exc
        if response.status_code == 400 or response.status_code == 422:
            message = _error_message(response)
            if any(words in message for words in _TOO_LONG):
                # the max_model_len read from /v1/models is stale (a server restarted with another
                # --max-model-len): the next request reads it again and is clamped to it
                self._max_model_len = None
                raise ContextLimit(f"vLLM server {self.name} rejected the request: {message}")
            raise InvalidRequest(f"vLLM server {self.name} rejected the request: {message}")
        if response.status_code == 404 and path == "/v1/completions":
            # vLLM's answer to a model it does not serve: the server was relaunched under another
            # name (launch.sh names it by its MODEL_DIR); the next request reads it again
            self._forget_served_model()
        if response.status_code == 404 and path in _DEV_MODE_PATHS:
            raise EngineError(
                f"vLLM server {self.name} has no {path} (404): start it with VLLM_SERVER_DEV_MODE=1 in its "
                "environment, as deployments/vllm/launch.sh does"
            )
        if response.status_code >= 500 and path == "/collective_rpc":
            # vLLM answers every failure of the call alike, whatever its cause, with a bare 500
            # (the method missing from its workers too)
            raise EngineError(
                f"vLLM server {self.name} answered {response.status_code} on {path}: {_error_message(response)}; "
                "its log has the cause. A server without treadle's worker extension answers so to "
                f"{self.config.reload_method}: deployments/vllm/launch.sh loads it with --worker-extension-cls "
                "treadle_vllm_ext.WeightReloadExtension and deployments/vllm on PYTHONPATH"
            )
        if response.status_code >= 300:
            raise EngineError(
                f"vLLM server {self.name} answered {response.status_code} on {path}: {_error_message(response)}"
            )
        return response

    async def _json(self, method: str, path: str, *, empty_ok: bool = False, **kwargs) -> Any:
        """The answer of :meth:`_request` parsed as JSON; one that is not (a page of a proxy in
        front of the server) is an ``EngineError``, as the infrastructure failing. With
        ``empty_ok``, an empty body is None."""
        response = await self._request(method, path, **kwargs)
        if empty_ok and not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(
                f"vLLM server {self.name} answered {response.status_code} with a body that is not JSON on "
                f"{path}: {response.text[:200]!r}"
            ) from exc

    async def _served_model(self) -> tuple[str, int | None]:
        """The served model's name and its ``max_model_len`` (None when the server lists none),
        asked from ``GET /v1/models`` once."""
        if self._max_model_len is None:
            data = await self._json("GET", "/v1/models")
            try:
                cards = data["data"]
                card = next(c for c in cards if c["id"] == self._model) if self._model else cards[0]
                length = card.get("max_model_len")
                max_model_len = int(length) if length is not None else 0
                if not isinstance(card["id"], str) or max_model_len < 0:
                    raise ValueError("a model card of another shape")
            except (*_WRONG_SHAPE, StopIteration) as exc:
                what = f"model {self._model!r}" if self._model else "model"
                raise EngineError(
                    f"vLLM server {self.name} lists no {what} on /v1/models: {data!r:.200}"
                ) from exc
            self._max_model_len = max_model_len
            self._model = card["id"]
        return self._model, self._max_model_len or None

    def _forget_served_model(self) -> None:
        """Have the next request read the served model's name and length from /v1/models again."""
        self._model, self._max_model_len = self.config.model, None

    async def max_model_len(self) -> int | None:
        """The server's context length in tokens (prompt and generation), None when unknown."""
        return (await self._served_model())[1]

    async def generate(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Generate from ``prompt_ids``; see the module docstring for what is sent."""
        if not prompt_ids:
            raise InvalidRequest("empty prompt")
        seed = _signed_seed(params.seed)
        async with self._gate:
            self._held += 1
            try:
                await self._gate.wait_for(lambda: not self._reloading)
            finally:
                self._held -= 1
            if self.version == UNKNOWN_VERSION:
                raise NotServing(
                    f"vLLM server {self.name} holds weights of an unknown version (a reload failed midway, "
                    "or the server restarted); it generates again once a reload succeeds"
                )
            self._inflight += 1
            version = self.version
        try:
            model, max_model_len = await self._served_model()
            max_tokens = params.max_new_tokens
            if max_model_len is not None:
                # as TorchEngine: a generation stops where the context ends (finish "length")
                # rather than the server refusing a request whose max_tokens do not all fit
                if len(prompt_ids) >= max_model_len:
                    raise ContextLimit(
                        f"prompt has {len(prompt_ids)} tokens, leaving no room to generate in vLLM server "
                        f"{self.name}'s max_model_len={max_model_len}"
                    )
                max_tokens = min(max_tokens, max_model_len - len(prompt_ids))
            body = {
                "model": model,
                "prompt": list(prompt_ids),
                "max_tokens": max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": -1,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "seed": seed,
                "stop_token_ids": list(params.stop_ids),
                "ignore_eos": True,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
                "return_token_ids": True,
                "skip_special_tokens": False,
                "user": session_id,
            }
            # a header takes ASCII only, and a line break in one would end it
            headers = {"X-Request-Id": f"{urllib.parse.quote(session_id, safe='')}-{uuid.uuid4().hex[:8]}"}
            data = await self._json("POST", "/v1/completions", json=body, headers=headers)
        finally:
            async with self._gate:
                self._inflight -= 1
                self._gate.notify_all()
        generation = _parse_completion(data, self.name, version)
        last = generation.token_ids[-1] if generation.token_ids else None
        if generation.finish_reason == "length" and last in params.stop_ids:
            # vLLM versions whose check_stop tests the length cap before the stop ids answer
            # "length" for a stop token sampled last: the action ended at it (TorchEngine's "stop")
            generation.finish_reason = "stop"
        cached = generation.cached_tokens
        self._stats.requests += 1
        self._stats.prefill_computed += generation.prompt_tokens - cached
        self._stats.prefill_reused += cached
        self._stats.decode_tokens += len(generation.token_ids)
        return generation

    async def load_version(self, version: int, path: str) -> None:
        """Drain in-flight requests, load the weights in ``path`` (a directory the server can
        read), reset the prefix cache, then let requests through tagged ``version``. When the
        load or the reset fails, the version is :data:`UNKNOWN_VERSION` until a load succeeds."""
        async with self._gate:
            self._reloading = True
        try:
            async with self._gate:
                await self._gate.wait_for(lambda: self._inflight == 0)
            await self._check_logprobs_mode()
            # from here on the server may hold some of the new weights: no token may carry
            # the old tag until this load has finished
            self.version = UNKNOWN_VERSION
            # read before the load: a restart after this reading is found by the next probe,
            # even one that came after the load
            self._server_start = await self._server_start_time()
            await self._request(
                "POST",
                "/collective_rpc",
                json={"method": self.config.reload_method, "kwargs": {"path": str(path)}},
            )
            await self._reset_prefix_cache()
            self.version = version
            self._stats.extra["reloads"] = self._stats.extra.get("reloads", 0.0) + 1
            logger.info("%s loaded weight version %d from %s", self.name, version, path)
        finally:
            async with self._gate:
                self._reloading = False
                self._gate.notify_all()

    async def _check_logprobs_mode(self) -> None:
        """Refuse a server whose ``GET /server_info`` (dev mode) names a ``--logprobs-mode`` other
        than ``processed_logprobs``: vLLM's default, ``raw_logprobs``, returns log-probs before
        temperature and top-p, wrong for training though nothing else tells. A server that names
        none (no such endpoint or field) is taken as it is."""
        try:
            info = await self._json("GET", "/server_info", params={"config_format": "json"})
            mode = info["vllm_config"]["model_config"]["logprobs_mode"]
        except (EngineError, InvalidRequest, *_WRONG_SHAPE):
            return
        if mode != "processed_logprobs":
            raise EngineError(
                f"vLLM server {self.name} runs with --logprobs-mode {mode}: its log-probs are not those of the "
                "distribution it samples from, which training needs; start it with --logprobs-mode "
                "processed_logprobs, as deployments/vllm/launch.sh does"
            )

    async def _reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache`` until the server says it reset, for up to ``reset_wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.reset_wait_s
        while True:
            # vLLM answers {"success": bool}; older versions answered an empty 200 whether or not
            # it reset
            reset = await self._json("POST", "/reset_prefix_cache", empty_ok=True)
            try:
                success = reset is None or reset.get("success", True)
            except _WRONG_SHAPE as exc:
                raise EngineError(
                    f"vLLM server {self.name} answered JSON of another shape on /reset_prefix_cache: "
                    f"{reset!r:.200}"
                ) from exc
            if success:
                return
            if loop.time() >= deadline:
                raise EngineError(
                    f"vLLM server {self.name} could not reset its prefix cache within "
                    f"{self.config.reset_wait_s:g} s (blocks still held by a running request)"
                )
            await asyncio.sleep(_RESET_RETRY_S)

    def end_session(self, session_id: str) -> None:
        """Nothing to do: vLLM's prefix cache is shared and content-addressed."""

    def stats(self) -> EngineStats:
        """Counters of this client; ``queue_depth`` is the requests waiting for room: held by
        the server's scheduler (:data:`WAITING_GAUGE`), held here while a reload runs, and
        waiting here for one of the ``max_connections`` (unseen by the server), not the ones
        generating (``extra["in_flight"]`` counts every request sent and not yet
        answered; ``extra["queue_read"]`` is 0 when the server's gauge could not be read).
        Asks the server's ``/metrics``, so it may take up to ``connect_timeout_s``: call it off
        the event loop."""
        return EngineStats(
            prefill_computed=self._stats.prefill_computed,
            prefill_reused=self._stats.prefill_reused,
            decode_tokens=self._stats.decode_tokens,
            queue_depth=self._held
            + max(0, self._inflight - self.config.max_connections)
            + self._server_waiting(),
            requests=self._stats.requests,
            extra=dict(self._stats.extra)
            | {"in_flight": float(self._inflight), "queue_read": float(not self._metrics_failing)},
        )

    def _server_waiting(self) -> int:
        """The server's :data:`WAITING_GAUGE`; 0, with a warning when it starts failing, when
        it cannot be read (the elastic controller then sees no queue on this replica)."""
        if self._metrics_client.is_closed:
            return 0
        try:
            response = self._get_metrics()
            samples = _WAITING_SAMPLE.findall(response.text) if response.status_code == 200 else []
            if not samples:
                raise ValueError(f"answered {response.status_code} without a {WAITING_GAUGE} sample")
            waiting = round(sum(float(sample) for sample in samples))
        except (httpx.HTTPError, ValueError) as exc:
            if not self._metrics_failing:
                logger.warning(
                    "vLLM server %s: cannot read its queue from /metrics (%s); counting 0 waiting requests",
                    self.name,
                    exc,
                )
            self._metrics_failing = True
            return 0
        self._metrics_failing = False
        return waiting

    def _get_metrics(self) -> httpx.Response:
        """``GET /metrics``, retried ``retries`` times while its connection breaks before any
        answer (a keep-alive connection the server closed meanwhile), as :meth:`_request`."""
        for _ in range(self.config.retries):
            try:
                return self._metrics_client.get("/metrics")
            except _BROKEN as exc:
                logger.info("vLLM server %s: %s on /metrics, retrying", self.name, type(exc).__name__)
        return self._metrics_client.get("/metrics")

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 (False once this engine is closed); sent as
        :meth:`_request` sends, so a keep-alive connection the server closed meanwhile does not
        take a healthy replica out of service.

        A server whose process started since its weights were loaded (a relaunched server,
        serving its launch weights) is up, but its version is then :data:`UNKNOWN_VERSION`:
        it refuses to generate until a reload (the worker's health check) loads the weights
        again. A server without a :data:`_PROCESS_START` sample in ``/metrics`` cannot be
        told restarted."""
        if self._client.is_closed:
            return False
        try:
            response = await self._request("GET", "/health", timeout=self.config.connect_timeout_s)
        except (EngineError, InvalidRequest):
            return False
        if response.status_code != 200:
            return False
        known = self._server_start
        started = await self._server_start_time()
        # a reload begun or ended meanwhile reads the start time for its own version
        if started is None or self._reloading or self._server_start != known:
            return True
        if known is None:
            self._server_start = started
        elif started != known:
            self._server_start = started
            self._forget_served_model()  # a relaunch may serve it under another name and length
            if self.version != UNKNOWN_VERSION:
                logger.warning(
                    "vLLM server %s restarted since it loaded weight version %d: it serves its launch "
                    "weights until they are loaded again",
                    self.name,
                    self.version,
                )
                self.version = UNKNOWN_VERSION
        return True

    async def _server_start_time(self) -> float | None:
        """The :data:`_PROCESS_START` of the server's ``/metrics``; None when it lists none or
        cannot be read."""
        try:
            response = await self._request("GET", "/metrics", timeout=self.config.connect_timeout_s)
            sample = _PROCESS_START.search(response.text)
            return float(sample.group(1)) if sample else None
        except (EngineError, InvalidRequest, ValueError):
            return None

    async def close(self) -> None:
        await self._client.aclose()
        self._metrics_client.close()


def _signed_seed(seed: int | None) -> int | None:
    """``seed`` as the signed 64-bit integer vLLM takes: a seed in [2**63, 2**64) as the one
    with the same 64 bits, which ``torch.Generator.manual_seed`` (vLLM's and TorchEngine's)
    reads alike. The one whose bits are -1 is refused: vLLM's ``SamplingParams`` takes a seed
    of -1 as no seed (``vllm/sampling_params.py``) and would sample at random."""
    signed = seed - 2**64 if seed is not None and seed >= 2**63 else seed
    if signed == -1:
        raise InvalidRequest(f"seed {seed} is -1 to vLLM, which takes it as no seed: give another seed")
    return signed


def _error_message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key])
    return str(data)[:500]


def _parse_completion(data: Any, name: str, version: int) -> Generation:
    """The generation in a ``/v1/completions`` answer; an answer of another shape (a proxy's,
    or one without the token ids and log-probs asked for) is an ``EngineError``."""
    try:
        choice = data["choices"][0]
        logprobs = choice["logprobs"]
        token_logprobs = [float(x) for x in logprobs["token_logprobs"]]
        token_ids = choice.get("token_ids")
        if token_ids is None:
            token_ids = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
        token_ids = [int(t) for t in token_ids]
        reason = choice.get("finish_reason")
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        cached_tokens = int(details.get("cached_tokens") or 0)
    except _WRONG_SHAPE as exc:
        raise EngineError(
            f"vLLM server {name} answered a completion of another shape on /v1/completions: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if len(token_ids) != len(token_logprobs):
        raise EngineError(
            f"vLLM server {name} sent {len(token_ids)} tokens but {len(token_logprobs)} log-probs"
        )
    return Generation(
        token_ids=token_ids,
        logprobs=token_logprobs,
        versions=[version] * len(token_ids),
        finish_reason=reason if reason in ("stop", "length") else "abort",
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        engine=name,
    )
