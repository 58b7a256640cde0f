"""Flows of one run that start together both warm-start: one version 0, used by all."""

from __future__ import annotations

import asyncio
import os
import posixpath
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from prefect import flow
from safetensors.torch import load_file, save_file

from envs import registry
from envs.arith import ArithEnv, solve
from flows.config import RunConfig
from rl.models import build_tiny_model, load_policy, publish_policy, restore_master_weights
from rl.trainer import Trainer
from storage import weights as weight_store
from storage.tables import Tables
from storage.weights import CLAIM_FILE, WeightStore
from tasks import weights as weight_tasks
from tasks.common import run_store
from tasks.weights import build_base_version, demonstration_data, warm_start
from tests.flows.conftest import tiny_config


def test_flows_warm_starting_together_publish_one_version_zero(tmp_path):
    config = tiny_config(tmp_path / "runs", "warm-race")
    logs: dict[str, list[str]] = {"trainer": [], "worker": []}
    results: dict[str, int] = {}

    def start(name: str) -> None:
        results[name] = build_base_version(config, log=logs[name].append)

    threads = [threading.Thread(target=start, args=(name,)) for name in logs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert results == {"trainer": 0, "worker": 0}
    weights = WeightStore(run_store(config))
    assert weights.list() == [0] and weights.latest() == 0
    weights.load(0)  # every file matches the one manifest
    assert Tables(run_store(config)).read("weights").column("version").to_pylist() == [0]
    waited = [name for name, lines in logs.items() if any("using that one" in line for line in lines)]
    assert len(waited) == 1, logs


@pytest.mark.parametrize("claim", ["unreadable", "an hour old"])
def test_a_version_zero_claimed_by_a_process_that_died_is_given_up_on(tmp_path, claim):
    """A process died while it wrote its claim (unreadable), or after it (a claim last renewed
    an hour ago, past ``BASE_VERSION_WAIT_S``): this base is published as the next version."""
    config = tiny_config(tmp_path / "runs", "warm-dead", warm_start={"enabled": False})
    store = run_store(config)
    weights = WeightStore(store)
    renewed = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    text = b"a process that died\n" if claim == "unreadable" else f"{renewed} pid 1\n".encode()
    store.create_exclusive(posixpath.join(weights.version_path(0), CLAIM_FILE), text)
    lines: list[str] = []
    assert build_base_version(config, log=lines.append) == 1
    assert weights.list() == [1] and weights.latest() == 1 and weights.manifest(1)["tag"] == "base"
    assert f"its claim not renewed for {weight_tasks.BASE_VERSION_WAIT_S:.0f} s" in lines[-1]
    assert Tables(store).read("weights").column("version").to_pylist() == [1]


def test_flows_that_give_up_on_a_dead_claim_together_publish_one_base(tmp_path, monkeypatch):
    """Two flows found version 0's claim dead: the first claimed version 1 and publishes it;
    the second published its own base as version 2 at once, so the run held two bases and
    its trainer and workers could start from different ones. It now waits for version 1 as
    it waits for version 0."""
    config = tiny_config(tmp_path / "runs", "warm-dead-two", warm_start={"enabled": False})
    store = run_store(config)
    weights = WeightStore(store)
    renewed = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    store.create_exclusive(posixpath.join(weights.version_path(0), CLAIM_FILE), f"{renewed} pid 1\n".encode())
    claim = f"{datetime.now(UTC).isoformat()} pid 2 owner other-flow\n".encode()
    store.create_exclusive(posixpath.join(weights.version_path(1), CLAIM_FILE), claim)

    def other_flow_publishes(seconds: float) -> None:
        if not weights.list():
            weights.publish({"w": torch.zeros(2)}, {}, None, tag="base", version=1, owner="other-flow")

    monkeypatch.setattr(weight_tasks.time, "sleep", other_flow_publishes)
    assert build_base_version(config, log=print) == 1
    assert weights.list() == [1] and weights.latest() == 1


def test_a_trainer_starting_before_the_base_version_is_recorded_leaves_it_one_row(tmp_path, monkeypatch):
    """The trainer finds version 0 published and its row missing, and records it; the base's
    publisher then records it too."""
    config = tiny_config(tmp_path / "runs", "warm-trainer", warm_start={"enabled": False})
    real_publish = weight_tasks.publish_policy
    trainers = []

    def publish_then_start_a_trainer(*args, **kwargs) -> int:
        version = real_publish(*args, **kwargs)
        trainers.append(Trainer(run_store(config), config.sao))
        return version

    monkeypatch.setattr(weight_tasks, "publish_policy", publish_then_start_a_trainer)
    assert build_base_version(config, log=lambda line: None) == 0
    assert trainers[0].recorded_resumed, "the trainer did not record it: only one writer was tested"
    assert Tables(run_store(config)).read("weights").column("version").to_pylist() == [0]


def test_the_base_version_is_published_in_the_runs_publish_dtype_with_its_float32_weights(tmp_path):
    config = tiny_config(
        tmp_path / "runs", "warm-bf16", warm_start={"enabled": False}, sao={"publish_dtype": "bfloat16"}
    )
    assert build_base_version(config, log=lambda line: None) == 0
    weights = WeightStore(run_store(config))
    served, _ = load_policy(weights.load(0, "serving"))
    built, _ = build_tiny_model(config.model.tiny)
    for (name, p), q in zip(built.named_parameters(), served.parameters(), strict=True):
        torch.testing.assert_close(q, p.to(torch.bfloat16).float(), rtol=0, atol=0, msg=name)
    assert restore_master_weights(served, weights.load(0))
    for (name, p), q in zip(built.named_parameters(), served.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_run_started_from_a_bfloat16_version_starts_from_its_float32_weights(tmp_path):
    """``model.path`` may name a weight version of another run: the new run's base is that
    version's policy as trained, not the rounded copy its engines served."""
    source = tiny_config(
        tmp_path / "runs", "source", warm_start={"enabled": False}, sao={"publish_dtype": "bfloat16"}
    )
    build_base_version(source, log=lambda line: None)
    version_dir = WeightStore(run_store(source)).load(0)
    config = tiny_config(
        tmp_path / "runs", "from-version", warm_start={"enabled": False}, model={"path": version_dir}
    )
    assert build_base_version(config, log=lambda line: None) == 0
    started, _ = load_policy(WeightStore(run_store(config)).load(0))
    built, _ = build_tiny_model(source.model.tiny)
    for (name, p), q in zip(built.named_parameters(), started.parameters(), strict=True):
        assert torch.equal(p, q), name


@flow
def warm_starting(config: RunConfig) -> int:
    return warm_start(config)


def test_a_failed_upload_of_version_zero_is_retried_as_version_zero(tmp_path, monkeypatch):
    config = tiny_config(tmp_path / "runs", "warm-retry", warm_start={"enabled": False})
    real_put = LocalFileSystem.put_file
    failures: list[str] = []

    def fail_once_in_version_zero(fs, source, target, *args, **kwargs):
        if not failures and "weights/v000000/" in str(target):
            failures.append(target)
            raise OSError("transient storage error (injected)")
        return real_put(fs, source, target, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "put_file", fail_once_in_version_zero)
    monkeypatch.setattr(weight_tasks, "BASE_VERSION_WAIT_S", 2.0)  # what a claim of another process gets
    assert warm_starting(config) == 0  # the task's retry takes back its own claim
    assert failures
    weights = WeightStore(run_store(config))
    assert weights.list() == [0] and weights.latest() == 0 and weights.manifest(0)["tag"] == "base"
    assert sorted(os.listdir(weights.root)) == ["LATEST", "v000000"]
    weights.load(0)
    assert Tables(run_store(config)).read("weights").column("version").to_pylist() == [0]


def test_a_version_zero_whose_row_failed_to_land_is_recorded_and_announced_by_the_retry(
    tmp_path, monkeypatch
):
    """The publish landed and its ``weights`` row did not (a Delta commit that failed): the
    task's retry finds the version there, and records and announces it rather than skip both."""
    config = tiny_config(tmp_path / "runs", "warm-record", warm_start={"enabled": False})
    real_record = WeightStore.record
    failures: list[int] = []

    def fail_once(weights, tables, version):
        if not failures:
            failures.append(version)
            raise OSError("the weights table commit failed (injected)")
        return real_record(weights, tables, version)

    announced: list[int] = []
    monkeypatch.setattr(WeightStore, "record", fail_once)
    monkeypatch.setattr(weight_tasks, "announce_version", lambda config, version: announced.append(version))
    assert warm_starting(config) == 0
    assert failures == [0]
    assert Tables(run_store(config)).read("weights").column("version").to_pylist() == [0]
    assert announced == [0]
    assert warm_starting(config) == 0  # a later run: recorded and announced already
    assert announced == [0]


def test_a_version_zero_whose_upload_outlasts_the_wait_is_waited_for(tmp_path, monkeypatch):
    """The winner uploads slower than a loser's wait (a large checkpoint): it renews its claim
    while it uploads, so the loser keeps waiting and uses it rather than publish a second base."""
    config = tiny_config(tmp_path / "runs", "warm-slow", warm_start={"enabled": False})
    real_put = LocalFileSystem.put_file
    uploading = threading.Event()

    def slow_put(fs, source, target, *args, **kwargs):
        uploading.set()
        time.sleep(0.4)
        return real_put(fs, source, target, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "put_file", slow_put)
    monkeypatch.setattr(weight_store, "CLAIM_REFRESH_S", 0.1)
    monkeypatch.setattr(weight_tasks, "BASE_VERSION_WAIT_S", 1.0)
    results: dict[str, int] = {}
    winner = threading.Thread(target=lambda: results.update(trainer=build_base_version(config, log=print)))
    winner.start()
    assert uploading.wait(60)
    results["worker"] = build_base_version(config, log=print)
    winner.join()
    weights = WeightStore(run_store(config))
    assert results == {"trainer": 0, "worker": 0} and weights.list() == [0]


def test_a_version_zero_whose_latest_write_failed_is_used_by_the_retry(tmp_path, monkeypatch):
    config = tiny_config(tmp_path / "runs", "warm-latest", warm_start={"enabled": False})
    real_advance = WeightStore._advance_latest
    failures: list[int] = []

    def fail_once(weights, version):
        if not failures:
            failures.append(version)
            raise OSError("LATEST could not be written (injected)")
        return real_advance(weights, version)

    monkeypatch.setattr(WeightStore, "_advance_latest", fail_once)
    assert warm_starting(config) == 0  # the retry finds version 0 whole and points LATEST at it
    weights = WeightStore(run_store(config))
    assert failures == [0] and weights.list() == [0] and weights.latest() == 0


def test_a_checkpoint_whose_tokenizer_has_no_pad_token_is_warm_started(tmp_path):
    """Llama-3 or Mistral checkpoints define no pad token: batches are padded with EOS."""
    model, tokenizer = build_tiny_model(tiny_config(tmp_path / "runs").model.tiny)
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None
    model.save_pretrained(tmp_path / "checkpoint")
    tokenizer.save_pretrained(tmp_path / "checkpoint")
    config = tiny_config(
        tmp_path / "runs",
        "warm-no-pad",
        model={"path": str(tmp_path / "checkpoint")},
        warm_start={"demos": {"arith": 8, "guess": 4}, "sft": {"max_steps": 2}},
    )
    lines: list[str] = []
    assert build_base_version(config, log=lines.append) == 0
    warm = WeightStore(run_store(config)).manifest(0)["metadata"]["warm_start"]
    assert (warm["steps"], warm["demonstrations"], warm["flawed"]) == (2, 12, True)
    assert lines[-1].startswith(f"warm start: 2 steps on {warm['demonstrations']} demonstrations, loss ")
    assert lines[-1].endswith(f" → {warm['final_loss']:.3f}"), "the manifest's loss is the last step's"


def test_demonstrations_an_env_cannot_give_are_a_config_error_naming_the_setting(tmp_path):
    _, tokenizer = build_tiny_model(tiny_config(tmp_path / "runs").model.tiny)
    many = tiny_config(
        tmp_path / "runs", orchestrator={"mix": {"code": 1.0}}, warm_start={"demos_per_env": 2000}
    )
    with pytest.raises(
        ValueError, match=r"2000 demonstrations of code: only \d+ distinct tasks .* warm_start.demos.code"
    ):
        demonstration_data(many, tokenizer, ["code"])
    fewer = tiny_config(
        tmp_path / "runs",
        orchestrator={"mix": {"arith": 1.0, "code": 1.0}},
        warm_start={"demos": {"code": 3, "arith": 2}},
    )
    assert len(demonstration_data(fewer, tokenizer, ["arith", "code"])[0]) == 5
    left_out = tiny_config(
        tmp_path / "runs",
        orchestrator={"mix": {"arith": 1.0, "code": 1.0}},
        warm_start={"demos": {"code": 0, "arith": 2}},
    )
    assert len(demonstration_data(left_out, tokenizer, ["arith", "code"])[0]) == 2


def test_a_demonstrators_own_error_is_raised_as_it_is_not_as_a_config_error(tmp_path, monkeypatch):
    """A bug inside a demonstrator (a ``ValueError`` of its own) is no setting to change: it
    surfaces with its message and the demonstrator in its traceback. An env with no scripted
    solver (``NotImplementedError``) is still the config error naming the setting."""

    class Broken(ArithEnv):
        name = "broken"

        @classmethod
        def demonstrate(cls, task, flawed=False, seed=0):
            return [str(int(task.prompt))]  # "3+4=" is no int

    class Unsolved(ArithEnv):
        name = "unsolved"

        @classmethod
        def demonstrate(cls, task, flawed=False, seed=0):
            raise NotImplementedError("unsolved has no scripted solver")

    for env in (Broken, Unsolved):
        monkeypatch.setitem(registry.REGISTRY, env.name, env)  # what registry.register does
    _, tokenizer = build_tiny_model(tiny_config(tmp_path / "runs").model.tiny)
    config = tiny_config(tmp_path / "runs", warm_start={"demos": {"broken": 2, "unsolved": 2}})
    with pytest.raises(ValueError, match="invalid literal for int") as raised:
        demonstration_data(config, tokenizer, ["broken"])
    assert "warm_start.demos" not in str(raised.value)
    assert any(entry.name == "demonstrate" for entry in raised.traceback)
    with pytest.raises(ValueError, match=r"unsolved has no scripted solver; set warm_start\.demos\.unsolved"):
        demonstration_data(config, tokenizer, ["unsolved"])


def test_demonstrations_are_rendered_with_the_gateways_template_variables(tmp_path):
    """The warm start learns the prompts the rollouts will show: with
    ``gateway.chat_template_kwargs`` (Qwen3's ``enable_thinking: false``), the same ones."""
    from tests.rollout.test_gateway import QWEN3_LIKE

    _, tokenizer = build_tiny_model(tiny_config(tmp_path / "runs").model.tiny)
    tokenizer.chat_template = QWEN3_LIKE
    quiet = tiny_config(
        tmp_path / "runs",
        orchestrator={"mix": {"arith": 1.0}},
        warm_start={"demos": {"arith": 1, "guess": 0}},
        gateway={"chat_template_kwargs": {"enable_thinking": False}},
    )
    sequences, masks = demonstration_data(quiet, tokenizer, ["arith"])
    text = tokenizer.decode(sequences[0])
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" in text
    trained = tokenizer.decode([t for t, m in zip(sequences[0], masks[0], strict=True) if m])
    assert "<think>" not in trained, "the block is prompt, not a demonstrated action"


def test_the_warm_start_trains_on_the_trainers_device(tmp_path, monkeypatch):
    """``trainer_device`` reaches the supervised warm start (the meta device stands in for a
    GPU here: the model is put there, and training stops at once)."""
    config = tiny_config(tmp_path / "runs", "warm-device", trainer_device="meta")
    seen = []

    def trains(model, *args, **kwargs):
        seen.append({p.device.type for p in model.parameters()})
        raise RuntimeError("stop before training on the meta device")

    monkeypatch.setattr(weight_tasks, "supervised_warm_start", trains)
    with pytest.raises(RuntimeError, match="stop before training"):
        build_base_version(config, log=lambda line: None)
    assert seen == [{"meta"}]


def test_a_trainers_version_without_its_row_is_left_to_the_trainer(tmp_path):
    """A warm start (a rollout flow starting) meets the trainer's newest version between its
    publish and its ``weights`` row: the trainer records and announces it; the warm start
    announcing it too sent the event twice."""
    config = tiny_config(tmp_path / "runs", "warm-trainer", warm_start={"enabled": False})
    assert build_base_version(config) == 0
    weights = WeightStore(run_store(config))
    model, tokenizer = build_tiny_model(config.model.tiny)
    publish_policy(weights, model, tokenizer, step=3, parent=0)  # the trainer's, its row not yet written
    announced: list[int] = []
    assert build_base_version(config, on_publish=announced.append) == 1
    assert announced == []
    assert Tables(run_store(config)).read("weights").column("version").to_pylist() == [0]


def test_a_warm_start_between_version_zeros_publish_and_its_row_announces_it_once(tmp_path, monkeypatch):
    """Another flow's warm start finds version 0 published and not yet recorded: of the two,
    the one whose row lands announces it, not both."""
    config = tiny_config(tmp_path / "runs", "warm-twice", warm_start={"enabled": False})
    real_record = WeightStore.record
    announced: list[int] = []
    others: list[int] = []

    def another_flow_first(weights, tables, version):
        if not others:
            others.append(-1)
            others[0] = build_base_version(config, on_publish=announced.append)
        return real_record(weights, tables, version)

    monkeypatch.setattr(WeightStore, "record", another_flow_first)
    assert build_base_version(config, on_publish=announced.append) == 0
    assert others == [0]
    assert announced == [0]
    assert Tables(run_store(config)).read("weights").column("version").to_pylist() == [0]


def test_a_garbled_latest_does_not_stop_a_flow_from_starting(tmp_path):
    """The warm start every flow begins with points a garbled LATEST at the newest version
    rather than failing, and warm-starts nothing."""
    config = tiny_config(tmp_path / "runs", "warm-garbled", warm_start={"enabled": False})
    assert build_base_version(config) == 0
    weights = WeightStore(run_store(config))
    weights.fs.pipe_file(f"{weights.root}/LATEST", b"")
    lines: list[str] = []
    assert build_base_version(config, log=lines.append) == 0
    assert weights.list() == [0] and weights.latest() == 0
    assert "LATEST holds '', not a version number" in lines[0]


def test_a_latest_naming_a_deleted_version_is_passed_over_as_the_trainer_does(tmp_path):
    """LATEST names a version whose folder was deleted (by hand, a retention race) before its
    row was written: the warm start goes on from the newest complete version below it, as the
    trainer and the workers do (``load_newest``); with none below, a one-line error says what to do."""
    config = tiny_config(tmp_path / "runs", "warm-deleted", warm_start={"enabled": False})
    assert build_base_version(config) == 0
    weights = WeightStore(run_store(config))
    model, tokenizer = build_tiny_model(config.model.tiny)
    publish_policy(weights, model, tokenizer, step=3, parent=0)
    publish_policy(weights, model, tokenizer, step=4, parent=1)
    weights.fs.rm(weights.version_path(2), recursive=True)
    lines: list[str] = []
    assert build_base_version(config, log=lines.append) == 1  # the newest below, not the oldest
    assert "LATEST names weight version 2, which has no manifest; using version 1 below it" in lines[0]
    assert weights.list() == [0, 1]  # nothing warm-started
    for version in (0, 1):
        weights.fs.rm(weights.version_path(version), recursive=True)
    with pytest.raises(
        FileNotFoundError, match=r"names weight version 2, which has no manifest, and no"
    ) as error:
        build_base_version(config, log=lines.append)
    assert "delete LATEST to warm-start the run again" in str(error.value) and "\n" not in str(error.value)
    weights.fs.rm_file(f"{weights.root}/LATEST")
    assert build_base_version(config) == 0 and weights.list() == [0]


@pytest.mark.parametrize("flawed", [True, False])
def test_the_demonstrations_are_the_train_splits_by_the_runs_demonstrator_and_seed(tmp_path, flawed):
    """The warm start learns the train split's problems (the held-out ones stay unseen),
    answered as ``warm_start.flawed`` says with the flaws the run's seed draws."""
    _, tokenizer = build_tiny_model(tiny_config(tmp_path / "runs").model.tiny)
    config = tiny_config(tmp_path / "runs", seed=3, warm_start={"demos": {"arith": 6}, "flawed": flawed})
    sequences, masks = demonstration_data(config, tokenizer, ["arith"])
    shown = [
        (tokenizer.decode(tokens), tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m]))
        for tokens, mask in zip(sequences, masks, strict=True)
    ]
    train = registry.task_set("arith", "train", 3, 6, config.env_config("arith"))
    answers = [registry.demonstrate(task, flawed=flawed, seed=3)[0] for task in train]
    assert [answer.removesuffix("<|im_end|>") for _, answer in shown] == answers
    assert all(task.prompt in text for task, (text, _) in zip(train, shown, strict=True))
    assert (answers != [str(solve(t.data["a"], t.data["op"], t.data["b"])) for t in train]) == flawed


