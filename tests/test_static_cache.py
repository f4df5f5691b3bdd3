"""Static caches (``cache_implementation="static"``) and compiled passes (``compile_config``): greedy output equals
target-only decoding (ragged batches, trees, prompt lookup, a returned cache that continues), sampling keeps the
target's law, a steady-state call compiles no new graph, and a cache too small or a setting we cannot honour is
refused. Each check has a negative control that must fail."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CASES,
    MIXED_PROMPTS,
    MIXED_SETTINGS,
    PAD,
    PROMPTS,
    BanSuccessorOfLastToken,
    exact_law,
    left_padded,
    make_noisy_copy,
    make_tiny_model,
    sample_mixed_prompts,
    sample_speculative,
)
from transformers import CompileConfig, StaticCache

import hf_spec.compiled
import hf_spec.forward
import hf_spec.rounds
from hf_spec import speculative, without_speculation
from hf_spec.caches import static_cache_size, static_length
from hf_spec.evaluation.exactness import fit_sequences
from hf_spec.loading.packed import optimize

DRAFTING = {
    "chain k3": {"num_assistant_tokens": 3},
    "auto k": {"num_assistant_tokens": "auto"},
    "tree": {"num_tree_nodes": 8},
    "lookup, then the draft": {"prompt_lookup_num_tokens": 4},
}
EAGER_COMPILE = CompileConfig(backend="eager", fullgraph=False, dynamic=False)  # dynamo's graphs, no code generation


@pytest.fixture(scope="module")
def model():
    return speculative(make_tiny_model(seed=0, vocab_size=256))


@pytest.fixture(scope="module")
def assistant(model):
    return make_noisy_copy(model, seed=3, noise=0.3)


def greedy(model, input_ids, attention_mask=None, **kwargs):
    return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False,
                          pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize("drafting", list(DRAFTING))
def test_static_cache_greedy_equals_target_only(model, assistant, drafting):
    batches = ([left_padded([prompt]) for prompt in PROMPTS] if "num_tree_nodes" in DRAFTING[drafting]
               else [left_padded(PROMPTS)])  # trees take one row; chains a ragged batch
    for input_ids, mask in batches:
        expected = greedy(model, input_ids, mask)
        output = greedy(model, input_ids, mask, assistant_model=assistant, cache_implementation="static",
                        return_dict_in_generate=True, **DRAFTING[drafting])
        assert torch.equal(output.sequences, expected)
        if drafting != "auto k":  # auto k may time the tiny draft as not paying, and draft nothing
            assert output.speculative_stats.num_accepted > 0


def test_a_returned_static_cache_continues_exactly(model, assistant):
    prompt = torch.tensor([PROMPTS[1]])
    expected = greedy(model, prompt)
    output = greedy(model, prompt, assistant_model=assistant, cache_implementation="static", max_cache_len=64,
                    return_dict_in_generate=True)
    assert torch.equal(output.sequences, expected)
    assert isinstance(output.cache, StaticCache) and static_length(output.cache) == 64  # the user's size, honoured
    assert int(output.cache.get_seq_length()) == expected.shape[1] - 1
    more = model.generate(output.sequences, cache=output.cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(more, model.generate(expected, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("case", ["combined_chain_k4", "min_new_tokens_suppress_tokens"])
def test_static_cache_samples_the_target_law(small_target, small_draft, case):
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(small_target, small_draft, settings, user_processors, k, seed=31,
                                 cache_implementation="static")
    result = fit_sequences(samples, exact_law(small_target, settings, user_processors))
    assert result.is_consistent, result


def _mask_one_slot_late(original):
    """Broken: a static cache's 2D mask shifted one slot to the right of the cache's slots (off by one)."""
    def missing_inputs(model, cache, sequence_ids, attention_mask, num_logits):
        inputs = original(model, cache, sequence_ids, attention_mask, num_logits)
        if static_length(cache) is not None:
            inputs["attention_mask"] = F.pad(inputs["attention_mask"][:, :-1], (1, 0))
        return inputs
    return missing_inputs


def mixed_prompt_fits(target, draft, seed: int) -> list:
    """Rows with two prompts of different lengths, left-padded, on a static cache: the fit of each prompt's rows."""
    return [fit_sequences(samples, exact_law(target, MIXED_SETTINGS, [BanSuccessorOfLastToken()], prompt))
            for samples, prompt in zip(sample_mixed_prompts(target, draft, seed, cache_implementation="static"),
                                       MIXED_PROMPTS)]


