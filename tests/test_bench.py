"""``hf-spec bench``: the formula, the counting, and the report it writes (on the tiny pair)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_model
from transformers import CompileConfig

import hf_spec.bench.methods
import hf_spec.bench.runner
from hf_spec import speculative, without_speculation
from hf_spec.bench.measure import ForwardCounter
from hf_spec.bench.methods import method_spec
from hf_spec.bench.report import format_table, plot
from hf_spec.bench.runner import run_benchmark
from hf_spec.bench.workloads import random_workloads, text_workloads
from hf_spec.cli import main
from hf_spec.loading.tiny import TINY_VOCAB_SIZE, build_tiny_pair
from hf_spec.mixin import SpeculativeGenerationMixin
from hf_spec.sizing.speedup import acceptance_from_tokens_per_pass, expected_tokens, predicted_speedup

TINY = ["--target", "tiny", "--draft", "tiny"]
RESULT_FIELDS = {
    "workload", "setting", "method", "calls", "failed_calls", "new_tokens", "seconds", "tokens_per_second",
    "speedup_vs_target_only",
    "speedup_vs_own_target_only", "speedup_vs_transformers", "acceptance_rate", "tokens_per_target_pass", "alpha",
    "predicted_speedup", "speedup_vs_stock_target_only", "speedup_vs_best_target_only",
    "predicted_speedup_block_cost", "share_of_predicted", "share_of_predicted_block_cost", "latency_p50_seconds",
    "latency_p90_seconds", "weights_bytes", "working_memory_bytes", "peak_memory_bytes", "identical_to_target_only",
    "speedup_median", "speedup_min", "speedup_max", "modelled_speedup", "profile_shares", "probe_cost_ratio",
    "probe_block_cost", "in_run_cost_ratio", "in_run_block_cost", "predicted_speedup_in_run",
    "share_of_predicted_in_run", "lost_to_draft_prefill_and_catch_up", "lost_outside_the_passes",
}


def test_formula_limits_and_a_known_value():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    # (1 - 0.8^5) / ((1 - 0.8)(1 + 4 * 0.1)) = 0.67232 / 0.28
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx(2.401142857)
    # a (k+1)-block costing 2 steps instead of 1
    assert predicted_speedup(0.8, 4, 0.1, block_cost=2.0) == pytest.approx(0.67232 / 0.2 / 2.4)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.75, 0.99])
def test_acceptance_is_recovered_from_tokens_per_pass(alpha):
    assert acceptance_from_tokens_per_pass(expected_tokens(alpha, 5), 5) == pytest.approx(alpha, abs=1e-6)


def test_forward_counter_counts_one_target_pass_per_token():
    target, _ = build_tiny_pair(seed=1)
    with ForwardCounter(target) as calls:
        target.generate(torch.tensor([[1, 2, 3]]), do_sample=False, max_new_tokens=7)
    assert calls.count == 7
    target.generate(torch.tensor([[1, 2, 3]]), do_sample=False, max_new_tokens=2)
    assert calls.count == 7, "the hook is removed on exit"


PEAK_MEMORY_CHECK = """
import time, torch
from hf_spec.bench.measure import PeakMemory
with PeakMemory(torch.device("cpu")) as memory:
    block = torch.ones(64, 2**20, dtype=torch.uint8)  # 64 MiB, touched
    block.add_(1)
    time.sleep(0.05)  # the sampler looks every 5 ms
    del block
print(memory.peak_bytes)
"""


def test_peak_memory_sees_an_allocation():
    """In a fresh process: in this one, memory freed by earlier tests can serve the block without growing RSS."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", PEAK_MEMORY_CHECK], capture_output=True, text=True, check=True)
    peak_bytes = int(result.stdout.strip().splitlines()[-1])
    assert peak_bytes >= 48 * 2**20


def test_without_speculation_restores_transformers_assisted_decoding():
    target, draft = make_tiny_model(seed=2), make_tiny_model(seed=3)
    with pytest.raises(TypeError, match="not speculative"), without_speculation(target):
        pass
    target = speculative(target)
    prompt = torch.tensor([[1, 2]])
    with without_speculation(target) as plain:
        output = plain.generate(prompt, assistant_model=draft, max_new_tokens=4, return_dict_in_generate=True)
        assert output.sequences.shape == (1, 6) and not hasattr(output, "speculative_stats")
    assert isinstance(target, SpeculativeGenerationMixin)
    output = target.generate(prompt, assistant_model=draft, max_new_tokens=4, return_dict_in_generate=True)
    assert output.speculative_stats.num_rounds > 0


