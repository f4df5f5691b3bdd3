"""Cost of the processor chain on one verification block: ours vs transformers' per-position loop.

    python scripts/bench_processors.py [--threads 2] [--prefix 512] [--repeats 30] [--json out.json]

The block: k = 5 drafted tokens (k + 1 = 6 positions), vocab 151,936 (Qwen2.5), batch 1, float32 logits. The chain
is what ``generate(repetition_penalty=1.1, temperature=0.7, top_k=50, top_p=0.9)`` builds, in transformers' order.
Both sides run in this process, interleaved, and the medians are compared. The reference cost is one forward pass
of a Qwen2.5-Coder-1.5B-shaped model (the real model's config; random weights, which cost the same) in bf16 over the
same 6-token block after a cached prefix of ``--prefix`` tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache, LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from logits_processors import process_block

VOCAB_SIZE = 151936
K = 5
QWEN_1_5B = {  # Qwen2.5-Coder-1.5B-Instruct's config.json
    "vocab_size": VOCAB_SIZE, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
}


def per_position_loop(chain, sequence_ids, num_prefix, logits):
    """transformers' way: the whole chain once per block position, with that position's prefix."""
    return torch.stack(
        [chain(sequence_ids[:, : num_prefix + i], logits[:, i].clone()) for i in range(logits.shape[1])], dim=1
    )


def median_ms(function, repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def forward_block_ms(num_prefix: int, repeats: int) -> float:
    """One bf16 forward of the Qwen-1.5B shape over a 6-token block after a cached prefix."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(Qwen2Config(**QWEN_1_5B), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, VOCAB_SIZE, (1, num_prefix + K + 1))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :num_prefix], cache=cache, use_cache=True, logits_to_keep=1)

        def block():
            model(ids[:, num_prefix:], cache=cache, use_cache=True, logits_to_keep=K + 1)
            cache.crop(-(K + 1))

        return median_ms(block, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=512, help="tokens before the block")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--skip-forward", action="store_true", help="do not build the 1.5B-shaped model")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(0)
    sequence_ids = torch.randint(0, VOCAB_SIZE, (1, args.prefix + K), generator=generator)
    logits = torch.randn(1, K + 1, VOCAB_SIZE, generator=generator) * 3
    chain = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.1), TemperatureLogitsWarper(0.7), TopKLogitsWarper(50),
        TopPLogitsWarper(0.9),
    ])
    ours = process_block(chain, sequence_ids[:, : args.prefix], sequence_ids[:, args.prefix :], logits)
    theirs = per_position_loop(chain, sequence_ids, args.prefix, logits)
    assert torch.equal(torch.isneginf(ours), torch.isneginf(theirs)), "results differ"

    ours_ms, loop_ms = [], []
    for _ in range(3):  # interleaved rounds
        ours_ms.append(median_ms(
            lambda: process_block(chain, sequence_ids[:, : args.prefix], sequence_ids[:, args.prefix :], logits),
            args.repeats,
        ))
        loop_ms.append(median_ms(lambda: per_position_loop(chain, sequence_ids, args.prefix, logits), args.repeats))
    result = {
        "cpu": torch.backends.cpu.get_cpu_capability(), "threads": args.threads, "prefix": args.prefix, "k": K,
        "vocab_size": VOCAB_SIZE,
        "chain": [type(p).__name__ for p in chain],
        "ours_ms": statistics.median(ours_ms), "transformers_loop_ms": statistics.median(loop_ms),
    }
    result["speed_up"] = result["transformers_loop_ms"] / result["ours_ms"]
    if not args.skip_forward:
        result["qwen_1_5b_bf16_block_forward_ms"] = forward_block_ms(args.prefix, max(5, args.repeats // 3))
        forward = result["qwen_1_5b_bf16_block_forward_ms"]
        result["ours_share_of_forward"] = result["ours_ms"] / forward
        result["transformers_loop_share_of_forward"] = result["transformers_loop_ms"] / forward

    print(f"CPU capability {result['cpu']}, {args.threads} threads, prefix {args.prefix}, k {K}, vocab {VOCAB_SIZE}")
    print("| what | ms | share of a Qwen-1.5B bf16 block forward |")
    print("|---|---|---|")
    for name, key in (("ours (block)", "ours"), ("transformers per-position loop", "transformers_loop")):
        share = result.get(f"{key}_share_of_forward")
        print(f"| {name} | {result[f'{key}_ms']:.2f} | {'-' if share is None else f'{100 * share:.1f}%'} |")
    if "qwen_1_5b_bf16_block_forward_ms" in result:
        block_ms = result["qwen_1_5b_bf16_block_forward_ms"]
        print(f"| Qwen-1.5B-shaped bf16 forward, {K + 1}-token block | {block_ms:.1f} | |")
    print(f"speed-up of the chain: {result['speed_up']:.1f}x")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=2)


if __name__ == "__main__":
    main()
