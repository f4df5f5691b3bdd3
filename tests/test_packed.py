"""The optimized CPU forward paths (`hf_spec.loading.packed`) and the measured costs auto k starts from.

Exactness holds whatever the kernels: the law is enumerated from the optimized target itself, so these tests check
that prepacked layers and per-pass kernel dispatch change nothing in the loop's law, greedy output, caches or
checkpoints. Speed is measured with ``hf-spec bench``, not here.
"""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch
from helpers import (
    CASES,
    PAD,
    PROMPTS,
    exact_law,
    left_padded,
    make_noisy_copy,
    make_tiny_model,
    sample_speculative,
)
from transformers import AutoModelForCausalLM

from hf_spec import AutoDraftLength, speculative, without_speculation
from hf_spec.bench.measure import weight_bytes
from hf_spec.drafting.model import ModelDrafter
from hf_spec.drafting.model_tree import ModelTreeDrafter
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, fit_sequences
from hf_spec.loading import packed
from hf_spec.loading.cpu import default_dtype
from hf_spec.loading.packed import PackedLinear, cpu_path, deoptimize, optimize
from hf_spec.loading.weight_only import quantize_weights
from hf_spec.sizing.costs import CostTable
from hf_spec.sizing.estimates import SHIFT_EVIDENCE
from hf_spec.timing import probe as costs
from hf_spec.timing.probe import probe_costs


def optimized(model, path="packed"):
    model = copy.deepcopy(model)
    optimize(model, path=path)
    return model


@pytest.fixture(scope="module")
def small_pair():
    """The statistical tests' pair (vocabulary 4), both on the packed path."""
    target = make_tiny_model(seed=10, vocab_size=4, num_layers=1, head_scale=3.0)
    draft = make_noisy_copy(target, seed=12, noise=1.0)
    return speculative(optimized(target)), optimized(draft)


def test_packed_layers_really_are_packed_and_tied_outputs_stay_dense():
    model = optimized(make_tiny_model(seed=0))
    assert cpu_path(model).name == "packed"
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)
    assert model.model.layers[0].mlp.down_proj.weight.is_mkldnn
    tied = make_tiny_model(seed=0)
    tied.lm_head.weight = tied.model.embed_tokens.weight  # as Qwen ties them
    optimize(tied, path="packed")
    assert type(tied.lm_head) is torch.nn.Linear and tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize("case", ["temperature_1", "combined_chain_k4"])
def test_speculative_sampling_follows_the_optimized_target_law(small_pair, case):
    target, draft = small_pair
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(target, draft, settings, user_processors, k, seed=31)
    result = fit_sequences(samples, exact_law(target, settings, user_processors))
    assert result.is_consistent, result


def test_negative_control_resampling_from_p_is_caught_on_the_optimized_path(small_pair, monkeypatch):
    target, draft = small_pair
    k, settings, user_processors = CASES["temperature_1"]
    samples = sample_speculative(target, draft, settings, user_processors, k, seed=98, verification=RESAMPLE_FROM_P)
    assert not fit_sequences(samples, exact_law(target, settings, user_processors)).is_consistent


@pytest.mark.parametrize("path", ["dense", "packed"])
def test_greedy_ragged_batch_equals_optimized_target_only(path):
    base = make_tiny_model(seed=0)
    target = speculative(optimized(base, path))
    draft = optimized(make_tiny_model(seed=3), path)
    input_ids, attention_mask = left_padded(PROMPTS)
    common = {"attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False, "pad_token_id": PAD}
    with without_speculation(target):
        expected = target.generate(input_ids, **common)
    output = target.generate(input_ids, assistant_model=draft, num_assistant_tokens=4, return_dict_in_generate=True,
                             **common)
    assert torch.equal(output.sequences, expected)
    assert 0 < output.speculative_stats.num_accepted < output.speculative_stats.num_draft_tokens


def test_packing_keeps_the_weights_once_and_checkpoints_unchanged(tmp_path):
    base = make_tiny_model(seed=0)
    model = optimized(base)
    assert weight_bytes(model) == weight_bytes(base)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in base.state_dict().items())
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.allclose(reloaded(prompt).logits, base(prompt).logits)
    deoptimize(model)
    assert not any(isinstance(module, PackedLinear) for module in model.modules()) and cpu_path(model) is None
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in base.state_dict().items())


