"""Run configs: bad ones fail naming the field; flows render RunConfig as a form;
every deployment in deployments/prefect.yaml validates against its flow."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import jsonschema
import pytest
import yaml
from prefect.cli.deploy._models import PrefectYamlModel
from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema
from pydantic import SecretStr, ValidationError

import flows.rollout
from envs import registry
from envs.agent import AgentConfig, AgentEnv
from envs.arith import ArithEnv
from flows.cli_args import parse
from flows.config import (
    ConfigError,
    RunConfig,
    evaluate_devices,
    evaluate_paths,
    load_config,
    missing_device,
    missing_path,
    pipeline_devices,
    rollout_devices,
    train_paths,
)
from rl.config import SAOConfig
from tests.flows.conftest import REPO

TINY = REPO / "configs" / "tiny.yaml"
PREFECT_YAML = REPO / "deployments" / "prefect.yaml"


HUB_MODEL = "model:\n  path: Qwen/Qwen3-0.6B\n"
"""A model whose positions a run config does not know: only the gateway's limit is checked."""


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_tiny_config_loads():
    config = load_config(TINY)
    assert set(config.orchestrator.mix) == {"arith", "guess"}
    assert config.engine.kind == "torch"


def test_the_gpu_config_loads_with_its_trainer_memory_settings():
    config = load_config(TINY.parent / "qwen3-0.6b-gpu.yaml")
    assert config.engine.kind == "vllm" and config.trainer_device == "cuda"
    assert config.sao.activation_checkpointing and config.sao.micro_token_budget == 32768
    assert config.sao.mixed_precision == "bf16"
    assert config.gateway.chat_template_kwargs == {"enable_thinking": False}, "Qwen3 answers without thinking"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("sao:\n  eps_low: -1\n", "sao.eps_low"),
        ("orchestrator:\n  mix: {arith: 0.5, chess: 0.5}\n", "orchestrator.mix: unknown environment 'chess'"),
        ("stop:\n  max_seconds: 10\nmax_secnods: 3\n", "max_secnods"),
        ("warm_start:\n  demos_per_env: 0\n", "warm_start.demos_per_env"),
        ("run_id: 'a b'\n", "run_id"),
        ("envs:\n  arith: {no_such_option: 1}\n", "envs.arith.no_such_option"),
        ("envs:\n  chess: {}\n", "envs: unknown environment 'chess'"),
        ("warm_start:\n  demos: {gues: 3}\n", "warm_start.demos: unknown environment 'gues'"),
        ("trainer_device: gpu\n", "trainer_device: 'gpu' is not a torch device"),
        # a server that cannot be reached: the worker found it out after the warm start and
        # the first evaluation, and took it out of service, or failed
        *(
            (
                f"engine:\n  kind: vllm\n  vllm: [{{base_url: '{url}'}}]\n",
                "engine.vllm.0.base_url: base_url must be an http:// or https:// URL with a host",
            )
            for url in (
                "127.0.0.1:8000",
                "ftp://vllm:8000",
                "http://:8000",
                "http://vllm:0",
                "http://vllm:80000",
            )
        ),
        # torch.manual_seed takes 64 bits: past them the warm start or the trainer failed with
        # "Overflow when unpacking long long", naming no field
        ("model:\n  tiny: {seed: 18446744073709551616}\n", "model.tiny.seed: Input should be less than"),
        ("warm_start:\n  sft: {seed: 18446744073709551616}\n", "warm_start.sft.seed"),
        ("sao:\n  seed: -9223372036854775809\n", "sao.seed: Input should be greater than or equal"),
        ("eval:\n  temperature: 1.0e-7\n", "eval.temperature"),  # the engines refuse it
        ("eval:\n  temperature: .nan\n", "eval.temperature"),
        ("service:\n  top_p: 0.9\n", "service.top_p: 0.9 is below 1, and the trainer"),
        # vLLM samples it at 0.01 and reports those log-probs, which the trainer would take at 0.005
        (
            "engine:\n  kind: vllm\n  vllm: [{base_url: 'http://127.0.0.1:8000'}]\nservice:\n  temperature: 0.005\n",
            "service.temperature: 0.005 is below 0.01, which vLLM samples a smaller one at",
        ),
        (
            HUB_MODEL + "service:\n  compact_at: 4096\n",
            "service.compact_at: 4096 plus service.max_new_tokens 32 passes gateway.max_context_tokens 4096",
        ),
        # a prompt just under compact_at is not compacted, and its action was cut to the room
        # left under the limit, silently: a turn cut short like one that ran out of tokens
        (
            HUB_MODEL + "service:\n  compact_at: 4090\n",
            "service.compact_at: 4090 plus service.max_new_tokens 32 passes gateway.max_context_tokens "
            "4096: a prompt at most compact_at, not compacted, would have its action cut short; keep "
            "compact_at at most 4064",
        ),
        # the tiny model's engine cuts a generation at its last position, and refuses a prompt
        # that reaches it: under the gateway's limit, a context was never compacted but truncated
        (
            "service:\n  compact_at: 1000\n",
            "service.compact_at: 1000 plus service.max_new_tokens 32 passes "
            "model.tiny.max_position_embeddings 1024: a prompt at most compact_at, not compacted, would "
            "have its action cut short; keep compact_at at most 992",
        ),
        (
            "service:\n  compact_at: 512\n  max_turns: 4\n  compact_keep_turns: 3\n",
            "service.compact_keep_turns: 3 leaves no turn to compact in service.max_turns 4",
        ),
        ("sao:\n  lr: .inf\n", "sao.lr: Input should be a finite number"),
        ("processor:\n  success_threshold: .nan\n", "processor.success_threshold: Input should be a finite"),
        ("storage:\n  read_timeout: .inf\n", "storage.read_timeout: Input should be a finite number"),
        ("elastic:\n  cooldown_s: .inf\n", "elastic.cooldown_s: Input should be a finite number"),
        ("elastic:\n  min_train: 2\n", "elastic.min_train: Input should be less than or equal to 1"),
        ("cluster: ray\norchestrator:\n  mix: {agent: 1.0}\n", "'agent' drives its own program"),
        ("ray_node_ip: ray-head\n", "ray_node_ip: 'ray-head' is not an IP address"),
        ("ray_node_ip: 0.0.0.0\n", "ray_node_ip: 0.0.0.0 is no node's address"),
        ("ray_node_ip: '::'\n", "ray_node_ip: :: is no node's address"),
        (
            "ray_node_ip: 127.0.0.2\n",
            "ray_node_ip: Ray keeps to loopback only on 127.0.0.1, not on 127.0.0.2",
        ),
        (
            "orchestrator:\n  mix: {arith: 0.5, agent: 0.5}\n",
            "warm_start.demos.agent: 'agent' has no scripted solver to demonstrate with",
        ),
        # the warm start failed at run time with "no demonstrations to train on", naming no setting
        (
            "warm_start:\n  demos: {arith: 0}\n",
            "warm_start.demos: no environment of orchestrator.mix has demonstrations to warm-start on",
        ),
        ("orchestrator:\n  group_size: 8\n  concurrency: 4\n", "exceeds concurrency"),
        ("orchestrator:\n  group_size: 4\n  max_rollouts: 2\n", "is below group_size"),
        ("orchestrator:\n  group_size: 4\nstop:\n  max_rollouts: 3\n", "is below orchestrator.group_size"),
        ("sao:\n  mode: grpo\n", "sao.mode: 'grpo' takes each rollout's reward less its group's mean"),
        (
            "orchestrator:\n  mix: {agent: 1.0}\nwarm_start:\n  enabled: false\n",
            "envs.agent.command: 'agent' is in orchestrator.mix and needs it set",
        ),
        (
            "orchestrator:\n  mix: {agent: 1.0}\nwarm_start:\n  enabled: false\nenvs:\n  agent: {command: run}\n",
            "envs.agent.tasks: 'agent' is in orchestrator.mix and needs it set",
        ),
        (
            "orchestrator:\n  mix: {agent: 1.0}\nwarm_start:\n  enabled: false\n"
            "envs:\n  agent: {command: run, tasks: [{id: t1, prompt: p}]}\n",
            "envs.agent.eval_command or envs.agent.reward_model: 'agent' is in orchestrator.mix and, "
            "with none of them set, scores every episode 0",
        ),
        ("envs:\n  agent: {tasks: [{id: a, prompt: p, dta: {}}]}\n", "envs.agent.tasks.0.dta"),
        ("envs:\n  dataset: {path: rows.csv}\n", "envs.dataset.path: must end in .parquet, .jsonl or .json"),
        (
            "envs:\n  dataset: {path: 'https://host/rows.jsonl'}\n",
            "envs.dataset.path: must be a local file or an s3:// URL, not a https:// one",
        ),
        (
            "envs:\n  code: {sandbox: {backend: apptainer}}\n",
            "envs.code.sandbox.apptainer_image: the apptainer backend needs an image",
        ),
        ("envs:\n  agent: {tasks: [{id: ' ', prompt: p}]}\n", "envs.agent.tasks.0.id"),
        (
            "orchestrator:\n  mix: {dataset: 1.0}\nwarm_start:\n  enabled: false\nenvs:\n  dataset: {path: ''}\n",
            "envs.dataset.path: 'dataset' is in orchestrator.mix and needs it set",
        ),
        (
            "cluster: ray\nservice:\n  reward_models: {judge: {path: /models/judge}}\n"
            "envs:\n  arith: {reward_model: judge}\n",
            "envs.arith.reward_model: reward models are not served with cluster 'ray'",
        ),
        ("service:\n  compact_at: 0\n", "service.compact_at"),
        ("service:\n  compact_keep_turns: 0\n", "service.compact_keep_turns"),
        ("gateway_http:\n  port: 65536\n", "gateway_http.port"),
        ("gateway_http:\n  host: ''\n", "gateway_http.host"),
        # a name no shell can set: the worker would refuse to start for want of its token
        ("gateway_http:\n  token_env: 'GATEWAY TOKEN'\n", "gateway_http.token_env"),
        ("gateway_http:\n  idle_timeout_s: 0\n", "gateway_http.idle_timeout_s"),
        ("gateway_http:\n  drain_timeout_s: -1\n", "gateway_http.drain_timeout_s"),
        ("gateway_http:\n  prot: 8080\n", "gateway_http.prot"),
    ],
)
def test_bad_config_fails_naming_the_field(tmp_path, text, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(write_config(tmp_path, text))


AGENT_RUN = (
    "orchestrator:\n  mix: {agent: 1.0}\nwarm_start:\n  enabled: false\nenvs:\n  agent: {command: run, "
    "eval_command: score, action_cores: 2, tasks: [{id: t1, prompt: p}]}\n"
)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        # the scheduler refused every action of the agent's program, each rollout an env_error
        (
            AGENT_RUN + "service:\n  scheduler: static\n",
            "envs.agent.action_cores (2) exceeds service.scheduler_static_cores (1)",
        ),
        (
            AGENT_RUN + "service:\n  scheduler_cores: 1\n",
            "envs.agent.action_cores (2) exceeds service.scheduler_cores (1)",
        ),
        # the rollout service refused it as it started: at the first evaluation, after the warm start
        (
            "service:\n  scheduler: static\n  scheduler_cores: 2\n  scheduler_static_cores: 4\n",
            "service: scheduler_static_cores (4) exceeds scheduler_cores (2)",
        ),
    ],
)
def test_cores_that_the_scheduler_could_never_grant_are_refused_naming_the_fields(tmp_path, text, said):
    with pytest.raises(ConfigError) as failed:
        load_config(write_config(tmp_path, text))
    assert said in str(failed.value)


