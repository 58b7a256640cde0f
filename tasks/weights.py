"""Tasks that create and evaluate weight versions: the warm-started base version, evals."""

from __future__ import annotations

import hashlib
import json
import pathlib
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import numpy as np
from prefect import get_run_logger, task
from prefect.runtime import task_run

from envs import registry
from envs.base import Split, Task, TooFewTasks
from flows.config import RunConfig
from rl.models import build_tiny_model, load_trained_policy, model_eos_ids, padding_id, publish_policy
from rl.sft import supervised_warm_start
from rollout.config import SEED_STRIDE
from rollout.demos import demonstrations
from rollout.engines.torch_engine import TorchEngine
from rollout.evaluate import EVAL_CONCURRENCY, EvalResult, evaluate
from rollout.gateway import ChatRenderer
from storage.tables import Tables
from storage.weights import CorruptVersion, VersionTaken, WeightStore
from tasks.common import SIDE_EFFECTS, STORAGE_RETRIES, announce_version, reporting, run_store
from tasks.event_loop import run_async

PROGRESS_EVERY_S = 15.0
"""How often the warm start logs its progress (demonstrations played, steps taken)."""

BASE_VERSION_WAIT_S = 300.0
"""How old the claim of version 0 may grow (its publish renews it while uploading) before a
process that lost the race to publish it takes the claimer for dead."""


def demonstration_data(
    config: RunConfig, tokenizer, envs: list[str] | None = None, log: Callable[[str], None] | None = None
) -> tuple[list[list[int]], list[list[bool]]]:
    """Token sequences and loss masks of the train-split demonstrations of each env in
    ``envs`` (the mix when None; ``warm_start.demos`` or ``demos_per_env`` of each, 0 leaving
    it out), laid out as the gateway does, up to ``orchestrator.concurrency`` played at once
    (the sandboxes the run's machine holds); ``log`` is told how many are done every
    :data:`PROGRESS_EVERY_S`. An env that cannot give as many (too few train problems, no
    scripted solver) is a ``ValueError`` naming the setting to change; any other error (a
    demonstrator's bug) is raised as it is."""
    renderer = ChatRenderer(tokenizer, config.gateway.chat_template_kwargs)
    sequences, masks = [], []
    for name in envs or list(config.orchestrator.mix):
        env_config = config.env_config(name)
        count = config.warm_start.count(name)
        if count == 0:
            continue
        try:
            tasks = registry.task_set(name, "train", config.seed, count, env_config)
            seqs, msks = run_async(
                demonstrations(
                    renderer,
                    lambda t, c=env_config: registry.make(t.env, c),
                    tasks,
                    lambda t: registry.demonstrate(t, flawed=config.warm_start.flawed, seed=config.seed),
                    concurrency=config.orchestrator.concurrency,
                    on_done=_progress(log, name, count),
                )
            )
        except (TooFewTasks, NotImplementedError) as exc:  # too few problems; no scripted solver
            raise ValueError(
                f"warm_start: {count} demonstrations of {name}: {exc}; set warm_start.demos.{name} "
                "(0 leaves it out) or turn warm_start off"
            ) from None
        _check_action_lengths(config, name, msks, log)
        sequences += seqs
        masks += msks
    return sequences, masks


def action_lengths(mask: list[bool]) -> list[int]:
    """Tokens of each action of a demonstration (the runs of true in its loss ``mask``, each
    ending with its stop token)."""
    runs = [0]
    for trained in mask:
        if trained:
            runs[-1] += 1
        elif runs[-1]:
            runs.append(0)
    return [run for run in runs if run]


def _check_action_lengths(
    config: RunConfig, name: str, masks: list[list[bool]], log: Callable[[str], None] | None
) -> None:
    """Tell ``log`` how many of env ``name``'s demonstrated actions ``service.max_new_tokens``
    would cut: the warm start would teach actions that a rollout never finishes."""
    lengths = [length for mask in masks for length in action_lengths(mask)]
    over = [length for length in lengths if length > config.service.max_new_tokens]
    if over and log is not None:
        log(
            f"warm start: {len(over)} of {len(lengths)} demonstrated actions of {name} are longer than "
            f"service.max_new_tokens={config.service.max_new_tokens} (the longest {max(over)} tokens, its "
            "stop token included): rollouts cut them short, so the policy learns actions it cannot "
            "finish; raise service.max_new_tokens"
        )


