"""End-to-end check of the GPU engines: TorchEngine on CUDA and a real vLLM server.

Run on a machine with a GPU and a vLLM environment built from
``deployments/vllm/requirements.txt``:

    .venv/bin/python benchmarks/gpu_check.py --vllm-venv /opt/treadle-vllm [--skip-vllm]

It builds the tiny model (a GPU-friendly size: head dim 64) and a perturbed copy as weight
versions 0 and 1 in a temporary folder, then for each engine:

- generates for 8 concurrent sessions and checks every returned log-prob against a
  separate fp32 forward pass of the same weights (sampling distribution: temperature, then
  top-p, renormalised — ``rollout.engines.torch_engine.sampling_logprobs``);
- checks a stop token is kept in the action and a length stop is reported;
- repeats a prompt and checks the prefix cache is reused;
- loads version 1 and checks tokens are tagged 1, log-probs now follow version 1's
  weights, and (vLLM) the prefix cache was reset.

Then the trainer's pass on CUDA: a two-block model with Qwen3-0.6B's dimensions and
vocabulary, ``token_logprobs`` (chunked head) with activation checkpointing against the
model's full logits without it, in float32 and under bf16 autocast: log-probs and
gradients must agree (within 1e-3 in float32, 0.1 in bf16), and the peak CUDA memory of
each is reported. The model is randomly initialised, its logits small (std ~0.6), so the bf16
bound checks that the path runs right, not the precision a trained model gets: bf16 rounding
of logits of a trained model's size moves a log-prob by up to ~0.06.

Last, the SAO trainer itself (``rl.trainer.Trainer``) on a randomly initialised model of
Qwen3-0.6B's dimensions (28 blocks) at ``configs/qwen3-0.6b-gpu.yaml``'s ``sao`` budgets
(262,144 tokens a step in micro-batches of 32,768, activation checkpointing, bf16 matmuls;
one critic pretraining step): ``--trainer-rows`` rows of 2,048 tokens whose rollout log-probs
the same weights computed, so the ratios must be 1 and nothing masked; the step times, tokens/s
and peak CUDA memory are reported.

Prints the JSON summary as its last line: {"bench": "gpu_check", "ok": ..., ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import httpx
import torch
import yaml
from bench_train_memory import qwen3_like

from rl.config import SAOConfig
from rl.logprobs import token_logprobs
from rl.models import TinyModelConfig, build_tiny_model, enable_activation_checkpointing, publish_policy
from rl.trainer import Trainer
from rollout.engines.base import SamplingParams
from rollout.engines.torch_engine import TorchEngine, sampling_logprobs
from rollout.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from storage.config import RunStore, StorageConfig
from storage.schema import PROCESSED_SCHEMA, to_table
from storage.shards import ShardWriter
from storage.tables import Tables
from storage.weights import WeightStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_TINY = TinyModelConfig(
    hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512, max_position_embeddings=1024
)


def make_versions(folder: str) -> tuple[str, str, torch.nn.Module, torch.nn.Module, object]:
    """Save the tiny model as ``v0`` and a perturbed copy as ``v1`` (HF dirs with tokenizer)."""
    torch.manual_seed(0)
    model, tokenizer = build_tiny_model(GPU_TINY)
    v0, v1 = os.path.join(folder, "v0"), os.path.join(folder, "v1")
    model.save_pretrained(v0)
    tokenizer.save_pretrained(v0)
    updated, _ = build_tiny_model(GPU_TINY)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn_like(p))
    updated.save_pretrained(v1)
    tokenizer.save_pretrained(v1)
    return v0, v1, model, updated, tokenizer


def reference_logprobs(model, prompt, tokens, temperature: float, top_p: float) -> list[float]:
    """Sampling log-probs of ``tokens`` after ``prompt`` from one fp32 forward pass."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens], device=device)).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]  # (T, V)
    n = rows.shape[0]
    lp = sampling_logprobs(
        rows, torch.full((n,), temperature, device=device), torch.full((n,), top_p, device=device)
    )
    return lp[torch.arange(n, device=device), torch.tensor(tokens, device=device)].tolist()


