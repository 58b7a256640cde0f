"""The READMEs point a new user only at files that a clone of the repository holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
READMES = ["README.md", "deployments/README.md"]


def named_files(readme: Path) -> list[str]:
    """The repository files ``readme`` names: every ``*.md``, and every path that starts with
    one of the repository's top-level folders (``flows/sql.py``; not ``status/…/plan.json``,
    an object of a run's storage)."""
    folders = {path.name for path in REPO.iterdir() if path.is_dir() and not path.name.startswith(".")}
    names = re.findall(r"(?<![\w./-])([\w.-]+(?:/[\w.-]+)*\.(?:md|py|yaml))(?![\w/-])", readme.read_text())
    return sorted({name for name in names if name.endswith(".md") or name.split("/")[0] in folders})


@pytest.mark.parametrize("name", READMES)
def test_every_file_a_readme_names_is_in_the_repository(name):
    readme = REPO / name
    named = named_files(readme)
    assert named, f"found no file named in {name}: the pattern is wrong"
    missing = [f for f in named if not (readme.parent / f).exists() and not (REPO / f).exists()]
    assert not missing, f"{name} names files a clone does not have: {missing}"
