"""``treadle inspect`` and ``treadle sql`` on the pipeline run's tables."""

from __future__ import annotations

import subprocess
import sys

from tests.flows.conftest import REPO


def treadle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_inspect_prints_versions_rewards_and_shards(pipeline_run):
    config = pipeline_run.config
    result = treadle("inspect", "--root", config.storage.root, "--run-id", config.run_id)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    final = pipeline_run.result["after"]["version"]
    assert f"weight versions: {final + 1}" in out
    assert "v0    arith" in out and f"v{final:<4} guess" in out
    processed = pipeline_run.result["processed"]
    assert f"processed  {processed['shards']} shards, {processed['trajectories_out']} trajectories" in out
    assert f"policy steps logged: {pipeline_run.result['trained']['steps']}" in out


def test_sql_answers_over_the_runs_tables(pipeline_run):
    config = pipeline_run.config
    result = treadle(
        "sql",
        "--root",
        config.storage.root,
        "--run-id",
        config.run_id,
        "SELECT task, count(*) AS n FROM trajectories GROUP BY task ORDER BY task",
    )
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.strip().splitlines()
    assert header == "task\tn"
    counts = {task: int(n) for task, n in (row.split("\t") for row in rows)}
    assert set(counts) == {"arith", "guess"}
    assert sum(counts.values()) == pipeline_run.result["rollouts"]["finished"]


def test_sql_error_is_reported():
    result = treadle("sql", "--root", "/nonexistent", "--run-id", "none", "SELECT * FROM trajectories")
    assert result.returncode != 0
    assert "trajectories" in result.stderr
