"""Signals between the pipeline's tasks go through the run's store: a store that fails for a
moment delays a signal, never loses it."""

from __future__ import annotations

import threading

import pytest

from tasks import common
from tasks.common import (
    clear_signals,
    deadline_once_started,
    read_signal,
    send_signal,
    signal_path,
    signals_dir,
    watch_signal,
)


def flaky_pipe(store, monkeypatch, failures: int) -> list[str]:
    """Make the store's next ``failures`` writes fail; returns the attempts made."""
    attempts: list[str] = []
    pipe_file = store.fs.pipe_file

    def pipe(path, data, **kwargs):
        attempts.append(path)
        if len(attempts) <= failures:
            raise ConnectionResetError("connection reset (injected)")
        return pipe_file(path, data, **kwargs)

    monkeypatch.setattr(store.fs, "pipe_file", pipe)
    return attempts


def test_a_signal_is_raised_once_the_store_answers_again(local_store, monkeypatch):
    attempts = flaky_pipe(local_store, monkeypatch, failures=2)
    send_signal(local_store, "k", "stop", retry_s=(0.01, 0.01, 0.01))
    assert len(attempts) == 3
    assert local_store.fs.exists(local_store.path(signal_path("k", "stop")))


def test_a_signal_the_store_keeps_refusing_is_an_error(local_store, monkeypatch):
    attempts = flaky_pipe(local_store, monkeypatch, failures=10)
    with pytest.raises(ConnectionResetError, match="injected"):
        send_signal(local_store, "k", "stop", retry_s=(0.01, 0.01))
    assert len(attempts) == 3


@pytest.fixture
def fast_watch(monkeypatch):
    monkeypatch.setattr(common, "SIGNAL_POLL_S", 0.01)


def watchers(name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == f"signal-{name}"]


def test_a_watched_signal_is_seen_once_raised_and_not_before(local_store, fast_watch):
    with watch_signal(local_store, "k", "rollouts-done") as raised:
        send_signal(local_store, "another-key", "rollouts-done")
        assert not raised.wait(0.1)
        send_signal(local_store, "k", "rollouts-done")
        assert raised.wait(30)
    assert not watchers("rollouts-done")


def test_a_signal_the_store_refused_is_heard_by_the_tasks_of_this_process(
    local_store, monkeypatch, fast_watch
):
    """A store that refuses writes (a full disk) kept a pipeline's tasks, threads of its own
    process, from hearing their end: those waiting for a rollout worker that failed before it
    came up waited for ever, and the flow with them. Removing the signals forgets them."""
    flaky_pipe(local_store, monkeypatch, failures=10)
    with watch_signal(local_store, "k", "rollouts-done") as raised:
        with pytest.raises(ConnectionResetError, match="injected"):
            send_signal(local_store, "k", "rollouts-done", retry_s=())
        assert raised.wait(30)  # the bound only ends a wait that fails the test
    clear_signals(local_store, "k")
    with watch_signal(local_store, "k", "rollouts-done") as raised:
        assert not raised.wait(0.1)


def test_a_watcher_ends_with_its_block_when_no_signal_came(local_store, fast_watch):
    with watch_signal(local_store, "k", "never") as raised:
        assert watchers("never")
    assert not raised.is_set() and not watchers("never")


def failing_exists(store, monkeypatch, error: Exception, failures: int | None = None) -> list[str]:
    """Make the store's next ``failures`` looks for a file (all without a number) raise
    ``error``; returns the looks made."""
    looks: list[str] = []
    exists = store.fs.exists

    def look(path, **kwargs):
        looks.append(path)
        if failures is None or len(looks) <= failures:
            raise error
        return exists(path, **kwargs)

    monkeypatch.setattr(store.fs, "exists", look)
    return looks


@pytest.mark.parametrize(
    "error",
    [ConnectionResetError("connection reset (injected)"), ValueError("an odd answer (injected)")],
    ids=["transient", "unknown"],
)
def test_a_watcher_the_store_fails_for_a_moment_sees_the_signal_once_it_answers(
    local_store, monkeypatch, fast_watch, error
):
    """An error not known to say the same on every look is looked past: ending a long run's
    work on one seen once would cost more than a warning."""
    looks = failing_exists(local_store, monkeypatch, error, 2)
    local_store.fs.pipe_file(local_store.path(signal_path("k", "stop")), b"stop")
    with watch_signal(local_store, "k", "stop") as raised:
        assert raised.wait(30)
    assert len(looks) == 3