def test_kernel_dispatch_restores_the_onednn_flag_even_after_an_error():
    model = optimized(make_tiny_model(seed=0), "dense")
    assert torch.backends.mkldnn.enabled
    seen = []
    model.model.register_forward_pre_hook(lambda module, args: seen.append(torch.backends.mkldnn.enabled))
    with torch.no_grad():
        model(torch.tensor([[1]]))  # one row: torch's own kernels
        model(torch.tensor([[1, 2, 3]]))  # a block: oneDNN
        with pytest.raises(IndexError):
            model(torch.tensor([[10_000]]))  # an id past the vocabulary fails inside the forward
    assert seen == [False, True, False] and torch.backends.mkldnn.enabled


def test_auto_measures_every_candidate_and_keeps_the_fastest_for_its_role():
    model = make_tiny_model(seed=0)
    path = optimize(model, role="steps", widths=[1, 2], repeats=1)
    assert set(path.seconds) == {"stock", "dense", "packed"} and path.name in ("dense", "packed")
    score = {name: seconds[1] for name, seconds in path.seconds.items() if name != "stock"}
    assert path.name == min(score, key=score.get)
    assert cpu_path(model) is path and path.name in path.describe()


def test_a_speculating_target_is_put_on_the_path_that_verifies_fastest():
    """A target that speculates mostly verifies blocks (`TARGET_STEP_SHARE` of its passes are steps): the step timings
    of the built-in 1.5B target on AMD EPYC AVX512-BF16, where dense stepped 20% faster and packed verified 1.3x
    faster, used to tie within a few percent and flip with noise; the blocks now decide."""
    dense = {1: 0.113, 2: 0.163, 4: 0.192, 6: 0.195, 8: 0.205}
    packed_seconds = {1: 0.161, 2: 0.172, 4: 0.139, 6: 0.144, 8: 0.163}
    assert packed._score(packed_seconds, "target") < 0.93 * packed._score(dense, "target")
    assert packed._score(packed_seconds, "steps") > packed._score(dense, "steps")
    assert packed._score(dense, "target") == pytest.approx(0.25 * 0.113 + 0.75 * (0.163 + 0.192 + 0.195 + 0.205) / 4)


def test_a_draft_is_put_on_the_path_cheapest_for_a_whole_round():
    """A draft pays steps, a 2-token catch-up and a share of a prefill (`DRAFT_ROUND`), not the step alone: a path whose
    step is 5% slower but whose catch-up and prefill cost about a step wins for a draft, and loses for steps."""
    dense = {1: 0.100, 2: 0.150, 16: 0.550}
    packed_seconds = {1: 0.105, 2: 0.106, 16: 0.110}
    assert packed._score(packed_seconds, "draft") < packed._score(dense, "draft")
    assert packed._score(packed_seconds, "steps") > packed._score(dense, "steps")
    assert packed._score(dense, "draft") == pytest.approx(4 * 0.100 + 0.150 + 0.5 * 0.550)
    model = make_tiny_model(seed=0)
    path = optimize(model, role="draft", repeats=1)
    assert all(set(seconds) == set(packed.DRAFT_ROUND) for seconds in path.seconds.values())
    score = {name: packed._score(seconds, "draft") for name, seconds in path.seconds.items() if name != "stock"}
    assert path.name == min(score, key=score.get)
    with pytest.raises(ValueError, match=r"including \[1, 2, 16\] \(for role 'draft'\), but is \[1, 2\]"):
        optimize(model, role="draft", widths=[1, 2])


def test_the_loss_of_plain_steps_on_a_verifying_path_is_reported():
    """A target on the packed path pays its step, not the fastest one, in rounds that draft nothing: said, with the
    ratio, and not said when the path's own step is the fastest."""
    path = packed.CpuPath("packed", 0, {"stock": {1: 0.40}, "dense": {1: 0.30, 6: 0.50}, "packed": {1: 0.33, 6: 0.34}})
    assert path.step_loss() == (pytest.approx(1.1), "dense")
    assert "plain steps (rounds that draft nothing) cost 1.10x the fastest step (dense)" in path.describe()
    fastest = packed.CpuPath("dense", 1, {"dense": {1: 0.30}, "packed": {1: 0.33}})
    assert fastest.step_loss() == (1.0, "dense") and "plain steps" not in fastest.describe()
    assert packed.CpuPath("stock", 0, {}).step_loss() is None


