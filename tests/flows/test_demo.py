"""What ``make demo`` prints once its run is over: where to look, each place one that exists."""

from __future__ import annotations

import os
import pathlib
import shlex

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.cli_args import REPO_CONFIG


@pytest.fixture
def finished_demo(monkeypatch, tmp_path, capsys):
    """Run the demo command with ``argv`` on a pipeline that returns at once, under the
    Prefect API ``api``; what it printed."""
    import flows.cli
    import flows.demo
    import flows.pipeline

    def pipeline(config):
        return {
            "before": {"reward": {"arith": 0.1}},
            "after": {"reward": {"arith": 0.3}},
            "gain": {"arith": 0.2},
        }

    monkeypatch.setattr(flows.pipeline, "pipeline", pipeline)
    monkeypatch.setattr(flows.cli, "inspect_run", lambda store: "weight versions: 1 published")
    monkeypatch.setattr(flows.demo, "_ui_running", lambda: False)

    def run(api: str, *argv: str) -> str:
        with temporary_settings({PREFECT_API_URL: api}):
            flows.demo.main(["--set", f"storage.root={tmp_path}/runs", *argv])
        return capsys.readouterr().out

    return run


def test_the_demo_points_at_the_ui_of_the_prefect_api_it_reported_to(finished_demo):
    """It said to open http://127.0.0.1:4200 whatever API the run reported to: a server the
    environment or the profile named elsewhere showed the run at an address with no UI."""
    out = finished_demo("http://user:password@gpu-box:4300/api")
    (ui,) = [line for line in out.splitlines() if line.strip().startswith("UI:")]
    assert "open http://gpu-box:4300 " in ui and "4200" not in ui and "password" not in out


def test_the_demo_names_a_treadle_command_that_exists_wherever_it_was_started(
    finished_demo, monkeypatch, tmp_path
):
    """It named .venv/bin/treadle, relative to the current directory: a demo started from
    another directory (it then reads the repository's config), or by a Python of another
    environment, printed `treadle inspect` and `treadle sql` commands that were not there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = finished_demo("http://127.0.0.1:4300/api")
    labels = ("summary again:", "SQL (duckdb):", "what it trained on:")
    commands = [line.split(":", 1)[1] for line in out.splitlines() if line.strip().startswith(labels)]
    assert len(commands) == 3, out
    for command in commands:
        executable = shlex.split(command.removesuffix("\\"))[0]
        assert os.access(executable, os.X_OK), command


@pytest.mark.parametrize("stored", [True, False])
def test_the_demo_names_the_curves_file_only_where_the_report_stored_it(finished_demo, monkeypatch, stored):
    """The report goes on without storing the curves when the store fails to take them (they
    are in its artifact): the demo named the file all the same."""
    import flows.pipeline
    from tasks.common import run_store

    def pipeline(config):
        if stored:
            store = run_store(config)
            store.fs.makedirs(store.path("reports"), exist_ok=True)
            with store.fs.open(store.path("reports", "curves.png"), "wb") as out:
                out.write(b"png")
        return {"before": {"reward": {}}, "after": {"reward": {}}, "gain": {}}

    monkeypatch.setattr(flows.pipeline, "pipeline", pipeline)
    out = finished_demo("http://127.0.0.1:4300/api", "--run-id", "curves")
    (line,) = [line for line in out.splitlines() if line.strip().startswith("curves:")]
    named = line.split(":", 1)[1].strip()
    assert os.path.isfile(named) if stored else "curves.png" not in named, line


def test_the_demo_runs_under_the_run_id_its_config_file_names(monkeypatch, tmp_path):
    """Only the embedded default's run id ('demo') is replaced by a new one for each demo: a
    config file naming its own run was run under a new demo-<time> id, its run_id ignored."""
    import flows.demo
    import flows.pipeline

    class Started(Exception):
        pass

    def pipeline(config):
        raise Started(config.run_id)

    tiny = pathlib.Path(REPO_CONFIG).read_text()
    mine = tmp_path / "mine.yaml"
    mine.write_text(tiny.replace("run_id: demo\n", "run_id: exp7\n"))
    monkeypatch.setattr(flows.demo, "_ui_running", lambda: False)
    monkeypatch.setattr(flows.pipeline, "pipeline", pipeline)
    with pytest.raises(Started) as started:
        flows.demo.main(["--config", str(mine), "--set", f"storage.root={tmp_path}/runs"])
    assert started.value.args[0] == "exp7"
