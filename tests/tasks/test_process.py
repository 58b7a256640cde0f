"""The process task's processor on a run as the flows start it."""

from __future__ import annotations

from rl.models import ensure_base_version
from storage.shards import ShardWriter
from storage.tables import Tables
from storage.weights import WeightStore
from tasks.common import run_store
from tasks.process import shard_processor
from tests.flows.conftest import tiny_config
from tests.rl.test_trainer import TINY, make_trajectories


def test_a_processor_started_before_version_zero_fills_the_text_column(tmp_path):
    """Started beside the trainer and the workers, the processor finds no version (so no
    tokenizer) yet; the rows of the shards that come later still get their text."""
    config = tiny_config(tmp_path / "runs", "process-early")
    processor = shard_processor(config)
    store = run_store(config)
    ensure_base_version(WeightStore(store), TINY)
    raw = [
        {k: v for k, v in record.items() if k not in ("train_mask", "loss_weight")}
        for record in make_trajectories(store, 2, seed=1)
    ]
    writer = ShardWriter(store, "w0")
    writer.write_many(raw)
    writer.close()
    assert len(processor.poll()) == 1
    texts = Tables(store).read("trajectories").column("text").to_pylist()
    assert len(texts) == 2 and all(texts), texts
