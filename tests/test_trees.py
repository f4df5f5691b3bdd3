"""Trees of drafts: the multi-candidate rule is exact (pure function, n = 20,000 per case), generate() with trees
samples the target's law (each scheme of drawing children), greedy trees equal target-only decoding, and the caches
keep exactly the accepted path. Each family of bug has a negative control that must fail."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from helpers import make_noisy_copy, make_tiny_model
from transformers import LogitsProcessorList

import hf_spec.drafting.branching
import hf_spec.rounds
from hf_spec import speculative
from hf_spec.drafting.model_tree import ModelTreeDrafter
from hf_spec.drafting.suffix import SuffixDrafter, continuations, heaviest_subtree
from hf_spec.drafting.tree import DraftTree
from hf_spec.evaluation.exactness import broken_rules, exact_law, fit_sequences
from hf_spec.rejection import accept_tree, accept_tree_greedy, sample_from_weights
from hf_spec.sizing.costs import CostTable
from hf_spec.sizing.tree_size import AutoTreeSize
from hf_spec.verification import BLOCK, Verification

VOCAB = 4
RULE_SAMPLES = 20_000


# --- The rule alone: a toy target and draft given by tables of laws, two tokens emitted per sample. ----------------

def _laws(seed: int, sharpness: float) -> dict[tuple[int, ...], torch.Tensor]:
    """A law over VOCAB tokens for every prefix of up to 3 tokens."""
    generator = torch.Generator().manual_seed(seed)
    return {prefix: (sharpness * torch.randn(VOCAB, generator=generator)).softmax(-1).double()
            for n in range(4) for prefix in itertools.product(range(VOCAB), repeat=n)}


P, Q = _laws(0, 1.5), _laws(1, 3.0)  # a peaked draft: drawing with or without replacement differs a lot


def _draw_children(law: torch.Tensor, scheme: str, count: int, generator) -> list[tuple[int, torch.Tensor]]:
    """(token, law reported to the rule) for each child."""
    if scheme == "point_mass":
        return [(int(token), torch.nn.functional.one_hot(token, VOCAB).double()) for token in law.topk(count).indices]
    children, remaining = [], law.clone()
    for _ in range(count):
        draw_from = law if scheme == "iid" else remaining / remaining.sum()
        token = int(sample_from_weights(draw_from, generator))
        reported = law if scheme in ("iid", "without_replacement_reported_iid") else draw_from
        children.append((token, reported))
        remaining[token] = 0
    return children


def _toy_tree(prefix: tuple[int, ...], scheme: str, generator):
    """Root with 3 children, each with 2 children: tokens, parents, reported laws, p at root and each node."""
    tokens, parents, laws, paths = [], [], [], []
    for token, law in _draw_children(Q[prefix], scheme, 3, generator):
        tokens.append(token), parents.append(-1), laws.append(law), paths.append((token,))
    for parent in range(len(tokens)):
        for token, law in _draw_children(Q[prefix + paths[parent]], scheme, 2, generator):
            tokens.append(token), parents.append(parent), laws.append(law), paths.append(paths[parent] + (token,))
    target = torch.stack([P[prefix]] + [P[prefix + path] for path in paths])
    return torch.tensor(tokens), parents, torch.stack(laws), target


def _sample_two_tokens(scheme: str, rule, seed: int) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(RULE_SAMPLES):
        emitted: tuple[int, ...] = ()
        while len(emitted) < 2:
            token_ids, parents, laws, target = _toy_tree(emitted, scheme, generator)
            path, next_id = rule(token_ids, parents, laws, target, generator)
            emitted += tuple(token_ids[path].tolist()) + (int(next_id),)
        samples.append(emitted[:2])
    return np.array(samples)


def _exact_two_tokens() -> np.ndarray:
    return np.array([[float(P[()][a] * P[(a,)][b]) for b in range(VOCAB)] for a in range(VOCAB)])


def _accept_tree_without_residual_update(token_ids, parents, draft_probs, target_probs, generator):
    """Broken: every child is tried against p itself, as if the earlier rejections had not happened."""
    path, node = [], -1
    while True:
        children = [c for c, parent in enumerate(parents) if parent == node]
        for child in children:
            q, p = float(draft_probs[child, token_ids[child]]), float(target_probs[node + 1, token_ids[child]])
            if float(torch.rand((), dtype=torch.float64, generator=generator)) * q < p:
                path.append(child)
                node = child
                break
        else:
            residual = (target_probs[node + 1] - draft_probs[children[0]]).clamp_min(0) if children else None
            weights = target_probs[node + 1] if residual is None or residual.sum() == 0 else residual
            return path, sample_from_weights(weights, generator)


@pytest.mark.parametrize("scheme", ["iid", "without_replacement", "point_mass"])
def test_tree_rule_emits_the_target_law(scheme):
    result = fit_sequences(_sample_two_tokens(scheme, accept_tree, seed=3), _exact_two_tokens())
    assert result.is_consistent, result


@pytest.mark.parametrize("scheme, rule", [
    ("iid", _accept_tree_without_residual_update),  # negative control: a second child without the residual update
    ("without_replacement_reported_iid", accept_tree),  # negative control: without replacement under the i.i.d. rule
])
def test_negative_control_broken_tree_rule_is_caught(scheme, rule):
    result = fit_sequences(_sample_two_tokens(scheme, rule, seed=4), _exact_two_tokens())
    assert not result.is_consistent, result


def test_greedy_tree_rule_follows_the_argmax():
    scores = torch.tensor([[0.0, 5, 1, 0], [0, 0, 0, 7], [0, 0, 0, 9], [3, 0, 0, 0], [0, 0, 2, 0]])
    # the root's argmax is 1: node 1; after it the argmax is 3: node 2 (not node 3, token 0); after node 2 it is 0
    path, next_id = accept_tree_greedy(torch.tensor([2, 1, 3, 0]), [-1, -1, 1, 1], scores)
    assert path == [1, 2] and int(next_id) == 0


def test_tree_rule_refuses_a_malformed_tree():
    with pytest.raises(ValueError, match="parents"):
        accept_tree_greedy(torch.tensor([1, 2]), [-1, 1], torch.zeros(3, VOCAB))
    with pytest.raises(ValueError, match="DraftTree"):
        DraftTree(torch.tensor([1, 2]), [0, -1], None, torch.zeros(2, dtype=torch.bool), 0)


# --- generate() with trees on the tiny models. --------------------------------------------------------------------

NUM_TOKENS = 3
# 2,000 per case in the suite (one generate() call per sample, about 7 ms each); the n = 20,000 run of these cases is
# `HF_SPEC_TREE_SAMPLES=20000 pytest tests/test_trees.py -k generate -rA` (benchmarks/avx512-bf16-amd/2026-12-01-).
GENERATE_SAMPLES = int(os.environ.get("HF_SPEC_TREE_SAMPLES", "2000"))
PROMPT = torch.tensor([[1, 3, 2, 1, 3]])


def _settings(settings: dict) -> dict:
    return {"max_new_tokens": NUM_TOKENS, "min_new_tokens": NUM_TOKENS, **settings}


def _sample_trees(target, assistant, settings: dict, seed: int, samples: int = GENERATE_SAMPLES,
                  **tree) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    return np.array([
        target.generate(PROMPT, assistant_model=assistant, do_sample=True, generator=generator, pad_token_id=0,
                        logits_processor=LogitsProcessorList(), **tree, **_settings(settings))[0, PROMPT.shape[1]:]
        .tolist() for _ in range(samples)
    ])


def _auto_tree_size() -> AutoTreeSize:
    """`num_tree_nodes="auto"` on costs where trees pay (held fixed: the tiny models' own timings say otherwise), so
    that budgets and branching change from round to round with the measured acceptance."""
    chooser = AutoTreeSize(max_nodes=8, max_depth=3)
    chooser.start_from(CostTable(1.0, 0.05, {1: 1.0, 2: 1.0, 9: 1.1}, {1: 0.05, 2: 0.05}), weight=1e9)
    return chooser


TREE_CASES = {
    "without_replacement_combined_chain": (
        lambda draft: draft, {"temperature": 0.7, "top_k": 3, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
        {"num_tree_nodes": 6, "num_assistant_tokens": 3}),
    "iid_children": (lambda draft: ModelTreeDrafter(draft, branching=3, width=1, replacement=True), {},
                     {"num_tree_nodes": 7}),
    "node_by_node": (lambda draft: draft, {"temperature": 0.7, "top_k": 3},
                     {"num_tree_nodes": 6, "verification": "token"}),
    "suffix_point_masses": (lambda draft: SuffixDrafter(max_ngram_size=2), {"top_p": 0.95},
                            {"num_tree_nodes": 5}),
    "auto_budget": (lambda draft: draft, {"temperature": 0.8}, {"num_tree_nodes": _auto_tree_size()}),
}


@pytest.mark.parametrize("case", list(TREE_CASES))
def test_generate_with_trees_samples_the_target_law(small_target, small_draft, case):
    make_assistant, settings, tree = TREE_CASES[case]
    samples = _sample_trees(small_target, make_assistant(small_draft), settings, seed=len(case), **tree)
    result = fit_sequences(samples, exact_law(small_target, _settings(settings), PROMPT, NUM_TOKENS, []))
    print(case, result)
    assert result.is_consistent, result
    if isinstance(tree["num_tree_nodes"], AutoTreeSize):  # budgets and branching did change between rounds
        chooser = tree["num_tree_nodes"]
        assert len(set(chooser.chosen)) > 1 and set(chooser.chosen_branching) == {1, 2}, set(chooser.chosen)


@pytest.mark.parametrize("verification, samples", [("token", GENERATE_SAMPLES), ("block", 3 * GENERATE_SAMPLES)])
def test_negative_control_children_without_replacement_reported_as_iid(small_target, small_draft, monkeypatch,
                                                                        verification, samples):
    """Under both rules (traversal verification is closer to the law with these wrong laws: more samples)."""
    original = hf_spec.drafting.branching._children

    def reported_as_iid(probs, scores, count, context, replacement):
        return [(token, probs) for token, _ in original(probs, scores, count, context, False)]

    monkeypatch.setattr(hf_spec.drafting.branching, "_children", reported_as_iid)
    samples = _sample_trees(small_target, ModelTreeDrafter(small_draft, branching=3, width=1), {}, seed=5,
                            samples=samples, num_tree_nodes=7, verification=verification)
    result = fit_sequences(samples, exact_law(small_target, _settings({}), PROMPT, NUM_TOKENS, []))
    print("negative control, without replacement reported as i.i.d.:", result)
    assert not result.is_consistent, result


def _chains_against_the_draft() -> tuple[Verification, list[int]]:
    """Rules that verify chain rounds against the draft's own law (p := q where drafted), trees as the default
    does: a broken rule that only a test seeing chain rounds can catch. With the drafted lengths of the chain rounds,
    as they run."""
    chain_rounds = []

    def accept(draft_ids, draft_probs, target_probs, generator=None):
        chain_rounds.append(draft_ids.shape[1])
        laws = torch.cat([draft_probs, target_probs[:, draft_ids.shape[1]:]], dim=1)
        return BLOCK.chain(draft_ids, draft_probs, laws, generator)

    return broken_rules(accept, BLOCK.tree, "chains against the draft"), chain_rounds


def test_negative_control_an_auto_trees_chain_rounds_accepted_against_the_draft(small_target, small_draft):
    """The auto tree's chains run as chain rounds (`hf_spec.rounds.TreeRounds.chain_round`), and the
    ``auto_budget`` case sees them: verifying their drafts against the draft's own law instead of the target's must
    fail it."""
    broken, chain_rounds = _chains_against_the_draft()
    make_assistant, settings, _ = TREE_CASES["auto_budget"]
    samples = _sample_trees(small_target, make_assistant(small_draft), settings, seed=11,
                            num_tree_nodes=_auto_tree_size(), verification=broken)
    result = fit_sequences(samples, exact_law(small_target, _settings(settings), PROMPT, NUM_TOKENS, []))
    print("negative control, an auto tree's chain rounds accepted against the draft:", result, len(chain_rounds))
    assert any(chain_rounds) and not result.is_consistent, result


CHAIN_CASES = {  # (settings, nodes): trees that come out chains
    "nucleus": ({"temperature": 0.7, "top_p": 0.5}, 6),  # one-token nuclei (point masses), mixed with trees
    "one_node": ({"temperature": 0.8}, 1),  # one node, drawn from the draft's whole law
}


def _sample_chain_trees(target, draft, case: str, seed: int, monkeypatch, **extra) -> tuple[np.ndarray, int]:
    """Fixed trees of a `CHAIN_CASES` case, and how many of their rounds were verified as chains."""
    settings, num_nodes = CHAIN_CASES[case]
    chains, as_chain = [], hf_spec.rounds.chain_proposal

    def counted(tree: DraftTree):
        chains.append(tree.num_nodes)
        return as_chain(tree)

    monkeypatch.setattr(hf_spec.rounds, "chain_proposal", counted)
    samples = _sample_trees(target, draft, settings, seed=seed, num_tree_nodes=num_nodes, **extra)
    return samples, sum(1 for n in chains if n)


@pytest.mark.parametrize("case", list(CHAIN_CASES))
def test_trees_that_come_out_chains_are_verified_as_chains_and_sample_the_target_law(small_target, small_draft, case,
                                                                                   monkeypatch):
    samples, num_chains = _sample_chain_trees(small_target, small_draft, case, 21, monkeypatch)
    result = fit_sequences(samples, exact_law(small_target, _settings(CHAIN_CASES[case][0]), PROMPT, NUM_TOKENS, []))
    print(case, "trees verified as chains:", num_chains, result)
    assert num_chains >= GENERATE_SAMPLES // 4 and result.is_consistent, (num_chains, result)


def test_negative_control_trees_verified_as_chains_accepted_against_the_draft(small_target, small_draft, monkeypatch):
    """The ``one_node`` case sees the trees it verifies as chains: accepting them against the draft's own law must
    fail it. (Two would-be controls pass, as they should: the chain rule is exact for any token chosen independently
    of the target and reported with the law it was drawn from, so neither a tree's siblings verified as successive
    tokens, in draw order, nor a chain's tokens reported as point masses, changes the output law.)"""
    broken, chain_rounds = _chains_against_the_draft()
    samples, num_chains = _sample_chain_trees(small_target, small_draft, "one_node", 22, monkeypatch,
                                              verification=broken)
    result = fit_sequences(samples, exact_law(small_target, _settings(CHAIN_CASES["one_node"][0]), PROMPT,
                                              NUM_TOKENS, []))
    print("negative control, trees verified as chains accepted against the draft:", num_chains, result)
    assert num_chains and len(chain_rounds) >= num_chains and not result.is_consistent, (num_chains, result)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tree", [{"num_tree_nodes": 8}, {"num_tree_nodes": 12, "num_assistant_tokens": 3},
                                  {"num_tree_nodes": 6, "prompt_lookup_num_tokens": 4}])
