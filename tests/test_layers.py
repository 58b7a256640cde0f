"""The pure packages never import Prefect: the rollout workers, the trainer and the storage
layer run as plain Python too (a Ray actor, a vLLM extension, a notebook)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PURE_PACKAGES = ("storage", "envs", "rollout", "rl")

IMPORT_ALL = """
import importlib, pkgutil, sys
package = importlib.import_module(sys.argv[1])
names = [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(len(names), sorted(module for module in sys.modules if module.split(".")[0] == "prefect")[:3])
"""


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_a_pure_package_imports_without_prefect(package):
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, package], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stderr
    count, prefect = result.stdout.split(maxsplit=1)
    assert int(count) > 0, f"found no module in {package}"
    assert prefect.strip() == "[]", f"importing {package}'s modules imported {prefect.strip()}"
