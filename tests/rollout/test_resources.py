"""CPU manager (cores granted per action and reclaimed) and reward-service LRU manager."""

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollout import resources
from rollout.resources import CpuManager, ServiceManager, state_bytes
from rollout.scheduler import ActionScheduler, ResourceRequest

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@needs_two_cores
def test_cores_granted_at_execution_and_reclaimed_after(child):
    cores = sorted(os.sched_getaffinity(0))[:2]
    cpu = CpuManager(cores, parking={cores[0]})
    sched = ActionScheduler({"cpu": 2}, cpu=cpu)

    async def main():
        cpu.park(child.pid)
        assert cpu.affinity(child.pid) == {cores[0]}
        async with sched.run(ResourceRequest(elastic="cpu", max_units=2, duration=1), pid=child.pid) as grant:
            assert grant.cores == frozenset(cores)
            assert cpu.affinity(child.pid) == frozenset(cores)
            assert cpu.available == frozenset()
        assert cpu.affinity(child.pid) == {cores[0]}
        assert cpu.available == frozenset(cores)
        assert sched.policy.free == [2.0]
        async with sched.run(ResourceRequest(demand={"cpu": 1}, duration=1), pid=child.pid) as grant:
            assert len(grant.cores) == 1
            assert cpu.affinity(child.pid) == grant.cores
            assert cpu.available == frozenset(cores) - grant.cores

    asyncio.run(main())
    assert cpu.available == frozenset(cores)


@needs_two_cores
@pytest.mark.parametrize("ending", ["raises", "cancelled"])
def test_cores_are_reclaimed_and_the_process_parked_when_its_action_fails_or_is_cancelled(child, ending):
    cores = sorted(os.sched_getaffinity(0))[:2]
    cpu = CpuManager(cores, parking={cores[0]})
    sched = ActionScheduler({"cpu": 2}, cpu=cpu)
    request = ResourceRequest(elastic="cpu", max_units=2, duration=1)

    async def action(running):
        async with sched.run(request, pid=child.pid) as grant:
            assert cpu.affinity(child.pid) == grant.cores == frozenset(cores)
            running.set()
            if ending == "raises":
                raise RuntimeError("the tool failed")
            await asyncio.Event().wait()

    async def main():
        cpu.park(child.pid)
        running = asyncio.Event()
        task = asyncio.create_task(action(running))
        await running.wait()
        if ending == "cancelled":
            task.cancel()
        with pytest.raises(RuntimeError if ending == "raises" else asyncio.CancelledError):
            await task
        assert cpu.affinity(child.pid) == {cores[0]}
        assert cpu.available == frozenset(cores) and sched.policy.free == [2.0]

    asyncio.run(asyncio.wait_for(main(), 30))


