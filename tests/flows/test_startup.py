"""What starting a flow or ``treadle`` imports: torch and transformers (seconds) only once a
flow runs, not for ``--help``, a run config that does not load, or ``treadle inspect``."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from flows.cli import FLOWS
from storage.tables import Tables
from storage.weights import WeightStore
from tests.flows.conftest import REPO

PROBE = """
import json, runpy, sys

ends = []
for module, argv in json.loads(sys.argv[1]):
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code
    ends.append([" ".join([module, *argv]), code, sorted({"torch", "transformers"} & set(sys.modules))])
print(json.dumps(ends))
"""


def start(runs: list[tuple[str, list[str]]]) -> tuple[list[int], dict[str, list[str]], str]:
    """Run each ``(module, argv)`` as ``python -m module argv…``, one after the other in one
    fresh interpreter: their exit codes, which of torch and transformers had been imported
    by the end of each (by the command line), and what they printed."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(runs)], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stderr
    *printed, last = result.stdout.splitlines()
    ends = json.loads(last)
    return [code for _, code, _ in ends], {run: imported for run, _, imported in ends}, "\n".join(printed)


def test_a_flows_help_and_a_run_config_that_does_not_load_import_neither_torch_nor_transformers():
    flows = [f"flows.{name}" for name in (*FLOWS, "demo")]
    helps = [(module, ["--help"]) for module in flows] + [("flows.cli", ["run", "train", "--help"])]
    # every field is validated (devices included) before the one error is reported
    bad_configs = [(module, ["--set", "sao.lr=-1"]) for module in flows]
    codes, imported, printed = start(helps + bad_configs)
    assert codes == [0] * len(helps) + [2] * len(bad_configs)
    assert printed.count("usage: ") == len(helps)
    assert imported == {run: [] for run in imported}


def test_treadle_inspect_imports_neither_torch_nor_transformers(local_store):
    weights = WeightStore(local_store)
    weights.record(Tables(local_store), weights.publish({"w": torch.zeros(2)}, {}, None))
    codes, imported, printed = start(
        [("flows.cli", ["inspect", "--root", local_store.config.root, "--run-id", local_store.run_id])]
    )
    assert codes == [0] and "weight versions: 1 published, 1 kept" in printed
    assert imported == {run: [] for run in imported}
