"""Slot leases: what a take whose create failed leaves behind."""

from __future__ import annotations

import posixpath

import pytest

from storage.leases import SlotLease


@pytest.mark.parametrize("failing", [0, 1])
def test_a_lease_whose_create_failed_after_it_was_made_is_held_and_released(store, monkeypatch, failing):
    """A create whose reply never came (its retries timed out, the connection dropped) may
    have made the lease: the take raised and left it behind, held by no one, so every
    compaction of the table was skipped for up to two slots."""
    folder, slot = store.path("status", "leases"), 10.0
    real_create, calls = store.create_exclusive, []

    def reply_timed_out(path, payload):
        real_create(path, payload)
        calls.append(path)
        if len(calls) == failing + 1:
            raise TimeoutError("no reply to the PUT (injected)")

    lease = SlotLease(store, folder, slot)
    monkeypatch.setattr(store, "create_exclusive", reply_timed_out)
    assert lease.take(100.0)
    monkeypatch.undo()
    assert [posixpath.basename(p) for p in lease.held] == ["10", "11"]
    assert not SlotLease(store, folder, slot).take(100.0)
    lease.release()
    assert SlotLease(store, folder, slot).take(100.0)


def test_a_create_that_failed_and_made_no_lease_raises_and_leaves_none(store, monkeypatch):
    folder, slot = store.path("status", "leases"), 10.0

    def unreachable(path, payload):
        raise ConnectionError("the store is unreachable (injected)")

    lease = SlotLease(store, folder, slot)
    monkeypatch.setattr(store, "create_exclusive", unreachable)
    with pytest.raises(ConnectionError, match="unreachable"):
        lease.take(100.0)
    monkeypatch.undo()
    assert lease.held == []
    assert SlotLease(store, folder, slot).take(100.0)
