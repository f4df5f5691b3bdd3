"""Greedy equality with target-only decoding, and the cache invariant under forced rejections at every position."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_model

import hf_spec.decoding

PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("draft_name", ["random", "close", "same"])
def test_greedy_equals_target_only(target, random_draft, close_draft, draft_name, k):
    draft = {"random": random_draft, "close": close_draft, "same": target}[draft_name]
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=200, repetition_penalty=1.2)
    output = target.generate(
        PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=200, repetition_penalty=1.2,
        num_assistant_tokens=k, return_dict_in_generate=True,
    )
    assert torch.equal(output.sequences, expected)
    if draft_name == "same":
        assert output.speculative_stats.acceptance_rate == 1.0


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
def test_same_weights_draft_accepts_every_token_when_sampling(target, temperature):
    output = target.generate(
        PROMPT, assistant_model=target, do_sample=True, temperature=temperature, top_k=8, top_p=0.9,
        max_new_tokens=60, num_assistant_tokens=4, return_dict_in_generate=True,
    )
    stats = output.speculative_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted == stats.num_draft_tokens


def test_scores_and_logits_keep_transformers_shapes(target, close_draft):
    output = target.generate(
        PROMPT, assistant_model=close_draft, do_sample=False, max_new_tokens=12, num_assistant_tokens=3,
        return_dict_in_generate=True, output_scores=True, output_logits=True,
    )
    reference = target.generate(
        PROMPT, do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    assert len(output.scores) == len(output.logits) == 12
    for ours, theirs in zip(output.scores + output.logits, reference.scores + reference.logits):
        assert ours.shape == theirs.shape == (1, target.config.vocab_size)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def _forced_rejection_draft(draft, greedy_ids: torch.Tensor, reject_at: set[int]):
    """Make ``draft`` propose the target's greedy token everywhere except at positions in ``reject_at``."""
    original_forward = draft.forward

    def forward(*args, position_ids=None, **kwargs):
        output = original_forward(*args, position_ids=position_ids, **kwargs)
        predicted_position = int(position_ids[0, -1]) + 1
        token = int(greedy_ids[0, predicted_position])
        if predicted_position in reject_at:
            token = (token + 1) % output.logits.shape[-1]
        output.logits = torch.full_like(output.logits, -30.0)
        output.logits[:, -1, token] = 30.0
        return output

    draft.forward = forward
    return draft


@pytest.mark.parametrize(
    "k, reject_at_block_position", [(k, j) for k in (1, 3, 5) for j in range(k + 1)]  # j == k: no rejection
)
def test_forced_rejection_at_every_position_keeps_caches_exact(target, monkeypatch, k, reject_at_block_position):
    num_new = 24
    greedy_ids = target.generate(PROMPT, do_sample=False, max_new_tokens=num_new + k + 2)
    # Rejecting at block position j of every round: the rounds start at n, n + j + 1, n + 2 (j + 1), ...
    reject_at, start = set(), PROMPT.shape[1]
    while reject_at_block_position < k and start < greedy_ids.shape[1]:
        reject_at.add(start + reject_at_block_position)
        start += reject_at_block_position + 1
    draft = _forced_rejection_draft(make_tiny_model(seed=3), greedy_ids, reject_at)

    snapshots = []
    original_roll_back = hf_spec.rounds.Rounds.roll_back

    def recording_roll_back(self, target_cache, rollback):
        original_roll_back(self, target_cache, rollback)
        length = rollback.num_cached + 1  # one row, no holes: the committed length
        keys = [layer.keys.clone() for layer in target_cache.layers]
        snapshots.append((length, keys, self.drafter.cache.get_seq_length()))

    monkeypatch.setattr(hf_spec.rounds.Rounds, "roll_back", recording_roll_back)
    output = target.generate(
        PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=num_new, num_assistant_tokens=k,
        return_dict_in_generate=True,
    )
    assert torch.equal(output.sequences, greedy_ids[:, : PROMPT.shape[1] + num_new])
    stats = output.speculative_stats
    if reject_at_block_position == k:
        assert stats.acceptance_rate == 1.0
    else:  # never accepted at the forced position, always accepted before it
        assert stats.accepted_by_position[reject_at_block_position] == 0
        before = slice(0, reject_at_block_position)
        assert stats.accepted_by_position[before] == stats.proposed_by_position[before]

    for length, target_keys, draft_length in snapshots:
        # Target cache: exactly the committed sequence minus its last token, equal to a fresh prefill.
        fresh = target(greedy_ids[:, : length - 1], use_cache=True).cache
        for ours, theirs in zip(target_keys, fresh.layers):
            assert ours.shape == theirs.keys.shape
            torch.testing.assert_close(ours, theirs.keys, rtol=1e-5, atol=1e-5)
        # Draft cache: the same prefix, or one token less right after a fully accepted block.
        assert length - 2 <= draft_length <= length - 1
    # The returned cache continues decoding exactly like a fresh pass over the whole output.
    final = output.sequences
    continued = target(final[:, -1:], cache=output.cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(continued, target(final).logits[:, -1], rtol=1e-4, atol=1e-4)
