"""The run-wide quota: what a claim costs on a long chain of links, and exact totals when
claimants race."""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from storage.config import RunStore
from storage.quota import RunQuota


class CountedFs:
    """A store's filesystem that counts the listings and reads made through it."""

    def __init__(self, fs):
        self.fs = fs
        self.calls: Counter[str] = Counter()

    def ls(self, *args, **kwargs):
        self.calls["ls"] += 1
        return self.fs.ls(*args, **kwargs)

    def cat_file(self, *args, **kwargs):
        self.calls["cat_file"] += 1
        return self.fs.cat_file(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def counted(store: RunStore) -> tuple[RunStore, CountedFs]:
    """A second handle on ``store``'s run whose filesystem counts its listings and reads."""
    other = RunStore(store.config, store.run_id)
    other.fs = CountedFs(other.fs)
    return other, other.fs


def test_a_claim_on_a_long_chain_lists_nothing_after_the_first_and_reads_one_link(local_store):
    for _ in range(200):
        RunQuota(local_store, "rollouts", 10_000).claim(1)
    store, fs = counted(local_store)
    quota = RunQuota(store, "rollouts", 10_000)
    assert quota.claim(2) == 2
    assert fs.calls["ls"] == 1
    fs.calls.clear()
    for _ in range(50):
        assert quota.claim(2) == 2
        quota.release(1)
    assert fs.calls == {"cat_file": 100}
    assert quota.claimed() == 200 + 2 + 50


def test_a_worker_sees_what_others_claimed_and_gave_back_since_its_last_claim(local_store):
    mine, theirs = RunQuota(local_store, "rollouts", 10), RunQuota(local_store, "rollouts", 10)
    assert mine.claim(4) == 4
    assert theirs.claim(10) == 6
    assert mine.claim(1) == 0
    theirs.release(5)
    assert mine.claim(8, step=2) == 4
    assert theirs.claimed() == mine.claimed() == 9


def test_racing_claimants_never_pass_the_limit_and_hold_exactly_what_the_chain_says(store):
    limit, workers, start = 60, 4, threading.Barrier(4)

    def claimant(seed: int) -> int:
        quota = RunQuota(RunStore(store.config, store.run_id), "rollouts", limit)
        rng = random.Random(seed)
        held = 0
        start.wait()
        for _ in range(15):
            held += quota.claim(rng.randint(1, 6), step=rng.choice([1, 2]))
            unused = rng.randint(0, held)
            quota.release(unused)
            held -= unused
        return held

    with ThreadPoolExecutor(workers) as pool:
        held = sum(pool.map(claimant, range(workers)))
    quota = RunQuota(store, "rollouts", limit)
    assert quota.claimed() == held <= limit
    assert quota.claim(limit) == limit - held


def test_a_claim_or_release_whose_create_reply_was_lost_counts_once(store, monkeypatch):
    """s3fs retries a PUT whose reply was lost, and the retry is refused: the link exists,
    made by the first attempt."""
    real_create = store.create_exclusive

    def reply_lost(path, payload):
        real_create(path, payload)
        raise FileExistsError(f"{path} exists (conditional create refused)")

    quota = RunQuota(store, "rollouts", 10)
    monkeypatch.setattr(store, "create_exclusive", reply_lost)
    assert quota.claim(4) == 4
    quota.release(3)
    monkeypatch.undo()
    assert RunQuota(store, "rollouts", 10).claimed() == 1
    assert quota.claim(10) == 9


def test_a_claim_or_release_whose_create_failed_after_it_was_made_counts_once(store, monkeypatch):
    """A create whose reply never came (its retries timed out, the connection dropped) may
    have made the link: the claim raised, and the rollouts it took were held by no worker and
    never given back, so the run fell short by them; a release raised and was counted."""
    real_create = store.create_exclusive

    def reply_timed_out(path, payload):
        real_create(path, payload)
        raise TimeoutError("no reply to the PUT (injected)")

    quota = RunQuota(store, "rollouts", 10)
    monkeypatch.setattr(store, "create_exclusive", reply_timed_out)
    assert quota.claim(4) == 4
    quota.release(3)
    monkeypatch.undo()
    assert RunQuota(store, "rollouts", 10).claimed() == 1
    assert quota.claim(10) == 9


def test_a_create_that_failed_and_made_no_link_raises_its_error(store, monkeypatch):
    def unreachable(path, payload):
        raise ConnectionError("the store is unreachable (injected)")

    quota = RunQuota(store, "rollouts", 10)
    monkeypatch.setattr(store, "create_exclusive", unreachable)
    with pytest.raises(ConnectionError, match="unreachable"):
        quota.claim(4)
    monkeypatch.undo()
    assert quota.claimed() == 0


def test_a_local_link_is_on_disk_before_its_claim_returns(local_store, monkeypatch):
    """A link's bytes and its folder entry are flushed before the claim counts: after a power
    loss an empty link (which does not parse) would refuse every claim of the run for ever."""
    synced: set[tuple[int, int]] = set()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        stat = os.fstat(fd)
        synced.add((stat.st_dev, stat.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    quota = RunQuota(local_store, "rollouts", 10)
    assert quota.claim(4) == 4
    link = os.stat(quota._path(0))
    folder = os.stat(quota.folder)
    assert (link.st_dev, link.st_ino) in synced
    assert (folder.st_dev, folder.st_ino) in synced


@pytest.mark.parametrize(
    "payload", [b"", b"\x00garbage", b"[4]", b'{"mark": "m"}', b'{"total": "4"}', b'{"total": -1}']
)
def test_a_link_that_does_not_parse_is_named_in_the_error(local_store, payload):
    """A link damaged by hand or by a broken copy of the run's storage failed every claim with
    a bare JSONDecodeError, KeyError or TypeError that named no file (a string total was even
    taken as a number)."""
    quota = RunQuota(local_store, "rollouts", 10)
    assert quota.claim(2) == 2
    with open(quota._path(1), "wb") as link:
        link.write(payload)
    for read in (RunQuota(local_store, "rollouts", 10).claim, quota.claim, quota.release):
        with pytest.raises(ValueError, match=r"quota link .*rollouts/00000001 \(\d+ bytes\) is not"):
            read(1)
