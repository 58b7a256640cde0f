"""Held-out evaluation as the pipeline runs it: a version is recorded once per measurement."""

from __future__ import annotations

import json
import os
from typing import Any

import pyarrow.compute as pc
import pytest
import torch
from prefect import flow

from rl.models import build_tiny_model, load_policy, publish_policy
from storage.tables import Tables
from storage.weights import WeightStore
from tasks.common import run_store
from tasks.weights import build_base_version, eval_setup, eval_tasks, evaluate_task, evaluate_weights
from tests.flows.conftest import tiny_config


def holding_versions(config, last: int) -> None:
    """Publish stand-in weight versions 0 to ``last`` in ``config``'s run: the evaluate flow
    refuses a version the run does not hold before it measures anything."""
    weights = WeightStore(run_store(config))
    for step in range(last + 1):
        weights.publish({"w": torch.zeros(2)}, {}, None, step=step)


@flow
def evaluating(config, version: int | None = None, reuse: bool = False) -> dict[str, Any]:
    return evaluate_task(config, version, reuse=reuse)


def test_a_rerun_reuses_the_recorded_eval_of_its_version_and_an_explicit_eval_measures_again(tmp_path):
    config = tiny_config(tmp_path / "runs", "eval-rerun", warm_start={"enabled": False})
    mix = sorted(config.orchestrator.mix)
    base = build_base_version(config, log=lambda line: None)
    tables = Tables(run_store(config))

    def rows() -> list[tuple[int, str, int]]:
        return sorted((r["version"], r["env"], r["count"]) for r in tables.read("evals").to_pylist())

    first = evaluating(config, base, reuse=True)
    assert first["statuses"], "a version never evaluated is evaluated"
    assert rows() == [(base, env, 4) for env in mix]

    again = evaluating(config, reuse=True)  # the latest version: the same one
    assert rows() == [(base, env, 4) for env in mix], "a rerun recorded the same version twice"
    assert again["version"] == base and again["statuses"] == {}
    assert again["reward"] == pytest.approx(first["reward"], rel=1e-6)
    assert again["count"] == first["count"]

    evaluating(config, base)  # the evaluate flow: asked for, so measured again
    assert rows() == sorted([(base, env, 4) for env in mix] * 2)

    # over a different number of tasks the recorded rows are another measurement
    wider = config.model_copy(update={"eval": config.eval.model_copy(update={"tasks_per_env": 5})})
    assert evaluating(wider, base, reuse=True)["count"] == {env: 5 for env in mix}
    assert rows() == sorted([(base, env, 4) for env in mix] * 2 + [(base, env, 5) for env in mix])


def test_an_env_whose_eval_split_holds_fewer_tasks_than_asked_is_evaluated_on_all_of_them(tmp_path):
    """``code`` holds 27 held-out functions, fewer than a GPU config's 200 per env: the
    evaluation runs all of them and a rerun reuses that row, where it refused to start."""
    config = tiny_config(
        tmp_path / "runs", "eval-small", warm_start={"enabled": False}, envs={"arith": {"max_operand": 5}},
        eval={"tasks_per_env": 6},
    )  # fmt: skip
    held_out = len(eval_tasks(config, "arith"))
    assert 0 < held_out < 6 and len({task.id for task in eval_tasks(config, "arith")}) == held_out
    assert len(eval_tasks(config, "guess")) == 6
    base = build_base_version(config, log=lambda line: None)
    first = evaluating(config, base, reuse=True)
    assert first["count"] == {"arith": held_out, "guess": 6}
    again = evaluating(config, base, reuse=True)
    assert again["statuses"] == {} and again["count"] == first["count"], "the recorded row is reused"
    assert Tables(run_store(config)).read("evals").num_rows == 2