def _progress(log: Callable[[str], None] | None, name: str, count: int) -> Callable[[], None]:
    """What is called as each of ``count`` demonstrations of ``name`` ends: it tells ``log``
    how many are, every :data:`PROGRESS_EVERY_S`."""
    done, last = 0, time.monotonic()

    def on_done() -> None:
        nonlocal done, last
        done += 1
        if log is not None and time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            log(f"warm start: {done} of {count} demonstrations of {name} played")

    return on_done


def build_base_version(
    config: RunConfig,
    log=print,
    owner: str | None = None,
    on_publish: Callable[[int], None] | None = None,
) -> int:
    """Publish version 0 if the run has none: the starting policy, warm-started on the
    environments' demonstrations when ``warm_start.enabled``. Returns the latest version.

    Flows of one run started together (a trainer and a rollout worker on two machines) may both
    warm-start; the first to claim version 0 publishes it and the others wait for it and use it,
    however long its upload takes (the claim is renewed meanwhile). A claim not renewed for
    ``BASE_VERSION_WAIT_S`` belongs to a process that died before publishing: this base is then
    published under the next number. A claim made by ``owner`` (the same on every retry of the
    caller) whose publish failed is taken back at once; one whose publish wrote version 0 whole
    and failed only to point ``LATEST`` at it is used as it is, nothing built again; a
    ``LATEST`` naming a version without a manifest is passed over for the newest complete one
    below it, as ``WeightStore.load_newest`` does (with none below, a ``FileNotFoundError``
    saying what to do); a latest base version with no ``weights`` row (its publish landed, its
    row did not) is recorded, while a trainer's is left to the trainer. ``on_publish`` is called
    with the version once this call recorded it: of two flows that meet a version between its
    publish and its row, only the one whose row lands announces it."""
    store = run_store(config)
    weights = WeightStore(store)
    try:
        latest = weights.latest()
    except CorruptVersion as error:
        log(f"{error}: pointing it at the newest complete version")
        latest = weights.recover_latest()
    if latest is None and (complete := weights.list()):  # written whole, its LATEST write failed
        log(f"weight version {complete[-1]} is complete and LATEST names no version: pointing LATEST at it")
        latest = weights.recover_latest()
    if latest is not None and latest not in (complete := weights.list()):
        # its folder deleted (by hand, a retention race): the trainer and the workers start
        # from the newest complete version below it (WeightStore.load_newest)
        below = [version for version in complete if version < latest]
        if not below:
            raise FileNotFoundError(
                f"{store.url('weights', 'LATEST')} names weight version {latest}, which has no manifest, "
                "and no complete version is below it: restore that version's folder, or delete LATEST "
                "to warm-start the run again"
            )
        log(
            f"LATEST names weight version {latest}, which has no manifest; using version {below[-1]} below it"
        )
        latest = below[-1]
    if latest is not None:
        log(f"run {config.run_id} already has weight version {latest}; not warm-starting")
        # a retry of a warm start whose row failed to land: its version was never announced
        tables = Tables(store)
        recorded = set(tables.read("weights").column("version").to_pylist())
        if (
            latest not in recorded
            and weights.manifest(latest).get("tag") == "base"
            and weights.record(tables, latest)
            and on_publish is not None
        ):
            on_publish(latest)
        return latest
    # the warm start trains where the trainer does; without one, publishing needs no device
    device = config.trainer_device if config.warm_start.enabled else "cpu"
    if config.model.path:
        model, tokenizer = load_trained_policy(config.model.path, device=device)
    else:
        model, tokenizer = build_tiny_model(config.model.tiny)
        model.to(device)
    metadata: dict[str, Any] = {
        "source": config.model.path or "tiny",
        "tiny_model": config.model.tiny.model_dump(),
    }
    if config.warm_start.enabled:
        started = time.monotonic()
        sequences, masks = demonstration_data(config, tokenizer, log=log)
        last_log = [time.monotonic()]

        def on_step(step: int, loss: float) -> None:
            if time.monotonic() - last_log[0] >= PROGRESS_EVERY_S:
                last_log[0] = time.monotonic()
                log(f"warm start: step {step}, loss {loss:.3f}")

        losses = supervised_warm_start(
            model, sequences, masks, padding_id(tokenizer, model), config.warm_start.sft, on_step=on_step
        )
        metadata["warm_start"] = {
            "demonstrations": len(sequences),
            "flawed": config.warm_start.flawed,
            "steps": len(losses),
            "final_loss": losses[-1],
            "seconds": round(time.monotonic() - started, 1),
        }
        log(
            f"warm start: {len(losses)} steps on {len(sequences)} demonstrations, loss {losses[0]:.3f} → {losses[-1]:.3f}"
        )
    version = 0
    while True:
        try:
            version = publish_policy(
                weights,
                model,
                tokenizer,
                config.sao.publish_dtype,
                step=0,
                metadata=metadata,
                tag="base",
                version=version,
                owner=owner,
            )
            break
        except VersionTaken:  # another flow of this run (a trainer, a worker) got there first
            log(f"another process is publishing version {version} of run {config.run_id}; using that one")
            latest = _wait_for_version(weights, version)
            if latest is not None:
                return latest
            # the next number, claimed as this one was: of flows that gave up together, one publishes
            log(
                f"version {version} of run {config.run_id} was claimed and its claim not renewed for "
                f"{BASE_VERSION_WAIT_S:.0f} s (its process died?); publishing this base as the next version"
            )
            version += 1
    if weights.record(Tables(store), version) and on_publish is not None:
        on_publish(version)
    return version