def test_a_watcher_refused_the_signals_file_ends_the_work_and_fails_its_block(
    local_store, monkeypatch, fast_watch, caplog
):
    """A lasting PermissionError was looked at again every second for ever, a warning each
    time: the task never heard the signal that ends it (a pipeline's rollouts and trainer
    without a deadline ran on for ever). Its work ends as at the signal, then the error
    fails the block, and so the task, which does not retry it."""
    looks = failing_exists(local_store, monkeypatch, PermissionError(13, "Permission denied (injected)"))
    with pytest.raises(PermissionError, match="injected"), watch_signal(local_store, "k", "stop") as raised:
        assert raised.wait(30)  # the bound only ends a wait that fails the test
    assert len(looks) == 1 and not watchers("stop")
    (said,) = [r for r in caplog.records if "signal stop" in r.getMessage()]
    assert said.levelname == "ERROR" and "Permission denied (injected)" in said.getMessage()


def test_a_watcher_whose_block_failed_raises_the_blocks_error(local_store, monkeypatch, fast_watch):
    failing_exists(local_store, monkeypatch, PermissionError(13, "Permission denied (injected)"))
    with (
        pytest.raises(RuntimeError, match="the work failed"),
        watch_signal(local_store, "k", "stop") as raised,
    ):
        assert raised.wait(30)
        raise RuntimeError("the work failed")


def test_without_a_key_there_is_nothing_to_watch(local_store):
    with watch_signal(local_store, None, "stop") as raised:
        assert raised is None and not watchers("stop")


def test_clearing_removes_the_signals_of_its_key_alone(local_store):
    send_signal(local_store, "k", "stop")
    send_signal(local_store, "other", "stop")
    clear_signals(local_store, "k")
    clear_signals(local_store, "never-signalled")
    assert not local_store.fs.exists(local_store.path(signal_path("k", "stop")))
    assert local_store.fs.exists(local_store.path(signal_path("other", "stop")))


def test_a_store_that_refuses_to_clear_the_signals_is_an_error(local_store, monkeypatch):
    """The pipeline warns of the signals it leaves behind; a silent failure would not."""
    send_signal(local_store, "k", "stop")

    def refused(path, **kwargs):
        raise ConnectionResetError("connection reset (injected)")

    monkeypatch.setattr(local_store.fs, "rm", refused)
    with pytest.raises(ConnectionResetError, match="injected"):
        clear_signals(local_store, "k")


def test_a_task_waiting_for_the_run_to_start_takes_its_deadline_once_the_store_answers_again(
    local_store, monkeypatch
):
    """A store error reading signal 'started' (an S3 503) is retried: every other signal
    outlives a store away for a moment."""
    failures = []
    cat_file = type(local_store.fs).cat_file

    def flaky_cat(fs, path, *args, **kwargs):
        if len(failures) < 2:
            failures.append(path)
            raise ConnectionResetError("connection reset (injected)")
        return cat_file(fs, path, *args, **kwargs)

    monkeypatch.setattr(type(local_store.fs), "cat_file", flaky_cat)
    send_signal(local_store, "k", "started", content="1234.5")
    assert deadline_once_started(local_store, "k") == 1234.5
    assert len(failures) == 2


def test_a_started_signal_the_store_keeps_refusing_to_read_is_an_error(local_store, monkeypatch):
    """Read as not raised, a store that stays away would leave the waiting task polling for
    ever without a word."""
    send_signal(local_store, "k", "started", content="1234.5")
    reads = []

    def refused(fs, path, *args, **kwargs):
        reads.append(path)
        raise ConnectionResetError("connection reset (injected)")

    monkeypatch.setattr(type(local_store.fs), "cat_file", refused)
    with pytest.raises(ConnectionResetError, match="injected"):
        read_signal(local_store, "k", "started", retry_s=(0.01, 0.01))
    assert len(reads) == 3


class FinishedOnFirstLook:
    """An end never set; the first look at it finishes writing signal 'started'."""

    def __init__(self, store):
        self.store, self.looks = store, 0

    def is_set(self) -> bool:
        if not self.looks:
            send_signal(self.store, "k", "started", content="1234.5")
        self.looks += 1
        return False


def test_a_task_waits_for_a_started_signal_still_being_written(local_store):
    """A local store's write is not atomic: the file of signal 'started' is there, empty, before
    its content; read then, it is not raised yet (no deadline in '')."""
    local_store.fs.makedirs(local_store.path(signals_dir("k")), exist_ok=True)
    local_store.fs.touch(local_store.path(signal_path("k", "started")))
    written = FinishedOnFirstLook(local_store)
    assert deadline_once_started(local_store, "k", written) == 1234.5
    assert written.looks == 1


def test_a_task_waiting_for_the_run_to_start_ends_without_a_deadline_at_its_end_signal(local_store):
    """The rollouts task failed before its worker came up, or the run was stopped: no
    deadline will come, and the waiting task ends."""
    ended = threading.Event()
    ended.set()
    assert deadline_once_started(local_store, "k", None, ended) is None
    send_signal(local_store, "k", "started", content="1234.5")
    assert deadline_once_started(local_store, "k", ended) == 1234.5
