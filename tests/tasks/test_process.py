"""The process task's processor on a run as the flows start it."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from rl import process_loop
from rl.models import ensure_base_version, load_policy, publish_policy
from rl.process_loop import ShardProcessor
from storage.shards import ShardWriter
from storage.status import InUse, ProcessOffsetBoard, ProcessorStatus, ProcessorStatusBoard
from storage.tables import Tables
from storage.weights import WeightStore
from tasks import process as process_task
from tasks.common import deadline_of, run_store
from tasks.process import process_pending, run_processor, shard_processor
from tests.conftest import kept_fresh, published_by
from tests.flows.conftest import tiny_config
from tests.rl.test_trainer import TINY, make_trajectories


def test_a_processor_started_before_version_zero_fills_the_text_column(tmp_path):
    """Started beside the trainer and the workers, the processor finds no version (so no
    tokenizer) yet; the rows of the shards that come later still get their text."""
    config = tiny_config(tmp_path / "runs", "process-early")
    processor = shard_processor(config)
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    raw = [
        {k: v for k, v in record.items() if k not in ("train_mask", "loss_weight")}
        for record in make_trajectories(store, 2, seed=1)
    ]
    writer = ShardWriter(store, "w0")
    writer.write_many(raw)
    writer.close()
    assert len(processor.poll()) == 1
    texts = Tables(store).read("trajectories").column("text").to_pylist()
    assert len(texts) == 2 and all(texts), texts


def test_a_processor_decodes_with_the_newest_tokenizer_that_verifies(tmp_path):
    """LATEST's version whose tokenizer does not verify is passed over, as the workers pass
    it over: every row's text was left empty (CorruptVersion at each decode)."""
    config = tiny_config(tmp_path / "runs", "process-corrupt")
    store = run_store(config)
    weights = WeightStore(store)
    ensure_base_version(weights, TINY)
    model, tokenizer = load_policy(weights.load(0))
    publish_policy(weights, model, tokenizer, step=1, parent=0)
    os.truncate(os.path.join(weights.version_path(1), "tokenizer.json"), 10)
    commit_raw(store, raw_records(store, 2, seed=1))
    assert len(shard_processor(config).poll()) == 1
    texts = Tables(store).read("trajectories").column("text").to_pylist()
    assert len(texts) == 2 and all(texts), texts


def test_a_processor_whose_tokenizer_does_not_load_tries_again_after_a_while_not_at_every_row(
    tmp_path, monkeypatch
):
    """Every row's decode fetched and hashed each version's tokenizer again (on S3, a
    shard of a thousand rows: a thousand downloads of every retained version's tokenizer)."""
    config = tiny_config(tmp_path / "runs", "process-no-tokenizer")
    store = run_store(config)
    weights = WeightStore(store)
    ensure_base_version(weights, TINY)
    first, later = raw_records(store, 4, seed=1), raw_records(store, 2, seed=2)
    commit_raw(store, first)
    tokenizer = Path(weights.version_path(0), "tokenizer.json")
    good = tokenizer.read_bytes()
    tokenizer.write_bytes(good[:10])
    loads = []
    load_newest = WeightStore.load_newest
    monkeypatch.setattr(WeightStore, "load_newest", lambda self, *a: loads.append(a) or load_newest(self, *a))
    processor = shard_processor(config)
    assert len(processor.poll()) == 1
    assert Tables(store).read("trajectories").column("text").to_pylist() == [None] * 4
    assert len(loads) == 1

    tokenizer.write_bytes(good)
    monkeypatch.setattr(process_task, "TOKENIZER_RETRY_S", 0.0)
    commit_raw(store, later)
    assert len(processor.poll()) == 1
    rows = Tables(store).read("trajectories").to_pylist()
    assert [bool(r["text"]) for r in rows if r["trajectory_id"] in {t["trajectory_id"] for t in later}] == [
        True
    ] * 2
    assert len(loads) == 2