@needs_two_cores
def test_a_child_forked_while_the_tree_is_walked_runs_on_the_granted_cores(monkeypatch):
    """The process forks right after the walk read its children, before it is moved (bwrap
    starting the interpreter as the first action is bound): its child, which inherited the
    old cores, is found by the next walk and moved too."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; sys.stdin.read(1); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)",
        ],
        stdin=subprocess.PIPE,
    )
    walk = resources._tree_threads
    walks: list[list[int]] = []

    def walk_then_fork(pid: int) -> list[int]:
        walks.append(walk(pid))
        if len(walks) == 1:  # the parent forks its child now, with its cores not yet moved
            parent.stdin.write(b"x")
            parent.stdin.flush()
            while len(walk(pid)) == len(walks[0]):
                time.sleep(0.01)
        return walks[-1]

    monkeypatch.setattr(resources, "_tree_threads", walk_then_fork)
    try:
        CpuManager(cores, parking={cores[0]}).bind(parent.pid, {cores[1]})
        tree = walk(parent.pid)
        assert len(tree) > len(walks[0]), "the child was forked"
        assert {frozenset(os.sched_getaffinity(tid)) for tid in tree} == {frozenset({cores[1]})}
    finally:
        for pid in walk(parent.pid)[::-1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        parent.wait()
        parent.stdin.close()


def test_a_grant_is_released_when_parking_fails(child):
    """Parking on cores the worker may not use fails (EINVAL): the grant and its cores go back all the same."""
    core = min(os.sched_getaffinity(0))
    cpu = CpuManager({core}, parking={4095})
    sched = ActionScheduler({"cpu": 1}, cpu=cpu)

    async def main():
        with pytest.raises(OSError):
            async with sched.run(ResourceRequest(demand={"cpu": 1}, duration=1), pid=child.pid):
                assert cpu.affinity(child.pid) == {core}
        assert cpu.available == {core}
        assert sched.policy.free == [1.0]
        async with sched.run(ResourceRequest(demand={"cpu": 1}, duration=1)) as grant:
            assert grant.cores == {core}

    asyncio.run(asyncio.wait_for(main(), 30))


@needs_two_cores
@pytest.mark.skipif(os.geteuid() != 0, reason="runs the worker as another user, which needs root")
def test_a_thread_the_worker_may_not_move_is_skipped_and_keeps_its_cores(child):
    """A worker that is not root binding a process of another user (a setuid program an
    action started): the thread keeps its cores, and bind neither raises nor hangs."""
    before = os.sched_getaffinity(child.pid)
    read_end, write_end = os.pipe()
    worker = os.fork()
    if worker == 0:  # the worker: drops to nobody, then binds the root-owned child
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            logged = []
            handler = logging.Handler()
            handler.emit = lambda record: logged.append(record.getMessage())
            logging.getLogger("rollout.resources").addHandler(handler)
            logging.getLogger("rollout.resources").setLevel(logging.INFO)
            CpuManager(before).bind(child.pid, {min(before)})
            os.write(write_end, "\n".join(logged).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end) as source:
        logged = source.read()
    _, status = os.waitpid(worker, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert f"cannot move thread {child.pid} of process {child.pid}" in logged
    assert os.sched_getaffinity(child.pid) == before


def test_a_fractional_core_demand_is_refused_at_the_call_and_the_scheduler_keeps_serving():
    core = min(os.sched_getaffinity(0))
    cpu = CpuManager({core})
    sched = ActionScheduler({"cpu": 1}, cpu=cpu)

    async def main():
        with pytest.raises(ValueError, match="grants whole cores"):
            await sched.acquire(ResourceRequest(demand={"cpu": 0.5}, duration=1))
        async with sched.run(ResourceRequest(demand={"cpu": 1}, duration=1)) as grant:
            assert grant.cores == {core}
        assert cpu.available == {core} and sched.policy.free == [1.0]

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_parking_cores_are_granted_last():
    """Parked sandboxes sit on the parking core between actions (with whatever they left
    running): an action is granted free cores off it first, and it only when nothing else is free."""
    cpu = CpuManager({0, 1, 2}, parking={0})
    assert cpu.allocate(1) == {1}
    assert cpu.allocate(1) == {2}
    assert cpu.allocate(1) == {0}
    cpu.free({0, 2})
    assert cpu.allocate(2) == {0, 2}
    assert CpuManager({5, 3, 7}).parking == {3}, "by default sandboxes park on the lowest core"


def test_cpu_manager_rejects_bad_use():
    cpu = CpuManager({0})
    with pytest.raises(ValueError, match="needs n >= 1, got 0"):
        cpu.allocate(0)
    with pytest.raises(ValueError, match="only 1 of 1 cores free"):
        cpu.allocate(2)
    cores = cpu.allocate(1)
    cpu.free(cores)
    with pytest.raises(ValueError, match="already free"):
        cpu.free(cores)
    with pytest.raises(ValueError, match="not in the pool"):
        cpu.free({7})
    with pytest.raises(ValueError, match="capacity"):
        ActionScheduler({"cpu": 3}, cpu=cpu)


def make_service(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


SERVICE_BYTES = (16 * 16 + 16 + 16 + 1) * 4


def test_services_lru_eviction_order_and_outputs_survive_parking():
    x = torch.randn(3, 16)
    expected = {name: make_service(seed)(x) for seed, name in enumerate("abc")}
    manager = ServiceManager(device="cpu", budget_bytes=2 * SERVICE_BYTES)
    for seed, name in enumerate("abc"):
        manager.register(name, make_service(seed))
    assert manager.resident == []

    async def call(name):
        async with manager.use(name) as module:
            assert next(module.parameters()).device.type == "cpu"
            torch.testing.assert_close(module(x), expected[name])

    async def main():
        for name in "aba":
            await call(name)
        assert manager.resident == ["b", "a"]
        await call("c")  # b is least recently used
        assert manager.evictions == ["b"]
        assert manager.resident == ["a", "c"]
        await call("b")  # now a is
        assert manager.evictions == ["b", "a"]
        assert manager.resident == ["c", "b"]
        assert manager.loads == ["a", "b", "c", "b"]
        assert manager.reloads == 1  # b's second load
        await call("a")  # c is least recently used
        assert manager.reloads == 2
        assert manager.used_bytes <= manager.budget_bytes

    asyncio.run(main())
    evicted = manager._modules["c"]
    assert next(evicted.parameters()).device.type == "meta"


class TiedService(torch.nn.Module):
    """Input and output embeddings that are one tensor, as T5's and BART's sequence
    classifiers tie their encoder's and decoder's embeddings to a shared one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(8, 4)
        self.out = torch.nn.Linear(4, 8, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(self.embed(ids))


def test_a_service_with_tied_weights_loads_them_tied_every_time():
    """Moving a module to ``meta`` and back unties what it shares: the load then looked for
    the second name's parked copy (KeyError, every call of such a reward model failed) and
    would have put the tensor on the device twice, past the bytes budgeted for it."""
    ids = torch.arange(8)
    expected = TiedService()(ids)
    manager = ServiceManager(device="cpu", budget_bytes=8 * 4 * 4)
    manager.register("tied", TiedService())
    manager.register("other", TiedService())

    async def main():
        for name in ("tied", "other", "tied"):  # each load evicts the other
            async with manager.use(name) as module:
                assert module.out.weight is module.embed.weight
                torch.testing.assert_close(module(ids), expected)
        assert manager.evictions == ["tied", "other"]

    asyncio.run(main())


class _DeviceBytes(TorchDispatchMode):
    """Counts the bytes of the empty tensors made on ``device`` (a load's allocations)."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (
            torch.ops.aten.empty_like,
            torch.ops.aten.empty,
            torch.ops.aten.empty_strided,
        ):
            self.bytes += out.nbytes if out.device == self.device else 0
        return out


def test_a_tied_tensor_is_put_on_the_device_once_per_load(monkeypatch):
    """The load materialised each name of a tied tensor apart (a module moved to ``meta``
    holds one copy per name) and tied them after: a BART or T5 reward model took its shared
    embedding two or three times over on the device, past the bytes budgeted for it, for the
    length of the load."""
    manager = ServiceManager(device="cpu", budget_bytes=8 * 4 * 4)
    manager.register("tied", TiedService())
    real = manager._copy_in
    counted = []

    def copy_in(*args):
        with _DeviceBytes(manager.device) as allocated:
            real(*args)
        counted.append(allocated.bytes)

    monkeypatch.setattr(manager, "_copy_in", copy_in)

    async def main():
        async with manager.use("tied") as module:
            assert module.out.weight is module.embed.weight
            torch.testing.assert_close(module(torch.arange(8)), TiedService()(torch.arange(8)))

    asyncio.run(main())
    assert counted == [state_bytes(TiedService())] == [manager.budget_bytes]


def test_a_service_is_last_used_when_its_call_ends():
    """A long call to ``a`` begins before a short call to ``b`` and ends after it: ``b`` is
    the least recently used, so ``c`` evicts it. Ordered by when calls began, ``a`` was
    evicted the moment its call was done, while it was the one just used."""
    manager = ServiceManager(device="cpu", budget_bytes=2 * SERVICE_BYTES)
    for seed, name in enumerate("abc"):
        manager.register(name, make_service(seed))

    async def main():
        done_with_a, caller = await _held(manager, "a")
        async with manager.use("b"):
            pass
        done_with_a.set()
        await caller
        assert manager.resident == ["b", "a"]
        async with manager.use("c"):
            pass
        assert manager.evictions == ["b"] and manager.resident == ["a", "c"]

    asyncio.run(main())


def test_a_long_lived_manager_keeps_only_the_latest_names_of_its_swaps():
    """Two services that fit one at a time, called in turn: every call swaps. However many
    swaps, the manager holds the latest ``RECENT_SWAPS`` names."""
    manager = ServiceManager(device="cpu", budget_bytes=SERVICE_BYTES)
    for seed, name in enumerate("ab"):
        manager.register(name, make_service(seed))
    called = ["ab"[i % 2] for i in range(3 * resources.RECENT_SWAPS + 1)]

    async def main():
        for name in called:
            async with manager.use(name):
                pass

    asyncio.run(main())
    assert manager.loads == called[-resources.RECENT_SWAPS :]
    assert manager.evictions == called[:-1][-resources.RECENT_SWAPS :]
    assert len(manager._recent_loads) == len(manager._recent_evictions) == resources.RECENT_SWAPS


def test_in_use_service_is_never_evicted():
    manager = ServiceManager(device="cpu", budget_bytes=SERVICE_BYTES)
    manager.register("a", make_service(0))
    manager.register("b", make_service(1))

    async def main():
        order = []
        async with manager.use("a"):
            other = asyncio.ensure_future(_use(manager, "b", order))
            await asyncio.sleep(0.01)
            assert order == [] and manager.resident == ["a"]
            order.append("a done")
        await other
        assert order == ["a done", "b"]
        assert manager.evictions == ["a"]

    asyncio.run(main())


def test_a_service_that_needs_room_is_not_starved_by_steady_calls_to_resident_ones():
    """``a`` and ``b`` fill the budget and are called back to back, overlapping, so one is
    always in use: ``c`` arrived while they ran and is served next, evicting the idle one,
    rather than waiting for a moment when both are idle at once."""
    manager = ServiceManager(device="cpu", budget_bytes=2 * SERVICE_BYTES)
    for seed, name in enumerate("abc"):
        manager.register(name, make_service(seed))

    async def main():
        stop = asyncio.Event()

        async def steady(name):
            while not stop.is_set():
                async with manager.use(name):
                    await asyncio.sleep(0.01)

        callers = [asyncio.ensure_future(steady("a"))]
        await asyncio.sleep(0.005)
        callers.append(asyncio.ensure_future(steady("b")))
        await asyncio.sleep(0.02)
        async with asyncio.timeout(5):
            async with manager.use("c"):
                assert "c" in manager.resident and manager.used_bytes <= manager.budget_bytes
        stop.set()
        await asyncio.gather(*callers)

    asyncio.run(main())


def test_a_call_to_a_resident_service_waits_behind_an_earlier_caller_waiting_for_room():
    """``a`` and ``b`` are in use and fill the budget; ``c`` waits for room. A second call to
    ``a`` arriving after it is served after it, though ``a`` is resident: otherwise steady
    calls to ``a`` would keep it in use, and ``c`` waiting, for ever."""
    manager = ServiceManager(device="cpu", budget_bytes=2 * SERVICE_BYTES)
    for seed, name in enumerate("abc"):
        manager.register(name, make_service(seed))

    async def main():
        served = []
        release_b = asyncio.Event()

        async def call(name, label, until=None):
            async with manager.use(name):
                served.append(label)
                if until is not None:
                    await until.wait()

        holding_a = asyncio.Event()
        first_a = asyncio.ensure_future(call("a", "a1", holding_a))
        held_b = asyncio.ensure_future(call("b", "b", release_b))
        while len(served) < 2:
            await asyncio.sleep(0)
        waiting_c = asyncio.ensure_future(call("c", "c"))
        for _ in range(10):
            await asyncio.sleep(0)
        second_a = asyncio.ensure_future(call("a", "a2"))
        for _ in range(10):
            await asyncio.sleep(0)
        assert served == ["a1", "b"], "the second call to a waits behind c"
        release_b.set()
        await asyncio.wait_for(asyncio.gather(held_b, waiting_c, second_a), 30)
        holding_a.set()
        await first_a
        return served

    assert asyncio.run(main()) == ["a1", "b", "c", "a2"]


class ScaledByABuffer(torch.nn.Module):
    """A module whose output depends on a non-persistent buffer (as a rotary table is)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)
        self.register_buffer("scale", torch.arange(1.0, 5.0), persistent=False)

    def forward(self, x):
        return self.linear(x) * self.scale