def test_what_cannot_be_optimized_keeps_its_stock_path_with_the_reason(monkeypatch, caplog):
    half = make_tiny_model(seed=0).to(torch.float16)
    assert optimize(half).reason == "torch.float16 weights" and cpu_path(half).name == "stock"

    def refuse(weight, *args):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    model = make_tiny_model(seed=0)
    monkeypatch.setattr(packed.torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    with caplog.at_level(logging.INFO, logger="hf_spec.loading.packed"):
        path = optimize(model, path="packed")
    assert path.name == "stock" and "cannot prepack" in path.reason
    assert not any(isinstance(module, PackedLinear) for module in model.modules())


def test_bad_path_and_role_are_named():
    model = make_tiny_model(seed=0)
    with pytest.raises(ValueError, match="`path` must be 'auto' or one of .*'fast'"):
        optimize(model, path="fast")
    with pytest.raises(ValueError, match="`role` must be one of .*'verify'"):
        optimize(model, role="verify")


def test_costs_are_probed_once_per_process_and_models():
    target, draft = make_tiny_model(seed=0), make_tiny_model(seed=1)
    first = probe_costs(target, ModelDrafter(draft), (2, 3, 4, 5))
    assert probe_costs(target, ModelDrafter(draft), (2, 3, 4, 5)) is first, "keyed by the draft model, not the drafter"
    assert set(first.target_block_seconds) == {1, 2, 3, 4, 5} and first.draft_step_seconds > 0
    assert probe_costs(target, None, (2, 3, 4, 5)).draft_step_seconds == 0.0


def test_the_probe_times_the_two_models_in_turns_so_a_slow_phase_spoils_one_repeat(monkeypatch):
    """One repeat of each model at a time, medians over the repeats: a slow phase during the draft's first repeat
    (5 s where its step costs 0.3 s) leaves the draft's figures alone. Timed in one go, all its passes fell in it."""
    order, draft_seconds = [], iter([5.0, 0.3, 0.3])
    monkeypatch.setattr(costs, "forward_seconds", lambda model, ids, widths, repeats: order.append(("target", repeats))
                        or {width: 1.0 + 0.1 * width for width in widths})

    class PhasedDrafter(ModelDrafter):
        def measure_passes(self, prefix_ids, widths, repeats):
            order.append(("draft", repeats))
            seconds = next(draft_seconds)
            return {width: seconds * width for width in widths}

    table = costs.measure_costs(make_tiny_model(seed=0), PhasedDrafter(make_tiny_model(seed=1)),
                                torch.tensor([[1, 2, 3]]), [2, 3], repeats=3, draft_widths=(1, 2))
    assert order == [("target", 1), ("draft", 1)] * 3
    assert table.draft_step_seconds == 0.3 and table.draft_pass_seconds == {1: 0.3, 2: 0.6}
    assert table.target_block_seconds == pytest.approx({1: 1.1, 2: 1.2, 3: 1.3})


def hopeless_costs() -> CostTable:
    """A draft as dear as the target and blocks that cost a step per token: nothing can pay."""
    return CostTable(1.0, 1.0, {n: float(n) for n in range(1, 12)})


def test_auto_decodes_at_k0_and_says_so_where_speculation_cannot_pay(target, random_draft, caplog):
    auto = AutoDraftLength()
    with caplog.at_level(logging.WARNING, logger="hf_spec.sizing.online"):
        auto.start_from(hopeless_costs())
    assert auto.is_hopeless and "speculation cannot pay" in caplog.text
    prompt = torch.tensor([[1, 2, 3]])
    output = target.generate(prompt, assistant_model=random_draft, num_assistant_tokens=auto, do_sample=False,
                             max_new_tokens=20, return_dict_in_generate=True)
    assert set(auto.chosen) <= {0, 1} and output.speculative_stats.num_draft_tokens <= SHIFT_EVIDENCE
    assert auto.is_hopeless and list(auto.chosen)[-5:] == [0] * 5  # blocks cost a step per token: no draft step pays
    with without_speculation(target):
        assert torch.equal(output.sequences, target.generate(prompt, do_sample=False, max_new_tokens=20))


def test_auto_starts_from_probed_costs_in_generate(target, random_draft):
    auto = AutoDraftLength()
    target.generate(torch.tensor([[1, 2, 3]]), assistant_model=random_draft, num_assistant_tokens=auto,
                    max_new_tokens=4, do_sample=False)
    assert auto.has_costs and auto.block_seconds(1) is not None


def test_rejected_explorations_wait_ever_longer():
    auto = AutoDraftLength(explore_every=2)
    auto.start_from(CostTable(1.0, 0.3, {n: 1.0 for n in range(1, 12)}))
    for _ in range(40):
        k = auto.choose(10)
        auto.update(k, [0], 0.3 * k, k, 1.0)  # every drafted token rejected
    explorations = [i for i, k in enumerate(auto.chosen) if k > 0]
    gaps = [b - a for a, b in itertools.pairwise(explorations)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], auto.chosen


def test_the_clock_overrules_the_cost_model_when_drafting_is_measurably_slower():
    """Costs say drafting pays (a cheap draft, flat blocks) and every draft is accepted, but steady drafting rounds
    emit fewer tokens per second than steady plain rounds (catch-up passes, say): auto then stops drafting."""
    auto = AutoDraftLength()
    auto.start_from(CostTable(1.0, 0.1, {n: 1.0 for n in range(1, 12)}))
    for _ in range(7):
        auto.update(0, [0], 0.0, 0, 1.0)  # plain steps: 1 token per second
    for _ in range(5):
        auto.update(4, [4], 0.4, 4, 9.6)  # 5 tokens in 10 seconds
    assert auto.choose(10) > 0, "too little evidence yet: the cost model decides"
    for _ in range(2):
        auto.update(4, [4], 0.4, 4, 9.6)
    assert auto.choose(10) == 0
    fast = AutoDraftLength()
    fast.start_from(CostTable(1.0, 0.1, {n: 1.0 for n in range(1, 12)}))
    for k, seconds in [(0, 1.0)] * 7 + [(4, 1.5)] * 7:
        fast.update(k, [k], 0.1 * k, k, seconds - 0.1 * k)
    assert fast.choose(10) > 0, "drafting that is measurably faster goes on"


def test_unpacking_restores_requires_grad_as_loaded():
    """torch's oneDNN bf16 matmul of several rows is several times slower for weights with requires_grad=False:
    a layer that was packed and unpacked again must come back as it was loaded."""
    model = make_tiny_model(seed=0)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    optimize(model, path="packed")
    deoptimize(model)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags


def test_a_longer_call_probes_only_the_sizes_it_adds(monkeypatch):
    target, draft = make_tiny_model(seed=0), make_tiny_model(seed=1)
    asked, measure = [], costs.measure_costs
    monkeypatch.setattr(costs, "measure_costs", lambda target, drafter, ids, sizes, *args: asked.append(sizes)
                        or measure(target, drafter, ids, sizes, *args))
    short = probe_costs(target, ModelDrafter(draft), (2, 3))
    longer = probe_costs(target, ModelDrafter(draft), (2, 3, 4, 6))
    assert asked == [[1, 2, 3], [4, 6]]  # the target step is timed with every measurement, to scale it
    assert set(longer.target_block_seconds) == {1, 2, 3, 4, 6}
    assert {size: longer.target_block_seconds[size] for size in (1, 2, 3)} == short.target_block_seconds


def test_probed_costs_are_kept_for_the_next_process(monkeypatch, tmp_path):
    """A fresh process (the in-process table dropped) reads the stored table and probes nothing; another dtype, or
    other kernels, is another table; a damaged file is measured again."""
    monkeypatch.setenv("HF_SPEC_COST_STORE", str(tmp_path))
    target, draft = make_tiny_model(seed=0), make_tiny_model(seed=1)
    first = probe_costs(target, ModelDrafter(draft), (2, 3))
    costs._PROBED.clear()  # what a new process starts from
    monkeypatch.setattr(costs, "measure_costs", lambda *args: pytest.fail("probed again"))
    assert probe_costs(target, ModelDrafter(draft), (2, 3)) == first
    assert probe_costs(make_tiny_model(seed=5), ModelDrafter(make_tiny_model(seed=6)), (2, 3)) == first, \
        "costs depend on shapes and kernels, not weights"
    monkeypatch.undo()
    monkeypatch.setenv("HF_SPEC_COST_STORE", str(tmp_path))
    asked, measure = [], costs.measure_costs
    monkeypatch.setattr(costs, "measure_costs", lambda *args: asked.append(args[3]) or measure(*args))
    probe_costs(make_tiny_model(seed=0).to(torch.bfloat16), ModelDrafter(draft), (2, 3))
    optimize(packed_target := make_tiny_model(seed=0).to(default_dtype()), path="packed")  # a dtype oneDNN packs here
    probe_costs(packed_target, ModelDrafter(draft), (2, 3))
    assert len(asked) == 2 and len(list(tmp_path.glob("*.json"))) == 3
    for file in tmp_path.glob("*.json"):
        file.write_text("{")
    costs._PROBED.clear()
    probe_costs(target, ModelDrafter(draft), (2, 3))
    assert len(asked) == 3


def test_a_tree_probes_only_what_the_chains_table_lacks_and_once_per_machine(monkeypatch, tmp_path):
    """A tree drafter of the same draft times its passes as the chain drafter does: its first probe measures only the
    larger passes a tree may use, and a later process reads its table from disk (it was kept under the chain's key in
    the process, so every fresh process measured the tree's passes again: 6 s of a 64-token first call)."""
    monkeypatch.setenv("HF_SPEC_COST_STORE", str(tmp_path))
    target, draft = make_tiny_model(seed=0), make_tiny_model(seed=1)
    asked, measure = [], costs.measure_costs
    monkeypatch.setattr(costs, "measure_costs", lambda *args: asked.append(args[3]) or measure(*args))
    for process in range(2):
        costs._PROBED.clear()  # a new process: load_pair seeds the chain's table, then an auto tree probes
        chain = probe_costs(target, ModelDrafter(draft), (2, 3))
        tree = probe_costs(target, ModelTreeDrafter(draft), (2, 3, 8))
        assert {size: tree.target_block_seconds[size] for size in (1, 2, 3)} == chain.target_block_seconds
    assert asked == [[1, 2, 3], [8]], "the chain's sizes once, the tree's larger pass once, no process again"


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_an_optimized_pair_starts_auto_k_from_its_kernel_timings_without_a_probe(monkeypatch, quantize):
    """`load_pair` times each model's passes to choose its kernels; those timings are the costs auto k starts from,
    so its first call probes nothing (sizes past the widest timed are extrapolated). Weight-only models have one path
    but are timed too."""
    from hf_spec import load_pair

    pair = load_pair("tiny", "tiny", seed=3, quantize=quantize, quantize_draft=quantize)
    assert (pair.target_path.name == "stock") == (quantize is not None)
    monkeypatch.setattr(costs, "measure_costs", lambda *args: pytest.fail("probed in the call"))
    output = pair.target.generate(torch.tensor([[3, 1, 4, 1, 5]]), assistant_model=pair.draft, max_new_tokens=12,
                                  num_assistant_tokens="auto", do_sample=False, return_dict_in_generate=True)
    assert output.speculative_stats.num_rounds > 0
    table = probe_costs(pair.target, ModelDrafter(pair.draft), (2, 3, 4))
    timed = pair.target_path.seconds[pair.target_path.name]
    assert all(table.target_block_seconds[width] == seconds for width, seconds in timed.items())
    assert {10, 12} <= set(table.target_block_seconds)  # extrapolated up to auto k's largest pass


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_chosen_path_is_kept_for_the_next_process(monkeypatch, tmp_path, role):
    """`optimize` keeps its choice on disk: a later process (another model of the same kind) takes the same path and
    timings without timing anything, and computes what it computed; another role, or the store off, times again; a
    weight-only model keeps its timings (they seed auto k's costs)."""
    monkeypatch.setenv("HF_SPEC_COST_STORE", str(tmp_path))
    first = optimize(make_tiny_model(seed=0).to(torch.bfloat16), role=role)
    timed = optimize(quantize_weights(make_tiny_model(seed=0).to(torch.bfloat16), "int8"), role=role)
    assert timed.name == "stock" and timed.seconds["stock"]
    monkeypatch.setattr(packed, "time_passes", lambda *args: pytest.fail("timed again"))
    again = make_tiny_model(seed=0).to(torch.bfloat16)
    assert optimize(again, role=role) == first and cpu_path(again) == first
    reference = make_tiny_model(seed=0).to(torch.bfloat16)
    optimize(reference, path=first.name)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.equal(again(prompt).logits, reference(prompt).logits)
    assert optimize(quantize_weights(make_tiny_model(seed=1).to(torch.bfloat16), "int8"), role=role) == timed
    with pytest.raises(pytest.fail.Exception, match="timed again"):
        optimize(make_tiny_model(seed=0).to(torch.bfloat16), role="steps")
    monkeypatch.setenv("HF_SPEC_COST_STORE", "off")
    with pytest.raises(pytest.fail.Exception, match="timed again"):
        optimize(make_tiny_model(seed=0).to(torch.bfloat16), role=role)


def test_drafts_pruned_to_other_sizes_keep_their_own_paths(monkeypatch, tmp_path):
    """A pruned vocabulary changes the output layer, not the config: two drafts pruned to different sizes are timed
    each (they shared one stored path and its timings), two of the same size share it."""
    from hf_spec.drafting.vocabulary import prune_vocabulary

    monkeypatch.setenv("HF_SPEC_COST_STORE", str(tmp_path))
    timed, time_passes = [], packed.time_passes
    monkeypatch.setattr(packed, "time_passes", lambda *args, **kwargs: timed.append(1) or time_passes(*args, **kwargs))
    counts = []
    for seed, size in [(0, 8), (1, 12), (2, 8)]:
        optimize(prune_vocabulary(make_tiny_model(seed=seed).to(torch.bfloat16), range(size)), role="draft")
        counts.append(len(timed))
    assert 0 < counts[0] < counts[1] == counts[2]


class _Load:
    """A `hf_spec.timing.load.LoadMeter` that reports what the test says the rest of the machine did."""

    share = 0.0

    def __init__(self):
        self.others_share = _Load.share

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.others_share = _Load.share

    @property
    def is_loaded(self):
        return self.others_share > 0.25


@pytest.fixture
def machine_load(monkeypatch):
    """Set ``machine_load.share`` to the share of the CPUs other processes take while hf_spec times or decodes."""
    from hf_spec import mixin

    for module in (costs, packed, mixin):
        monkeypatch.setattr(module, "LoadMeter", _Load)
    _Load.share = 0.0
    return _Load


def test_costs_timed_on_a_busy_machine_serve_the_process_and_are_not_stored(monkeypatch, tmp_path, machine_load,
                                                                            caplog):
    """A first run while other work keeps the CPUs busy: its probe and its CPU-path choice serve that process only (a
    warning says so); a later quiet process times again and stores what it measured."""
    monkeypatch.setenv("HF_SPEC_COST_STORE", str(tmp_path))
    target, draft = make_tiny_model(seed=0), make_tiny_model(seed=1)
    machine_load.share = 0.8
    with caplog.at_level(logging.WARNING):
        busy = probe_costs(target, ModelDrafter(draft), (2, 3))
        optimize(make_tiny_model(seed=0).to(torch.bfloat16), role="draft")
    assert list(tmp_path.glob("*.json")) == []
    assert "other processes used 80% of the CPUs" in caplog.text
    assert probe_costs(target, ModelDrafter(draft), (2, 3)) is busy, "the process keeps what it measured"
    costs._PROBED.clear()  # a new process, on a quiet machine
    machine_load.share = 0.05
    asked, measure = [], costs.measure_costs
    monkeypatch.setattr(costs, "measure_costs", lambda *args: asked.append(1) or measure(*args))
    probe_costs(target, ModelDrafter(draft), (2, 3))
    optimize(make_tiny_model(seed=0).to(torch.bfloat16), role="draft")
    assert asked == [1] and len(list(tmp_path.glob("*.json"))) == 2


def test_a_quiet_call_corrects_stored_costs_that_a_busy_moment_made_stale(monkeypatch, tmp_path, machine_load):
    """The stored draft step is 5x what it costs (timed while the machine was busy, or on other kernels): a quiet call
    with auto k measures the draft's steps against the target's passes, and the stored table follows; a later
    process starts from a draft step close to what the call measured. A call on a busy machine corrects nothing."""
    from hf_spec.timing.store import load_table, store_key

    monkeypatch.setenv("HF_SPEC_COST_STORE", str(tmp_path))
    target = speculative(make_tiny_model(seed=0))
    draft = make_noisy_copy(target, seed=2, noise=0.05)
    true = probe_costs(target, ModelDrafter(draft), tuple(range(2, 9)))
    key = store_key(target, draft, ModelDrafter(draft), torch.get_num_threads())
    stale = CostTable(true.target_step_seconds, 5 * true.draft_step_seconds, dict(true.target_block_seconds),
                      {width: 5 * seconds for width, seconds in true.draft_pass_seconds.items()})

    def call_with(share):
        costs._PROBED.clear()  # a new process starts from the store
        costs.save_table(key, stale)
        machine_load.share = share
        target.generate(torch.tensor([[3, 1, 4, 1, 5]]), assistant_model=draft, num_assistant_tokens="auto",
                        max_new_tokens=120, do_sample=False, eos_token_id=None)
        return load_table(key, CostTable)

    assert call_with(0.9) == stale, "a busy call's timings are no evidence"
    corrected = call_with(0.0)
    assert {size: corrected.target_block_seconds[size] for size in stale.target_block_seconds} == \
        stale.target_block_seconds, "the target's passes are left alone (the call also timed larger ones)"
    assert corrected.draft_step_seconds < stale.draft_step_seconds / 2
    assert corrected.draft_pass_seconds[1] == pytest.approx(corrected.draft_step_seconds)


def test_stored_costs_are_keyed_by_the_kernels_build(monkeypatch, tmp_path):
    """hf_spec's version and its C++ kernels' sources are in the key, beside the CPU's flags, torch and threads: a
    rebuilt kernel is timed again."""
    from hf_spec.timing import store as cost_store

    target, draft = make_tiny_model(seed=0), make_tiny_model(seed=1)
    key = cost_store.store_key(target, draft, ModelDrafter(draft), 1)
    assert cost_store.store_key(target, draft, ModelDrafter(draft), 2) != key
    path = cost_store.path_key(target, "draft", [1, 2], 3)
    monkeypatch.setattr(cost_store, "_kernels", lambda: "another build")
    assert cost_store.store_key(target, draft, ModelDrafter(draft), 1) != key
    assert cost_store.path_key(target, "draft", [1, 2], 3) != path
    monkeypatch.undo()
    monkeypatch.setattr(cost_store, "_machine", lambda: "another CPU model, or other flags")
    assert cost_store.store_key(target, draft, ModelDrafter(draft), 1) != key


def test_the_load_meter_sees_other_processes(monkeypatch):
    """Measured for real: a busy child process takes a share of the CPUs; a quiet block takes none (to within what
    the rest of this machine did meanwhile)."""
    import subprocess
    import sys
    import time

    from hf_spec.timing.load import LoadMeter, _cpu_seconds

    monkeypatch.delenv("HF_SPEC_LOAD_METER")

    busy_loop = "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"
    with LoadMeter() as meter:
        subprocess.run([sys.executable, "-c", busy_loop], check=True)
    if meter.others_share is None:
        pytest.skip("no /proc/stat here")
    cpus = _cpu_seconds()[1]
    assert meter.others_share >= 0.5 / cpus, "a process busy for the whole block is at least half a CPU of others"
    with LoadMeter() as quiet:
        time.sleep(0.5)
    assert quiet.others_share < meter.others_share


def test_a_sizer_kept_across_calls_corrects_the_stored_costs_once(monkeypatch, tmp_path, machine_load):
    """An `AutoDraftLength` passed to every call keeps the costs it started from; each quiet call's correction scales
    those, so a second call does not scale the corrected table again (which would put the draft at 1/25 of the stale
    figure instead of 1/5)."""
    from hf_spec.timing.store import load_table, store_key

    monkeypatch.setenv("HF_SPEC_COST_STORE", str(tmp_path))
    target = speculative(make_tiny_model(seed=0))
    draft = make_noisy_copy(target, seed=2, noise=0.05)
    true = probe_costs(target, ModelDrafter(draft), tuple(range(2, 9)))
    key = store_key(target, draft, ModelDrafter(draft), torch.get_num_threads())
    costs._PROBED.clear()
    costs.save_table(key, CostTable(true.target_step_seconds, 5 * true.draft_step_seconds,
                                    dict(true.target_block_seconds),
                                    {width: 5 * seconds for width, seconds in true.draft_pass_seconds.items()}))
    auto, steps = AutoDraftLength(), []
    for _ in range(3):
        target.generate(torch.tensor([[3, 1, 4, 1, 5]]), assistant_model=draft, num_assistant_tokens=auto,
                        max_new_tokens=120, do_sample=False, eos_token_id=None)
        steps.append(load_table(key, CostTable).draft_step_seconds)
    assert steps[0] < 5 * true.draft_step_seconds / 2
    assert steps[2] == pytest.approx(steps[0], rel=0.5), steps
