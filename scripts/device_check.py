"""The GPU check: exactness on the device, the cost table of real model shapes, the loop's own overheads measured
with an acceptance oracle, and batches. One command, one JSON and one Markdown summary.

    python scripts/device_check.py --output OUT            # on CUDA when present (about 5 minutes on one H200)
    python scripts/device_check.py --quick --output OUT    # tiny shapes on the CPU (part of the test suite)

What it measures:

1. Exactness on the device: the statistical tests (enumerated target law against speculative samples) for plain
   sampling, top-p with a repetition penalty, a ragged batch of 8 rows, and trees of draft-model nodes (tree
   attention masks and cache gathers on the device), with a ``torch.Generator`` on the device, plus the negative
   control that must fail; greedy equality with target-only decoding on a ragged batch, and with trees.
2. Costs, bf16, random weights of real shapes (Qwen2.5-Coder-1.5B and 0.5B, and a Qwen2.5-7B-shaped target with the
   0.5B draft): a target step, passes over 2, 4, 8, 16 and 32 tokens (b), a draft step (c).
3. The acceptance oracle (`hf_spec.drafting.oracle.OracleDrafter`): the target's own greedy continuation replayed
   with acceptance 1.0 and 0.8, paying for the real draft's forward passes: tokens/s against target-only decoding, the
   formula's prediction with the measured a, b and c, the share of it reached, the loop's own seconds per round
   outside the two models' passes, and host synchronizations per round (counted with
   ``torch.cuda.set_sync_debug_mode``).
4. Batches of 1, 4 and 16 rows with the oracle: tokens/s of target-only decoding and of hf_spec.
5. Static caches and compiled passes (the first pair, the oracle at acceptance 0.8, k = 3): target-only decoding and
   hf_spec on a dynamic cache, on a static cache, and compiled on a static cache (``mode="reduce-overhead"``: CUDA
   graphs), each timed on its second call; the first call's seconds (it compiles), graphs compiled, identical
   outputs.
6. Whisper large-v3 with a distil-large-v3-shaped assistant (`device_whisper`): the encoder pass, the decoder and
   assistant steps, greedy equality in a batch of two with one encoder pass, tokens/s of target-only, k = 5 and auto
   (real weights where ``HF_SPEC_WHISPER_TARGET`` and ``HF_SPEC_WHISPER_ASSISTANT`` name local folders).

The JSON is written after every section, so a run cut short keeps what it measured.

Random weights give meaningless text but real costs; the output layers are scaled so that greedy choices are clear
(the oracle's answer then survives bf16 rounding). Nothing here needs the Hub: configs are written out below.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from device_whisper import whisper_check, whisper_summary  # scripts/, beside this file
from transformers import CompileConfig, Qwen2Config, Qwen2ForCausalLM

import hf_spec
from hf_spec import speculative, without_speculation
from hf_spec.bench.measure import machine_info
from hf_spec.compiled import compiled_forward
from hf_spec.drafting.model import ModelDrafter
from hf_spec.drafting.oracle import OracleDrafter
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, exact_law, fit_sequences
from hf_spec.loading.tiny import build_tiny_model, noisy_copy
from hf_spec.sizing.speedup import acceptance_from_tokens_per_pass, predicted_speedup
from hf_spec.timing.probe import measure_costs, synchronize

#: Configs of the shapes measured (layers, hidden, MLP, heads, key-value heads, vocabulary).
SHAPES = {
    "qwen2.5-coder-0.5b": (24, 896, 4864, 14, 2, 151936),
    "qwen2.5-coder-1.5b": (28, 1536, 8960, 12, 2, 151936),
    "qwen2.5-7b": (28, 3584, 18944, 28, 4, 152064),
}
QUICK_SHAPES = {"tiny-draft": (1, 64, 128, 4, 2, 512), "tiny-target": (2, 128, 256, 4, 2, 512)}
PAIRS = [("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"), ("qwen2.5-7b", "qwen2.5-coder-0.5b")]
QUICK_PAIRS = [("tiny-target", "tiny-draft")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="folder for device_check.json and device_check.md")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few samples (the CPU run of the tests)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or device.type != "cuda"
    started = time.perf_counter()
    report = {"machine": machine_info(), "device": str(device), "quick": quick, "hf_spec": hf_spec.__file__}
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report["seconds"] = time.perf_counter() - started
        (output / "device_check.json").write_text(json.dumps(report, indent=2, default=str))

    report["exactness"] = check_exactness(device, quick)
    report["greedy"] = check_greedy(device)
    save()
    shapes, pairs = (QUICK_SHAPES, QUICK_PAIRS) if quick else (SHAPES, PAIRS)
    models = {}
    report["costs"], report["oracle"], report["batches"] = [], [], []
    for target_name, draft_name in pairs:
        for name in (target_name, draft_name):
            models.setdefault(name, random_model(shapes[name], device))
        target, draft = speculative(models[target_name]), models[draft_name]
        costs = measure_costs(target, ModelDrafter(draft), random_ids(target, 1, 128 if not quick else 16, device),
                              [2, 4, 6, 8, 16, 32], repeats=5 if not quick else 2)
        report["costs"].append({"target": target_name, "draft": draft_name, **dataclasses.asdict(costs),
                                "cost_ratio": costs.cost_ratio})
        new_tokens = 16 if quick else 128
        for acceptance in (1.0, 0.8):
            report["oracle"].append(oracle_run(target, draft, costs, acceptance, 5, 1, new_tokens, device,
                                               target_name, draft_name))
        if target_name == pairs[0][0]:
            for batch_size in (1, 4, 16):
                report["batches"].append(oracle_run(target, draft, costs, 1.0, 5, batch_size, new_tokens, device,
                                                    target_name, draft_name))
        if target_name == pairs[0][0]:
            save()
            report["compiled"] = compiled_runs(target, draft, device, target_name, 16 if quick else 64)
        models.pop(target_name)
        save()
    models.clear()
    report["whisper"] = whisper_check(device, quick)
    save()
    (output / "device_check.md").write_text(summary(report))
    print(summary(report))


def random_model(shape: tuple, device: torch.device) -> Qwen2ForCausalLM:
    """Random bf16 weights of a real shape (fp32 on the CPU); the output layer scaled for clear greedy choices."""
    layers, hidden, mlp, heads, kv_heads, vocab = shape
    config = Qwen2Config(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=mlp,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         tie_word_embeddings=False, max_position_embeddings=4096)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(hash(shape) % 2**31)
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def random_ids(model, batch_size: int, length: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(length * 31 + batch_size)  # ids from 1: 0 is the pad id
    return torch.randint(1, model.config.vocab_size, (batch_size, length), generator=generator).to(device)


def check_exactness(device: torch.device, quick: bool) -> list[dict]:
    """Speculative samples against the enumerated law (vocabulary 4, three tokens), on ``device``."""
    target = speculative(build_tiny_model(10, vocab_size=4, num_layers=1, head_scale=3.0).to(device))
    draft = noisy_copy(target, seed=12, noise=1.0).to(device)
    num_samples = 1200 if quick else 4000
    results = []
    cases = [("plain sampling, k=2", {}, 2, [[1, 3, 2]]),
             ("top-p 0.9 + repetition penalty 3.0, k=3", {"top_p": 0.9, "repetition_penalty": 3.0}, 3, [[1, 3, 2]]),
             ("ragged batch of 8 (prompts of 3, 5, 2 and 4 tokens), T=0.8, top-k 3, k=3",
              {"temperature": 0.8, "top_k": 3}, 3, [[1, 3, 2], [2, 0, 1, 1, 3], [3, 1], [0, 2, 2, 1]])]
    for name, settings, k, prompts in cases:
        samples = sample_rows(target, draft, settings, k, prompts, num_samples, device, seed=len(name))
        for prompt, prompt_samples in zip(prompts, samples):
            law = exact_law(target, {**settings, "max_new_tokens": 3, "min_new_tokens": 3},
                            torch.tensor([prompt], device=device), 3)
            fit = fit_sequences(prompt_samples, law)
            results.append({"case": name, "prompt": prompt, **dataclasses.asdict(fit), "passed": fit.is_consistent})
    # a tree of 6 draft-model nodes per round (children drawn without replacement), one row per call
    num_tree_samples = 300 if quick else 2000
    generator = torch.Generator(device).manual_seed(7)
    prompt = torch.tensor([[1, 3, 2]], device=device)
    samples = torch.stack([
        target.generate(prompt, assistant_model=draft, do_sample=True, num_tree_nodes=6, num_assistant_tokens=3,
                        generator=generator, pad_token_id=0, max_new_tokens=3, min_new_tokens=3)[0, 3:].cpu()
        for _ in range(num_tree_samples)
    ]).numpy()
    fit = fit_sequences(samples, exact_law(target, {"max_new_tokens": 3, "min_new_tokens": 3}, prompt, 3))
    results.append({"case": "tree of 6 draft-model nodes, depth 3, one row", "prompt": [1, 3, 2],
                    **dataclasses.asdict(fit), "passed": fit.is_consistent})
    # the negative control: resampling from p instead of the residual must be caught
    samples = sample_rows(target, draft, {"verification": RESAMPLE_FROM_P}, 2, [[1, 3, 2]], num_samples, device,
                          seed=99)[0]
    fit = fit_sequences(samples, exact_law(target, {"max_new_tokens": 3, "min_new_tokens": 3},
                                           torch.tensor([[1, 3, 2]], device=device), 3))
    results.append({"case": "negative control: resample from p (must fail)", "prompt": [1, 3, 2],
                    **dataclasses.asdict(fit), "passed": not fit.is_consistent})
    return results


def sample_rows(target, draft, settings, k, prompts, num_samples, device, seed):
    """Per prompt ``[num_samples, 3]`` generated ids, from left-padded batches of 8 rows cycling through the
    prompts, with a generator on ``device``."""
    width = max(map(len, prompts))
    rows = [F.pad(torch.tensor(p), (width - len(p), 0)) for p in prompts]
    masks = [F.pad(torch.ones(len(p), dtype=torch.long), (width - len(p), 0)) for p in prompts]
    batch = 8 if len(prompts) > 1 else 400
    order = [i % len(prompts) for i in range(batch)]
    input_ids = torch.stack([rows[i] for i in order]).to(device)
    attention_mask = torch.stack([masks[i] for i in order]).to(device)
    generator = torch.Generator(device).manual_seed(seed)
    collected = [[] for _ in prompts]
    while min(map(len, collected)) < num_samples:
        output = target.generate(input_ids, attention_mask=attention_mask, assistant_model=draft, do_sample=True,
                                 num_assistant_tokens=k, generator=generator, pad_token_id=0, max_new_tokens=3,
                                 min_new_tokens=3, **settings)[:, width:].cpu()
        for row, prompt_index in enumerate(order):
            collected[prompt_index].append(output[row])
    return [torch.stack(c[:num_samples]).numpy() for c in collected]


def check_greedy(device: torch.device) -> dict:
    target = speculative(build_tiny_model(0).to(device))
    draft = build_tiny_model(3).to(device)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    common = {"attention_mask": mask, "max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    expected = without_speculation_generate(target, ids, **common)
    output = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **common)
    single = {"max_new_tokens": 24, "do_sample": False}
    tree_identical = all(  # trees take one row per call: against target-only decoding of that row alone
        torch.equal(target.generate(row, assistant_model=draft, num_tree_nodes=8, **single),
                    without_speculation_generate(target, row, **single))
        for row in (torch.tensor([prompt], device=device) for prompt in prompts))
    return {"identical": bool(torch.equal(output.sequences, expected)),
            "acceptance_rate": output.speculative_stats.acceptance_rate, "tree_identical": tree_identical}


def without_speculation_generate(target, *args, **kwargs):
    with without_speculation(target):
        return target.generate(*args, **kwargs)


@contextlib.contextmanager
def counting_syncs(device: torch.device):
    """Count host synchronizations (CUDA's sync debug mode warns at each); nothing to count on the CPU."""
    counted = {"syncs": None}
    if device.type != "cuda":
        yield counted
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            yield counted
        finally:
            torch.cuda.set_sync_debug_mode(0)
    counted["syncs"] = sum("synchroniz" in str(w.message) for w in caught)


def oracle_run(target, draft, costs, acceptance, k, batch_size, new_tokens, device, target_name, draft_name):
    """hf_spec with the oracle (paying for the draft's passes) against target-only decoding, greedy."""
    prompt = random_ids(target, batch_size, 32, device)
    common = {"attention_mask": torch.ones_like(prompt), "do_sample": False, "max_new_tokens": new_tokens,
              "min_new_tokens": new_tokens, "pad_token_id": 0}
    without_speculation_generate(target, prompt, **{**common, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    synchronize(device)
    started = time.perf_counter()
    reference = without_speculation_generate(target, prompt, **common)
    synchronize(device)
    target_only_seconds = time.perf_counter() - started
    oracle = OracleDrafter(reference, acceptance, draft_model=draft,
                           generator=torch.Generator(device).manual_seed(7))
    with counting_syncs(device) as counted:
        synchronize(device)
        started = time.perf_counter()
        output = target.generate(prompt, assistant_model=oracle, num_assistant_tokens=k, return_dict_in_generate=True,
                                 **common)
        synchronize(device)
        seconds = time.perf_counter() - started
    stats = output.speculative_stats
    tokens = batch_size * new_tokens
    per_round_model = costs.block_cost(k) * costs.target_step_seconds + k * costs.draft_step_seconds
    alpha = acceptance_from_tokens_per_pass(stats.tokens_per_round / batch_size, k)
    predicted = predicted_speedup(alpha, k, costs.cost_ratio, costs.block_cost(k))
    speedup = target_only_seconds / seconds
    return {
        "target": target_name, "draft": draft_name, "oracle_acceptance": acceptance, "k": k, "batch_size": batch_size,
        "new_tokens_per_row": new_tokens, "target_only_tokens_per_second": tokens / target_only_seconds,
        "hf_spec_tokens_per_second": tokens / seconds, "speedup": speedup,
        "identical_to_target_only": bool(torch.equal(output.sequences, reference)),
        "measured_acceptance": stats.acceptance_rate, "tokens_per_round_per_row": stats.tokens_per_round / batch_size,
        "predicted_speedup": predicted if batch_size == 1 else None,
        "share_of_predicted": speedup / predicted if batch_size == 1 else None,
        "loop_seconds_per_round": seconds / stats.num_rounds - per_round_model if batch_size == 1 else None,
        "host_syncs_per_round": None if counted["syncs"] is None else counted["syncs"] / stats.num_rounds,
    }


def compiled_runs(target, draft, device, target_name, new_tokens, acceptance=0.8, k=3) -> list[dict]:
    """Target-only and hf_spec (the oracle at ``acceptance``) on a dynamic cache, a static cache, and compiled on a
    static cache: the second call timed, the first call's seconds (it compiles), graphs, identical outputs."""
    config = (CompileConfig(fullgraph=False, dynamic=False) if device.type == "cuda"  # reduce-overhead: CUDA graphs
              else CompileConfig(fullgraph=False, dynamic=False, backend="eager", mode=None))  # the CPU test: fast
    config._compile_all_devices = True  # transformers' own generate compiles off CUDA only when told to
    prompt = random_ids(target, 1, 32, device)
    common = {"do_sample": False, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "pad_token_id": 0}
    reference = without_speculation_generate(target, prompt, **common)
    cases = {"dynamic": {}, "static": {"cache_implementation": "static"},
             "static, compiled": {"cache_implementation": "static", "compile_config": config}}
    rows = []
    for case, extra in cases.items():
        for method in ("target_only", "hf_spec"):
            def call(method=method, extra=extra):
                if method == "target_only":
                    return without_speculation_generate(target, prompt, **common, **extra)
                oracle = OracleDrafter(reference, acceptance, draft_model=draft,
                                       generator=torch.Generator(device).manual_seed(7))
                return target.generate(prompt, assistant_model=oracle, num_assistant_tokens=k, **common, **extra)
            seconds = []
            for _ in range(2):  # the first call compiles
                synchronize(device)
                started = time.perf_counter()
                output = call()
                synchronize(device)
                seconds.append(time.perf_counter() - started)
            graphs = (sum(compiled_forward(m, config).num_graphs for m in (target, draft))
                      if method == "hf_spec" and "compile_config" in extra else None)
            rows.append({"target": target_name, "case": case, "method": method, "k": k, "oracle_acceptance": acceptance,
                         "first_call_seconds": seconds[0], "tokens_per_second": new_tokens / seconds[1],
                         "graphs": graphs, "identical_to_target_only": bool(torch.equal(output, reference))})
    return rows


def summary(report: dict) -> str:
    def number(value, spec="") -> str:
        return "-" if value is None else format(value, spec)

    lines = [(f"# Device check on {report['device']} ({report['machine']['cuda'] or report['machine']['cpu']}), "
             f"{'quick' if report['quick'] else 'full'}, {report.get('seconds', 0):.0f} s"), "",
             "## Exactness", "", "| case | prompt | p-value | TV | bound | passed |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['prompt']} | {r['p_value']:.3g} | {r['total_variation']:.4f} | {r['tv_bound']:.4f} "
              f"| {r['passed']} |" for r in report["exactness"]]
    lines += ["", (f"Greedy ragged batch identical to target-only: {report['greedy']['identical']}; greedy trees "
                   f"(8 nodes, one row per call) identical: {report['greedy']['tree_identical']}."), "", "## Costs", "",
              "| target | draft | step ms | b(2) | b(4) | b(8) | b(16) | b(32) | draft step ms | c |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["costs"]:
        step, blocks = c["target_step_seconds"], c["target_block_seconds"]
        lines.append(f"| {c['target']} | {c['draft']} | {step * 1e3:.2f} | "
                     + " | ".join(f"{blocks[n] / step:.2f}" for n in (2, 4, 8, 16, 32))
                     + f" | {c['draft_step_seconds'] * 1e3:.2f} | {c['cost_ratio']:.3f} |")
    lines += ["", "## Oracle and batches (greedy, k = 5)", "",
              ("| target | oracle a | batch | target-only tok/s | hf_spec tok/s | speed-up | predicted | share "
               "| loop ms/round | syncs/round | measured a | identical |"), "|---" * 12 + "|"]
    for r in report["oracle"] + report["batches"]:
        loop = None if r["loop_seconds_per_round"] is None else r["loop_seconds_per_round"] * 1e3
        lines.append(f"| {r['target']} | {r['oracle_acceptance']} | {r['batch_size']} | "
                     f"{r['target_only_tokens_per_second']:.1f} | {r['hf_spec_tokens_per_second']:.1f} | "
                     f"{r['speedup']:.2f}x | {number(r['predicted_speedup'], '.2f')} | "
                     f"{number(r['share_of_predicted'], '.0%')} | {number(loop, '.2f')} | "
                     f"{number(r['host_syncs_per_round'], '.1f')} | {r['measured_acceptance']:.2f} | "
                     f"{r['identical_to_target_only']} |")
    lines += ["", "## Static caches and compiled passes (greedy, batch 1)", "",
              "| target | cache | method | tok/s | first call s | graphs | identical |", "|---" * 7 + "|"]
    lines += [f"| {r['target']} | {r['case']} | {r['method']} | {r['tokens_per_second']:.1f} | "
              f"{r['first_call_seconds']:.1f} | {number(r['graphs'])} | {r['identical_to_target_only']} |"
              for r in report.get("compiled", [])]
    lines += whisper_summary(report.get("whisper"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
