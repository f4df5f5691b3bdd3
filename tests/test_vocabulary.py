"""Pruned draft vocabularies (FR-Spec, `hf_spec.drafting.vocabulary`): q = 0 outside the kept ids, law unchanged.

The statistical tests prune the draft to half the vocabulary, so some target tokens can only come from the
residual; the negative control restricts the target to the draft's ids, a plausible pruning bug, and must fail.
"""

from __future__ import annotations

import collections
import json

import pytest
import torch
from helpers import (
    CASES,
    PAD,
    PROMPTS,
    exact_law,
    left_padded,
    letters_tokenizer,
    make_noisy_copy,
    make_tiny_model,
    sample_speculative,
)

import hf_spec.rejection
import hf_spec.rounds
from hf_spec import speculative, without_speculation
from hf_spec.cli import main
from hf_spec.drafting.vocabulary import PrunedOutputLayer, prune_vocabulary, pruned_size, restore_vocabulary
from hf_spec.evaluation.exactness import broken_rules, fit_sequences
from hf_spec.loading.packed import deoptimize, optimize
from hf_spec.loading.vocabulary import frequent_token_ids, token_counts

KEPT = [0, 2]  # of the statistical tests' 4 ids


@pytest.fixture(scope="module")
def pruned_draft(small_target):
    return prune_vocabulary(make_noisy_copy(small_target, seed=12, noise=1.0), KEPT)


def test_pruned_layer_computes_the_kept_rows_and_minus_infinity_elsewhere():
    model = make_tiny_model(seed=0)
    hidden = torch.randn(2, 3, 64)
    full = model.lm_head(hidden)
    prune_vocabulary(model, [7, 1, 12])
    assert isinstance(model.lm_head, PrunedOutputLayer) and pruned_size(model) == 3
    pruned = model.lm_head(hidden)
    assert torch.allclose(pruned[..., [1, 7, 12]], full[..., [1, 7, 12]], atol=1e-5)
    others = [i for i in range(16) if i not in (1, 7, 12)]
    assert torch.isneginf(pruned[..., others]).all()
    restore_vocabulary(model)
    assert type(model.lm_head) is torch.nn.Linear and pruned_size(model) is None


@pytest.mark.parametrize("case", ["temperature_1", "combined_chain_k4", "top_p_repetition_penalty"])
def test_a_pruned_draft_keeps_the_target_law(small_target, pruned_draft, case):
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(small_target, pruned_draft, settings, user_processors, k, seed=41)
    assert set(samples.reshape(-1).tolist()) - set(KEPT), "tokens outside the draft's ids must still be emitted"
    result = fit_sequences(samples, exact_law(small_target, settings, user_processors))
    assert result.is_consistent, result


def _target_restricted_to_the_draft_ids(draft_ids, draft_probs, target_probs, generator):
    """Broken: the target's law is cut to the ids the draft can propose (and renormalized)."""
    mask = torch.zeros(target_probs.shape[-1], dtype=torch.bool)
    mask[KEPT] = True
    restricted = target_probs * mask
    restricted = restricted / restricted.sum(dim=-1, keepdim=True)
    return hf_spec.rejection.accept_draft_tokens(draft_ids, draft_probs, restricted, generator)


def test_negative_control_a_target_restricted_to_the_draft_ids_is_caught(small_target, pruned_draft, monkeypatch):
    k, settings, user_processors = CASES["temperature_1"]
    samples = sample_speculative(small_target, pruned_draft, settings, user_processors, k, seed=97,
                                 verification=broken_rules(_target_restricted_to_the_draft_ids))
    assert not fit_sequences(samples, exact_law(small_target, settings, user_processors)).is_consistent


@pytest.mark.parametrize("path", [None, "packed"])
def test_greedy_ragged_batch_with_a_pruned_draft_equals_target_only(path):
    target = speculative(make_tiny_model(seed=0))
    draft = prune_vocabulary(make_noisy_copy(target, seed=4, noise=0.3), list(range(0, 16, 2)))
    if path is not None:
        optimize(draft, path=path)
    input_ids, attention_mask = left_padded(PROMPTS)
    common = {"attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False, "pad_token_id": PAD}
    with without_speculation(target):
        expected = target.generate(input_ids, **common)
    output = target.generate(input_ids, assistant_model=draft, num_assistant_tokens=3, return_dict_in_generate=True,
                             **common)
    assert torch.equal(output.sequences, expected)
    assert 0 < output.speculative_stats.num_accepted < output.speculative_stats.num_draft_tokens


def test_a_draft_packed_before_pruning_is_refused_with_what_to_do():
    draft = make_tiny_model(seed=4)  # untied output layer: packed with the others
    optimize(draft, path="packed")
    with pytest.raises(ValueError, match=r"type PackedLinear; .*prune before .*optimize`, or `deoptimize"):
        prune_vocabulary(draft, [0, 2])
    deoptimize(draft)
    assert prune_vocabulary(draft, [0, 2]) is draft


def test_frequent_ids_from_a_corpus_through_datasets():
    tokenizer = letters_tokenizer()
    counts = token_counts(tokenizer, ["abba", "cab", "", "bbbd"])
    assert counts == collections.Counter({1: 6, 0: 3, 2: 1, 3: 1})
    assert frequent_token_ids(counts, 2) == [0, 1]
    assert frequent_token_ids(counts, 3, always=[15]) == [0, 1, 15]  # specials always kept
    assert frequent_token_ids(counts, 3) == [0, 1, 2]  # ties broken by id
    assert frequent_token_ids(counts, 7, always=[15]) == [0, 1, 2, 3, 15]  # no more ids counted
    assert frequent_token_ids(counts, 7, always=[15], num_ids=16) == [0, 1, 2, 3, 4, 5, 15]  # the lowest ids fill up
    with pytest.raises(ValueError, match="corpus is empty"):
        token_counts(tokenizer, ["", ""])
    with pytest.raises(ValueError, match="`draft_vocab` must be a positive integer, but is 0"):
        frequent_token_ids(counts, 0)


@pytest.mark.parametrize("ids, message", [
    ([], "non-empty"), ([1, 1, 2], "distinct.*1 repeated"), ([3, 16], r"in \[0, 16\).*from 3 to 16"),
    ([-1, 2], "from -1 to 2"),
])
def test_bad_id_lists_are_named(ids, message):
    with pytest.raises(ValueError, match=message):
        prune_vocabulary(make_tiny_model(seed=0), ids)


def test_cli_generate_and_bench_with_a_pruned_draft(tmp_path, capsys):
    tiny = ["--target", "tiny", "--draft", "tiny", "--threads", "1"]
    assert main(["generate", *tiny, "--draft-vocab", "32", "--max-new-tokens", "6", "--no-optimize"]) == 0
    assert "output layer 32 of 64 ids" in capsys.readouterr().err
    report_path = tmp_path / "bench.json"
    assert main(["bench", *tiny, "--draft-vocab-variants", "32", "--methods", "hf_spec", "--workloads", "code",
                 "--settings", "greedy", "--prompts", "1", "--max-new-tokens", "8", "--no-progress", "--no-optimize",
                 "--output", str(report_path), "--plot", str(tmp_path / "bench.png")]) == 0
    rows = {row["method"]: row for row in json.loads(report_path.read_text())["results"]}
    assert rows["hf_spec@vocab32"]["identical_to_target_only"] == 1.0
