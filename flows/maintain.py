"""The maintain flow: compact and vacuum the Delta tables, keep the last N weight versions.

Runs one table at a time (compaction and vacuum must not overlap on a table).
``python -m flows.maintain --config configs/tiny.yaml``
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task

from flows.config import RunConfig
from storage.tables import TABLE_SCHEMAS, Tables
from storage.weights import WeightStore
from tasks.common import SIDE_EFFECTS, STORAGE_RETRIES, run_store


@task(name="compact-table", **SIDE_EFFECTS, **STORAGE_RETRIES)
def compact_table(config: RunConfig, table: str, retention_hours: int) -> dict[str, Any]:
    tables = Tables(run_store(config))
    if tables.version(table) is None:
        return {"table": table, "skipped": "not created yet"}
    optimized = tables.optimize(table)
    removed = tables.vacuum(table, retention_hours=retention_hours)
    return {"table": table, "optimize": optimized, "vacuumed_files": len(removed)}


@task(name="retain-weights", **SIDE_EFFECTS, **STORAGE_RETRIES)
def retain_weights(config: RunConfig, keep_last: int) -> list[int]:
    return WeightStore(run_store(config)).retain(keep_last)


@flow(name="maintain", log_prints=True)
def maintain(
    config: RunConfig = RunConfig(), keep_last: int = 5, retention_hours: int = 168
) -> dict[str, Any]:
    """Compact and vacuum every table, then drop weight versions beyond the last ``keep_last`` (tagged ones stay)."""
    tables = [compact_table(config, name, retention_hours) for name in TABLE_SCHEMAS]
    return {"tables": tables, "removed_versions": retain_weights(config, keep_last)}


def main(argv: list[str] | None = None) -> None:
    from flows.cli_args import parse

    config, args = parse(
        "Compact tables and prune weight versions.",
        argv,
        extra=lambda p: p.add_argument("--keep-last", type=int, default=5, help="Weight versions to keep."),
    )
    print(maintain(config, keep_last=args.keep_last))


if __name__ == "__main__":
    main()
