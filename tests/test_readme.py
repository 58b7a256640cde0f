"""What the docs tell a user holds of the code: the files they name are in a clone, the config
keys, commands, flags and SQL they give exist and run."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
READMES = [
    "README.md",
    "deployments/README.md",
    "deployments/vllm/README.md",
    *sorted(str(path.relative_to(REPO)) for path in REPO.glob("docs/*.md")),
]
DOCS = [*READMES, *sorted(str(path.relative_to(REPO)) for path in REPO.glob("configs/*.yaml"))]
"""Everything a user reads: the READMEs, and the shipped configs' comments."""


def named_files(readme: Path) -> list[str]:
    """The repository files ``readme`` names: every ``*.md``, and every path that starts with
    one of the repository's top-level folders (``flows/sql.py``; not ``status/…/plan.json``,
    an object of a run's storage)."""
    folders = {path.name for path in REPO.iterdir() if path.is_dir() and not path.name.startswith(".")}
    names = re.findall(
        r"(?<![\w./-])([\w.-]+(?:/[\w.-]+)*\.(?:md|py|yaml|sh|txt))(?![\w/-])", readme.read_text()
    )
    return sorted({name for name in names if name.endswith(".md") or name.split("/")[0] in folders})


@pytest.mark.parametrize("name", DOCS)
def test_every_file_a_doc_names_is_in_the_repository(name):
    readme = REPO / name
    named = named_files(readme)
    assert named, f"found no file named in {name}: the pattern is wrong"
    missing = [f for f in named if not (readme.parent / f).exists() and not (REPO / f).exists()]
    assert not missing, f"{name} names files a clone does not have: {missing}"


def spans(text: str) -> list[str]:
    """The inline code spans of markdown ``text`` (````…```` fences left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+(?:\n[^`\n]+)*)`", text)


def config_keys(text: str, sections: set[str]) -> list[str]:
    """The dotted run-config keys the code spans of ``text`` name (``service.compact_at``,
    ``envs.<env>.sandbox``): those whose first part is one of ``sections``. A module path
    (``storage.shards.ShardWriter``) goes on past the key, and is left out."""
    keys = set()
    for span in spans(text):
        for match in re.finditer(r"(?<![\w.])([a-z_]+(?:\.(?:[a-z_0-9]+|<\w+>))+)(?![\w.(<])", span):
            if match[1].split(".")[0] in sections:
                keys.add(match[1])
    return sorted(keys)


def missing_field(model: type[BaseModel], key: str) -> str | None:
    """Where dotted ``key`` leaves the fields of ``model`` and the models they hold, or None
    when each part is a field. A part past a mapping or a plain value is a key of it
    (``warm_start.demos.agent``); ``<env>`` stands for any environment's config."""
    from flows.config import EnvsConfig

    for depth, part in enumerate(key.split(".")):
        if model is EnvsConfig and part.startswith("<"):
            part = "code"
        field = model.model_fields.get(part)
        if field is None:
            return f"{key}: {'.'.join(key.split('.')[:depth]) or 'RunConfig'} has no field {part!r}"
        inner = [field.annotation]
        model = None
        while inner:
            kind = inner.pop()
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                model = kind
                break
            if typing.get_origin(kind) is not dict:  # a mapping's values are keyed, not fields
                inner.extend(typing.get_args(kind))
        if model is None:
            return None
    return None


@pytest.mark.parametrize("name", READMES)
def test_every_config_key_a_doc_names_is_a_field_of_the_run_config(name):
    from flows.config import RunConfig

    keys = config_keys((REPO / name).read_text(), set(RunConfig.model_fields))
    wrong = [problem for key in keys if (problem := missing_field(RunConfig, key))]
    assert not wrong, f"{name} names config keys the run config lacks: {wrong}"


def test_the_config_key_pattern_finds_keys_and_leaves_module_paths():
    from flows.config import RunConfig

    text = (
        "`service.compact_at: N`, `--set envs.code.sandbox.backend=bwrap`, `envs.<env>.reward_model`, "
        "`storage.shards.ShardWriter(store)`, `rollout.gateway_http.GatewayServer`\n"
        "```yaml\nsao.not_a_key: 1\n```"
    )
    keys = config_keys(text, set(RunConfig.model_fields))
    assert keys == ["envs.<env>.reward_model", "envs.code.sandbox.backend", "service.compact_at"]
    assert missing_field(RunConfig, "service.compact_at") is None
    assert missing_field(RunConfig, "warm_start.demos.agent") is None
    assert "has no field 'compact'" in missing_field(RunConfig, "service.compact")


@pytest.mark.parametrize("name", READMES)
def test_every_make_target_a_doc_names_is_in_the_makefile(name):
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M))
    named = {span.split()[1] for span in spans((REPO / name).read_text()) if re.match(r"make [\w-]+", span)}
    assert not named - targets, f"{name} names make targets the Makefile lacks: {sorted(named - targets)}"


OTHER_PROGRAMS_FLAGS = {"--index-url", "--head", "--address", "--ray-client-server-port"}
"""Flags the README gives pip and ``ray start``, not treadle."""


def test_every_flag_the_readme_names_is_an_option_of_a_treadle_command(monkeypatch, capsys):
    import importlib

    import flows.cli_args
    from flows.cli import FLOWS, main

    monkeypatch.setattr(flows.cli_args, "set_prefect_defaults", lambda: None)  # --help reaches no server
    commands = [(main, [command, "--help"]) for command in ("inspect", "sql", "ui")]
    commands += [(importlib.import_module(f"flows.{flow}").main, ["--help"]) for flow in FLOWS]
    helps = []
    for command, argv in commands:
        with pytest.raises(SystemExit) as exited:
            command(argv)
        assert exited.value.code == 0, argv
        helps.append(capsys.readouterr().out)
    options = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", "\n".join(helps)))
    named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", (REPO / "README.md").read_text()))
    assert not named - options - OTHER_PROGRAMS_FLAGS, (
        f"README.md names flags no treadle command takes: {sorted(named - options - OTHER_PROGRAMS_FLAGS)}"
    )


def test_every_query_the_readme_gives_runs_over_a_run(tmp_path):
    pytest.importorskip("duckdb")
    from flows.sql import connect
    from storage.config import RunStore, StorageConfig

    text = (REPO / "README.md").read_text()
    queries = [re.sub(r"\s+", " ", span) for span in spans(text) if span.startswith("SELECT ")]
    queries += [f"SELECT {span} FROM train_steps" for span in spans(text) if span.startswith("extra->")]
    assert len(queries) >= 5, "found too few queries in README.md: the pattern is wrong"
    connection = connect(RunStore(StorageConfig(root=str(tmp_path)), "empty"))
    failed = []
    for query in queries:
        try:
            connection.execute(query).fetchall()
        except Exception as exc:  # duckdb's errors share no base class of its own but Exception
            failed.append(f"{query}: {exc}")
    assert not failed, f"README.md gives queries that fail: {failed}"