def test_an_agent_whose_actions_fit_the_scheduler_loads(tmp_path):
    for service in (
        "scheduler: static\n  scheduler_static_cores: 2",
        "scheduler_cores: 2",
        "scheduler: none",
    ):
        config = load_config(write_config(tmp_path, AGENT_RUN + f"service:\n  {service}\n"))
        assert config.env_config("agent").action_cores == 2


@pytest.mark.parametrize(
    ("text", "service"),
    [
        # the largest values the refusals of test_bad_config_fails_naming_the_field name
        (HUB_MODEL + "service:\n  compact_at: 4064\n", {"compact_at": 4064}),
        ("service:\n  compact_at: 992\n", {"compact_at": 992}),
        (
            "model:\n  tiny: {max_position_embeddings: 8192}\nservice:\n  compact_at: 4064\n",
            {"compact_at": 4064},
        ),
        (
            "service:\n  compact_at: 512\n  max_turns: 4\n  compact_keep_turns: 2\n",
            {"max_turns": 4, "compact_keep_turns": 2},
        ),
        # without compaction, compact_keep_turns keeps nothing: one turn is a run's own choice
        ("service:\n  max_turns: 1\n", {"compact_at": None, "max_turns": 1}),
    ],
)
def test_compaction_settings_up_to_the_limits_their_refusals_name_load(tmp_path, text, service):
    config = load_config(write_config(tmp_path, text))
    assert {field: getattr(config.service, field) for field in service} == service


def test_a_local_ray_is_on_loopback_unless_the_config_names_another_address_or_leaves_it_to_ray(tmp_path):
    assert RunConfig().ray_node_ip == "127.0.0.1"
    assert (
        load_config(write_config(tmp_path, "cluster: ray\nray_node_ip: 10.0.0.5\n")).ray_node_ip == "10.0.0.5"
    )
    assert load_config(write_config(tmp_path, "cluster: ray\nray_node_ip: null\n")).ray_node_ip is None


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({}, "cluster is 'local', which starts no Ray"),
        ({"cluster": "ray", "ray_address": "ray://10.0.0.1:10001"}, "ray_address names a cluster to join"),
        ({"cluster": "ray", "ray_address": "auto"}, "ray_address names a cluster to join"),
    ],
)
def test_a_ray_node_ip_that_no_local_ray_would_start_on_is_refused_at_load(overrides, why):
    """``ray_node_ip`` is the address of the local Ray a run starts: with cluster 'local', or
    a ray_address to join, it was taken and ignored (no Ray listened on it)."""
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, overrides | {"ray_node_ip": "10.0.0.5"})
    assert str(refused.value) == (
        f"invalid run config {TINY}: ray_node_ip is the address of the local Ray a run starts, and "
        f"{why}: leave ray_node_ip at 127.0.0.1"
        + (", or set cluster to 'ray'" if not overrides else ", or set ray_address to 'local' or null")
    )
    for address in ("local", None):
        config = load_config(TINY, {"cluster": "ray", "ray_address": address, "ray_node_ip": "10.0.0.5"})
        assert config.ray_node_ip == "10.0.0.5"


def test_an_empty_ray_address_starts_a_local_ray_as_none_does(tmp_path):
    """A form's or a file's empty field: Ray refused it ("Invalid address format: ") once
    the warm start and the first evaluation were over."""
    assert load_config(write_config(tmp_path, "ray_address: ''\n")).ray_address is None
    assert RunConfig(cluster="ray", ray_address="auto").ray_address == "auto"


def test_a_check_of_the_whole_config_fails_with_its_own_message_alone(tmp_path):
    path = write_config(tmp_path, "orchestrator:\n  mix: {chess: 1.0}\n")
    with pytest.raises(ConfigError) as failed:
        load_config(path)
    assert str(failed.value) == (
        f"invalid run config {path}: orchestrator.mix: unknown environment 'chess'; known: "
        f"{sorted(registry.REGISTRY)}"
    )


def test_grpo_loads_with_groups_of_two_or_more_rollouts():
    config = load_config(TINY, {"sao": {"mode": "grpo"}, "orchestrator": {"group_size": 2}})
    assert (config.sao.mode, config.orchestrator.group_size) == ("grpo", 2)