def test_a_services_buffers_are_parked_and_loaded_with_its_parameters():
    torch.manual_seed(0)
    module = ScaledByABuffer()
    x = torch.randn(3, 16)
    expected = module(x)
    manager = ServiceManager(device="cpu", budget_bytes=10_000)
    manager.register("scaled", module)

    async def main():
        async with manager.use("scaled") as loaded:
            return loaded(x)

    torch.testing.assert_close(asyncio.run(main()), expected, rtol=0, atol=0)
    assert manager.used_bytes == (16 * 4 + 4 + 4) * 4
    assert state_bytes(ScaledByABuffer().half()) == (16 * 4 + 4 + 4) * 2


def test_room_that_in_use_services_block_evicts_nothing():
    """``c`` needs both slots while ``a`` is in use: ``b`` (idle) stays resident until ``c``
    can really load, instead of being evicted for nothing."""
    manager = ServiceManager(device="cpu", budget_bytes=3 * SERVICE_BYTES)
    for seed, name in enumerate("ab"):
        manager.register(name, make_service(seed))
    manager.register("c", torch.nn.Linear(16, 40, bias=False))  # fits beside neither a nor b

    async def main():
        async with manager.use("b"):
            pass
        async with manager.use("a"):
            waiting = asyncio.ensure_future(_use(manager, "c", []))
            await asyncio.sleep(0.01)
            assert manager.resident == ["b", "a"] and manager.evictions == []
        await asyncio.wait_for(waiting, 5)
        assert sorted(manager.evictions) == ["a", "b"]

    asyncio.run(main())


