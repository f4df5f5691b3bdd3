"""Sliding windows and recurrent states in ragged batches: the cause of the old failure, proved on one forward pass,
then greedy equality with target-only for every drafter kind and the sampled law, each with its negative control."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import NUM_SAMPLES, PROMPT, exact_law, with_length
from transformers import DynamicCache, MambaConfig, MambaForCausalLM, MistralConfig, MistralForCausalLM

import hf_spec.decoding
import hf_spec.rounds
from hf_spec import speculative, without_speculation
from hf_spec.caches import ColumnRules, column_rules, crop_to, move_columns, prepare_for_rollback
from hf_spec.compat import records_recurrent_states
from hf_spec.drafting.model import ModelDrafter
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, fit_sequences
from hf_spec.evaluation.zoo import near_copy
from hf_spec.heads import DraftHead

needs_recording = pytest.mark.skipif(not records_recurrent_states(),
                                     reason="recurrent-state recording needs transformers >= 5.25")


def mistral(window: int, vocab_size: int = 64, seed: int = 0, head_scale: float = 1.0) -> MistralForCausalLM:
    config = MistralConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                           sliding_window=window, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def mamba(vocab_size: int = 64, seed: int = 0, head_scale: float = 1.0) -> MambaForCausalLM:
    config = MambaConfig(vocab_size=vocab_size, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
                         conv_kernel=4, pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MambaForCausalLM(config).eval()
        with torch.no_grad():  # transformers' init leaves the head near zero: every law near uniform
            model.lm_head.weight.normal_(0, head_scale / 8)
    return model


def ragged(lengths: list[int], vocab_size: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    rows = [torch.randint(3, vocab_size, (n,), generator=generator) for n in lengths]
    ids = torch.stack([F.pad(row, (width - len(row), 0)) for row in rows])
    mask = torch.stack([F.pad(torch.ones_like(row), (width - len(row), 0)) for row in rows])
    return ids, mask


# --- The cause, on one forward pass ---------------------------------------------------------------------------------


def test_holes_inside_a_window_hide_a_rows_tokens_and_moving_them_left_restores_its_logits():
    """A row whose last columns hold holes (masked rejected drafts) sees fewer of its own tokens than the window:
    transformers counts a sliding window in cache columns, holes included. That was the old failure. Moving the holes
    to the left of the window, in the cache and the mask alike, gives the row's own logits back."""
    model = mistral(window=4)
    row = torch.tensor([[7, 9, 11, 13, 15, 17, 19, 21, 23, 25]])
    with torch.no_grad():
        alone = model(row).logits[0, -1]  # the row decoded alone: its last 4 tokens in the window
        cache = DynamicCache(config=model.config)
        prepare_for_rollback(cache, 4)
        model(row[:, :8], cache=cache)  # the prompt's columns 0-7
        model(torch.tensor([[23, 5, 5]]), cache=cache)  # a verify block: 23 accepted, the two drafts after it not
        # the model view: 7 .. 21, 23, hole, hole, then the newest token 25 (column 11)
        mask = torch.tensor([[1] * 9 + [0, 0] + [1]])
        position = torch.tensor([[9]])  # positions follow the mask: holes shift nothing
        with_holes = model(row[:, -1:], attention_mask=mask, position_ids=position,
                           cache=_copy(cache, model)).logits[0, -1]
        assert not torch.allclose(with_holes, alone, atol=1e-3)  # the cause: the window holds 23 and 25 only

        order = torch.argsort(mask[:, :-1], dim=1, stable=True)  # holes first, the tokens in their order
        move_columns(cache, 0, order)
        crop_to(cache, 11)
        moved_mask = torch.cat([mask[:, :-1].gather(1, order), mask[:, -1:]], dim=1)
        moved = model(row[:, -1:], attention_mask=moved_mask, position_ids=position, cache=cache).logits[0, -1]
    torch.testing.assert_close(moved, alone, atol=1e-5, rtol=1e-5)


def _copy(cache, model):
    """A cache holding the same entries (the forward above must not change the one the test goes on with)."""
    copied = DynamicCache(config=model.config)
    prepare_for_rollback(copied, 4)
    for source, target in zip(cache.layers, copied.layers):
        target.lazy_initialization(source.keys, source.values)
        target.keys, target.values = source.keys.clone(), source.values.clone()
        target.cumulative_length = source.cumulative_length
    return copied


def test_column_rules_name_windows_and_recurrent_states():
    rules = column_rules(DynamicCache(config=mistral(window=6).config))
    assert rules == ColumnRules(6, True)
    assert rules | ColumnRules(None, False) == ColumnRules(6, False)
    assert column_rules(DynamicCache(config=mamba().config)).allows_holes is False


# --- Greedy: every drafter kind against target-only, ragged, prompts longer than the window -----------------------


