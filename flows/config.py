"""``RunConfig``: the run config that every flow and deployment takes.

It composes each package's own config model; the Prefect UI renders it as the form of
every deployment. Load one from YAML with :func:`load_config`; a bad value fails with a
message that names the field.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import math
import os
import re
import socket
import tempfile
import types
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from envs.agent import AgentConfig
from envs.arith import ArithConfig
from envs.base import EnvConfig, Split, TooFewTasks
from envs.code import CodeConfig
from envs.dataset import DatasetConfig
from envs.guess import GuessConfig
from envs.pytool import PyToolConfig
from envs.registry import REGISTRY, env_class, make_config, task_set
from envs.shell_env import ShellConfig
from rl.config import SAOConfig, SFTConfig, TinyModelConfig, TorchDevice
from rl.processor import ProcessorConfig
from rollout.config import EngineConfig, GatewayHTTPConfig, OrchestratorConfig, ServiceConfig
from rollout.elastic import ElasticConfig
from rollout.engines.base import MIN_TEMPERATURE
from rollout.engines.vllm_engine import VLLM_MIN_TEMPERATURE
from rollout.gateway import GatewayConfig
from storage.config import RUN_ID_PATTERN, StorageConfig, run_id_problem


class ConfigError(ValueError):
    """A run config that does not load; the message names the field."""


class ModelConfig(BaseModel):
    """Which policy the run starts from."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    path: str | None = Field(
        None,
        description="Local directory of a Hugging Face checkpoint, or a Hugging Face Hub model id "
        "(Qwen/Qwen3-0.6B); None builds the embedded tiny model.",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="The embedded tiny model.")


class WarmStartConfig(BaseModel):
    """Supervised warm start on the environments' scripted demonstrations, before RL."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    enabled: bool = Field(
        True, description="Warm-start version 0 on demonstrations when the run has no weights."
    )
    demos_per_env: int = Field(
        2000,
        ge=1,
        description="Demonstrations per environment in the mix; a new run asking one for more than its "
        "train split holds distinct tasks (code's 327) is refused at its start.",
    )
    demos: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        description="Demonstrations of particular environments, overriding demos_per_env (e.g. fewer "
        "of a multi-turn env whose demonstrations are long; 0 for one with no scripted solver, like agent).",
    )
    flawed: bool = Field(
        True, description="Use each env's flawed demonstrator, so RL has something left to learn."
    )
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Optimizer settings of the warm start.")

    def count(self, env: str) -> int:
        """Demonstrations of ``env``: ``demos[env]``, else ``demos_per_env``."""
        return self.demos.get(env, self.demos_per_env)


class ElasticRunConfig(ElasticConfig):
    """The trainer's elastic controller, which lends rollout workers' engine replicas to
    training and hands them back."""

    model_config = ConfigDict(extra="forbid")

    sessions_per_replica: int | None = Field(
        None,
        ge=1,
        description="Concurrent rollout sessions one replica serves (its session slots); "
        "None: a replica's share of orchestrator.concurrency.",
    )
    min_train: int = Field(
        1,
        ge=1,
        le=1,
        description="Training units never handed to rollout: the trainer's own unit (a run's trainer has one).",
    )


class EvalConfig(BaseModel):
    """Held-out evaluation of a weight version."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    tasks_per_env: int = Field(
        100,
        ge=1,
        description="Held-out tasks per environment, each problem once (fewer where the split holds fewer).",
    )
    temperature: float = Field(
        1e-3,
        ge=MIN_TEMPERATURE,
        allow_inf_nan=False,
        description="Sampling temperature (near-greedy by default; finite, >= 1e-5).",
    )
    seed: int = Field(
        1234,
        description="Seed of the eval task set and of its sampling (an env's rollout i samples with seed "
        "seed * SEED_STRIDE + i, as an orchestrator's do, whatever the other envs evaluated).",
    )


class StopConfig(BaseModel):
    """When the long-lived flows end."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    max_seconds: float | None = Field(
        120.0,
        gt=0,
        description="Wall-clock budget of rollout and training, counted from when the rollout worker is up "
        "(its engines loaded and, on Ray, its env actors started): a start-up, a fresh Ray cluster's above "
        "all, is not counted. The pipeline's processing and training share that deadline; a train or "
        "process flow run alone counts from its own start, after the warm start.",
    )
    max_policy_steps: int | None = Field(
        None,
        ge=1,
        description="Stop once the run has this many policy steps, counting those of earlier flow runs "
        "it resumes from.",
    )
    max_rollouts: int | None = Field(
        None,
        ge=1,
        description="Finish at most this many rollouts in the whole run: all its workers together, counting "
        "those of earlier flow runs it resumes from. Workers claim blocks of up to orchestrator.concurrency; "
        "a worker killed outright keeps its unused block, so the run can end that many short. In group mode "
        "a group launches whole: the run ends at the largest multiple of orchestrator.group_size not above it.",
    )


def schema_pattern(pattern: str) -> str:
    """``pattern`` (``^...$``) for a JSON schema, ending where the string ends: the Prefect
    server checks parameters with Python's ``re.search``, whose ``$`` also matches before a
    final newline; a negative lookahead ends the string there and in the UI's JavaScript."""
    return pattern.removesuffix("$") + r"(?![\s\S])"


