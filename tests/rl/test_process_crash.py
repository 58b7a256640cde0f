"""Crash safety of the process stage: processors killed with SIGKILL at random points, each
restarted, leave every raw shard processed exactly once, as one uninterrupted run would."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from rl.process_loop import ShardProcessor
from storage.config import RunStore, StorageConfig
from storage.shards import ShardReader, ShardWriter
from storage.tables import Tables
from tests.rl.test_processor import random_execution
from tests.storage.test_crash import stopped

KILLS = 20

MOMENTS = ["changes", "read", "store", "append shards", "append trajectories", "save"]
"""The operations a processor is killed in (or a little after) at their first or second
occurrence, as its forker announces them:
reading the ``shards`` log, reading a raw shard, writing a processed shard's file, the Delta
commits of its twin and of its ``trajectories`` rows, saving its offset."""

FORKER = textwrap.dedent(
    """
    import json, os, sys, traceback
    import rl.process_loop as process_loop
    from storage.config import RunStore, StorageConfig
    from storage.shards import ShardReader, ShardWriter
    from storage.status import ProcessOffsetBoard
    from storage.tables import Tables

    def say(line):
        # one write, so that the forker's lines and its processor's never interleave
        os.write(1, f"{line}\\n".encode())

    def announced(cls, name, what):
        real = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            say(what(*args))
            return real(self, *args, **kwargs)

        setattr(cls, name, wrapper)

    announced(Tables, "changes", lambda name, *_: f"changes {name}")
    announced(ShardReader, "read", lambda shard: f"read {shard.shard_id}")
    announced(ShardWriter, "_store", lambda table, seq, exclusive: f"store {seq}")
    announced(Tables, "append", lambda name, *_: f"append {name}")
    announced(ProcessOffsetBoard, "publish", lambda offset: f"save {offset.offset}")

    def process_until_done(config, run_id):
        processor = process_loop.ShardProcessor(RunStore(StorageConfig(**config), run_id))
        while processor.poll():
            pass
        processor.save()

    config, run_id = json.loads(sys.argv[1])
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                process_until_done(config, run_id)
                code = 0
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        say(f"processor {pid}")
        _, status = os.waitpid(pid, 0)
        say(f"ended {os.waitstatus_to_exitcode(status)}")
    """
)
"""Forks one processor per line of stdin from a process that imported the modules once: each
polls until no raw shard is left and saves its offset (as a ``process-pending`` pass does),
exiting 0, unless killed; it announces on stdout each storage operation it begins."""


def commit_wave(writers: dict[tuple[RunStore, str], ShardWriter], stores: list[RunStore], wave: int) -> None:
    """Two raw shards of three branching executions each (some exact retries), the same in
    each store; by worker ``w0`` or ``w1``, whose writers ``writers`` keeps from wave to wave
    (a new one would read the whole ``shards`` log for its next number)."""
    worker = f"w{wave % 2}"
    for shard in range(2):
        rng = np.random.default_rng(100 * wave + shard)
        records = []
        for execution in range(3):
            records += random_execution(rng, f"s{wave}-{shard}x{execution}", int(rng.integers(1, 5)))
        for store in stores:
            if (store, worker) not in writers:
                writers[(store, worker)] = ShardWriter(store, worker, flush_records=10**6)
            writers[(store, worker)].write_many(records)
            assert writers[(store, worker)].flush() is not None


def life(forker: subprocess.Popen, kill_in: str | None, nth: int, delay_s: float) -> str:
    """Run one processor; SIGKILL it ``delay_s`` after it begins its ``nth`` operation
    ``kill_in`` (one of :data:`MOMENTS`; None: never). Returns the forker's ``ended <exit
    code>`` line: a processor that finishes first exits 0."""
    forker.stdin.write("go\n")
    forker.stdin.flush()
    pid, seen = None, 0
    # the forker names the processor while it runs: some of its operations may come first
    while not (line := forker.stdout.readline().strip()).startswith("ended"):
        assert line, stopped(forker)  # the forker died
        if line.startswith("processor "):
            pid = int(line.split()[1])
        elif kill_in is not None and line.startswith(kill_in):
            seen += 1
        if pid is not None and kill_in is not None and seen >= nth:
            time.sleep(delay_s)
            with contextlib.suppress(ProcessLookupError):  # it finished first
                os.kill(pid, signal.SIGKILL)
            kill_in = None
    return line


def processed_twins(store: RunStore) -> dict[tuple[str, int], list[dict]]:
    """Each committed processed shard's rows, read back whole, by its raw shard."""
    reader = ShardReader(store, kind="processed")
    twins = {}
    for shard in reader.poll()[0]:
        table = reader.read(shard)
        assert table is not None, f"committed processed shard {shard.shard_id} did not read back"
        assert table.num_rows == shard.num_rows
        twins[(shard.worker, shard.seq)] = table.to_pylist()
    return twins


@pytest.mark.slow
def test_processors_killed_at_random_points_process_every_shard_exactly_once(local_store, tmp_path):
    """Before each processor, a wave of raw shards is committed; most processors are killed
    in one of :data:`MOMENTS` and the next resumes at the offset saved last (if any), with
    what the killed one left half done. A last processor, never killed, finishes. Whatever
    the moments, the result is that of one processor over the same raw shards, run once."""
    reference = RunStore(StorageConfig(root=str(tmp_path / "reference")), f"run-{uuid.uuid4().hex[:12]}")
    where = json.dumps([local_store.config.model_dump(mode="json"), local_store.run_id])
    forker = subprocess.Popen(
        [sys.executable, "-c", FORKER, where],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        start_new_session=True,  # its own process group, with its processor: stopped() kills them all
    )
    rng = random.Random(4321)
    kills = waves = 0
    writers: dict[tuple[RunStore, str], ShardWriter] = {}
    try:
        while kills < KILLS:
            assert waves < 2 * KILLS, f"only {kills} of the processors were killed in {waves} waves"
            commit_wave(writers, [local_store, reference], waves)
            waves += 1
            kill_in = rng.choice(MOMENTS)
            ended = life(forker, kill_in, rng.randint(1, 2), rng.uniform(0.0, 0.03))
            assert ended in ("ended 0", f"ended {-signal.SIGKILL}"), (ended, stopped(forker))
            kills += ended != "ended 0"
        assert life(forker, None, 0, 0.0) == "ended 0", stopped(forker)
    finally:
        stopped(forker)

    ShardProcessor(reference).poll()
    shards = Tables(local_store).read("shards", columns=["kind", "worker", "seq"]).to_pylist()
    raw = sorted((s["worker"], s["seq"]) for s in shards if s["kind"] == "raw")
    twins = sorted((s["worker"], s["seq"]) for s in shards if s["kind"] == "processed")
    assert len(raw) == 2 * waves
    assert twins == raw  # one twin commit each: none missing, none twice
    # the same rows, selected and weighted alike, in each raw shard's twin
    assert processed_twins(local_store) == processed_twins(reference)
    trajectories = [
        sorted(Tables(store).read("trajectories", columns=["trajectory_id"]).column(0).to_pylist())
        for store in (local_store, reference)
    ]
    assert trajectories[0] == trajectories[1]
    assert not local_store.fs.exists(local_store.path("shards/quarantine"))
