"""The maintain flow: compact and vacuum the Delta tables, keep the last N weight versions
(and sweep the temporary files of LATEST, CLAIM and manifests that killed publishes left), sweep shard files no
commit lists, abort the incomplete multipart uploads that killed writers left on S3.

Runs one table at a time (compaction and vacuum must not overlap on a table).
``python -m flows.maintain --config configs/tiny.yaml``
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Annotated, Any

from prefect import flow, task
from prefect.client.schemas.objects import State
from pydantic import Field

from flows.cli_args import flow_command
from flows.config import RunConfig
from flows.run_body import run_body
from storage.shards import MIN_SWEEP_AGE_S, abort_stale_uploads, sweep_uncommitted
from storage.tables import TABLE_SCHEMAS, Tables
from storage.weights import WeightStore
from tasks.common import SIDE_EFFECTS, STORAGE_RETRIES, run_store

_ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")
"""The colours deltalake writes into its errors' chains of causes."""

MIN_RETENTION_HOURS = math.ceil(MIN_SWEEP_AGE_S / 3600)
"""Smallest ``retention_hours``: a younger uncommitted shard file may still be committed by
its writer (see ``MIN_SWEEP_AGE_S``), and vacuum would remove files that readers of recent
snapshots and the change feed still need."""

MAX_RETENTION_HOURS = 1_000_000
"""Largest ``retention_hours`` (114 years: files that old are never there to go). deltalake
(1.6.6) panics computing a vacuum's cutoff past about 2.5e12 hours, and its PanicException
crashed the flow at its first table, before any other step."""


# named as the flow's errors name the step: five runs of one name in the UI cannot be told apart
@task(name="compact-table", task_run_name="compact-table {table}", **SIDE_EFFECTS, **STORAGE_RETRIES)
def compact_table(config: RunConfig, table: str, retention_hours: int) -> dict[str, Any]:
    tables = Tables(run_store(config))
    if tables.version(table) is None:
        return {"table": table, "skipped": "not created yet"}
    # before compacting: a new commit (and its checkpoint) over an empty one would make the
    # lost rows' absence the table's state, past restoring the empty commit's file
    tables.check_log(table)
    optimized = tables.optimize(table)
    if optimized is None:
        # that compaction's new files are listed by no commit until it commits: a vacuum would
        # delete those older than the retention, and its commit then list them
        skipped = "being compacted by another process (storage.tables.COMPACTION_SLOT_S)"
        return {"table": table, "optimize": {"skipped": skipped}, "vacuumed_files": 0}
    removed = tables.vacuum(table, retention_hours=retention_hours)
    return {"table": table, "optimize": optimized, "vacuumed_files": len(removed)}


@task(name="retain-weights", **SIDE_EFFECTS, **STORAGE_RETRIES)
def retain_weights(config: RunConfig, keep_last: int) -> list[int]:
    return WeightStore(run_store(config)).retain(keep_last)


# a task of its own: a retry of the sweep must not run retain again, which would report
# nothing pruned, the versions gone at the first attempt
@task(name="sweep-latest-temps", **SIDE_EFFECTS, **STORAGE_RETRIES)
def sweep_latest_temps(config: RunConfig) -> list[str]:
    return WeightStore(run_store(config)).sweep_latest_temps()


@task(name="sweep-shards", **SIDE_EFFECTS, **STORAGE_RETRIES)
def sweep_shards(config: RunConfig, retention_hours: int) -> list[str]:
    return sweep_uncommitted(run_store(config), older_than_s=retention_hours * 3600)


@task(name="abort-stale-uploads", **SIDE_EFFECTS, **STORAGE_RETRIES)
def abort_uploads(config: RunConfig, retention_hours: int) -> list[str]:
    return abort_stale_uploads(run_store(config), older_than_s=retention_hours * 3600)


