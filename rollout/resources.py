"""Resource managers behind the action scheduler (ARL-Tangram's CPU and GPU managers).

``CpuManager`` allocates on execution: a sandbox process keeps its memory between actions
but runs on granted cores only while an action runs (``sched_setaffinity`` of every thread
of the process and its descendants), then is parked back on a small parking set and the
cores return to the pool. Pinning is cooperative: a command may widen its own affinity
again, and a job that left the process tree is not reached (see ``docs/sandboxes.md``).

``ServiceManager`` evicts on execution: reward-model services stay parked in CPU memory as
copies of their tensors and are loaded onto the device when called, evicting the least
recently used idle services while the device-memory budget would be exceeded.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext

import torch

log = logging.getLogger(__name__)


BIND_WALKS = 8
"""Most walks of a process tree per bind (each moves what the ones before did not find)."""


def _tree_threads(pid: int) -> list[int]:
    """Thread ids of process ``pid`` and of all its descendants (a sandbox wraps its shell in bwrap).

    Only the tree is walked: finding a job that double-forked out of it (by the sandbox's uid)
    would scan all of ``/proc`` twice per action on the event loop."""
    tids: list[int] = []
    todo = [pid]
    while todo:
        proc = todo.pop()
        try:
            threads = os.listdir(f"/proc/{proc}/task")
        except FileNotFoundError:
            continue
        for tid in threads:
            tids.append(int(tid))
            try:
                with open(f"/proc/{proc}/task/{tid}/children") as handle:
                    todo.extend(int(child) for child in handle.read().split())
            except FileNotFoundError:
                continue
    return tids


class CpuManager:
    """A pool of core ids granted to actions and reclaimed after.

    Args:
        cores: the cores this manager hands out (default: this process's affinity).
        parking: cores a sandbox sits on between actions (default: the lowest pool core).
    """

    def __init__(
        self,
        cores: Iterable[int] | None = None,
        parking: Iterable[int] | None = None,
    ):
        self.pool = frozenset(os.sched_getaffinity(0) if cores is None else cores)
        if not self.pool:
            raise ValueError("CpuManager needs at least one core")
        self.parking = frozenset(parking) if parking is not None else frozenset({min(self.pool)})
        if not self.parking:
            raise ValueError("CpuManager parking set must not be empty")
        self._free = set(self.pool)

    @property
    def available(self) -> frozenset[int]:
        """Cores not granted to any action."""
        return frozenset(self._free)

    def allocate(self, n: int) -> frozenset[int]:
        """Take ``n`` free cores: the parking cores last (every parked sandbox shares them), then
        lowest ids first."""
        if n < 1:
            raise ValueError(f"CpuManager.allocate needs n >= 1, got {n}")
        if n > len(self._free):
            raise ValueError(
                f"CpuManager.allocate({n}): only {len(self._free)} of {len(self.pool)} cores free"
            )
        cores = frozenset(sorted(self._free, key=lambda core: (core in self.parking, core))[:n])
        self._free -= cores
        return cores

    def free(self, cores: Iterable[int]) -> None:
        """Return cores to the pool."""
        cores = set(cores)
        if not cores <= self.pool:
            raise ValueError(f"CpuManager.free: cores {sorted(cores - self.pool)} are not in the pool")
        if cores & self._free:
            raise ValueError(f"CpuManager.free: cores {sorted(cores & self._free)} are already free")
        self._free |= cores

    def bind(self, pid: int, cores: Iterable[int]) -> None:
        """Run process ``pid``, all its threads and descendants, on ``cores`` only.

        What it forks later inherits the cores. A thread that exits meanwhile is skipped, and so
        is one this worker may not move (a setuid program the action started, when the worker
        is not root): it keeps the cores it had.
        """
        cores = frozenset(cores)
        # A process that forks after the walk read its children but before it is moved hands
        # its old cores to the child (bwrap still starting the interpreter when the first
        # action is bound): walk again until a walk finds nothing not moved yet; what forks
        # from a moved process inherits the cores. Bounded, so a fork loop in the sandbox
        # cannot hold the event loop.
        moved: set[int] = set()
        for _ in range(BIND_WALKS):
            new = [tid for tid in _tree_threads(pid) if tid not in moved]
            if not new:
                return
            for tid in new:
                moved.add(tid)
                try:
                    os.sched_setaffinity(tid, cores)
                except ProcessLookupError:
                    continue
                except PermissionError:
                    log.info("cannot move thread %d of process %d onto cores %s", tid, pid, sorted(cores))

    def park(self, pid: int) -> None:
        """Move process ``pid`` back to the parking cores between actions."""
        self.bind(pid, self.parking)

    def affinity(self, pid: int) -> frozenset[int]:
        """The cores process ``pid`` may run on now."""
        return frozenset(os.sched_getaffinity(pid))


RECENT_SWAPS = 64
"""Names of the latest loads and evictions a :class:`ServiceManager` keeps (``loads``,
``evictions``)."""


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer, non-persistent buffers included (rotary tables are not in
    a state dict, yet a module moved to ``meta`` loses them too)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def _ties(module: torch.nn.Module) -> list[tuple[str, str]]:
    """Each parameter or buffer name that holds a tensor named before it (tied embeddings:
    T5's, BART's), with that first name: a move to ``meta`` and back unties them."""
    first: dict[int, str] = {}
    ties = []
    for name, tensor in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            ties.append((name, owner))
    return ties


def _tie(module: torch.nn.Module, ties: list[tuple[str, str]]) -> None:
    """Make each tied name hold its owner's tensor again."""
    for name, owner in ties:
        holder, _, leaf = name.rpartition(".")
        submodule = module.get_submodule(holder)
        shared = module.get_parameter if leaf in submodule._parameters else module.get_buffer
        setattr(submodule, leaf, shared(owner))


def state_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers: what it holds on a device."""
    return sum(t.numel() * t.element_size() for _, t in _tensors(module))


class ServiceManager:
    """Reward-model services loaded onto a device on demand, LRU-evicted under a memory budget.

    On a CUDA machine the device is the GPU and the default budget is its free memory;
    on CPU the "device" is CPU memory under a configured budget (``budget_bytes`` required).
    Parked services keep CPU copies of their parameters and buffers; loading materialises
    the module on the device from them, evicting moves the module to the ``meta`` device so
    its memory is freed. Callers are served in arrival order: one whose service is resident
    never overtakes an earlier caller waiting for room, so a service that needs others
    evicted is not starved by steady calls to them.

    ``loads`` and ``evictions`` name the latest :data:`RECENT_SWAPS` services loaded and
    evicted, oldest first (a long-lived rollout service swaps without end); ``reloads``
    counts the loads of a service evicted before, the cost of a budget that holds fewer
    than all of them.
    """

    def __init__(self, device: str | None = None, budget_bytes: int | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if budget_bytes is None:
            if self.device.type != "cuda":
                raise ValueError("ServiceManager on CPU needs budget_bytes (the emulated device memory)")
            budget_bytes = torch.cuda.mem_get_info(self.device)[0]
        if budget_bytes <= 0:
            raise ValueError(f"ServiceManager budget_bytes must be > 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._modules: dict[str, torch.nn.Module] = {}
        self._parked: dict[str, dict[str, torch.Tensor]] = {}
        self._sizes: dict[str, int] = {}
        self._ties: dict[str, list[tuple[str, str]]] = {}
        self._resident: OrderedDict[str, None] = OrderedDict()
        self._in_use: dict[str, int] = {}
        self._changed = asyncio.Condition()
        self._arrivals: deque[object] = deque()
        self._recent_loads: deque[str] = deque(maxlen=RECENT_SWAPS)
        self._recent_evictions: deque[str] = deque(maxlen=RECENT_SWAPS)
        self._loaded_before: set[str] = set()
        self.reloads = 0

    def register(self, name: str, module: torch.nn.Module) -> None:
        """Park ``module`` in CPU memory under ``name``."""
        if name in self._modules:
            raise ValueError(f"service {name!r} is already registered")
        size = state_bytes(module)
        if size > self.budget_bytes:
            raise ValueError(f"service {name!r} needs {size} bytes, more than the budget {self.budget_bytes}")
        pin = self.device.type == "cuda"
        self._ties[name] = _ties(module)
        parked = {}
        for key, tensor in _tensors(module):
            copy = tensor.detach().to("cpu", copy=True)
            parked[key] = copy.pin_memory() if pin else copy
        module.to("meta")
        module.eval()
        self._modules[name] = module
        self._parked[name] = parked
        self._sizes[name] = size

    @property
    def resident(self) -> list[str]:
        """Services on the device, least recently used first."""
        return list(self._resident)

    @property
    def loads(self) -> list[str]:
        """The latest services loaded onto the device, oldest first."""
        return list(self._recent_loads)

    @property
    def evictions(self) -> list[str]:
        """The latest services evicted from the device, oldest first."""
        return list(self._recent_evictions)

    @property
    def used_bytes(self) -> int:
        """Device bytes held by resident services."""
        return sum(self._sizes[n] for n in self._resident)

    async def _load(self, name: str) -> None:
        """Materialise ``name`` on the device from its parked copy, on a thread: a copy of
        gigabytes would otherwise hold the event loop, and every session on it, for seconds.
        A caller cancelled meanwhile leaves the copy to finish (the service is then
        resident) before the cancel goes on, so no other load touches a half-copied module."""
        module = self._modules[name]
        copying = asyncio.ensure_future(
            asyncio.to_thread(self._copy_in, module, self._parked[name], self._ties[name])
        )
        try:
            await _to_the_end(copying)
        finally:
            if copying.exception() is None:
                self._resident[name] = None
                self._recent_loads.append(name)
                self.reloads += name in self._loaded_before
                self._loaded_before.add(name)
            else:
                module.to("meta")

    def _copy_in(
        self, module: torch.nn.Module, parked: dict[str, torch.Tensor], ties: list[tuple[str, str]]
    ) -> None:
        # tied on ``meta`` first, then each tensor made once on the device: ``to_empty`` would
        # make one copy per name of a tied tensor, past the bytes budgeted for it
        _tie(module, ties)
        # keyed by id, holding each meta tensor too so that no other object takes its id
        made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def empty(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in made:
                made[id(tensor)] = (tensor, torch.empty_like(tensor, device=self.device))
            return made[id(tensor)][1]

        module._apply(empty)
        _tie(module, ties)
        with torch.no_grad():
            for key, tensor in _tensors(module):
                tensor.copy_(parked[key], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _evict(self, name: str) -> None:
        self._modules[name].to("meta")
        del self._resident[name]
        self._recent_evictions.append(name)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _make_room(self, size: int) -> bool:
        """Evict idle LRU services until ``size`` more bytes fit; False, evicting nothing, if
        in-use services block it."""
        in_use = sum(self._sizes[n] for n in self._resident if self._in_use.get(n))
        if in_use + size > self.budget_bytes:
            return False
        while self.used_bytes + size > self.budget_bytes:
            self._evict(next(n for n in self._resident if not self._in_use.get(n)))
        return True

    @asynccontextmanager
    async def use(
        self, name: str, waiting: Callable[[], AbstractContextManager] = nullcontext
    ) -> AsyncIterator[torch.nn.Module]:
        """The service's module on the device for the body (loaded, and others evicted, as
        needed). ``waiting()`` scopes each wait for the device (for the lock another's load
        holds, for room or for an earlier caller, and for the service's own load): a rollout's
        clock books it as queue time."""
        if name not in self._modules:
            raise KeyError(f"unknown service {name!r}; registered: {sorted(self._modules)}")
        turn = object()
        with waiting():
            await self._changed.acquire()
        try:
            self._arrivals.append(turn)
            try:
                with waiting():
                    while self._arrivals[0] is not turn or (
                        name not in self._resident and not self._make_room(self._sizes[name])
                    ):
                        await self._changed.wait()
                    if name not in self._resident:
                        await self._load(name)
                self._resident.move_to_end(name)
                self._in_use[name] = self._in_use.get(name, 0) + 1
            finally:
                self._arrivals.remove(turn)
                self._changed.notify_all()
        finally:
            self._changed.release()
        try:
            yield self._modules[name]
        finally:
            # given back before the lock is awaited (a load may hold it for seconds): a cancel
            # meanwhile must not leave the service in use, never to be evicted again
            self._in_use[name] -= 1
            self._resident.move_to_end(name)  # last used when its call ends, not when it began
            await _to_the_end(asyncio.ensure_future(self._notify()))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


async def _to_the_end(work: asyncio.Future) -> None:
    """Wait until ``work`` is done, even through a cancel of the caller, which is raised after."""
    cancelled = False
    while not work.done():
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    work.result()
