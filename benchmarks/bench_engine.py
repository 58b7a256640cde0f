"""TorchEngine throughput at concurrency 1, 8 and 64 against sequential ``model.generate``.

Same tiny model (the embedded default), same prompts, same number of new tokens, one run.
Baseline: Hugging Face ``model.generate`` (sampling, KV cache) called once per prompt.
Both sides must generate every token asked for, and the engine the same tokens for each
prompt at every concurrency (seeded sampling; asserted).
Last line: ``{"bench": "engine", "ratio": tokens/s at concurrency 64 / sequential tokens/s, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from rl.models import TinyModelConfig, build_tiny_model
from rollout.engines.base import SamplingParams
from rollout.engines.torch_engine import TorchEngine


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for index in range(count):
        messages = [{"role": "user", "content": f"What is {index * 37 % 1000} + {index * 91 % 1000}?"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def sequential_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    """Tokens generated and seconds taken by ``model.generate`` on each prompt in turn."""
    generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            output = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=True,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                top_k=0,
            )
            generated += output.shape[1] - len(prompt)
    return generated, time.perf_counter() - start


async def engine_throughput(engine: TorchEngine, prompts: list[list[int]], new_tokens: int, concurrency: int):
    """Each prompt's generated tokens and the seconds taken with ``concurrency`` requests in
    flight at all times."""
    queue = list(enumerate(prompts))
    generated: dict[int, list[int]] = {}

    async def client():
        while queue:
            index, prompt = queue.pop()
            params = SamplingParams(max_new_tokens=new_tokens, seed=index)
            generation = await engine.generate(f"c{concurrency}-{index}", prompt, params)
            generated[index] = generation.token_ids

    start = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(concurrency)])
    return generated, time.perf_counter() - start


async def main(args) -> dict:
    torch.set_num_threads(args.threads)
    model, tokenizer = build_tiny_model(TinyModelConfig())
    prompts = make_prompts(tokenizer, args.prompts)
    sequential_tokens, sequential_seconds = sequential_generate(model, prompts, args.new_tokens)
    sequential = sequential_tokens / sequential_seconds
    print(
        f"sequential model.generate: {sequential_tokens} tokens in {sequential_seconds:.2f}s = {sequential:.0f} tok/s"
    )

    engine = TorchEngine(model, tokenizer, name="bench", max_batch=64, kv_cache_bytes=0)
    results = {}
    outputs = {}
    try:
        for concurrency in (1, 8, 64):
            outputs[concurrency], seconds = await engine_throughput(
                engine, prompts, args.new_tokens, concurrency
            )
            tokens = sum(len(ids) for ids in outputs[concurrency].values())
            results[concurrency] = tokens / seconds
            print(
                f"TorchEngine concurrency {concurrency:>2}: {tokens} tokens in {seconds:.2f}s = {results[concurrency]:.0f} tok/s"
            )
        stats = engine.stats()
    finally:
        await engine.close()
    # seeded sampling gives each prompt the same tokens alone or batched: batching that got
    # faster by mixing up rows would show here
    assert outputs[8] == outputs[1] and outputs[64] == outputs[1], "batched generations differ from unbatched"
    engine_tokens = sum(len(ids) for ids in outputs[1].values())
    assert sequential_tokens == engine_tokens == len(prompts) * args.new_tokens, (
        f"generated {sequential_tokens} (model.generate) and {engine_tokens} (TorchEngine) tokens, "
        f"asked for {len(prompts) * args.new_tokens}"
    )
    return {
        "bench": "engine",
        "ratio": round(results[64] / sequential, 3),
        "sequential_tok_s": round(sequential, 1),
        "engine_c1_tok_s": round(results[1], 1),
        "engine_c8_tok_s": round(results[8], 1),
        "engine_c64_tok_s": round(results[64], 1),
        "ratio_c1": round(results[1] / sequential, 3),
        "ratio_c8": round(results[8] / sequential, 3),
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "mean_batch": round(stats.extra["mean_batch"], 2),
        "threads": args.threads,
        "params": sum(p.numel() for p in model.parameters()),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128, help="prompts per configuration")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    for name, value in (
        ("--prompts", args.prompts),
        ("--new-tokens", args.new_tokens),
        ("--threads", args.threads),
    ):
        if value < 1:
            parser.error(f"{name} must be at least 1, not {value}")
    return args


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args()))))
