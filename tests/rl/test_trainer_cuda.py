"""The trainer on a CUDA device: steps, weight versions the engines load on any device, and
resume across devices. Skipped without one (``benchmarks/gpu_check.py`` covers the engine)."""

from __future__ import annotations

import pytest
import torch

from rl.models import ensure_base_version, load_policy
from rl.trainer import Trainer
from storage.config import RunStore, StorageConfig
from storage.tables import Tables
from storage.weights import WeightStore
from tests.rl.synthetic import TINY, config, make_trajectories, write_shards

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def store(tmp_path) -> RunStore:
    run = RunStore(StorageConfig(root=str(tmp_path / "runs")), "trainer-cuda")
    ensure_base_version(WeightStore(run), TINY)
    return run


def rewarded_logprob(policy: torch.nn.Module, reward_token: int) -> float:
    device = next(policy.parameters()).device
    prompts = torch.tensor([[11, 12, 13, 14], [50, 60, 70, 80], [101, 7, 99, 150]], device=device)
    with torch.no_grad():
        logits = policy(input_ids=prompts).logits[:, -1].float()
    return float(torch.log_softmax(logits, -1)[:, reward_token].mean())


@pytest.mark.parametrize(
    "precision", [{}, {"mixed_precision": "bf16", "activation_checkpointing": True}], ids=["fp32", "bf16"]
)
def test_a_cuda_trainer_trains_every_row_once_on_the_device_and_learns(store, precision):
    reward_token = 40
    write_shards(store, make_trajectories(store, 96, seed=9, reward_token=reward_token), per_shard=16)
    trainer = Trainer(
        store,
        config(
            token_budget=88,
            micro_token_budget=88,
            lr=1e-2,
            value_pretrain_steps=4,
            max_staleness=100,
            **precision,
        ),
        device="cuda",
    )
    assert {p.device.type for p in trainer.policy.parameters()} == {"cuda"}
    assert {p.device.type for p in trainer.value_model.parameters()} == {"cuda"}
    before = rewarded_logprob(trainer.policy, reward_token)
    summary = trainer.run(drain=True)

    assert summary.stop_reason == "drained" and trainer.step == 12
    assert rewarded_logprob(trainer.policy, reward_token) > before + 0.5
    steps = sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])
    assert [row["num_samples"] for row in steps] == [8] * 12
    first = steps[0]
    # the rollout log-probs came from this policy on the CPU: on-policy on the GPU too
    tolerance = 1e-3 if not precision else 0.05
    assert first["mean_ratio"] == pytest.approx(1.0, abs=tolerance)
    assert first["masked_fraction"] == 0.0
    assert all(torch.isfinite(torch.tensor([r["policy_loss"], r["value_loss"]])).all() for r in steps)
    assert all(s["exp_avg"].device.type == "cuda" for s in trainer.policy_optimizer.state.values())


def test_a_version_trained_on_cuda_loads_on_the_cpu_and_resumes_on_either_device(store):
    write_shards(store, make_trajectories(store, 12, seed=8), per_shard=3)
    first = Trainer(store, config(publish_every=1, publish_on_stop=False), device="cuda")
    first.run(max_steps=2)
    assert first.step == 2

    served, _ = load_policy(WeightStore(store).load(first.version, "serving"))
    for (name, trained), loaded in zip(
        first.policy.state_dict().items(), served.state_dict().values(), strict=True
    ):
        assert loaded.device.type == "cpu"
        torch.testing.assert_close(loaded, trained.cpu(), rtol=0, atol=0, msg=name)

    moments = [s["exp_avg"].cpu() for s in first.policy_optimizer.state.values()]
    for device in ("cuda", "cpu"):
        again = Trainer(store, config(publish_every=1, publish_on_stop=False), device=device)
        assert again.step == 2 and again.version == first.version
        resumed = list(again.policy_optimizer.state.values())
        assert {s["exp_avg"].device.type for s in resumed} == {device}
        # AdamW reads a step count with .item() at every step: on the GPU, a sync per parameter
        assert {s["step"].device.type for s in resumed} == {"cpu"}
        for a, b in zip(moments, resumed, strict=True):
            torch.testing.assert_close(a, b["exp_avg"].cpu(), rtol=0, atol=0)
        for (name, a), b in zip(
            first.value_model.state_dict().items(), again.value_model.state_dict().values(), strict=True
        ):
            assert b.device.type == device
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, msg=name)

    last = Trainer(store, config(publish_every=1), device="cuda")
    last.run(drain=True)
    assert last.step == 3