def test_a_processor_keeps_no_copy_of_the_tokenizer_it_loaded_in_the_weight_cache(tmp_path):
    """The tokenizer is read into memory once: its copy stayed in the weight cache for good,
    one per processor run."""
    config = tiny_config(tmp_path / "runs", "process-cache")
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    commit_raw(store, raw_records(store, 2, seed=1))
    assert len(shard_processor(config).poll()) == 1
    assert all(Tables(store).read("trajectories").column("text").to_pylist())
    assert not [path for path in WeightStore(store).cache_dir.rglob("v0*") if path.is_dir()]


def raw_records(store, count: int, seed: int) -> list[dict]:
    return [
        {k: v for k, v in record.items() if k not in ("train_mask", "loss_weight")}
        for record in make_trajectories(store, count, seed=seed)
    ]


def commit_raw(store, records: list[dict], worker: str = "w0") -> None:
    writer = ShardWriter(store, worker)
    writer.write_many(records)
    writer.close()


def test_a_pending_pass_is_bounded_by_what_was_pending_when_it_started(tmp_path, monkeypatch):
    """A worker that commits faster than a pass processes would otherwise keep one pass
    running for as long as it commits; each commit's own event schedules the next pass."""
    config = tiny_config(tmp_path / "runs", "pending")
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    commit_raw(store, raw_records(store, 2, seed=1))
    late = raw_records(store, 2, seed=2)
    poll = ShardProcessor.poll

    def poll_then_commit(self):
        outcomes = poll(self)
        if late:
            commit_raw(store, [late.pop(), late.pop()], worker="w1")
        return outcomes

    monkeypatch.setattr(ShardProcessor, "poll", poll_then_commit)
    assert process_pending.fn(config)["shards"] == 1
    assert Tables(store).read("trajectories").num_rows == 2
    assert not ProcessorStatusBoard(store).read().running
    assert not [thread for thread in threading.enumerate() if thread.name == "processor status"]
    assert process_pending.fn(config)["shards"] == 1  # the next pass takes the late one
    assert Tables(store).read("trajectories").num_rows == 4


def test_a_pending_pass_on_storage_without_the_run_fails_naming_it(tmp_path):
    config = tiny_config(tmp_path / "elsewhere", "cluster")
    with pytest.raises(FileNotFoundError, match=r"run 'cluster' is not at .*elsewhere.*storage\.root"):
        process_pending.fn(config)
    ensure_base_version(WeightStore(run_store(config)), TINY)  # warm-started, no rollout yet
    assert process_pending.fn(config)["dropped"] == {}


@pytest.mark.parametrize("how", ["continuous", "pending"])
def test_a_second_processor_on_a_run_with_a_running_processor_refuses_to_start(tmp_path, how):
    config = tiny_config(tmp_path / "runs", "one-processor")
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    commit_raw(store, raw_records(store, 2, seed=3))
    board = ProcessorStatusBoard(store)
    start = {
        "continuous": lambda: run_processor(config, time.time() + 30),
        "pending": lambda: process_pending.fn(config),
    }[how]

    with (
        kept_fresh(lambda: board.publish(ProcessorStatus(time=time.time()))),
        pytest.raises(InUse, match="the processor of run 'one-processor' is in use.*one processor"),
    ):
        start()
    assert Tables(store).read("trajectories").num_rows == 0
    board.publish(ProcessorStatus(time=time.time(), running=False))  # a stopped one holds nothing
    if how == "continuous":
        assert run_processor(config, time.time())["shards"] == 1
    else:
        assert process_pending.fn(config)["shards"] == 1
    assert Tables(store).read("trajectories").num_rows == 2 and not board.read().running


