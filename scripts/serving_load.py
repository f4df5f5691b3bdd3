"""Load test of continuous batching on the built-in pair: transformers' own engine (target only) against hf_spec's
speculative steps, same model object, weights and kernels, one process, run alone.

    python scripts/serving_load.py --concurrency 1 2 4 --num-requests 8 --max-new-tokens 64

Requests are HumanEval prompts (held out from 100 on), greedy. At concurrency c, c requests are in flight at any time
(a closed loop: each finished request is replaced by the next until all are done). Reported per engine and c:
throughput (generated tokens / wall seconds), time to first token and time per output token after the first (p50,
p99 over requests), and the KV-cache bytes per request (paged blocks held at the peak / requests in flight).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from hf_spec.bench.workloads import text_workloads
from hf_spec.loading import load_pair


def run(manager, prompts: list[list[int]], concurrency: int) -> dict:
    manager.start()
    try:
        submitted, pending, done = 0, set(), {}
        start = time.perf_counter()
        created = {}
        while len(done) < len(prompts):
            while len(pending) < concurrency and submitted < len(prompts):
                request_id = manager.add_request(prompts[submitted], record_timestamps=True)
                created[request_id] = time.perf_counter()
                pending.add(request_id)
                submitted += 1
            output = manager.get_result(timeout=60)
            if output is not None and output.is_finished():
                pending.discard(output.request_id)
                done[output.request_id] = output
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    tokens = sum(len(o.generated_tokens) for o in done.values())
    ttft = [o.timestamps[0] - created[i] for i, o in done.items()]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / max(1, len(o.timestamps) - 1) for o in done.values()]
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens,
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
            "tpot_p50": float(np.percentile(tpot, 50)), "tpot_p99": float(np.percentile(tpot, 99)),
            "acceptance": _acceptance(done.values()),
            "outputs": [done[i].generated_tokens for i in sorted(done, key=lambda i: int(i.split("_")[-1]))]}


def _acceptance(outputs) -> float | None:
    stats = [o.speculative_stats for o in outputs if hasattr(o, "speculative_stats")]
    drafted = sum(s["num_drafted"] for s in stats)
    return sum(s["num_accepted"] for s in stats) / drafted if drafted else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-assistant-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = load_pair()
    prompts = [w["input_ids"][0].tolist()
               for w in text_workloads(pair.tokenizer, ("code",), args.num_requests, offset=100)["code"]]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=pair.tokenizer.eos_token_id)
    cache = ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=512)
    alone = [pair.target.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]
    rows = []
    for concurrency in args.concurrency:
        for engine in ("transformers", "hf_spec"):
            extra = {} if engine == "transformers" else {"assistant_model": pair.draft,
                                                         "num_assistant_tokens": args.num_assistant_tokens}
            manager = pair.target.init_continuous_batching(config, cache, **extra)
            result = run(manager, prompts, concurrency)
            rows.append({"engine": engine, "concurrency": concurrency, **result})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "outputs"}), flush=True)
        agree = [sum(a == b for a, b in zip(row["outputs"], alone, strict=True)) for row in rows[-2:]]
        print(f"concurrency {concurrency}: speculative/plain throughput "
              f"{rows[-1]['tokens_per_s'] / rows[-2]['tokens_per_s']:.2f}x; requests equal to generate() alone: "
              f"transformers {agree[0]}/{len(prompts)}, hf_spec {agree[1]}/{len(prompts)}", flush=True)
    print("cpu:", platform.processor() or platform.machine(), "threads:", args.threads)


if __name__ == "__main__":
    main()
