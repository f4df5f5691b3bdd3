"""Gemma 3 270M (local layers with a 512-token sliding window) with prompt lookup, on prompts longer than the window.

    python scripts/bench_gemma3_window.py [--max-new-tokens 96] [--threads 2] [--dtype bfloat16] [--json out.json]

The four prompts are several HumanEval problems (each prompt 700-1,100 tokens, longer than the window), then the
first lines of one of them again, so that the continuation copies code the prompt holds: prompt lookup's workload.
What it checks and measures, greedy, on the same weights and kernels:

1. A ragged batch of the four prompts: hf_spec with ``prompt_lookup_num_tokens`` equals the target's own batched
   ``generate()`` token for token (and each row decoded alone).
2. Speed: target-only and hf_spec, for the batch and for each prompt alone, interleaved, after one warm-up call of
   each (the first call's time is reported apart).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_spec import speculative, without_speculation
from hf_spec.bench.measure import describe_machine, machine_info
from hf_spec.loading.corpora import humaneval_prompts
from hf_spec.loading.pretrained import load


def make_prompts(tokenizer, count: int = 4) -> list[str]:
    problems = humaneval_prompts()
    prompts = []
    for i in range(count):
        chosen = problems[10 * i: 10 * i + 5 + i]  # 5 to 8 problems: ragged lengths
        repeated = chosen[0].splitlines()
        prompts.append("\n\n".join(chosen) + "\n\n# Once more, the first function:\n" + "\n".join(repeated[:4]))
    return prompts


def batch_inputs(tokenizer, prompts: list[str]) -> dict:
    tokenizer.padding_side = "left"
    return tokenizer(prompts, return_tensors="pt", padding=True)


def timed(function) -> tuple[float, object]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load("gemma-3-270m", dtype=getattr(torch, args.dtype))
    target = speculative(model)
    config = target.config.get_text_config()
    prompts = make_prompts(tokenizer)
    inputs = batch_inputs(tokenizer, prompts)
    lengths = inputs["attention_mask"].sum(dim=1).tolist()
    assert min(lengths) > config.sliding_window, (lengths, config.sliding_window)
    greedy = {"do_sample": False, "max_new_tokens": args.max_new_tokens, "min_new_tokens": args.max_new_tokens,
              "pad_token_id": tokenizer.pad_token_id}
    lookup = {"prompt_lookup_num_tokens": args.lookup_tokens}

    def target_only(batch):
        with without_speculation(target), torch.no_grad():
            return target.generate(**batch, **greedy)

    def ours(batch):
        return target.generate(**batch, **lookup, **greedy, return_dict_in_generate=True)

    # 1. Exactness on the ragged batch, first calls of each timed.
    first_target, expected = timed(lambda: target_only(inputs))
    first_ours, output = timed(lambda: ours(inputs))
    rows_alone = [target_only(batch_inputs(tokenizer, [prompt]))[0, -args.max_new_tokens:] for prompt in prompts]
    report = {
        "machine": machine_info(), "model": "gemma-3-270m (GGUF Q4_K_M, dequantized)", "dtype": args.dtype,
        "sliding_window": config.sliding_window, "prompt_tokens": lengths, "max_new_tokens": args.max_new_tokens,
        "prompt_lookup_num_tokens": args.lookup_tokens,
        "batch_equal_to_target_only": bool(torch.equal(output.sequences, expected)),
        "batch_equal_to_rows_alone": all(torch.equal(output.sequences[r, -args.max_new_tokens:], rows_alone[r])
                                         for r in range(len(prompts))),
        "batch_acceptance": output.speculative_stats.acceptance_rate,
        "batch_tokens_per_round": output.speculative_stats.tokens_per_round,
        "first_call_seconds": {"target_only": first_target, "hf_spec": first_ours},
    }
    # 2. Speed, interleaved: the batch, then each prompt alone.
    seconds = {"batch": {"target_only": [], "hf_spec": []}, "alone": {"target_only": [], "hf_spec": []}}
    for _ in range(args.repeats):
        seconds["batch"]["target_only"].append(timed(lambda: target_only(inputs))[0])
        seconds["batch"]["hf_spec"].append(timed(lambda: ours(inputs))[0])
        for prompt in prompts:
            single = batch_inputs(tokenizer, [prompt])
            seconds["alone"]["target_only"].append(timed(lambda: target_only(single))[0])
            seconds["alone"]["hf_spec"].append(timed(lambda: ours(single))[0])
    new_tokens = {"batch": len(prompts) * args.max_new_tokens, "alone": args.max_new_tokens}
    report["tokens_per_second"] = {
        case: {method: new_tokens[case] * len(values) / sum(values) for method, values in methods.items()}
        for case, methods in seconds.items()}
    report["speedup"] = {case: rates["hf_spec"] / rates["target_only"]
                         for case, rates in report["tokens_per_second"].items()}
    report["seconds"] = seconds
    print(describe_machine(report["machine"]))
    print(json.dumps({key: report[key] for key in report if key not in ("machine", "seconds")}, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
