"""Exclusive leases on time slots, kept in a run's storage (a local folder or S3).

The lease of a folder for slot ``s`` is the object ``<folder>/<s>``, created exclusively
(``O_EXCL`` on a local folder, a conditional PUT on S3). A holder takes the slot of now and
the next one, so no one else can take both of two consecutive slots; while it works it
takes each next slot before that slot begins (``kept`` renews on a thread every third of a
slot), and when it is done it deletes its leases. A holder that dies stops renewing, and its
leases lapse within two slots. Leases rest on the processes' clocks agreeing to well within
a slot, and on a holder never pausing for a whole slot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Iterator

from storage.config import RunStore

log = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """A holder found a slot it renews taken by another holder while its work ran."""


class SlotLease:
    """A lease on the slots of ``slot_s`` seconds in ``folder`` (a path of ``store``)."""

    def __init__(self, store: RunStore, folder: str, slot_s: float):
        self.store = store
        self.folder = folder
        self.slot_s = slot_s
        self.holder = f"{uuid.uuid4().hex} pid {os.getpid()} on {socket.gethostname()}\n".encode()
        self.held: list[str] = []
        self.lost: list[int] = []
        """Slots a renewal found taken by another holder."""

    def take(self, now: float) -> bool:
        """Take the slot of ``now`` and the next one; False (holding nothing) when another
        holder has either. Leases of earlier slots, left by holders that died, are deleted."""
        slot = self._slot(now)
        if not self.store.config.is_s3:
            os.makedirs(self.folder, exist_ok=True)
        try:
            for leased in (slot, slot + 1):
                self._create(leased)
        except FileExistsError:
            self.release()
            return False
        except BaseException:
            self.release()
            raise
        self._forget_before(slot)
        return True

    def renew(self, now: float) -> None:
        """Hold the slot of ``now`` and the next one too (taken before it begins, no one
        else can take it)."""
        slot = self._slot(now)
        for leased in (slot, slot + 1):
            if self._path(leased) in self.held:
                continue
            try:
                self._create(leased)
            except FileExistsError:
                if leased not in self.lost:
                    self.lost.append(leased)
                log.error(
                    "lease %s is held by another holder: the work it guards may now run twice at once "
                    "(was this process paused for a whole slot of %s s?)",
                    self._path(leased),
                    self.slot_s,
                )

    def release(self) -> None:
        """Delete the leases this holder took (one that cannot be deleted lapses in two slots)."""
        for path in self.held:
            try:
                self.store.fs.rm(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not delete lease %s (it lapses within two slots): %s", path, exc)
        self.held = []

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Renew the lease on a thread while the body runs, and release it after; raise
        :class:`LeaseLost` after a body that completed when a renewal found a slot taken (the
        work cannot be stopped midway, but must not end as if it had been alone)."""
        stop = threading.Event()
        self.lost = []

        def renewing() -> None:
            while not stop.wait(self.slot_s / 3):
                try:
                    self.renew(time.time())
                except Exception as exc:  # the next round tries again, a third of a slot on
                    log.warning("could not renew lease %s: %s", self.folder, exc)

        thread = threading.Thread(target=renewing, name="lease-renewal", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.release()
        if self.lost:
            raise LeaseLost(
                f"lease {self.folder}: slot {self.lost[0]} was taken by another holder while this one's work "
                f"ran (was this process paused for a whole slot of {self.slot_s} s?): the work it guards "
                "may have run twice at once"
            )

    def _slot(self, now: float) -> int:
        return int(now // self.slot_s)

    def _path(self, slot: int) -> str:
        return posixpath.join(self.folder, str(slot))

    def _create(self, slot: int) -> None:
        path = self._path(slot)
        while True:
            try:
                self.store.create_exclusive(path, self.holder)
                break
            except FileExistsError:
                try:
                    held_by = self.store.fs.cat_file(path)
                except FileNotFoundError:  # its holder released it since: create it again
                    continue
                # a create retried after its reply was lost finds the lease it made
                if held_by != self.holder:
                    raise
                break
            except Exception:
                # one that got no reply at all may have made it: raised, the take would leave it
                # held by no one, every take refused until it lapsed
                with contextlib.suppress(Exception):
                    if self.store.fs.cat_file(path) == self.holder:
                        break
                raise
        self.held.append(path)

    def _forget_before(self, slot: int) -> None:
        fs = self.store.fs
        try:
            for path in fs.ls(self.folder, detail=False, refresh=True):
                name = posixpath.basename(path)
                if name.isdigit() and int(name) < slot:
                    fs.rm(path)
        except OSError as exc:  # old leases are only clutter
            log.info("could not delete old leases in %s: %s", self.folder, exc)
