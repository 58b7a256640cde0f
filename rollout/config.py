"""Config models of the rollout package whose code imports torch: the engines, the
rollout service (its reward models) and the orchestrator (which drives the service).

Kept apart from that code so that a run config loads without torch and transformers
(seconds on every flow's start).
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rl.config import TorchDevice, TorchDtype
from rollout.engines.base import MIN_TEMPERATURE
from rollout.engines.vllm_engine import VLLMEngineConfig

_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*")
"""A DNS host name: dot-separated labels of letters, digits and inner hyphens."""

SEED_STRIDE = 1_000_003
"""Rollout ``n`` of an orchestrator seeded ``seed`` samples with seed ``seed * SEED_STRIDE + n``."""


class TorchEngineConfig(BaseModel):
    """Settings of one ``TorchEngine`` replica."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    device: TorchDevice = Field(
        "cpu",
        description="Torch device the model runs on (cpu, cuda, cuda:1 …); 'cuda' spreads a process's "
        "replicas over the visible GPUs, one each in turn.",
    )
    dtype: TorchDtype = Field("float32", description="Torch dtype of the weights.")
    max_batch: int = Field(64, ge=1, description="Most requests decoded together in one step.")
    kv_cache_bytes: int = Field(
        256 * 2**20, ge=0, description="Memory bound of the per-session KV cache kept between turns (LRU)."
    )
    max_prefill_tokens: int = Field(
        16384,
        ge=1,
        description="Most padded tokens (rows x longest context) in one batched prefill forward; "
        "a longer request is still prefilled, alone.",
    )


class EngineConfig(BaseModel):
    """Which inference engines serve the rollouts."""

    # its inputs may hold credentials: errors name the field, never the value
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", hide_input_in_errors=True)

    kind: Literal["torch", "vllm"] = Field(
        "torch", description="'torch': in-process TorchEngine; 'vllm': vLLM servers."
    )
    replicas: int = Field(1, ge=1, description="TorchEngine replicas in this process (torch kind).")
    torch: TorchEngineConfig = Field(default_factory=TorchEngineConfig, description="TorchEngine settings.")
    vllm: list[VLLMEngineConfig] = Field(
        default_factory=list, description="One entry per vLLM server replica (vllm kind)."
    )
    load_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Seconds a replica may take to load a weight version, waiting for its requests in "
        "flight included; one that takes longer has failed to load it (its worker's health check retries).",
    )

    @model_validator(mode="after")
    def _servers_for_vllm(self) -> EngineConfig:
        if self.kind == "vllm" and not self.vllm:
            raise ValueError("engine.kind is 'vllm' but engine.vllm lists no server")
        if self.kind == "vllm" and self.replicas != 1:
            # else ignored: the worker rolled out on the servers listed, however many were asked for
            raise ValueError(
                f"engine.replicas ({self.replicas}) counts TorchEngine replicas, and with engine.kind "
                f"'vllm' a worker runs one replica per server engine.vllm lists ({len(self.vllm)}): list "
                "a server for each replica, or leave engine.replicas at 1"
            )
        if self.kind == "torch" and self.vllm:
            # else the run rolled out on an in-process model, its servers idle, without a word
            count = len(self.vllm)
            raise ValueError(
                f"engine.kind is 'torch', so the {count} server{'s' * (count != 1)} engine.vllm lists "
                "would go unused: set engine.kind to 'vllm' to roll out on them, or empty engine.vllm"
            )
        return self

    @property
    def replica_count(self) -> int:
        """Engine replicas a rollout worker runs: its vLLM servers, or its TorchEngine replicas."""
        return len(self.vllm) if self.kind == "vllm" else self.replicas