def test_the_issue_reproducer_is_equal_with_two_unpadded_rows():
    """The reproducer from the report: two rows of 30 tokens, window 8, a near-copy draft, greedy."""
    target = mistral(window=8, vocab_size=256)
    draft = near_copy(target)
    ids = torch.randint(3, 250, (2, 30), generator=torch.Generator().manual_seed(1))
    settings = {"attention_mask": torch.ones_like(ids), "do_sample": False, "max_new_tokens": 40, "pad_token_id": 0}
    expected = target.generate(ids, **settings)
    output = speculative(target).generate(ids, assistant_model=draft, return_dict_in_generate=True, **settings)
    assert torch.equal(output.sequences, expected)
    assert output.speculative_stats.num_accepted > 10


@pytest.fixture(scope="module")
def window_pair():
    target = speculative(mistral(window=6, head_scale=4.0))
    return target, near_copy(target, noise=0.1)


def _greedy(target, ids, mask, **extra):
    settings = {"attention_mask": mask, "do_sample": False, "max_new_tokens": 30, "pad_token_id": 0}
    with without_speculation(target):
        expected = target.generate(ids, **settings)
    output = target.generate(ids, return_dict_in_generate=True, **settings, **extra)
    return expected, output


@pytest.mark.parametrize("drafter", ["model", "auto k", "prompt lookup", "lookup then model", "head"])
def test_greedy_sliding_window_batches_equal_target_only(window_pair, drafter):
    target, draft = window_pair
    ids, mask = ragged([20, 13, 9, 17])
    if drafter in ("prompt lookup", "lookup then model"):  # prompts that repeat, so that lookups are found
        ids = torch.cat([ids, ids[:, -10:]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, -10:])], dim=1)
    extra = {"model": {"assistant_model": draft, "num_assistant_tokens": 4},
             "auto k": {"assistant_model": draft, "num_assistant_tokens": "auto"},
             "prompt lookup": {"prompt_lookup_num_tokens": 5},
             "lookup then model": {"assistant_model": draft, "prompt_lookup_num_tokens": 3},
             "head": {"assistant_model": DraftHead.from_target(target), "num_assistant_tokens": 3}}[drafter]
    expected, output = _greedy(target, ids, mask, **extra)
    assert torch.equal(output.sequences, expected)
    assert output.speculative_stats.num_draft_tokens > 0


def test_a_block_longer_than_the_window_is_exact(window_pair):
    target, draft = window_pair
    ids, mask = ragged([15, 8, 11])
    expected, output = _greedy(target, ids, mask, assistant_model=draft, num_assistant_tokens=9)
    assert torch.equal(output.sequences, expected)
    assert max(output.speculative_stats.rounds_by_draft_length) == 9


def test_moving_holes_keeps_the_drafts_acceptance(window_pair):
    """The draft's cache follows the moved columns: in a batch it is accepted about as often as row by row."""
    target, draft = window_pair
    ids, mask = ragged([20, 13, 9, 17])
    _, batched = _greedy(target, ids, mask, assistant_model=draft, num_assistant_tokens=4)
    alone = [_greedy(target, ids[r:r + 1, mask[r].argmax():], None, assistant_model=draft,
                     num_assistant_tokens=4)[1].speculative_stats for r in range(4)]
    rate_alone = sum(s.num_accepted for s in alone) / sum(s.num_draft_tokens for s in alone)
    assert batched.speculative_stats.acceptance_rate > rate_alone - 0.1


def test_trees_refuse_a_sliding_window_by_name(window_pair):
    target, draft = window_pair
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        target.generate(PROMPT, assistant_model=draft, num_tree_nodes=4, max_new_tokens=4)


@pytest.mark.parametrize("family", ["mistral", "mamba"])
def test_static_caches_of_windows_and_recurrent_states_are_refused_by_name_before_any_pass(family):
    target = speculative(mistral(window=6) if family == "mistral" else mamba())
    passes = []
    handle = target.register_forward_pre_hook(lambda module, args: passes.append(1))
    ids, mask = ragged([20, 13])
    try:
        with pytest.raises(ValueError, match=f"'{family}'.*cannot"):  # (transformers 5.24: no recording, named first)
            target.generate(ids, attention_mask=mask, assistant_model=near_copy(target), max_new_tokens=8,
                            pad_token_id=0, cache_implementation="static")
    finally:
        handle.remove()
    assert not passes