def test_a_run_of_exactly_one_group_loads():
    """``stop.max_rollouts`` equal to ``orchestrator.group_size`` launches one group: the
    refusal is of a limit below it alone."""
    config = load_config(TINY, {"orchestrator": {"group_size": 4}, "stop": {"max_rollouts": 4}})
    assert (config.orchestrator.group_size, config.stop.max_rollouts) == (4, 4)


SERVE_ONLY = {"gateway_http": {"port": 0, "serve_only": True}}


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        ({"stop": {"max_rollouts": 64}}, "stop.max_rollouts (64) counts the workers' own rollouts"),
        # the orchestrator's own limit and its group target went unchecked: neither is reached either
        (
            {"orchestrator": {"max_rollouts": 64}},
            "orchestrator.max_rollouts (64) counts the workers' own rollouts",
        ),
        (
            {"orchestrator": {"group_size": 2, "target_groups": 8}, "sao": {"mode": "grpo"}},
            "orchestrator.target_groups (8) counts the workers' own rollouts",
        ),
    ],
)
def test_a_rollout_limit_of_a_worker_that_serves_only_is_refused_naming_it(overrides, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(TINY, SERVE_ONLY | overrides)


def test_a_worker_that_serves_only_loads_with_a_stop_it_reaches():
    config = load_config(TINY, SERVE_ONLY | {"stop": {"max_policy_steps": 3}})
    assert config.gateway_http.serve_only and config.stop.max_policy_steps == 3


def test_vllm_servers_listed_for_a_torch_engine_are_refused_without_showing_them():
    """With ``engine.kind`` torch the servers of ``engine.vllm`` went unused, silently: a run
    meant for them (kind left at its default) rolled out on an in-process model instead."""
    servers = [{"base_url": "http://127.0.0.1:8000", "api_key": "TOP-SECRET"}]
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, {"engine": {"vllm": servers}})
    assert "engine: engine.kind is 'torch', so the 1 server engine.vllm lists would go unused" in str(
        refused.value
    )
    assert "TOP-SECRET" not in str(refused.value)
    assert load_config(TINY, {"engine": {"kind": "vllm", "vllm": servers}}).engine.replica_count == 1


def test_torch_replicas_asked_of_a_vllm_engine_are_refused():
    """With ``engine.kind`` vllm a worker runs one replica per server of ``engine.vllm``:
    ``engine.replicas: 4`` was taken and ignored, the run rolling out on the two servers listed."""
    servers = [{"base_url": "http://127.0.0.1:8000"}, {"base_url": "http://127.0.0.1:8001"}]
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, {"engine": {"kind": "vllm", "vllm": servers, "replicas": 4}})
    assert str(refused.value) == (
        f"invalid run config {TINY}: engine: engine.replicas (4) counts TorchEngine replicas, and with "
        "engine.kind 'vllm' a worker runs one replica per server engine.vllm lists (2): list a server "
        "for each replica, or leave engine.replicas at 1"
    )
    assert load_config(TINY, {"engine": {"kind": "vllm", "vllm": servers}}).engine.replica_count == 2


@pytest.mark.parametrize(
    ("steps", "every", "on_stop"), [(6, 2, False), (5, 2, True), (5, None, True), (5, 2, False)]
)
def test_a_policy_step_limit_that_no_version_would_publish_is_refused(steps, every, on_stop):
    """Without ``publish_on_stop`` the trainer publishes every ``publish_every`` steps only: it
    stopped at ``max_policy_steps`` with the steps since its last version unpublished (trained
    again, and lost again, by each run resuming it), and the rollout workers, which stop on a
    version that holds ``max_policy_steps``, never served one."""
    overrides = {
        "stop": {"max_policy_steps": steps},
        "sao": {"publish_every": every, "publish_on_stop": on_stop},
    }
    if steps % (every or steps) == 0 or on_stop:
        assert load_config(TINY, overrides).stop.max_policy_steps == steps
        return
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "stop.max_policy_steps (5) is not a multiple of sao.publish_every (2), and sao.publish_on_stop is "
            "false: the trainer would stop at step 5 with its last 1 step unpublished"
        ),
    ):
        load_config(TINY, overrides)


def test_a_config_that_is_not_utf8_fails_naming_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run_id: d\xe9mo\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"cannot read run config {path}: 'utf-8' codec"):
        load_config(path)


def test_malformed_yaml_fails_naming_the_place_without_quoting_the_line(tmp_path):
    path = write_config(tmp_path, "storage:\n  root: ./runs\n  secret_access_key: hunter2: x\n")
    with pytest.raises(ConfigError) as failed:
        load_config(path)
    message = str(failed.value)
    assert (
        message == f"cannot read run config {path}: mapping values are not allowed here at line 3, column 29"
    )
    assert "hunter2" not in message and failed.value.__cause__ is None


def test_a_field_given_twice_in_the_file_fails_naming_it(tmp_path):
    path = write_config(tmp_path, "sao:\n  lr: 0.5\nstop: {max_seconds: 7}\nsao:\n  mode: grpo\n")
    with pytest.raises(ConfigError) as failed:
        load_config(path)
    assert str(failed.value) == f"cannot read run config {path}: duplicate key 'sao' at line 4, column 1"
    merged = write_config(tmp_path, "a: &a {lr: 0.5}\nsao:\n  <<: *a\n  lr: 0.25\n")
    with pytest.raises(ConfigError, match=r"^invalid run config .*: a: Extra inputs are not permitted$"):
        load_config(merged)  # a key that a merge brings in may be given again: only the extra 'a' fails


