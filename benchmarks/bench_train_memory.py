"""Memory of a policy-gradient pass on Qwen3-0.6B's dimensions: logits and activations.

Logits: one forward and backward of ``Σ w·log p`` over a micro-batch, through a one-block
model with Qwen3-0.6B's hidden size and vocabulary (1024, 151,936; tied head), in float32
on the CPU:

- treadle: :func:`rl.logprobs.token_logprobs` with ``where`` = the action tokens (a
  ``--action-share`` of the positions), the head worked out chunk by chunk;
- baseline: the model's own forward, its ``(B, T, V)`` logits upcast, ``logsumexp`` and
  ``gather`` over every position (what the trainer did before).

Each side runs in a fresh process; its peak RSS growth over the model's is measured, and
the two sides' log-probs are checked to agree on the action tokens. The last line's
``"ratio"`` is the baseline's peak growth / treadle's; the times are printed beside it.

Activations: the bytes autograd keeps for the backward pass per token and decoder block
(distinct storages, parameters left out), from a two-block model less a one-block one,
with and without ``activation_checkpointing``, scaled to Qwen3-0.6B's 28 blocks at the
GPU config's ``micro_token_budget`` (32,768 tokens).

    python benchmarks/bench_train_memory.py [--tokens 2048] [--action-share 0.4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from rl.logprobs import token_logprobs
from rl.models import enable_activation_checkpointing

VOCAB = 151_936
HIDDEN = 1024
BLOCKS = 28
MICRO_TOKENS = 32_768


def peak_rss_bytes() -> int:
    """VmHWM of this process (the kernel's peak RSS since the last reset), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS and return it, in bytes.

    Building the model peaks well above the RSS it leaves (about 590 MiB more at these
    dimensions); without the reset a pass's growth would be measured over that peak.
    """
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return peak_rss_bytes()


def qwen3_like(blocks: int) -> torch.nn.Module:
    """Qwen3-0.6B's dimensions with ``blocks`` decoder blocks, randomly initialised."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=3072,
        num_hidden_layers=blocks,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def inputs(tokens: int, action_share: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of random ids, their attention mask and the action tokens."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, tokens // 2), generator=generator)
    where = torch.rand(input_ids.shape, generator=generator) < action_share
    return input_ids, torch.ones_like(input_ids, dtype=torch.bool), where


def saved_bytes(blocks: int, checkpointing: bool, tokens: int, action_share: float) -> int:
    """Bytes of the distinct storages autograd saves in a forward of ``token_logprobs``."""
    model = qwen3_like(blocks)
    if checkpointing:
        enable_activation_checkpointing(model)
    input_ids, attention_mask, where = inputs(tokens, action_share)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        token_logprobs(model, input_ids, attention_mask, where=where)
    return sum(saved.values())


def activations_per_token_block(checkpointing: bool, tokens: int, action_share: float) -> float:
    """Saved bytes per token of one decoder block: two blocks' less one block's."""
    one, two = (saved_bytes(blocks, checkpointing, tokens, action_share) for blocks in (1, 2))
    return (two - one) / tokens


def one_pass(side: str, tokens: int, action_share: float) -> dict:
    model = qwen3_like(1)
    input_ids, attention_mask, where = inputs(tokens, action_share)
    weights = torch.randn(input_ids.shape)
    before = reset_peak_rss()
    started = time.perf_counter()
    if side == "treadle":
        logprobs = token_logprobs(model, input_ids, attention_mask, where=where)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask.long()).logits[:, :-1].float()
        taken = logits.gather(-1, input_ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, dim=-1)
        logprobs = torch.nn.functional.pad(taken, (1, 0))
    (logprobs * weights * where).sum().backward()
    seconds = time.perf_counter() - started
    return {
        "peak_growth_bytes": peak_rss_bytes() - before,
        "seconds": seconds,
        "action_logprobs": logprobs.detach()[where].tolist(),
    }


def run_side(side: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--side", side, "--tokens", str(args.tokens),
               "--action-share", str(args.action_share)]  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the micro-batch (2 rows)")
    parser.add_argument(
        "--action-share", type=float, default=0.4, help="share of positions that are action tokens"
    )
    parser.add_argument("--side", choices=["treadle", "full"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokens < 4:
        parser.error(f"--tokens must be at least 4 (two rows of two), not {args.tokens}")
    if not 0 < args.action_share <= 1:
        parser.error(
            f"--action-share must be in (0, 1]: with none the two sides have nothing to compare, not {args.action_share}"
        )
    if not inputs(args.tokens, args.action_share)[2].any():
        parser.error(
            f"--tokens {args.tokens} with --action-share {args.action_share} draws no action token: "
            "the two sides would have nothing to compare; raise either"
        )
    return args


def main() -> None:
    args = parse_args()
    if args.side:
        print(json.dumps(one_pass(args.side, args.tokens, args.action_share)))
        return
    full, ours = run_side("full", args), run_side("treadle", args)
    difference = max(
        abs(a - b) for a, b in zip(full.pop("action_logprobs"), ours.pop("action_logprobs"), strict=True)
    )
    assert difference < 1e-3, f"the two sides' log-probs differ by {difference}"
    logits_bytes = args.tokens * VOCAB * 4
    for name, result in (("full logits", full), ("treadle", ours)):
        print(
            f"{name:12s} peak growth {result['peak_growth_bytes'] / 2**20:7.0f} MiB, "
            f"forward + backward {result['seconds']:.2f} s"
        )
    print(f"one copy of the float32 logits: {logits_bytes / 2**20:.0f} MiB")
    activations = {}
    for checkpointing in (False, True):
        per_token_block = activations_per_token_block(checkpointing, 512, args.action_share)
        at_budget = per_token_block * BLOCKS * MICRO_TOKENS
        activations[checkpointing] = (per_token_block, at_budget)
        print(
            f"activations, checkpointing {'on ' if checkpointing else 'off'}: "
            f"{per_token_block / 1024:.1f} KiB per token and block, {at_budget / 2**30:.1f} GiB for "
            f"{BLOCKS} blocks at {MICRO_TOKENS} tokens"
        )
    print(
        json.dumps(
            {
                "bench": "train_memory",
                "ratio": round(full["peak_growth_bytes"] / ours["peak_growth_bytes"], 2),
                "baseline": "the model's full float32 logits",
                "full_peak_growth_mib": round(full["peak_growth_bytes"] / 2**20),
                "treadle_peak_growth_mib": round(ours["peak_growth_bytes"] / 2**20),
                "full_s": round(full["seconds"], 2),
                "treadle_s": round(ours["seconds"], 2),
                "time_ratio": round(full["seconds"] / ours["seconds"], 2),
                "logits_mib": round(logits_bytes / 2**20),
                "tokens": args.tokens,
                "vocab": VOCAB,
                "action_share": args.action_share,
                "max_logprob_difference": difference,
                "activation_kib_per_token_block": round(activations[False][0] / 1024, 1),
                "activation_kib_per_token_block_checkpointed": round(activations[True][0] / 1024, 1),
                f"activation_gib_at_{MICRO_TOKENS}_tokens": round(activations[False][1] / 2**30, 1),
                f"activation_gib_at_{MICRO_TOKENS}_tokens_checkpointed": round(
                    activations[True][1] / 2**30, 1
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