class RewardModelConfig(BaseModel):
    """One reward-model service."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    path: str = Field(
        description="Local directory of a sequence-classification checkpoint with one label and its tokenizer."
    )
    max_tokens: int = Field(
        2048,
        ge=1,
        description="Longest input; a longer conversation keeps its last max_tokens tokens (fewer where the "
        "model has fewer positions: its max_position_embeddings).",
    )


class ServiceConfig(BaseModel):
    """Worker pools and limits of the rollout service."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    init_workers: int = Field(64, ge=1, description="Rollouts that may be in the INIT stage at once.")
    run_workers: int = Field(512, ge=1, description="Rollouts that may be in the RUN stage at once.")
    eval_workers: int = Field(64, ge=1, description="Rollouts that may be in the EVAL stage at once.")
    timeout_s: float = Field(
        300.0, gt=0, description="Seconds a rollout may spend in INIT+RUN+EVAL; queue time is not counted."
    )
    max_turns: int = Field(32, ge=1, description="Hard cap on actions per rollout, over the env's own limit.")
    max_new_tokens: int = Field(32, ge=1, description="Token budget of one action.")
    temperature: float = Field(
        1.0, ge=MIN_TEMPERATURE, allow_inf_nan=False, description="Sampling temperature (finite, >= 1e-5)."
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling threshold; a run config needs 1 (the trainer cannot reproduce "
        "log-probs renormalised over a nucleus).",
    )
    compact_at: int | None = Field(
        None,
        ge=1,
        description="Context management of the rollouts the service drives (not of an env that drives "
        "its own program): when a turn's prompt would hold more tokens than this, the turn goes on in a "
        "branch of the rollout's execution whose context is the task's first messages and the last "
        "compact_keep_turns turns. The branches are rows of one execution that share the first messages' "
        "tokens: the processor trains those once and at most processor.j_max rows. None: the context "
        "grows until gateway.max_context_tokens cuts the rollout short (truncated).",
    )
    compact_keep_turns: int = Field(
        1,
        ge=1,
        description="Turns (an action and the observation that answers it) a compacted context keeps, "
        "the latest one included.",
    )
    scheduler: Literal["action", "static", "none"] = Field(
        "action",
        description="Resources for tool calls and test runs: 'action' grants them per action "
        "(ARL-Tangram), 'static' reserves scheduler_static_cores per rollout for its whole life "
        "(the baseline), 'none' runs every action at once.",
    )
    scheduler_cores: int | None = Field(
        None, ge=1, description="CPU cores the scheduler hands out; default: the cores this process may use."
    )
    scheduler_static_cores: int = Field(
        1, ge=1, description="Cores a rollout reserves for its whole life in 'static' mode."
    )
    scheduler_pin: bool = Field(
        True,
        description="Pin the sandbox's processes to the cores granted to each action (CPU affinity); "
        "needs scheduler_cores <= the cores this process may use.",
    )
    loop_block_warn_s: float = Field(
        0.5,
        gt=0,
        description="Warn when an env's reset, step, evaluate, run or close holds the event loop this "
        "long without yielding (blocking work done inside async code: every other rollout, the gateway "
        "and the heartbeats wait meanwhile).",
    )
    reward_models: dict[str, RewardModelConfig] = Field(
        default_factory=dict,
        description="Reward-model services by name; an env whose config names one as reward_model is "
        "scored by it in EVAL. A run loads (and checks at its start) only those an env of its "
        "orchestrator.mix names.",
    )
    reward_slots: int = Field(
        1,
        ge=1,
        description="Reward-model calls that may run at once ('action' scheduler; 'static' pins every "
        "model on the device and runs calls as they come).",
    )
    reward_device: TorchDevice | None = Field(
        None, description="Device reward models run on for a call; default: CUDA when available, else CPU."
    )
    reward_budget_mb: float | None = Field(
        None,
        gt=0,
        description="Device memory the resident reward models may hold ('action' scheduler); the least "
        "recently used idle one is evicted to make room. Default: the free GPU memory, or all "
        "models on CPU.",
    )

    @model_validator(mode="after")
    def _reservation_fits(self) -> ServiceConfig:
        # else the rollout service refused it as it started: at the first evaluation, after the warm start
        if (
            self.scheduler == "static"
            and self.scheduler_cores is not None
            and self.scheduler_static_cores > self.scheduler_cores
        ):
            raise ValueError(
                f"scheduler_static_cores ({self.scheduler_static_cores}) exceeds scheduler_cores "
                f"({self.scheduler_cores}): no rollout could reserve its cores"
            )
        return self


class OrchestratorConfig(BaseModel):
    """How many rollouts run at once, on which tasks, and when to stop."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    mix: dict[str, float] = Field(
        default_factory=lambda: {"arith": 1.0}, description="Target share of rollouts per task (normalised)."
    )
    concurrency: int = Field(64, ge=1, description="Rollouts in flight at once.")
    group_size: int = Field(1, ge=1, description="Rollouts per prompt: 1 for SAO, n for GRPO group mode.")
    filter_uniform_groups: bool = Field(
        True,
        description="Group mode: drop groups whose rewards, as the trainer trains them (lifted by partial "
        "progress), are all equal (DAPO dynamic sampling).",
    )
    target_groups: int | None = Field(
        None,
        ge=1,
        description="Group mode (group_size > 1 only): stop (cancelling redundant rollouts) after this "
        "many kept groups. Single rollouts form no groups: stop those with max_rollouts.",
    )
    max_rollouts: int | None = Field(
        None,
        ge=1,
        description="Finish at most this many rollouts: a rollout worker counts them over the whole run "
        "(all its workers and their restarts, through the run's storage).",
    )
    max_backlog: int = Field(
        8, ge=1, description="Pause launching while more shards than this await the trainer."
    )
    max_trainer_batches: float | None = Field(
        2.0,
        ge=1,
        description="Pause launching while the trainer holds more than this many policy steps' worth of "
        "data it has not trained (its published queue); at least 1, so the trainer always has a full "
        "batch to step on while rollouts wait. None: off.",
    )
    backpressure_poll_s: float = Field(0.2, gt=0, description="Seconds between backlog checks while paused.")
    seed: int = Field(
        0,
        ge=-(2**63 // SEED_STRIDE),
        le=(2**63 - 1) // SEED_STRIDE,
        description="Base of the per-rollout sampling seeds: rollout n samples with seed * 1_000_003 + n "
        "(its turn t with a hash of that and t: rollout.service.turn_seed); bounded so that these stay "
        "signed 64-bit integers. A rollout worker first makes it its own, hashed with its name "
        "(rollout.worker.worker_seed).",
    )

    @field_validator("mix")
    @classmethod
    def _valid_mix(cls, mix: dict[str, float]) -> dict[str, float]:
        if not mix or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
            raise ValueError("mix needs at least one task and non-negative weights with a positive sum")
        return mix

    @model_validator(mode="after")
    def _groups_fit(self) -> OrchestratorConfig:
        # a group launches whole: one that cannot fit would launch nothing, silently
        if self.group_size > self.concurrency:
            raise ValueError(
                f"group_size ({self.group_size}) exceeds concurrency ({self.concurrency}): no group could launch"
            )
        if self.max_rollouts is not None and self.max_rollouts < self.group_size:
            raise ValueError(
                f"max_rollouts ({self.max_rollouts}) is below group_size ({self.group_size}): no group could launch"
            )
        if self.target_groups is not None and self.group_size == 1:
            raise ValueError(
                "target_groups counts the groups of group mode (group_size > 1); single rollouts form none, "
                "so it would never stop the run: stop after a number of rollouts with max_rollouts"
            )
        return self


class GatewayHTTPConfig(BaseModel):
    """The gateway's HTTP API (``rollout.gateway_http``) that a rollout worker serves to agent
    harnesses outside the run, and the raw shards it writes their records into."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="TCP port each rollout worker serves the API on, for its life (0: a free one; the "
        "worker logs its URL). None: not served.",
    )
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address it listens on: loopback only by default; 0.0.0.0 for every interface (plain "
        "HTTP: put TLS in front of it beyond a trusted network).",
    )
    token_env: str = Field(
        "TREADLE_GATEWAY_TOKEN",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding the bearer token every request but /health must carry; "
        "a worker serving the API refuses to start while it is unset or empty.",
    )
    idle_timeout_s: float | None = Field(
        1800.0,
        gt=0,
        description="A session opened over HTTP with no request for this many seconds is ended "
        "unrecorded (a crashed harness's); None: never.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="Seconds a stopping worker lets the harness requests in flight finish before it "
        "answers them 503 (cuts a streamed answer off) and goes on stopping; keep it under the supervisor's grace period "
        "(Kubernetes' terminationGracePeriodSeconds, docker stop's --time) with room for the "
        "worker's last commit.",
    )
    read_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a harness has to send a request, head and body, once it began it; one still "
        "sending then is disconnected (a stalled or hostile client holds no connection for ever). Raise it "
        "for harnesses that write large records over a slow link.",
    )
    max_connections: int | None = Field(
        None,
        ge=1,
        description="Most connections the API holds open at once; one past it is closed as soon as it is "
        "accepted (harnesses see a dropped connection). Keep it above the harnesses' concurrent requests, "
        "and below the worker's file-descriptor limit when the API is reachable beyond a trusted network. "
        "None: no bound.",
    )
    serve_only: bool = Field(
        False,
        description="The worker runs none of its own rollouts (orchestrator.mix): it serves the API and "
        "loads each new weight version until the deadline or a stop. Needs port.",
    )

    @field_validator("host")
    @classmethod
    def _host_is_an_address(cls, value: str) -> str:
        # else the worker failed as it started serving, after the warm start, with a traceback
        try:
            ipaddress.ip_address(value)
        except ValueError:
            if not _HOST_NAME.fullmatch(value):
                raise ValueError(
                    "must be an IP address or a host name to listen on (127.0.0.1, 0.0.0.0, ::, "
                    "localhost), without a scheme or a port (that is gateway_http.port)"
                ) from None
        return value

    @model_validator(mode="after")
    def _serving(self) -> GatewayHTTPConfig:
        if self.serve_only and self.port is None:
            raise ValueError("serve_only without port: the worker would neither roll out nor serve; set port")
        return self

    def token(self) -> str:
        """The bearer token, from the environment variable ``token_env``, without the whitespace
        around it (a secret file's last newline: an HTTP header cannot carry it, so no request
        would match); ``ValueError`` when it is unset or blank."""
        token = os.environ.get(self.token_env, "")
        if not token.strip():
            raise ValueError(
                f"gateway_http.port is set, so the worker serves the gateway, but environment variable "
                f"{self.token_env} (gateway_http.token_env), its bearer token, is "
                f"{'empty' if self.token_env in os.environ else 'unset'}: set it to the token harnesses send"
            )
        return token.strip()
