"""The rollout flow: one worker's engines and orchestrator, long-lived.

``python -m flows.rollout --config configs/tiny.yaml [--worker NAME]``
"""

from __future__ import annotations

import argparse
import re
import uuid
from typing import Annotated, Any

from prefect import flow, get_run_logger
from pydantic import Field

from flows.cli_args import flow_command
from flows.config import (
    RunConfig,
    missing_device,
    missing_gateway_token,
    missing_path,
    missing_ray,
    rollout_devices,
    rollout_problem,
    schema_pattern,
    too_few_demos,
    unreachable_ray,
)
from flows.run_body import run_body
from storage.shards import NAME_PATTERN
from tasks.common import clear_signals, run_store


@flow(name="rollout", flow_run_name="{config.run_id}/{worker_name}", log_prints=True)
def rollout(
    config: RunConfig = RunConfig(),
    worker_name: Annotated[
        str, Field(pattern=NAME_PATTERN, json_schema_extra={"pattern": schema_pattern(NAME_PATTERN)})
    ] = "worker-0",
) -> dict[str, Any]:
    """Serve the newest weight version and write rollouts to raw shards until the stop condition.

    Args:
        config: the run.
        worker_name: the worker's name, its shard folder (letters, digits, ``_ . -``, not
            starting with ``.``); one running worker per name.
    """
    # a run started from a deployment's form is checked here: the engines, the reward
    # models and Ray are first used once the warm start is over
    problem = (
        missing_device(rollout_devices(config))
        or missing_ray(config)
        or unreachable_ray(config)
        or missing_path(config)
        or rollout_problem(config, ("train",))
        or too_few_demos(config)
        or missing_gateway_token(config)
    )
    if problem is not None:
        raise ValueError(problem)
    with run_body():
        # the tasks import torch and transformers: here, so that --help and a bad config answer at once
        from tasks.rollout import rollouts
        from tasks.weights import warm_start

        warm_start(config)
        # this flow run's own key: a retry of the task keeps the deadline its first attempt raised
        signals = uuid.uuid4().hex
        try:
            return rollouts(config, worker_name, signals=signals)
        finally:
            try:
                clear_signals(run_store(config), signals)
            except Exception as exc:  # a leftover file must not fail the run, nor replace its error
                get_run_logger().warning("could not remove the signals of %s: %s", signals, exc)


def _worker_name(text: str) -> str:
    """``--worker``, refused by argparse (exit 2, one line) when it cannot name a shard
    folder, before a flow run starts: the flow's own check fails the run with a traceback."""
    if not re.fullmatch(NAME_PATTERN, text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a worker name: letters, digits, '_', '.', '-' only, not starting with '.'"
        )
    return text


@flow_command
def main(argv: list[str] | None = None) -> None:
    from flows.cli import temporary_api, weight_versions
    from flows.cli_args import parse

    config, args = parse(
        "Generate rollouts into raw shards.",
        argv,
        extra=lambda p: p.add_argument(
            "--worker",
            type=_worker_name,
            default="worker-0",
            help="Worker name (its shard folder; default: %(default)s).",
        ),
        devices=rollout_devices,
        ray=True,
        splits=("train",),
        warm_starts=True,
        serves_gateway=True,
    )
    weight_versions(run_store(config))
    temporary_api()
    rollout(config, args.worker)


if __name__ == "__main__":
    main()
