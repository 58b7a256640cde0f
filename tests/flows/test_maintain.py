"""The maintain flow on a run with history: tables compacted, old weight versions pruned,
shard files that no commit lists swept once they are old, and nothing committed lost."""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
import types
import uuid
from datetime import UTC, datetime

import pytest
from prefect.exceptions import ParameterTypeError
from prefect.states import Failed
from prefect.utilities.callables import parameter_schema

from flows.maintain import (
    MAX_RETENTION_HOURS,
    MIN_RETENTION_HOURS,
    _first_line,
    compact_table,
    maintain,
    summary,
)
from flows.maintain import main as maintain_main
from rl.models import load_policy, publish_policy
from storage import shards as shard_module
from storage.config import RunStore, StorageConfig
from storage.leases import SlotLease
from storage.shards import ShardReader, ShardWriter
from storage.tables import COMPACTION_PREFIX, COMPACTION_SLOT_S, TABLE_SCHEMAS, Tables
from storage.weights import WeightStore
from tasks.common import run_store
from tasks.weights import build_base_version
from tests.flows.conftest import REPO, tiny_config
from tests.storage.records import make_table
from tests.storage.test_shards import start_upload, uploads_of


def test_maintain_compacts_prunes_and_sweeps_only_old_uncommitted_files(tmp_path):
    config = tiny_config(tmp_path / "runs", "maintain", warm_start={"enabled": False})
    store = run_store(config)
    build_base_version(config)
    weights = WeightStore(store)
    model, tokenizer = load_policy(weights.load(0))
    for step in (1, 2, 3):
        publish_policy(weights, model, tokenizer, step=step, parent=step - 1)
    with ShardWriter(store, "w0", flush_records=2) as writer:
        for start in range(0, 8, 2):
            writer.write_table(make_table(start, 2))
    old, young = "shards/raw/w0/00000009.arrow", "shards/tmp/raw/w0/00000010.arrow-0f0f"
    for leftover in (old, young):
        store.create_exclusive(store.path(leftover), b"left by a writer that died")
    two_hours_ago = time.time() - 7200
    os.utime(store.path(old), (two_hours_ago, two_hours_ago))
    # left by a publish killed before renaming it over LATEST; the young one may be a live write
    dead, live = (store.path("weights", f"LATEST.tmp-{seed * 32}") for seed in "ab")
    for temp in (dead, live):
        store.create_exclusive(temp, b"3\n")
    os.utime(dead, (two_hours_ago, two_hours_ago))

    result = maintain(config, keep_last=1, retention_hours=1)

    assert result["removed_latest_temps"] == [os.path.basename(dead)]
    assert not os.path.exists(dead) and os.path.exists(live)
    assert result["removed_shard_files"] == [old]
    assert not os.path.exists(store.path(old)) and os.path.exists(store.path(young))
    assert result["removed_versions"] == [1, 2] and weights.list() == [0, 3]  # v0 is tagged base
    compacted = {t["table"]: t["optimize"] for t in result["tables"] if "optimize" in t}
    assert compacted["shards"]["numFilesRemoved"] == 4  # one file per commit, compacted into one
    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert sum(reader.read(s).num_rows for s in shards) == 8
    assert Tables(store).read("shards").num_rows == 4


def test_a_sweep_of_latest_temps_that_failed_once_does_not_hide_the_versions_pruned(tmp_path, monkeypatch):
    """The sweep ran in the retain-weights task after retain: a transient error of the sweep
    retried the task, whose second retain found nothing left to prune, so the flow reported
    no version pruned."""
    config = tiny_config(tmp_path / "runs", "maintain-sweep-retried", warm_start={"enabled": False})
    build_base_version(config)
    weights = WeightStore(run_store(config))
    model, tokenizer = load_policy(weights.load(0))
    for step in (1, 2):
        publish_policy(weights, model, tokenizer, step=step, parent=step - 1)
    sweep, failures = WeightStore.sweep_latest_temps, iter([OSError("timed out (injected)")])

    def fails_once(self, *args, **kwargs):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return sweep(self, *args, **kwargs)

    monkeypatch.setattr(WeightStore, "sweep_latest_temps", fails_once)

    result = maintain(config, keep_last=1, retention_hours=1)

    assert result["removed_versions"] == [1] and weights.list() == [0, 2]  # v0 is tagged base
    assert result["removed_latest_temps"] == []


