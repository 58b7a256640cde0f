"""The process flow: continuous, or one pass when triggered by a shard-commit event.

``python -m flows.process --config configs/tiny.yaml [--once]``
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.cli_args import flow_command
from flows.config import RunConfig
from flows.run_body import run_body
from tasks.common import deadline_of


@flow(name="process", flow_run_name="{config.run_id}", log_prints=True)
def process(config: RunConfig = RunConfig(), continuous: bool = True) -> dict[str, Any]:
    """Turn raw shards into processed shards and ``trajectories`` rows.

    Args:
        config: the run.
        continuous: process shards as they are committed until the stop condition; off: one
            pass over the shards pending when it starts, then end.
    """
    with run_body():
        # the tasks import torch and transformers: here, so that --help and a bad config answer at once
        from tasks.process import process_pending, process_shards

        if continuous:
            return process_shards(config, deadline_of(config))
        return process_pending(config)


@flow_command
def main(argv: list[str] | None = None) -> None:
    from flows.cli import existing_run, temporary_api
    from flows.cli_args import parse
    from tasks.common import run_store

    config, args = parse(
        "Process raw shards.",
        argv,
        extra=lambda p: p.add_argument("--once", action="store_true", help="One pass, then exit."),
        paths=None,
    )
    if args.once:  # a continuous processor may start before the run's first write; one pass may not
        existing_run(run_store(config), hint="storage.root and --run-id")
    temporary_api()
    process(config, continuous=not args.once)


if __name__ == "__main__":
    main()
