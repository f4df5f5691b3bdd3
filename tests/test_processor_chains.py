"""Every processor chain, end to end through ``generate``: a draft with the target's weights is never rejected.

If draft and target saw different transforms, or a position saw the wrong prefix, p and q would differ and some
draft tokens would be rejected. transformers' own assisted generation accepts 41% here at temperature 0.5.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

PROMPT = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


class PreferEvenAfterOdd(LogitsProcessor):
    """A user processor that reads the prefix: after an odd token, even tokens get +1."""

    def __call__(self, input_ids, scores):
        is_odd = (input_ids[:, -1:] % 2 == 1).float()  # [batch, 1]
        even = (torch.arange(scores.shape[-1], device=scores.device) % 2 == 0).float()  # [vocab]
        return scores + is_odd * even


SINGLE = {
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.1},
    "typical_p": {"typical_p": 0.8},
    "epsilon_cutoff": {"epsilon_cutoff": 0.05},
    "eta_cutoff": {"eta_cutoff": 0.05},
    "repetition_penalty": {"repetition_penalty": 1.5},
    "no_repeat_ngram": {"no_repeat_ngram_size": 2},
    "bad_words": {"bad_words_ids": [[3], [4, 5]]},
    "sequence_bias": {"sequence_bias": [[[2], 1.5], [[1, 2], -2.0]]},
    "min_new_tokens": {"eos_token_id": 7, "min_new_tokens": 12},
    "suppress_tokens": {"suppress_tokens": [5, 6]},
    "user_processor": {"logits_processor": [PreferEvenAfterOdd()]},
}
COMBINED = {
    "warpers": {"top_k": 8, "top_p": 0.9, "min_p": 0.02, "typical_p": 0.95},
    "penalties_and_user": {
        "repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "bad_words_ids": [[4, 5]], "suppress_tokens": [6],
        "logits_processor": [PreferEvenAfterOdd()],
    },
    "everything": {
        "top_k": 10, "top_p": 0.95, "epsilon_cutoff": 0.01, "repetition_penalty": 1.2, "no_repeat_ngram_size": 3,
        "sequence_bias": [[[2], 1.0]], "eos_token_id": 7, "min_new_tokens": 8,
        "logits_processor": [PreferEvenAfterOdd()],
    },
}
CHAINS = {**SINGLE, **COMBINED}


def run_with_own_weights_as_draft(target, settings: dict, **decoding):
    settings = dict(settings)
    if "logits_processor" in settings:
        settings["logits_processor"] = LogitsProcessorList(settings["logits_processor"])
    return target.generate(
        PROMPT, assistant_model=target, max_new_tokens=24, num_assistant_tokens=4, return_dict_in_generate=True,
        generator=torch.Generator().manual_seed(0), **settings, **decoding,
    ).speculative_stats


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
@pytest.mark.parametrize("chain", list(CHAINS))
def test_same_weights_draft_is_always_accepted_when_sampling(target, chain, temperature):
    stats = run_with_own_weights_as_draft(target, CHAINS[chain], do_sample=True, temperature=temperature)
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted == stats.num_draft_tokens, stats


@pytest.mark.parametrize("chain", list(CHAINS))
def test_same_weights_draft_is_always_accepted_when_greedy(target, chain):
    stats = run_with_own_weights_as_draft(target, CHAINS[chain], do_sample=False)
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted == stats.num_draft_tokens, stats


def test_negative_control_a_draft_that_skips_the_chain_is_rejected(target, monkeypatch):
    """If the draft drafted from its raw logits, a same-weights draft would be rejected under top-k + temperature."""
    import hf_spec.drafting.base

    monkeypatch.setattr(hf_spec.drafting.base, "process_step",
                        lambda processors, prefix_ids, logits, prefix_lengths: logits)
    stats = run_with_own_weights_as_draft(target, {"top_k": 3}, do_sample=True, temperature=0.5)
    assert stats.num_accepted < stats.num_draft_tokens
