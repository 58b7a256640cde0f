"""The whole loop at once — rollout, process and train side by side — the embedded default.

``python -m flows.pipeline --config configs/tiny.yaml``
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from prefect import flow, get_run_logger
from prefect.futures import PrefectFuture, as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from flows.cli_args import flow_command
from flows.config import (
    RunConfig,
    missing_device,
    missing_gateway_token,
    missing_path,
    missing_ray,
    pipeline_devices,
    rollout_problem,
    too_few_demos,
    unreachable_ray,
)
from flows.run_body import run_body
from rollout.config import GatewayHTTPConfig
from storage.config import RunStore
from tasks.common import SIGNAL_RETRY_S, clear_signals, run_store, send_signal
from tasks.event_loop import wait_awake
from tasks.report import report_task

WIND_DOWN_RETRY_S = (*SIGNAL_RETRY_S, 8.0, 16.0, 32.0)
"""Waits between the attempts to raise each signal as the tasks wind down in order: longer than
a signal's own, since one refused past them is raised with the others at once, and training may
then stop before processing has handled the last shards."""


def _wind_down(
    config: RunConfig,
    signals: str,
    rollout_run: PrefectFuture,
    process_run: PrefectFuture,
    train_run: PrefectFuture,
) -> tuple[dict, dict, dict]:
    """Wait for the three tasks, ending each when the one it depends on is done.

    Whichever ends first (its stop condition, or a failure): training or processing over
    stops the rollouts; rollouts over end processing once it has processed what they
    committed; processing over makes the trainer train what is left and stop.
    So no stop condition (a step count with no wall-clock limit) leaves a task running, nor
    does a rollouts task that fails before its worker is up leave processing and training
    waiting for the deadline it never raised.
    A signal the store refuses is tried again for longer than a task's own
    (:data:`WIND_DOWN_RETRY_S`), so that each task still ends after the one before it; refused
    past that, or the flow stopping, all three are raised at once and the refusal logged.
    Its waits wake the main thread (:func:`~tasks.event_loop.wait_awake`): a Ctrl-C or a
    cancellation's SIGTERM the kernel gave to another thread stops the flow at once.
    A failed or crashed task's error is raised once all three are over. The signals go once all three
    are over, however the flow ends: they are this flow run's alone (``signals`` is its own key).
    """
    store = run_store(config)
    try:
        first = wait_awake(lambda: next(as_completed([rollout_run, process_run, train_run])))
        if first is not rollout_run:  # nothing more will be trained, or processed: rollouts stop
            send_signal(store, signals, "stop", WIND_DOWN_RETRY_S)
        wait_awake(rollout_run.wait)
        send_signal(store, signals, "rollouts-done", WIND_DOWN_RETRY_S)
        wait_awake(process_run.wait)
        send_signal(store, signals, "processed", WIND_DOWN_RETRY_S)
        wait_awake(train_run.wait)
    except BaseException as error:  # the flow is stopping (cancelled, interrupted, a signal refused): end all
        sent = _end_all(store, signals, (rollout_run, process_run, train_run))
        if isinstance(error, Exception):  # a signal the store refused: a task's failure is the run's error
            if sent:  # raised on a second try: the tasks were wound down, their results stand
                get_run_logger().warning("the run's store refused a signal, then took it: %s", error)
                return rollout_run.result(), process_run.result(), train_run.result()
            for run in (rollout_run, process_run, train_run):
                if run.state.is_failed() or run.state.is_crashed():
                    run.result()  # raises its error
        raise
    _clear_signals(store, signals)
    return rollout_run.result(), process_run.result(), train_run.result()


def _submitted(
    config: RunConfig, signals: str, submits: Sequence[Callable[[], PrefectFuture]]
) -> list[PrefectFuture]:
    """The futures of ``submits`` (the rollout, process and train tasks' submissions), called in
    turn. Stopped part way (a Ctrl-C, a submission that fails), the tasks already submitted are
    told to end, and waited for, before the error is raised: no wind-down would end them else,
    and a task without a deadline (or the flow waiting on its thread) ran on."""
    runs: list[PrefectFuture] = []
    try:
        for submit in submits:
            runs.append(submit())
    except BaseException:
        _end_all(run_store(config), signals, runs)
        raise
    return runs


def _end_all(store: RunStore, signals: str, runs: Sequence[PrefectFuture]) -> bool:
    """Raise the three signals at once, and, when each was raised, wait for ``runs`` to end at
    them and remove the signals. Whether each was raised; one refused is logged."""
    sent = True
    for name in ("stop", "rollouts-done", "processed"):
        try:  # one signal that cannot be raised must not keep the others from being sent
            send_signal(store, signals, name)
        except Exception as exc:
            sent = False
            get_run_logger().error(
                "could not raise signal %r; the tasks waiting for it on Ray run to their deadline: %s",
                name,
                exc,
            )
    if sent:  # each task stops at its signal: removed once none is left to watch them
        for run in runs:
            wait_awake(run.wait)
        _clear_signals(store, signals)
    return sent


def untrained_warning(rollouts: dict[str, Any], http: GatewayHTTPConfig, trained: dict[str, Any]) -> str:
    """Why a run took no policy step, from what its rollout and train tasks returned
    (``rollouts``, ``trained``): a run already at its ``stop.max_policy_steps`` (a rerun), else
    what the worker finished and wrote, the groups it dropped for equal rewards (never written),
    and, for a worker serving the gateway's HTTP API (``http``), the records harnesses had it
    write: a worker serving only runs none of its own."""
    if trained["stop_reason"] == "max_steps":
        return (
            f"no policy step: the run was already at policy step {trained['steps']}, its "
            "stop.max_policy_steps (which counts the steps of earlier flow runs too): raise it to train further"
        )
    orchestrator = rollouts["orchestrator"]
    count = rollouts["harness_records"]
    harnesses = (
        f"harnesses wrote {count} record{'' if count == 1 else 's'}" if count else "harnesses wrote no record"
    )
    if http.serve_only:
        return (
            "no policy step: the trainer got too little to train on; the rollout worker served harnesses "
            f"only (gateway_http.serve_only), and {harnesses}"
        )
    dropped = orchestrator["groups_filtered"]
    groups = orchestrator["groups_kept"] + dropped
    return (
        f"no policy step: the trainer got too little to train on; {orchestrator['written']} of "
        f"{orchestrator['finished']} rollouts finished were written"
        + (
            f", {dropped} of {groups} groups dropped with every reward in them equal "
            "(orchestrator.filter_uniform_groups)"
            if dropped
            else ""
        )
        + (f", and {harnesses}" if http.port is not None else "")
    )


def _clear_signals(store: RunStore, signals: str) -> None:
    """Remove the signals of ``signals`` once its tasks are over; a store that fails to is
    logged: a few leftover files must not fail a run whose tasks are done (nor replace the
    error of one that failed)."""
    try:
        clear_signals(store, signals)
    except Exception as exc:
        get_run_logger().warning("could not remove the signals of %s: %s", signals, exc)


def _run_on_ray(config: RunConfig, signals: str) -> tuple[dict, dict, dict]:
    """The three long-running tasks as Ray tasks on the cluster at ``config.ray_address``.

    The rollout task only drives its engine and env actors, so it asks for no CPU of its
    own; processing and training take one each, and training on CUDA a GPU too: without it
    Ray may place the trainer on a node with none (the head) or on one whose GPUs engine
    actors hold. Ray shows the task only its GPU, as ``cuda`` (``cuda:0``). Ray would keep
    a task that no node can place (a trainer on CUDA, a cluster without a GPU) pending for
    ever, and the flow waiting on it: each is first placed by a probe, which fails the run
    after ``engine.load_timeout_s``, naming what it asks for. So are they all at once with the
    rollout worker's actors, in one placement group held for the run: processing and training
    hold their CPUs for the whole run, and an actor that found none free waited for them (the
    run wrote no rollout before its deadline); placed freely, processing could take the CPU of
    the node whose GPU the trainer needs, or another job what the check found free. Each
    runs in its bundle (the rollout task, which asks for nothing, places its actors in theirs);
    the group is removed once the run is over, however it ends, stopping any of them still running.
    The three are submitted at once: processing and training wait for the deadline the
    rollouts raise once their worker is up, the trainer loading meanwhile.
    """
    from prefect_ray.context import remote_options
    from prefect_ray.task_runners import RayTaskRunner
    from ray.util.placement_group import remove_placement_group

    from rollout.ray_actors import in_bundle, reserve_together, wait_placeable
    from rollout.ray_engine import actor_device
    from tasks.process import process_shards
    from tasks.rollout import connect_run_ray, rollout_actor_resources, rollouts
    from tasks.train import train

    process_options = {"num_cpus": 1}
    train_options = {"num_cpus": 1, "num_gpus": 1 if config.trainer_device.startswith("cuda") else 0}
    connect_run_ray(config, task_cpus=process_options["num_cpus"] + train_options["num_cpus"])
    for kind, options in (("process-shards", process_options), ("train", train_options)):
        wait_placeable(kind, options, config.engine.load_timeout_s, "engine.load_timeout_s")
    requests = [process_options, train_options, *rollout_actor_resources(config)]
    group = reserve_together(
        "processing, training and the rollout worker's actors",
        requests,
        config.engine.load_timeout_s,
        "engine.load_timeout_s",
    )
    try:
        process_bundle, train_bundle, *actor_bundles = (in_bundle(group, i) for i in range(len(requests)))
        train_config = config.model_copy(update={"trainer_device": actor_device(config.trainer_device)})
        with RayTaskRunner(address=config.ray_address) as runner:

            def submit(task, parameters: dict, options: dict) -> PrefectFuture:
                with remote_options(**options):
                    return runner.submit(task, parameters)

            tasks = (
                (
                    rollouts,
                    {"config": config, "signals": signals, "placements": actor_bundles},
                    {"num_cpus": 0},
                ),
                (
                    process_shards,
                    {"config": config, "signals": signals},
                    {**process_options, **process_bundle},
                ),
                (train, {"config": train_config, "signals": signals}, {**train_options, **train_bundle}),
            )
            runs = _submitted(config, signals, [functools.partial(submit, *task) for task in tasks])
            return _wind_down(config, signals, *runs)
    finally:
        remove_placement_group(group)


@flow(
    name="pipeline",
    flow_run_name="{config.run_id}",
    task_runner=ThreadPoolTaskRunner(max_workers=3),
    log_prints=True,
)
def pipeline(config: RunConfig = RunConfig()) -> dict[str, Any]:
    """Warm-start (if needed) and evaluate the starting version (0 on a new run, the newest
    on a rerun), run rollouts, processing and training concurrently until the stop
    condition, then evaluate the newest version and report. A version whose held-out reward
    the ``evals`` table holds already is not evaluated again.

    With ``cluster: ray`` the three run as Ray tasks (prefect-ray's task runner), the
    engines and environments as Ray actors.

    Args:
        config: the run.
    """
    # a run started from a deployment's form is checked here: the trainer's device is
    # first used once the warm start and the first evaluation are over
    problem = (
        missing_device(pipeline_devices(config))
        or missing_ray(config)
        or unreachable_ray(config)
        or missing_path(config)
        or rollout_problem(config, ("train", "eval"))
        or too_few_demos(config)
        or missing_gateway_token(config)
    )
    if problem is not None:
        raise ValueError(problem)
    with run_body():
        # the tasks import torch and transformers: here, so that --help and a bad config answer at once
        import torch

        from tasks.process import process_shards
        from tasks.rollout import rollouts
        from tasks.train import train
        from tasks.weights import evaluate_task, warm_start

        logger = get_run_logger()
        torch.set_num_threads(1)
        warm_start(config)
        # the newest version that verifies: the one the trainer and the workers start from
        before = evaluate_task(config, reuse=True)
        logger.info("version %d held-out reward before RL: %s", before["version"], before["reward"])
        signals = uuid.uuid4().hex
        if config.cluster == "ray":
            generated, processed, trained = _run_on_ray(config, signals)
        else:
            # processing and training wait for the deadline the rollouts raise once their worker
            # is up (stop.max_seconds from then): the trainer loads meanwhile
            runs = _submitted(
                config,
                signals,
                [
                    lambda task=task: task.submit(config, signals=signals)
                    for task in (rollouts, process_shards, train)
                ],
            )
            generated, processed, trained = _wind_down(config, signals, *runs)
        if not trained["new_steps"]:
            logger.warning(untrained_warning(generated, config.gateway_http, trained))
        after = evaluate_task(config, reuse=True)
        report_task(config)
        gain = {
            env: round(after["reward"][env] - before["reward"].get(env, 0.0), 6) for env in after["reward"]
        }
        logger.info(
            "version %d held-out reward after RL: %s (gain %s)", after["version"], after["reward"], gain
        )
        return {
            "run_id": config.run_id,
            "before": before,
            "after": after,
            "gain": gain,
            "rollouts": generated["orchestrator"],
            "processed": processed,
            "trained": trained,
        }


@flow_command
def main(argv: list[str] | None = None) -> None:
    from flows.cli import temporary_api, weight_versions
    from flows.cli_args import parse

    config, _ = parse(
        "Warm start, run rollout, process and train at once, then evaluate and report.",
        argv,
        devices=pipeline_devices,
        ray=True,
        splits=("train", "eval"),
        warm_starts=True,
        serves_gateway=True,
    )
    weight_versions(run_store(config))
    temporary_api()
    pipeline(config)


if __name__ == "__main__":
    main()