def test_an_env_that_repeats_its_tasks_is_evaluated_on_each_problem_once(tmp_path):
    """A dataset whose eval split holds fewer rows than ``tasks_per_env`` gave the rows again
    to make up the number: the row counted as that many tasks measured, and its mean weighed
    the first rows more. Guess drew its problems with replacement (a problem scored twice)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20))
    )
    config = tiny_config(
        tmp_path / "runs", "eval-distinct", warm_start={"enabled": False},
        envs={"dataset": {"path": str(rows), "eval_fraction": 0.3}},
        orchestrator={"mix": {"arith": 0.5, "guess": 0.3, "dataset": 0.2}}, eval={"tasks_per_env": 12},
    )  # fmt: skip
    held_out = eval_tasks(config, "dataset")
    assert 0 < len(held_out) < 12 and len({task.prompt for task in held_out}) == len(held_out)
    wider = config.model_copy(update={"eval": config.eval.model_copy(update={"tasks_per_env": 80})})
    problems = {(t.data["low"], t.data["high"], t.data["target"]) for t in eval_tasks(wider, "guess")}
    assert len(problems) == 80
    base = build_base_version(config, log=lambda line: None)
    measured = evaluating(config, base)
    assert measured["count"] == {"arith": 12, "guess": 12, "dataset": len(held_out)}
    row = Tables(run_store(config)).read("evals").filter(pc.equal(pc.field("env"), "dataset")).to_pylist()
    assert [(r["count"], r["tasks"]) for r in row] == [(len(held_out), len(held_out))]


def test_an_evaluation_lists_the_held_out_tasks_of_each_env_once(tmp_path, monkeypatch):
    """Each env's held-out set is listed once per evaluation and passed on, so the row's setup
    is that of the tasks measured. The pipeline's evaluation listed it for the recorded rows'
    lookup, for the measurement and for the row's setup apart (a guess env of a million
    problems ranked them three times, about a second each), the setup recorded being that of
    another listing than the one measured."""
    import envs.registry

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20))
    )
    config = tiny_config(
        tmp_path / "runs", "eval-once", warm_start={"enabled": False}, envs={"dataset": {"path": str(rows)}},
        orchestrator={"mix": {"arith": 0.5, "guess": 0.3, "dataset": 0.2}}, eval={"tasks_per_env": 2},
    )  # fmt: skip
    base = build_base_version(config, log=lambda line: None)
    listed = []
    task_pool = envs.registry.task_pool

    def listing(name, *args, **kwargs):
        listed.append(name)
        return task_pool(name, *args, **kwargs)

    monkeypatch.setattr(envs.registry, "task_pool", listing)
    mix = sorted(config.orchestrator.mix)
    first = evaluating(config, base, reuse=True)  # the pipeline's: none recorded, so measured
    assert first["statuses"] and sorted(listed) == mix
    listed.clear()
    assert evaluating(config, base, reuse=True)["statuses"] == {}  # reused
    assert sorted(listed) == mix
    listed.clear()
    evaluating(config, base)  # the evaluate flow's
    assert sorted(listed) == mix
    monkeypatch.setattr(envs.registry, "task_pool", task_pool)
    setups = {row["env"]: row["setup"] for row in Tables(run_store(config)).read("evals").to_pylist()}
    assert setups == {env: eval_setup(config, env) for env in mix}


def test_a_rerun_reuses_a_recorded_eval_that_left_out_rollouts_failed_outside_the_policy(
    tmp_path, monkeypatch
):
    """A row's count is the rollouts measured: one env_error among the 4 tasks leaves 3, and
    the row still stands for those 4 tasks, so a rerun reuses it rather than evaluate again."""
    import tasks.weights
    from rollout.evaluate import EvalResult

    config = tiny_config(tmp_path / "runs", "eval-env-error", warm_start={"enabled": False})
    base = build_base_version(config, log=lambda line: None)
    measured = EvalResult(
        version=base,
        reward={"arith": 1.0, "guess": 0.5},
        count={"arith": 3, "guess": 4},
        statuses={"arith": {"ok": 3, "env_error": 1}, "guess": {"ok": 4}},
    )
    calls = []
    monkeypatch.setattr(
        tasks.weights, "evaluate_weights", lambda config, version, tasks: calls.append(1) or measured
    )
    evaluating(config, base, reuse=True)
    again = evaluating(config, base, reuse=True)
    assert len(calls) == 1, "the recorded evaluation was run again"
    assert again["statuses"] == {} and again["count"] == {"arith": 3, "guess": 4}
    rows = Tables(run_store(config)).read("evals").to_pylist()
    assert {row["env"]: (row["count"], row["tasks"]) for row in rows} == {"arith": (3, 4), "guess": (4, 4)}


def test_a_rerun_measured_otherwise_does_not_reuse_the_recorded_eval(tmp_path, monkeypatch):
    """A row stands for the measurement that made it: another eval temperature or seed, another
    env config, turn, token or time budget, context compaction or reward model, another engine
    dtype or kind of device, or a row from before the setup was recorded, is measured again
    (the pipeline's reward before RL was the old setup's, beside an after in the new one);
    an engine setting that changes only its speed is not."""
    from datetime import UTC, datetime

    import tasks.weights

    config = tiny_config(tmp_path / "runs", "eval-setup", warm_start={"enabled": False})
    calls = []
    monkeypatch.setattr(
        tasks.weights,
        "evaluate_weights",
        lambda config, version, tasks: calls.append(config) or _measured(config, 1),
    )
    evaluating(config, 1, reuse=True)
    evaluating(config, 1, reuse=True)
    assert len(calls) == 1, "the same setup is reused"
    otherwise = [
        {"eval": {"temperature": 0.7}},
        {"eval": {"seed": 99}},
        {"envs": {"guess": {"max_turns": 3}}},
        {"service": {"max_turns": 3}},
        {"service": {"max_new_tokens": 5}},
        {"service": {"timeout_s": 7.0}},
        {"service": {"compact_at": 200}},
        {"service": {"compact_at": 200, "compact_keep_turns": 2}},
        *(
            {
                "envs": {"arith": {"reward_model": "judge"}},
                "service": {"reward_models": {"judge": {"path": path}}},
            }
            for path in ("judge-a", "judge-b")
        ),
        {"engine": {"torch": {"dtype": "bfloat16"}}},
        {"engine": {"torch": {"device": "cuda"}}},
        {"gateway": {"chat_template_kwargs": {"enable_thinking": False}}},
    ]
    for n, change in enumerate(otherwise, start=2):
        changed = tiny_config(tmp_path / "runs", "eval-setup", warm_start={"enabled": False}, **change)
        evaluating(changed, 1, reuse=True)
        assert len(calls) == n, f"{change}: the recorded eval of another setup was reused"
        evaluating(changed, 1, reuse=True)
        assert len(calls) == n, f"{change}: its own recorded eval was not reused"
    speed_only = [
        {"engine": {"replicas": 3, "torch": {"max_batch": 3, "kv_cache_bytes": 0, "max_prefill_tokens": 64}}},
        {"engine": {"torch": {"device": "cuda:0"}}},  # the kind of device measured last
    ]
    for change in speed_only:
        evaluating(
            tiny_config(tmp_path / "runs", "eval-setup", warm_start={"enabled": False}, **change),
            1,
            reuse=True,
        )
        assert len(calls) == len(otherwise) + 1, (
            f"{change}: the recorded eval of the same measurement was not reused"
        )

    tables = Tables(run_store(config))
    tables.append(
        "evals",
        [{"version": 2, "env": env, "reward": 1.0, "count": 4, "tasks": 4, "time": datetime.now(UTC)}
         for env in config.orchestrator.mix],
    )  # fmt: skip
    evaluating(config, 2, reuse=True)
    assert len(calls) == len(otherwise) + 2, "a row without its setup was reused"


def test_a_reused_eval_gives_the_rewards_it_recorded_not_their_float32_noise(tmp_path, monkeypatch):
    """The ``evals`` table keeps a reward as a float32: read back as is, a rerun's reward
    before RL (logged, returned, printed by the demo) was 0.4300000071525574 for the 0.43
    measured."""
    import tasks.weights
    from rollout.evaluate import EvalResult

    config = tiny_config(tmp_path / "runs", "eval-digits", warm_start={"enabled": False})
    monkeypatch.setattr(
        tasks.weights,
        "evaluate_weights",
        lambda config, version, tasks: EvalResult(
            version=version,
            reward={"arith": 0.43, "guess": 1 / 3},
            count={"arith": 4, "guess": 4},
            statuses={"arith": {"ok": 4}, "guess": {"ok": 4}},
        ),
    )
    evaluating(config, 1, reuse=True)
    again = evaluating(config, 1, reuse=True)
    assert again["statuses"] == {}, "the recorded eval is reused"
    assert again["reward"] == {"arith": 0.43, "guess": 0.33333334}


def test_a_rerun_on_other_held_out_tasks_does_not_reuse_the_recorded_eval(tmp_path, monkeypatch):
    """A row stands for the tasks it measured: a dataset file rewritten between two runs of a
    run (other rows, the same path and config) gives other held-out tasks, which are measured
    again rather than reported by the old rows' reward."""
    import envs.dataset
    import tasks.weights
    from rollout.evaluate import EvalResult

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(40)))
    config = tiny_config(
        tmp_path / "runs", "eval-tasks", warm_start={"enabled": False}, envs={"dataset": {"path": str(rows)}},
        orchestrator={"mix": {"arith": 0.5, "guess": 0.3, "dataset": 0.2}},
    )  # fmt: skip
    mix = list(config.orchestrator.mix)
    calls = []
    measured = EvalResult(1, {e: 0.5 for e in mix}, {e: 4 for e in mix}, {e: {"ok": 4} for e in mix})
    monkeypatch.setattr(
        tasks.weights, "evaluate_weights", lambda config, version, tasks: calls.append(1) or measured
    )
    evaluating(config, 1, reuse=True)
    evaluating(config, 1, reuse=True)
    assert len(calls) == 1, "the same tasks are reused"
    rows.write_text("".join(json.dumps({"prompt": f"r{i}", "answer": "2"}) + "\n" for i in range(40)))
    monkeypatch.setattr(envs.dataset, "_ROWS", {})  # as a new process reads the file
    evaluating(config, 1, reuse=True)
    assert len(calls) == 2, "the recorded eval of other held-out tasks was reused"


