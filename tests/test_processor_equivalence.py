"""The block implementations equal transformers' own processors called once per position (property tests).

Reference: ``LogitsProcessorList.__call__`` on ``prefix + block[:i]`` for every block position ``i``, which is what
target-only decoding does. Values must agree up to float rounding and the -inf masks must be identical.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

import logits_processors.registry
import logits_processors.warpers
from logits_processors import has_block_implementation, process_block, process_step

LARGE_VOCAB = 151936  # Qwen2.5's LM head


def reference_block(chain: LogitsProcessorList, sequence_ids: torch.Tensor, num_prefix: int, logits: torch.Tensor):
    """transformers' own chain, once per block position with that position's prefix."""
    return torch.stack(
        [chain(sequence_ids[:, : num_prefix + i], logits[:, i].clone()) for i in range(logits.shape[1])], dim=1
    )


def assert_block_matches_reference(chain, sequence_ids, num_prefix, logits) -> None:
    """process_block equals the reference, or raises the same exception type where transformers raises."""
    prefix_ids, block_ids = sequence_ids[:, :num_prefix], sequence_ids[:, num_prefix:]
    try:
        expected = reference_block(chain, sequence_ids, num_prefix, logits)
    except ValueError as error:  # e.g. eta on a row every earlier processor masked: transformers refuses it
        with pytest.raises(type(error)):
            process_block(chain, prefix_ids, block_ids, logits)
        return
    assert_same_scores(process_block(chain, prefix_ids, block_ids, logits), expected)


def assert_same_scores(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.shape == expected.shape
    assert torch.equal(torch.isneginf(ours), torch.isneginf(expected)), "the -inf masks differ"
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6, equal_nan=True)


@st.composite
def blocks(draw, max_vocab: int = 24):
    """(sequence_ids [batch, len + k], num_prefix, logits [batch, k + 1, vocab]) with repeats, ties and -inf."""
    vocab_size = draw(st.integers(2, max_vocab))
    batch_size = draw(st.integers(1, 3))
    num_prefix = draw(st.integers(1, 10))
    k = draw(st.integers(0, 5))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    num_distinct_ids = draw(st.integers(1, vocab_size))  # few distinct ids: repeated tokens and n-grams
    sequence_ids = torch.randint(0, num_distinct_ids, (batch_size, num_prefix + k), generator=generator)
    logits = torch.randn(batch_size, k + 1, vocab_size, generator=generator) * draw(st.sampled_from([0.5, 3.0, 10.0]))
    if draw(st.booleans()):  # ties, as bf16 logits have
        logits = (logits * 2).round() / 2
    if draw(st.booleans()):  # masked entries, as after an earlier processor
        logits = logits.masked_fill(torch.rand(logits.shape, generator=generator) < 0.3, float("-inf"))
        logits[..., 0] = 1.0  # keep every row samplable
    return sequence_ids, num_prefix, logits


def token_lists(vocab_size: int, max_len: int):
    return st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=max_len)


@st.composite
def processors(draw, vocab_size: int, num_prefix: int, batch_size: int) -> LogitsProcessor:
    """One processor of every kind with a fast path, with drawn parameters."""
    min_keep = draw(st.integers(1, 3))
    unit = st.floats(0.01, 0.99)
    eos = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=2))
    kind = draw(st.sampled_from(FAST_PATH_KINDS))
    if kind == "temperature":
        return TemperatureLogitsWarper(draw(st.floats(0.05, 3.0)))
    if kind == "top_k":
        return TopKLogitsWarper(draw(st.integers(1, vocab_size + 2)), min_tokens_to_keep=min_keep)
    if kind == "top_p":
        return TopPLogitsWarper(draw(st.floats(0.01, 1.0)), min_tokens_to_keep=min_keep)
    if kind == "min_p":
        return MinPLogitsWarper(draw(unit), min_tokens_to_keep=min_keep)
    if kind == "typical":
        return TypicalLogitsWarper(draw(unit), min_tokens_to_keep=min_keep)
    if kind == "epsilon":
        return EpsilonLogitsWarper(draw(st.floats(0.001, 0.5)), min_tokens_to_keep=min_keep)
    if kind == "eta":
        return EtaLogitsWarper(draw(st.floats(0.001, 0.5)), min_tokens_to_keep=min_keep, device="cpu")
    if kind == "top_h":
        return TopHLogitsWarper(draw(st.floats(0.05, 1.0)))
    if kind == "log_softmax":
        return LogitNormalization()
    if kind == "inf_nan_remove":
        return InfNanRemoveLogitsProcessor()
    if kind == "suppress":
        return SuppressTokensLogitsProcessor(draw(token_lists(vocab_size, 4)))
    if kind == "suppress_at_begin":
        begin_index = num_prefix + draw(st.integers(0, 5))
        return SuppressTokensAtBeginLogitsProcessor(draw(token_lists(vocab_size, 3)), begin_index)
    if kind == "repetition_penalty":
        ignore = draw(st.sampled_from(["none", "int", "tensor"]))
        length = {
            "none": None,
            "int": draw(st.integers(0, num_prefix + 2)),
            "tensor": torch.tensor(draw(st.lists(st.integers(0, num_prefix + 2), min_size=batch_size,
                                                max_size=batch_size))),
        }[ignore]
        return RepetitionPenaltyLogitsProcessor(draw(st.floats(0.3, 3.0)), prompt_ignore_length=length)
    if kind == "no_repeat_ngram":
        return NoRepeatNGramLogitsProcessor(draw(st.integers(1, 4)))
    if kind == "bad_words":
        return NoBadWordsLogitsProcessor(draw(st.lists(token_lists(vocab_size, 3), min_size=1, max_size=4)), eos)
    if kind == "sequence_bias":
        biases = draw(st.lists(st.tuples(token_lists(vocab_size, 3), st.floats(-5, 5)), min_size=1, max_size=5))
        return SequenceBiasLogitsProcessor([[list(ids), bias] for ids, bias in biases])
    if kind == "min_length":
        return MinLengthLogitsProcessor(num_prefix + draw(st.integers(-1, 6)), eos)
    if kind == "min_new_tokens":
        skip = draw(st.integers(0, num_prefix))
        return MinNewTokensLengthLogitsProcessor(skip, draw(st.integers(1, 8)), eos)
    if kind == "prefix_constrained":
        return PrefixConstrainedLogitsProcessor(allowed_after, num_beams=1)
    if kind == "forced_eos":
        return ForcedEOSTokenLogitsProcessor(num_prefix + draw(st.integers(1, 7)), eos)
    raise AssertionError(kind)


FAST_PATH_KINDS = [
    "temperature", "top_k", "top_p", "min_p", "typical", "epsilon", "eta", "top_h", "log_softmax", "inf_nan_remove",
    "suppress", "suppress_at_begin", "repetition_penalty", "no_repeat_ngram", "bad_words", "sequence_bias",
    "min_length", "min_new_tokens", "forced_eos", "prefix_constrained",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block=blocks())
def test_each_fast_path_equals_per_position_application(data, block):
    sequence_ids, num_prefix, logits = block
    processor = data.draw(processors(logits.shape[-1], num_prefix, logits.shape[0]))
    assert has_block_implementation(processor)
    assert_block_matches_reference(LogitsProcessorList([processor]), sequence_ids, num_prefix, logits)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block=blocks())
def test_chains_equal_per_position_application(data, block):
    sequence_ids, num_prefix, logits = block
    size = data.draw(st.integers(2, 5))
    chain = LogitsProcessorList(
        [data.draw(processors(logits.shape[-1], num_prefix, logits.shape[0])) for _ in range(size)]
        + ([PenalizeLastToken()] if data.draw(st.booleans()) else [])
    )
    assert_block_matches_reference(chain, sequence_ids, num_prefix, logits)
    try:
        expected_step = chain(sequence_ids[:, :num_prefix], logits[:, 0].clone())
    except ValueError:  # transformers refuses this input; the block check above has compared the errors
        return
    assert_same_scores(process_step(chain, sequence_ids[:, :num_prefix], logits[:, 0]), expected_step)


class PenalizeLastToken(LogitsProcessor):
    """A user processor: prefix-dependent, no fast path, modifies its input in place (allowed by the contract)."""

    def __init__(self):
        self.seen_lengths = []

    def __call__(self, input_ids, scores):
        self.seen_lengths.append(input_ids.shape[1])
        scores[torch.arange(scores.shape[0]), input_ids[:, -1] % scores.shape[-1]] -= 2.0
        return scores


def for_row(processor: LogitsProcessor, row: int) -> LogitsProcessor:
    """``processor`` as target-only decoding of row ``row`` alone would hold it (per-row state sliced)."""
    if (isinstance(processor, RepetitionPenaltyLogitsProcessor)
            and isinstance(processor.prompt_ignore_length, torch.Tensor)):
        return RepetitionPenaltyLogitsProcessor(processor.penalty, processor.prompt_ignore_length[row : row + 1])
    if isinstance(processor, PrefixConstrainedLogitsProcessor):
        function = processor._prefix_allowed_tokens_fn
        return PrefixConstrainedLogitsProcessor(lambda _, prefix: function(row, prefix), num_beams=1)
    return processor


def allowed_after(batch_id: int, prefix: torch.Tensor) -> list[int]:
    """A ``prefix_allowed_tokens_fn`` that depends on the row and on the prefix (ids below 2: any vocab works)."""
    return [(batch_id + int(prefix[-1])) % 2] + ([1] if int(prefix.sum()) % 3 == 0 else [])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block=blocks())
def test_rows_of_different_lengths_equal_each_row_alone(data, block):
    """A ragged batch (rows that accepted different numbers of tokens): row b equals its own target-only chain."""
    sequence_ids, num_prefix, logits = block
    batch_size = sequence_ids.shape[0]
    prefix_lengths = torch.tensor(data.draw(st.lists(st.integers(1, num_prefix), min_size=batch_size,
                                                     max_size=batch_size)))
    chain = LogitsProcessorList(
        [data.draw(processors(logits.shape[-1], int(prefix_lengths.min()), batch_size)) for _ in range(2)]
        + [data.draw(st.sampled_from([PenalizeLastToken(), PrefixConstrainedLogitsProcessor(allowed_after, 1)]))]
    )
    rows = [
        torch.cat([sequence_ids[b, : prefix_lengths[b]], sequence_ids[b, num_prefix:]])[None] for b in range(batch_size)
    ]
    try:
        expected = torch.cat([
            reference_block(LogitsProcessorList([for_row(p, b) for p in chain]), rows[b], int(prefix_lengths[b]),
                            logits[b : b + 1])
            for b in range(batch_size)
        ])
    except ValueError:
        return  # transformers refuses this input (e.g. eta on a fully masked row)
    prefix_ids = sequence_ids[:, :num_prefix].clone()  # right-padded: whatever follows a row's length is padding
    ours = process_block(chain, prefix_ids, sequence_ids[:, num_prefix:], logits, prefix_lengths)
    assert_same_scores(ours, expected)


def test_user_processor_takes_the_loop_with_each_position_prefix():
    processor = PenalizeLastToken()
    logits = torch.randn(2, 4, 9)
    original = logits.clone()
    sequence_ids = torch.randint(0, 9, (2, 8))
    ours = process_block(LogitsProcessorList([processor]), sequence_ids[:, :5], sequence_ids[:, 5:], logits)
    assert processor.seen_lengths == [5, 6, 7, 8]
    assert torch.equal(logits, original), "the caller's logits were modified"
    assert_same_scores(ours, reference_block(LogitsProcessorList([PenalizeLastToken()]), sequence_ids, 5, logits))


def test_subclasses_take_the_loop_until_registered():
    class MyTopK(TopKLogitsWarper):
        pass

    assert has_block_implementation(TopKLogitsWarper(3))
    assert not has_block_implementation(MyTopK(3))


@pytest.mark.parametrize("seed", range(4))
def test_large_vocab_chain_equals_per_position_application(seed):
    generator = torch.Generator().manual_seed(seed)
    k, num_prefix = 5, 300
    sequence_ids = torch.randint(0, LARGE_VOCAB, (2, num_prefix + k), generator=generator)
    sequence_ids[:, -3:] = sequence_ids[:, :3]  # repeats inside the block
    logits = torch.randn(2, k + 1, LARGE_VOCAB, generator=generator) * 2
    logits[..., sequence_ids[0, :20]] += 12  # a peaked head, as real models have
    chain = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.3), NoRepeatNGramLogitsProcessor(2), TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(50), TopPLogitsWarper(0.9), MinPLogitsWarper(0.01),
    ])
    ours = process_block(chain, sequence_ids[:, :num_prefix], sequence_ids[:, num_prefix:], logits)
    assert_same_scores(ours, reference_block(chain, sequence_ids, num_prefix, logits))


@pytest.mark.parametrize("temperature", [0.3, 1.0])
def test_top_p_fast_path_decides_peaked_large_vocab_rows_itself(monkeypatch, temperature):
    """Rows whose nucleus fits among the candidates never reach transformers' full sort."""
    generator = torch.Generator().manual_seed(0)  # a seed whose rows have no candidate within 1.5e-3 of the cut
    logits = torch.randn(6, LARGE_VOCAB, generator=generator) * 2
    logits[:, :40] += torch.linspace(24, 16, 40)
    logits /= temperature
    processor = TopPLogitsWarper(0.9)
    expected = processor(None, logits)

    def full_sort_is_not_allowed(self, input_ids, scores):
        raise AssertionError("fell back to the full sort")

    monkeypatch.setattr(TopPLogitsWarper, "__call__", full_sort_is_not_allowed)
    assert_same_scores(logits_processors.warpers.top_p_rows(processor, logits), expected)