def test_retention_below_the_minimum_is_refused_by_the_flow_its_form_and_the_cli(tmp_path, capsys):
    config = tiny_config(tmp_path / "runs", "maintain-zero", warm_start={"enabled": False})
    store = run_store(config)
    with ShardWriter(store, "w0") as writer:
        writer.write_table(make_table(0, 2))
    in_flight = "shards/raw/w0/00000001.arrow"  # written, its commit not landed yet
    store.create_exclusive(store.path(in_flight), b"a live writer's shard")

    for hours in (0, -1):
        with pytest.raises(ParameterTypeError, match="retention_hours"):
            maintain(config, retention_hours=hours)
    assert parameter_schema(maintain).properties["retention_hours"]["minimum"] == MIN_RETENTION_HOURS >= 1
    with pytest.raises(SystemExit):
        maintain_main(["--config", str(REPO / "configs" / "tiny.yaml"), "--retention-hours", "0"])
    assert "--retention-hours: must be >= 1, got 0" in capsys.readouterr().err
    assert os.path.exists(store.path(in_flight))


def test_a_retention_past_what_vacuum_can_count_is_refused_and_the_most_allowed_runs(tmp_path, capsys):
    """deltalake panics computing a vacuum's cutoff millions of years back: the flow crashed
    at its first table, no other step run, on a PanicException."""
    config, store, orphan = _run_with_history(tmp_path, "maintain-forever")

    with pytest.raises(ParameterTypeError, match="retention_hours"):
        maintain(config, retention_hours=2**50)
    retention = parameter_schema(maintain).properties["retention_hours"]
    assert (
        retention["maximum"] == MAX_RETENTION_HOURS
        and f"at most {MAX_RETENTION_HOURS}" in retention["description"]
    )
    with pytest.raises(SystemExit):
        maintain_main(["--config", str(REPO / "configs" / "tiny.yaml"), "--retention-hours", str(2**50)])
    assert f"--retention-hours: must be <= {MAX_RETENTION_HOURS}, got {2**50}" in capsys.readouterr().err

    result = maintain(config, keep_last=1, retention_hours=MAX_RETENTION_HOURS)
    assert result["removed_shard_files"] == [] and os.path.exists(store.path(orphan))


def test_the_forms_retention_hours_says_its_minimum_as_a_number():
    # the deployment's form shows the docstring: a reader there cannot look a constant up
    description = parameter_schema(maintain).properties["retention_hours"]["description"]
    assert f"at least {MIN_RETENTION_HOURS}" in description
    assert "MIN_RETENTION_HOURS" not in description


def test_maintain_on_a_run_that_does_not_exist_is_an_error_before_the_flow_starts(tmp_path):
    root = tmp_path / "runs"
    with pytest.raises(SystemExit) as refused:
        maintain_main(["--run-id", "typo", "--set", f"storage.root={root}"])
    assert refused.value.code == (
        f"error: no run at {root / 'typo'}: it has no tables (check storage.root and --run-id)"
    )
    assert not root.exists()


def test_maintain_help_and_errors_say_what_it_does_and_expects(capsys):
    with pytest.raises(SystemExit):
        maintain_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Compact and vacuum the run's Delta tables, prune old weight versions and sweep shard files" in out
    assert "LATEST, tagged versions and the newest that verifies are always kept" in out
    with pytest.raises(SystemExit):
        maintain_main(["--keep-last", "x"])
    assert "argument --keep-last: invalid integer value: 'x'" in capsys.readouterr().err