def prompts(tokenizer, n: int) -> list[list[int]]:
    """Distinct chat prompts of 40+ tokens (longer than a vLLM cache block)."""
    out = []
    for i in range(n):
        messages = [
            {"role": "system", "content": "reply only digits, you are a careful calculator " * 2},
            {
                "role": "user",
                "content": f"What is {i * 37 % 1000} + {i * 91 % 1000}? Please compute the sum.",
            },
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


async def exercise(engine, ref_v0, ref_v1, v1_dir: str, tokenizer, tolerance: float) -> dict:
    """The checks of the module docstring on one engine; returns figures and an ``ok`` flag."""
    result: dict = {"engine": engine.name}
    temperature, top_p = 0.8, 0.9
    batch = prompts(tokenizer, 8)
    params = [
        SamplingParams(max_new_tokens=24, temperature=temperature, top_p=top_p, seed=i) for i in range(8)
    ]
    started = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(f"s{i}", batch[i], params[i]) for i in range(8)))
    result["generate_s"] = round(time.perf_counter() - started, 3)
    diffs = []
    for prompt, gen in zip(batch, gens, strict=True):
        expected = reference_logprobs(ref_v0, prompt, gen.token_ids, temperature, top_p)
        diffs.extend(abs(a - b) for a, b in zip(gen.logprobs, expected, strict=True))
    result["tokens"] = sum(len(g.token_ids) for g in gens)
    result["logprob_max_abs_diff_v0"] = max(diffs)
    result["versions_v0_ok"] = all(set(g.versions) == {0} for g in gens)

    every_id = tuple(range(len(tokenizer)))
    stop = await engine.generate(
        "stop", batch[0], SamplingParams(max_new_tokens=8, stop_ids=every_id, seed=0)
    )
    result["stop_kept_ok"] = stop.finish_reason == "stop" and len(stop.token_ids) == 1
    length = await engine.generate("len", batch[1], SamplingParams(max_new_tokens=5, seed=0))
    result["length_ok"] = length.finish_reason == "length" and len(length.token_ids) == 5

    repeat = await engine.generate("s0", batch[0], params[0])
    result["prefix_cached_tokens"] = repeat.cached_tokens
    result["prefix_cache_ok"] = repeat.cached_tokens > 0

    started = time.perf_counter()
    await engine.load_version(1, v1_dir)
    result["reload_s"] = round(time.perf_counter() - started, 3)
    after = await engine.generate("s0", batch[0], params[0])
    result["versions_v1_ok"] = set(after.versions) == {1}
    result["cached_after_reload"] = after.cached_tokens
    v1_diff = max(
        abs(a - b)
        for a, b in zip(
            after.logprobs,
            reference_logprobs(ref_v1, batch[0], after.token_ids, temperature, top_p),
            strict=True,
        )
    )
    v0_diff = max(
        abs(a - b)
        for a, b in zip(
            after.logprobs,
            reference_logprobs(ref_v0, batch[0], after.token_ids, temperature, top_p),
            strict=True,
        )
    )
    result["logprob_max_abs_diff_v1"] = v1_diff
    result["reload_ok"] = v1_diff <= tolerance and v1_diff < v0_diff
    result["logprob_ok"] = result["logprob_max_abs_diff_v0"] <= tolerance
    result["stats"] = vars(engine.stats())
    result["queue_read_ok"] = result["stats"]["extra"].get("queue_read", 1.0) == 1.0
    checks = ["versions_v0_ok", "stop_kept_ok", "length_ok", "prefix_cache_ok", "versions_v1_ok", "reload_ok",
              "queue_read_ok"]  # fmt: skip
    result["ok"] = all(result[k] for k in [*checks, "logprob_ok"])
    return result


async def check_torch(v0: str, v1: str, ref_v0, ref_v1, tokenizer) -> dict:
    engine = TorchEngine(v0, tokenizer, name="torch-cuda", device="cuda", dtype=torch.float32)
    try:
        return await exercise(engine, ref_v0, ref_v1, v1, tokenizer, tolerance=1e-3)
    finally:
        await engine.close()


