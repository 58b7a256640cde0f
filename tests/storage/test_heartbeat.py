"""The heartbeat thread: beats at its pace, survives a failing beat, and is quiet once stopped."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from storage.heartbeat import Heartbeat


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def test_a_failing_beat_is_logged_and_the_next_beats_still_come(caplog):
    calls = []

    def beat() -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise OSError("the store timed out")

    with caplog.at_level(logging.WARNING, logger="storage.heartbeat"):
        heartbeat = Heartbeat(beat, every_s=0.01, what="status heartbeat")
        wait_until(lambda: len(calls) >= 3)
        heartbeat.stop()
    assert [r.getMessage() for r in caplog.records] == ["status heartbeat failed: the store timed out"]


def test_stop_waits_for_a_running_beat_and_no_beat_follows():
    started, release = threading.Event(), threading.Event()
    finished, calls = [], []

    def beat() -> None:
        calls.append(1)
        started.set()
        release.wait(30)
        finished.append(1)

    heartbeat = Heartbeat(beat, every_s=0.01, what="claim renewal")
    assert started.wait(30)
    threading.Timer(0.2, release.set).start()
    heartbeat.stop()
    assert finished == [1], "stop returned while a beat was still running"
    count = len(calls)
    time.sleep(0.2)  # twenty periods
    assert len(calls) == count == 1
    heartbeat.stop()  # stopping again does nothing


def test_a_beat_failing_with_an_empty_message_says_what_failed(caplog):
    """A beat that timed out with a bare ``TimeoutError()`` logged "… failed: " and nothing
    after it."""
    calls = []

    def beat() -> None:
        calls.append(1)
        raise TimeoutError()

    with caplog.at_level(logging.WARNING, logger="storage.heartbeat"):
        heartbeat = Heartbeat(beat, every_s=0.01, what="claim renewal")
        wait_until(lambda: len(calls) >= 1)
        heartbeat.stop()
    assert caplog.records[0].getMessage() == "claim renewal failed: TimeoutError"


def test_a_pace_that_is_not_a_positive_number_of_seconds_is_refused():
    """0, a negative or NaN pace beat without pause (a storage write in a busy loop); an
    infinite one killed the thread at its first wait, so the status went stale unsaid."""
    calls = []
    for every_s in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"every_s must be a positive number of seconds, got {every_s}"):
            Heartbeat(lambda: calls.append(1), every_s=every_s, what="status heartbeat")
    assert calls == []
