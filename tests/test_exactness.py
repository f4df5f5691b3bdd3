"""Statistical exactness end to end: ``generate(assistant_model=...)`` against the target's enumerated law
(`helpers.exact_law`). Each family of bug has a negative control that must fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CASES,
    NUM_SAMPLES,
    BanSuccessorOfLastToken,
    exact_law,
    resample_from_p,
    sample_speculative,
    with_length,
)
from transformers import LogitsProcessorList

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


MIXED_PROMPTS = (torch.tensor([[1, 3, 2]]), torch.tensor([[2, 0, 1, 1, 3]]))
MIXED_SETTINGS = {"temperature": 0.8, "top_k": 3, "repetition_penalty": 1.5}


def sample_mixed_prompts(target, draft, seed: int) -> list[np.ndarray]:
    """One left-padded batch whose rows alternate between the two prompts (every row's neighbours have the other
    prompt); the samples of each prompt."""
    width = max(prompt.shape[1] for prompt in MIXED_PROMPTS)
    rows = [F.pad(prompt, (width - prompt.shape[1], 0)) for prompt in MIXED_PROMPTS]
    masks = [F.pad(torch.ones_like(prompt), (width - prompt.shape[1], 0)) for prompt in MIXED_PROMPTS]
    half = NUM_SAMPLES // 2
    input_ids = torch.stack([row[0] for row in rows]).repeat(half, 1)  # [2 * half, width]: prompt 0, 1, 0, 1, ...
    output = target.generate(
        input_ids, attention_mask=torch.stack([mask[0] for mask in masks]).repeat(half, 1), assistant_model=draft,
        do_sample=True, num_assistant_tokens=3, generator=torch.Generator().manual_seed(seed), pad_token_id=0,
        logits_processor=LogitsProcessorList([BanSuccessorOfLastToken()]), **with_length(MIXED_SETTINGS),
    )[:, width:].numpy()
    return [output[0::2], output[1::2]]


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