def test_a_reward_model_written_anew_under_its_path_is_another_setup(tmp_path):
    """A row scored by a reward model stands for that checkpoint: one retrained and saved
    under the same path scores otherwise, so a rerun's reward before RL would have been the old
    judge's, beside an after by the new one (the setup named only the path). What a download
    tool keeps beside the files is not the checkpoint: it changing re-evaluated every version."""
    from huggingface_hub._local_folder import write_download_metadata
    from transformers import LlamaConfig, LlamaForSequenceClassification

    judge = tmp_path / "judge"
    config = tiny_config(
        tmp_path / "runs",
        "eval-judge",
        warm_start={"enabled": False},
        envs={"arith": {"reward_model": "judge"}},
        service={"reward_models": {"judge": {"path": str(judge)}}},
    )
    _, tokenizer = build_tiny_model(config.model.tiny)

    def save_judge(seed: int) -> None:
        torch.manual_seed(seed)
        LlamaForSequenceClassification(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_labels=1,
                pad_token_id=tokenizer.pad_token_id,
            )
        ).save_pretrained(judge)
        tokenizer.save_pretrained(judge)

    save_judge(1)
    first = eval_setup(config, "arith")
    assert eval_setup(config, "arith") == first, "the same checkpoint is the same setup"
    # `hf download --local-dir` run again over an up-to-date checkpoint rewrites its bookkeeping
    # in .cache/huggingface (a timestamp); the checkpoint's files stay as they were
    write_download_metadata(judge, "model.safetensors", commit_hash="0" * 40, etag="x")
    assert eval_setup(config, "arith") == first, "the download's bookkeeping changed the setup"
    save_judge(2)
    assert eval_setup(config, "arith") != first, "a checkpoint saved anew under its path kept its setup"
    (judge / "1_Pooling").mkdir()  # a checkpoint's own folders (sentence-transformers keeps some)
    (judge / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    pooled = eval_setup(config, "arith")
    (judge / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true, "mean": false}')
    assert eval_setup(config, "arith") != pooled, (
        "a file rewritten in a folder of the checkpoint kept its setup"
    )


def test_the_eval_seed_seeds_the_sampling_of_an_evaluation_not_only_its_tasks(tmp_path, monkeypatch):
    """An env's rollout i samples with seed ``eval.seed * SEED_STRIDE + i``: the same seed measures the
    same, another samples otherwise (every evaluation sampled with seeds 0..n-1, the seed
    picking the tasks only). The tasks are held fixed, so only the sampling can differ; and
    at the eval temperature near-greedy, not at all (the temperature reaches the sampler)."""
    import tasks.weights
    from rollout.config import SEED_STRIDE
    from rollout.engines.base import MIN_TEMPERATURE
    from rollout.service import RolloutService

    config = tiny_config(
        tmp_path / "runs", "eval-seed", warm_start={"enabled": False}, eval={"temperature": 1.0}
    )
    base = build_base_version(config, log=lambda line: None)
    fixed = {name: eval_tasks(config, name) for name in config.orchestrator.mix}
    monkeypatch.setattr(tasks.weights, "eval_tasks", lambda config, name, split: fixed[name])
    sampled = []
    process = RolloutService.process

    async def recording(self, request):
        result = await process(self, request)
        sampled.append((request.task.env, request.task.id, request.seed, tuple(result.record["tokens"])))
        return result

    monkeypatch.setattr(RolloutService, "process", recording)

    def evaluation(seed: int, temperature: float = 1.0):
        sampled.clear()
        seeded = config.model_copy(
            update={"eval": config.eval.model_copy(update={"seed": seed, "temperature": temperature})}
        )
        return evaluate_weights(seeded, base), sorted(sampled)

    (first, rollouts), (again, repeated) = evaluation(7), evaluation(7)
    assert again == first and repeated == rollouts
    for env, listed in fixed.items():
        seeds = sorted(seed for task_env, _, seed, _ in rollouts if task_env == env)
        assert seeds == [7 * SEED_STRIDE + i for i in range(len(listed))]
    _, other = evaluation(8)
    assert [task for *task, _, _ in other] == [task for *task, _, _ in rollouts]
    assert [tokens for *_, tokens in other] != [tokens for *_, tokens in rollouts]
    (_, greedy), (_, greedy_other) = evaluation(7, MIN_TEMPERATURE), evaluation(8, MIN_TEMPERATURE)
    assert [tokens for *_, tokens in greedy_other] == [tokens for *_, tokens in greedy]


def test_an_evaluation_whose_every_rollout_of_an_env_failed_on_infrastructure_fails_and_records_nothing(
    tmp_path, monkeypatch
):
    """An engine or sandbox that never worked measured nothing: the run fails, naming the env,
    rather than complete with a held-out reward of 0 that later runs would reuse."""
    import tasks.weights
    from flows.evaluate import evaluate
    from rollout.evaluate import EvalResult

    config = tiny_config(tmp_path / "runs", "eval-infra", warm_start={"enabled": False})
    measured = EvalResult(
        version=0,
        reward={"arith": 0.5, "guess": float("nan")},
        count={"arith": 4, "guess": 0},
        statuses={"arith": {"ok": 4}, "guess": {"env_error": 1, "infra_error": 3}},
        errors={"guess": "sandbox start_failed during init: bwrap: execvp python3: No such file"},
    )
    monkeypatch.setattr(tasks.weights, "evaluate_weights", lambda config, version, tasks: measured)
    holding_versions(config, 0)
    state = evaluate(config, 0, return_state=True)
    assert state.is_failed()
    # the reason too: the error that ends the run said only "engine, sandbox, environment host"
    with pytest.raises(
        RuntimeError,
        match=r"guess \(1 env_error, 3 infra_error; the last: sandbox start_failed during init: bwrap: "
        r"execvp python3: No such file\)",
    ):
        state.result()
    assert Tables(run_store(config)).read("evals").num_rows == 0


def test_a_negative_version_is_refused_by_the_evaluate_form_and_flow_before_it_starts(tmp_path, monkeypatch):
    import jsonschema
    from prefect.exceptions import ParameterTypeError
    from prefect.utilities.callables import parameter_schema

    import tasks.weights
    from flows.evaluate import evaluate

    started = []
    monkeypatch.setattr(tasks.weights, "evaluate_task", lambda *args: started.append(args))
    with pytest.raises(ParameterTypeError, match="version"):
        evaluate(tiny_config(tmp_path / "runs", "eval-negative"), -1)
    assert started == []
    schema = parameter_schema(evaluate).model_dump()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"version": -1}, schema)
    for version in (0, 7, None):
        jsonschema.validate({"version": version}, schema)


