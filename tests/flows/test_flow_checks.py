"""The train, rollout and evaluate flows check what they use in their own process as they
start, as a run started from a deployment's form does (the command line refuses it before
a flow run starts): a device this machine lacks (no machine shows 100 GPUs), a missing
local path, a Ray cluster without the ray extra, agent tasks none of which falls in a split
the flow draws from, a scheduler asking for more cores than the process may use. Each fails the run at once with one line
naming the field, before the warm start or the download of a weight version."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile

import pytest
import torch
import yaml
from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

import flows.demo
import flows.evaluate
import flows.pipeline
import flows.rollout
import flows.train
from envs.agent import GATEWAY_SOCKET, SOCKET_PATH_MAX
from envs.base import in_eval_split
from envs.dataset import DatasetConfig
from envs.sandbox import Sandbox, SandboxConfig, folder_path_bytes
from flows.config import (
    WARM_START_DEVICE,
    Replacement,
    _float32_bytes,
    _merge,
    evaluate_devices,
    evaluate_paths,
    missing_cores,
    missing_gateway_token,
    missing_path,
    missing_sandbox_root,
    pipeline_devices,
    reward_not_one_label,
    reward_over_budget,
    rollout_devices,
    rollout_problem,
    too_few_demos,
    train_paths,
    unreachable_ray,
)
from rollout.resources import state_bytes
from storage.tables import Tables
from tasks.common import run_store
from tasks.weights import build_base_version
from tests.flows.conftest import tiny_config

NO_WARM_START = {"enabled": False}


def failed_with(state, pattern: str) -> None:
    assert state.is_failed()
    with pytest.raises(ValueError, match=pattern):
        state.result()


JUDGED_ARITH = {"arith": {"reward_model": "judge"}}
"""arith scored by reward model 'judge': a run loads (and checks) only the reward models its envs name."""


def reward_on_a_missing_gpu(tmp_path) -> dict:
    """Overrides serving arith's reward model on a CUDA device this machine lacks."""
    service = {"reward_models": {"judge": {"path": str(tmp_path)}}, "reward_device": "cuda:99"}
    return {"service": service, "envs": JUDGED_ARITH}