def test_greedy_trees_equal_target_only_and_keep_the_path_in_the_cache(target, close_draft, attn, tree):
    model = speculative(make_tiny_model(seed=0, vocab_size=256))
    model.config._attn_implementation = attn
    prompts = [torch.tensor([[5, 9, 5, 9, 7, 5, 9]]), torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])]
    assistant = None if "prompt_lookup_num_tokens" in tree else make_noisy_copy(model, seed=3, noise=0.3)
    for prompt in prompts:
        expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
        out = model.generate(prompt, assistant_model=assistant, max_new_tokens=24, do_sample=False,
                             return_dict_in_generate=True, output_scores=True, **tree)
        assert torch.equal(out.sequences, expected)
        assert len(out.scores) == expected.shape[1] - prompt.shape[1]
        assert out.cache.get_seq_length() == expected.shape[1] - 1
        # the returned cache continues exactly: the path's entries are the ones a chain would have computed
        more = model.generate(out.sequences, cache=out.cache, max_new_tokens=6, do_sample=False)
        assert torch.equal(more, model.generate(expected, max_new_tokens=6, do_sample=False))
        assert out.speculative_stats.num_accepted > 0


def test_left_padded_row_with_a_tree_equals_target_only():
    model = speculative(make_tiny_model(seed=0, vocab_size=256))
    prompt = torch.tensor([[0, 0, 0, 5, 9, 5, 9, 7, 5, 9]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    expected = model.generate(prompt, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    for tree in ({"assistant_model": make_noisy_copy(model, seed=3, noise=0.3)}, {"prompt_lookup_num_tokens": 4}):
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                             num_tree_nodes=8, **tree)
        assert torch.equal(out, expected)


def test_tree_stops_inside_a_path_exactly_as_target_only(small_target):
    model = speculative(make_tiny_model(seed=0, vocab_size=256))
    prompt = torch.tensor([[5, 9, 5, 9, 7, 5, 9]])
    reference = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.shape[1]:]
    eos = int(reference[7])
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    out = model.generate(prompt, assistant_model=make_noisy_copy(model, seed=3, noise=0.1), max_new_tokens=20,
                         do_sample=False, eos_token_id=eos, num_tree_nodes=10)
    assert torch.equal(out, expected)


def test_tree_edges_are_refused_by_name(small_target, small_draft):
    with pytest.raises(ValueError, match="batch of one row"):
        small_target.generate(PROMPT.expand(2, -1), assistant_model=small_draft, num_tree_nodes=4, pad_token_id=0)
    with pytest.raises(ValueError, match="num_tree_nodes"):
        small_target.generate(PROMPT, assistant_model=small_draft, num_tree_nodes=0)
    with pytest.raises(ValueError, match="num_tree_nodes"):
        small_target.generate(PROMPT, num_tree_nodes=4)
    with pytest.raises(ValueError, match="auto"):
        small_target.generate(PROMPT, assistant_model=small_draft, num_tree_nodes=4, num_assistant_tokens="auto")
    model = speculative(make_tiny_model(seed=0, vocab_size=256))
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        model.generate(PROMPT, assistant_model=make_tiny_model(seed=1, vocab_size=256), num_tree_nodes=4)


def test_tree_stats_report_depths(small_target, small_draft):
    out = small_target.generate(PROMPT, assistant_model=small_draft, max_new_tokens=20, do_sample=False,
                                num_tree_nodes=6, return_dict_in_generate=True)
    stats = out.speculative_stats
    assert sum(stats.rounds_by_accepted) == stats.num_rounds
    assert stats.num_emitted == sum((n + 1) * count for n, count in enumerate(stats.rounds_by_accepted))
    assert stats.num_draft_tokens <= 6 * stats.num_rounds


def test_suffix_drafter_builds_the_heaviest_tree():
    ids = torch.tensor([1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2])
    found = continuations(ids, [], max_ngram_size=2, min_ngram_size=1, length=2, max_matches=8)
    assert found == [[3, 9], [4, 1], [3, 1]]  # after each earlier "1 2", most recent first
    tokens, parents = heaviest_subtree(found, num_nodes=4)
    assert tokens[0] == 3 and parents[0] == -1  # "3" follows twice
    assert set(zip(tokens, parents)) == {(3, -1), (4, -1), (9, 0), (1, 0)} or len(tokens) == 4
    corpus_found = continuations(torch.tensor([7, 8]), [torch.tensor([7, 8, 5, 6])], 2, 1, 2, 8)
    assert corpus_found == [[5, 6]]