def test_the_newest_version_evaluated_is_the_newest_that_verifies(tmp_path):
    """A newest version whose files do not verify is passed over, as the trainer and the
    workers pass it over: the pipeline's evaluation before RL measures the version they
    start from rather than stop the run (it raised CorruptVersion)."""
    config = tiny_config(
        tmp_path / "runs", "eval-corrupt", warm_start={"enabled": False}, eval={"tasks_per_env": 1}
    )
    weights = WeightStore(run_store(config))
    build_base_version(config, log=lambda line: None)
    model, tokenizer = load_policy(weights.load(0))
    publish_policy(weights, model, tokenizer, step=1, parent=0)
    os.truncate(os.path.join(weights.version_path(1), "model.safetensors"), 10)
    assert evaluating(config, reuse=True)["version"] == 0
    assert {row["version"] for row in Tables(run_store(config)).read("evals").to_pylist()} == {0}
    # a rerun looked for version 1's row, found none, and measured version 0 again
    again = evaluating(config, reuse=True)
    assert again["version"] == 0 and again["statuses"] == {}
    assert Tables(run_store(config)).read("evals").num_rows == len(config.orchestrator.mix)


def test_an_evaluation_leaves_no_copy_of_the_version_it_measured_in_the_weight_cache(tmp_path):
    """The pipeline evaluates version after version for as long as it trains: each evaluation
    left its version's copy in the weight cache for good, a model's size on disk apiece."""
    config = tiny_config(
        tmp_path / "runs", "eval-cache", warm_start={"enabled": False}, eval={"tasks_per_env": 1}
    )
    base = build_base_version(config, log=lambda line: None)
    cache = WeightStore(run_store(config)).cache_dir
    assert evaluate_weights(config, base).version == base
    assert not [path for path in cache.rglob("v0*") if path.is_dir()]