class EnvsConfig(BaseModel):
    """Each environment's config, by name; an environment left unset runs on its defaults.

    The built-in environments' fields are typed, so the Prefect UI shows each as a form. An
    environment added with ``envs.registry.register`` takes a mapping under its name, checked
    against its own config model when the run config is validated.
    """

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, dict[str, Any]] = Field(init=False)

    arith: ArithConfig | None = Field(None, description="Sums and differences, one turn.")
    guess: GuessConfig | None = Field(None, description="Guess a number from higher/lower hints.")
    pytool: PyToolConfig | None = Field(None, description="Answer with the help of a sandboxed interpreter.")
    code: CodeConfig | None = Field(None, description="Write a function that passes hidden tests.")
    shell: ShellConfig | None = Field(None, description="Answer with the help of a sandboxed shell.")
    dataset: DatasetConfig | None = Field(None, description="Prompts and reference answers from a file.")
    agent: AgentConfig | None = Field(None, description="A whole agent program in a sandbox per episode.")

    def configured(self) -> dict[str, EnvConfig | dict[str, Any]]:
        """The environments set here, by name: the built-in ones' configs, a registered one's mapping."""
        typed = {name: getattr(self, name) for name in type(self).model_fields}
        return {
            name: value for name, value in (typed | (self.model_extra or {})).items() if value is not None
        }