@flow(name="maintain", flow_run_name="{config.run_id}", log_prints=True)
def maintain(
    config: RunConfig = RunConfig(),
    keep_last: Annotated[int, Field(ge=1)] = 5,
    retention_hours: Annotated[int, Field(ge=MIN_RETENTION_HOURS, le=MAX_RETENTION_HOURS)] = 168,
) -> dict[str, Any]:
    """Compact and vacuum every table (one another process is compacting is left to the next
    run), drop old weight versions (and the temporary files of LATEST, CLAIM and manifests
    that killed publishes left, once an hour old), delete shard files that no commit lists
    (left by writers that died) and abort the incomplete multipart uploads of writers killed
    while sending a large file to S3 (their parts are stored, and billed, until then). A step that fails (a table whose log or files cannot be read) leaves the
    others to run; the flow then raises naming each.

    Args:
        config: the run.
        keep_last: weight versions kept, the newest (LATEST, tagged ones and the newest
            that verifies always stay).
        retention_hours: vacuumed table files and uncommitted shard files are deleted, and
            incomplete uploads aborted, once older than this (at least 1: a younger one may
            belong to a writer whose commit has not landed yet; at most 1000000).
    """
    store = run_store(config)
    # a wrong root or run id (a deployment's form) would otherwise complete, having found nothing to do
    if not store.fs.exists(store.path()):
        raise FileNotFoundError(
            f"run {config.run_id!r} is not at {store.uri}: nothing is stored there; check storage.root and run_id"
        )
    with run_body():
        states = {
            **{
                f"compact-table {name}": compact_table(config, name, retention_hours, return_state=True)
                for name in TABLE_SCHEMAS
            },
            "retain-weights": retain_weights(config, keep_last, return_state=True),
            "sweep-latest-temps": sweep_latest_temps(config, return_state=True),
            "abort-stale-uploads": abort_uploads(config, retention_hours, return_state=True),
            # a shards table that cannot be read fails the sweep before it deletes anything
            "sweep-shards": sweep_shards(config, retention_hours, return_state=True),
        }
        failed = {step: state for step, state in states.items() if not state.is_completed()}
        if failed:
            raise RuntimeError(
                f"maintain could not complete {len(failed)} of its {len(states)} steps (the others ran): "
                + "; ".join(f"{step}: {_first_line(state)}" for step, state in failed.items())
            )
        return {
            "tables": [states[f"compact-table {name}"].result() for name in TABLE_SCHEMAS],
            "removed_versions": states["retain-weights"].result(),
            "removed_latest_temps": states["sweep-latest-temps"].result(),
            "removed_shard_files": states["sweep-shards"].result(),
            "aborted_uploads": states["abort-stale-uploads"].result(),
        }


def summary(result: dict[str, Any]) -> str:
    """What a :func:`maintain` run's result did, a short line per table and one each for the
    weight versions, the temporary files of killed publishes and shard files it removed and the incomplete
    uploads it aborted."""
    lines = []
    for table in result["tables"]:
        optimize = table.get("optimize")
        if optimize is None:
            done = table["skipped"]
        elif "skipped" in optimize:
            done = f"neither compacted nor vacuumed, {optimize['skipped']}"
        else:
            removed, added = optimize.get("numFilesRemoved", 0), optimize.get("numFilesAdded", 0)
            compacted = f"compacted {removed} files into {added}" if removed else "nothing to compact"
            done = f"{compacted}, vacuumed {table['vacuumed_files']} files"
        lines.append(f"{table['table']}: {done}")
    versions = result["removed_versions"]
    lines.append(f"weight versions pruned: {', '.join(f'v{v}' for v in versions) if versions else 'none'}")
    lines.append(f"temporary files of killed publishes deleted: {len(result['removed_latest_temps'])}")
    lines.append(f"uncommitted shard files deleted: {len(result['removed_shard_files'])}")
    lines.append(f"incomplete uploads of killed writers aborted: {len(result['aborted_uploads'])}")
    return "\n".join(lines)


def _first_line(state: State) -> str:
    """What failed ``state``'s task, on one line: deltalake's causes (its lines marked ``↳``,
    where a storage error says what the store answered) joined to its first line, without
    the backtrace it appends."""
    error = state.result(raise_on_failure=False)
    lines = _ANSI_CODES.sub("", str(error)).splitlines()
    if not lines:
        return type(error).__name__
    causes = [line.strip().removeprefix("↳").strip() for line in lines[1:] if line.strip().startswith("↳")]
    return ": ".join([lines[0], *causes])


def _at_least(minimum: int, maximum: int | None = None):
    # argparse names the function in its message: "invalid integer value: 'x'"
    def integer(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return integer


def _maintain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keep-last",
        type=_at_least(1),
        default=5,
        help=(
            "Newest weight versions to keep (default: 5); LATEST, tagged versions and the newest "
            "that verifies are always kept."
        ),
    )
    parser.add_argument(
        "--retention-hours",
        type=_at_least(MIN_RETENTION_HOURS, MAX_RETENTION_HOURS),
        default=168,
        help=(
            f"Age past which unreferenced files go (default: %(default)s; at least {MIN_RETENTION_HOURS}, "
            f"at most {MAX_RETENTION_HOURS})."
        ),
    )


@flow_command
def main(argv: list[str] | None = None) -> None:
    from flows.cli import existing_run, temporary_api
    from flows.cli_args import parse

    config, args = parse(
        "Compact and vacuum the run's Delta tables, prune old weight versions and sweep shard "
        "files that no commit lists (left by writers that died).",
        argv,
        extra=_maintain_arguments,
        paths=None,
    )
    # a table it cannot read fails the flow naming it, after the other tables and steps
    existing_run(run_store(config), hint="storage.root and --run-id", unreadable_logs=True)
    temporary_api()
    print(summary(maintain(config, keep_last=args.keep_last, retention_hours=args.retention_hours)))


if __name__ == "__main__":
    main()