def test_a_rerun_that_reuses_the_newest_versions_eval_leaves_no_copy_of_it_in_the_weight_cache(tmp_path):
    """A rerun's evaluation of its start (``reuse``, no version named) loads the newest version
    that verifies to learn its number: when the ``evals`` table held it already, nothing was
    measured and that copy stayed in the weight cache for good, a model's size per rerun."""
    config = tiny_config(
        tmp_path / "runs", "eval-reuse-cache", warm_start={"enabled": False}, eval={"tasks_per_env": 1}
    )
    base = build_base_version(config, log=lambda line: None)
    cache = WeightStore(run_store(config)).cache_dir
    for _ in range(2):  # measured, then the recorded row reused
        assert evaluating(config, reuse=True)["version"] == base
        assert not [path for path in cache.rglob("v0*") if path.is_dir()]


def _measured(config, version, tasks=None):
    """A measurement of arith and guess (of those of them in ``tasks`` where given)."""
    from rollout.evaluate import EvalResult

    reward = {"arith": 0.25 * version, "guess": 0.5}
    envs = [env for env in reward if tasks is None or env in tasks]
    return EvalResult(
        version=version,
        reward={env: reward[env] for env in envs},
        count={env: 4 for env in envs},
        statuses={env: {"ok": 4} for env in envs},
    )