async def _use(manager, name, order):
    async with manager.use(name):
        order.append(name)


async def _held(manager, name) -> tuple[asyncio.Event, asyncio.Future]:
    """A call to ``name`` that keeps it in use until the event is set; returns once it is
    resident, with the event and the call."""
    done = asyncio.Event()

    async def hold():
        async with manager.use(name):
            await done.wait()

    caller = asyncio.ensure_future(hold())
    while name not in manager.resident:
        await asyncio.sleep(0)
    return done, caller


def test_a_failed_load_leaves_nothing_held_and_concurrent_calls_of_one_service_load_it_once(monkeypatch):
    """``b``'s first load fails (the device ran out): its caller gets the error, ``b`` is not
    resident and holds no bytes, and the next call loads it whole. Five calls of ``a`` at once
    share one load."""
    x = torch.randn(3, 16)
    expected = make_service(1)(x)
    manager = ServiceManager(device="cpu", budget_bytes=SERVICE_BYTES)
    for seed, name in enumerate("ab"):
        manager.register(name, make_service(seed))
    real = manager._copy_in
    failures = [RuntimeError("out of device memory")]

    def copy_in(module, *rest):
        if failures:
            module.to_empty(device=manager.device)  # fails part-way, its memory taken
            raise failures.pop()
        real(module, *rest)

    monkeypatch.setattr(manager, "_copy_in", copy_in)

    async def main():
        with pytest.raises(RuntimeError, match="out of device memory"):
            async with manager.use("b"):
                pass
        assert manager.resident == [] and manager.used_bytes == 0 and manager.loads == []
        assert next(manager._modules["b"].parameters()).device.type == "meta"
        async with manager.use("b") as module:
            torch.testing.assert_close(module(x), expected)
        order = []
        await asyncio.gather(*(_use(manager, "a", order) for _ in range(5)))
        assert order == ["a"] * 5
        assert manager.loads == ["b", "a"] and manager.evictions == ["b"]
        assert manager.used_bytes <= manager.budget_bytes

    asyncio.run(asyncio.wait_for(main(), 30))


