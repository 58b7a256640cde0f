"""``make demo``: the whole pipeline on the embedded default, then where to look.

Uses the Prefect API that ``PREFECT_API_URL`` names (in the environment or the Prefect
profile); without one, the server started by ``make ui`` when one answers on 127.0.0.1:4200
(so the run shows up in the UI), and a temporary server of its own otherwise
(:func:`~flows.cli.temporary_api`).
"""

from __future__ import annotations

import http.client
import os
import shlex
import sys
import time
import urllib.request
from typing import TYPE_CHECKING

from flows.cli_args import flow_command

if TYPE_CHECKING:
    from flows.config import RunConfig

UI_URL = "http://127.0.0.1:4200"


def _ui_running() -> bool:
    try:
        with urllib.request.urlopen(f"{UI_URL}/api/health", timeout=1) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):  # a program that is no HTTP server holds the port
        return False


@flow_command
def main(argv: list[str] | None = None) -> None:
    from prefect.context import refresh_global_settings_context
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    # an API the environment or the Prefect profile names (`prefect config set PREFECT_API_URL=…`) is kept
    if not PREFECT_API_URL.value() and _ui_running():
        os.environ["PREFECT_API_URL"] = f"{UI_URL}/api"
        refresh_global_settings_context()
    from flows.cli import inspect_run, temporary_api, weight_versions, without_credentials
    from flows.cli_args import default_config, parse
    from flows.config import RunConfig, pipeline_devices

    # the checks of the pipeline's own command (flows.pipeline.main), whose flow this runs
    config, args = parse(
        "The treadle demo: warm start, then rollout + process + train at once.",
        argv,
        devices=pipeline_devices,
        ray=True,
        splits=("train", "eval"),
        warm_starts=True,
        serves_gateway=True,
    )
    from flows.pipeline import pipeline
    from tasks.common import run_store

    # the embedded default's run id gets a new one each demo; a run id given or a file's own is kept
    named = args.run_id is not None or any(item.partition("=")[0] == "run_id" for item in args.set)
    if not named and config.run_id == RunConfig.model_fields["run_id"].default:
        config = config.model_copy(update={"run_id": time.strftime("demo-%Y%m%d-%H%M%S")})
    weight_versions(run_store(config))
    api = PREFECT_API_URL.value()
    model = config.model.path or "the tiny model"
    devices = ", ".join(sorted(set(pipeline_devices(config).values())))
    print(f"treadle demo — run {config.run_id}: {model} on {devices}, envs {sorted(config.orchestrator.mix)}")
    where = (
        f"server {without_credentials(api)}"
        if api
        else "a temporary server of its own (start `make ui` first to watch it in the UI)"
    )
    print(f"Prefect: {where}")
    temporary_api()
    started = time.monotonic()
    result = pipeline(config)
    store = run_store(config)
    print("\n" + inspect_run(store))
    arith = result["gain"].get("arith")
    print(f"\nheld-out reward before → after RL: {result['before']['reward']} → {result['after']['reward']}")
    if arith is not None:
        print(f"arith gain: {arith:+.3f}")
    print(f"finished in {time.monotonic() - started:.0f} s")
    where = run_arguments(args.config or default_config(), config)
    treadle = treadle_command()
    curves = store.url("reports", "curves.png")
    if not store.fs.exists(store.path("reports", "curves.png")):  # the report logged why
        curves = "not stored (the report artifact holds them; the run's logs say why)"
    # the UI of the API the run reported to (Prefect's own setting: the API's server, Cloud's app)
    ui = (
        f"open {without_credentials(PREFECT_UI_URL.value())} (flow runs, artifacts, events)"
        if api
        else "run `make ui`, then `make demo` again to see the run there"
    )
    print(
        f"""
Where to look:
  tables (Delta Lake):  {store.url("tables")}/{{shards,trajectories,train_steps,weights,evals}}
  weight versions:      {store.url("weights")}
  curves:               {curves}
  summary again:        {treadle} inspect {where}
  SQL (duckdb):         {treadle} sql {where} \\
                          "SELECT version, env, reward FROM evals ORDER BY version, env"
  what it trained on:   {treadle} sql {where} \\
                          "SELECT step, task, reward, text FROM trained ORDER BY step DESC LIMIT 5"
  UI:                   {ui}"""
    )
    if "arith" in config.orchestrator.mix and (arith is None or round(arith, 6) < 0.15):
        print("note: the arith gain is below the 0.15 this demo aims for on this machine", file=sys.stderr)


def treadle_command() -> str:
    """The ``treadle`` command of this Python's environment, quoted for a shell: its script
    beside the interpreter (relative to the current directory when inside it:
    ``.venv/bin/treadle``), else the module it runs."""
    script = os.path.join(os.path.dirname(sys.executable), "treadle")
    if not os.access(script, os.X_OK):
        return shlex.join([sys.executable, "-m", "flows.cli"])
    relative = os.path.relpath(script)
    return shlex.quote(script if relative.startswith(os.pardir) else relative)


def run_arguments(config_path: str, config: RunConfig) -> str:
    """The ``treadle inspect``/``sql`` arguments that reach this run, quoted for a shell:
    ``--config`` brings the credentials, ``--root``, ``--endpoint-url`` and ``--region`` keep
    a ``--set storage.…`` override of the file's."""
    storage = config.storage
    where = ["--config", config_path, "--root", storage.root]
    for flag, value in (("--endpoint-url", storage.endpoint_url), ("--region", storage.region)):
        if value is not None:
            where += [flag, value]
    return shlex.join([*where, "--run-id", config.run_id])


if __name__ == "__main__":
    main()