async def wait_healthy(url: str, process: subprocess.Popen, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {process.returncode}")
            try:
                if (await client.get(f"{url}/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1)
    raise RuntimeError(f"vLLM server not healthy after {deadline_s} s")


async def check_vllm(args, v0: str, v1: str, ref_v0, ref_v1, tokenizer, log_path: str) -> dict:
    launch = os.path.join(ROOT, "deployments", "vllm", "launch.sh")
    command = [
        launch, args.vllm_venv, v0, str(args.port),
        "--dtype", args.vllm_dtype, "--gpu-memory-utilization", "0.3", "--max-model-len", "1024", "--enforce-eager",
    ]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    engine = VLLMEngine(VLLMEngineConfig(base_url=f"http://127.0.0.1:{args.port}"), name="vllm-gpu")
    try:
        await wait_healthy(f"http://127.0.0.1:{args.port}", process, args.startup_timeout)
        tolerance = 1e-3 if args.vllm_dtype == "float32" else 0.1
        result = await exercise(engine, ref_v0, ref_v1, v1, tokenizer, tolerance=tolerance)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        result["crash_is_engine_error"] = await _crash_surfaces(engine)
        result["ok"] = result["ok"] and result["crash_is_engine_error"]
        return result
    finally:
        await engine.close()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


async def _crash_surfaces(engine: VLLMEngine) -> bool:
    from rollout.engines.base import EngineError

    healthy = await engine.health()
    try:
        await engine.generate("after-crash", [1, 2, 3], SamplingParams(max_new_tokens=2))
    except EngineError:
        return not healthy
    return False


def full_logprobs(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` log-probs from the model's whole ``(B, T, V)`` logits (position 0 is 0)."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    taken = logits.gather(-1, input_ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(taken, (1, 0))


def check_training(tokens: int = 8192, device: str = "cuda") -> dict:
    """The trainer's log-prob pass on ``device``, checkpointed and chunked, against the plain
    one (peak memory measured on CUDA only)."""
    cuda = device.startswith("cuda")
    model = qwen3_like(2).to(device)
    input_ids = torch.randint(0, model.config.vocab_size, (4, tokens // 4), device=device)
    attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    weights = torch.randn(input_ids.shape, device=device)
    results = {}
    for side in ("full", "treadle", "treadle_bf16"):
        if side == "treadle":
            enable_activation_checkpointing(model)
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        started = time.perf_counter()
        if side == "full":
            logprobs = full_logprobs(model, input_ids)
        else:
            with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=side == "treadle_bf16"):
                logprobs = token_logprobs(model, input_ids, attention_mask)
        (logprobs * weights).sum().backward()
        if cuda:
            torch.cuda.synchronize()
        results[side] = {
            "peak_mib": round((torch.cuda.max_memory_allocated() - base) / 2**20) if cuda else None,
            "seconds": round(time.perf_counter() - started, 3),
            "logprobs": logprobs.detach(),
            "grads": [p.grad.detach().clone() for p in model.parameters()],
        }
    full, ours, mixed = results["full"], results["treadle"], results["treadle_bf16"]
    errors = {}
    for name, side in (("float32", ours), ("bf16", mixed)):
        errors[f"max_logprob_error_{name}"] = float((full["logprobs"] - side.pop("logprobs")).abs().max())
        errors[f"max_relative_grad_error_{name}"] = max(
            float((a - b).norm() / a.norm().clamp(min=1e-12))
            for a, b in zip(full["grads"], side.pop("grads"), strict=True)
        )
    del full["logprobs"], full["grads"]
    return {
        "ok": errors["max_logprob_error_float32"] < 1e-3
        and errors["max_relative_grad_error_float32"] < 1e-3
        and errors["max_logprob_error_bf16"] < 0.1
        and errors["max_relative_grad_error_bf16"] < 0.1,
        "tokens": tokens,
        **errors,
        "full_logits": full,
        "chunked_checkpointed": ours,
        "chunked_checkpointed_bf16": mixed,
    }


def on_policy_rows(model, rows: int, length: int = 2048) -> list[dict]:
    """Processed trajectories of random tokens whose rollout log-probs ``model`` gives them:
    three actions (256, 256 and 512 tokens) between a prompt and observations."""
    generator = torch.Generator().manual_seed(0)
    mask = [False] * 512 + [True] * 256 + [False] * 256 + [True] * 256 + [False] * 256 + [True] * 512
    records = []
    for i in range(rows):
        tokens = torch.randint(1000, model.config.vocab_size, (length,), generator=generator).cuda()
        with torch.no_grad():
            logits = model(input_ids=tokens[None]).logits[0, :-1].float()  # (T - 1, V)
            ones = torch.ones(len(logits), device="cuda")
            taken = sampling_logprobs(logits, ones, ones).gather(-1, tokens[1:, None])[:, 0]
        logprobs = [0.0, *taken.tolist()]
        records.append(
            {
                "trajectory_id": f"t{i}",
                "execution_id": f"e{i}",
                "task": "synthetic",
                "prompt_id": f"p{i}",
                "group_id": f"g{i}",
                "tokens": tokens.tolist(),
                "logprobs": [lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)],
                "action_mask": mask,
                "turn": [0] * length,
                "versions": [0 if m else -1 for m in mask],
                "reward": float(i % 2),
                "progress": 1.0,
                "status": "ok",
                "train_mask": mask,
                "loss_weight": [1.0] * length,
            }
        )
    return records


def check_trainer(folder: str, rows: int) -> dict:
    """The SAO trainer at the GPU config's budgets on a Qwen3-0.6B-shaped model (module docstring)."""
    sao = yaml.safe_load(Path(ROOT, "configs", "qwen3-0.6b-gpu.yaml").read_text())["sao"]
    config = SAOConfig(**sao | {"value_pretrain_steps": 1, "publish_every": 10**6})
    store = RunStore(StorageConfig(root=os.path.join(folder, "runs")), "qwen3-shaped")
    model = qwen3_like(28)
    _, tokenizer = build_tiny_model(TinyModelConfig())  # the engines' concern, not the trainer's
    publish_policy(WeightStore(store), model, tokenizer, step=0, tag="base")
    records = on_policy_rows(model.cuda().eval(), rows)
    del model
    torch.cuda.empty_cache()
    writer = ShardWriter(store, "gpu-check", kind="processed", schema=PROCESSED_SCHEMA)
    for start in range(0, rows, 32):
        writer.write_table(to_table(records[start : start + 32], PROCESSED_SCHEMA))
        writer.flush()
    writer.close()
    trainer = Trainer(store, config, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    summary = trainer.run(drain=True)
    seconds = time.perf_counter() - started
    steps = sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])
    return {
        "ok": len(steps) == rows * 2048 // config.token_budget
        and all(abs(row["mean_ratio"] - 1) < 1e-2 and row["masked_fraction"] == 0.0 for row in steps)
        and all(math.isfinite(row["policy_loss"]) and math.isfinite(row["value_loss"]) for row in steps)
        and bool(summary.versions),
        "token_budget": config.token_budget,
        "micro_token_budget": config.micro_token_budget,
        "step_seconds": [round(row["step_seconds"], 2) for row in steps],
        "tokens_per_s": [round(row["tokens_per_s"]) for row in steps],
        "mean_ratio": [round(row["mean_ratio"], 5) for row in steps],
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "seconds_with_publish": round(seconds, 1),
    }


def guarded(check) -> dict:
    """``check()``'s summary, or a failed one naming the exception it raised."""
    try:
        return check()
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-venv", help="Environment built from deployments/vllm/requirements.txt.")
    parser.add_argument("--skip-vllm", action="store_true", help="Check only the TorchEngine.")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--vllm-dtype", default="bfloat16", help="vllm serve --dtype (float32 for exact log-probs)."
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument(
        "--trainer-rows",
        type=int,
        default=256,
        help="Rows of 2,048 tokens the trainer check trains on (0: skip).",
    )
    parser.add_argument(
        "--log", default=os.path.join(os.environ.get("OUT", tempfile.gettempdir()), "vllm.log")
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu_check", "ok": False, "error": "no CUDA device"}))
        sys.exit(1)
    summary: dict = {"bench": "gpu_check", "device": torch.cuda.get_device_name(0)}
    with tempfile.TemporaryDirectory(prefix="treadle-gpu-check-") as folder:
        v0, v1, model_v0, model_v1, tokenizer = make_versions(folder)
        ref_v0, ref_v1 = model_v0.cuda().float().eval(), model_v1.cuda().float().eval()
        summary["torch"] = guarded(lambda: asyncio.run(check_torch(v0, v1, ref_v0, ref_v1, tokenizer)))
        summary["training"] = guarded(check_training)
        summary["trainer"] = (
            guarded(lambda: check_trainer(folder, args.trainer_rows))
            if args.trainer_rows
            else {"ok": None, "skipped": True}
        )
        if args.skip_vllm:
            summary["vllm"] = {"ok": None, "skipped": True}
        elif not args.vllm_venv:
            summary["vllm"] = {"ok": False, "error": "give --vllm-venv (or --skip-vllm)"}
        else:
            try:
                summary["vllm"] = asyncio.run(check_vllm(args, v0, v1, ref_v0, ref_v1, tokenizer, args.log))
            except Exception as exc:
                summary["vllm"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "log": args.log}
    results = [summary[check]["ok"] for check in ("torch", "training", "trainer", "vllm")]
    summary["ok"] = all(r is not False for r in results)
    summary["ratio"] = float(sum(r is True for r in results)) / len(results)
    print(json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
