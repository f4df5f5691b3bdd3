"""A `Drafter` of your own as ``assistant_model``, and the acceptance oracle built on that (`OracleDrafter`)."""

from __future__ import annotations

import torch
from helpers import PAD, PROMPTS, left_padded, make_tiny_model

from hf_spec import without_speculation
from hf_spec.drafting.oracle import OracleDrafter


def test_an_oracle_of_the_greedy_answer_is_always_accepted(target):
    input_ids, attention_mask = left_padded(PROMPTS)
    common = {"attention_mask": attention_mask, "max_new_tokens": 16, "do_sample": False, "pad_token_id": PAD}
    with without_speculation(target):
        expected = target.generate(input_ids, **common)
    output = target.generate(input_ids, assistant_model=OracleDrafter(expected), num_assistant_tokens=5,
                             return_dict_in_generate=True, **common)
    assert torch.equal(output.sequences, expected)
    stats = output.speculative_stats
    assert stats.num_accepted == stats.num_draft_tokens > 0


def test_an_oracle_with_a_set_acceptance_and_a_draft_model_to_pay_for(target):
    prompt = torch.tensor([PROMPTS[1]])
    with without_speculation(target):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=60)
    oracle = OracleDrafter(expected, acceptance=0.5, draft_model=make_tiny_model(seed=3),
                           generator=torch.Generator().manual_seed(0))
    output = target.generate(prompt, assistant_model=oracle, num_assistant_tokens=1, do_sample=False,
                             max_new_tokens=60, return_dict_in_generate=True)
    assert torch.equal(output.sequences, expected)
    stats = output.speculative_stats
    assert 0.3 < stats.acceptance_rate < 0.7, stats  # about half of 59 single-token proposals
    assert stats.draft_seconds > 0