def _wait_for_version(weights: WeightStore, version: int) -> int | None:
    """The latest version once the base ``version`` is published whole; None once its claim
    has gone ``BASE_VERSION_WAIT_S`` without renewal (its publisher died)."""
    while (latest := weights.latest()) is None:
        if weights.list():  # written whole, its LATEST write failed
            return weights.recover_latest()
        if weights.claim_age(version) >= BASE_VERSION_WAIT_S:
            return None
        time.sleep(1.0)
    return latest


def evaluate_version(
    config: RunConfig,
    version: int | None = None,
    once: str | None = None,
    tasks: dict[str, list[Task]] | None = None,
) -> EvalResult:
    """Held-out reward of weight ``version`` (the newest that verifies when None) on every env in the mix,
    recorded in the ``evals`` table with the rollouts measured (those that failed outside the
    policy are not). An env whose every rollout failed so (an engine or a sandbox that never
    worked) measured nothing: that raises ``RuntimeError`` naming it, and nothing is recorded.

    ``once``: an id of this evaluation (see ``Tables.append``): a second call with it that
    measures the same version, a retry of one whose rows landed before it raised, records
    nothing; one that measures another (the newest moved on meanwhile) records its rows.

    ``tasks``: :func:`held_out_tasks` of ``config`` where the caller listed them already; each
    row's setup is that of the tasks measured."""
    tasks = held_out_tasks(config) if tasks is None else tasks
    result = evaluate_weights(config, version, tasks=tasks)
    unmeasured = [env for env, count in result.count.items() if count == 0]
    if unmeasured:
        raise RuntimeError(
            f"version {result.version} not evaluated: every rollout of "
            + ", ".join(
                f"{env} ({_statuses(result.statuses[env])}; the last: {result.errors[env]})"
                for env in unmeasured
            )
            + " failed outside the policy (engine, sandbox, environment host)"
        )
    Tables(run_store(config)).append(
        "evals",
        [
            {
                "version": result.version,
                "env": env,
                "reward": result.reward[env],
                "count": result.count[env],
                "time": datetime.now(UTC),
                "tasks": sum(result.statuses[env].values()),
                "setup": eval_setup(config, env, tasks[env]),
            }
            for env in result.reward
        ],
        once=None if once is None else f"{once}/{result.version}",
    )
    return result


