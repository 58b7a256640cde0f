"""The maintain flow on a run with history: tables compacted, old weight versions pruned,
shard files that no commit lists swept once they are old, and nothing committed lost."""

from __future__ import annotations

import os
import time

from flows.maintain import maintain
from rl.models import load_policy, publish_policy
from storage.shards import ShardReader, ShardWriter
from storage.tables import Tables
from storage.weights import WeightStore
from tasks.common import run_store
from tasks.weights import build_base_version
from tests.flows.conftest import tiny_config
from tests.storage.records import make_table


def test_maintain_compacts_prunes_and_sweeps_only_old_uncommitted_files(tmp_path):
    config = tiny_config(tmp_path / "runs", "maintain", warm_start={"enabled": False})
    store = run_store(config)
    build_base_version(config)
    weights = WeightStore(store)
    model, tokenizer = load_policy(weights.load(0))
    for step in (1, 2, 3):
        publish_policy(weights, model, tokenizer, step=step, parent=step - 1)
    with ShardWriter(store, "w0", flush_records=2) as writer:
        for start in range(0, 8, 2):
            writer.write_table(make_table(start, 2))
    old, young = "shards/raw/w0/00000009.arrow", "shards/tmp/raw/w0/00000010.arrow-0f0f"
    for leftover in (old, young):
        store.create_exclusive(store.path(leftover), b"left by a writer that died")
    two_hours_ago = time.time() - 7200
    os.utime(store.path(old), (two_hours_ago, two_hours_ago))

    result = maintain(config, keep_last=1, retention_hours=1)

    assert result["removed_shard_files"] == [old]
    assert not os.path.exists(store.path(old)) and os.path.exists(store.path(young))
    assert result["removed_versions"] == [1, 2] and weights.list() == [0, 3]  # v0 is tagged base
    compacted = {t["table"]: t["optimize"] for t in result["tables"] if "optimize" in t}
    assert compacted["shards"]["numFilesRemoved"] == 4  # one file per commit, compacted into one
    reader = ShardReader(store)
    shards, _ = reader.poll()
    assert sum(reader.read(s).num_rows for s in shards) == 8
    assert Tables(store).read("shards").num_rows == 4