def with_sets(sets: list[str]) -> list[str]:
    """The command line of the tiny config with a ``--set`` for each of ``sets``."""
    return ["--config", str(TINY)] + [arg for item in sets for arg in ("--set", item)]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["stop=5", "stop.max_seconds=3"], "--set stop.max_seconds: stop is set to a value, not a section"),
        (["envs=[1]", "envs.arith.x=3"], "--set envs.arith.x: envs is set to a value, not a section"),
        (["stop.max_seconds=3", "stop=5"], "--set stop: fields inside stop are set by another --set"),
        (
            ["engine.vllm.0.base_url=http://127.0.0.1:8000"],
            "--set engine.vllm.0.base_url: engine.vllm is a list, which --set sets whole: engine.vllm=[...]",
        ),
        (
            ["engine.vllm.base_url=http://127.0.0.1:8000"],
            "--set engine.vllm.base_url: engine.vllm is a list, which --set sets whole: engine.vllm=[...]",
        ),
        (
            ["gateway.eos_token_ids.0=2"],
            "--set gateway.eos_token_ids.0: gateway.eos_token_ids is a list, which --set sets whole: "
            "gateway.eos_token_ids=[...]",
        ),
        # a field named by an empty part: the config's error named no field ("Extra inputs …")
        (["sao..lr=1"], "--set 'sao..lr': a field's name has an empty part"),
        (["=hunter2"], "--set '': a field's name has an empty part"),
        # taken as the field set to null: stop.max_seconds was no limit at all
        (["stop.max_seconds"], "--set needs KEY=VALUE: no '=' after 'stop.max_seconds'"),
        (
            ["storage.secret_access_key: hunter2"],
            "--set needs KEY=VALUE: no '=' after 'storage.secret_access_key'",
        ),
        (
            ["storage={secret_access_key: hunter2: [x}"],
            "--set storage: its value is not YAML (expected ',' or '}', but got ':' at line 1, column 28)",
        ),
    ],
)
def test_conflicting_overrides_fail_naming_the_option(capsys, sets, message):
    argv = with_sets(sets)
    with pytest.raises(SystemExit) as exited:
        parse("test", argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "hunter2" not in err


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("sao.lrr=1e-4", "--set sao.lrr: sao has no field 'lrr'; did you mean sao.lr?"),
        (
            "stpo.max_seconds=60",
            "--set stpo.max_seconds: the run config has no field 'stpo'; did you mean stop?",
        ),
        (
            "envs.arith.max_opernd=9",
            "--set envs.arith.max_opernd: envs.arith has no field 'max_opernd'; did you mean envs.arith.max_operand?",
        ),
        ("stop.zzz=1", "--set stop.zzz: stop has no field 'zzz'; its fields: "),
    ],
)
def test_a_field_the_config_lacks_set_on_the_command_line_is_refused_with_the_nearest_name(
    capsys, given, said
):
    """A mistyped ``--set`` key was refused as "sao.lrr: Extra inputs are not permitted", naming
    no field the user may have meant."""
    with pytest.raises(SystemExit) as exited:
        parse("test", with_sets([given]))
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_a_flow_run_as_a_module_names_the_command_that_runs_it_in_its_usage(capsys, monkeypatch):
    """``python -m flows.evaluate --help`` said ``usage: evaluate.py [-h] ...`` (argparse
    names the file), and so did every usage error: a command that runs nothing."""
    import types

    import flows.evaluate

    main = types.ModuleType("__main__")
    main.__file__ = flows.evaluate.__file__
    main.__spec__ = flows.evaluate.__spec__
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [flows.evaluate.__file__, "--help"])
    with pytest.raises(SystemExit) as exited:
        parse("test", ["--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m flows.evaluate [-h]")


def test_a_field_set_twice_takes_the_last_value():
    sets = ["orchestrator.mix={arith: 0.2}", "orchestrator.mix={arith: 0.4}"]
    config, _ = parse("test", with_sets(sets))
    assert config.orchestrator.mix["arith"] == 0.4


def test_a_mapping_set_on_the_command_line_replaces_a_mapping_field_and_updates_a_section():
    """``orchestrator.mix={arith: 1.0}`` is the whole mix (merged, the file's guess would
    stay in it); ``sao={lr: ...}`` changes the learning rate and keeps the file's other
    trainer settings."""
    sets = [
        "orchestrator.mix={arith: 1.0}",
        "warm_start.demos={}",
        "sao={lr: 1.0e-4}",
        "envs={arith: {max_operand: 9}}",
    ]
    config, _ = parse("test", with_sets(sets))
    assert config.orchestrator.mix == {"arith": 1.0}
    assert config.warm_start.demos == {}
    file = load_config(TINY)
    assert (
        config.sao == file.sao.model_copy(update={"lr": 1.0e-4})
        and file.sao.token_budget != SAOConfig().token_budget
    )
    assert config.envs.configured()["arith"].max_operand == 9


def test_a_mapping_field_inside_a_section_set_on_the_command_line_is_its_whole_value():
    """``orchestrator={mix: {arith: 1.0}}`` names the whole mix, as ``orchestrator.mix={arith: 1.0}``
    does: merged, the file's guess stayed in it."""
    sets = ["orchestrator={mix: {arith: 1.0}}", "warm_start={demos: {arith: 5}}"]
    config, _ = parse("test", with_sets(sets))
    assert config.orchestrator.mix == {"arith": 1.0}
    assert config.warm_start.demos == {"arith": 5}
    assert config.orchestrator.concurrency == load_config(TINY).orchestrator.concurrency


def test_a_value_set_on_the_command_line_for_a_text_field_stays_text():
    """YAML reads ``2024`` and ``1.50`` as numbers and ``2024-12-03`` as a date; a field that
    holds text (a run id, a key) gets the characters given, while a number field still gets
    a number."""
    sets = [
        "run_id=2024",
        "storage.access_key_id=2024",
        "storage.secret_access_key=123456",
        "storage.session_token=1.50",
        "cluster=ray",
        "ray_address=2024-12-03",
        "storage.retries=5",
    ]
    config, _ = parse("test", with_sets(sets))
    assert config.run_id == "2024"
    assert config.storage.access_key_id.get_secret_value() == "2024"
    assert config.storage.secret_access_key.get_secret_value() == "123456"
    assert config.storage.session_token.get_secret_value() == "1.50"
    assert config.ray_address == "2024-12-03"
    assert config.storage.retries == 5


def test_a_shell_command_set_on_the_command_line_for_a_text_field_is_the_characters_given():
    """YAML read a text field's value as a list that does not parse (``[ -f x ] && ...``,
    refused as "not YAML"), a mapping (``echo a: b``, refused as no string) or text and a
    comment (``echo done #1`` became ``echo done``). A text field now gets the characters
    given unless they are quoted, and ``null`` still unsets a field that may be unset."""
    sets = [
        "envs.agent.command=[ -f setup.sh ] && sh setup.sh",
        "envs.agent.eval_command=echo a: b #1",
        "ray_address=null",
        "run_id='007'",
    ]
    config, _ = parse("test", with_sets(sets))
    assert config.envs.agent.command == "[ -f setup.sh ] && sh setup.sh"
    assert config.envs.agent.eval_command == "echo a: b #1"
    assert config.ray_address is None
    assert config.run_id == "007"


def test_a_choice_set_on_the_command_line_that_yaml_reads_as_a_boolean_stays_text():
    """``sao.mixed_precision=no`` turns bfloat16 off: YAML reads ``no`` as false, which the
    field's choices refused ("Input should be 'no' or 'bf16'", as it was given 'no')."""
    config, _ = parse("test", with_sets(["sao.mixed_precision=no"]))
    assert config.sao.mixed_precision == "no"


def test_yes_no_on_and_off_in_a_config_file_are_text_for_text_fields_and_booleans_for_flags(tmp_path):
    """YAML 1.1 reads ``no``, ``on`` and ``off`` as booleans: ``mixed_precision: no`` (the
    README's way to turn bfloat16 off) was refused ("Input should be 'no' or 'bf16'") and a
    sandbox variable ``DEBUG: on`` was refused as no string. Only ``true`` and ``false`` are
    booleans now, as in YAML 1.2; a flag still takes ``no`` and ``on``."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "sao:\n  mixed_precision: no\n  adaptive_lambda: on\n  normalize_advantages: false\n"
        "warm_start:\n  enabled: off\n"
        "envs:\n  code:\n    sandbox:\n      env: {DEBUG: on, QUIET: No}\n"
    )
    config = load_config(path)
    assert config.sao.mixed_precision == "no"
    assert config.sao.adaptive_lambda is True and config.sao.normalize_advantages is False
    assert config.warm_start.enabled is False
    assert config.envs.code.sandbox.env == {"DEBUG": "on", "QUIET": "No"}


def test_a_mapping_set_on_the_command_line_reads_as_the_config_file_does(capsys):
    """``--set`` read its value as YAML 1.1, the file as YAML 1.2's booleans with no key
    given twice: ``sao={mixed_precision: no}`` and a sandbox variable ``{DEBUG: on}`` were
    refused though the file takes them, and ``sao={lr: 0.1, lr: 0.2}`` kept 0.2 silently."""
    config, _ = parse("test", with_sets(["sao={mixed_precision: no}", "envs.arith.sandbox.env={DEBUG: on}"]))
    assert config.sao.mixed_precision == "no"
    assert config.envs.arith.sandbox.env == {"DEBUG": "on"}
    with pytest.raises(SystemExit) as exited:
        parse("test", with_sets(["sao={lr: 0.1, lr: 0.2}"]))
    assert exited.value.code == 2
    assert "--set sao: its value is not YAML (duplicate key 'lr'" in capsys.readouterr().err


def test_a_value_set_on_the_command_line_for_a_text_entry_of_a_mapping_stays_text():
    """An environment variable of a sandbox (``dict[str, str]``) set with ``--set`` gets the
    characters given, as a text field does: refused before, "Input should be a valid string"."""
    config, _ = parse(
        "test", with_sets(["envs.arith.sandbox.env.PORT=8080", "envs.arith.sandbox.env.V=1.50"])
    )
    assert config.envs.arith.sandbox.env == {"PORT": "8080", "V": "1.50"}


def test_a_secret_set_on_the_command_line_is_warned_of_without_showing_it(capsys):
    """A key given with ``--set`` is in the command line, which ``ps`` shows every user of the
    machine and the shell keeps in its history: it is taken, with a warning naming the field
    and where to give it instead, never the value."""
    sets = [
        "storage={root: ./runs, access_key_id: TOP-SECRET-0, secret_access_key: TOP-SECRET-1}",
        "engine.vllm=[{base_url: 'http://127.0.0.1:8000'}, {api_key: TOP-SECRET-2}]",
        "engine.kind=vllm",
    ]
    config, _ = parse("test", with_sets(sets))
    assert config.storage.secret_access_key.get_secret_value() == "TOP-SECRET-1"
    warned = capsys.readouterr().err
    assert "TOP-SECRET" not in warned
    for field in ("storage.access_key_id", "storage.secret_access_key", "engine.vllm[1].api_key"):
        assert f"warning: --set {field} puts a secret on the command line" in warned, warned
    parse("test", with_sets(["storage.retries=5", "run_id=key"]))
    assert capsys.readouterr().err == ""


def test_a_value_set_for_a_text_field_of_an_environment_stays_text():
    """The environments' sections may be left unset (``envs.agent`` is an ``AgentConfig`` or
    None): ``true`` is the agent's whole shell command there, not a boolean, and a number
    field of an environment still gets a number."""
    sets = ["envs.agent.command=true", "envs.agent.eval_command=2024", "envs.arith.max_operand=12"]
    config, _ = parse("test", with_sets(sets))
    assert (config.envs.agent.command, config.envs.agent.eval_command) == ("true", "2024")
    assert config.envs.arith.max_operand == 12


def test_overrides_merge_into_the_file_and_are_validated(tmp_path):
    config = load_config(TINY, {"sao": {"lr": 0.5}, "stop": {"max_seconds": 7}})
    assert (config.sao.lr, config.stop.max_seconds, config.sao.mode) == (0.5, 7, "sao")
    with pytest.raises(ConfigError, match=r"sao\.lr"):
        load_config(TINY, {"sao": {"lr": "fast"}})


def test_a_value_set_for_a_text_field_of_a_registered_environment_stays_text(monkeypatch):
    """A registered environment's section is no field of the run config: its fields' types
    come from its own config, so text stays text there too (``true`` and ``2024`` were taken
    for a boolean and a number, which its text fields refused)."""

    class MyAgent(AgentEnv):
        name = "my_agent"

    monkeypatch.setitem(registry.REGISTRY, MyAgent.name, MyAgent)  # what registry.register does
    config, _ = parse("test", with_sets(["envs.my_agent.command=true", "envs.my_agent.eval_command=2024"]))
    agent = config.env_config("my_agent")
    assert (agent.command, agent.eval_command) == ("true", "2024")


def test_a_secret_of_a_registered_environment_is_warned_of_set_alone_or_in_its_section(capsys, monkeypatch):
    """A registered environment's config may hold a key: ``--set`` warns of it whether the
    field is named or given inside a mapping for the environment or for all ``envs``."""

    class KeyedConfig(AgentConfig):
        api_key: SecretStr | None = None

    class KeyedAgent(AgentEnv):
        name = "keyed_agent"
        config_cls = KeyedConfig

    monkeypatch.setitem(registry.REGISTRY, KeyedAgent.name, KeyedAgent)
    for given in (
        "envs.keyed_agent.api_key=TOP-SECRET",
        "envs.keyed_agent={command: 'true', api_key: TOP-SECRET}",
        "envs={keyed_agent: {command: 'true', api_key: TOP-SECRET}}",
    ):
        config, _ = parse("test", with_sets([given]))
        assert config.env_config("keyed_agent").api_key.get_secret_value() == "TOP-SECRET"
        warned = capsys.readouterr().err
        assert "TOP-SECRET" not in warned
        assert "warning: --set envs.keyed_agent.api_key puts a secret on the command line" in warned, given


def test_an_empty_run_id_on_the_command_line_is_refused_not_taken_for_none(capsys):
    with pytest.raises(SystemExit) as exited:
        parse("test", ["--config", str(TINY), "--run-id", ""])
    assert exited.value.code == 2
    assert f"error: invalid run config {TINY}: run_id: run_id may hold letters" in capsys.readouterr().err


@pytest.mark.parametrize("missing", ["ray", "prefect_ray"])
def test_a_ray_flows_command_line_exits_naming_the_missing_extra(capsys, monkeypatch, missing):
    """A flow that runs on Ray checks the extra before its flow starts; one that does not
    (``ray=False``: the train flow) starts without it."""
    monkeypatch.setitem(sys.modules, missing, None)  # its import then fails as if not installed
    argv = with_sets(["cluster=ray"])
    with pytest.raises(SystemExit) as exited:
        parse("test", argv, ray=True)
    assert exited.value.code == 2
    assert f"error: cluster is 'ray', but {missing} is not installed: pip install" in capsys.readouterr().err
    config, _ = parse("test", argv)
    assert config.cluster == "ray"


def test_flow_command_line_exits_with_the_field_name(tmp_path):
    bad = write_config(tmp_path, "sao:\n  eps_low: -1\n")
    result = subprocess.run(
        [sys.executable, "-m", "flows.evaluate", "--config", str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2
    assert "sao.eps_low" in result.stderr


@pytest.mark.parametrize(
    ("flow", "field", "cluster"),
    [
        ("pipeline", "trainer_device", "local"),
        ("train", "trainer_device", "local"),
        ("pipeline", "engine.torch.device", "local"),
        ("evaluate", "engine.torch.device", "local"),
        ("rollout", "engine.torch.device", "local"),
        # with cluster 'ray' the train flow still trains, and every evaluation runs, in its own process
        ("train", "trainer_device", "ray"),
        ("pipeline", "engine.torch.device", "ray"),
        ("evaluate", "engine.torch.device", "ray"),
    ],
)
def test_a_flow_on_a_cuda_device_the_machine_lacks_exits_naming_the_field_before_it_starts(
    tmp_path, capsys, flow, field, cluster
):
    """Refused as the command starts, not once the warm start and the first evaluation
    are over (the trainer's device is first used then); no machine shows 100 GPUs."""
    main = importlib.import_module(f"flows.{flow}").main
    with pytest.raises(SystemExit) as exited:
        main(
            ["--set", f"{field}=cuda:99", "--set", f"cluster={cluster}"]
            + ["--set", f"storage.root={tmp_path}", "--set", "warm_start.enabled=false"]
        )
    err = capsys.readouterr().err
    assert exited.value.code == 2, err[-3000:]
    assert err.startswith(f"error: {field} is 'cuda:99', but this machine shows "), err
    assert err.count("\n") == 1
    assert not list(tmp_path.iterdir()), "nothing of the run was written"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("seed: true\n", "seed: a boolean where a number is wanted"),
        ("orchestrator:\n  concurrency: false\n", "orchestrator.concurrency: a boolean"),
        ("sao:\n  lr: true\n", "sao.lr: a boolean"),
        ("stop:\n  max_rollouts: true\n", "stop.max_rollouts: a boolean"),
        ("warm_start:\n  demos: {arith: true}\n", "warm_start.demos.arith: a boolean"),
        ("envs:\n  arith: {max_turns: true}\n", "envs.arith.max_turns: a boolean"),
        # in a list: an eos token id 1, a vLLM server's one-second timeout
        ("gateway:\n  eos_token_ids: [2, true]\n", "gateway.eos_token_ids[1]: a boolean"),
        ("engine:\n  vllm: [{timeout_s: true}]\n", "engine.vllm[0].timeout_s: a boolean"),
    ],
)
def test_a_boolean_for_a_number_fails_naming_the_field(tmp_path, text, named):
    """pydantic's lax mode read ``true`` as 1: ``seed: true`` seeded 1."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(write_config(tmp_path, text))


def test_numbers_load_as_before_booleans_where_they_are_booleans(tmp_path):
    text = "seed: 3\nsao:\n  lr: 1\n  value_lr: 1.0e-3\nwarm_start:\n  enabled: false\n"
    config = load_config(write_config(tmp_path, text))
    assert (config.seed, config.sao.lr, config.sao.value_lr, config.warm_start.enabled) == (
        3,
        1.0,
        1e-3,
        False,
    )


@pytest.mark.parametrize("text", ["- sao\n- stop\n", "sao\n"])
def test_a_config_file_that_is_no_mapping_fails_saying_so(tmp_path, text):
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError, match=f"^run config {path} must be a mapping at the top level$"):
        load_config(path)


def test_a_config_file_that_does_not_exist_fails_naming_it(tmp_path):
    path = tmp_path / "no-such.yaml"
    with pytest.raises(ConfigError, match=f"^cannot read run config {path}: .*No such file or directory"):
        load_config(path)


@pytest.mark.parametrize("text", ["", "# nothing set yet\n"])
def test_an_empty_config_file_fails_saying_so(tmp_path, text):
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError, match=f"^run config {path} is empty: it sets no field$"):
        load_config(path)


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (
            ["model.path={tmp}/no-such-model"],
            "model.path '{tmp}/no-such-model' is neither a local directory",
        ),
        (
            ["orchestrator.mix={{dataset: 1.0}}", "envs.dataset.path={tmp}/no-such.jsonl"],
            "envs.dataset.path '{tmp}/no-such.jsonl' does not exist",
        ),
        (
            [
                "service.reward_models={{judge: {{path: {tmp}/no-such-judge}}}}",
                "envs.arith.reward_model=judge",
            ],
            "service.reward_models.judge.path '{tmp}/no-such-judge' is neither a local directory",
        ),
    ],
    ids=["model", "dataset", "reward-model"],
)
def test_a_flow_given_a_local_path_that_does_not_exist_exits_naming_the_field(tmp_path, capsys, sets, said):
    """Refused as the command starts: found at the warm start or the first task otherwise."""
    said = said.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as exited:
        flows.rollout.main(
            [arg for field in sets for arg in ("--set", field.format(tmp=tmp_path))]
            + ["--set", f"storage.root={tmp_path}/runs", "--set", "warm_start.enabled=false"]
        )
    err = capsys.readouterr().err
    assert exited.value.code == 2, err[-3000:]
    assert err.startswith(f"error: {said}"), err
    assert err.count("\n") == 1
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize("under", ["", "/runs"])
def test_a_flow_given_a_storage_root_in_a_file_exits_naming_the_field(tmp_path, capsys, under):
    """A root that is a file, or lies under one, failed once the flow had started, with a
    traceback (NotADirectoryError) reading the run's LATEST; a root not there yet is created."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder\n")
    root = f"{notes}{under}"
    with pytest.raises(SystemExit) as exited:
        flows.rollout.main(["--set", f"storage.root={root}", "--set", "warm_start.enabled=false"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err[-3000:]
    said = f"is no folder: {str(notes)!r} is a file" if under else "is a file, not a folder"
    assert err == f"error: storage.root {root!r} {said}\n"
    assert notes.read_text() == "not a folder\n"
    assert missing_path(load_config(TINY, {"storage": {"root": f"{tmp_path}/new/runs"}})) is None


def test_flows_that_read_no_local_path_start_without_them(tmp_path):
    """maintain and process read the run's storage only: a finished run whose model folder
    moved can still be maintained."""
    from flows.cli_args import parse

    argv = ["--set", f"model.path={tmp_path}/moved-model", "--set", f"storage.root={tmp_path}/runs"]
    config, _ = parse("maintain", argv, paths=None)
    assert config.model.path == f"{tmp_path}/moved-model"
    with pytest.raises(SystemExit):
        parse("rollout", argv)


def test_a_hub_model_id_and_paths_that_exist_pass_the_path_check(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    on_data = {"orchestrator": {"mix": {"dataset": 1.0}}}  # beside arith and guess
    config = load_config(
        TINY, on_data | {"model": {"path": "Qwen/Qwen3-0.6B"}, "envs": {"dataset": {"path": str(data)}}}
    )
    assert missing_path(config) is None
    assert missing_path(load_config(TINY, {"model": {"path": str(tmp_path)}})) is None
    s3 = on_data | {"envs": {"dataset": {"path": "s3://bucket/rows.jsonl"}}}
    assert missing_path(load_config(TINY, s3)) is None


def test_a_cuda_device_is_missing_from_the_first_index_the_machine_does_not_show():
    """The check's edge, which cuda:99 alone leaves untested: ``cuda:N`` on a machine showing
    N devices is missing, and so is plain ``cuda`` (device 0) on one showing none; the
    devices it shows are not."""
    import torch

    count = torch.cuda.device_count()
    said = missing_device({"trainer_device": f"cuda:{count}"})
    assert said is not None and said.startswith(f"trainer_device is 'cuda:{count}', but this machine shows ")
    if count:
        assert missing_device({"trainer_device": "cuda", "engine.torch.device": f"cuda:{count - 1}"}) is None
    else:
        assert missing_device({"trainer_device": "cuda"}) == (
            "trainer_device is 'cuda', but this machine shows no CUDA device"
        )


def test_a_ray_pipeline_checks_the_devices_of_its_own_process_alone():
    """On Ray the trainer runs on a cluster node (given its GPU as ``cuda``), so the
    pipeline's own machine need not show the trainer's device where it does not warm-start
    the run there (test_flow_checks checks one that does); the evaluation engine runs in the
    pipeline's process on either cluster."""
    config = load_config(
        TINY, {"cluster": "ray", "trainer_device": "cuda:99", "warm_start": {"enabled": False}}
    )
    assert pipeline_devices(config) == {"engine.torch.device": "cpu"}
    assert missing_device(pipeline_devices(config)) is None
    local = config.model_copy(update={"cluster": "local"})
    assert pipeline_devices(local) == {"trainer_device": "cuda:99", "engine.torch.device": "cpu"}


def test_each_flow_checks_what_it_uses_in_its_own_process(tmp_path):
    """The train flow serves no reward model, so a reward model's missing checkpoint is no
    reason to refuse it, nor a moved starting checkpoint an evaluation, which loads a
    published version; on Ray a rollout worker's engines run on the cluster's nodes and no
    reward model is served (nor in an evaluation), so their devices are not its own; a
    worker whose engines are vLLM servers runs no torch engine."""
    judge = {"reward_models": {"judge": {"path": str(tmp_path / "no-such-judge")}}}
    judged = {"service": judge, "envs": {"arith": {"reward_model": "judge"}}}
    assert train_paths(load_config(TINY, judged)) is None
    assert missing_path(load_config(TINY, judged)).startswith("service.reward_models.judge.path ")
    moved = load_config(
        TINY, {"model": {"path": str(tmp_path / "moved-model")}, "storage": {"root": str(tmp_path / "runs")}}
    )
    assert missing_path(moved).startswith("model.path ")
    assert evaluate_paths(moved) is None
    on_gpus = judged | {
        "engine": {"torch": {"device": "cuda:99"}},
        "service": {**judge, "reward_device": "cuda:98"},
    }
    local = load_config(TINY, on_gpus)
    assert rollout_devices(local) == {"engine.torch.device": "cuda:99", "service.reward_device": "cuda:98"}
    assert evaluate_devices(local) == rollout_devices(local)
    servers = {
        "kind": "vllm",
        "vllm": [{"base_url": "http://127.0.0.1:8000/v1"}],
        "torch": {"device": "cuda:99"},
    }
    assert rollout_devices(load_config(TINY, on_gpus | {"engine": servers})) == {
        "service.reward_device": "cuda:98"
    }
    ray = local.model_copy(update={"cluster": "ray"})
    assert rollout_devices(ray) == {}
    assert evaluate_devices(ray) == {"engine.torch.device": "cuda:99"}


def _schema_properties(schema: dict) -> list[tuple[str, str, dict]]:
    return [
        (definition, name, prop)
        for definition, body in schema["definitions"].items()
        for name, prop in body.get("properties", {}).items()
    ]


@pytest.mark.parametrize("entrypoint", ["pipeline", "rollout", "process", "train", "evaluate", "maintain"])
def test_flow_parameters_render_run_config_with_descriptions(entrypoint):
    flow = load_flow_from_entrypoint(f"flows.{entrypoint}:{entrypoint}", use_placeholder_flow=False)
    schema = parameter_schema(flow).model_dump()
    assert schema["properties"]["config"]["$ref"] == "#/definitions/RunConfig"
    undescribed = [name for name, prop in schema["properties"].items() if not prop.get("description")]
    assert not undescribed, f"parameters without a description in the form: {undescribed}"
    run_config = schema["definitions"]["RunConfig"]["properties"]
    assert set(run_config) == set(RunConfig.model_fields)
    missing = [f"{d}.{n}" for d, n, prop in _schema_properties(schema) if not prop.get("description")]
    assert not missing, f"fields without a description in the form: {missing}"
    assert schema["definitions"]["StopConfig"]["properties"]["max_seconds"]["description"]
    outside = [name for name in ("PAPERS.md", "DESIGN.md") if name in json.dumps(schema)]
    assert not outside, f"the form points at documents that are not in the repository: {outside}"


def test_the_form_shows_every_built_in_environments_own_fields():
    flow = load_flow_from_entrypoint("flows.pipeline:pipeline", use_placeholder_flow=False)
    schema = parameter_schema(flow).model_dump()
    envs = schema["definitions"]["EnvsConfig"]["properties"]
    built_in = {name: cls for name, cls in registry.REGISTRY.items() if cls.__module__.startswith("envs.")}
    assert set(envs) == set(built_in)
    for name, cls in built_in.items():
        (typed, _) = envs[name]["anyOf"]
        form = schema["definitions"][typed["$ref"].rsplit("/", 1)[1]]["properties"]
        assert set(form) == set(cls.config_cls.model_fields), name
    guess = schema["definitions"]["GuessConfig"]["properties"]["high"]
    assert (guess["default"], guess["maximum"]) == (24, 9999)
    with pytest.raises(jsonschema.ValidationError, match="9999"):
        jsonschema.validate({"config": {"envs": {"guess": {"high": 10**5}}}}, schema)


def test_a_registered_environment_takes_a_mapping_checked_against_its_own_config(monkeypatch, tmp_path):
    class Sums(ArithEnv):
        name = "sums"

    monkeypatch.setitem(registry.REGISTRY, Sums.name, Sums)  # what registry.register does
    config = load_config(write_config(tmp_path, "envs:\n  sums: {max_operand: 7}\n  guess: {high: 40}\n"))
    assert config.env_config("sums").max_operand == 7 and config.env_config("guess").high == 40
    assert set(config.envs.configured()) == {"sums", "guess"}
    assert config.env_config("arith") == registry.make_config("arith")  # unset: its defaults
    assert RunConfig.model_validate(config.model_dump(mode="json")) == config
    for text, named in [
        ("envs:\n  sums: {max_operand: 0}\n", "envs.sums.max_operand"),
        ("envs:\n  sums: 7\n", "envs.sums"),
    ]:
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            load_config(write_config(tmp_path, text))


def test_a_boolean_for_a_number_of_a_registered_environment_is_refused_naming_the_field(
    monkeypatch, tmp_path
):
    """As for a built-in environment's (``envs.arith.max_operand: true``): pydantic's lax mode
    took it for 1, and a registered environment's mapping was not checked for it."""

    class Sums(ArithEnv):
        name = "sums"

    monkeypatch.setitem(registry.REGISTRY, Sums.name, Sums)  # what registry.register does
    with pytest.raises(ConfigError, match=r"envs\.sums\.max_operand: a boolean where a number is wanted"):
        load_config(write_config(tmp_path, "envs:\n  sums: {max_operand: true}\n"))


@pytest.mark.parametrize("entrypoint", ["pipeline", "rollout", "process", "train", "evaluate", "maintain"])
def test_no_credential_can_travel_in_a_deployment_runs_parameters(entrypoint):
    """The Prefect server stores a run's parameters as it gets them: the form offers no
    credential field, and a run whose config carries one is refused by the schema (as is a
    run id that cannot name a folder)."""
    flow = load_flow_from_entrypoint(f"flows.{entrypoint}:{entrypoint}", use_placeholder_flow=False)
    schema = parameter_schema(flow).model_dump()
    storage = schema["definitions"]["StorageConfig"]
    assert not {"access_key_id", "secret_access_key", "session_token"} & set(storage["properties"])
    assert storage["additionalProperties"] is False
    plain = {"config": RunConfig().model_dump(mode="json")}
    jsonschema.validate(plain, schema)  # a config without credentials goes through as dumped
    for run_id in ("../elsewhere", "demo\n"):
        bad_run = {"config": plain["config"] | {"run_id": run_id}}
        with pytest.raises(jsonschema.ValidationError, match="does not match"):
            jsonschema.validate(bad_run, schema)  # refused by the server, before a worker starts
    for keys in (
        {"access_key_id": "AKIAEXAMPLE", "secret_access_key": "EXAMPLE"},
        {"access_key_id": "AKIAEXAMPLE", "secret_access_key": "EXAMPLE", "session_token": "EXAMPLE"},
    ):
        for keyed in ({"storage": keys}, {"envs": {"dataset": {"storage": keys}}}):
            with_key = RunConfig.model_validate(keyed).model_dump(mode="json")
            with pytest.raises(jsonschema.ValidationError) as refused:
                jsonschema.validate({"config": with_key}, schema)
            assert "unexpected" in refused.value.message
            assert all(f"'{field}'" in refused.value.message for field in keys)


def _deployments() -> list[dict]:
    raw = yaml.safe_load(PREFECT_YAML.read_text())
    PrefectYamlModel.model_validate(raw)
    return raw["deployments"]


def test_prefect_yaml_deployments_validate_against_their_flows():
    deployments = _deployments()
    flows = {d["entrypoint"].split(":")[1] for d in deployments}
    assert flows >= {"train", "pipeline", "evaluate", "maintain", "process"}
    assert len({(d["entrypoint"], d["name"]) for d in deployments}) == len(deployments)
    for deployment in deployments:
        # a module path: a file path would put flows/ on sys.path, where flows/rollout.py
        # shadows the rollout package
        assert ".py" not in deployment["entrypoint"]
        flow = load_flow_from_entrypoint(deployment["entrypoint"], use_placeholder_flow=False)
        schema = parameter_schema(flow).model_dump()
        # the schema lets any other name through, and a run then fails binding it to the flow
        assert set(deployment["parameters"]) <= set(schema["properties"]), deployment["name"]
        jsonschema.validate(deployment["parameters"], schema)
        RunConfig.model_validate(deployment["parameters"]["config"])
        assert deployment["work_pool"]["name"] in {"cpu", "gpu"}
        assert deployment["description"]


def test_prefect_yaml_schedules_pools_and_trigger():
    deployments = {d["entrypoint"].split(":")[1] + "/" + d["name"]: d for d in _deployments()}
    nightly = deployments["train/nightly"]
    (schedule,) = nightly["schedules"]
    assert schedule["cron"] == "0 2 * * *" and schedule["timezone"] == "Europe/Lisbon"
    assert nightly["parameters"]["drain"] is True
    assert nightly["work_pool"]["name"] == "gpu"
    assert nightly["work_pool"]["job_variables"]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    # one version as it stops: its own versions would age the day's backlog past max_staleness
    assert RunConfig.model_validate(nightly["parameters"]["config"]).sao.publish_every is None
    for name in ("train/nightly", "rollout/gpu-worker"):
        gpu = RunConfig.model_validate(deployments[name]["parameters"]["config"])
        assert (gpu.engine.torch.device, gpu.trainer_device) == ("cuda", "cuda"), name
        assert deployments[name]["work_pool"]["name"] == "gpu"
    tiny = load_config(REPO / "configs" / "tiny.yaml")
    on_demand = RunConfig.model_validate(deployments["pipeline/on-demand"]["parameters"]["config"])
    assert on_demand == tiny, "the deployments' run config is not configs/tiny.yaml"
    for name in ("pipeline/on-demand", "evaluate/on-demand", "maintain/on-demand"):
        assert not deployments[name].get("schedules"), name
        assert deployments[name]["work_pool"]["name"] == "cpu"
    process = deployments["process/on-commit"]
    assert process["parameters"]["continuous"] is False
    (trigger,) = process["triggers"]
    parsed = DeploymentEventTrigger.model_validate(trigger)
    assert parsed.expect == {"treadle.shard.committed"}
    # debounced: a commit every second starts a pass every 30 s at most, not one per commit
    assert parsed.within == parsed.schedule_after == timedelta(seconds=30)
    assert process["concurrency_limit"]["limit"] == 1
    assert deployments["pipeline/on-demand"]["concurrency_limit"] == 1
    # two maintain passes at once delete the same files, and one fails on a file already gone
    assert deployments["maintain/on-demand"]["concurrency_limit"] == 1
    run_id = process["parameters"]["config"]["run_id"]
    assert trigger["match"]["prefect.resource.id"] == f"treadle.run.{run_id}"
    # the pipeline processes its own run: a second processor there would process it twice
    assert run_id != deployments["pipeline/on-demand"]["parameters"]["config"]["run_id"]
    for name in ("train/nightly", "rollout/gpu-worker"):
        assert deployments[name]["parameters"]["config"]["run_id"] == run_id, name


def test_a_worker_name_that_cannot_name_a_shard_folder_fails_the_rollout_flow_before_it_starts(monkeypatch):
    from prefect.exceptions import ParameterTypeError

    import flows.rollout
    import tasks.weights

    started = []
    monkeypatch.setattr(tasks.weights, "warm_start", started.append)
    with pytest.raises(ParameterTypeError, match="worker_name"):
        flows.rollout.rollout(RunConfig(), "a b")
    assert started == []
    schema = parameter_schema(flows.rollout.rollout).model_dump()
    for name in ("w0\n", "a b", "../w0"):  # refused by the server too, before a worker starts
        with pytest.raises(jsonschema.ValidationError, match="does not match"):
            jsonschema.validate({"worker_name": name}, schema)
    jsonschema.validate({"worker_name": "worker-0.b_1"}, schema)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"storage": {"aws_secret_access_key": "TOP-SECRET-VALUE"}}, "storage.aws_secret_access_key"),
        ({"storage": {"secret_access_key": ["TOP-SECRET-VALUE"]}}, "storage.secret_access_key"),
        ({"storage": "TOP-SECRET-VALUE"}, "storage"),
        ({"engine": {"vllm": [{"api_key": ["TOP-SECRET-VALUE"]}]}}, "engine.vllm.0.api_key"),
        (
            {"engine": {"vllm": [{"base_url": "http://user:TOP-SECRET-VALUE@vllm:8000"}]}},
            "engine.vllm.0.base_url",
        ),
        # no scheme: no netloc to find the credentials in, refused as no URL
        ({"engine": {"vllm": [{"base_url": "user:TOP-SECRET-VALUE@vllm:8000"}]}}, "engine.vllm.0.base_url"),
        ({"envs": {"dataset": {"path": "s3://KEY:TOP-SECRET-VALUE@bucket/rows.jsonl"}}}, "envs.dataset.path"),
        ({"envs": {"dataset": {"path": "https://user:TOP-SECRET-VALUE@host/rows.csv"}}}, "envs.dataset.path"),
    ],
)
def test_a_run_config_error_names_the_field_but_never_shows_a_credential(data, field):
    with pytest.raises(ValidationError) as error:
        RunConfig.model_validate(data)
    assert field in str(error.value) and "TOP-SECRET-VALUE" not in str(error.value)