def test_the_evaluate_flow_updates_the_runs_keyed_evals_artifact_with_every_version(tmp_path, monkeypatch):
    import tasks.weights
    from flows.evaluate import evaluate
    from tasks.report import artifact_key
    from tests.flows.prefect_api import artifacts_of

    config = tiny_config(tmp_path / "runs", "Eval_Keyed", warm_start={"enabled": False})
    holding_versions(config, 2)
    monkeypatch.setattr(tasks.weights, "evaluate_weights", _measured)
    states = [evaluate(config, version, return_state=True) for version in (1, 2)]
    assert all(state.is_completed() for state in states)

    first, second = (artifacts_of([s.state_details.flow_run_id]) for s in states)
    assert [a.key for a in first + second] == [f"{artifact_key('Eval_Keyed')}-evals"] * 2
    rows = [(r["version"], r["env"], r["reward"]) for r in json.loads(second[0].data)]
    assert rows == [(1, "arith", 0.25), (1, "guess", 0.5), (2, "arith", 0.5), (2, "guess", 0.5)]


def test_an_artifact_the_prefect_api_refuses_does_not_fail_an_evaluation_already_recorded(
    tmp_path, monkeypatch, caplog
):
    """The rows are in the ``evals`` table before the artifact is made: a failed flow run
    would be run again and record the version a second time."""
    import httpx
    from prefect.client.orchestration import SyncPrefectClient

    import tasks.weights
    from flows.evaluate import evaluate

    def unreachable(*args, **kwargs):
        raise httpx.ConnectError("the Prefect API is away")

    config = tiny_config(tmp_path / "runs", "eval-api-away", warm_start={"enabled": False})
    holding_versions(config, 1)
    monkeypatch.setattr(tasks.weights, "evaluate_weights", _measured)
    monkeypatch.setattr(SyncPrefectClient, "create_artifact", unreachable)

    state = evaluate(config, 1, return_state=True)

    assert state.is_completed()
    assert state.result()["reward"] == {"arith": 0.25, "guess": 0.5}
    assert Tables(run_store(config)).read("evals").num_rows == 2
    assert "the evals artifact of run eval-api-away failed, the work goes on" in caplog.text


def test_a_retried_evaluation_whose_rows_landed_before_it_raised_records_them_once(tmp_path, monkeypatch):
    """The ``evals`` commit lands and the task raises after it (a lost reply): Prefect runs
    the task again, and its append must find the first attempt's commit, not add the rows
    a second time."""
    import tasks.weights
    from flows.evaluate import evaluate

    config = tiny_config(tmp_path / "runs", "eval-retried", warm_start={"enabled": False})
    holding_versions(config, 1)
    monkeypatch.setattr(tasks.weights, "evaluate_weights", _measured)
    monkeypatch.setattr(
        tasks.weights, "evaluate_task", tasks.weights.evaluate_task.with_options(retry_delay_seconds=0)
    )
    real_append, raised = Tables.append, []

    def lands_then_raises(self, name, rows, once=None):
        appended = real_append(self, name, rows, once)
        if name == "evals" and not raised:
            raised.append(once)
            raise OSError("connection reset before the reply")
        return appended

    monkeypatch.setattr(Tables, "append", lands_then_raises)

    state = evaluate(config, 1, return_state=True)

    assert state.is_completed() and len(raised) == 1
    rows = Tables(run_store(config)).read("evals").to_pylist()
    assert sorted((r["version"], r["env"], r["reward"]) for r in rows) == [
        (1, "arith", 0.25),
        (1, "guess", 0.5),
    ]


def test_a_retried_evaluation_of_the_newest_version_records_the_version_the_retry_measured(
    tmp_path, monkeypatch
):
    """The first attempt's rows of version 1 land and it raises; the trainer publishes
    version 2 meanwhile, which the retry (the newest, as asked) measures: its append carried
    the first attempt's id and recorded nothing, so the flow returned version 2's reward
    while the ``evals`` table held no row of it."""
    import tasks.weights
    from flows.evaluate import evaluate

    config = tiny_config(tmp_path / "runs", "eval-moved", warm_start={"enabled": False})
    holding_versions(config, 1)
    weights = WeightStore(run_store(config))
    monkeypatch.setattr(
        tasks.weights, "evaluate_weights", lambda c, v, tasks=None: _measured(c, weights.latest(), tasks)
    )
    monkeypatch.setattr(
        tasks.weights, "evaluate_task", tasks.weights.evaluate_task.with_options(retry_delay_seconds=0)
    )
    real_append = Tables.append

    def lands_then_raises(self, name, rows, once=None):
        appended = real_append(self, name, rows, once)
        if name == "evals" and weights.latest() == 1:
            weights.publish({"w": torch.zeros(2)}, {}, None, step=2)
            raise OSError("connection reset before the reply")
        return appended

    monkeypatch.setattr(Tables, "append", lands_then_raises)

    result = evaluate(config)

    assert result["version"] == 2
    rows = Tables(run_store(config)).read("evals").to_pylist()
    assert sorted((r["version"], r["env"]) for r in rows) == [
        (1, "arith"),
        (1, "guess"),
        (2, "arith"),
        (2, "guess"),
    ]


