"""Ragged batches: rows that accept different numbers of tokens, finish at different times, and stay exact.

Greedy rows must equal each row decoded alone and transformers' own batched target-only output (padding included);
the statistical side (rows as independent samples, mixed prompts, negative controls) is in test_exactness.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import PAD, PROMPTS, left_padded, letters_tokenizer, make_tiny_model


def forced_rejection_draft(greedy_rows: list[torch.Tensor], reject_at: list[set[int]], vocab_size: int):
    """A draft proposing each row's greedy token, except a wrong one where the row's position is in ``reject_at``.

    Row b's position p (from position ids, which follow the attention mask) predicts ``greedy_rows[b][p]``.
    """
    draft = make_tiny_model(seed=3)
    original_forward = draft.forward

    def forward(*args, position_ids=None, **kwargs):
        output = original_forward(*args, position_ids=position_ids, **kwargs)
        logits = torch.full_like(output.logits, -30.0)
        for row, position in enumerate((position_ids[:, -1] + 1).tolist()):
            token = int(greedy_rows[row][position]) if position < len(greedy_rows[row]) else 0
            if position in reject_at[row]:
                token = (token + 1) % vocab_size
            logits[row, -1, token] = 30.0
        output.logits = logits
        return output

    draft.forward = forward
    return draft


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ragged_greedy_batch_equals_each_row_alone(target, k):
    num_new = 30
    alone = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=num_new + k + 1)[0] for p in PROMPTS]
    # Different rejection patterns per row: never, every 2nd, every 3rd and every 5th position.
    reject_at = [set(), set(range(0, 200, 2)), set(range(0, 200, 3)), set(range(0, 200, 5))]
    draft = forced_rejection_draft(alone, reject_at, target.config.vocab_size)
    ids, mask = left_padded(PROMPTS)
    output = target.generate(
        ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=num_new, pad_token_id=PAD,
        num_assistant_tokens=k, return_dict_in_generate=True,
    )
    for row, prompt in enumerate(PROMPTS):
        expected = alone[row][len(prompt) : len(prompt) + num_new]
        assert output.sequences[row, ids.shape[1] :].tolist() == expected.tolist()
    rows = output.speculative_stats.rows
    assert rows[0].acceptance_rate == 1.0
    assert len({row.num_accepted for row in rows}) > 1, "the rows should accept different numbers of tokens"


@pytest.mark.parametrize("draft_name", ["random", "close"])
def test_ragged_greedy_batch_equals_transformers_batched_output(target, random_draft, close_draft, draft_name):
    draft = {"random": random_draft, "close": close_draft}[draft_name]
    ids, mask = left_padded(PROMPTS)
    settings = {"do_sample": False, "max_new_tokens": 40, "pad_token_id": PAD, "repetition_penalty": 1.3}
    expected = target.generate(ids, attention_mask=mask, **settings)
    output = target.generate(ids, attention_mask=mask, assistant_model=draft, num_assistant_tokens=4, **settings)
    assert torch.equal(output, expected)


def test_a_row_that_meets_eos_mid_block_stops_there_and_the_others_go_on(target):
    ids, mask = left_padded(PROMPTS)
    free_run = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=PAD)
    eos = int(free_run[1, ids.shape[1] + 6])  # row 1's 7th token: inside the second block of 4
    expected = target.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=PAD, eos_token_id=eos
    )
    output = target.generate(
        ids, attention_mask=mask, assistant_model=target, do_sample=False, max_new_tokens=30, pad_token_id=PAD,
        eos_token_id=eos, num_assistant_tokens=4, return_dict_in_generate=True,
    )
    assert torch.equal(output.sequences, expected)
    rows = output.speculative_stats.rows
    assert rows[1].num_emitted <= 7, "row 1 finishes at its EOS"
    assert max(row.num_emitted for row in rows) == 30, "another row goes on to the budget"
    assert rows[1].num_rounds < max(row.num_rounds for row in rows)


def test_finished_rows_leave_the_model_batch(target, monkeypatch):
    ids, mask = left_padded(PROMPTS)
    free_run = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD)
    eos = int(free_run[0, ids.shape[1] + 2])
    batch_sizes = []
    original_forward = target.forward

    def recording_forward(*args, **kwargs):
        batch_sizes.append(kwargs["input_ids"].shape[0])
        return original_forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", recording_forward)
    target.generate(
        ids, attention_mask=mask, assistant_model=target, do_sample=False, max_new_tokens=24, pad_token_id=PAD,
        eos_token_id=eos, num_assistant_tokens=3,
    )
    assert batch_sizes[0] == len(PROMPTS) and min(batch_sizes) < len(PROMPTS)
    assert batch_sizes == sorted(batch_sizes, reverse=True)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 4, 5, 9])
def test_max_new_tokens_is_exact_for_every_row(target, close_draft, max_new_tokens):
    ids, mask = left_padded(PROMPTS)
    output = target.generate(
        ids, attention_mask=mask, assistant_model=close_draft, do_sample=True, max_new_tokens=max_new_tokens,
        pad_token_id=PAD, num_assistant_tokens=4, return_dict_in_generate=True,
    )
    assert output.sequences.shape == (len(PROMPTS), ids.shape[1] + max_new_tokens)
    assert [row.num_emitted for row in output.speculative_stats.rows] == [max_new_tokens] * len(PROMPTS)


def test_stop_strings_cut_each_row_at_its_own_match(target):
    tokenizer = letters_tokenizer(target.config.vocab_size)
    ids, mask = left_padded(PROMPTS)
    free_run = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=PAD)
    stops = [tokenizer.decode(free_run[row, ids.shape[1] + 3 + row : ids.shape[1] + 5 + row]) for row in (0, 2)]
    # An EOS that never occurs: with one, transformers pads the rows a stop string finished (without one it goes on
    # generating for them; hf_spec pads them either way).
    unused = min(set(range(target.config.vocab_size)) - set(free_run.flatten().tolist()))
    settings = {"do_sample": False, "max_new_tokens": 30, "pad_token_id": PAD, "stop_strings": stops,
                "tokenizer": tokenizer, "eos_token_id": unused}
    expected = target.generate(ids, attention_mask=mask, **settings)
    output = target.generate(ids, attention_mask=mask, assistant_model=target, num_assistant_tokens=4, **settings)
    assert torch.equal(output, expected)


def test_seeded_batches_are_reproducible(target, close_draft):
    ids, mask = left_padded(PROMPTS)

    def run(seed):
        return target.generate(
            ids, attention_mask=mask, assistant_model=close_draft, do_sample=True, temperature=0.9, top_p=0.95,
            max_new_tokens=20, pad_token_id=PAD, generator=torch.Generator().manual_seed(seed),
        )

    first, second, other = run(1), run(1), run(2)
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_statistics_are_reported_in_total_and_per_row(target, close_draft):
    ids, mask = left_padded(PROMPTS)
    stats = target.generate(
        ids, attention_mask=mask, assistant_model=close_draft, do_sample=True, max_new_tokens=16, pad_token_id=PAD,
        num_assistant_tokens=3, return_dict_in_generate=True,
    ).speculative_stats
    assert len(stats.rows) == len(PROMPTS)
    for name in ("num_draft_tokens", "num_accepted", "num_emitted"):
        assert getattr(stats, name) == sum(getattr(row, name) for row in stats.rows)
    assert stats.num_rounds == max(row.num_rounds for row in stats.rows)
    assert [row["num_emitted"] for row in stats.to_dict()["rows"]] == [16] * len(PROMPTS)
    assert "acceptance by row" in str(stats)


def test_scores_keep_transformers_layout_in_a_batch(target):
    ids, mask = left_padded(PROMPTS)
    settings = {"do_sample": False, "max_new_tokens": 10, "pad_token_id": PAD, "return_dict_in_generate": True,
                "output_scores": True}
    expected = target.generate(ids, attention_mask=mask, **settings)
    output = target.generate(ids, attention_mask=mask, assistant_model=target, num_assistant_tokens=3, **settings)
    assert len(output.scores) == len(expected.scores) == 10
    for ours, theirs in zip(output.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_unpadded_batch_without_attention_mask(target, close_draft):
    ids = torch.tensor([PROMPTS[2][:7], PROMPTS[3][:7], PROMPTS[1]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    output = target.generate(
        ids, assistant_model=close_draft, do_sample=False, max_new_tokens=20, pad_token_id=PAD, num_assistant_tokens=4
    )
    assert torch.equal(output, expected)


def test_sliding_window_caches_follow_ragged_rows():
    """Mistral-style sliding-window layers (window 6, shorter than the prompts): holes, crops and dropped rows."""
    from transformers import MistralConfig, MistralForCausalLM

    from hf_spec import speculative

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=6, max_position_embeddings=256, pad_token_id=PAD,
    )
    target = MistralForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    target, draft = speculative(target), MistralForCausalLM(config).eval()
    ids, mask = left_padded(PROMPTS)
    free_run = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    eos = int(free_run[2, ids.shape[1] + 4])  # row 2 finishes early, the others may go on
    settings = {"do_sample": False, "max_new_tokens": 30, "eos_token_id": eos}
    expected = target.generate(ids, attention_mask=mask, **settings)
    output = target.generate(ids, attention_mask=mask, assistant_model=draft, num_assistant_tokens=4, **settings)
    assert torch.equal(output, expected)