def test_bench_cli_writes_every_field_and_a_plot(tmp_path, capsys):
    report_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", *TINY, "--prompts", "2", "--max-new-tokens", "12", "--threads", "1", "--no-progress",
            "--output", str(report_path), "--plot", str(plot_path)]
    assert main(argv) == 0
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(report_path.read_text())
    assert set(report) == {"machine", "config", "weights_bytes", "costs", "cost_table", "results", "first_calls",
                           "runs"}
    assert report["config"]["cpu_paths"]["target"]["name"] in ("stock", "dense", "packed")
    # each method's first call, to the full length, timed apart and against target-only's first call
    firsts = report["first_calls"]
    assert set(firsts) == {"target_only", "transformers", "transformers_default", "hf_spec", "target_only@stock",
                           "target_only@steps"}
    assert firsts["target_only"]["speedup_vs_target_only"] == 1.0 and 0 < firsts["target_only"]["new_tokens"] <= 12
    assert all(entry["seconds"] > 0 and entry["tokens_per_second"] > 0 and entry["setting"] == "greedy"
               and entry["workload"] == "code" for entry in firsts.values())
    table = report["cost_table"]
    assert table["target_step_seconds"] > 0 and set(table["target_block_seconds"]) == {
        str(n) for n in (1, 2, 3, 4, 5, 6, 8, 10, 12)}  # up to k = 10, the sizes between interpolated
    out = capsys.readouterr().out
    assert "| tokens in the target pass | ms | b |" in out and "Each method's first call" in out
    assert {"cpu", "cpu_bf16_flags", "threads", "torch", "transformers", "date"} <= set(report["machine"])
    assert report["config"]["method_specs"]["transformers"]["assistant_settings"] == {
        "num_assistant_tokens": 5, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    for costs in report["costs"].values():
        assert costs["target_step_seconds"] > 0 and costs["draft_step_seconds"] > 0
        assert costs["block_cost_by_k"]["5"] > 0
    results = {(r["workload"], r["setting"], r["method"]): r for r in report["results"]}
    # (2 workloads + all of them) x 2 settings x (4 methods + target-only on stock kernels and on the step path)
    assert len(results) == 3 * 2 * 6 and len(report["runs"]) == 2 * 2 * 2 * 6
    for key, row in results.items():
        assert set(row) == RESULT_FIELDS, key
        assert row["tokens_per_second"] > 0 and row["calls"] == (4 if key[0] == "all" else 2)
        baselines = [results[(*key[:2], name)]["tokens_per_second"] for name in
                     ("target_only", "target_only@stock", "target_only@steps")]
        assert row["speedup_vs_best_target_only"] == pytest.approx(row["tokens_per_second"] / max(baselines))
        assert row["speedup_vs_stock_target_only"] == pytest.approx(row["tokens_per_second"] / baselines[1])
        assert row["latency_p90_seconds"] >= row["latency_p50_seconds"]
        assert row["peak_memory_bytes"] >= row["weights_bytes"] > 0
        assert row["speedup_vs_transformers"] == pytest.approx(
            row["tokens_per_second"] / results[(*key[:2], "transformers")]["tokens_per_second"])
        assert row["speedup_min"] <= row["speedup_median"] <= row["speedup_max"]
        if key[2] == "target_only":  # each prompt against itself; one pass per token at the probe's step cost
            assert row["speedup_min"] == row["speedup_max"] == 1.0 and row["modelled_speedup"] == pytest.approx(1.0)
        if key[2] == "hf_spec":  # the CPU default profiles: the sections and what lies outside them make the whole
            assert sum(row["profile_shares"].values()) == pytest.approx(1.0, abs=1e-6)
            assert min(row["profile_shares"].values()) >= 0 and row["profile_shares"]["target forward"] > 0
            assert row["share_of_predicted_in_run"] > 0 and row["predicted_speedup_in_run"] > 0
    for workload in ("code", "prose"):
        ours, theirs = results[(workload, "greedy", "hf_spec")], results[(workload, "greedy", "transformers")]
        assert ours["identical_to_target_only"] == 1.0 and theirs["identical_to_target_only"] == 1.0
        # Greedy: both keep the same matching prefix, so their forward-pass counts agree.
        assert ours["tokens_per_target_pass"] == pytest.approx(theirs["tokens_per_target_pass"])
        assert ours["predicted_speedup"] > 0 and 0 < ours["acceptance_rate"] <= 1
        baseline = results[(workload, "greedy", "target_only")]
        assert baseline["tokens_per_target_pass"] == 1.0 and baseline["predicted_speedup"] is None


def test_bench_rejects_bad_input():
    target, draft = build_tiny_pair(seed=0)
    workloads = random_workloads(("code",), 1, TINY_VOCAB_SIZE)
    with pytest.raises(ValueError, match="must include 'target_only'"):
        run_benchmark(target, draft, workloads, methods=("hf_spec",), progress=False)
    with pytest.raises(ValueError, match="Unknown method 'vllm'"):
        run_benchmark(target, draft, workloads, methods=("target_only", "vllm"), progress=False)
    with pytest.raises(ValueError, match="`num_draft_tokens` must be a positive integer, but is 0"):
        run_benchmark(target, draft, workloads, num_draft_tokens=0, progress=False)
    with pytest.raises(ValueError, match=r"runs on variant 'nf4', but `variants` has \[\]"):
        run_benchmark(target, draft, workloads, methods=("target_only", "hf_spec@nf4"), progress=False)
    with pytest.raises(ValueError, match="Workload 'code' has no prompts"):
        run_benchmark(target, draft, {"code": []}, progress=False)
    with pytest.raises(ValueError, match=r"prose workload has 8 prompts; `offset` \+ `num_prompts` is 9"):
        text_workloads(None, ("prose",), 9)
    with pytest.raises(ValueError, match=r"code workload has 164 prompts; `offset` \+ `num_prompts` is 166"):
        text_workloads(None, ("code",), 2, offset=164)
    with pytest.raises(ValueError, match="`offset` must be an integer >= 0, but is -1"):
        text_workloads(None, ("code",), 2, offset=-1)
    with pytest.raises(ValueError, match="Unknown workload 'poetry'"):
        text_workloads(None, ("poetry",), 1)


def test_bench_compares_draft_lengths_schedules_and_prompt_lookup(tmp_path):
    methods = ["hf_spec_k2", "hf_spec_auto", "transformers_heuristic", "transformers_lookup", "hf_spec_lookup",
               "hf_spec_lookup_draft"]
    argv = ["bench", *TINY, "--prompts", "1", "--max-new-tokens", "10", "--threads", "1", "--no-progress",
            "--workloads", "code", "--settings", "greedy", "--methods", *methods,
            "--output", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    assert main(argv) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["config"]["methods"] == ["target_only", *methods, "target_only@stock", "target_only@steps"]
    results = {row["method"]: row for row in report["results"]}
    for method in methods:
        assert results[method]["identical_to_target_only"] == 1.0, method
    for run in report["runs"]:  # the k of each round of hf_spec's calls, in order; none for the others
        if run["method"].startswith("hf_spec"):
            assert len(run["draft_lengths"]) == run["target_passes"] and sum(run["draft_lengths"]) == run["proposed"]
        else:
            assert run["draft_lengths"] is None, run["method"]
    assert results["hf_spec_k2"]["predicted_speedup"] is not None and "2" in report["costs"]["code"]["block_cost_by_k"]
    for method in ("hf_spec_auto", "transformers_heuristic", "hf_spec_lookup", "transformers_lookup"):
        assert results[method]["predicted_speedup"] is None, method
    assert results["hf_spec_lookup"]["weights_bytes"] == report["weights_bytes"]["target"], "no draft model used"


def test_min_new_tokens_makes_every_call_of_every_method_decode_one_length():
    """Sampled completions end where they end, so methods decode texts of different lengths; ``min_new_tokens`` in
    the settings (``hf-spec bench --min-new-tokens``) makes every call of every method decode the same number.
    Control: with half the vocabulary ending the text, calls without it stop early."""
    target, draft = build_tiny_pair(seed=0)
    target.generation_config.eos_token_id = list(range(1, TINY_VOCAB_SIZE // 2))
    workloads = random_workloads(("code",), 2, TINY_VOCAB_SIZE)
    settings = {"sampled": {"do_sample": True}, "sampled_to_10": {"do_sample": True, "min_new_tokens": 10}}
    report = run_benchmark(target, draft, workloads, settings=settings, max_new_tokens=10, progress=False,
                           methods=("target_only", "transformers", "hf_spec_k2", "hf_spec_auto"))
    lengths = {name: [run["new_tokens"] for run in report["runs"] if run["setting"] == name] for name in settings}
    assert len(lengths["sampled_to_10"]) == 8 and set(lengths["sampled_to_10"]) == {10}, lengths
    assert min(lengths["sampled"]) < 10, lengths


def test_bench_min_new_tokens_reaches_every_setting_and_is_checked(tmp_path, capsys):
    """``--min-new-tokens`` is recorded in every setting of the report; above ``--max-new-tokens`` it is refused,
    naming both."""
    argv = ["bench", *TINY, "--prompts", "2", "--max-new-tokens", "10", "--min-new-tokens", "10", "--threads", "1",
            "--no-progress", "--workloads", "code", "--settings", "greedy", "sampled", "--methods", "transformers",
            "hf_spec_k2", "hf_spec_auto", "--kernel-baselines", "--output", str(tmp_path / "b.json"),
            "--plot", str(tmp_path / "b.png")]
    assert main(argv) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert all(setting["min_new_tokens"] == 10 for setting in report["config"]["settings"].values())
    assert {run["method"] for run in report["runs"]} == {"target_only", "transformers", "hf_spec_k2", "hf_spec_auto"}
    assert main(["bench", *TINY, "--max-new-tokens", "8", "--min-new-tokens", "9"]) == 2
    assert "--min-new-tokens 9: more than --max-new-tokens 8" in capsys.readouterr().err


def test_bench_cli_names_an_unknown_method(capsys):
    assert main(["bench", *TINY, "--methods", "vllm"]) == 2
    assert "Unknown method 'vllm'" in capsys.readouterr().err


def test_bench_compares_drafts_for_the_same_target():
    """A variant (target, other draft): its methods run on the same target with that draft; its own target-only
    baseline is the first target's (no duplicate target-only run)."""
    target, draft = build_tiny_pair(seed=0)
    _, other_draft = build_tiny_pair(seed=0, draft_noise=0.3)
    workloads = random_workloads(("code",), 2, TINY_VOCAB_SIZE)
    report = run_benchmark(target, draft, workloads, settings={"greedy": {"do_sample": False}},
                           methods=("target_only", "hf_spec", "hf_spec@noisier"), max_new_tokens=10,
                           variants={"noisier": (target, other_draft)}, progress=False)
    assert report["config"]["variants"] == {"noisier": {"target": "same", "draft": "tiny (float32, CPU path stock)"}}
    rows = {row["method"]: row for row in report["results"]}
    assert rows["hf_spec@noisier"]["identical_to_target_only"] == 1.0
    assert rows["hf_spec@noisier"]["speedup_vs_own_target_only"] == rows["hf_spec@noisier"]["speedup_vs_target_only"]
    assert rows["hf_spec@noisier"]["acceptance_rate"] < rows["hf_spec"]["acceptance_rate"]
    assert set(report["costs"]) == {"code", "code@noisier"}


def test_a_call_of_transformers_that_raises_is_reported_and_ours_stops_the_bench(monkeypatch, tmp_path):
    """transformers' assisted generation failing on a prompt (its universal assisted generation did, on a real
    cross-tokenizer pair) is a result: the call is listed with its error and left out of the figures, the other calls
    still run, and a case where every call raised has no row (the plot still draws). One of hf_spec's calls raising
    is a bug and stops the bench."""
    target, draft = build_tiny_pair(seed=0)
    workloads = random_workloads(("code", "prose"), 2, TINY_VOCAB_SIZE)
    failing = {("code", 1), ("prose", 0), ("prose", 1)}
    original = hf_spec.bench.runner.generate_once

    def generate_once(spec, target, draft, inputs, *args, **kwargs):
        chosen = any(inputs is workloads[name][i] for name, i in failing)
        if chosen and spec.uses_draft and spec.is_ours is ours_fail:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
        return original(spec, target, draft, inputs, *args, **kwargs)

    monkeypatch.setattr(hf_spec.bench.runner, "generate_once", generate_once)  # the warm-up's
    monkeypatch.setattr(hf_spec.bench.methods, "generate_once", generate_once)  # the timed calls'
    ours_fail = False
    report = run_benchmark(target, draft, workloads, settings={"greedy": {"do_sample": False}},
                           methods=("target_only", "transformers", "hf_spec"), max_new_tokens=8, progress=False)
    rows = {(row["workload"], row["method"]): row for row in report["results"]}
    assert (rows[("code", "transformers")]["calls"], rows[("code", "transformers")]["failed_calls"]) == (1, 1)
    assert ("prose", "transformers") not in rows and rows[("all", "transformers")]["failed_calls"] == 3
    assert (rows[("prose", "hf_spec")]["calls"], rows[("prose", "hf_spec")]["failed_calls"]) == (2, 0)
    failed = [(run["workload"], run["prompt"]) for run in report["runs"] if run["error"]]
    assert sorted(failed) == sorted(failing)
    assert "code/greedy prompt 1: transformers: RuntimeError: mat1 and mat2" in format_table(report)
    plot(report, str(tmp_path / "bench.png"))
    ours_fail = True
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        run_benchmark(target, draft, workloads, settings={"greedy": {"do_sample": False}},
                      methods=("target_only", "transformers", "hf_spec"), max_new_tokens=8, progress=False)


def test_bench_cli_names_a_draft_variant_that_is_not_there(tmp_path, capsys):
    assert main(["bench", *TINY, "--draft-variants", "./some/folder", "--output", str(tmp_path / "b.json")]) == 2
    assert "'./some/folder' is neither a built-in model" in capsys.readouterr().err


def test_text_workloads_hold_out_the_first_prompts_by_offset():
    from hf_spec.loading.corpora import humaneval_problems

    seen = []

    def tokenizer(text, **kwargs):
        seen.append(text)
        return {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)}

    workloads = text_workloads(tokenizer, ("code",), 2, offset=5)
    assert seen == [problem["prompt"] for problem in humaneval_problems()[5:7]] and len(workloads["code"]) == 2


def test_the_library_plots_leave_the_callers_matplotlib_backend_alone(tmp_path):
    """A notebook calling `train_and_evaluate_head` or `bench.report.plot` keeps its inline backend and open figures."""
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from hf_spec.evaluation.head_pipeline import plot_curve

    previous = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend the library has no reason to pick (switching to Agg was the old defect)
    try:
        open_figures = plt.get_fignums()
        plot_curve([{"step": 1, "eval_loss": 1.0, "eval_agreement": 0.5}], 0.1, tmp_path / "curve.png")
        assert (tmp_path / "curve.png").stat().st_size > 0
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == open_figures
    finally:
        matplotlib.use(previous)


def test_token_methods_run_hf_spec_chains_and_trees_with_the_token_wise_rule():
    assert method_spec("hf_spec_k3_token", 5).generate_kwargs == {"num_assistant_tokens": 3, "verification": "token"}
    assert method_spec("hf_spec_auto_static_token", 5).generate_kwargs["verification"] == "token"
    assert method_spec("hf_spec_tree8_token", 5).generate_kwargs["verification"] == "token"
    for method in ("transformers_token", "target_only_token"):
        with pytest.raises(ValueError, match="'_token' selects the token-wise"):
            method_spec(method, 5)


def test_static_and_compiled_methods(tmp_path):
    spec = method_spec("hf_spec_k3_compiled", 5)
    assert spec.is_compiled and spec.generate_kwargs == {"num_assistant_tokens": 3, "cache_implementation": "static"}
    assert not method_spec("target_only_static", 5).is_compiled
    with pytest.raises(ValueError, match="transformers_static.*refuses static caches"):
        method_spec("transformers_static", 5)
    argv = ["bench", *TINY, "--prompts", "1", "--max-new-tokens", "8", "--threads", "1", "--no-progress",
            "--workloads", "code", "--settings", "greedy", "--methods", "hf_spec_static", "target_only_static",
            "--output", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    assert main(argv) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    rows = {row["method"]: row for row in report["results"]}
    assert rows["hf_spec_static"]["identical_to_target_only"] == 1.0
    assert rows["target_only_static"]["tokens_per_target_pass"] == 1.0
    assert set(report["config"]["warmup_seconds"]) >= {"hf_spec_static", "target_only_static"}


def test_a_compiled_method_compiles_in_its_warm_up_and_not_while_timed(tmp_path, monkeypatch):
    """The warm-up runs each prompt once at the full length, so the timed calls meet no pass width not compiled."""
    def eager_graphs():  # dynamo's graphs without code generation
        return CompileConfig(backend="eager", fullgraph=False, dynamic=False)

    monkeypatch.setattr(hf_spec.bench.methods, "bench_compile_config", eager_graphs)
    monkeypatch.setattr(hf_spec.bench.runner, "bench_compile_config", eager_graphs)
    argv = ["bench", *TINY, "--prompts", "3", "--max-new-tokens", "8", "--threads", "1", "--no-progress",
            "--workloads", "code", "--settings", "greedy", "--methods", "hf_spec_k3_compiled", "--kernel-baselines",
            "--output", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    assert main(argv) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["config"]["graphs_compiled_while_timed"] == {"hf_spec_k3_compiled": 0}
    rows = {row["method"]: row for row in report["results"]}
    assert rows["hf_spec_k3_compiled"]["identical_to_target_only"] == 1.0


def test_the_profile_counts_the_draft_prefill_its_steps_and_catch_ups():
    """A draft equal to the target accepts every block: round 1 reads the prompt (the draft's prefill), and every
    later round starts with a 2-token catch-up (the last drafted token and the bonus token), then k - 1 steps."""
    from hf_spec.profiling import FORWARD_SECTIONS, profile_rounds

    target, draft = build_tiny_pair(seed=4, draft_noise=0.0)
    target, k = speculative(target), 3
    with profile_rounds(), ForwardCounter(draft) as draft_calls:
        output = target.generate(torch.tensor([[1, 2, 3, 4]]), assistant_model=draft, num_assistant_tokens=k,
                                 do_sample=False, max_new_tokens=4 * (k + 1), return_dict_in_generate=True)
    stats = output.speculative_stats
    assert stats.num_accepted == stats.num_draft_tokens == 4 * k and stats.num_rounds == 4
    assert set(stats.profile_passes) == set(FORWARD_SECTIONS)
    assert stats.profile_passes == {"draft prefill": 1, "draft forward": 4 * (k - 1), "draft catch-up": 3,
                                    "target forward": 4}
    assert sum(stats.profile_passes[name] for name in FORWARD_SECTIONS[:3]) == draft_calls.count
    assert all(stats.profile[name] > 0 for name in FORWARD_SECTIONS)
    plain = target.generate(torch.tensor([[1, 2, 3, 4]]), assistant_model=draft, num_assistant_tokens=k,
                            do_sample=False, max_new_tokens=4, return_dict_in_generate=True)
    assert plain.speculative_stats.profile is None and plain.speculative_stats.profile_passes is None


def _profiled_run(seconds: float, profile: dict, passes: dict, new_tokens: int, prompt: int = 0):
    from hf_spec.bench.report import Run

    return Run("code", "greedy", "hf_spec", prompt, 0, seconds, new_tokens, passes.get("target forward", new_tokens),
               0, None, None, None, profile=profile, profile_passes=passes)


def test_the_formula_at_the_runs_own_costs_and_where_the_rest_goes():
    """k = 2, 10 rounds of 2.5 tokens (alpha 0.5 at k = 2 gives 1.75: here 25 tokens over 10 passes); target-only
    costs 0.1 s a token, a draft step 0.02 s, a verify pass 0.12 s: the formula's round is 2 x 0.02 + 0.12 s."""
    from hf_spec.bench.formula import in_run_prediction

    k, rounds, tokens = 2, 10, 25
    profile = {"draft prefill": 0.05, "draft forward": 0.02 * 9, "draft catch-up": 0.03 * 10,
               "target forward": 0.12 * rounds}
    passes = {"draft prefill": 1, "draft forward": 9, "draft catch-up": 10, "target forward": rounds}
    forward = sum(profile.values())
    method = [_profiled_run(forward + 0.25, profile, passes, tokens)]
    baseline = [_profiled_run(0.1 * 40, {}, {}, 40)]
    result = in_run_prediction(method, baseline, k)
    assert result["in_run_cost_ratio"] == pytest.approx(0.2) and result["in_run_block_cost"] == pytest.approx(1.2)
    alpha = acceptance_from_tokens_per_pass(tokens / rounds, k)
    assert result["predicted_speedup_in_run"] == pytest.approx(predicted_speedup(alpha, k, 0.2, 1.2))
    priced = rounds * (k * 0.02 + 0.12)  # what the formula counts
    assert result["share_of_predicted_in_run"] == pytest.approx(priced / method[0].seconds)
    assert result["lost_to_draft_prefill_and_catch_up"] == pytest.approx((0.03 + 0.01 * 10) / method[0].seconds)
    assert result["lost_outside_the_passes"] == pytest.approx(0.25 / method[0].seconds)
    # what the formula counts and what it leaves out make the whole wall time (here k x rounds = all draft passes)
    assert (result["share_of_predicted_in_run"] + result["lost_to_draft_prefill_and_catch_up"]
            + result["lost_outside_the_passes"]) == pytest.approx(1.0)
    assert in_run_prediction(method, baseline, None)["share_of_predicted_in_run"] is None, "no fixed k"
    assert in_run_prediction(method, [_profiled_run(4.0, {}, {}, 40, prompt=1)], k)["in_run_cost_ratio"] is None


@pytest.mark.parametrize("forget", [False, True])
def test_the_warm_up_makes_every_cost_probe_the_timed_calls_use(tmp_path, monkeypatch, forget):
    """Auto k and auto trees probe the costs of passes sized by ``max_new_tokens``: the warm-up call (the method's
    first call, timed apart) runs with the timed calls' ``max_new_tokens``, so no timed call pays a probe (a tree's
    first timed call once paid 11 s of probing). Control: probes forgotten after the warm-up are made again in a
    timed call."""
    import hf_spec.timing.probe as costs

    probes, timed = [], []
    measure, interleaved = costs.measure_costs, hf_spec.bench.runner._interleaved_runs
    monkeypatch.setattr(costs, "measure_costs", lambda *args, **kwargs: (probes.append(bool(timed)),
                                                                          measure(*args, **kwargs))[1])

    def timed_runs(plan, *args, **kwargs):
        timed.append(True)
        for model in plan.pairs[""] if forget else ():
            costs.forget_costs(model)
        return interleaved(plan, *args, **kwargs)

    monkeypatch.setattr(hf_spec.bench.runner, "_interleaved_runs", timed_runs)
    argv = ["bench", *TINY, "--prompts", "2", "--max-new-tokens", "24", "--threads", "1", "--no-progress",
            "--workloads", "code", "--settings", "greedy", "--methods", "hf_spec_auto", "hf_spec_tree_auto",
            "--kernel-baselines", "--output", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    assert main(argv) == 0
    # the tree's, before the timed calls (auto k's costs come from load_pair's kernel timings: no probe at all)
    assert probes.count(False) >= 1
    assert (True in probes) == forget, probes


def test_the_texts_each_method_wrote_are_scored_as_eval_draft_scores_them(tmp_path, monkeypatch):
    """`scripts/bench_text_acceptance.py`: one report per (setting, method) over the texts that method wrote, each
    equal to `evaluate_draft` on those texts; a text scored against the wrong prompt gives other figures (control)."""
    import runpy
    import sys
    from pathlib import Path

    from hf_spec.evaluation.draft_fit import evaluate_draft
    from hf_spec.loading.pair import load_pair

    argv = ["bench", *TINY, "--prompts", "2", "--max-new-tokens", "12", "--threads", "1", "--no-progress",
            "--workloads", "code", "--settings", "greedy", "sampled", "--methods", "hf_spec_k2",
            "--kernel-baselines", "--output", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    assert main(argv) == 0
    script = str(Path(__file__).resolve().parents[1] / "scripts" / "bench_text_acceptance.py")
    monkeypatch.setattr(sys, "argv", ["bench_text_acceptance.py", str(tmp_path / "b.json"), "--threads", "1",
                                      "--output-dir", str(tmp_path / "texts")])  # the pair: the report's own
    runpy.run_path(script, run_name="__main__")
    summary = json.loads((tmp_path / "texts" / "summary.json").read_text())
    assert {(row["setting"], row["method"]) for row in summary} == {
        (setting, method) for setting in ("greedy", "sampled") for method in ("target_only", "hf_spec_k2")}
    report = json.loads((tmp_path / "b.json").read_text())
    pair = load_pair("tiny", "tiny", seed=0)
    prompts = random_workloads(("code",), 2, TINY_VOCAB_SIZE, seed=0)["code"]
    runs = [run for run in report["runs"] if run["setting"] == "sampled" and run["method"] == "hf_spec_k2"]
    scored = json.loads((tmp_path / "texts" / "code_sampled_hf_spec_k2.json").read_text())["predicted"]
    texts = [torch.tensor([run["new_ids"]]) for run in runs]
    settings = report["config"]["settings"]["sampled"]
    expected = evaluate_draft(pair.target, pair.draft, [prompts[run["prompt"]]["input_ids"] for run in runs], texts,
                              settings, progress=False)
    def flat(alongs):
        return [value for along in alongs for value in along]

    assert [len(along) for along in scored["acceptance_along_text"]] == [len(run["new_ids"]) for run in runs]
    assert flat(scored["acceptance_along_text"]) == pytest.approx(flat(expected.acceptance_along_text), abs=1e-5)
    swapped = evaluate_draft(pair.target, pair.draft, [prompts[1 - run["prompt"]]["input_ids"] for run in runs],
                             texts, settings, progress=False)
    assert flat(scored["acceptance_along_text"]) != pytest.approx(flat(swapped.acceptance_along_text), abs=1e-5)


def test_first_calls_run_each_method_in_a_fresh_process(tmp_path, capsys):
    """``--first-call``: one subprocess per method and prompt, target-only first in the table, every run timed once;
    options it would not honour are refused by name."""
    from hf_spec.cli import main

    argv = ["bench", "--target", "tiny", "--draft", "tiny", "--first-call", "fresh", "--methods", "hf_spec_k3",
            "--prompts", "2", "--workloads", "code", "--settings", "greedy", "--max-new-tokens", "6", "--threads", "1",
            "--kernel-baselines", "steps", "--min-new-tokens", "6", "--no-progress",
            "--output", str(tmp_path / "first.json")]
    assert main(argv) == 0
    report = json.loads((tmp_path / "first.json").read_text())
    methods = ["target_only", "hf_spec_k3", "target_only@steps"]
    assert report["config"]["methods"] == methods and len(report["runs"]) == 6
    assert {run["method"] for run in report["runs"] if run["prompt"] == 1} == set(methods)
    assert [run["method"] for run in report["runs"]][:3] != [run["method"] for run in report["runs"]][3:]  # rotated
    result = report["results"]["code/greedy"]
    assert result["target_only"]["speed_over_target_only"] == pytest.approx(1.0)
    assert all(n == 6 for n in result["hf_spec_k3"]["new_tokens"]) and result["hf_spec_k3"]["speed_over_target_only"]
    assert report["config"]["min_new_tokens"] == 6 and all(run["min_new_tokens"] == 6 for run in report["runs"])
    for method in methods:  # the fastest target-only first call of each prompt is the stricter baseline
        assert result[method]["speed_over_fastest_target_only"] <= result[method]["speed_over_target_only"] + 1e-9
    assert "(in brackets: over the fastest target-only" in capsys.readouterr().out
    assert main([*argv, "--repeats", "2"]) == 2
    assert "it does not take --repeats" in capsys.readouterr().err


FAKE_OPENVINO = '''
import numpy


class Tensor:
    def __init__(self, array):
        self.data = numpy.asarray(array)
'''
FAKE_GENAI = '''
import json, os


class GenerationConfig:
    pass


class TokenizedInputs:
    def __init__(self, ids, mask):
        self.ids = ids


def draft_model(folder, device, **properties):
    return folder


class LLMPipeline:
    def __init__(self, folder, device, draft_model=None, **properties):
        self.draft = draft_model
        with open(os.environ["FAKE_OPENVINO_LOG"], "a") as log:
            log.write(json.dumps({"target": folder, "draft": draft_model, **properties}) + "\\n")

    def generate(self, inputs, config):
        class Result:  # the prompt's last token, repeated; stops at an end token given as the prompt's first
            tokens = [[int(inputs.ids.data[0, -1])] * config.max_new_tokens]
        with open(os.environ["FAKE_OPENVINO_LOG"], "a") as log:
            log.write(json.dumps({"k": getattr(config, "num_assistant_tokens", None), "sample": config.do_sample,
                                  "max_new_tokens": config.max_new_tokens}) + "\\n")
        return Result()
'''


def test_openvino_peer_runs_interleaved_through_its_own_python(tmp_path, monkeypatch):
    """The peer's worker under a stand-in OpenVINO (no OpenVINO here): every prompt and setting reaches it, with
    k and the sampling flag; its runs land in the report beside the others; folders and Pythons are checked."""
    from hf_spec.bench.peers import OpenVINOPeer

    (tmp_path / "openvino.py").write_text(FAKE_OPENVINO)
    (tmp_path / "openvino_genai.py").write_text(FAKE_GENAI)
    for folder in ("t", "d"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "openvino_model.xml").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FAKE_OPENVINO_LOG", str(tmp_path / "log.jsonl"))
    import sys

    peer = OpenVINOPeer(sys.executable, {"int8": (str(tmp_path / "t"), str(tmp_path / "d"))}, threads=1)
    target, draft = build_tiny_pair(seed=1)
    workloads = random_workloads(("code",), 2, TINY_VOCAB_SIZE, seed=0)
    report = run_benchmark(target, draft, workloads, methods=("target_only", "hf_spec"), num_draft_tokens=3,
                           max_new_tokens=6, progress=False, peer=peer)
    rows = {(row["setting"], row["method"]) for row in report["results"]}
    assert {("greedy", "openvino_int8"), ("sampled", "openvino_int8_k3")} <= rows
    runs = [run for run in report["runs"] if run["method"].startswith("openvino")]
    assert len(runs) == 2 * 2 * 2 and all(run["new_tokens"] == 6 for run in runs)
    greedy_k = [run for run in runs if run["method"] == "openvino_int8_k3" and run["setting"] == "greedy"]
    assert all(run["identical_to_target_only"] for run in greedy_k)  # against the peer's own target-only
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [entry["draft"] for entry in log if "target" in entry] == [None, str(tmp_path / "d")]
    calls = [entry for entry in log if "k" in entry]
    assert {(entry["k"], entry["sample"]) for entry in calls} == {(None, False), (3, False), (None, True), (3, True)}
    assert peer.process is None  # closed when the bench ends
    with pytest.raises(ValueError, match="holds no openvino_model.xml"):
        OpenVINOPeer(sys.executable, {"x": (str(tmp_path), None)})
    with pytest.raises(ValueError, match="--openvino-python"):
        OpenVINOPeer(str(tmp_path / "nothing"), {})


def test_sampled_speeds_take_the_draws_luck_out():
    """`scripts/sampled_speeds.py`: two methods of the same true speed, one lucky in its draws and one not, come out
    apart as measured and together once the luck (whose mean is 0 for both) is taken out. Control: without the
    expected counts there is no luck to take out, and they stay apart."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "sampled_speeds.py"
    spec = importlib.util.spec_from_file_location("sampled_speeds", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    generator = torch.Generator().manual_seed(0)

    def calls(method, bias, has_expected=True):
        runs = []
        for prompt in range(40):
            luck = float(torch.randn((), generator=generator)) * 4 + bias  # accepted - expected, tokens
            seconds = 8.0 * (1 - 0.02 * luck) * (1 + 0.002 * float(torch.randn((), generator=generator)))
            runs.append({"method": method, "prompt": prompt, "seconds": seconds, "new_tokens": 64, "accepted": 150,
                         "expected_accepted": 150 - luck if has_expected else None})
        return runs

    for has_expected, apart in [(True, False), (False, True)]:
        groups = {"lucky": calls("lucky", 3.0, has_expected), "unlucky": calls("unlucky", -3.0, has_expected)}
        figures = script.adjusted_speeds(groups, {"lucky": None, "unlucky": None})["methods"]
        raw = figures["lucky"]["tokens_per_second"] / figures["unlucky"]["tokens_per_second"]
        adjusted = figures["lucky"]["adjusted_tokens_per_second"] / figures["unlucky"]["adjusted_tokens_per_second"]
        assert raw > 1.08
        assert (abs(adjusted - 1) > 0.08) == apart, (has_expected, raw, adjusted)


FAKE_LLAMA = '''#!{python}
import os, sys
args = sys.argv[1:]
n = int(args[args.index("-n") + 1])
with open(os.environ["FAKE_LLAMA_LOG"], "a") as log:
    log.write(os.path.basename(sys.argv[0]) + " " + " ".join(args) + "\\n")
sys.stdout.write("abc" * (n // 3))
if "-md" in args:
    sys.stderr.write("encoded    4 tokens in    0.250 seconds, speed:   16.0 t/s\\n")
    sys.stderr.write(f"decoded {{n + 2:4d}} tokens in    1.500 seconds, speed:   10.0 t/s\\n")
else:
    sys.stderr.write("llama_perf_context_print: prompt eval time =     120.00 ms /     4 tokens\\n")
    sys.stderr.write(f"llama_perf_context_print:        eval time =     880.00 ms / {{n - 1:5d}} runs   (x)\\n")
'''


def test_llama_cpp_peer_runs_its_tools_on_the_prompts_and_reads_their_timings(tmp_path, monkeypatch):
    """Stand-in llama.cpp tools (none built here): each greedy prompt reaches llama-completion and
    llama-speculative-simple (with the draft and k), the tools' own prompt and decoding times are the runs' seconds,
    their counts the tokens, and the rows land in the report; missing tools and sampled settings are named."""
    import sys

    from hf_spec.bench.peers import LlamaCppPeer, _llama_timings
    from hf_spec.loading.tiny import tiny_tokenizer

    for tool in ("llama-completion", "llama-speculative-simple"):
        (tmp_path / tool).write_text(FAKE_LLAMA.format(python=sys.executable))
        (tmp_path / tool).chmod(0o755)
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "log.txt"))
    peer = LlamaCppPeer(str(tmp_path), "target.gguf", "draft.gguf", threads=2)
    target, draft = build_tiny_pair(seed=1)
    workloads = random_workloads(("code",), 2, TINY_VOCAB_SIZE, seed=0)
    report = run_benchmark(target, draft, workloads, settings={"greedy": {"do_sample": False}},
                           methods=("target_only",), num_draft_tokens=3, max_new_tokens=6, progress=False, peer=peer,
                           tokenizer=tiny_tokenizer())
    runs = {run["method"]: run for run in report["runs"] if run["method"].startswith("llamacpp")}
    assert runs["llamacpp"]["seconds"] == pytest.approx(1.0) and runs["llamacpp"]["new_tokens"] == 6
    assert runs["llamacpp_k3"]["seconds"] == pytest.approx(1.75) and runs["llamacpp_k3"]["new_tokens"] == 8
    calls = (tmp_path / "log.txt").read_text().splitlines()
    assert sum(line.startswith("llama-completion -m target.gguf") for line in calls) == 3  # warm-up and 2 prompts
    speculative = [line for line in calls if line.startswith("llama-speculative-simple")]
    assert len(speculative) == 3 and all("-md draft.gguf" in line and "--spec-draft-n-max 3" in line
                                         for line in speculative)
    assert {"--temp 0", "-t 2"} <= {part for line in calls for part in (" ".join(line.split()[i:i + 2])
                                                                          for i in range(len(line.split())))}
    with pytest.raises(RuntimeError, match="printed no timings"):
        _llama_timings("nothing", speculative=False)
    with pytest.raises(ValueError, match="greedy settings only"):
        peer.run("llamacpp", workloads["code"][0], {"do_sample": True}, set(), 0, 4, tiny_tokenizer())
    with pytest.raises(ValueError, match="no executable llama-completion"):
        LlamaCppPeer(str(tmp_path / "nothing"), "target.gguf")