def test_service_manager_errors():
    with pytest.raises(ValueError, match="budget_bytes"):
        ServiceManager(device="cpu")
    with pytest.raises(ValueError, match="budget_bytes must be > 0, got 0"):
        ServiceManager(device="cpu", budget_bytes=0)
    manager = ServiceManager(device="cpu", budget_bytes=100)
    with pytest.raises(ValueError, match="more than the budget"):
        manager.register("big", make_service(0))

    async def main():
        async with manager.use("nope"):
            pass

    with pytest.raises(KeyError, match="unknown service 'nope'"):
        asyncio.run(main())


def slow_copies(manager, monkeypatch, seconds=0.3):
    """Each load of ``manager`` takes ``seconds`` more, as a copy of gigabytes onto a GPU does."""
    real = manager._copy_in

    def slow(*args):
        time.sleep(seconds)
        real(*args)

    monkeypatch.setattr(manager, "_copy_in", slow)


def test_a_slow_load_leaves_the_event_loop_to_the_other_sessions(monkeypatch):
    manager = ServiceManager(device="cpu", budget_bytes=SERVICE_BYTES)
    manager.register("a", make_service(0))
    slow_copies(manager, monkeypatch)
    ticks = []

    async def other_session():
        while True:
            await asyncio.sleep(0.01)
            ticks.append(None)

    async def main():
        ticker = asyncio.ensure_future(other_session())
        async with manager.use("a"):
            assert ticks, "the event loop was held while the service loaded"
        ticker.cancel()

    asyncio.run(main())
    assert manager.loads == ["a"]


