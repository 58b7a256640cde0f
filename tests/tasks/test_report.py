"""The run report's artifacts stay a bounded size however long the run."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from urllib.parse import unquote

import matplotlib.pyplot as plt
from markdown_it import MarkdownIt

from storage.tables import Tables, conform
from tasks import report
from tasks.common import run_store
from tests.flows.conftest import tiny_config

START = datetime(2026, 12, 1, tzinfo=UTC)


def shard_row(kind: str, worker: str, seq: int, versions: tuple[int, int], rows: int) -> dict:
    return {
        "shard_id": f"{kind}/{worker}/{seq:08d}",
        "kind": kind,
        "path": f"shards/{kind}/{worker}/{seq:08d}.arrow",
        "worker": worker,
        "seq": seq,
        "num_rows": rows,
        "num_tokens": 10 * rows,
        "min_version": versions[0],
        "max_version": versions[1],
        "committed_at": START + timedelta(seconds=seq),
    }


def step_row(step: int, value_loss: float | None = 0.2) -> dict:
    return {
        "step": step,
        "version": step // 2,
        "policy_loss": 0.1,
        "value_loss": value_loss,
        "masked_fraction": 0.0,
        "mean_ratio": 1.0,
        "kl": 0.0,
        "staleness_mean": 1.0,
        "staleness_max": 2,
        "num_samples": 8,
        "num_tokens": 80,
        "tokens_per_s": 10.0,
        "reward_mean": 0.5,
        "dropped_stale": 0,
        "step_seconds": 0.1,
        "time": START + timedelta(seconds=step),
        "extra": None,
    }


def test_the_shards_artifact_sums_each_worker_and_kind_against_a_loop():
    rng = random.Random(0)
    rows = []
    for i in range(300):
        kind, worker = rng.choice(["raw", "processed"]), rng.choice(["w0", "w1", "gpu-0"])
        low = rng.randrange(-1, 6)
        versions = (-1, -1) if low < 0 else (low, low + rng.randrange(3))
        rows.append(shard_row(kind, worker, i, versions, rng.randrange(1, 9)))
    summary = report.shards_by_worker(conform("shards", rows))

    expected = {}
    for r in rows:
        e = expected.setdefault(
            (r["kind"], r["worker"]),
            {"shards": 0, "rows": 0, "tokens": 0, "min_version": None, "max_version": None, "last": None},
        )
        e["shards"] += 1
        e["rows"] += r["num_rows"]
        e["tokens"] += r["num_tokens"]
        if r["min_version"] >= 0:
            e["min_version"] = (
                r["min_version"] if e["min_version"] is None else min(e["min_version"], r["min_version"])
            )
            e["max_version"] = (
                r["max_version"] if e["max_version"] is None else max(e["max_version"], r["max_version"])
            )
        e["last"] = r["committed_at"] if e["last"] is None else max(e["last"], r["committed_at"])
    assert [(s["kind"], s["worker"]) for s in summary] == sorted(expected)
    for s in summary:
        e = expected[(s["kind"], s["worker"])]
        assert (s["shards"], s["rows"], s["tokens"]) == (e["shards"], e["rows"], e["tokens"])
        assert (s["min_version"], s["max_version"]) == (e["min_version"], e["max_version"])
        assert s["last_commit"] == e["last"].isoformat()
    assert report.shards_by_worker(conform("shards", [])) == []


def version_row(step: int) -> dict:
    """A ``weights`` row of the version published just after ``step`` (its steps are in the weights)."""
    return {
        "version": step // 2,
        "step": step,
        "parent": None,
        "path": f"weights/v{step // 2:06d}",
        "num_consumed_shards": 1,
        "created_at": START + timedelta(seconds=step + 0.5),
    }


def test_a_long_runs_report_lists_its_latest_steps_and_one_shard_row_per_worker(tmp_path, monkeypatch):
    config = tiny_config(tmp_path / "runs", "long-run")
    tables = Tables(run_store(config))
    tables.append("shards", [shard_row("raw", f"w{i % 3}", i, (0, 1), 4) for i in range(500)])
    tables.append("train_steps", [step_row(step) for step in range(1, 201)])
    tables.append("weights", [version_row(200)])
    made = {}
    monkeypatch.setattr(
        report, "create_table_artifact", lambda rows, key, description: made.update({key: rows})
    )
    monkeypatch.setattr(report, "create_markdown_artifact", lambda text, key, description: None)

    markdown = report.report_run(config)

    key = report.artifact_key("long-run")
    assert [(r["worker"], r["shards"]) for r in made[f"{key}-shards"]] == [
        ("w0", 167),
        ("w1", 167),
        ("w2", 166),
    ]
    listed = [line for line in markdown.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(line.split("|")[1]) for line in listed] == list(range(151, 201))
    assert f"The last {report.REPORT_STEPS} of 200" in markdown


def test_a_grpo_runs_report_shows_no_value_loss(tmp_path, monkeypatch):
    """GRPO has no critic: its steps' value loss is null, shown as a dash and left out of the curve."""
    config = tiny_config(tmp_path / "runs", "grpo-run")
    tables = Tables(run_store(config))
    tables.append("train_steps", [step_row(1, None), step_row(2, None)])
    tables.append("weights", [version_row(2)])
    monkeypatch.setattr(report, "create_table_artifact", lambda rows, key, description: None)
    monkeypatch.setattr(report, "create_markdown_artifact", lambda text, key, description: None)

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)

    markdown = report.report_run(config)

    listed = [line for line in markdown.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[4] for line in listed] == ["—", "—"]
    (losses,) = [axes for axes in figures[0].axes if axes.get_title() == "losses"]
    assert [text.get_text() for text in losses.get_legend().get_texts()] == ["policy"]