@pytest.mark.parametrize(
    "text",
    [
        "orchestrator:\n  mix: {arith: 0.5, agent: 0.5}\nwarm_start:\n  demos: {agent: 0}\n",
        "orchestrator:\n  mix: {arith: 0.5, agent: 0.5}\nwarm_start:\n  enabled: false\n",
    ],
)
def test_an_env_with_no_scripted_solver_loads_once_the_warm_start_leaves_it_out(tmp_path, text):
    text += (
        "envs:\n  agent: {command: python3 agent.py, eval_command: python3 check.py, "
        "tasks: [{id: t1, prompt: fix the bug}]}\n"
    )
    assert "agent" in load_config(write_config(tmp_path, text)).orchestrator.mix


def test_an_agent_env_scored_by_a_reward_model_alone_loads(tmp_path):
    text = (
        "orchestrator:\n  mix: {agent: 1.0}\nwarm_start:\n  enabled: false\n"
        "service:\n  reward_models: {judge: {path: /models/judge}}\n"
        "envs:\n  agent: {command: python3 agent.py, reward_model: judge, tasks: [{id: t1, prompt: p}]}\n"
    )
    assert load_config(write_config(tmp_path, text)).envs.agent.reward_model == "judge"


def test_a_vllm_api_key_that_comes_back_masked_is_refused_and_the_form_never_offers_it():
    """Prefect stores a SecretStr parameter as ``**********`` and hands that back to the run,
    which would send it to the server as its bearer token: it is refused, naming the field."""
    config = RunConfig.model_validate({"engine": {"kind": "vllm", "vllm": [{"api_key": "real-key"}]}})
    stored = config.model_dump(mode="json")
    assert stored["engine"]["vllm"][0]["api_key"] == "**********"
    with pytest.raises(ValidationError, match=r"engine\.vllm\.0\.api_key") as error:
        RunConfig.model_validate(stored)
    assert "VLLM_API_KEY" in str(error.value)
    unset = RunConfig.model_validate({"engine": {"kind": "vllm", "vllm": [{}]}}).model_dump(mode="json")
    assert "api_key" not in unset["engine"]["vllm"][0]
    schema = parameter_schema(
        load_flow_from_entrypoint("flows.pipeline:pipeline", use_placeholder_flow=False)
    )
    assert "api_key" not in schema.model_dump()["definitions"]["VLLMEngineConfig"]["properties"]