@needs_recording
@pytest.mark.parametrize("drafter", ["model", "auto k", "prompt lookup", "mamba draft of a llama"])
def test_greedy_recurrent_batches_equal_target_only(drafter):
    target = speculative(mamba(head_scale=4.0))
    draft = near_copy(target, noise=0.1)
    ids, mask = ragged([20, 13, 9, 17])
    if drafter == "prompt lookup":
        ids = torch.cat([ids, ids[:, -10:]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, -10:])], dim=1)
    if drafter == "mamba draft of a llama":
        from helpers import make_tiny_model
        draft, target = target, speculative(make_tiny_model(seed=4, vocab_size=64))
    extra = {"prompt lookup": {"prompt_lookup_num_tokens": 5},
             "auto k": {"assistant_model": draft, "num_assistant_tokens": "auto"}}.get(
        drafter, {"assistant_model": draft, "num_assistant_tokens": 4})
    expected, output = _greedy(target, ids, mask, **extra)
    assert torch.equal(output.sequences, expected)
    assert output.speculative_stats.num_draft_tokens > 0


@needs_recording
def test_a_recurrent_batch_keeps_the_same_number_of_tokens_in_every_row():
    target = speculative(mamba(head_scale=4.0))
    ids, mask = ragged([20, 13, 9, 17])
    _, output = _greedy(target, ids, mask, assistant_model=near_copy(target, noise=0.3), num_assistant_tokens=4)
    rows = output.speculative_stats.rows
    assert len({row.num_accepted for row in rows}) == 1  # no row kept more drafts than another


@pytest.mark.skipif(records_recurrent_states(), reason="this transformers records recurrent states")
def test_recurrent_models_are_refused_by_name_without_recording():
    target = speculative(mamba())
    with pytest.raises(ValueError, match="'mamba'.*5.25"):
        target.generate(PROMPT, assistant_model=near_copy(target), max_new_tokens=4)


# --- The sampled law in a batch of independent rows, with negative controls ----------------------------------------

SETTINGS = {"temperature": 1.0}


def _sample(target, draft, seed: int, **extra) -> np.ndarray:
    """NUM_SAMPLES rows of one batch, each a sample of three tokens: rows accept different counts, so the batch has
    holes (windows) or keeps the fewest (recurrent states) every round."""
    prompt = torch.tensor([[1, 3, 2, 2, 1, 3]])  # longer than the window
    output = target.generate(prompt.expand(NUM_SAMPLES, -1), assistant_model=draft, do_sample=True,
                             num_assistant_tokens=2, generator=torch.Generator().manual_seed(seed), pad_token_id=0,
                             **with_length(SETTINGS), **extra)
    return output[:, prompt.shape[1]:].numpy(), prompt


def _ignore_column_rules(monkeypatch):
    """The loop as it was: holes anywhere, whatever the caches' layers."""
    monkeypatch.setattr(hf_spec.decoding, "model_column_rules", lambda model, cache: ColumnRules())
    monkeypatch.setattr(ModelDrafter, "column_rules", lambda self: ColumnRules())


@pytest.fixture(scope="module")
def small_window_pair():
    target = speculative(mistral(window=2, vocab_size=4, head_scale=6.0, seed=10))
    return target, near_copy(target, noise=1.5)


def test_sampling_a_sliding_window_batch_follows_the_target_law(small_window_pair):
    target, draft = small_window_pair
    samples, prompt = _sample(target, draft, seed=0)
    assert fit_sequences(samples, exact_law(target, SETTINGS, [], prompt)).is_consistent


def test_negative_control_holes_left_inside_the_window_are_caught(small_window_pair, monkeypatch):
    """The old behaviour (holes stay where they are) must fail the same test."""
    target, draft = small_window_pair
    _ignore_column_rules(monkeypatch)
    samples, prompt = _sample(target, draft, seed=0)
    assert not fit_sequences(samples, exact_law(target, SETTINGS, [], prompt)).is_consistent


def test_negative_control_a_broken_rule_is_caught_in_a_sliding_window_batch(small_window_pair, monkeypatch):
    target, draft = small_window_pair
    samples, prompt = _sample(target, draft, seed=0, verification=RESAMPLE_FROM_P)
    assert not fit_sequences(samples, exact_law(target, SETTINGS, [], prompt)).is_consistent


@pytest.fixture(scope="module")
def small_recurrent_pair():
    target = speculative(mamba(vocab_size=4, head_scale=3.0, seed=10))
    return target, near_copy(target, noise=1.5)


@needs_recording
def test_sampling_a_recurrent_batch_follows_the_target_law(small_recurrent_pair):
    target, draft = small_recurrent_pair
    samples, prompt = _sample(target, draft, seed=0)
    assert fit_sequences(samples, exact_law(target, SETTINGS, [], prompt)).is_consistent


@needs_recording
def test_negative_control_holes_in_recurrent_states_are_caught(small_recurrent_pair, monkeypatch):
    """Rows keeping different counts (holes a recurrent state cannot mask) must fail the same test."""
    target, draft = small_recurrent_pair
    _ignore_column_rules(monkeypatch)
    samples, prompt = _sample(target, draft, seed=0)
    assert not fit_sequences(samples, exact_law(target, SETTINGS, [], prompt)).is_consistent
