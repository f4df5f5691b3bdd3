"""Batched speculative decoding on the real Qwen2.5-Coder pair vs target-only generate at the same batch size.

    python scripts/bench_batches.py [--batch-sizes 1 4 8] [--max-new-tokens 64] [--k 5] [--dtype bfloat16]
                                    [--threads 2] [--json out.json]

Both methods run in this process on the same left-padded batch of the first B HumanEval prompts, greedy, one after
the other for each batch size, after a warm-up. Generated tokens are counted per row up to and including its EOS.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_spec import speculative
from hf_spec.loading.corpora import humaneval_prompts
from hf_spec.loading.pretrained import DEFAULT_DRAFT, DEFAULT_TARGET, load


def generated_counts(sequences: torch.Tensor, prompt_width: int, eos_ids: set[int]) -> list[int]:
    """Per row: tokens generated up to and including the first EOS (or all of them)."""
    counts = []
    for row in sequences[:, prompt_width:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        counts.append(ends[0] + 1 if ends else len(row))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load(args.target, dtype=dtype)
    target = speculative(target)
    draft, _ = load(args.draft, dtype=dtype)
    tokenizer.padding_side = "left"
    eos_ids = set(target.generation_config.eos_token_id if isinstance(target.generation_config.eos_token_id, list)
                  else [target.generation_config.eos_token_id])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    prompts = humaneval_prompts()
    settings = {"do_sample": False, "max_new_tokens": args.max_new_tokens, "pad_token_id": pad_id}

    warm = tokenizer(prompts[:1], return_tensors="pt")
    target.generate(**warm, do_sample=False, max_new_tokens=4, pad_token_id=pad_id)
    target.generate(**warm, assistant_model=draft, do_sample=False, max_new_tokens=4, pad_token_id=pad_id)

    results = []
    for batch_size in args.batch_sizes:
        inputs = tokenizer(prompts[:batch_size], padding=True, return_tensors="pt")
        width = inputs["input_ids"].shape[1]
        started = time.perf_counter()
        baseline = target.generate(**inputs, **settings)
        baseline_seconds = time.perf_counter() - started
        started = time.perf_counter()
        ours = target.generate(
            **inputs, assistant_model=draft, num_assistant_tokens=args.k, return_dict_in_generate=True, **settings
        )
        ours_seconds = time.perf_counter() - started
        baseline_tokens = sum(generated_counts(baseline, width, eos_ids))
        ours_tokens = sum(generated_counts(ours.sequences, width, eos_ids))
        stats = ours.speculative_stats
        result = {
            "batch_size": batch_size,
            "target_only_tokens_per_second": baseline_tokens / baseline_seconds,
            "ours_tokens_per_second": ours_tokens / ours_seconds,
            "acceptance": stats.acceptance_rate,
            "acceptance_by_row": [row.acceptance_rate for row in stats.rows],
            "tokens_per_target_pass_by_row": [row.tokens_per_round for row in stats.rows],
            "rows_identical_to_target_only": sum(
                torch.equal(a, b) for a, b in zip(ours.sequences, baseline)
            ),
            "draft_seconds": stats.draft_seconds, "verify_seconds": stats.verify_seconds,
        }
        result["speed_up"] = result["ours_tokens_per_second"] / result["target_only_tokens_per_second"]
        results.append(result)
        print(json.dumps(result), flush=True)

    print(f"\n{args.dtype}, {args.threads} threads, k={args.k}, {args.max_new_tokens} new tokens, greedy, "
          f"CPU {torch.backends.cpu.get_cpu_capability()}")
    print("| batch | target-only tok/s | ours tok/s | speed-up | acceptance | acceptance by row | identical rows |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        by_row = ", ".join(f"{a:.2f}" for a in r["acceptance_by_row"])
        print(f"| {r['batch_size']} | {r['target_only_tokens_per_second']:.2f} | {r['ours_tokens_per_second']:.2f} | "
              f"{r['speed_up']:.2f}x | {r['acceptance']:.2f} | {by_row} | "
              f"{r['rows_identical_to_target_only']}/{r['batch_size']} |")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "results": results}, file, indent=2)


if __name__ == "__main__":
    main()