@pytest.mark.parametrize("cluster", ["local", "ray"])
def test_a_train_run_on_a_cuda_device_the_machine_lacks_fails_before_the_warm_start(tmp_path, cluster):
    """The nightly training of a run on a worker without its GPU failed only once the warm
    start was over; with cluster 'ray' the train flow still trains in its own process."""
    config = tiny_config(tmp_path / "runs", "no-such-gpu", trainer_device="cuda:99", cluster=cluster)
    failed_with(
        flows.train.train(config, drain=True, return_state=True),
        r"^trainer_device is 'cuda:99', but this machine shows ",
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize(
    ("field", "overrides"),
    [
        ("engine.torch.device", {"engine": {"torch": {"device": "cuda:99"}}}),
        ("service.reward_device", {"service": "reward"}),
    ],
)
def test_a_rollout_run_on_a_cuda_device_the_machine_lacks_fails_before_the_warm_start(
    tmp_path, field, overrides
):
    """Its engines and its reward models run in its own process with cluster 'local'."""
    if overrides.get("service") == "reward":
        overrides = reward_on_a_missing_gpu(tmp_path)
    config = tiny_config(tmp_path / "runs", "no-such-gpu", warm_start=NO_WARM_START, **overrides)
    failed_with(
        flows.rollout.rollout(config, return_state=True), rf"^{field} is 'cuda:99', but this machine shows "
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_a_rollout_run_that_would_warm_start_on_a_cuda_device_the_machine_lacks_fails_before_it(tmp_path):
    """A rollout worker of a run with no weight version warm-starts it in its own process, on
    the trainer's device: that failed in the warm start with torch's error, unchecked."""
    config = tiny_config(tmp_path / "runs", "no-such-gpu", trainer_device="cuda:99")
    failed_with(
        flows.rollout.rollout(config, return_state=True),
        r"^trainer_device \(the warm start's, as the run has no weight version yet\) is 'cuda:99', but this "
        "machine shows ",
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_a_worker_checks_the_trainers_device_only_where_it_would_warm_start(tmp_path):
    """On Ray the pipeline's trainer runs on a cluster node, but its warm start in the
    pipeline's own process; a run that has a weight version, or a warm start turned off,
    trains nothing in a rollout worker's or a Ray pipeline's process."""
    fresh = tiny_config(tmp_path / "runs", "no-such-gpu", trainer_device="cuda:99", cluster="ray")
    assert rollout_devices(fresh) == {WARM_START_DEVICE: "cuda:99"}
    assert pipeline_devices(fresh) == {"engine.torch.device": "cpu", WARM_START_DEVICE: "cuda:99"}
    off = fresh.model_copy(update={"warm_start": fresh.warm_start.model_copy(update={"enabled": False})})
    assert rollout_devices(off) == {}
    build_base_version(off.model_copy(update={"trainer_device": "cpu"}), log=lambda line: None)
    assert rollout_devices(fresh) == {}
    assert pipeline_devices(fresh) == {"engine.torch.device": "cpu"}


@pytest.mark.parametrize("missing", ["ray", "prefect_ray"])
def test_a_ray_rollout_run_on_a_machine_without_the_ray_extra_fails_before_the_warm_start(
    tmp_path, monkeypatch, missing
):
    """It failed with ``No module named 'ray'`` once the warm start was over."""
    monkeypatch.setitem(sys.modules, missing, None)  # its import then fails as if not installed
    config = tiny_config(tmp_path / "runs", "no-ray", cluster="ray", warm_start=NO_WARM_START)
    failed_with(
        flows.rollout.rollout(config, return_state=True),
        rf"^cluster is 'ray', but {missing} is not installed: pip install",
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize("flow", ["pipeline", "rollout"])
def test_a_ray_run_at_an_address_nothing_answers_fails_before_the_warm_start(tmp_path, flow):
    """The pipeline failed with Ray's traceback once the warm start and the first evaluation
    were over (a rollout worker once the warm start was)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound but not listening: connections are refused
        address = f"ray://127.0.0.1:{closed.getsockname()[1]}"
        config = tiny_config(tmp_path / "runs", "no-cluster", cluster="ray", ray_address=address)
        run = getattr(flows, flow)
        failed_with(
            getattr(run, flow)(config, return_state=True),
            rf"^nothing answers at ray_address {address} \(Connection refused\)",
        )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize("case", ["gateway-token", "ray-address"])
def test_the_demo_command_refuses_in_one_line_what_the_pipeline_command_refuses(
    tmp_path, monkeypatch, capsys, case
):
    """``make demo`` runs the pipeline flow, but its command line checked less than the
    pipeline's: a run serving the gateway without its token, or on a Ray address nothing
    answers at, started a flow run that failed with a traceback."""
    monkeypatch.setattr(flows.demo, "_ui_running", lambda: False)
    monkeypatch.delenv("T_GATEWAY", raising=False)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound but not listening: connections are refused
        address = f"ray://127.0.0.1:{closed.getsockname()[1]}"
        sets, said = {
            "gateway-token": (
                ["gateway_http.port=0", "gateway_http.token_env=T_GATEWAY"],
                "error: gateway_http.port is set",
            ),
            "ray-address": (
                ["cluster=ray", f"ray_address={address}"],
                f"error: nothing answers at ray_address {address}",
            ),
        }[case]
        sets = [f"storage.root={tmp_path}/runs", *sets]
        with pytest.raises(SystemExit) as exited:
            flows.demo.main([arg for field in sets for arg in ("--set", field)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_a_ray_client_address_without_a_port_is_tried_at_the_ray_clients_port(tmp_path):
    with socket.socket() as client_server:
        client_server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            client_server.bind(("127.0.0.1", 10001))
        except OSError:
            pytest.skip("port 10001 is taken on this machine")
        client_server.listen()
        config = tiny_config(tmp_path / "runs", "ray-client", cluster="ray", ray_address="ray://127.0.0.1")
        assert unreachable_ray(config) is None


@pytest.mark.parametrize("address", ["auto", "local", "127.0.0.1"])
def test_a_ray_address_naming_no_cluster_port_is_left_to_ray(tmp_path, address):
    """'auto' and 'local' have Ray find or start the cluster; a head's address without a port
    (only a ray:// one has a default, the Ray client's 10001) names none to try here."""
    config = tiny_config(tmp_path / "runs", "ray-finds-it", cluster="ray", ray_address=address)
    assert unreachable_ray(config) is None


@pytest.mark.parametrize(
    ("field", "overrides"),
    [
        ("engine.torch.device", {"engine": {"torch": {"device": "cuda:99"}}}),
        ("service.reward_device", {"service": "reward"}),
    ],
)
def test_an_evaluate_run_on_a_cuda_device_the_machine_lacks_fails_before_it_loads_the_version(
    tmp_path, field, overrides
):
    """The evaluation engine and the reward models that score its episodes run in its own
    process; the reward models' device was not checked at all, the engine's only on the
    command line."""
    if overrides.get("service") == "reward":
        overrides = reward_on_a_missing_gpu(tmp_path)
    config = tiny_config(tmp_path / "runs", "no-such-gpu", warm_start=NO_WARM_START, **overrides)
    build_base_version(config, log=lambda line: None)
    failed_with(
        flows.evaluate.evaluate(config, return_state=True), rf"^{field} is 'cuda:99', but this machine shows "
    )


@pytest.mark.parametrize(
    "run",
    [
        lambda config: flows.train.train(config, return_state=True),
        lambda config: flows.rollout.rollout(config, return_state=True),
    ],
    ids=["train", "rollout"],
)
def test_a_flow_run_whose_model_path_is_missing_fails_before_the_warm_start(tmp_path, run):
    """A path that cannot be a Hugging Face model id either: it failed at the warm start's
    load, retried as transient."""
    missing = str(tmp_path / "no-such-checkpoint")
    config = tiny_config(tmp_path / "runs", "no-checkpoint", model={"path": missing})
    failed_with(
        run(config), rf"^model.path '{missing}' is neither a local directory nor a Hugging Face model id"
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_a_missing_model_path_is_no_reason_to_refuse_a_run_that_has_a_weight_version(tmp_path):
    """model.path is read only by the warm start of a run with no version: a trainer or a
    rollout worker of a run that has one, on a machine without the base checkpoint's folder
    (versions on shared storage), was refused for it, as it would never read it."""
    config = tiny_config(tmp_path / "runs", "moved-checkpoint", warm_start=NO_WARM_START)
    moved = config.model_copy(
        update={"model": config.model.model_copy(update={"path": str(tmp_path / "moved")})}
    )
    assert missing_path(moved).startswith("model.path ")
    build_base_version(config, log=lambda line: None)
    assert missing_path(moved) is None and train_paths(moved) is None


def test_a_rollout_run_whose_reward_model_is_missing_fails_before_the_warm_start(tmp_path):
    """Its rollout service loads the reward models as it starts, once the warm start is over."""
    missing = str(tmp_path / "no-such-judge")
    config = tiny_config(
        tmp_path / "runs",
        "no-judge",
        warm_start=NO_WARM_START,
        service={"reward_models": {"judge": {"path": missing}}},
        envs=JUDGED_ARITH,
    )
    failed_with(
        flows.rollout.rollout(config, return_state=True),
        rf"^service.reward_models.judge.path '{missing}' is neither a local directory",
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_the_reward_device_of_a_model_no_env_of_the_mix_names_is_not_checked(tmp_path):
    """The rollout service loads no such model: a device this machine lacks for it refuses nothing."""
    served = reward_on_a_missing_gpu(tmp_path)
    assert rollout_devices(tiny_config(tmp_path / "runs", **served))["service.reward_device"] == "cuda:99"
    unused = tiny_config(tmp_path / "runs", service=served["service"])
    assert "service.reward_device" not in rollout_devices(unused)


@pytest.mark.parametrize(
    "run",
    [
        lambda config: flows.pipeline.pipeline(config, return_state=True),
        lambda config: flows.rollout.rollout(config, return_state=True),
    ],
    ids=["pipeline", "rollout"],
)
def test_a_flow_run_whose_sandbox_folder_is_missing_fails_before_the_warm_start(tmp_path, run):
    """The env's every sandbox is made under ``sandbox.root_dir``: each rollout of it was an
    env_error, and the pipeline failed at its first evaluation, once the warm start was over."""
    missing = str(tmp_path / "no-such-folder")
    config = tiny_config(
        tmp_path / "runs",
        "no-sandbox-folder",
        envs={"code": {"sandbox": {"root_dir": missing}}},
        orchestrator={"mix": {"arith": 0.5, "code": 0.5}},
    )
    failed_with(run(config), rf"^envs.code.sandbox.root_dir '{missing}' is not a folder$")
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_a_sandbox_folder_is_checked_only_for_an_env_that_makes_sandboxes(tmp_path):
    """arith makes none: a root_dir set on it (a YAML anchor shared by every env) that is not
    there refuses nothing. On Ray the sandboxes are made on the env actors' nodes: a folder
    this machine lacks refuses nothing either."""
    config = tiny_config(tmp_path / "runs", envs={"arith": {"sandbox": {"root_dir": str(tmp_path / "none")}}})
    assert missing_sandbox_root(config) is None
    code = {
        "envs": {"code": {"sandbox": {"root_dir": str(tmp_path / "none")}}},
        "orchestrator": {"mix": {"code": 1.0}},
    }
    assert missing_sandbox_root(tiny_config(tmp_path / "runs", cluster="ray", **code)) is None
    assert missing_sandbox_root(tiny_config(tmp_path / "runs", **code)).endswith("is not a folder")


def test_an_agent_whose_sandbox_folders_are_too_deep_for_its_gateway_socket_is_refused_at_the_byte(tmp_path):
    """Its program reaches the gateway through a Unix socket in its sandbox folder, whose path
    a socket address holds up to 107 bytes: past that every rollout failed ('AF_UNIX path too
    long'). A root_dir whose socket path is 107 bytes binds; one byte longer is refused."""
    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        room = SOCKET_PATH_MAX - (folder_path_bytes(short) + 1 + len(GATEWAY_SOCKET))
        if room < 2:
            pytest.skip(f"{short} leaves no room for a sandbox folder under it")
        fits, too_long = os.path.join(short, "d" * (room - 1)), os.path.join(short, "d" * room)
        for root in (fits, too_long):
            os.mkdir(root)

        def config(root: str):
            run = agent_with_tasks([f"t{i}" for i in range(20)], 0.25)
            run["envs"]["agent"]["sandbox"] = {"root_dir": root}
            return tiny_config(tmp_path / "runs", **run)

        assert missing_sandbox_root(config(fits)) is None
        assert missing_sandbox_root(config(too_long)) == (
            f"envs.agent: sandbox.root_dir {too_long!r} is too long for the gateway socket in its sandbox "
            f"folders: its path would be {SOCKET_PATH_MAX + 1} bytes, over the {SOCKET_PATH_MAX} a Unix "
            "socket address holds; use a root_dir 1 byte shorter"
        )
        for root, binds in ((fits, True), (too_long, False)):
            with (
                Sandbox(SandboxConfig(backend="process", root_dir=root)) as box,
                socket.socket(socket.AF_UNIX) as s,
            ):
                path = os.path.join(box.workdir, GATEWAY_SOCKET)
                if binds:
                    s.bind(path)
                else:
                    with pytest.raises(OSError, match="AF_UNIX path too long"):
                        s.bind(path)


def test_an_evaluate_run_needs_no_starting_checkpoint(tmp_path, capsys):
    """It evaluates a published version: a ``model.path`` this machine lacks (the trainer's
    machine held it) is no reason to refuse it, on the command line or in the flow."""
    config = tiny_config(tmp_path / "runs", "eval-elsewhere", warm_start=NO_WARM_START)
    build_base_version(config, log=lambda line: None)
    overrides = {
        "storage.root": tmp_path / "runs",
        "model.path": tmp_path / "trainer-only",
        "eval.tasks_per_env": 4,
        "service.max_new_tokens": 8,
    }
    argv = ["--run-id", "eval-elsewhere"] + [f"--set={key}={value}" for key, value in overrides.items()]
    flows.evaluate.main(argv)
    printed = capsys.readouterr().out
    assert printed.startswith("{'version': 0, 'reward': {"), printed
    assert Tables(run_store(config)).read("evals").column("version").to_pylist() == [0] * len(
        config.orchestrator.mix
    )


CODE_ONLY = {"orchestrator": {"mix": Replacement({"code": 1.0})}, "warm_start": {"demos_per_env": 2000}}
"""A run warm-starting on 2000 demonstrations of code, whose train split holds 327 tasks."""


@pytest.mark.parametrize(
    "run",
    [
        lambda config: flows.pipeline.pipeline(config, return_state=True),
        lambda config: flows.rollout.rollout(config, return_state=True),
        lambda config: flows.train.train(config, return_state=True),
    ],
    ids=["pipeline", "rollout", "train"],
)
def test_a_flow_run_asking_more_demonstrations_than_an_env_holds_fails_before_the_warm_start(tmp_path, run):
    """The default demos_per_env asks code for 2000 of its 327 train tasks: the run failed at
    its warm start, once the flow (and on Ray the cluster) had started."""
    config = tiny_config(tmp_path / "runs", "code-demos", **CODE_ONLY)
    failed_with(
        run(config),
        r"^warm_start.demos_per_env \(2000\) asks for more demonstrations of code than the 327 distinct "
        r"tasks its train split holds; set warm_start.demos.code to at most 327 \(0 leaves it out\) or "
        r"turn warm_start off$",
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize(
    "main", [flows.train.main, flows.pipeline.main, flows.rollout.main], ids=["train", "pipeline", "rollout"]
)
def test_a_flow_command_asking_more_demonstrations_than_an_env_holds_exits_in_one_line(
    tmp_path, capsys, main
):
    with pytest.raises(SystemExit) as exited:
        main(
            ["--set", "orchestrator.mix={code: 1.0}", "--set", "warm_start.demos={code: 400}"]
            + ["--set", f"storage.root={tmp_path}/runs"]
        )
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "error: warm_start.demos.code (400) asks for more demonstrations of code than the 327 distinct "
        "tasks its train split holds; set warm_start.demos.code to at most 327 (0 leaves it out) or turn "
        "warm_start off\n"
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize(
    "overrides",
    [
        {"warm_start": {"demos": {"code": 327}}},  # every train task, each once
        {"warm_start": {"enabled": False}},
        {
            "orchestrator": {"mix": Replacement({"code": 1.0, "guess": 1.0})},
            "warm_start": {"demos": {"code": 0}},
        },
        {
            "orchestrator": {"mix": Replacement({"arith": 1.0})},
            "envs": {"arith": {"max_operand": 3}},
            "warm_start": {"demos_per_env": 16},
        },
    ],
    ids=["all-code-tasks", "no-warm-start", "code-left-out", "arith-holds-enough"],
)
def test_demonstrations_an_env_gives_are_not_refused(tmp_path, overrides):
    """guess repeats its problems by design: any number of its demonstrations is drawn; arith
    with max_operand 3 holds 16 train sums, as many as the 16 asked for."""
    config = tiny_config(tmp_path / "runs", "demos-fit", **_merge(CODE_ONLY, overrides))
    assert too_few_demos(config) is None


def test_an_env_asked_for_more_demonstrations_than_its_train_split_holds_is_refused(tmp_path):
    """arith with max_operand 3 holds 16 distinct train sums: 17 of them are refused."""
    config = tiny_config(
        tmp_path / "runs",
        "few-sums",
        orchestrator={"mix": Replacement({"arith": 1.0})},
        envs={"arith": {"max_operand": 3}},
        warm_start={"demos_per_env": 17},
    )
    assert too_few_demos(config).startswith(
        "warm_start.demos_per_env (17) asks for more demonstrations of arith than the 16 distinct tasks"
    )


def test_a_run_that_has_a_weight_version_is_not_refused_demonstrations_it_does_not_warm_start_on(
    tmp_path,
):
    """A rerun of a run (or a flow resuming it) starts from its weight version and plays no
    demonstration, yet it was refused more of code than its train split holds, on the command
    line and in the flow; a garbled ``LATEST`` the warm start points at a complete version
    counts, and a new run of the same storage is still refused, as is one whose garbled
    ``LATEST`` names nothing the warm start could take."""
    from flows.cli_args import parse

    build_base_version(
        tiny_config(tmp_path / "runs", "code-rerun", warm_start=NO_WARM_START), log=lambda line: None
    )
    config = tiny_config(tmp_path / "runs", "code-rerun", **CODE_ONLY)
    assert too_few_demos(config) is None
    argv = ["--run-id", "code-rerun", "--set", f"storage.root={tmp_path}/runs"]
    argv += ["--set", "orchestrator.mix={code: 1.0}", "--set", "warm_start.demos_per_env=2000"]
    assert parse("train", argv, warm_starts=True)[0].run_id == "code-rerun"
    (tmp_path / "runs" / "code-rerun" / "weights" / "LATEST").write_text("garbled\n")
    assert too_few_demos(config) is None
    refused = "warm_start.demos_per_env (2000) asks for more demonstrations of code"
    assert too_few_demos(tiny_config(tmp_path / "runs", "code-new", **CODE_ONLY)).startswith(refused)
    (tmp_path / "runs" / "code-garbled" / "weights").mkdir(parents=True)
    (tmp_path / "runs" / "code-garbled" / "weights" / "LATEST").write_text("garbled\n")
    assert too_few_demos(tiny_config(tmp_path / "runs", "code-garbled", **CODE_ONLY)).startswith(refused)


def test_demonstrations_are_not_refused_on_a_store_that_does_not_answer(tmp_path, monkeypatch):
    """Whether the run has a weight version is unknown: its flow command then says why the
    store does not answer (:func:`flows.cli.weight_versions`), where a refusal of its
    demonstrations would have sent a rerun to change a setting it does not use."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key-id-123")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-456")
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        storage = {"root": "s3://bucket/runs", "endpoint_url": f"http://127.0.0.1:{closed.getsockname()[1]}"}
        assert (
            too_few_demos(tiny_config(tmp_path / "runs", "code-away", storage=storage, **CODE_ONLY)) is None
        )


def agent_with_tasks(ids: list[str], eval_fraction: float) -> dict:
    """An agent-only run on the tasks ``ids``, split by ``eval_fraction``."""
    tasks = [{"id": task_id, "prompt": "p"} for task_id in ids]
    agent = {"command": "true", "eval_command": "echo 1", "eval_fraction": eval_fraction, "tasks": tasks}
    return {"orchestrator": {"mix": {"agent": 1.0}}, "warm_start": NO_WARM_START, "envs": {"agent": agent}}


@pytest.mark.parametrize(
    ("ids", "eval_fraction", "run", "split"),
    [
        # with 0.1 each of t0..t19 is a train task; with 0.25, t7 and t16 are eval tasks
        (["t0", "t1", "t2"], 0.1, lambda config: flows.pipeline.pipeline(config, return_state=True), "eval"),
        (["t7", "t16"], 0.25, lambda config: flows.pipeline.pipeline(config, return_state=True), "train"),
        (["t7", "t16"], 0.25, lambda config: flows.rollout.rollout(config, return_state=True), "train"),
        (["t0", "t1", "t2"], 0.1, lambda config: flows.evaluate.evaluate(config, return_state=True), "eval"),
    ],
    ids=["pipeline-no-eval", "pipeline-no-train", "rollout-no-train", "evaluate-no-eval"],
)
def test_a_flow_run_whose_agent_tasks_leave_a_split_it_draws_from_empty_fails_before_the_warm_start(
    tmp_path, ids, eval_fraction, run, split
):
    """Twenty agent tasks held none out with the default eval_fraction: the pipeline failed
    with "agent env has no eval tasks" at its first evaluation, once the warm start was over."""
    config = tiny_config(tmp_path / "runs", "agent-split", **agent_with_tasks(ids, eval_fraction))
    failed_with(
        run(config),
        rf"^envs.agent: none of its {len(ids)} tasks falls in the {split} split "
        rf"\(eval_fraction {eval_fraction}, by a hash of each id\): add tasks",
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize(
    ("main", "ids", "split"),
    [
        (flows.pipeline.main, ["t0", "t1", "t2"], "eval"),
        (flows.pipeline.main, ["t7", "t16"], "train"),
        (flows.rollout.main, ["t7", "t16"], "train"),
        (flows.evaluate.main, ["t0", "t1", "t2"], "eval"),
        (flows.demo.main, ["t7", "t16"], "train"),
    ],
    ids=["pipeline-no-eval", "pipeline-no-train", "rollout-no-train", "evaluate-no-eval", "demo-no-train"],
)
def test_a_flow_command_whose_agent_tasks_leave_a_split_it_draws_from_empty_exits_in_one_line(
    tmp_path, capsys, main, ids, split
):
    """Refused by the command line as the other checks are, before a flow run starts."""
    fraction = 0.25 if split == "train" else 0.1
    config = tmp_path / "agent.yaml"
    config.write_text(
        yaml.safe_dump({"storage": {"root": str(tmp_path / "runs")}, **agent_with_tasks(ids, fraction)})
    )
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(config)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: envs.agent: none of its {len(ids)} tasks falls in the {split} split"), err
    assert err.count("\n") == 1
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def beyond_this_process() -> int:
    """One core more than this process may use."""
    return len(os.sched_getaffinity(0)) + 1


def asking_too_many_cores(case: str, cores: int | None = None) -> tuple[dict, str]:
    """A config section that asks the rollout scheduler for more cores than this process may
    use (or for ``cores``), by ``case``, and the field the refusal names."""
    cores = cores or beyond_this_process()
    if case == "scheduler_cores":
        return {"service": {"scheduler_cores": cores}}, "service.scheduler_cores"
    if case == "static_cores":
        return {"service": {"scheduler": "static", "scheduler_static_cores": cores}}, (
            "service.scheduler_static_cores"
        )
    agent = agent_with_tasks(["t0", "t1", "t7", "t16"], 0.25)
    agent["envs"]["agent"]["action_cores"] = cores
    return agent, "envs.agent.action_cores"


@pytest.mark.parametrize(
    ("run", "case"),
    [
        (lambda config: flows.pipeline.pipeline(config, return_state=True), "action_cores"),
        (lambda config: flows.rollout.rollout(config, return_state=True), "scheduler_cores"),
        (lambda config: flows.evaluate.evaluate(config, return_state=True), "static_cores"),
    ],
    ids=["pipeline", "rollout", "evaluate"],
)
def test_a_flow_run_whose_scheduler_asks_for_more_cores_than_the_process_has_fails_before_the_warm_start(
    tmp_path, run, case
):
    """The scheduler refused pinned cores the process lacks, or a static reservation past
    them, as the rollout service started, after the warm start; an agent's action past them
    was refused action by action, every rollout an env_error."""
    overrides, field = asking_too_many_cores(case)
    config = tiny_config(tmp_path / "runs", "few-cores", **{"warm_start": NO_WARM_START, **overrides})
    failed_with(
        run(config),
        rf"^{field} \({beyond_this_process()}\) exceeds the {beyond_this_process() - 1} cores? this "
        "process may use",
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize(
    ("main", "case"),
    [
        (flows.pipeline.main, "scheduler_cores"),
        (flows.rollout.main, "static_cores"),
        (flows.evaluate.main, "action_cores"),
        (flows.demo.main, "action_cores"),
    ],
    ids=["pipeline", "rollout", "evaluate", "demo"],
)
def test_a_flow_command_whose_scheduler_asks_for_more_cores_than_the_process_has_exits_in_one_line(
    tmp_path, capsys, main, case
):
    overrides, field = asking_too_many_cores(case)
    config = tmp_path / "cores.yaml"
    config.write_text(yaml.safe_dump({"storage": {"root": str(tmp_path / "runs")}, **overrides}))
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(config)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field} ({beyond_this_process()}) exceeds the "), err
    assert err.count("\n") == 1
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize("case", ["scheduler_cores", "static_cores", "action_cores"])
def test_a_scheduler_asking_for_every_core_the_process_has_is_not_refused(tmp_path, case):
    overrides, _ = asking_too_many_cores(case, cores=len(os.sched_getaffinity(0)))
    config = tiny_config(tmp_path / "runs", "every-core", **{"warm_start": NO_WARM_START, **overrides})
    assert missing_cores(config) is None


@pytest.mark.parametrize(
    "service",
    [
        {"scheduler_cores": 10_000, "scheduler_pin": False},
        {"scheduler": "none", "scheduler_cores": 10_000},
        {
            "scheduler_cores": 10_000,
            "scheduler_pin": False,
            "scheduler": "static",
            "scheduler_static_cores": 10_000,
        },
    ],
    ids=["unpinned", "no-scheduler", "unpinned-static"],
)
def test_cores_the_scheduler_hands_out_without_pinning_them_may_exceed_the_process(tmp_path, service):
    """Unpinned, they are the scheduler's count, not the machine's (many sandboxes share a core)."""
    agent = agent_with_tasks(["t0", "t1", "t7", "t16"], 0.25)
    agent["envs"]["agent"]["action_cores"] = 10_000
    config = tiny_config(tmp_path / "runs", "unpinned", **agent, service=service)
    assert missing_cores(config) is None


def dataset_only(path) -> dict:
    """A run on the dataset at ``path`` alone."""
    return {
        "orchestrator": {"mix": {"dataset": 1.0}},
        "warm_start": NO_WARM_START,
        "envs": {"dataset": {"path": str(path)}},
    }


def rows_of_one_split(split: str, count: int) -> list[dict]:
    """``count`` rows whose prompts all fall in ``split`` at the default eval_fraction."""
    prompts = (f"{i}+1=" for i in range(10_000))
    chosen = [p for p in prompts if in_eval_split(p, DatasetConfig().eval_fraction) == (split == "eval")]
    return [{"prompt": prompt, "answer": "1"} for prompt in chosen[:count]]


@pytest.mark.parametrize(
    ("rows", "run", "problem"),
    [
        (
            rows_of_one_split("train", 5),
            lambda config: flows.pipeline.pipeline(config, return_state=True),
            r"none of the 5 rows of .*rows.jsonl falls in the eval split \(eval_fraction 0.1, by a hash of "
            r"each prompt\): add rows",
        ),
        (
            rows_of_one_split("eval", 3),
            lambda config: flows.rollout.rollout(config, return_state=True),
            r"none of the 3 rows of .*rows.jsonl falls in the train split",
        ),
        (
            [{"prompt": "1+1="}],
            lambda config: flows.evaluate.evaluate(config, return_state=True),
            r"line 1 of .*rows.jsonl has no field 'answer' \(fields: \['prompt'\]\)",
        ),
    ],
    ids=["pipeline-no-eval", "rollout-no-train", "evaluate-no-answer"],
)
def test_a_flow_run_whose_dataset_cannot_give_a_task_it_draws_fails_before_the_warm_start(
    tmp_path, rows, run, problem
):
    """A few rows may hold none out (the split is a hash of each prompt): the pipeline failed
    with "the eval split of … is empty" at its first evaluation, once the warm start was over;
    a row without its answer, as the first task was drawn."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tiny_config(tmp_path / "runs", "dataset-split", **dataset_only(path))
    failed_with(run(config), rf"^envs.dataset: {problem}")
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_a_flow_command_whose_dataset_file_does_not_read_exits_in_one_line(tmp_path, capsys):
    """A file that does not read is no ValueError of the env's: the command's one line names it all the same."""
    path = tmp_path / "rows.jsonl"
    path.mkdir()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"storage": {"root": str(tmp_path / "runs")}, **dataset_only(path)}))
    with pytest.raises(SystemExit) as exited:
        flows.rollout.main(["--config", str(config)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"error: envs.dataset: train tasks could not be drawn: IsADirectoryError: [Errno 21] Is a directory: "
        f"{str(path)!r}\n"
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize("main", [flows.pipeline.main, flows.evaluate.main])
def test_a_flow_command_whose_guess_range_holds_no_eval_problem_exits_in_one_line(tmp_path, capsys, main):
    """One window as wide as the range holds every problem in train."""
    config = tmp_path / "guess.yaml"
    guess = {"low": 1, "high": 8, "min_width": 8, "max_width": 8}
    config.write_text(
        yaml.safe_dump(
            {
                "storage": {"root": str(tmp_path / "runs")},
                "orchestrator": {"mix": {"guess": 1.0}},
                "envs": {"guess": guess},
            }
        )
    )
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(config)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: envs.guess: the eval split of guess 1-8 is empty; widen the range\n"
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    """A one-label sequence-classification checkpoint (no tokenizer: the checks read no more)."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("judge")
    LlamaForSequenceClassification(config).save_pretrained(path)
    return path


def test_a_checkpoints_size_read_from_its_headers_is_at_most_what_it_holds_loaded(judge):
    """What the rollout service measures once it loads the model: its float32 tensors, plus
    the buffers no checkpoint stores (rotary frequencies)."""
    loaded = state_bytes(AutoModelForSequenceClassification.from_pretrained(judge, dtype=torch.float32))
    read = _float32_bytes(judge)
    assert loaded - 1024 <= read <= loaded


@pytest.mark.parametrize(
    "run",
    [
        lambda config: flows.pipeline.pipeline(config, return_state=True),
        lambda config: flows.rollout.rollout(config, return_state=True),
        lambda config: flows.evaluate.evaluate(config, return_state=True),
    ],
    ids=["pipeline", "rollout", "evaluate"],
)
def test_a_flow_run_whose_reward_model_outgrows_its_budget_fails_before_the_warm_start(tmp_path, judge, run):
    """The rollout service refused it as it loaded the models, after the warm start."""
    service = {"reward_models": {"judge": {"path": str(judge)}}, "reward_budget_mb": 0.01}
    config = tiny_config(
        tmp_path / "runs",
        "judge-too-big",
        warm_start=NO_WARM_START,
        service=service,
        envs={"arith": {"reward_model": "judge"}},
    )
    megabytes = _float32_bytes(judge) / 2**20
    failed_with(
        run(config),
        rf"^reward model 'judge' needs {megabytes:.2f} MB on its device, more than service.reward_budget_mb \(0.01\)$",
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


def test_a_flow_command_whose_reward_model_outgrows_its_budget_exits_in_one_line(tmp_path, judge, capsys):
    service = {"reward_models": {"judge": {"path": str(judge)}}, "reward_budget_mb": 0.01}
    config = tmp_path / "judge.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "storage": {"root": str(tmp_path / "runs")},
                "service": service,
                "envs": {"arith": {"reward_model": "judge"}},
            }
        )
    )
    with pytest.raises(SystemExit) as exited:
        flows.pipeline.main(["--config", str(config)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("error: reward model 'judge' needs ")
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize("labels", [2, 3])
def test_a_flow_command_whose_reward_model_has_more_than_one_label_exits_in_one_line(
    tmp_path, labels, capsys
):
    """The rollout service refused it as it loaded the models: after the warm start, with the
    evaluation's traceback. Two labels are the default a config.json leaves unsaid."""
    judge = tmp_path / "judge"
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=labels,
        pad_token_id=0,
    )
    LlamaForSequenceClassification(config).save_pretrained(judge)
    capsys.readouterr()  # the save's progress bar
    run = tmp_path / "judge.yaml"
    run.write_text(
        yaml.safe_dump(
            {
                "storage": {"root": str(tmp_path / "runs")},
                "service": {"reward_models": {"judge": {"path": str(judge)}}},
                "envs": {"arith": {"reward_model": "judge"}},
            }
        )
    )
    with pytest.raises(SystemExit) as exited:
        flows.pipeline.main(["--config", str(run)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"error: reward model 'judge' at {judge} has {labels} labels; a reward model has one "
        "(its logit is the reward)\n"
    )
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"


@pytest.mark.parametrize(
    "service",
    [{"reward_budget_mb": 10.0}, {}, {"reward_budget_mb": 0.01, "scheduler": "static"}],
    ids=["fits", "no-budget", "static-pins-every-model"],
)
def test_a_reward_model_within_its_budget_or_with_none_set_is_not_refused(tmp_path, judge, service):
    config = tiny_config(
        tmp_path / "runs",
        "judge-fits",
        service={"reward_models": {"judge": {"path": str(judge)}}, **service},
        envs=JUDGED_ARITH,
    )
    assert reward_over_budget(config) is None


def test_a_reward_model_is_refused_past_its_budget_at_the_byte(tmp_path, judge):
    size = _float32_bytes(judge)

    def budgeted(budget_bytes: int):
        service = {"reward_models": {"judge": {"path": str(judge)}}, "reward_budget_mb": budget_bytes / 2**20}
        return tiny_config(tmp_path / "runs", "judge-budget", service=service, envs=JUDGED_ARITH)

    assert reward_over_budget(budgeted(size)) is None
    assert reward_over_budget(budgeted(size - 1)).startswith("reward model 'judge' needs ")


def test_a_reward_model_no_env_of_the_mix_names_blocks_no_run_and_is_checked_once_one_does(tmp_path, judge):
    """The rollout service loads only the reward models an env of the mix names: one for
    an env out of the mix (pytool) or for none, missing or with two labels past the budget,
    refused the run all the same."""
    wide = tmp_path / "wide"
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=2,
        pad_token_id=0,
    )
    LlamaForSequenceClassification(config).save_pretrained(wide)
    reward_models = {
        "judge": {"path": str(judge)},
        "wide": {"path": str(wide)},
        "absent": {"path": str(tmp_path / "no-such-judge")},
    }
    service = {"reward_models": reward_models, "reward_budget_mb": 1.01 * _float32_bytes(judge) / 2**20}
    envs = {"arith": {"reward_model": "judge"}, "pytool": {"reward_model": "wide"}}
    config = tiny_config(tmp_path / "runs", "spare-judges", service=service, envs=envs)
    assert missing_path(config) is None
    assert rollout_problem(config, ("train", "eval")) is None
    on_gpu = tiny_config(
        tmp_path / "runs", "spare-judge-gpu", service=reward_on_a_missing_gpu(tmp_path)["service"]
    )
    assert rollout_devices(on_gpu) == evaluate_devices(on_gpu) == {"engine.torch.device": "cpu"}

    used = tiny_config(
        tmp_path / "runs", "wide-judge", service=service, envs={"guess": {"reward_model": "wide"}}
    )
    assert rollout_problem(used, ("train",)).startswith("reward model 'wide' needs ")
    assert reward_not_one_label(used).startswith("reward model 'wide' at ")
    used = tiny_config(
        tmp_path / "runs", "absent-judge", service=service, envs={"guess": {"reward_model": "absent"}}
    )
    assert missing_path(used).startswith("service.reward_models.absent.path ")


def test_a_dataset_no_env_of_the_mix_draws_from_blocks_no_run_and_is_checked_once_one_does(tmp_path):
    """Every flow draws its tasks from the envs of the mix: a dataset file set for a run whose
    mix leaves ``dataset`` out is read by none, yet its absence refused the run."""
    absent = tmp_path / "no-such.jsonl"
    spare = tiny_config(tmp_path / "runs", "spare-dataset", envs={"dataset": {"path": str(absent)}})
    assert "dataset" not in spare.orchestrator.mix
    assert missing_path(spare) is None
    assert evaluate_paths(spare) is None and train_paths(spare) is None
    used = tiny_config(tmp_path / "runs", "absent-dataset", **dataset_only(absent))
    assert missing_path(used) == evaluate_paths(used) == f"envs.dataset.path {str(absent)!r} does not exist"


def test_a_train_run_checks_the_dataset_only_where_its_warm_start_draws_from_it(tmp_path):
    """The train flow draws tasks only to warm-start a run with no weight version: a trainer
    on a machine without the rollout workers' dataset file was refused for a file it would
    never read, with the warm start off or the run holding a version."""
    absent = tmp_path / "no-such.jsonl"
    off = tiny_config(tmp_path / "runs", "absent-dataset", **dataset_only(absent))
    assert train_paths(off) is None
    on = off.model_copy(update={"warm_start": off.warm_start.model_copy(update={"enabled": True})})
    assert train_paths(on) == f"envs.dataset.path {str(absent)!r} does not exist"
    build_base_version(
        tiny_config(tmp_path / "runs", "absent-dataset", warm_start=NO_WARM_START), log=lambda line: None
    )
    assert train_paths(on) is None


@pytest.mark.parametrize("beside", ["consolidated.safetensors", "adapter_model.safetensors"])
def test_a_checkpoints_size_counts_only_the_files_its_load_reads(tmp_path, judge, beside):
    """A folder may hold safetensors files its load never reads (Mistral's repositories keep
    ``consolidated.safetensors`` beside ``model.safetensors``, a PEFT run its adapter): each
    counted too refused a judge whose loaded model fits its budget."""
    folder = tmp_path / "judge"
    folder.mkdir()
    for file in judge.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / beside).write_bytes((judge / "model.safetensors").read_bytes())
    loaded = state_bytes(AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32))
    assert _float32_bytes(folder) == _float32_bytes(judge) <= loaded
    service = {"reward_models": {"judge": {"path": str(folder)}}, "reward_budget_mb": 1.01 * loaded / 2**20}
    config = tiny_config(tmp_path / "runs", "judge-beside", service=service, envs=JUDGED_ARITH)
    assert reward_over_budget(config) is None


def test_a_sharded_checkpoints_size_is_that_of_the_shards_its_index_names(tmp_path):
    """A checkpoint saved in shards is read from the files its index names, each once."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = state_bytes(AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32))
    assert loaded - 1024 <= _float32_bytes(tmp_path) <= loaded


def test_a_missing_gateway_token_is_refused_on_this_machine_and_left_to_the_worker_on_ray(
    tmp_path, monkeypatch
):
    """On Ray the worker reads the token on its own node, whose environment this one does not see."""
    local = tiny_config(tmp_path / "runs", "token", gateway_http={"port": 0, "token_env": "T_GATEWAY"})
    monkeypatch.setenv("T_GATEWAY", " ")
    assert "environment variable T_GATEWAY (gateway_http.token_env)" in missing_gateway_token(local)
    assert "is empty" in missing_gateway_token(local)
    assert missing_gateway_token(local.model_copy(update={"cluster": "ray"})) is None
    monkeypatch.setenv("T_GATEWAY", "secret")
    assert missing_gateway_token(local) is None
    monkeypatch.delenv("T_GATEWAY")
    assert missing_gateway_token(tiny_config(tmp_path / "runs", "token")) is None


@pytest.mark.parametrize("flow", ["pipeline", "rollout"])
def test_a_run_serving_the_gateway_without_its_token_fails_before_the_warm_start_and_its_command_in_one_line(
    tmp_path, monkeypatch, capsys, flow
):
    """A deployment's run failed once its rollout task started, with that task's traceback."""
    monkeypatch.delenv("T_GATEWAY", raising=False)
    http = {"port": 0, "token_env": "T_GATEWAY"}
    run = getattr(flows, flow)
    said = (
        r"^gateway_http\.port is set, so the worker serves the gateway, but environment variable T_GATEWAY "
    )
    failed_with(
        getattr(run, flow)(tiny_config(tmp_path / "runs", "token", gateway_http=http), return_state=True),
        said,
    )
    sets = [f"storage.root={tmp_path}/runs", "gateway_http.port=0", "gateway_http.token_env=T_GATEWAY"]
    with pytest.raises(SystemExit) as exited:
        run.main([arg for field in sets for arg in ("--set", field)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("error: gateway_http.port is set")
    assert not (tmp_path / "runs").exists(), "nothing of the run was written"