def test_an_evaluation_runs_no_more_rollouts_at_once_than_the_runs_concurrency(tmp_path, monkeypatch):
    """``orchestrator.concurrency`` is what the run's machine holds of rollouts in flight (their
    sandboxes, agent programs); an evaluation ran 64 at once whatever it said."""
    from rollout.service import RolloutService

    config = tiny_config(
        tmp_path / "runs", "eval-concurrency", warm_start={"enabled": False}, orchestrator={"concurrency": 2}
    )
    base = build_base_version(config, log=lambda line: None)
    process = RolloutService.process
    in_flight = {"now": 0, "most": 0}

    async def counted(self, request):
        in_flight["now"] += 1
        in_flight["most"] = max(in_flight["most"], in_flight["now"])
        try:
            return await process(self, request)
        finally:
            in_flight["now"] -= 1

    monkeypatch.setattr(RolloutService, "process", counted)
    result = evaluate_weights(config, base)
    assert sum(result.count.values()) == 4 * len(config.orchestrator.mix)
    assert in_flight["most"] == 2


def test_a_rerun_whose_mix_gained_an_env_measures_the_version_again_and_one_that_lost_one_reuses_it(
    tmp_path, monkeypatch
):
    """The recorded rows stand for the envs they measured: a rerun with another env in the
    mix measures the version on all of them rather than reuse the rows of some; one with an
    env fewer reuses the rows of those it kept, passing over the others' rows."""
    import tasks.weights

    calls = []
    monkeypatch.setattr(
        tasks.weights,
        "evaluate_weights",
        lambda config, version, tasks: calls.append(sorted(tasks)) or _measured(config, version, tasks),
    )
    config = tiny_config(tmp_path / "runs", "eval-mix", warm_start={"enabled": False})
    arith_only = config.model_copy(
        update={"orchestrator": config.orchestrator.model_copy(update={"mix": {"arith": 1.0}})}
    )
    evaluating(arith_only, 1, reuse=True)
    evaluating(config, 1, reuse=True)
    assert calls == [["arith"], ["arith", "guess"]], "the rows of part of the mix were reused"
    assert evaluating(config, 1, reuse=True)["statuses"] == {}
    assert evaluating(arith_only, 1, reuse=True) == {
        "version": 1,
        "reward": {"arith": 0.25},
        "count": {"arith": 4},
        "statuses": {},
    }
    assert len(calls) == 2


def test_a_reused_eval_is_the_versions_latest_measurement_by_its_time(tmp_path):
    """Of two rows of one env measured alike, the one measured last stands, whatever order
    the table gives them back in (a Delta table keeps no order between its files)."""
    from datetime import UTC, datetime

    config = tiny_config(tmp_path / "runs", "eval-latest", warm_start={"enabled": False})
    later = {"version": 2, "reward": 0.5, "count": 4, "tasks": 4, "time": datetime(2021, 1, 1, tzinfo=UTC)}
    earlier = {**later, "reward": 0.125, "time": datetime(2020, 1, 1, tzinfo=UTC)}
    Tables(run_store(config)).append(
        "evals",
        [  # the later measurement first
            {**row, "env": env, "setup": eval_setup(config, env)}
            for env in config.orchestrator.mix
            for row in (later, earlier)
        ],
    )
    assert evaluating(config, 2, reuse=True)["reward"] == {env: 0.5 for env in config.orchestrator.mix}


def test_the_held_out_tasks_are_drawn_by_the_eval_seed_not_the_runs(tmp_path):
    """A run's seed (its training tasks, its sampling) leaves the held-out set as it is, so the
    evaluations of runs of other seeds measure the same problems; ``eval.seed`` draws another."""

    def prompts(**overrides) -> list[str]:
        return [task.prompt for task in eval_tasks(tiny_config(tmp_path / "runs", **overrides), "arith")]

    assert prompts(seed=5) == prompts()
    assert prompts(eval={"seed": 5}) != prompts()