def test_left_padded_rows_on_a_static_cache_sample_their_own_laws(small_target, small_draft):
    results = mixed_prompt_fits(small_target, small_draft, seed=32)
    assert all(result.is_consistent for result in results), results


def test_negative_control_a_static_mask_off_the_cache_slots_is_caught(small_target, small_draft, monkeypatch):
    monkeypatch.setattr(hf_spec.forward, "_missing_inputs", _mask_one_slot_late(hf_spec.forward._missing_inputs))
    k, settings, user_processors = CASES["temperature_1"]
    samples = sample_speculative(small_target, small_draft, settings, user_processors, k, seed=31,
                                 cache_implementation="static")
    result = fit_sequences(samples, exact_law(small_target, settings, user_processors))
    assert not result.is_consistent, result


def graphs(models, config) -> int:
    return sum(hf_spec.compiled.compiled_forward(m, config).num_graphs for m in models)


@pytest.mark.parametrize("drafting", ["chain k3", "lookup, then the draft"])
def test_compiled_passes_equal_target_only_and_compile_once(model, assistant, drafting):
    torch._dynamo.reset()
    input_ids, mask = left_padded(PROMPTS[:2])
    expected = greedy(model, input_ids, mask)
    settings = {"assistant_model": assistant, "cache_implementation": "static", "compile_config": EAGER_COMPILE,
                **DRAFTING[drafting]}
    assert torch.equal(greedy(model, input_ids, mask, **settings), expected)
    first = graphs([model, assistant], EAGER_COMPILE)
    assert first > 0  # the passes did run compiled
    for _ in range(2):  # the same shapes again: every graph is reused
        assert torch.equal(greedy(model, input_ids, mask, **settings), expected)
    assert graphs([model, assistant], EAGER_COMPILE) == first
    assert torch.equal(greedy(model, input_ids, mask, **settings, disable_compile=True), expected)


def test_a_prompt_of_another_length_reuses_the_compiled_graphs(model):
    """The cache hf_spec makes is rounded up (`static_cache_size`), so its size, which every compiled pass's shapes
    hold, is the same for prompts of 3 and 4 tokens (whose prefills are padded to the same widths). The draft is the
    target's copy, so both calls run rounds of the same widths. Without the rounding the second call compiles every
    pass again."""
    torch._dynamo.reset()
    exact_copy = make_noisy_copy(model, seed=3, noise=0.0)
    settings = {"assistant_model": exact_copy, "cache_implementation": "static", "compile_config": EAGER_COMPILE,
                "num_assistant_tokens": 3}
    for length in (3, 4):
        prompt = torch.tensor([PROMPTS[1][:length]])
        assert torch.equal(greedy(model, prompt, **settings), greedy(model, prompt))
        if length == 3:
            first = graphs([model, exact_copy], EAGER_COMPILE)
    assert graphs([model, exact_copy], EAGER_COMPILE) == first


def test_a_static_cache_made_for_a_call_is_rounded_up_to_a_power_of_two():
    assert [static_cache_size(n) for n in (1, 256, 257, 600, 1024, 1025)] == [256, 256, 512, 1024, 1024, 2048]


def _padding_in_front(inputs: dict, width: int) -> dict:
    """Broken: the padding tokens go before the fed ones, so the crop afterwards keeps the padding's entries."""
    extra = width - inputs["input_ids"].shape[1]
    ids, positions = inputs["input_ids"], inputs["position_ids"]
    return {**inputs, "input_ids": torch.cat([ids[:, :1].expand(-1, extra), ids], dim=1),
            "position_ids": torch.cat([positions[:, :1].expand(-1, extra), positions], dim=1), "logits_to_keep": 0}


def test_negative_control_padding_in_front_of_a_compiled_pass_is_caught(model, assistant, monkeypatch):
    monkeypatch.setattr(hf_spec.forward, "pad_inputs", _padding_in_front)
    prompt = torch.tensor([PROMPTS[1]])
    output = greedy(model, prompt, assistant_model=assistant, cache_implementation="static",
                    compile_config=EAGER_COMPILE)
    assert not torch.equal(output, greedy(model, prompt))


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
def test_inductor_compiled_passes_equal_target_only():
    target = speculative(make_tiny_model(seed=4, vocab_size=128, num_layers=1))
    config = CompileConfig(fullgraph=False, dynamic=False)  # transformers' default backend, inductor
    prompt = torch.tensor([[5, 9, 5, 9, 7, 5, 9, 5]])
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    output = target.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3,
                             cache_implementation="static", compile_config=config)
    assert torch.equal(output, expected) and graphs([target], config) > 0


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
def test_inductor_compiles_a_model_on_the_packed_cpu_path():
    """oneDNN's op on a prepacked weight cannot be lowered by inductor; it runs as one opaque op in the graph."""
    target = speculative(make_tiny_model(seed=4, vocab_size=128, num_layers=1))
    if optimize(target, "packed").name != "packed":
        pytest.skip("oneDNN cannot prepack float32 weights on this CPU")
    config = CompileConfig(fullgraph=False, dynamic=False)
    prompt = torch.tensor([[5, 9, 5, 9, 7, 5, 9, 5]])
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    output = target.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3,
                             cache_implementation="static", compile_config=config)
    assert torch.equal(output, expected) and graphs([target], config) > 0


