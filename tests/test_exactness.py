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
    resample_from_p,
    sample_mixed_prompts,
    sample_speculative,
)

import hf_spec.rejection
import hf_spec.rounds
from hf_spec.evaluation.exactness import fit_sequences


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


def test_negative_control_q_from_another_row_is_caught(small_target, small_draft, monkeypatch):
    monkeypatch.setattr(hf_spec.rounds, "accept_draft_tokens", _q_from_the_next_row)
    results = [
        fit_sequences(samples, exact_law(small_target, MIXED_SETTINGS, [BanSuccessorOfLastToken()], prompt))
        for samples, prompt in zip(sample_mixed_prompts(small_target, small_draft, seed=6), MIXED_PROMPTS)
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
    broken = {"accept_draft_tokens": resample_from_p, "process_block": _block_without_draft_prefix}[patch]
    monkeypatch.setattr(hf_spec.rounds, patch, broken)
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(small_target, small_draft, settings, user_processors, k, seed=99)
    result = fit_sequences(samples, exact_law(small_target, settings, user_processors))
    assert not result.is_consistent, result
