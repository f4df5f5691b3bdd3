"""What the built-in pair's GGUF blocks cost on this CPU: each kind of layer's multiply by rows (1 to 150), beside
float32 dense; the whole target's and draft's passes (GGUF against float32); and the machine's read bandwidth, so
that a step can be set against the memory limit (bytes read per step over bandwidth).

    python scripts/gguf_costs.py --threads 2 --output benchmarks/<class>/<date>-gguf-costs.json

Run it alone: a second busy process on 2 cores changes every figure.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from hf_spec.bench.measure import machine_info
from hf_spec.loading.gguf_weights import TYPES, _file_tensors, gguf_kernel
from hf_spec.loading.pretrained import gguf_file, load
from hf_spec.timing.probe import forward_seconds

LAYERS = ("blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "blk.1.ffn_down.weight", "blk.0.attn_q.weight",
          "output.weight")
ROWS = (1, 2, 4, 6, 8, 16, 64, 150)


def best_ms(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = gguf_kernel()
    report = {"machine": machine_info(), "args": vars(args) | {"output": str(args.output)}, "layers": [],
              "models": {}}
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB of float32
    report["read_bandwidth_gb_s"] = round(big.numel() * 4 / 1e9 / (best_ms(big.sum, args.repeats) / 1000), 1)
    del big
    tensors = _file_tensors(gguf_file("qwen2.5-coder-1.5b-instruct"))
    for name in LAYERS:
        ggml_type, blocks = tensors[name]
        blocks = torch.from_numpy(np.array(blocks))
        _, inputs, size = TYPES[ggml_type]
        rows, width = blocks.shape[0], blocks.shape[1] // size * inputs
        dense = torch.randn(rows, width)
        entry = {"tensor": name, "type": TYPES[ggml_type][0], "shape": [rows, width], "bytes": blocks.numel(),
                 "gguf_ms": {}, "float32_ms": {}}
        for count in ROWS:
            x = torch.randn(count, width)
            repeats = max(2, args.repeats // (4 if rows > 100_000 else 1))
            entry["gguf_ms"][count] = round(best_ms(lambda: kernel.gguf_mm(x, blocks, ggml_type), repeats), 3)
            entry["float32_ms"][count] = round(best_ms(lambda: torch.nn.functional.linear(x, dense), repeats), 3)
        entry["step_gb_s"] = round(blocks.numel() / 1e6 / entry["gguf_ms"][1], 1)
        report["layers"].append(entry)
        print(json.dumps(entry), flush=True)
    for role, name in (("target", "qwen2.5-coder-1.5b-instruct"), ("draft", "qwen2.5-coder-0.5b-instruct")):
        for scheme in ("gguf", None):
            model, _ = load(name, dtype=torch.float32, quantize=scheme)
            ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
            seconds = forward_seconds(model, ids, [1, 2, 3, 4, 5, 6, 8], repeats=args.repeats)
            blocks = sum(buffer.numel() for name_, buffer in model.named_buffers() if name_.endswith("blocks"))
            report["models"][f"{role} {scheme or 'float32'}"] = {
                "ms": {width: round(1000 * value, 1) for width, value in seconds.items()},
                "gguf_block_bytes": blocks}
            print(role, scheme, report["models"][f"{role} {scheme or 'float32'}"], flush=True)
            del model
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
