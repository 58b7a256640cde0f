"""Crash safety: a shard writer killed with SIGKILL at random points never leaves a
visible partial shard, and every committed shard reads back whole."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap

from storage.schema import to_table
from storage.shards import ShardReader
from tests.storage.records import make_record

KILLS = 20

WRITER = textwrap.dedent(
    """
    import json, sys
    from storage.config import RunStore, StorageConfig
    from storage.shards import ShardWriter
    from tests.storage.records import make_record

    config, run_id, life = json.loads(sys.argv[1])
    writer = ShardWriter(RunStore(StorageConfig(**config), run_id), "crashy", flush_records=2)
    print("ready", flush=True)
    index = 0
    while True:
        if writer.write(make_record(index, num_tokens=16, prefix=f"L{life}-")):
            print("committed", flush=True)
        index += 1
    """
)


def test_writer_killed_at_random_points_leaves_only_whole_shards(store):
    config = store.config.model_dump(mode="json")
    for key in ("access_key_id", "secret_access_key"):
        if getattr(store.config, key) is not None:
            config[key] = getattr(store.config, key).get_secret_value()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    rng = random.Random(1234)
    for life in range(KILLS):
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, json.dumps([config, store.run_id, life])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        lines = [child.stdout.readline().strip() for _ in range(2)]
        assert lines == ["ready", "committed"], child.stderr.read()[-3000:]
        # Kill at a random point of the following writes, flushes and commits.
        try:
            child.wait(timeout=rng.uniform(0.0, 0.5))
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGKILL)
        child.wait()
        assert child.returncode == -signal.SIGKILL, child.stderr.read()[-3000:]
        child.stdout.close()
        child.stderr.close()

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
