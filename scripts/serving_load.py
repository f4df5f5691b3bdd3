"""Load test of continuous batching on the built-in pair: transformers' own engine (target only) against hf_spec's
speculative steps (a fixed k and auto k per request), same model object, weights and kernels, one process, run alone.

    python scripts/serving_load.py --concurrency 1 2 4 8 --num-requests 8 --max-new-tokens 48 --request-rate 1

Requests are HumanEval prompts (held out from 100 on), greedy. They arrive as a Poisson process (``--request-rate``
per second, the same arrival times for every engine), and at most c are in flight: a request that arrives while c
are running waits at the client. Reported per engine and c: throughput (generated tokens / seconds from the first
arrival to the last token), time to first token from sending (p50, p99), the client-side wait, time per output token
after the first (p50, p99), KV-cache bytes per request in flight (target's and, for hf_spec, the draft's, sampled
every 20 ms), acceptance, and how many requests equal `generate()` alone.

Warm figures: each engine first serves two of the prompts (a warm-up the table leaves out), and with ``--repeats R``
the engines take turns (ABBA order) R times per c; the table gives the median throughput, its range, and the
medians of the other columns. The first cell of the process, before any warm-up, is reported on its own (what the
first requests of a fresh server meet).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import threading
import time

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from hf_spec.bench.workloads import text_workloads
from hf_spec.loading import load_pair


def used_bytes(cache) -> float:
    total = sum(allocator.bytes_per_block * allocator.pool.count_free_blocks(allocator.index)
                for allocator in cache.cache_allocators.values())
    return cache.num_sectors * cache.bytes_per_sector - len(cache.pool.free_sectors) * cache.bytes_per_sector - total


def sample_cache(manager, pending: set, samples: list, done: threading.Event) -> None:
    """Every 20 ms while requests are in flight: the bytes the target's (and the draft's) paged cache holds."""
    while not done.wait(0.02):
        processor, in_flight = manager.batch_processor, len(pending)
        if processor is not None and in_flight:
            draft = getattr(processor, "draft_cache", None)
            samples.append(((used_bytes(processor.cache), used_bytes(draft) if draft else 0.0), in_flight))


def run(manager, prompts: list[list[int]], arrivals: list[float], concurrency: int) -> dict:
    manager.start()
    try:
        warm = manager.add_request(prompts[0][:16], max_new_tokens=2)  # the manager builds its cache, as a server's
        while (output := manager.get_result(timeout=120)) is None or output.request_id != warm:  # first request would
            pass
        submitted, pending, done, sent, samples = 0, set(), {}, {}, []
        sampling = threading.Event()
        threading.Thread(target=sample_cache, args=(manager, pending, samples, sampling), daemon=True).start()
        start = time.perf_counter()
        while len(done) < len(prompts):
            now = time.perf_counter() - start
            while submitted < len(prompts) and len(pending) < concurrency and arrivals[submitted] <= now:
                request_id = manager.add_request(prompts[submitted], record_timestamps=True)
                sent[request_id] = (time.perf_counter(), arrivals[submitted] + start)
                pending.add(request_id)
                submitted += 1
            wait = arrivals[submitted] - now if submitted < len(prompts) and len(pending) < concurrency else 1.0
            output = manager.get_result(timeout=max(0.001, wait))
            if output is None:
                continue
            if output.is_finished():
                pending.discard(output.request_id)
                done[output.request_id] = output
        wall = time.perf_counter() - start
        sampling.set()
    finally:
        manager.stop(block=True)
    tokens = sum(len(o.generated_tokens) for o in done.values())
    ttft = [o.timestamps[0] - sent[i][0] for i, o in done.items()]
    queued = [sent[i][0] - sent[i][1] for i in done]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / max(1, len(o.timestamps) - 1) for o in done.values()]
    order = sorted(done, key=lambda i: sent[i][0])
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens,
            "ttft_p50": _p(ttft, 50), "ttft_p99": _p(ttft, 99), "queued_p50": _p(queued, 50),
            "tpot_p50": _p(tpot, 50), "tpot_p99": _p(tpot, 99),
            "kv_bytes_per_request": float(np.mean([t / n for (t, _), n in samples])) if samples else None,
            "draft_kv_bytes_per_request": float(np.mean([d / n for (_, d), n in samples])) if samples else None,
            "acceptance": _acceptance(done.values()), "drafted": _drafted(done.values()),
            "outputs": [done[i].generated_tokens for i in order]}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _p(values: list[float], q: int) -> float:
    return float(np.percentile(values, q))


def _acceptance(outputs) -> float | None:
    stats = [o.speculative_stats for o in outputs if hasattr(o, "speculative_stats")]
    drafted = sum(s["num_drafted"] for s in stats)
    return sum(s["num_accepted"] for s in stats) / drafted if drafted else None


def _drafted(outputs) -> float | None:
    """Drafted tokens per step, over every request (None without speculation)."""
    stats = [o.speculative_stats for o in outputs if hasattr(o, "speculative_stats")]
    steps = sum(s["num_steps"] for s in stats)
    return sum(s["num_drafted"] for s in stats) / steps if steps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--request-rate", type=float, default=1.0, help="Poisson arrivals per second")
    parser.add_argument("--engines", nargs="+", default=["transformers", "k=4", "auto"],
                        help="transformers (no draft), k=N (hf_spec, fixed k), auto (hf_spec, auto k per request)")
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs per engine and c, in turns (ABBA)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = load_pair()
    prompts = [w["input_ids"][0].tolist()
               for w in text_workloads(pair.tokenizer, ("code",), args.num_requests, offset=100)["code"]]
    rng = np.random.default_rng(args.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / args.request_rate, len(prompts))).tolist()
    arrivals = [a - arrivals[0] for a in arrivals]  # the first at 0
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=pair.tokenizer.eos_token_id)
    cache = ContinuousBatchingConfig(num_blocks=256, page_size=args.page_size, max_batch_tokens=512)
    def measure(engine: str, concurrency: int, some_prompts=prompts, some_arrivals=arrivals) -> dict:
        extra = {} if engine == "transformers" else {
            "assistant_model": pair.draft,
            "num_assistant_tokens": "auto" if engine == "auto" else int(engine.removeprefix("k="))}
        manager = pair.target.init_continuous_batching(config, cache, **extra)
        return {"engine": engine, "concurrency": concurrency, **run(manager, some_prompts, some_arrivals, concurrency)}

    first = measure(args.engines[0], args.concurrency[0])  # a fresh process: nothing warmed yet
    print("first cell:", json.dumps({k: v for k, v in first.items() if k != "outputs"}), flush=True)
    for engine in args.engines:
        measure(engine, 2, prompts[:2], [0.0, 0.0])  # warm-up, left out
    runs = []
    for repeat in range(args.repeats):
        for concurrency in args.concurrency:
            for engine in args.engines if repeat % 2 == 0 else args.engines[::-1]:
                runs.append(measure(engine, concurrency))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "outputs"}), flush=True)
    alone = [pair.target.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]
    rows = []
    for concurrency in args.concurrency:
        for engine in args.engines:
            cell = [r for r in runs if r["engine"] == engine and r["concurrency"] == concurrency]
            row = {"engine": engine, "concurrency": concurrency,
                   "range": (min(r["tokens_per_s"] for r in cell), max(r["tokens_per_s"] for r in cell)),
                   "equal_to_generate_alone": min(sum(a == b for a, b in zip(r["outputs"], alone, strict=True))
                                                  for r in cell)}
            for name in ("tokens_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "kv_bytes_per_request",
                         "draft_kv_bytes_per_request", "acceptance", "drafted"):
                values = [r[name] for r in cell if r[name] is not None]
                row[name] = float(np.median(values)) if values else None
            rows.append(row)
    plain = {row["concurrency"]: row for row in rows if row["engine"] == "transformers"}
    flags = subprocess.run(["grep", "-m1", "-o", "-w", "-E", "avx512_bf16|avx512f|avx2", "/proc/cpuinfo"],
                           capture_output=True, text=True, check=False).stdout.split()
    print(f"\n{platform.processor() or platform.machine()}, best flag {flags[:1]}, {args.threads} threads, "
          f"{len(prompts)} requests x {args.max_new_tokens} tokens, Poisson {args.request_rate}/s, "
          f"medians of {args.repeats} run(s)\n")
    print("| c | engine | tok/s (range) | vs transformers | TTFT p50 / p99 s | time/token p50 / p99 ms | KV MB/request "
          "(target + draft) | drafted/step | acceptance | = generate() alone |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        base = plain.get(row["concurrency"])
        ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        kv = row["kv_bytes_per_request"] or 0.0
        draft_kv = row["draft_kv_bytes_per_request"] or 0.0
        low, high = row["range"]
        print(f"| {row['concurrency']} | {row['engine']} | {row['tokens_per_s']:.2f} ({low:.2f}-{high:.2f}) | "
              f"{ratio} | {row['ttft_p50']:.2f} / {row['ttft_p99']:.2f} | {1e3 * row['tpot_p50']:.0f} / "
              f"{1e3 * row['tpot_p99']:.0f} | {kv / 2**20:.1f} + {draft_kv / 2**20:.1f} | "
              f"{_fmt(row['drafted'])} | {_fmt(row['acceptance'])} | "
              f"{row['equal_to_generate_alone']}/{len(prompts)} |")


if __name__ == "__main__":
    main()