@pytest.mark.parametrize("address", ["ray://10.0.0.5:10001", "auto", "local"])
def test_a_ray_address_without_cluster_ray_is_refused_at_load(address):
    """``--set ray_address=…`` without ``cluster=ray`` was taken and ignored: the run went
    ahead in this process's threads, on this machine, and the cluster named stayed idle."""
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, {"ray_address": address})
    assert str(refused.value) == (
        f"invalid run config {TINY}: ray_address is set, but cluster is 'local', which runs no Ray: "
        "set cluster to 'ray' to run on that Ray cluster, or leave ray_address unset"
    )
    config = load_config(TINY, {"cluster": "ray", "ray_address": address})
    assert (config.cluster, config.ray_address) == ("ray", address)


@pytest.mark.parametrize("host", ["0.0.0.0:8080", "http://0.0.0.0", "my host", "[::1]", "-host"])
def test_a_gateway_host_that_names_no_address_is_refused_at_load(host):
    """A host with a port or a scheme was taken, and the rollout worker failed as it started
    serving the API, after the warm start, with the server's traceback."""
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, {"gateway_http": {"port": 0, "host": host}})
    assert str(refused.value) == (
        f"invalid run config {TINY}: gateway_http.host: must be an IP address or a host name to "
        "listen on (127.0.0.1, 0.0.0.0, ::, localhost), without a scheme or a port (that is "
        "gateway_http.port)"
    )


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "localhost", "gw-1.internal"])
def test_a_gateway_host_naming_an_address_loads(host):
    assert load_config(TINY, {"gateway_http": {"port": 0, "host": host}}).gateway_http.host == host


@pytest.mark.parametrize("address", ["http://10.0.0.1:8265", "HTTPS://ray.example.com"])
def test_a_ray_address_over_http_is_refused_at_load(address):
    """The dashboard's job-submission address (RAY_ADDRESS=http://head:8265 for ``ray job
    submit``) is no address a driver joins: Ray refused it once the warm start and the first
    evaluation were over."""
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, {"cluster": "ray", "ray_address": address})
    assert str(refused.value) == (
        f"invalid run config {TINY}: ray_address: an http(s):// address is the Ray dashboard's, for "
        "job submission, which a run cannot join: give the Ray client's ray://head:10001, the head's "
        "head:6379, or 'auto' on a node of the cluster"
    )
