"""Prompt lookup (n-gram) drafting: the matching, greedy equality, and exactness under sampling.

Under sampling a lookup proposal is a point mass, so the rule accepts x with probability p(x) and resamples a
rejection from p without x. The statistical tests compare with the target's enumerated law (`test_exactness`), with
auto k and with lookup-then-draft-model, and a negative control (resampling from p itself) must fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import NUM_SAMPLES, exact_law, make_noisy_copy, make_tiny_model, with_length
from transformers import LogitsProcessorList

from hf_spec import speculative
from hf_spec.drafting.lookup import lookup_continuation
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, fit_sequences

# "3 2" recurs, so lookup proposes "1 3 2" from the first round; later rounds match the rows' own samples.
LOOKUP_PROMPT = torch.tensor([[2, 1, 3, 2, 1, 3, 2]])


@pytest.mark.parametrize("ids, max_ngram, min_ngram, max_tokens, expected", [
    ([1, 2, 3, 4, 1, 2], 2, 1, 3, [3, 4, 1]),  # "1 2" recurs at 0: what followed it
    ([1, 2, 3, 4, 1, 2], 2, 1, 10, [3, 4, 1, 2]),  # up to the end of the sequence
    ([5, 2, 7, 9, 1, 2], 2, 1, 3, [7, 9, 1]),  # "1 2" never recurs; "2" does
    ([5, 2, 7, 9, 1, 2], 2, 2, 3, []),  # ... unless 1-grams are not allowed
    ([4, 1, 6, 8, 1, 9, 1], 1, 1, 2, [9, 1]),  # the latest earlier occurrence wins
    ([7, 8, 9], 3, 1, 2, []),  # nothing recurs
    ([1, 2, 3, 1, 2], 3, 1, 0, []),  # max_tokens 0
    ([3], 2, 1, 4, []),  # one token: no earlier n-gram
])
def test_lookup_continuation_by_hand(ids, max_ngram, min_ngram, max_tokens, expected):
    found = lookup_continuation(torch.tensor(ids), max_ngram, min_ngram, max_tokens)
    assert found.tolist() == expected


def test_longest_ngram_is_preferred():
    # "2 3" follows at 5 (-> 9); "3" alone last occurred at 7 (-> 4). The 2-gram wins.
    ids = torch.tensor([0, 1, 1, 1, 2, 3, 9, 3, 4, 2, 3])
    assert lookup_continuation(ids, 2, 1, 1).tolist() == [9]


@pytest.fixture(scope="module")
def target():
    return speculative(make_tiny_model(seed=30, vocab_size=8))


def test_greedy_lookup_equals_target_only_in_a_ragged_batch(target):
    prompts = [[1, 2, 3, 1, 2, 3, 1], [4, 5, 4, 5], [6, 1, 6, 1, 6, 1, 6, 1, 6]]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    expected = target.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=40, pad_token_id=0)
    output = target.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=40, pad_token_id=0,
                             prompt_lookup_num_tokens=4, return_dict_in_generate=True)
    assert torch.equal(output.sequences, expected)
    stats = output.speculative_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted > 0, stats
    assert len(stats.rounds_by_draft_length) <= 5


def test_lookup_then_model_greedy_equals_target_only(target):
    draft = make_noisy_copy(target, seed=31, noise=0.3)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 2, 6]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=40)
    output = target.generate(prompt, assistant_model=draft, prompt_lookup_num_tokens=3, do_sample=False,
                             max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(output.sequences, expected)
    assert output.speculative_stats.num_rounds < 40


def test_bad_lookup_settings_are_named(target):
    with pytest.raises(ValueError, match="`max_matching_ngram_size` must be a positive integer, but is 0"):
        target.generate(torch.tensor([[1, 2]]), prompt_lookup_num_tokens=2, max_matching_ngram_size=0,
                        max_new_tokens=3)


def sample_lookup(target, settings: dict, seed: int, **drafting) -> np.ndarray:
    """``[NUM_SAMPLES, NUM_TOKENS]``: rows of one batch, each an independent sample."""
    output = target.generate(
        LOOKUP_PROMPT.expand(NUM_SAMPLES, -1), do_sample=True, generator=torch.Generator().manual_seed(seed),
        pad_token_id=0, logits_processor=LogitsProcessorList(), **with_length(settings), **drafting,
    )
    return output[:, LOOKUP_PROMPT.shape[1]:].numpy()


LOOKUP_CASES = {
    "lookup_temperature_1": ({}, {"prompt_lookup_num_tokens": 3}),
    "lookup_top_k_repetition_penalty": ({"temperature": 0.7, "top_k": 3, "repetition_penalty": 1.5},
                                        {"prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 3}),
    "lookup_auto_k": ({"top_p": 0.9}, {"prompt_lookup_num_tokens": 3, "num_assistant_tokens": "auto"}),
}


@pytest.mark.parametrize("case", list(LOOKUP_CASES))
def test_lookup_sampling_matches_the_target_law(small_target, case):
    settings, drafting = LOOKUP_CASES[case]
    samples = sample_lookup(small_target, settings, seed=len(case), **drafting)
    result = fit_sequences(samples, exact_law(small_target, settings, [], prompt=LOOKUP_PROMPT))
    assert result.is_consistent, result


def test_auto_k_and_lookup_then_model_sampling_match_the_target_law(small_target):
    draft = make_noisy_copy(small_target, seed=12, noise=1.0)
    settings = {"temperature": 0.8, "top_k": 3}
    for drafting in ({"num_assistant_tokens": "auto"}, {"prompt_lookup_num_tokens": 2}):
        samples = sample_lookup(small_target, settings, seed=5, assistant_model=draft, **drafting)
        result = fit_sequences(samples, exact_law(small_target, settings, [], prompt=LOOKUP_PROMPT))
        assert result.is_consistent, (drafting, result)


def test_negative_control_lookup_resampling_from_p_is_caught(small_target, monkeypatch):
    """A rejected point mass resampled from p instead of p without x over-weights x: it must be caught."""
    settings, drafting = LOOKUP_CASES["lookup_temperature_1"]
    samples = sample_lookup(small_target, settings, seed=3, verification=RESAMPLE_FROM_P, **drafting)
    result = fit_sequences(samples, exact_law(small_target, settings, [], prompt=LOOKUP_PROMPT))
    assert not result.is_consistent, result