def test_a_max_cache_len_below_max_length_is_refused_before_any_pass(model, assistant):
    passes = []
    handle = model.register_forward_pre_hook(lambda module, args: passes.append(1))
    try:
        with pytest.raises(ValueError, match="`max_cache_len`=12 is smaller than `max_length`=24"):
            model.generate(torch.tensor([[1, 2, 3, 4]]), assistant_model=assistant, max_new_tokens=20,
                           cache_implementation="static", max_cache_len=12)
    finally:
        handle.remove()
    assert not passes


def test_the_static_cache_of_a_call_does_not_depend_on_earlier_calls(model, assistant):
    """transformers remembers the largest static cache an earlier call of the model made; hf_spec's size follows the
    call alone (a power of two of at least 256 positions), so it is the same in a fresh process."""
    prompt = torch.tensor([[1, 2, 3, 4]])
    with without_speculation(model):
        model.generate(prompt, max_new_tokens=30, cache_implementation="static", do_sample=False)
    output = model.generate(prompt, assistant_model=assistant, cache_implementation="static", max_new_tokens=10,
                            do_sample=False, return_dict_in_generate=True)
    assert static_length(output.cache) == static_cache_size(4 + 10 + 5 + 1) == 256


def test_a_filled_static_cache_too_small_is_refused_naming_max_cache_len(model, assistant):
    prompt = torch.tensor([PROMPTS[1]])
    cache = StaticCache(config=model.config, max_cache_len=12)
    first = model.generate(prompt, cache=cache, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="max_cache_len="):
        model.generate(first, cache=cache, assistant_model=assistant, max_new_tokens=3, do_sample=False)


def _poisoning(original, offset: int):
    """After every rollback of a static cache, its slots from ``length + offset`` on are filled with large finite
    values: ``offset=0`` poisons only the stale entries past the write position (which no later query may see),
    ``offset=-1`` the last kept one too (a negative control: the committed text, which queries do see)."""
    def crop_then_poison(cache, length):
        original(cache, length)
        if static_length(cache) is not None:
            for layer in cache.layers:
                layer.keys[:, :, length + offset:] = 1e3
                layer.values[:, :, length + offset:] = -1e3
    return crop_then_poison


@pytest.mark.parametrize("offset, is_exact", [(0, True), (-1, False)])
def test_stale_entries_past_the_write_position_never_reach_a_query(model, assistant, monkeypatch, offset, is_exact):
    monkeypatch.setattr(hf_spec.rounds, "crop_to", _poisoning(hf_spec.rounds.crop_to, offset))
    input_ids, mask = left_padded(PROMPTS)
    output = greedy(model, input_ids, mask, assistant_model=assistant, cache_implementation="static",
                    num_assistant_tokens=4, return_dict_in_generate=True)
    assert output.speculative_stats.num_draft_tokens > output.speculative_stats.num_accepted  # rollbacks happened
    assert torch.equal(output.sequences, greedy(model, input_ids, mask)) == is_exact


def test_compiled_passes_call_the_models_hooks(model, assistant):
    calls = []
    prompt = torch.tensor([PROMPTS[1]])
    settings = {"assistant_model": assistant, "cache_implementation": "static", "num_assistant_tokens": 3}
    handles = [model.register_forward_pre_hook(lambda module, args: calls.append("pre")),
               model.register_forward_hook(lambda module, args, output: calls.append("post"))]
    try:
        greedy(model, prompt, **settings)
        eager_calls, calls[:] = list(calls), []
        greedy(model, prompt, **settings, compile_config=EAGER_COMPILE)
        assert calls == eager_calls and calls.count("pre") == calls.count("post") > 0  # every pass, in order
    finally:
        for handle in handles:
            handle.remove()