def _run_with_history(tmp_path, run_id):
    """A run with 4 shard commits, 3 evals commits and an old shard file no commit lists; its
    config, store and that file."""
    config = tiny_config(tmp_path / "runs", run_id, warm_start={"enabled": False})
    store = run_store(config)
    with ShardWriter(store, "w0", flush_records=2) as writer:
        for start in range(0, 8, 2):
            writer.write_table(make_table(start, 2))
    tables = Tables(store)
    at = datetime.fromtimestamp(0, UTC)
    for version in range(3):
        tables.append("evals", [{"version": version, "env": "count", "reward": 0.5, "count": 4, "time": at}])
    orphan = "shards/raw/w0/00000009.arrow"
    store.create_exclusive(store.path(orphan), b"left by a writer that died")
    two_hours_ago = time.time() - 7200
    os.utime(store.path(orphan), (two_hours_ago, two_hours_ago))
    return config, store, orphan


def test_a_table_another_process_is_compacting_is_left_unvacuumed(tmp_path):
    """A compaction's new files are listed by no commit until it commits: a vacuum meanwhile
    deleted those older than the retention (a compaction running past it), and the commit
    then listed files that were gone in place of the ones it removed. maintain vacuumed a table
    whose compaction lease another process held, though compaction and vacuum must not overlap."""
    config, store, _ = _run_with_history(tmp_path, "maintain-compacting")
    assert SlotLease(store, store.path(COMPACTION_PREFIX, "evals"), COMPACTION_SLOT_S).take(time.time())
    folder = store.path("tables", "evals")
    written = os.path.join(folder, "part-00000-being-compacted-c000.zstd.parquet")
    shutil.copy(glob.glob(os.path.join(folder, "*.parquet"))[0], written)
    two_hours_ago = time.time() - 7200
    os.utime(written, (two_hours_ago, two_hours_ago))

    result = compact_table.fn(config, "evals", retention_hours=1)

    assert os.path.exists(written)
    assert result["vacuumed_files"] == 0
    assert summary({**EMPTY_RESULT, "tables": [result]}).splitlines()[0] == (
        "evals: neither compacted nor vacuumed, being compacted by another process "
        "(storage.tables.COMPACTION_SLOT_S)"
    )


EMPTY_RESULT = {
    "tables": [],
    "removed_versions": [],
    "removed_latest_temps": [],
    "removed_shard_files": [],
    "aborted_uploads": [],
}


