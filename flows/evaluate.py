"""The evaluate flow: a weight version on held-out tasks.

``python -m flows.evaluate --config configs/tiny.yaml [--version N]``
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.config import RunConfig
from tasks.weights import evaluate_task


@flow(name="evaluate", log_prints=True)
def evaluate(config: RunConfig = RunConfig(), version: int | None = None) -> dict[str, Any]:
    """Held-out reward of ``version`` (the newest when left out) on every env of the mix."""
    result = evaluate_task(config, version)
    create_table_artifact(
        [
            {"version": result["version"], "env": env, "reward": r, "count": result["count"][env]}
            for env, r in result["reward"].items()
        ],
        description=f"Held-out evaluation of version {result['version']}",
    )
    return result


def main(argv: list[str] | None = None) -> None:
    from flows.cli_args import parse

    config, args = parse(
        "Evaluate a weight version.",
        argv,
        extra=lambda p: p.add_argument("--version", type=int, help="Weight version (default: the newest)."),
    )
    print(evaluate(config, args.version))


if __name__ == "__main__":
    main()