def test_a_processor_whose_role_was_taken_stops_and_leaves_the_status_to_the_new_holder(
    tmp_path, monkeypatch
):
    """Its renewals stalled past the time a status counts, another processor took the run:
    at its next renewal it finds the other's status, stops processing and writes nothing."""
    monkeypatch.setattr(process_task, "STATUS_EVERY_S", 0.05)
    config = tiny_config(tmp_path / "runs", "taken-over")
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    board = ProcessorStatusBoard(store)
    written = published_by(monkeypatch, ProcessorStatusBoard)
    monkeypatch.setattr(process_loop, "SAVE_EVERY_S", 3600.0)  # its offset saved only when it stops
    offsets = published_by(monkeypatch, ProcessOffsetBoard)
    processed = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(run_processor, config, time.time() + 60, on_shard=lambda outcome: processed.set())
        deadline = time.monotonic() + 30
        while len(written) < 2:  # its claim: a status, and the same once it settled
            assert time.monotonic() < deadline and not first.done()
            time.sleep(0.02)
        first_owner = written[0].owner
        commit_raw(store, raw_records(store, 2, seed=4))
        assert processed.wait(30)
        saved = len(offsets)
        with kept_fresh(lambda: board.publish(ProcessorStatus(time=time.time(), owner="the-new-one")), 0.02):
            with pytest.raises(InUse, match="the processor of run .* was taken over by another process"):
                first.result(timeout=30)
            assert board.read().owner == "the-new-one" and board.read().running
    # it never marked the role stopped: that would have freed the new holder's run
    assert all(status.running for status in written)
    assert {status.owner for status in written} == {first_owner, "the-new-one"}
    assert len(offsets) == saved  # nor saved its place in the log over the new holder's


@pytest.mark.parametrize("twin", ["to commit", "committed, rows missing"])
@pytest.mark.parametrize("how", ["continuous", "pending"])
def test_a_processor_whose_role_was_taken_before_it_commits_commits_nothing(tmp_path, monkeypatch, how, twin):
    """The other processor took the run after this one claimed it and before its first
    commit, with no status renewal due between: the commit reads the status back first and
    is refused, so neither a processed shard nor a ``trajectories`` row lands. So also when
    an earlier processor died between a twin and its rows: the rows alone are refused."""
    config = tiny_config(tmp_path / "runs", "taken-before-commit")
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    commit_raw(store, raw_records(store, 2, seed=3))
    shard_kinds = ["raw"]
    if twin == "committed, rows missing":
        append = Tables.append

        def died_before_the_rows(self, name, rows):
            if name == "trajectories":
                raise OSError("died between the twin and its rows (injected)")
            append(self, name, rows)

        with monkeypatch.context() as dying, pytest.raises(OSError, match="injected"):
            dying.setattr(Tables, "append", died_before_the_rows)
            ShardProcessor(store, config.processor).poll()
        shard_kinds = ["processed", "raw"]
    board = ProcessorStatusBoard(store)
    build = process_task.shard_processor

    def taken_once_built(*args, **kwargs):
        processor = build(*args, **kwargs)
        board.publish(ProcessorStatus(time=time.time(), owner="the-new-one"))
        return processor

    monkeypatch.setattr(process_task, "shard_processor", taken_once_built)
    start = {
        "continuous": lambda: run_processor(config, time.time() + 30),
        "pending": lambda: process_pending.fn(config),
    }[how]
    with pytest.raises(InUse, match="the processor of run .* was taken over by another process"):
        start()
    tables = Tables(store)
    assert sorted(tables.read("shards").column("kind").to_pylist()) == shard_kinds
    assert tables.read("trajectories").num_rows == 0
    assert board.read().owner == "the-new-one" and board.read().running


def test_a_pass_sums_up_its_shards_drops_and_skips(tmp_path):
    """The summary a flow reports: one trajectory of a shard dropped as a duplicate, and a
    raw shard whose file went missing skipped, each counted by its reason."""
    config = tiny_config(tmp_path / "runs", "summary")
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    [record] = raw_records(store, 1, seed=6)
    commit_raw(store, [record, {**record, "trajectory_id": f"{record['trajectory_id']}-twice"}])
    commit_raw(store, raw_records(store, 1, seed=7), worker="w1")
    [lost] = [row for row in Tables(store).read("shards").to_pylist() if row["worker"] == "w1"]
    store.fs.rm(store.path(lost["path"]))
    summary = process_pending.fn(config)
    assert summary["shards"] == 1 and summary["skipped_file missing"] == 1
    assert (summary["trajectories_in"], summary["trajectories_out"]) == (2, 1)
    assert summary["dropped"] == {"duplicate": 1}


