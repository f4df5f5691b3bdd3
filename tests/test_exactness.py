"""Statistical exactness end to end: ``generate(assistant_model=...)`` against the target's enumerated law
(`helpers.exact_law`). Each family of bug has a negative control that must fail."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    CASES,
    MIXED_PROMPTS,
    MIXED_SETTINGS,
    BanSuccessorOfLastToken,
    exact_law,
    sample_mixed_prompts,
    sample_speculative,
)

import hf_spec.rejection
import hf_spec.rounds
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, broken_rules, fit_sequences


@pytest.mark.parametrize("case", list(CASES))
def test_rows_of_a_batch_sample_the_target_law(small_target, small_draft, case):
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(small_target, small_draft, settings, user_processors, k, seed=len(case))
    result = fit_sequences(samples, exact_law(small_target, settings, user_processors))
    assert result.is_consistent, result


@pytest.mark.parametrize("case", ["temperature_0.7_top_k", "eta_user_processor_k5", "combined_chain_k4"])
def test_separate_calls_sample_the_target_law(small_target, small_draft, case):
    """Batch of one, one call per sample: the single-row path."""
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(small_target, small_draft, settings, user_processors, k, seed=7, as_rows=False)
    result = fit_sequences(samples, exact_law(small_target, settings, user_processors))
    assert result.is_consistent, result


def test_left_padded_rows_with_different_prompts_sample_their_own_laws(small_target, small_draft):
    for samples, prompt in zip(sample_mixed_prompts(small_target, small_draft, seed=5), MIXED_PROMPTS):
        result = fit_sequences(samples, exact_law(small_target, MIXED_SETTINGS, [BanSuccessorOfLastToken()], prompt))
        assert result.is_consistent, result


def _q_from_the_next_row(draft_ids, draft_probs, target_probs, generator):
    """Broken: each row's acceptance ratio uses the draft law of the row after it."""
    return hf_spec.rejection.accept_draft_tokens(draft_ids, draft_probs.roll(1, dims=0), target_probs, generator)


def test_negative_control_q_from_another_row_is_caught(small_target, small_draft):
    broken = broken_rules(_q_from_the_next_row)
    results = [
        fit_sequences(samples, exact_law(small_target, MIXED_SETTINGS, [BanSuccessorOfLastToken()], prompt))
        for samples, prompt in zip(sample_mixed_prompts(small_target, small_draft, seed=6, verification=broken),
                                   MIXED_PROMPTS)
    ]
    assert not all(result.is_consistent for result in results), results


def _block_without_draft_prefix(processors, prefix_ids, block_ids, logits, prefix_lengths):
    """Broken: every block position is processed as if it followed the prefix alone (batch of one here)."""
    prefix_ids = prefix_ids[:, : int(prefix_lengths[0])]
    return torch.stack([processors(prefix_ids, logits[:, i].clone()) for i in range(logits.shape[1])], dim=1)


@pytest.mark.parametrize(
    "patch, case",
    [("accept_draft_tokens", "temperature_1"), ("process_block", "eta_user_processor_k5")],
)
def test_negative_control_broken_loop_is_caught(small_target, small_draft, monkeypatch, patch, case):
    extra = {"verification": RESAMPLE_FROM_P} if patch == "accept_draft_tokens" else {}
    if patch == "process_block":  # a broken processor pass, not a rule: it lives inside the rounds
        monkeypatch.setattr(hf_spec.rounds, patch, _block_without_draft_prefix)
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(small_target, small_draft, settings, user_processors, k, seed=99, **extra)
    result = fit_sequences(samples, exact_law(small_target, settings, user_processors))
    assert not result.is_consistent, result


# --- the two acceptance rules of sampled chains ---------------------------------------------------------------------

@pytest.mark.parametrize("case", ["temperature_1", "combined_chain_k4", "min_new_tokens_suppress_tokens"])
def test_the_token_wise_rule_samples_the_target_law(small_target, small_draft, case):
    """``verification="token"``: the seeds' rule, still selectable (block verification is the default)."""
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(small_target, small_draft, settings, user_processors, k, seed=3 + len(case),
                                 verification="token")
    result = fit_sequences(samples, exact_law(small_target, settings, user_processors))
    assert result.is_consistent, result


def _first_failure_scan(draft_ids, draft_probs, target_probs, generator):
    """Broken block verification: the row keeps the draft up to its first failed stop test, not its last passed."""
    stop, residuals = hf_spec.rejection.block_laws(draft_ids, draft_probs, target_probs)
    batch_size, k = draft_ids.shape
    if k == 0:  # nothing drafted (the last token): nothing to scan
        return hf_spec.rejection.accept_block(draft_ids, draft_probs, target_probs, generator)
    passed = torch.rand((batch_size, k), dtype=torch.float64, generator=generator) < stop[:, 1:]
    num_accepted = torch.where(passed.all(1), k, (~passed).long().argmax(1))
    residual = residuals[torch.arange(batch_size), num_accepted]
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual,
                           target_probs[torch.arange(batch_size), num_accepted].double())
    next_ids = hf_spec.rejection.sample_from_weights(residual, generator)
    return hf_spec.rejection._assemble_output(draft_ids, num_accepted, next_ids), num_accepted


def test_negative_control_block_verification_scanned_token_wise_is_caught(small_target, small_draft):
    k, settings, user_processors = CASES["combined_chain_k4"]
    samples = sample_speculative(small_target, small_draft, settings, user_processors, k, seed=98,
                                 verification=broken_rules(_first_failure_scan))
    assert not fit_sequences(samples, exact_law(small_target, settings, user_processors)).is_consistent


def test_the_rule_that_ran_is_reported_and_bad_choices_are_refused(small_target, small_draft):
    prompt = torch.tensor([[1, 3, 2]])
    common = {"assistant_model": small_draft, "max_new_tokens": 6, "return_dict_in_generate": True}
    ran = {name: small_target.generate(prompt, **common, **extra).speculative_stats.verification for name, extra in {
        "default": {"do_sample": True}, "token": {"do_sample": True, "verification": "token"},
        "greedy": {"do_sample": False}, "tree": {"do_sample": True, "num_tree_nodes": 4},
        "tree_token": {"do_sample": True, "num_tree_nodes": 4, "verification": "token"},
        "confidence": {"do_sample": True, "assistant_confidence_threshold": 0.3}}.items()}
    assert ran == {"default": "block", "token": "token", "greedy": "greedy", "tree": "traversal", "tree_token": "tree",
                   "confidence": "token"}
    with pytest.raises(ValueError, match=r"`verification` must be one of \('block', 'token'\) or a hf_spec "
                                         r"Verification, but is 'tree'"):
        small_target.generate(prompt, verification="tree", **common)
    with pytest.raises(ValueError, match="used by speculative decoding only"):
        small_target.generate(prompt, verification="token", max_new_tokens=4)
