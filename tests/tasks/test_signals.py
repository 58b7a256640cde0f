"""Signals between the pipeline's tasks go through the run's store: a store that fails for a
moment delays a signal, never loses it."""

from __future__ import annotations

import pytest

from tasks.common import send_signal, signal_path


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