def test_maintain_prints_a_short_summary_of_what_it_did(tmp_path, capsys):
    """It printed its whole result dict on one line of hundreds of characters."""
    config, store, orphan = _run_with_history(tmp_path, "maintain-summary")
    root = config.storage.root
    maintain_main(["--run-id", config.run_id, "--set", f"storage.root={root}", "--retention-hours", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-9:] == [
        "shards: compacted 4 files into 1, vacuumed 0 files",
        "trajectories: not created yet",
        "train_steps: not created yet",
        "weights: not created yet",
        "evals: compacted 3 files into 1, vacuumed 0 files",
        "weight versions pruned: none",
        "temporary files of killed publishes deleted: 0",
        "uncommitted shard files deleted: 1",
        "incomplete uploads of killed writers aborted: 0",
    ]
    assert not os.path.exists(store.path(orphan))


def _garble(store, table, version):
    with open(store.path("tables", table, "_delta_log", f"{version:020d}.json"), "w") as commit:
        commit.write('{"add": {"path": ')


def test_a_corrupt_table_fails_maintain_naming_it_after_every_other_table_and_step_ran(tmp_path):
    config, store, orphan = _run_with_history(tmp_path, "maintain-corrupt")
    _garble(store, "evals", 2)

    with pytest.raises(RuntimeError, match=r"maintain could not .*table 'evals': cannot load its Delta log"):
        maintain(config, keep_last=1, retention_hours=1)

    assert not os.path.exists(store.path(orphan))  # swept: the shards table reads
    assert Tables(store).version("shards") == 4  # compacted: one commit more
    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert sum(reader.read(s).num_rows for s in shards) == 8


def test_a_corrupt_shards_table_keeps_every_shard_file_and_fails_maintain_naming_it(tmp_path):
    config, store, orphan = _run_with_history(tmp_path, "maintain-corrupt-shards")
    _garble(store, "shards", 3)

    with pytest.raises(RuntimeError, match=r"table 'shards': cannot load its Delta log") as failed:
        maintain(config, keep_last=1, retention_hours=1)

    assert "sweep-shards" in str(failed.value)
    assert os.path.exists(store.path(orphan))  # nothing says which files were committed
    assert all(os.path.exists(store.path("shards", "raw", "w0", f"{seq:08d}.arrow")) for seq in range(4))
    assert Tables(store).version("evals") == 3  # compacted all the same


def _empty_latest_commit(store, table):
    """Leave ``table``'s latest commit file empty (a crash on a filesystem that lost its
    bytes) with every data file of the table two hours old; the data file that commit
    added."""
    tables = Tables(store)
    log = store.path("tables", table, "_delta_log", f"{tables.version(table):020d}.json")
    with open(log) as commit:
        lost = next(json.loads(line)["add"]["path"] for line in commit if line.startswith('{"add"'))
    open(log, "w").close()
    two_hours_ago = time.time() - 7200
    for data in glob.glob(store.path("tables", table, "*.parquet")):
        os.utime(data, (two_hours_ago, two_hours_ago))
    return store.path("tables", table, lost)


def test_an_empty_commit_file_fails_maintain_naming_the_table_and_its_data_files_stay(tmp_path):
    config, store, _ = _run_with_history(tmp_path, "maintain-empty-commit")
    lost = _empty_latest_commit(store, "evals")

    with pytest.raises(RuntimeError, match=r"compact-table evals: table 'evals': its commit 2 is empty"):
        maintain(config, keep_last=1, retention_hours=1)

    # no compaction commit over the empty one: restoring its file still brings its rows back
    assert sorted(os.listdir(store.path("tables", "evals", "_delta_log"))) == [
        f"{v:020d}.json" for v in range(3)
    ]
    assert os.path.exists(lost)  # vacuum deletes only the files a commit removed
    assert Tables(store).version("shards") == 4  # compacted all the same


def test_an_empty_shards_commit_keeps_the_shard_file_it_committed(tmp_path):
    config, store, _ = _run_with_history(tmp_path, "maintain-empty-shards-commit")
    shard = store.path("shards", "raw", "w0", "00000003.arrow")
    two_hours_ago = time.time() - 7200
    os.utime(shard, (two_hours_ago, two_hours_ago))
    _empty_latest_commit(store, "shards")

    with pytest.raises(RuntimeError, match=r"sweep-shards: table 'shards': its commit 3 is empty"):
        maintain(config, keep_last=1, retention_hours=1)

    assert os.path.exists(shard)


def task_run_names(flow_run_id, expected: int, timeout_s: float = 90.0) -> list[str]:
    """The names of the flow run's task runs once ``expected`` of them are recorded (the
    server records task runs from their events, asynchronously)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=30, at_exit=False)
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
            if len(runs) >= expected or time.monotonic() > deadline:
                return sorted(run.name for run in runs)
            time.sleep(0.5)


def test_each_compaction_task_run_is_named_after_its_table(tmp_path):
    config, _, _ = _run_with_history(tmp_path, "maintain-names")
    state = maintain(config, keep_last=1, retention_hours=1, return_state=True)
    assert state.is_completed()
    names = task_run_names(state.state_details.flow_run_id, len(TABLE_SCHEMAS) + 3)
    compactions = [name for name in names if name.startswith("compact-table")]
    assert compactions == sorted(f"compact-table {table}" for table in TABLE_SCHEMAS)


def test_the_maintain_deployment_says_each_step_the_flow_runs():
    """The deployment's description is what the UI shows of it: it names every step."""
    import yaml

    with open(REPO / "deployments" / "prefect.yaml") as file:
        deployments = yaml.safe_load(file)["deployments"]
    (deployment,) = [d for d in deployments if d["entrypoint"] == "flows.maintain:maintain"]
    said = deployment["description"]
    for step in (
        "Compact and vacuum the run's Delta tables",
        "prune old weight versions",
        "LATEST's temporary files",
        "sweep shard files",
    ):
        assert step in said


def test_a_maintain_run_on_a_run_that_does_not_exist_fails_naming_it(tmp_path):
    """A deployment run (its form) with a wrong root or run id completed, having found
    nothing to compact, prune or sweep; it fails naming where it looked."""
    root = tmp_path / "runs"
    state = maintain(tiny_config(root, "typo"), return_state=True)
    assert state.is_failed()
    with pytest.raises(FileNotFoundError, match=r"run 'typo' is not at .*check storage\.root and run_id"):
        state.result()
    assert not root.exists()


def test_a_storage_error_of_a_step_is_reported_on_one_line_with_what_the_store_answered(echoing_endpoint):
    """deltalake puts a storage error's cause on the lines after its first ("Kernel error ->
    Generic S3 error"), which alone named no cause in maintain's error."""
    config = StorageConfig(
        root="s3://bucket/runs",
        endpoint_url=echoing_endpoint,
        retries=0,
        access_key_id="AKIAKEYID123",
        secret_access_key="secret-456",
    )
    with pytest.raises(OSError) as raised:
        Tables(RunStore(config, "r")).version("shards")
    reported = _first_line(Failed(data=raised.value))
    assert "\n" not in reported and "\x1b" not in reported
    assert "400 Bad Request" in reported and "<Code>ExpiredToken</Code>" in reported, reported
    assert "AKIAKEYID123" not in reported


def test_the_maintain_command_on_a_corrupt_shards_table_runs_every_other_step(tmp_path):
    """The command's check that the run exists read the tables' logs in turn up to the first
    one it found: a shards log that did not parse refused the whole run, nothing compacted or
    pruned (another table's log did not, the check never reaching it)."""
    config, store, orphan = _run_with_history(tmp_path, "maintain-command-corrupt-shards")
    _garble(store, "shards", 3)
    root = config.storage.root

    with pytest.raises(RuntimeError, match=r"sweep-shards: table 'shards': cannot load its Delta log"):
        maintain_main(["--run-id", config.run_id, "--set", f"storage.root={root}", "--retention-hours", "1"])

    assert os.path.exists(store.path(orphan))
    assert Tables(store).version("evals") == 3  # compacted all the same


def test_maintain_aborts_the_old_incomplete_uploads_of_killed_writers_on_s3(s3_server, monkeypatch):
    """A writer killed while sending a large shard (a multipart upload) left its parts stored,
    and billed, for ever: no step of maintain listed or aborted them."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
    root = f"s3://{s3_server.bucket}/runs"
    storage = {"root": root, "endpoint_url": s3_server.endpoint_url}
    config = tiny_config(root, f"maintain-{uuid.uuid4().hex[:8]}", storage=storage)
    store = run_store(config)
    with ShardWriter(store, "w0") as writer:
        writer.write_table(make_table(0, 2))
    killed = start_upload(store, "shards/raw/w0/00000001.arrow")
    two_hours_on = killed["Initiated"].timestamp() + 7200
    monkeypatch.setattr(
        shard_module, "time", types.SimpleNamespace(time=lambda: two_hours_on, monotonic=time.monotonic)
    )

    result = maintain(config, keep_last=1, retention_hours=1)

    assert result["aborted_uploads"] == ["shards/raw/w0/00000001.arrow"]
    assert uploads_of(store) == []
    reader = ShardReader(store)
    assert [reader.read(shard).num_rows for shard in reader.poll()[0]] == [2]
