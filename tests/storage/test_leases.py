"""Slot leases: what a take whose create failed leaves behind."""

from __future__ import annotations

import posixpath

import pytest

from storage.leases import LeaseLost, SlotLease


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


def test_a_lease_lost_while_its_work_ran_fails_the_work_saying_it_may_have_run_twice(store):
    """A holder paused for a whole slot finds the next slot taken by another holder, whose
    work (a compaction, whose rows deltalake then holds twice) runs at once with its own: the
    renewal only logged it, and the work ended as if it had been alone."""
    folder, slot = store.path("status", "leases"), 1000.0
    lease, other = SlotLease(store, folder, slot), SlotLease(store, folder, slot)
    assert lease.take(100_000.0)  # slots 100 and 101
    lost = r"slot 102 .* taken by another holder .* may have run twice"
    with pytest.raises(LeaseLost, match=lost), lease.kept():
        assert other.take(102_000.0)  # this holder paused through slot 101
        lease.renew(101_500.0)
    assert lease.held == [] and [posixpath.basename(p) for p in other.held] == ["102", "103"]


def test_a_lease_lost_while_its_work_failed_leaves_the_work_s_error(store):
    folder, slot = store.path("status", "leases"), 1000.0
    lease = SlotLease(store, folder, slot)
    assert lease.take(100_000.0)
    with pytest.raises(KeyError, match="the work's own error"), lease.kept():
        assert SlotLease(store, folder, slot).take(102_000.0)
        lease.renew(101_500.0)
        raise KeyError("the work's own error")
