"""Measure every CPU forward path of a model (`hf_spec.loading.packed`): a pass over 1 .. 16 tokens after a short
context, for the stock, dense and packed paths, with oneDNN on and off; prints a Markdown table and writes JSON.

    python scripts/cpu_paths.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16 --threads 2 --output paths.json

To see what an AVX2-only CPU does on a machine with AVX512, cap both kernel libraries first:
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/cpu_paths.py ...`` (an emulation: the memory system
stays this machine's).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from hf_spec.bench.measure import machine_info
from hf_spec.loading.packed import deoptimize, optimize, time_passes
from hf_spec.loading.pretrained import load

WIDTHS = [1, 2, 4, 6, 8, 12, 16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load(args.model, dtype=getattr(torch, args.dtype))
    seconds = {}
    dense = time_passes(model, WIDTHS, args.repeats)
    seconds["stock (oneDNN on)"], seconds["torch's own kernels (oneDNN off)"] = dense[True], dense[False]
    path = optimize(model, path="packed")
    if path.name == "packed":
        packed = time_passes(model, WIDTHS, args.repeats)
        seconds["packed, rest oneDNN on"], seconds["packed, rest oneDNN off"] = packed[True], packed[False]
    deoptimize(model)
    report = {"model": args.model, "dtype": args.dtype, "machine": machine_info(), "seconds": seconds,
              "env": {name: os.environ.get(name) for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")},
              "packed_available": path.name == "packed", "reason": path.reason}
    print(f"| path | {' | '.join(f'{w} tok' for w in WIDTHS)} |")
    print("|---|" + "---|" * len(WIDTHS))
    for name, by_width in seconds.items():
        print(f"| {name} | " + " | ".join(f"{by_width[w] * 1e3:.0f}" for w in WIDTHS) + " |")
    if not report["packed_available"]:
        print(f"packed: {path.reason}")
    print(report["machine"], report["env"])
    if args.output:
        with open(args.output, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