class RunConfig(BaseModel):
    """Everything one run needs: storage, model, engines, environments, processor, trainer."""

    # its inputs may hold credentials: errors name the field, never the value
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", hide_input_in_errors=True)

    run_id: str = Field(
        "demo",
        description="Name of the run: its folder under storage.root.",
        # in the schema too, so the Prefect server refuses a bad one when the run is created
        json_schema_extra={"pattern": schema_pattern(RUN_ID_PATTERN)},
    )
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="Where shards, tables and weights live."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The starting policy.")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig, description="Supervised warm start.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Inference engines.")
    gateway: GatewayConfig = Field(
        default_factory=GatewayConfig, description="Token-in-token-out gateway limits."
    )
    service: ServiceConfig = Field(
        default_factory=ServiceConfig, description="Rollout service pools and sampling."
    )
    gateway_http: GatewayHTTPConfig = Field(
        default_factory=GatewayHTTPConfig,
        description="The gateway's HTTP API that each rollout worker serves to agent harnesses outside "
        "the run (off by default), writing their records into its raw shards.",
    )
    orchestrator: OrchestratorConfig = Field(
        default_factory=OrchestratorConfig, description="Task mix, concurrency, backpressure."
    )
    envs: EnvsConfig = Field(
        default_factory=EnvsConfig, description="Each environment's config, keyed by environment name."
    )
    processor: ProcessorConfig = Field(default_factory=ProcessorConfig, description="Trajectory processor.")
    sao: SAOConfig = Field(default_factory=SAOConfig, description="The SAO trainer.")
    elastic: ElasticRunConfig = Field(
        default_factory=ElasticRunConfig,
        description="Elastic capacity: when the trainer borrows rollout replicas and gives them back.",
    )
    trainer_device: TorchDevice = Field(
        "cpu", description="Torch device of the trainer's policy and value model (cpu, cuda, cuda:1 …)."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    stop: StopConfig = Field(default_factory=StopConfig, description="Stop conditions.")
    cluster: Literal["local", "ray"] = Field(
        "local", description="'local': threads in this process; 'ray': engines and env workers as Ray actors."
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster address ('auto', ray://host:10001) of a cluster 'ray' run, refused with "
        "cluster 'local'; None or 'local' starts a local Ray.",
    )
    ray_node_ip: str | None = Field(
        "127.0.0.1",
        description=(
            "Address of the local Ray that a run without ray_address (or with 'local') starts: on 127.0.0.1 its "
            "processes listen on loopback only; on another address of this machine (for other nodes "
            "to join) or null (Ray picks it, or joins the cluster RAY_ADDRESS or `ray start` names) "
            "on every interface. Another address is refused where no local Ray starts (cluster "
            "'local', or a ray_address to join)."
        ),
    )
    seed: int = Field(0, description="Seed of task sampling and everything not seeded elsewhere.")

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        # pydantic's lax mode reads true as 1 (``seed: true`` seeded 1); strict mode would
        # refuse the strings YAML gives for numbers it does not parse (1e-4), so only booleans
        wrong = booleans_for_numbers(cls, data)
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: a boolean where a number is wanted")
        return data

    @field_validator("ray_address")
    @classmethod
    def _ray_address(cls, value: str | None) -> str | None:
        if value and value.lower().startswith(("http://", "https://")):
            # else ray.init refused it as the run joined, after the warm start
            raise ValueError(
                "an http(s):// address is the Ray dashboard's, for job submission, which a run cannot "
                "join: give the Ray client's ray://head:10001, the head's head:6379, or 'auto' on a node "
                "of the cluster"
            )
        return value or None  # a form's empty field: ray.init refuses ""

    @field_validator("ray_node_ip")
    @classmethod
    def _ray_node_ip(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address") from None
        if address.is_loopback and value != "127.0.0.1":
            raise ValueError(f"Ray keeps to loopback only on 127.0.0.1, not on {value}")
        if address.is_unspecified:
            raise ValueError(
                f"{value} is no node's address: give this machine's own, or null for Ray's choice"
            )
        return value

    @model_validator(mode="after")
    def _ray_settings_need_their_ray(self) -> RunConfig:
        # else the run went ahead in this process's threads, the cluster named idle; the
        # address is not echoed (errors hide the config's values)
        if self.cluster != "ray" and self.ray_address is not None:
            raise ValueError(
                f"ray_address is set, but cluster is {self.cluster!r}, which runs no Ray: set cluster "
                "to 'ray' to run on that Ray cluster, or leave ray_address unset"
            )
        if self.ray_node_ip not in ("127.0.0.1", None):
            # else taken and ignored: no Ray of the run's own listened on it
            if self.cluster != "ray":
                why, fix = f"cluster is {self.cluster!r}, which starts no Ray", "set cluster to 'ray'"
            elif self.ray_address not in (None, "local"):
                why, fix = "ray_address names a cluster to join", "set ray_address to 'local' or null"
            else:
                return self
            raise ValueError(
                f"ray_node_ip is the address of the local Ray a run starts, and {why}: leave ray_node_ip "
                f"at 127.0.0.1, or {fix}"
            )
        return self

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        if problem := run_id_problem(value):
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _envs_known(self) -> RunConfig:
        for field, names in (
            ("orchestrator.mix", self.orchestrator.mix),
            ("envs", self.envs.configured()),
            ("warm_start.demos", self.warm_start.demos),
        ):
            for name in names:
                if name not in REGISTRY:
                    raise ValueError(f"{field}: unknown environment {name!r}; known: {sorted(REGISTRY)}")
        for name, overrides in self.envs.configured().items():
            try:
                scorer = make_config(name, overrides).reward_model
            except ValidationError as exc:
                raise ValueError(
                    "; ".join(
                        f"envs.{name}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                        for err in exc.errors()
                    )
                ) from None
            if scorer is not None and scorer not in self.service.reward_models:
                raise ValueError(
                    f"envs.{name}.reward_model: {scorer!r} is not one of service.reward_models "
                    f"({sorted(self.service.reward_models) or 'none configured'})"
                )
        if self.service.top_p < 1:
            raise ValueError(
                f"service.top_p: {self.service.top_p} is below 1, and the trainer, which takes the "
                "policy's log-probs over the whole vocabulary, cannot reproduce the engines' log-probs "
                "renormalised over the top-p nucleus: every DIS ratio would be off; set it to 1 "
                "(service.temperature is fine: the trainer takes its log-probs at it)"
            )
        if self.engine.kind == "vllm" and self.service.temperature < VLLM_MIN_TEMPERATURE:
            raise ValueError(
                f"service.temperature: {self.service.temperature:g} is below {VLLM_MIN_TEMPERATURE:g}, which "
                "vLLM samples a smaller one at: its log-probs would not be those of the temperature the "
                f"trainer takes them at; set it to {VLLM_MIN_TEMPERATURE:g} or more"
            )
        compact_at = self.service.compact_at
        limit_field, limit = self._context_limit()
        if compact_at is not None and compact_at + self.service.max_new_tokens > limit:
            raise ValueError(
                f"service.compact_at: {compact_at} plus service.max_new_tokens {self.service.max_new_tokens} "
                f"passes {limit_field} {limit}: a prompt at most compact_at, not compacted, "
                f"would have its action cut short; keep compact_at at most {limit - self.service.max_new_tokens}"
            )
        keep, turns = self.service.compact_keep_turns, self.service.max_turns
        if compact_at is not None and keep > turns - 2:
            raise ValueError(
                f"service.compact_keep_turns: {keep} leaves no turn to compact in service.max_turns {turns}: "
                "a branch opens once a rollout holds more turns than it keeps, and a turn must follow it; "
                f"keep at most {turns - 2}"
            )
        rollouts, group = self.stop.max_rollouts, self.orchestrator.group_size
        limits = {
            "stop.max_rollouts": rollouts,
            "orchestrator.max_rollouts": self.orchestrator.max_rollouts,
            "orchestrator.target_groups": self.orchestrator.target_groups,
        }
        for field, limit in limits.items():
            if limit is not None and self.gateway_http.serve_only:
                raise ValueError(
                    f"{field} ({limit}) counts the workers' own rollouts, and with gateway_http.serve_only "
                    "they run none (a harness's records are not counted): the run would never reach it; stop "
                    "it with stop.max_seconds or stop.max_policy_steps"
                )
        steps, every = self.stop.max_policy_steps, self.sao.publish_every
        if steps is not None and every is not None and not self.sao.publish_on_stop and steps % every:
            unpublished = steps % every
            raise ValueError(
                f"stop.max_policy_steps ({steps}) is not a multiple of sao.publish_every ({every}), and "
                f"sao.publish_on_stop is false: the trainer would stop at step {steps} with its last "
                f"{unpublished} step{'s' * (unpublished != 1)} unpublished (trained again, and lost again, "
                "by each run resuming it), and no rollout worker would see a version at that step to stop "
                f"on; make it a multiple of {every} or set sao.publish_on_stop true"
            )
        if self.sao.mode == "grpo" and group == 1:
            raise ValueError(
                "sao.mode: 'grpo' takes each rollout's reward less its group's mean, and with "
                "orchestrator.group_size 1 each group is one rollout: every advantage would be 0 "
                "and nothing trained; set orchestrator.group_size to 2 or more"
            )
        if rollouts is not None and rollouts < group:
            raise ValueError(
                f"stop.max_rollouts ({rollouts}) is below orchestrator.group_size ({group}): no group could launch"
            )
        if self.cluster == "ray":
            # a Ray env actor is reached through a proxy that neither drives a program nor
            # carries the env's config to the service
            for name in self.orchestrator.mix:
                if getattr(env_class(name), "drives_itself", False):
                    raise ValueError(
                        f"orchestrator.mix: {name!r} drives its own program, which cluster 'ray' cannot run"
                    )
                if self.env_config(name).reward_model is not None:
                    raise ValueError(
                        f"envs.{name}.reward_model: reward models are not served with cluster 'ray'"
                    )
        if self.warm_start.enabled:
            counts = {name: self.warm_start.count(name) for name in self.orchestrator.mix}
            for name, count in counts.items():
                if count and not env_class(name).scripted_solver:
                    raise ValueError(
                        f"warm_start.demos.{name}: {name!r} has no scripted solver to demonstrate with; "
                        f"set warm_start.demos.{name} to 0 or turn warm_start off"
                    )
            if not any(counts.values()):
                raise ValueError(
                    "warm_start.demos: no environment of orchestrator.mix has demonstrations to warm-start "
                    "on; give one some or turn warm_start off"
                )
        for name in self.orchestrator.mix:
            config = self.env_config(name)
            for field in getattr(type(config), "required_fields", ()):
                if not getattr(config, field):
                    raise ValueError(f"envs.{name}.{field}: {name!r} is in orchestrator.mix and needs it set")
            scored_by = getattr(type(config), "score_fields", ())
            if scored_by and config.reward_model is None and not any(getattr(config, f) for f in scored_by):
                fields = " or ".join(f"envs.{name}.{f}" for f in (*scored_by, "reward_model"))
                raise ValueError(
                    f"{fields}: {name!r} is in orchestrator.mix and, with none of them set, scores every episode 0"
                )
            if isinstance(config, AgentConfig) and (limit := self._cores_per_action()) is not None:
                field, most = limit
                if config.action_cores > most:
                    # else the scheduler refused every action of its program: each rollout an env_error
                    raise ValueError(
                        f"envs.{name}.action_cores ({config.action_cores}) exceeds {field} ({most}): "
                        "no action of its program could be granted its cores"
                    )
        return self

    def _context_limit(self) -> tuple[str, int]:
        """The field that bounds the tokens a rollout's context may hold, and its value: the
        gateway's limit, or the embedded tiny model's positions where fewer (its engine cuts a
        generation at the last one and refuses a prompt that reaches it). A checkpoint's
        positions are not read here: a vLLM server's are checked as the worker starts."""
        gateway = ("gateway.max_context_tokens", self.gateway.max_context_tokens)
        positions = self.model.tiny.max_position_embeddings
        if self.model.path is None and positions < gateway[1]:
            return "model.tiny.max_position_embeddings", positions
        return gateway

    def _cores_per_action(self) -> tuple[str, int] | None:
        """The field that bounds the cores one action may be granted, and its value; None when
        no field of the config does (no scheduler, or the machine's cores)."""
        service = self.service
        if service.scheduler == "static":
            return "service.scheduler_static_cores", service.scheduler_static_cores
        if service.scheduler == "action" and service.scheduler_cores is not None:
            return "service.scheduler_cores", service.scheduler_cores
        return None

    def env_config(self, name: str):
        """The validated config of environment ``name``."""
        return make_config(name, self.envs.configured().get(name))

    def mix_service(self) -> ServiceConfig:
        """The ``service`` section as the run's rollout services take it: holding only the reward
        models an env of ``orchestrator.mix`` names. One configured for no env of the mix is not
        loaded (its memory, device budget and load time are spared) nor checked at the start."""
        named = {self.env_config(name).reward_model for name in self.orchestrator.mix}
        used = {name: reward for name, reward in self.service.reward_models.items() if name in named}
        return self.service.model_copy(update={"reward_models": used})

    def elastic_settings(self) -> ElasticConfig:
        """The ``elastic`` section as the controller and the workers' routers take it: session
        slots left unset are a replica's share of a worker's ``orchestrator.concurrency``."""
        slots = self.elastic.sessions_per_replica or math.ceil(
            self.orchestrator.concurrency / self.engine.replica_count
        )
        return ElasticConfig(**self.elastic.model_dump() | {"sessions_per_replica": slots})


def booleans_for_numbers(model: type[BaseModel], data: Any, prefix: str = "") -> list[str]:
    """The dotted fields of ``data`` (the input of ``model``) given a boolean where ``model``
    takes an int or a float (and no boolean), in its sections, mappings and lists too (an item
    named by its index: ``gateway.eos_token_ids[1]``), and in a registered environment's
    mapping under ``envs``, against its own config."""
    if not isinstance(data, dict):
        return []
    fields = [
        where
        for name, field in model.model_fields.items()
        if (field.alias or name) in data
        for where in _booleans_in(
            field.annotation, data[field.alias or name], f"{prefix}{field.alias or name}"
        )
    ]
    if model is not EnvsConfig:
        return fields
    registered = [name for name in data if name not in model.model_fields and name in REGISTRY]
    return fields + [
        where
        for name in registered
        for where in booleans_for_numbers(REGISTRY[name].config_cls, data[name], f"{prefix}{name}.")
    ]


def _booleans_in(annotation: Any, value: Any, where: str) -> list[str]:
    options = _options(annotation)
    if isinstance(value, bool):
        return [where] if bool not in options and (int in options or float in options) else []
    for option in options:
        if isinstance(option, type) and issubclass(option, BaseModel):
            return booleans_for_numbers(option, value, f"{where}.")
        if typing.get_origin(option) is dict and isinstance(value, dict):
            value_type = typing.get_args(option)[1]
            return [
                found
                for key, item in value.items()
                for found in _booleans_in(value_type, item, f"{where}.{key}")
            ]
        if typing.get_origin(option) is list and isinstance(value, list):
            (item_type,) = typing.get_args(option)
            return [
                found
                for i, item in enumerate(value)
                for found in _booleans_in(item_type, item, f"{where}[{i}]")
            ]
    return []


def _options(annotation: Any) -> tuple[Any, ...]:
    """The types a field of ``annotation`` takes: a union's members, without ``Annotated``."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(option for member in typing.get_args(annotation) for option in _options(member))
    return (annotation,)


def missing_path(
    config: RunConfig, model: bool = True, reward_models: bool = True, dataset: bool = True
) -> str | None:
    """The first local path of ``config`` that does not exist, as one line naming its field;
    None when all are there. Without this check a missing ``model.path`` is found at the
    warm start, a missing reward model as the rollout service starts and a missing dataset
    file at the first task drawn, after the run started. A checkpoint path that is not there
    may be a Hugging Face Hub model id (``Qwen/Qwen3-0.6B``), which loads from the Hub: only
    one that cannot be an id is refused, and ``model.path`` only for a run with no weight
    version (the store is read then), whose warm start alone reads it. ``model``,
    ``reward_models``, ``dataset``: whether the flow loads ``model.path`` (it may warm-start),
    the reward models an env of the mix names (it serves a rollout service,
    :meth:`RunConfig.mix_service`) and the dataset (:func:`missing_dataset`). A local ``storage.root`` that is a
    file, or lies under one, is refused too (it need not exist: it is created); it failed
    once the flow had started, reading the run's ``LATEST``."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not config.storage.is_s3:
        existing = os.path.abspath(config.storage.root)
        while not os.path.exists(existing) and existing != os.path.dirname(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            if existing == os.path.abspath(config.storage.root):
                return f"storage.root {config.storage.root!r} is a file, not a folder"
            return f"storage.root {config.storage.root!r} is no folder: {existing!r} is a file"
    checkpoints = {"model.path": config.model.path} if model else {}
    if reward_models:
        checkpoints |= {
            f"service.reward_models.{name}.path": reward.path
            for name, reward in config.mix_service().reward_models.items()
        }
    for field, path in checkpoints.items():
        if path and not os.path.exists(path):
            try:
                validate_repo_id(path)
            except HFValidationError:
                # only the warm start of a run with no version reads model.path
                if field != "model.path" or not _has_weights(config):
                    return f"{field} {path!r} is neither a local directory nor a Hugging Face model id"
    return missing_dataset(config) if dataset else None


def missing_dataset(config: RunConfig) -> str | None:
    """``envs.dataset.path`` as one line when it is a local file that does not exist; None
    otherwise. Every flow that draws tasks reads it, all of them of the mix: one set for a
    run whose mix leaves ``dataset`` out is read by none, and not checked."""
    dataset = config.envs.dataset
    if (
        dataset is not None
        and "dataset" in config.orchestrator.mix
        and dataset.path
        and "://" not in dataset.path
        and not os.path.exists(dataset.path)
    ):
        return f"envs.dataset.path {dataset.path!r} does not exist"
    return None


def rollout_problem(config: RunConfig, splits: tuple[Split, ...]) -> str | None:
    """Why a flow that runs a rollout service in its own process (the pipeline's evaluations,
    a rollout worker, an evaluation) and draws tasks of ``splits`` cannot, as one line: a
    task it cannot draw (:func:`empty_split`), more cores than the process may use
    (:func:`missing_cores`), a sandbox folder that is not there (:func:`missing_sandbox_root`),
    a reward model past its budget (:func:`reward_over_budget`) or with more than one label
    (:func:`reward_not_one_label`); None when it can."""
    return (
        empty_split(config, splits)
        or missing_cores(config)
        or missing_sandbox_root(config)
        or reward_over_budget(config)
        or reward_not_one_label(config)
    )


def empty_split(config: RunConfig, splits: tuple[Split, ...] = ("train", "eval")) -> str | None:
    """One line naming the first env of the mix that cannot draw a task of one of ``splits``,
    those the flow draws from (rollouts draw train tasks, evaluations eval ones), and why:
    a split its tasks leave empty (a task's split is a hash of its id, so twenty agent tasks
    may hold none out), a dataset file that does not read, a verifier that does not import;
    None when each draws. Without this check the run failed at its first evaluation or
    rollout, once the warm start was over. A dataset file is read once per process: the
    flow's first draw then reads it from memory."""
    for name in config.orchestrator.mix:
        env_config = config.env_config(name)
        for split in splits:
            try:
                env_class(name).tasks(split, config.seed, 1, env_config)
            except ValueError as exc:
                return f"envs.{name}: {exc}"
            except Exception as exc:
                return f"envs.{name}: {split} tasks could not be drawn: {type(exc).__name__}: {exc}"
    return None


def too_few_demos(config: RunConfig) -> str | None:
    """One line naming the setting that asks the warm start for more demonstrations of an env
    of the mix than its train split holds distinct tasks (``code``'s 327 under the default
    ``demos_per_env``), and how many it holds; None when each gives them (an env that repeats
    its tasks by design gives any number) or warm_start is off. The tasks are drawn as the warm
    start draws them. Without this check the run failed once the flow had started (a Ray
    cluster up), at its warm start. A draw that fails otherwise is left to :func:`empty_split`
    and to the warm start, which name why. A run that has a weight version (a rerun, a flow
    resuming) does not warm-start, and is not refused: the run's store is read for that, only
    when a setting would be."""
    if not config.warm_start.enabled:
        return None
    problem = _demos_past_train_split(config)
    return None if problem is None or _has_weights(config) else problem


def _demos_past_train_split(config: RunConfig) -> str | None:
    """:func:`too_few_demos` of a run with no weight version."""
    for name in config.orchestrator.mix:
        count = config.warm_start.count(name)
        if count == 0:
            continue
        try:
            task_set(name, "train", config.seed, count, config.env_config(name))
        except TooFewTasks as exc:
            setting = (
                f"warm_start.demos.{name}" if name in config.warm_start.demos else "warm_start.demos_per_env"
            )
            return (
                f"{setting} ({count}) asks for more demonstrations of {name} than the {exc.available} distinct "
                f"tasks its train split holds; set warm_start.demos.{name} to at most {exc.available} "
                "(0 leaves it out) or turn warm_start off"
            )
        except Exception:
            continue
    return None


def _has_weights(config: RunConfig) -> bool:
    """Whether the run's store has a weight version that the warm start takes as the run's
    (it then publishes none): ``LATEST`` names one, or, garbled, a complete version is there
    to point it at. A store that does not answer is taken for one that has: its read is left
    to the flow, whose command and warm start say why it fails."""
    from storage.config import RunStore
    from storage.weights import CorruptVersion, WeightStore

    weights = WeightStore(RunStore(config.storage, config.run_id))
    try:
        try:
            return weights.latest() is not None
        except CorruptVersion:
            return bool(weights.list())
    except Exception:  # an endpoint s3fs cannot reach raises botocore's errors, not OSError
        return True


def missing_cores(config: RunConfig) -> str | None:
    """One line naming the field that asks the rollout service's scheduler for more CPU cores
    than this process may use; None when they fit. Every flow that rolls out runs a service
    in its own process (the pipeline's evaluations, a rollout worker, an evaluation). Without
    this check the scheduler refused it as the service started, after the warm start, or,
    with ``service.scheduler_cores`` unset, refused every action of an agent's program."""
    service = config.service
    if service.scheduler == "none":
        return None
    usable = len(os.sched_getaffinity(0))
    here = f"the {usable} core{'s' * (usable != 1)} this process may use"
    if service.scheduler_cores is not None:
        if service.scheduler_pin and service.scheduler_cores > usable:
            return (
                f"service.scheduler_cores ({service.scheduler_cores}) exceeds {here}: lower it or set "
                "service.scheduler_pin false"
            )
        return None  # what it must hold was checked against it as the config loaded
    if service.scheduler == "static" and service.scheduler_static_cores > usable:
        return (
            f"service.scheduler_static_cores ({service.scheduler_static_cores}) exceeds {here} "
            "(service.scheduler_cores unset): no rollout could reserve its cores"
        )
    if service.scheduler == "action":
        for name in config.orchestrator.mix:
            env_config = config.env_config(name)
            if isinstance(env_config, AgentConfig) and env_config.action_cores > usable:
                return (
                    f"envs.{name}.action_cores ({env_config.action_cores}) exceeds {here} "
                    "(service.scheduler_cores unset): no action of its program could be granted its cores"
                )
    return None


def reward_over_budget(config: RunConfig) -> str | None:
    """One line naming the first reward model an env of the mix names (those the rollout
    service loads, :meth:`RunConfig.mix_service`) whose checkpoint alone holds more than
    ``service.reward_budget_mb`` (in float32, as the rollout service loads it); None when
    each fits or no budget is set. Without this check the rollout service refused it as it
    loaded the models, after the warm start. A checkpoint's size is read from the headers of
    its safetensors files in a local directory; one held otherwise is left to that load."""
    service = config.service
    if service.scheduler != "action" or service.reward_budget_mb is None:
        return None
    budget = int(service.reward_budget_mb * 2**20)
    for name, reward in config.mix_service().reward_models.items():
        size = _float32_bytes(Path(reward.path))
        if size is not None and size > budget:
            return (
                f"reward model {name!r} needs {size / 2**20:.2f} MB on its device, more than "
                f"service.reward_budget_mb ({service.reward_budget_mb:.3g})"
            )
    return None


def missing_sandbox_root(config: RunConfig) -> str | None:
    """One line naming the first env of the mix that makes sandboxes whose ``sandbox.root_dir``
    is not a folder, or, for an env that drives its own program, is too long for the gateway
    socket in its sandbox folders; None when each is fine. Without this check each rollout of
    the env failed (``FileNotFoundError``, ``AF_UNIX path too long``), and the pipeline at its
    first evaluation, once the warm start was over. On Ray the sandboxes are made on the env
    actors' nodes: not checked."""
    from envs.agent import GATEWAY_SOCKET, SOCKET_PATH_MAX
    from envs.sandbox import folder_path_bytes

    if config.cluster != "local":
        return None
    for name in config.orchestrator.mix:
        if not env_class(name).makes_sandboxes:
            continue
        root = config.env_config(name).sandbox.root_dir
        if root is not None and not os.path.isdir(root):
            return f"envs.{name}.sandbox.root_dir {root!r} is not a folder"
        if getattr(env_class(name), "drives_itself", False):
            path_bytes = folder_path_bytes(root) + 1 + len(GATEWAY_SOCKET)
            over = path_bytes - SOCKET_PATH_MAX
            if over > 0:
                where = f"sandbox.root_dir {root!r}" if root else f"the temp dir {tempfile.gettempdir()!r}"
                return (
                    f"envs.{name}: {where} is too long for the gateway socket in its sandbox folders: "
                    f"its path would be {path_bytes} bytes, over the {SOCKET_PATH_MAX} a Unix socket "
                    f"address holds; use a root_dir {over} byte{'s' * (over != 1)} shorter"
                )
    return None


def reward_not_one_label(config: RunConfig) -> str | None:
    """One line naming the first reward model an env of the mix names (those the rollout
    service loads, :meth:`RunConfig.mix_service`) whose checkpoint has other than one label, as
    the rollout service refuses it once it loads the models (after the warm start); None when
    each has one. The labels are read from the ``config.json`` of a local directory; a
    checkpoint held otherwise is left to that load."""
    for name, reward in config.mix_service().reward_models.items():
        labels = _num_labels(Path(reward.path))
        if labels is not None and labels != 1:
            return (
                f"reward model {name!r} at {reward.path} has {labels} labels; a reward model has one "
                "(its logit is the reward)"
            )
    return None


def _num_labels(checkpoint: Path) -> int | None:
    """The labels a load of ``checkpoint`` gives its classifier, counted as transformers counts
    them from its ``config.json``: its ``id2label`` map, else ``num_labels``, else 2 (the
    default a saved config leaves out); None when it has no ``config.json`` that reads."""
    try:
        config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if isinstance(config.get("id2label"), dict):
        return len(config["id2label"])
    labels = config.get("num_labels", 2)
    return labels if isinstance(labels, int) else None


def _float32_bytes(checkpoint: Path) -> int | None:
    """Bytes the tensors of the safetensors files a load of ``checkpoint`` reads take in
    float32: its ``model.safetensors``, else the shards its ``model.safetensors.index.json``
    names (any other safetensors file beside them, an adapter or a consolidated copy, is not
    loaded); None when it holds neither, or one that does not read (the model's load says
    why)."""
    files = _loaded_safetensors(checkpoint)
    if not files:
        return None
    elements = 0
    for file in files:
        try:
            with file.open("rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                if length > file.stat().st_size:
                    return None
                header = json.loads(handle.read(length))
            elements += sum(
                math.prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__"
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return elements * 4


def _loaded_safetensors(checkpoint: Path) -> list[Path]:
    """The safetensors files ``from_pretrained`` reads from the folder ``checkpoint``."""
    if (checkpoint / "model.safetensors").is_file():
        return [checkpoint / "model.safetensors"]
    try:
        weight_map = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
        return [checkpoint / name for name in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def train_devices(config: RunConfig) -> dict[str, str]:
    """The torch devices the train flow uses in its own process, by field: the trainer's
    (the warm start's too), on either cluster."""
    return {"trainer_device": config.trainer_device}


def evaluate_devices(config: RunConfig) -> dict[str, str]:
    """The torch devices an evaluation uses in its own process, by field: the evaluation
    engine's and, with cluster 'local', the reward models' (on Ray no reward model is served)."""
    return {"engine.torch.device": config.engine.torch.device} | _reward_devices(config)


def rollout_devices(config: RunConfig) -> dict[str, str]:
    """The torch devices a rollout worker uses in its own process, by field: the trainer's
    where it would warm-start the run (:func:`_warm_start_devices`) and, with cluster 'local',
    the engines' (``engine.kind`` torch) and the reward models'; on Ray the engines run on the
    cluster's nodes, and no reward model is served."""
    warm_start = _warm_start_devices(config)
    if config.cluster != "local":
        return warm_start
    engines = {"engine.torch.device": config.engine.torch.device} if config.engine.kind == "torch" else {}
    return warm_start | engines | _reward_devices(config)


WARM_START_DEVICE = "trainer_device (the warm start's, as the run has no weight version yet)"
"""The field :func:`_warm_start_devices` names: a rollout worker's user may not expect it to
train at all."""


def _warm_start_devices(config: RunConfig) -> dict[str, str]:
    """``trainer_device`` when the flow's warm start would train there in its own process (a
    rollout worker's, a Ray pipeline's: neither trains otherwise) and this machine lacks it:
    warm start on and no weight version in the run's store, read only then. Without this
    check the warm start failed with torch's error."""
    devices = {WARM_START_DEVICE: config.trainer_device}
    if not config.warm_start.enabled or missing_device(devices) is None or _has_weights(config):
        return {}
    return devices


def _reward_devices(config: RunConfig) -> dict[str, str]:
    """``service.reward_device`` when reward models are served (cluster 'local' only) on a
    device the config names."""
    service = config.mix_service()
    if config.cluster == "local" and service.reward_models and service.reward_device is not None:
        return {"service.reward_device": service.reward_device}
    return {}


def train_paths(config: RunConfig) -> str | None:
    """:func:`missing_path` of what the train flow reads: it serves no reward model, and draws
    tasks (the dataset's) only to warm-start a run with no weight version (the store is read
    for that only when the dataset is missing)."""
    dataset = missing_dataset(config)
    warm_starts = dataset is not None and config.warm_start.enabled and not _has_weights(config)
    return missing_path(config, reward_models=False, dataset=False) or (dataset if warm_starts else None)


def evaluate_paths(config: RunConfig) -> str | None:
    """:func:`missing_path` of what an evaluation reads: it loads a published version, not
    ``model.path``."""
    return missing_path(config, model=False)


def pipeline_devices(config: RunConfig) -> dict[str, str]:
    """The torch devices the pipeline uses in its own process, by field: the evaluation
    engine's (every evaluation runs there) and, with cluster 'local', the trainer's and the
    rollout worker's; on Ray the trainer and the rollout engines run on the cluster's nodes,
    and the trainer's device is the warm start's alone (:func:`rollout_devices`)."""
    devices = train_devices(config) if config.cluster == "local" else {}
    return devices | evaluate_devices(config) | rollout_devices(config)


def missing_device(devices: dict[str, str]) -> str | None:
    """The first of ``devices`` (field -> torch device) naming a CUDA device that this
    machine does not show, as one line naming the field; None when all are there. Without
    this check, a trainer on a missing GPU fails once the warm start and the first
    evaluation are over, minutes into the run."""
    cuda = {field: device for field, device in devices.items() if device.startswith("cuda")}
    if not cuda:
        return None
    import torch  # only for a CUDA device: a second or two

    count = torch.cuda.device_count()
    for field, device in cuda.items():
        if (torch.device(device).index or 0) >= count:
            seen = f"{count} CUDA device{'s' * (count != 1)}" if count else "no CUDA device"
            return f"{field} is {device!r}, but this machine shows {seen}"
    return None


def missing_ray(config: RunConfig) -> str | None:
    """With cluster 'ray', one line naming what this machine lacks of the ``ray`` extra (Ray,
    prefect-ray); None when it has them or the run is local. Without this check the pipeline
    fails once the warm start and the first evaluation are over, a rollout worker once the
    warm start is."""
    if config.cluster != "ray":
        return None
    missing = [name for name in ("ray", "prefect_ray") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return f"cluster is 'ray', but {' and '.join(missing)} is not installed: pip install 'treadle[ray]'"


def missing_gateway_token(config: RunConfig) -> str | None:
    """With ``gateway_http.port`` set on a local cluster, one line naming the environment
    variable (``gateway_http.token_env``) of the gateway's bearer token when it is unset or
    blank; None otherwise. Without this check the run failed once its rollout task started,
    with that task's traceback. On Ray the worker reads the variable on its own node, and
    says so there."""
    if config.cluster != "local" or config.gateway_http.port is None:
        return None
    try:
        config.gateway_http.token()
    except ValueError as exc:
        return str(exc)
    return None


RAY_REACH_TIMEOUT_S = 10.0
"""How long :func:`unreachable_ray` waits for the cluster's port to accept a connection."""

_HOST_PORT = re.compile(r"^(?:ray://)?(?P<host>\[[^]]+\]|[^:/\[\]]+)(?::(?P<port>\d+))?$")


def unreachable_ray(config: RunConfig) -> str | None:
    """With cluster 'ray' and a ``ray_address`` naming a host (``ray://host:10001``, or a head's
    ``host:6379``), one line when nothing accepts a connection at its port; None otherwise
    ('auto', 'local' or none: Ray finds or starts the cluster). Without this check a run
    failed once the warm start and the first evaluation were over, with Ray's traceback: a
    ``ray://`` address after 30 s, a head's address only after minutes of retries."""
    if config.cluster != "ray" or config.ray_address in (None, "auto", "local"):
        return None
    match = _HOST_PORT.match(config.ray_address)
    if match is None or (match["port"] is None and not config.ray_address.startswith("ray://")):
        return None
    port = int(match["port"] or 10001)  # the Ray client's port when ray:// names none
    try:
        socket.create_connection((match["host"].strip("[]"), port), timeout=RAY_REACH_TIMEOUT_S).close()
    except OSError as exc:
        return (
            f"nothing answers at ray_address {config.ray_address} ({exc.strerror or exc}): "
            "start the Ray cluster, or fix the address"
        )
    return None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a run config from YAML (defaults when ``path`` is None), then apply ``overrides``."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = read_yaml(Path(path).read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read run config {path}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"cannot read run config {path}: {yaml_problem(exc)}") from None
        if data is None:  # a wrong or truncated file would otherwise run on every default
            raise ConfigError(f"run config {path} is empty: it sets no field")
        if not isinstance(data, dict):
            raise ConfigError(f"run config {path} must be a mapping at the top level")
    data = _merge(data, overrides or {})
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(_problem(err) for err in exc.errors())
        raise ConfigError(f"invalid run config{f' {path}' if path else ''}: {problems}") from None


def read_yaml(text: str) -> Any:
    """``text`` read as a run config reads (YAML 1.2's booleans, no key given twice), for
    the file and a ``--set`` value alike."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def _problem(error: dict[str, Any]) -> str:
    """One pydantic error as ``field: what is wrong``; a check of the whole config names its
    fields in its message."""
    message = error["msg"].removeprefix("Value error, ")
    field = ".".join(str(part) for part in error["loc"])
    return f"{field}: {message}" if field else message


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``, refusing a key given twice in a mapping: PyYAML keeps the last
    one silently, so a section written twice lost the first one's fields. Its booleans are
    ``true`` and ``false`` alone, as in YAML 1.2 (set below)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # keys a merge brings in may be given again
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # SafeLoader refuses it below
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


# YAML 1.1 reads yes/no/on/off as booleans too: `mixed_precision: no` was false, which the
# field's choices refuse; a flag (pydantic) still takes the words as text.
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong with the YAML and where, without the line it quotes (a credential may
    stand on it)."""
    problem = getattr(exc, "problem", None) or "not valid YAML"
    mark = getattr(exc, "problem_mark", None)
    return problem if mark is None else f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


class Replacement(dict):
    """An override that replaces the mapping it lands on instead of merging into it: ``--set
    orchestrator.mix={arith: 1.0}`` names the whole mix."""


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if (
            isinstance(value, dict)
            and not isinstance(value, Replacement)
            and isinstance(merged.get(key), dict)
        ):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
