"""Greedy identity of the optimized pair with optimized target-only decoding, and the margin where they part.

    python scripts/greedy_margins.py --dtype float32 --prompts 4 --max-new-tokens 64 --threads 2

For each HumanEval prompt: target-only greedy decoding and hf_spec's (k = 5) on the same optimized weights. Where the
texts differ, the target's logits at the first differing position, after the common prefix, are recomputed with a
single full pass, and the gap between the two tokens' logits is reported relative to the larger logit: a near tie
(block and step passes rounding differently) shows as a gap far below 1e-4.
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_spec import without_speculation
from hf_spec.bench.measure import machine_info
from hf_spec.loading.corpora import humaneval_prompts
from hf_spec.loading.pair import load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = load_pair(dtype=getattr(torch, args.dtype))
    print(pair.describe())
    rows = []
    for index, text in enumerate(humaneval_prompts()[: args.prompts]):
        inputs = pair.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        common = {**inputs, "do_sample": False, "max_new_tokens": args.max_new_tokens}
        with without_speculation(pair.target):
            expected = pair.target.generate(**common)[0]
        output = pair.target.generate(**common, assistant_model=pair.draft, num_assistant_tokens=5)[0]
        row = {"prompt": index, "identical": bool(torch.equal(output, expected))}
        if not row["identical"]:
            length = min(len(output), len(expected))
            first = next(i for i in range(length) if output[i] != expected[i])
            with torch.no_grad():
                logits = pair.target(expected[None, :first]).logits[0, -1].float()
            a, b = logits[expected[first]], logits[output[first]]
            row.update(position=first - inputs["input_ids"].shape[1], target_only_token=int(expected[first]),
                       hf_spec_token=int(output[first]),
                       relative_margin=float((a - b).abs() / logits.abs().max()))
        rows.append(row)
        print(row, flush=True)
    report = {"dtype": args.dtype, "machine": machine_info(), "rows": rows,
              "cpu_paths": {"target": pair.target_path.name, "draft": pair.draft_path.name}}
    if args.output:
        with open(args.output, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