def test_a_caller_cancelled_while_its_service_loads_leaves_it_loaded_whole(monkeypatch):
    x = torch.randn(3, 16)
    expected = make_service(0)(x)
    manager = ServiceManager(device="cpu", budget_bytes=SERVICE_BYTES)
    manager.register("a", make_service(0))
    slow_copies(manager, monkeypatch)

    async def main():
        loading = asyncio.ensure_future(_use(manager, "a", []))
        await asyncio.sleep(0.05)
        loading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loading
        assert manager.resident == ["a"] and manager.loads == ["a"]
        async with manager.use("a") as module:
            torch.testing.assert_close(module(x), expected)
        assert manager.loads == ["a"], "loaded once"

    asyncio.run(main())


def test_a_caller_cancelled_while_it_gives_its_service_back_leaves_it_evictable(monkeypatch):
    """``a``'s caller is done with it and waits for the lock a slow load of ``b`` holds when a
    cancel arrives: ``a`` is still given back, so the next load evicts it (the least recently
    used), not ``b``."""
    manager = ServiceManager(device="cpu", budget_bytes=2 * SERVICE_BYTES)
    for seed, name in enumerate("abc"):
        manager.register(name, make_service(seed))
    copying, go_on = threading.Event(), threading.Event()
    real = manager._copy_in

    def held_copy(*args):
        copying.set()
        go_on.wait(10)
        real(*args)

    async def main():
        done_with_a, caller = await _held(manager, "a")
        monkeypatch.setattr(manager, "_copy_in", held_copy)
        loading = asyncio.ensure_future(_use(manager, "b", []))
        while not copying.is_set():
            await asyncio.sleep(0.001)
        done_with_a.set()
        for _ in range(5):  # the caller leaves its body and waits for the lock
            await asyncio.sleep(0)
        caller.cancel()
        go_on.set()
        await loading
        with pytest.raises(asyncio.CancelledError):
            await caller
        monkeypatch.setattr(manager, "_copy_in", real)
        async with manager.use("c"):
            pass
        assert manager.evictions == ["a"]

    asyncio.run(main())


def test_a_services_load_is_inside_a_wait_for_the_device(monkeypatch):
    """The copy onto the device (seconds for a model of gigabytes) ran outside every
    ``waiting()`` scope, so a rollout's clock charged it to its budget as the model's own
    work; the caller waits for it as it waits for room, and the scope now holds it."""
    manager = ServiceManager(device="cpu", budget_bytes=SERVICE_BYTES)
    manager.register("a", make_service(0))
    events = []
    real = manager._copy_in

    def copy_in(*args):
        events.append("load")
        real(*args)

    @contextlib.contextmanager
    def waiting():
        events.append("wait")
        try:
            yield
        finally:
            events.append("end")

    monkeypatch.setattr(manager, "_copy_in", copy_in)

    async def main():
        async with manager.use("a", waiting):
            events.append("body")

    asyncio.run(main())
    load, body = events.index("load"), events.index("body")
    assert events[:load].count("wait") == events[:load].count("end") + 1, events
    assert "body" not in events[:load] and events[:body].count("wait") == events[:body].count("end"), events