def test_without_a_warm_start_the_base_version_is_built_off_the_trainers_device(tmp_path):
    """Publishing the starting policy as it is trains nothing: it needs no GPU, and a flow on
    a machine without the trainer's device (a rollout worker) still starts the run (the
    meta device stands in for a GPU here: a model put there has no weights to publish)."""
    config = tiny_config(
        tmp_path / "runs", "warm-off-device", trainer_device="meta", warm_start={"enabled": False}
    )
    assert build_base_version(config, log=lambda line: None) == 0
    served, _ = load_policy(WeightStore(run_store(config)).load(0))
    built, _ = build_tiny_model(config.model.tiny)
    for (name, p), q in zip(built.named_parameters(), served.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_the_warm_start_tells_how_many_demonstrations_it_has_played(tmp_path, monkeypatch):
    """Two thousand shell demonstrations, one sandbox each, took minutes with nothing logged."""
    monkeypatch.setattr(weight_tasks, "PROGRESS_EVERY_S", 0.0)
    _, tokenizer = build_tiny_model(tiny_config(tmp_path / "runs").model.tiny)
    config = tiny_config(tmp_path / "runs", warm_start={"demos": {"arith": 3}})
    lines: list[str] = []
    sequences, _ = demonstration_data(config, tokenizer, ["arith"], log=lines.append)
    assert len(sequences) == 3
    assert lines == [f"warm start: {done} of 3 demonstrations of arith played" for done in (1, 2, 3)]
    built: list[str] = []
    build_base_version(config, log=built.append)
    assert lines[-1] in built, "the warm start of the base version told nothing of its demonstrations"


def test_demonstrated_actions_longer_than_an_actions_token_budget_are_told(tmp_path):
    """With ``service.max_new_tokens`` below a demonstrated action's tokens (code's run to a
    dozen and more, tiny.yaml's budget is 4), the warm start taught actions that every rollout
    cut short, and said nothing."""
    _, tokenizer = build_tiny_model(tiny_config(tmp_path / "runs").model.tiny)
    demos = {"warm_start": {"demos": {"arith": 4}}}
    _, masks = demonstration_data(tiny_config(tmp_path / "runs", **demos), tokenizer, ["arith"])
    lengths = []
    for mask in masks:
        starts = [i for i, trained in enumerate(mask) if trained and (i == 0 or not mask[i - 1])]
        lengths += [next((j for j in range(i, len(mask)) if not mask[j]), len(mask)) - i for i in starts]
    assert weight_tasks.action_lengths([False, True, True, False, True]) == [2, 1]
    assert [weight_tasks.action_lengths(mask) for mask in masks] == [[n] for n in lengths]
    for budget in (max(lengths), min(lengths) - 1, max(lengths) - 1):
        lines: list[str] = []
        config = tiny_config(tmp_path / "runs", service={"max_new_tokens": budget}, **demos)
        demonstration_data(config, tokenizer, ["arith"], log=lines.append)
        over = sum(n > budget for n in lengths)
        told = (
            f"warm start: {over} of {len(lengths)} demonstrated actions of arith are longer than "
            f"service.max_new_tokens={budget} (the longest {max(lengths)} tokens, its stop token included): "
            "rollouts cut them short, so the policy learns actions it cannot finish; raise "
            "service.max_new_tokens"
        )
        assert lines == ([told] if over else []), budget


def test_the_demonstrations_are_played_as_many_at_once_as_the_runs_concurrency(tmp_path, monkeypatch):
    """Each demonstration waits on its env (a sandbox's processes): played one at a time, two
    thousand shell demonstrations took minutes on a machine holding ``orchestrator.concurrency``."""
    playing, most = [0], [0]

    class Slow(ArithEnv):
        name = "slow"

        async def reset(self, task):
            playing[0] += 1
            most[0] = max(most[0], playing[0])
            await asyncio.sleep(0)
            playing[0] -= 1
            return await super().reset(task)

    monkeypatch.setitem(registry.REGISTRY, Slow.name, Slow)
    _, tokenizer = build_tiny_model(tiny_config(tmp_path / "runs").model.tiny)
    config = tiny_config(
        tmp_path / "runs", warm_start={"demos": {"slow": 6}}, orchestrator={"concurrency": 3}
    )
    assert len(demonstration_data(config, tokenizer, ["slow"])[0]) == 6
    assert most == [3]


def test_a_checkpoint_missing_a_tensor_fails_the_warm_start_and_publishes_nothing(tmp_path):
    """The tensor was initialised at random and version 0 trained and published on it; a
    rerun with the checkpoint mended then found that version and used it."""
    model, tokenizer = build_tiny_model(tiny_config(tmp_path / "runs").model.tiny)
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    config = tiny_config(
        tmp_path / "runs", "warm-torn", model={"path": str(checkpoint)}, warm_start={"enabled": False}
    )
    with pytest.raises(ValueError, match=r"lacks \['model.layers.0.self_attn.q_proj.weight'\] \(1 in all"):
        build_base_version(config, log=lambda line: None)
    weights = WeightStore(run_store(config))
    assert weights.latest() is None and weights.list() == []
    assert not weights.fs.exists(weights.version_path(0))

    model.save_pretrained(checkpoint)
    assert build_base_version(config, log=lambda line: None) == 0