def test_top_p_falls_back_for_flat_rows_and_split_ties():
    flat = torch.zeros(1, 1000)  # every token tied, nucleus of 900: only the full sort decides
    tied_at_cut = torch.tensor([[2.0, 1.0, 1.0, -3.0]])
    for scores, top_p in ((flat, 0.9), (tied_at_cut, 0.8)):
        processor = TopPLogitsWarper(top_p)
        assert_same_scores(logits_processors.warpers.top_p_rows(processor, scores), processor(None, scores))


def _penalty_ignoring_the_block(processor, sequence_ids, prefix_lengths, scores):
    """Broken: every position is penalized as if it followed the prefix alone."""
    prefix_ids = sequence_ids[:, : int(prefix_lengths[0])]
    return torch.stack([processor(prefix_ids, scores[:, i]) for i in range(scores.shape[1])], dim=1)


def test_negative_control_a_block_function_blind_to_drafted_tokens_is_caught(monkeypatch):
    monkeypatch.setitem(
        logits_processors.registry._BLOCK_FUNCTIONS, RepetitionPenaltyLogitsProcessor, _penalty_ignoring_the_block
    )
    # A fixed case that must be caught: drafted token 3 is penalized at the positions after it.
    chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0)])
    sequence_ids = torch.tensor([[1, 2, 3, 3]])  # prefix [1, 2], drafted [3, 3]
    logits = torch.arange(1.0, 1.0 + 3 * 5).view(1, 3, 5)
    with pytest.raises(AssertionError):
        assert_block_matches_reference(chain, sequence_ids, 2, logits)
