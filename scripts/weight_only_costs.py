"""Forward-pass costs of the built-in pair in bf16 (on its fastest CPU path, as `load_pair` chooses it) and with
weight-only int8 and int4 layers, or int8 weights with inputs quantized on the fly (w8a8)
(`hf_spec.loading.weight_only`), or the GGUF files' own blocks as shipped (gguf, `hf_spec.loading.gguf_weights`): a
decoding step, and passes over 2 to 8 tokens (a
verify pass over k drafts feeds k + 1), after a 64-token prefix; and how far each quantized target is from bf16 (the
greedy agreement of its first 32 tokens on 4 held-out code prompts, its perplexity on 512 tokens of 8 of them).

    python scripts/weight_only_costs.py --output benchmarks/avx512-bf16-amd/2026-12-06-weight-only-costs
    python scripts/weight_only_costs.py --schemes int8 w8a8 --roles target --output ...
    python scripts/weight_only_costs.py --schemes gguf --output ...  (the reference in this machine's dtype)

Run it alone: every figure is a median of wall-clock passes on 2 threads.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

WIDTHS = [1, 2, 3, 4, 6, 8]


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="writes OUTPUT.json and OUTPUT.md")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--schemes", nargs="+", default=["int8", "int4", "w8a8"],
                        choices=["int8", "int4", "w8a8", "gguf"], help="besides the float reference")
    parser.add_argument("--roles", nargs="+", default=["target", "draft"], choices=["target", "draft"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import hf_spec
    from hf_spec.bench.measure import machine_info
    from hf_spec.bench.workloads import text_workloads
    from hf_spec.loading.pretrained import DEFAULT_DRAFT, DEFAULT_TARGET, load
    from hf_spec.loading.quantization import quantized_copy
    from hf_spec.timing.probe import forward_seconds

    pair = hf_spec.load_pair(quantize=None, quantize_draft=None)  # both float: each scheme quantizes a copy
    prompts = text_workloads(pair.tokenizer, ("code",), 8, offset=100)["code"]  # held-out HumanEval prompts
    prefix = torch.randint(100, 20000, (1, 64), generator=torch.Generator().manual_seed(0))
    text = torch.cat([prompt["input_ids"] for prompt in prompts], dim=1)[:, :512]
    report = {"machine": machine_info(), "widths": WIDTHS, "rows": []}
    greedy = {}
    for role, model in (("target", pair.target), ("draft", pair.draft)):
        if role not in args.roles:
            continue
        reference = str(model.dtype).removeprefix("torch.")  # bf16 where the CPU has it natively, else float32
        for scheme in (reference, *args.schemes):
            if scheme == "gguf":  # the file's own blocks, as shipped
                variant = load(DEFAULT_TARGET if role == "target" else DEFAULT_DRAFT, dtype=model.dtype,
                               quantize="gguf")[0]
            else:
                variant = model if scheme == reference else quantized_copy(model, scheme)
            seconds = forward_seconds(variant, prefix, WIDTHS, repeats=args.repeats)
            row = {"model": role, "weights": scheme, "step_ms": seconds[1] * 1e3,
                   "pass_ms": {width: seconds[width] * 1e3 for width in WIDTHS},
                   "perplexity": perplexity(variant, text)}
            if role == "target":
                outputs = []
                for prompt in prompts[:4]:
                    out = variant.generate(**prompt, max_new_tokens=32, do_sample=False)
                    outputs.append(out[0, prompt["input_ids"].shape[1]:])
                greedy[scheme] = outputs
                row["greedy_agreement"] = sum(
                    int(((a[:len(b)] == b[:len(a)]).cumprod(0)).sum()) for a, b in zip(outputs, greedy[reference])
                ) / sum(len(b) for b in greedy[reference])
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            del variant
    args.output.with_suffix(".json").write_text(json.dumps(report, indent=2))
    lines = [f"# Quantized weights' costs ({report['machine']['cpu']}, {args.threads} threads)", "",
             "| model | weights | step ms | " + " | ".join(f"{w}-token pass / step" for w in WIDTHS[1:])
             + " | perplexity | greedy tokens equal to the float reference's |", "|---" * (4 + len(WIDTHS)) + "|"]
    for row in report["rows"]:
        ratios = " | ".join(f"{row['pass_ms'][w] / row['step_ms']:.2f}" for w in WIDTHS[1:])
        agreement = row.get("greedy_agreement")
        lines.append(f"| {row['model']} | {row['weights']} | {row['step_ms']:.1f} | {ratios} | "
                     f"{row['perplexity']:.3f} | {'-' if agreement is None else f'{agreement:.0%}'} |")
    args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
