"""What a signal's warnings say when the store fails for a moment: the error's type, even
where it has no message, and never a credential its text echoes."""

from __future__ import annotations

import logging

import pytest

from tasks.common import read_signal, send_signal

FAILURES = [
    TimeoutError(),  # fsspec's timeout: no message
    PermissionError("AccessDenied: <AWSAccessKeyId>AKIAABCDEFGHIJKLMNOP</AWSAccessKeyId>"),
]


def failing_first(calls: list, method):
    """``method`` failing with each of :data:`FAILURES` in turn, then answering."""

    def call(*args, **kwargs):
        calls.append(args)
        if len(calls) <= len(FAILURES):
            raise FAILURES[len(calls) - 1]
        return method(*args, **kwargs)

    return call


def assert_said(caplog: pytest.LogCaptureFixture, opening: str) -> None:
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith(opening)]
    assert len(warned) == len(FAILURES), warned
    assert "TimeoutError" in warned[0], warned[0]
    assert "AccessDenied" in warned[1] and "AKIAABCDEFGHIJKLMNOP" not in warned[1], warned[1]


def test_a_signal_raised_again_says_what_failed_masked(local_store, monkeypatch, caplog):
    """A bare ``TimeoutError`` was logged as "could not raise signal 'stop' ()", and a key id
    an S3 error body echoed as it was."""
    calls: list = []
    monkeypatch.setattr(local_store.fs, "pipe_file", failing_first(calls, local_store.fs.pipe_file))
    with caplog.at_level(logging.WARNING, logger="tasks.common"):
        send_signal(local_store, "k", "stop", retry_s=(0.01, 0.01, 0.01))
    assert_said(caplog, "could not raise signal 'stop'")


def test_a_signal_read_again_says_what_failed_masked(local_store, monkeypatch, caplog):
    send_signal(local_store, "k", "started", content="1234.5")
    calls: list = []
    monkeypatch.setattr(local_store.fs, "cat_file", failing_first(calls, local_store.fs.cat_file))
    with caplog.at_level(logging.WARNING, logger="tasks.common"):
        assert read_signal(local_store, "k", "started", retry_s=(0.01, 0.01, 0.01)) == "1234.5"
    assert_said(caplog, "could not read signal 'started'")