def test_a_pass_with_nothing_pending_reports_zero_counts(tmp_path):
    """A pass over no new shard (an event-triggered pass whose shard an earlier pass took)
    reports the same counts as any other, at zero, rather than a summary without them."""
    config = tiny_config(tmp_path / "runs", "nothing-pending")
    ensure_base_version(WeightStore(run_store(config)), TINY)
    summary = process_pending.fn(config)
    assert summary == {
        "shards": 0,
        "trajectories_in": 0,
        "trajectories_out": 0,
        "tokens_in": 0,
        "train_tokens_out": 0,
        "dropped": {},
    }


def test_a_processor_whose_shard_reports_fail_processes_on_and_says_so(tmp_path, caplog):
    """The Prefect API away for a moment fails the event of a processed shard, not the shard."""
    config = tiny_config(tmp_path / "runs", "reports-fail")
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    commit_raw(store, raw_records(store, 2, seed=5))

    def unreachable(outcome):
        raise httpx.ConnectError("Prefect API unreachable (injected)")

    assert run_processor(config, time.time(), on_shard=unreachable)["shards"] == 1
    assert Tables(store).read("trajectories").num_rows == 2
    assert "report of a processed shard failed, the work goes on" in caplog.text


def test_the_text_column_keeps_the_special_tokens(tmp_path):
    """The text is what the policy saw: an end-of-turn token stays in it."""
    config = tiny_config(tmp_path / "runs", "special-tokens")
    store = run_store(config)
    weights = WeightStore(store)
    ensure_base_version(weights, TINY)
    _, tokenizer = load_policy(weights.load(0))
    [record] = raw_records(store, 1, seed=8)
    record["tokens"][-1] = tokenizer.eos_token_id
    commit_raw(store, [record])
    assert len(shard_processor(config).poll()) == 1
    [text] = Tables(store).read("trajectories").column("text").to_pylist()
    assert text.endswith(tokenizer.eos_token), text


def test_a_processor_told_to_stop_drains_once_and_returns_before_its_deadline(tmp_path, monkeypatch):
    """The rollouts are done (``stop`` set): what they committed is processed, and the
    processor returns rather than poll on to its deadline."""
    config = tiny_config(tmp_path / "runs", "stopped")
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    commit_raw(store, raw_records(store, 2, seed=9))
    polls = []
    poll = ShardProcessor.poll

    def polled_once(self):
        polls.append(self)
        assert len(polls) == 1, "polled on after its stop"
        return poll(self)

    monkeypatch.setattr(ShardProcessor, "poll", polled_once)
    stop = threading.Event()
    stop.set()
    assert run_processor(config, time.time() + 3600, stop=stop)["shards"] == 1
    assert Tables(store).read("trajectories").num_rows == 2


def test_a_process_task_given_neither_a_deadline_nor_a_signals_key_is_refused(tmp_path):
    """With no rollouts task to raise its deadline in signal 'started', it would wait for ever."""
    config = tiny_config(tmp_path / "runs", "no-deadline")
    with pytest.raises(ValueError, match=r"^the process-shards task needs a deadline, or the signals key"):
        process_task.process_shards.fn(config)


def test_a_process_flows_deadline_is_the_runs_wall_clock_budget_from_now_and_none_without_one(tmp_path):
    before = time.time()
    deadline = deadline_of(tiny_config(tmp_path / "runs", "budget", stop={"max_seconds": 20}))
    assert before + 20 <= deadline <= time.time() + 20
    assert deadline_of(
        tiny_config(tmp_path / "runs", "no-budget", stop={"max_seconds": None, "max_rollouts": 4})
    ) == float("inf")


@pytest.mark.parametrize("how", ["continuous", "pending"])
def test_a_processor_saves_its_place_in_the_log_when_it_ends(tmp_path, monkeypatch, how):
    """Even with no periodic save due: the next processor of the run starts after the
    shards this one processed rather than going over them again."""
    monkeypatch.setattr(process_loop, "SAVE_EVERY_S", float("inf"))
    config = tiny_config(tmp_path / "runs", "saves-offset")
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    commit_raw(store, raw_records(store, 2, seed=10))
    start = {
        "continuous": lambda: run_processor(config, time.time()),
        "pending": lambda: process_pending.fn(config),
    }[how]
    assert start()["shards"] == 1
    assert ShardProcessor(store, config.processor).poll() == []
