"""The evaluate flow: a weight version on held-out tasks.

``python -m flows.evaluate --config configs/tiny.yaml [--version N]``
"""

from __future__ import annotations

import argparse
import sys
from typing import Annotated, Any

from prefect import flow
from prefect.runtime import flow_run
from pydantic import Field

from flows.cli import temporary_api, weight_versions
from flows.cli_args import flow_command
from flows.config import (
    RunConfig,
    evaluate_devices,
    evaluate_paths,
    missing_device,
    rollout_problem,
)
from flows.run_body import run_body
from storage.config import RunStore
from tasks.common import published_versions, run_store
from tasks.report import report_evals


def _run_name() -> str:
    """The evaluate flow run's name: its run and version (``demo/v3``, ``demo/newest``)."""
    parameters = flow_run.parameters
    version = parameters.get("version")
    return f"{parameters['config'].run_id}/{'newest' if version is None else f'v{version}'}"


@flow(name="evaluate", flow_run_name=_run_name, log_prints=True)
def evaluate(
    config: RunConfig = RunConfig(),
    # strict: pydantic's lax mode read true as version 1 (the server's schema refuses it)
    version: Annotated[int, Field(ge=0, strict=True)] | None = None,
) -> dict[str, Any]:
    """Held-out reward of a weight version on every env of the mix.

    Args:
        config: the run.
        version: the weight version to evaluate; empty: the newest.
    """
    # a run started from a deployment's form is checked here: the engine's device is
    # first used once the version is downloaded, the reward models' at the first score
    problem = (
        missing_device(evaluate_devices(config))
        or evaluate_paths(config)
        or rollout_problem(config, ("eval",))
    )
    if problem is None:
        problem = absent_version(run_store(config), published_versions(config), version)
    if problem is not None:
        raise ValueError(problem)
    with run_body():
        # the tasks import torch and transformers: here, so that --help and a bad config answer at once
        from tasks.weights import evaluate_task

        result = evaluate_task(config, version)
        report_evals(config)
        return result


def _version(text: str) -> int:
    """``--version``, refused by argparse (exit 2, one line) when negative, as the flow's
    parameter is: a version -1 was looked up and said not to exist."""
    try:
        version = int(text)
    except ValueError:  # argparse would name the function: "invalid _version value"
        raise argparse.ArgumentTypeError(f"invalid integer value: {text!r}") from None
    if version < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {version}")
    return version


@flow_command
def main(argv: list[str] | None = None) -> None:
    from flows.cli_args import parse

    config, args = parse(
        "Evaluate a weight version.",
        argv,
        extra=lambda p: p.add_argument(
            "--version", type=_version, help="Weight version (default: the newest)."
        ),
        devices=evaluate_devices,
        paths=evaluate_paths,
        splits=("eval",),
    )
    problem = missing_version(config, args.version, hint="--run-id and storage.root")
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(1)
    temporary_api()
    print(evaluate(config, args.version))


def missing_version(
    config: RunConfig, version: int | None, hint: str = "run_id and storage.root"
) -> str | None:
    """Why ``version`` of the run (the newest when None) cannot be evaluated; None when it can
    (exits with one line when the storage does not answer: :func:`~flows.cli.weight_versions`).
    ``hint``: as for :func:`absent_version`."""
    store = run_store(config)
    return absent_version(store, weight_versions(store), version, hint)


def absent_version(
    store: RunStore, published: list[int], version: int | None, hint: str = "run_id and storage.root"
) -> str | None:
    """Why ``version`` (the newest when None) is not among the run's ``published`` versions;
    None when it is. A pruned one, given in a deployment's form, failed the flow run with a
    ``KeyError`` once its tasks were listed. ``hint``: what to check when the run has no
    version, as the caller's user names it (the command line's ``--run-id``, a flow run's
    parameter ``run_id``)."""
    if not published:
        return f"no weight version published in {store.url('weights')} (check {hint})"
    if version is not None and version not in published:
        return (
            f"weight version {version} does not exist in {store.url('weights')}; "
            f"kept: {version_ranges(published)} ({len(published)} in all)"
        )
    return None


def version_ranges(versions: list[int]) -> str:
    """Ascending ``versions`` as their runs of consecutive versions: ``v0, v3 to v4`` (those
    between them were pruned)."""
    runs: list[list[int]] = []
    for version in versions:
        if runs and version == runs[-1][-1] + 1:
            runs[-1].append(version)
        else:
            runs.append([version])
    return ", ".join(f"v{run[0]}" if len(run) == 1 else f"v{run[0]} to v{run[-1]}" for run in runs)


if __name__ == "__main__":
    main()
