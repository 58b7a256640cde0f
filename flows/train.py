"""The train flow: continuous SAO on processed shards, publishing weight versions.

``python -m flows.train --config configs/tiny.yaml``. Killed and started again, it
resumes from ``weights/LATEST`` (or, when that version's files do not verify, the newest
below it that does) without losing or repeating a trajectory.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.cli_args import flow_command
from flows.config import RunConfig, missing_device, too_few_demos, train_devices, train_paths
from flows.run_body import run_body
from tasks.common import deadline_of
from tasks.report import report_task


@flow(name="train", flow_run_name="{config.run_id}", log_prints=True)
def train(config: RunConfig = RunConfig(), drain: bool = False) -> dict[str, Any]:
    """Train until the stop condition, then report the curves.

    Args:
        config: the run.
        drain: also stop once every committed processed shard is trained (a nightly run
            over what arrived since the last one; with ``sao.publish_every`` null it publishes
            one version as it stops, and the versions it would publish as it went do not age
            that backlog past ``sao.max_staleness``).
    """
    # a run started from a deployment's form is checked here: on a run that has a version
    # the trainer's device is first used once the warm start is over
    problem = missing_device(train_devices(config)) or train_paths(config) or too_few_demos(config)
    if problem is not None:
        raise ValueError(problem)
    with run_body():
        # the tasks import torch and transformers: here, so that --help and a bad config answer at once
        from tasks.train import train as train_task
        from tasks.weights import warm_start

        warm_start(config)
        result = train_task(config, deadline_of(config), drain)
        report_task(config)
        return result


@flow_command
def main(argv: list[str] | None = None) -> None:
    from flows.cli import temporary_api, weight_versions
    from flows.cli_args import parse
    from tasks.common import run_store

    config, args = parse(
        "Train on processed shards.",
        argv,
        extra=lambda p: p.add_argument(
            "--drain", action="store_true", help="Stop once every processed shard is trained."
        ),
        devices=train_devices,
        paths=train_paths,
        warm_starts=True,
    )
    weight_versions(run_store(config))
    temporary_api()
    train(config, drain=args.drain)


if __name__ == "__main__":
    main()