def eval_setup(config: RunConfig, env: str, tasks: list[Task] | None = None) -> str:
    """Fingerprint of what an evaluation of ``env`` depends on besides the weights: the eval
    settings (tasks, seed, temperature), the held-out tasks themselves (a dataset file
    rewritten under its path, an env that draws its tasks otherwise), the env's config, the
    rollout limits (a rollout out of time scores 0), the context compaction (what the model
    sees in later turns), the reward model the env names (its settings and
    :func:`checkpoint_files`) and the precision and kind of device of the engine that samples
    (``engine.torch``; not its batch, cache or prefill sizes, which change only its speed).
    ``tasks``: :func:`eval_tasks` of ``env``, where the caller listed them already."""
    env_config = config.env_config(env)
    scorer = env_config.reward_model and config.service.reward_models[env_config.reward_model]
    engine = config.engine.torch
    listed = [task.model_dump(mode="json") for task in (eval_tasks(config, env) if tasks is None else tasks)]
    setup = {
        "eval": config.eval.model_dump(mode="json"),
        "tasks": hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest(),
        "env": env_config.model_dump(mode="json"),
        "max_turns": config.service.max_turns,
        "max_new_tokens": config.service.max_new_tokens,
        "timeout_s": config.service.timeout_s,
        "reward_model": scorer and {**scorer.model_dump(mode="json"), "files": checkpoint_files(scorer.path)},
        "gateway": config.gateway.model_dump(mode="json"),
        # a device's kind samples with its own generator and kernels; which one of a kind does not
        "engine": {"dtype": engine.dtype, "device": engine.device.split(":")[0]},
    }
    if config.service.compact_at is not None:  # absent when off: the setups recorded before it stay
        setup["compaction"] = {
            "compact_at": config.service.compact_at,
            "compact_keep_turns": config.service.compact_keep_turns,
        }
    return hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_files(path: str) -> list[tuple[str, int, int]]:
    """Name, size and modification time (ns) of each file of the checkpoint directory ``path``:
    a checkpoint saved anew under its path scores otherwise (none for a path that is not there).
    Hidden files and folders are not the checkpoint's: ``hf download --local-dir`` rewrites its
    bookkeeping in ``.cache/huggingface`` each time it finds the files up to date."""
    root = pathlib.Path(path)
    files = []
    for file in root.rglob("*"):
        hidden = any(part.startswith(".") for part in file.relative_to(root).parts)
        if file.is_file() and not hidden:
            stat = file.stat()
            files.append((str(file.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    return sorted(files)


def recorded_eval(
    config: RunConfig, version: int | None, tasks: dict[str, list[Task]] | None = None
) -> EvalResult | None:
    """``version``'s latest row of each env of the mix in the ``evals`` table measured as
    ``config`` would measure it (the same :func:`eval_setup`, of :func:`held_out_tasks` or of
    ``tasks`` where the caller listed them); None unless every env has one. Its ``statuses``
    are empty: the table does not keep them."""
    evals = Tables(run_store(config)).read("evals").sort_by("time").to_pylist()
    mix = list(config.orchestrator.mix)
    tasks = held_out_tasks(config) if tasks is None else tasks
    setups = {env: eval_setup(config, env, tasks[env]) for env in mix}
    latest = {
        row["env"]: row
        for row in evals
        if row["version"] == version and row["env"] in setups and row.get("setup") == setups[row["env"]]
    }
    if any(env not in latest for env in mix):
        return None
    return EvalResult(
        version=version,
        # the table's float32 as the digits it holds (0.43, not the 0.4300000071525574 it widens to)
        reward={env: float(str(np.float32(latest[env]["reward"]))) for env in mix},
        count={env: latest[env]["count"] for env in mix},
        statuses={},
    )


def _statuses(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))


def eval_tasks(config: RunConfig, name: str, split: Split = "eval") -> list[Task]:
    """The ``eval.tasks_per_env`` problems of env ``name``'s ``split`` an evaluation runs
    (:func:`~envs.registry.task_pool`: all of a split of fewer distinct ones, each once)."""
    return registry.task_pool(
        name, split, config.eval.seed, config.eval.tasks_per_env, config.env_config(name), distinct=True
    )


def held_out_tasks(config: RunConfig) -> dict[str, list[Task]]:
    """:func:`eval_tasks` of every env of the mix: listed once per evaluation, so that the
    setup recorded is that of the tasks measured (a set listed anew may differ, and ranking
    a large one takes seconds)."""
    return {name: eval_tasks(config, name) for name in config.orchestrator.mix}


def evaluate_weights(
    config: RunConfig,
    version: int | None = None,
    split: Split = "eval",
    *,
    tasks: dict[str, list[Task]] | None = None,
) -> EvalResult:
    """Reward of weight ``version`` (when None, the newest that verifies, as a rollout worker
    serves: ``WeightStore.load_newest``) on :func:`eval_tasks` of ``split`` of every env in
    the mix, an env's rollout ``i`` sampling with seed ``eval.seed * SEED_STRIDE + i``, recorded
    nowhere (``train``: how well the policy does on the problems it trains on, beside the
    held-out ones). ``tasks``: those of each env to run instead (``split`` then unused)."""
    if tasks is None:
        tasks = {name: eval_tasks(config, name, split) for name in config.orchestrator.mix}
    weights = WeightStore(run_store(config), one_copy=True)
    if version is None:
        version, path = weights.load_newest("serving")
    else:
        path = weights.load(version, "serving")
    listed = [task for name in config.orchestrator.mix for task in tasks[name]]

    async def run() -> EvalResult:
        engine = TorchEngine.from_config(config.engine.torch, path, name="eval", version=version)
        try:
            gateway_config = config.gateway
            if gateway_config.vocab_size is None:
                gateway_config = gateway_config.model_copy(update={"vocab_size": engine.vocab_size})
            if gateway_config.eos_token_ids is None:
                gateway_config = gateway_config.model_copy(update={"eos_token_ids": model_eos_ids(path)})
            return await evaluate(
                engine,
                engine.tokenizer,
                listed,
                lambda t: registry.make(t.env, config.env_config(t.env)),
                service_config=config.mix_service(),
                temperature=config.eval.temperature,
                # no more in flight than the run's rollout workers hold (their sandboxes, programs)
                concurrency=min(EVAL_CONCURRENCY, config.orchestrator.concurrency),
                gateway_config=gateway_config,
                seed=config.eval.seed * SEED_STRIDE,
            )
        finally:
            await engine.close()

    try:
        return run_async(run())
    finally:
        weights.release()


@task(name="warm-start", **SIDE_EFFECTS, **STORAGE_RETRIES)
def warm_start(config: RunConfig) -> int:
    """Create the run's version 0 (warm-started) unless it exists; emits an event when it does."""
    return build_base_version(
        config,
        log=get_run_logger().info,
        owner=f"task-run-{task_run.id}",
        on_publish=reporting(lambda version: announce_version(config, version), "event of the base version"),
    )


@task(name="evaluate", **SIDE_EFFECTS, **STORAGE_RETRIES)
def evaluate_task(config: RunConfig, version: int | None = None, reuse: bool = False) -> dict[str, Any]:
    """Held-out evaluation of a weight version; returns reward and count per env.
    ``reuse``: a version the ``evals`` table holds already (:func:`recorded_eval`) is not
    evaluated again, so a rerun of a run does not add a second row for its start."""
    recorded = None
    tasks = held_out_tasks(config)
    # its copy, held until the evaluation has loaded it, leaves the weight cache with it
    newest = WeightStore(run_store(config), one_copy=True)
    try:
        if reuse:
            # the one evaluate_weights would measure, not LATEST's when that does not verify
            if version is None:
                version = newest.load_newest("serving")[0]
            recorded = recorded_eval(config, version, tasks)
        # a retry of this task run repeats its id: rows a failed attempt committed are not added again
        result = recorded or evaluate_version(
            config, version, once=f"evals/task-run-{task_run.id}", tasks=tasks
        )
    finally:
        newest.release()
    how = " (recorded by an earlier evaluation)" if recorded else ""
    get_run_logger().info("version %d held-out reward%s: %s", result.version, how, result.reward)
    return {
        "version": result.version,
        "reward": result.reward,
        "count": result.count,
        "statuses": result.statuses,
    }
