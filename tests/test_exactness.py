"""Statistical exactness end to end: ``generate(assistant_model=...)`` against the target's enumerated law.

The exact reference: the target's processed next-token law on every prefix of up to two generated tokens (the chain
that transformers' target-only sampling builds, applied by transformers), giving the joint law of the first three
generated tokens. Three tokens is more than most block lengths here, so bonus tokens and second rounds are covered.
Each family of bug has a negative control that must fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_noisy_copy, make_tiny_model
from goodness_of_fit import fit_sequences
from transformers import LogitsProcessor, LogitsProcessorList

import hf_spec.decoding
import hf_spec.rejection
from hf_spec import speculative
from hf_spec.evaluation.exactness import exact_law as enumerated_law

VOCAB = 4
NUM_TOKENS = 3
NUM_SAMPLES = 1500
PROMPT = torch.tensor([[1, 3, 2]])


class BanSuccessorOfLastToken(LogitsProcessor):
    """A user processor that depends on the prefix: token (last + 1) % vocab is never allowed."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        banned = (input_ids[:, -1:] + 1) % scores.shape[-1]
        return scores.scatter(1, banned, float("-inf"))


@pytest.fixture(scope="module")
def small_target():
    return speculative(make_tiny_model(seed=10, vocab_size=VOCAB, num_layers=1, head_scale=3.0))


@pytest.fixture(scope="module")
def small_draft(small_target):
    """Close enough to the target for about 50% acceptance: both acceptance and rejection paths are exercised."""
    return make_noisy_copy(small_target, seed=12, noise=1.0)


def with_length(settings: dict) -> dict:
    """Exactly NUM_TOKENS new tokens: EOS is suppressed until then unless the case sets its own min_new_tokens."""
    return {"max_new_tokens": NUM_TOKENS, "min_new_tokens": NUM_TOKENS, **settings}


def exact_law(model, settings: dict, user_processors: list, prompt: torch.Tensor = PROMPT) -> np.ndarray:
    """``[V, V, V]``: P(first three generated tokens) under target-only sampling of ``prompt`` with ``settings``."""
    return enumerated_law(model, with_length(settings), prompt, NUM_TOKENS, user_processors)


def sample_speculative(
    target, draft, settings: dict, user_processors: list, k: int, seed: int, as_rows: bool = True
) -> np.ndarray:
    """``[NUM_SAMPLES, NUM_TOKENS]`` samples: rows of one batch (independent samples), or one call per sample."""
    generator = torch.Generator().manual_seed(seed)

    def generate(prompt):
        return target.generate(
            prompt, assistant_model=draft, do_sample=True, num_assistant_tokens=k, generator=generator,
            logits_processor=LogitsProcessorList(user_processors), pad_token_id=0, **with_length(settings),
        )[:, PROMPT.shape[1] :]

    if as_rows:
        return generate(PROMPT.expand(NUM_SAMPLES, -1)).numpy()
    return np.array([generate(PROMPT)[0].tolist() for _ in range(NUM_SAMPLES)])


CASES = {
    "temperature_1": (1, {}, []),
    "temperature_0.7_top_k": (2, {"temperature": 0.7, "top_k": 3}, []),
    "top_p_repetition_penalty": (3, {"top_p": 0.9, "repetition_penalty": 3.0}, []),
    "min_p_typical": (2, {"min_p": 0.1, "typical_p": 0.9}, []),
    "epsilon_no_repeat_ngram": (2, {"epsilon_cutoff": 0.02, "no_repeat_ngram_size": 2}, []),
    "eta_user_processor_k5": (5, {"eta_cutoff": 0.01}, [BanSuccessorOfLastToken()]),
    "bad_words_sequence_bias": (3, {"bad_words_ids": [[2, 1]], "sequence_bias": [[[3], -1.0], [[1, 0], 2.0]]}, []),
    # EOS (token 0) is suppressed for the first two tokens only, so it can end the third.
    "min_new_tokens_suppress_tokens": (2, {"eos_token_id": 0, "min_new_tokens": 2, "suppress_tokens": [3]}, []),
    "combined_chain_k4": (
        4,
        {"temperature": 0.7, "top_k": 3, "top_p": 0.95, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
        [BanSuccessorOfLastToken()],
    ),
}


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
    monkeypatch.setattr(hf_spec.decoding, "accept_draft_tokens", _q_from_the_next_row)
    results = [
        fit_sequences(samples, exact_law(small_target, MIXED_SETTINGS, [BanSuccessorOfLastToken()], prompt))
        for samples, prompt in zip(sample_mixed_prompts(small_target, small_draft, seed=6), MIXED_PROMPTS)
    ]
    assert not all(result.is_consistent for result in results), results


def _resample_from_p(draft_ids, draft_probs, target_probs, generator):
    """Broken: a rejection resamples from p instead of max(0, p - q)."""
    output_ids, num_accepted = hf_spec.rejection.accept_draft_tokens(draft_ids, draft_probs, target_probs, generator)
    for row, j in enumerate(num_accepted.tolist()):
        if j < draft_ids.shape[1]:
            output_ids[row, j] = hf_spec.rejection.sample_from_weights(target_probs[row, j], generator)
    return output_ids, num_accepted


def _block_without_draft_prefix(processors, prefix_ids, block_ids, logits, prefix_lengths):
    """Broken: every block position is processed as if it followed the prefix alone (batch of one here)."""
    prefix_ids = prefix_ids[:, : int(prefix_lengths[0])]
    return torch.stack([processors(prefix_ids, logits[:, i].clone()) for i in range(logits.shape[1])], dim=1)


@pytest.mark.parametrize(
    "patch, case",
    [("accept_draft_tokens", "temperature_1"), ("process_block", "eta_user_processor_k5")],
)
def test_negative_control_broken_loop_is_caught(small_target, small_draft, monkeypatch, patch, case):
    broken = {"accept_draft_tokens": _resample_from_p, "process_block": _block_without_draft_prefix}[patch]
    monkeypatch.setattr(hf_spec.decoding, patch, broken)
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(small_target, small_draft, settings, user_processors, k, seed=99)
    result = fit_sequences(samples, exact_law(small_target, settings, user_processors))
    assert not result.is_consistent, result