def test_a_report_whose_curves_cannot_be_stored_still_reports(tmp_path, monkeypatch, caplog):
    """Writing the curves' PNG to storage fails (here ``reports`` is a file, not a folder): the
    report still embeds the curves, says they were not stored, and the run does not fail."""
    config = tiny_config(tmp_path / "runs", "unstored")
    store = run_store(config)
    Tables(store).append("train_steps", [step_row(1), step_row(2)])
    with store.fs.open(store.path("reports"), "wb") as blocker:
        blocker.write(b"not a folder")
    monkeypatch.setattr(report, "create_table_artifact", lambda rows, key, description: None)
    monkeypatch.setattr(report, "create_markdown_artifact", lambda text, key, description: None)

    markdown = report.report_run(config)

    assert "data:image/png;base64," in markdown
    assert "Curves not stored" in markdown and "Curves as stored" not in markdown
    assert any("curves of run unstored not written" in r.getMessage() for r in caplog.records)


def test_the_evals_artifact_rounds_rewards_and_the_report_heads_its_count_as_tasks_measured(
    tmp_path, monkeypatch
):
    """A float32 reward of 0.43 reads back as 0.4300000071525574: the artifact shows 0.43.
    The report's column is ``count``, the tasks measured (3 of the 4 run here)."""
    config = tiny_config(tmp_path / "runs", "evals-shown")
    row = {"version": 1, "env": "arith", "reward": 0.43, "count": 3, "time": START, "tasks": 4}
    Tables(run_store(config)).append("evals", [row])
    made = {}
    monkeypatch.setattr(
        report, "create_table_artifact", lambda rows, key, description: made.update({key: rows})
    )
    monkeypatch.setattr(report, "create_markdown_artifact", lambda text, key, description: None)

    markdown = report.report_run(config)

    assert made[f"{report.artifact_key('evals-shown')}-evals"] == [
        {"version": 1, "env": "arith", "reward": 0.43, "count": 3}
    ]
    lines = markdown.splitlines()
    header = lines.index("## Held-out reward") + 2
    assert lines[header : header + 3] == [
        "| version | env | reward | tasks measured |",
        "|---|---|---|---|",
        "| 1 | arith | 0.430 | 3 |",
    ]


def test_the_report_keeps_its_link_and_table_whole_for_a_root_with_spaces_and_an_env_with_a_pipe(
    tmp_path, monkeypatch
):
    """A local root may hold spaces and parentheses, and a registered env's name any
    character: rendered as CommonMark with tables, the curves' link still points at the
    stored PNG and each evals row keeps its four cells, the env shown as it is named."""
    root = tmp_path / "my runs (old)_*x*_"
    config = tiny_config(root, "odd")
    row = {"version": 1, "env": "a|b_*c*_", "reward": 0.5, "count": 3, "time": START, "tasks": 3}
    Tables(run_store(config)).append("evals", [row])
    monkeypatch.setattr(report, "create_table_artifact", lambda rows, key, description: None)
    monkeypatch.setattr(report, "create_markdown_artifact", lambda text, key, description: None)

    tokens = MarkdownIt("commonmark").enable("table").parse(report.report_run(config))

    png = run_store(config).url("reports/curves.png")
    inlines = [t.children for t in tokens if t.type == "inline"]
    links = [
        (unquote(child.attrGet("href")), "".join(c.content for c in children[i + 1 :] if c.type == "text"))
        for children in inlines
        for i, child in enumerate(children)
        if child.type == "link_open"
    ]
    assert links == [(png, png)]
    cells = [
        "".join(c.content for c in tokens[i + 1].children)
        for i, t in enumerate(tokens)
        if t.type == "td_open"
    ]
    assert cells == ["1", "a|b_*c*_", "0.500", "3"]
