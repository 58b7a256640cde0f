"""A run-wide quota (e.g. of rollouts), shared by every worker of a run through its storage.

The claims form a chain of objects ``quota/<name>/<k>`` (k = 0, 1, …), each created
exclusively (:meth:`RunStore.create_exclusive`) and holding the total claimed once it is
in (and a random mark of the create that made it, which a create whose reply was lost, then
retried and refused or failed, recognises). A claimant reads the newest link, adds what it
takes (never past the limit) and creates the next link; of two claimants racing for one link
one wins, and the other reads it and tries again. So the workers of a run, running at once or one after
another, restarted or rerun, together never hold more than the limit. A worker gives back
what it did not use (:meth:`RunQuota.release`); one that dies keeps what it held, and the
run falls short by it.

A claimant lists the folder once, then reads forward from the last link it saw: a claim
that meets no other costs one failed read and one create, however long the chain. Links
are never deleted: a claimant that last saw link k creates k + 1 from k's total, and were
k + 1 deleted after others went past it, that create would succeed with a stale total.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import uuid

from storage.config import RunStore


class RunQuota:
    """The quota ``name`` of the run in ``store``, at most ``limit`` held at once."""

    def __init__(self, store: RunStore, name: str, limit: int):
        self.store = store
        self.name = name
        self.folder = store.path("quota", name)
        self.limit = limit
        self._seen: tuple[int, int] | None = None
        """The number and total of the newest link this quota read or created."""

    def claimed(self) -> int:
        """What the run's workers hold now (used, or claimed and not given back)."""
        return self._newest()[1]

    def claim(self, wanted: int, step: int = 1) -> int:
        """Take up to ``wanted`` more, a multiple of ``step``; returns how much was taken
        (0: the limit is reached)."""
        while True:
            index, total = self._newest()
            taken = max(min(wanted, self.limit - total), 0) // step * step
            if taken == 0:
                return 0
            if self._link(index + 1, total + taken):
                return taken

    def release(self, unused: int) -> None:
        """Give back ``unused`` of what this worker took and did not use."""
        while unused > 0:
            index, total = self._newest()
            if self._link(index + 1, max(total - unused, 0)):
                return

    def _newest(self) -> tuple[int, int]:
        """The newest link's number and total ((-1, 0) before the first claim): read forward
        from the last link seen, listed only when none was."""
        index, total = self._listed() if self._seen is None else self._seen
        while True:
            try:
                total = self._read(index + 1)
            except FileNotFoundError:
                self._seen = index, total
                return index, total
            index += 1

    def _listed(self) -> tuple[int, int]:
        """The newest link's number and total as a listing of the folder finds them."""
        try:
            paths = self.store.fs.ls(self.folder, detail=False, refresh=True)
        except FileNotFoundError:
            return -1, 0
        names = [posixpath.basename(path.rstrip("/")) for path in paths]
        links = [int(n) for n in names if n.isdigit()]
        if not links:
            return -1, 0
        index = max(links)
        return index, self._read(index)

    def _read(self, index: int) -> int:
        """The total link ``index`` holds (``FileNotFoundError`` when there is none yet)."""
        return self._parsed(index)["total"]

    def _link(self, index: int, total: int) -> bool:
        """Create link ``index`` holding ``total``; False when another claimant made it first."""
        mark = uuid.uuid4().hex
        try:
            self.store.create_exclusive(
                self._path(index), json.dumps({"total": total, "mark": mark}).encode()
            )
        except FileExistsError:
            # a create retried after its reply was lost finds the link it made: taken or given
            # back twice, the run would fall short, or pass its limit
            return self._made(index, mark)
        except Exception:
            # one that got no reply at all may have made it: a claim that raised then left what
            # it took held by no worker, the run short by it (a release, given back none)
            with contextlib.suppress(Exception):
                return self._made(index, mark)
            raise
        self._seen = index, total
        return True

    def _made(self, index: int, mark: str) -> bool:
        """Whether link ``index`` is the one the create marked ``mark`` made (``FileNotFoundError``
        when there is none)."""
        link = self._parsed(index)
        self._seen = index, link["total"]
        return link.get("mark") == mark

    def _parsed(self, index: int) -> dict:
        """Link ``index``'s object (``FileNotFoundError`` when there is none yet); ``ValueError``
        naming it when it is no link, which no claim can go past: its total is the chain's."""
        payload = self.store.fs.cat_file(self._path(index))
        try:
            link = json.loads(payload)
        except ValueError:
            link = None
        total = link.get("total") if isinstance(link, dict) else None
        if type(total) is not int or total < 0:
            raise ValueError(
                f"quota link {self.store.url('quota', self.name, f'{index:08d}')} "
                f"({len(payload)} bytes) is not a JSON object with a count 'total' >= 0: no claim on "
                "the quota can go past it until it holds the total claimed by then again ('{\"total\": N}')"
            )
        return link

    def _path(self, index: int) -> str:
        return posixpath.join(self.folder, f"{index:08d}")