def test_an_evaluation_of_the_train_split_measures_the_train_tasks(tmp_path, monkeypatch):
    """``evaluate_weights(..., "train")`` measures the problems the policy trains on, beside the
    held-out ones it measures by default."""
    from rollout.service import RolloutService

    config = tiny_config(tmp_path / "runs", "eval-train-split", warm_start={"enabled": False})
    base = build_base_version(config, log=lambda line: None)
    measured = []
    process = RolloutService.process

    async def recording(self, request):
        measured.append(request.task.prompt)
        return await process(self, request)

    monkeypatch.setattr(RolloutService, "process", recording)
    for split in ("train", "eval"):
        measured.clear()
        evaluate_weights(config, base, split)
        listed = [task.prompt for env in config.orchestrator.mix for task in eval_tasks(config, env, split)]
        assert sorted(measured) == sorted(listed), split


def test_an_evaluation_ends_a_reply_at_every_eos_id_of_the_version(tmp_path, monkeypatch):
    """As a rollout worker's gateway does (``test_worker_eos``): a model whose generation config
    lists EOS ids besides its tokenizer's (Qwen2.5 instruct) ends a reply at each of them; an
    evaluation that sampled on past them measured replies the workers never give."""
    from rollout.service import RolloutService

    config = tiny_config(tmp_path / "runs", "eval-eos", warm_start={"enabled": False})
    config = config.model_copy(
        update={"orchestrator": config.orchestrator.model_copy(update={"mix": {"arith": 1.0}})}
    )
    model, tokenizer = build_tiny_model(config.model.tiny)
    model.generation_config.eos_token_id = list(range(len(tokenizer)))  # every token ends a reply
    publish_policy(WeightStore(run_store(config)), model, tokenizer, step=0)
    replies = []
    process = RolloutService.process

    async def recording(self, request):
        result = await process(self, request)
        replies.append(sum(result.record["action_mask"]))
        return result

    monkeypatch.setattr(RolloutService, "process", recording)
    evaluate_weights(config, 0)
    assert replies == [1] * config.eval.tasks_per_env


def test_an_evaluation_leaves_no_engine_running(tmp_path):
    """The pipeline evaluates version after version in one process: an engine left running
    after its evaluation kept its thread and its copy of the model (on a GPU, its memory)."""
    import threading

    config = tiny_config(
        tmp_path / "runs", "eval-closed", warm_start={"enabled": False}, eval={"tasks_per_env": 1}
    )
    base = build_base_version(config, log=lambda line: None)
    assert evaluate_weights(config, base).version == base
    assert not [thread for thread in threading.enumerate() if thread.name == "torch-engine-eval"]


@pytest.mark.parametrize("pruned", [True, False], ids=["pruned-version", "no-version"])
def test_the_evaluate_flow_given_a_version_the_run_does_not_hold_fails_in_one_line_before_its_tasks(
    tmp_path, monkeypatch, pruned
):
    """A pruned version given in a deployment's form failed the flow run with
    ``KeyError: 'weight version 1 does not exist…'`` once its tasks were listed."""
    import tasks.weights
    from flows.evaluate import evaluate

    config = tiny_config(tmp_path / "runs", "eval-pruned")
    store = run_store(config)
    if pruned:
        holding_versions(config, 3)
        WeightStore(store).retain(2)
    started = []
    monkeypatch.setattr(tasks.weights, "evaluate_task", lambda *args: started.append(args))
    state = evaluate(config, 1, return_state=True)
    assert state.is_failed()
    said = (
        f"weight version 1 does not exist in {store.url('weights')}; kept: v2 to v3 (2 in all)"
        if pruned
        else f"no weight version published in {store.url('weights')} (check run_id and storage.root)"
    )
    with pytest.raises(ValueError) as raised:
        state.result()
    assert str(raised.value) == said
    assert started == []


def test_the_evaluate_flow_retries_a_transient_error_listing_the_runs_versions(tmp_path, monkeypatch):
    """The flow lists the run's versions before its tasks; an S3 503 there failed a nightly
    evaluation at once, where every other storage read of the flow is retried."""
    import flows.evaluate
    import tasks.weights

    config = tiny_config(tmp_path / "runs", "eval-listing-retried")
    holding_versions(config, 1)
    listed, refused = WeightStore.list, []

    def fails_once(self):
        if not refused:
            refused.append("list")
            raise OSError("503 Slow Down (injected)")
        return listed(self)

    monkeypatch.setattr(WeightStore, "list", fails_once)
    monkeypatch.setattr(
        flows.evaluate,
        "published_versions",
        flows.evaluate.published_versions.with_options(retry_delay_seconds=0),
    )
    started = []
    monkeypatch.setattr(tasks.weights, "evaluate_task", lambda *args: started.append(args) or {})
    monkeypatch.setattr(flows.evaluate, "report_evals", lambda config: None)
    assert flows.evaluate.evaluate(config, 1) == {}
    assert refused == ["list"] and started == [(config, 1)]
