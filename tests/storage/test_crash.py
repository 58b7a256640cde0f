"""Crash safety: a shard writer killed with SIGKILL at random points never leaves a
visible partial shard, and every committed shard reads back whole."""

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

from storage.schema import to_table
from storage.shards import ShardReader
from tests.storage.records import make_record

KILLS = 20

FORKER = textwrap.dedent(
    """
    import json, os, sys, traceback
    from storage.config import RunStore, StorageConfig
    from storage.shards import ShardWriter
    from tests.storage.records import make_record

    def say(line):
        # one write: with PYTHONUNBUFFERED set, print writes the line and its end apart, and a
        # writer's line could land between the forker's
        os.write(1, f"{line}\\n".encode())

    def write_until_killed(config, run_id, life):
        writer = ShardWriter(RunStore(StorageConfig(**config), run_id), "crashy", flush_records=2)
        index = 0
        while True:
            if writer.write(make_record(index, num_tokens=16, prefix=f"L{life}-")):
                say("committed")
            index += 1

    config, run_id = json.loads(sys.argv[1])
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                write_until_killed(config, run_id, int(line))
            except BaseException:
                traceback.print_exc()  # os._exit would drop the interpreter's report
                sys.stderr.flush()
            finally:
                os._exit(1)
        say(f"writer {pid}")
        _, status = os.waitpid(pid, 0)
        say(f"ended {os.waitstatus_to_exitcode(status)}")
    """
)
"""Forks one writer per life from a process that imported the storage modules once (a fresh
interpreter per life spent most of the test importing them): each writer is still its own
process, creating its own store, killed with SIGKILL."""


def stopped(forker: subprocess.Popen) -> str:
    """The end of the forker's stderr, after stopping it and its writer (reading it blocks
    while either runs: a live writer holds the pipes open)."""
    if forker.returncode is None:  # not reaped yet: its pid still names its group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(forker.pid, signal.SIGKILL)
    return forker.communicate()[1][-3000:]


def started_writer(forker: subprocess.Popen) -> int:
    """The pid of the writer just forked, once it has committed a shard. The forker names
    the writer while it writes: one or more commits may come first."""
    pid, committed = None, False
    while pid is None or not committed:
        line = forker.stdout.readline().strip()
        if line == "committed":
            committed = True
        elif line.startswith("writer ") and pid is None:
            pid = int(line.split()[1])
        else:
            raise AssertionError((line, stopped(forker)))
    return pid


def test_writer_killed_at_random_points_leaves_only_whole_shards(store):
    config = store.config.model_dump(mode="json")
    for key in ("access_key_id", "secret_access_key"):
        if getattr(store.config, key) is not None:
            config[key] = getattr(store.config, key).get_secret_value()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    rng = random.Random(1234)
    forker = subprocess.Popen(
        [sys.executable, "-c", FORKER, json.dumps([config, store.run_id])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, with its writers: stopped() kills them all
    )
    try:
        for life in range(KILLS):
            forker.stdin.write(f"{life}\n")
            forker.stdin.flush()
            writer = started_writer(forker)
            # Kill at a random point of the following writes, flushes and commits.
            time.sleep(rng.uniform(0.0, 0.5))
            with contextlib.suppress(ProcessLookupError):  # ended by itself: the forker says how
                os.kill(writer, signal.SIGKILL)
            while (line := forker.stdout.readline().strip()) == "committed":
                pass
            assert line == f"ended {-signal.SIGKILL}", (line, stopped(forker))
    finally:
        stopped(forker)

    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert len(shards) >= KILLS
    assert len({s.shard_id for s in shards}) == len(shards)
    seen = set()
    for shard in shards:
        table = reader.read(shard)
        assert table is not None, f"committed shard {shard.shard_id} did not read back"
        assert table.num_rows == shard.num_rows == 2
        for row in table.to_pylist():
            life, index = row["trajectory_id"][1:].split("-")
            assert (
                row == to_table([make_record(int(index), num_tokens=16, prefix=f"L{life}-")]).to_pylist()[0]
            )
            seen.add(row["trajectory_id"])
    assert len(seen) == 2 * len(shards)
    assert not store.fs.exists(store.path("shards/quarantine"))
