"""Traversal verification (`hf_spec.traversal`): the law of one round, enumerated over every tree a toy draft can
draw, equals the target's law exactly (not statistically), for children drawn i.i.d., without replacement, and as
point masses, on trees of fixed shape and on trees shaped by their own tokens; on a chain it is block verification;
it keeps more tokens than node-by-node rejection in expectation. Negative controls: a rule that forgets to update
the parent's weight, and children handed to the rule with the wrong laws, must both break the law."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from hf_spec.evaluation.exactness import expected_tree_depths
from hf_spec.rejection import accept_tree, block_laws, children_of
from hf_spec.traversal import Stop, accept_traversal, traversal_stops

VOCAB = 3


def _laws(seed: int, sharpness: float) -> dict[tuple[int, ...], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {prefix: (sharpness * torch.randn(VOCAB, generator=generator, dtype=torch.float64)).softmax(-1)
            for n in range(5) for prefix in itertools.product(range(VOCAB), repeat=n)}


P, Q = _laws(0, 1.5), _laws(1, 2.5)

#: Fixed shapes: each node's number of children, in the order drawn (a node is a tuple of child ranks).
SHAPES = {
    "two_chains": {(): 2, (0,): 1, (1,): 1},
    "bushy": {(): 2, (0,): 2, (0, 0): 1, (0, 1): 1, (1,): 1},
    "chain_of_three": {(): 1, (0,): 1, (0, 0): 1},
    "one_level": {(): 3},  # node-by-node rejection, which traversal is on one level
}


def _children_laws(law: torch.Tensor, count: int, scheme: str) -> list[list[tuple[int, float, torch.Tensor]]]:
    """Every way to draw ``count`` children: lists of (token, probability of this draw, law reported)."""
    if scheme == "point_mass":
        return [[(int(t), 1.0, torch.nn.functional.one_hot(t, VOCAB).double()) for t in law.topk(count).indices]]
    draws = []
    for tokens in itertools.product(range(VOCAB), repeat=count):
        remaining, children = law.clone(), []
        for token in tokens:
            drawn_from = law if scheme.startswith("iid") else remaining / remaining.sum()
            if float(drawn_from[token]) == 0:
                break
            reported = remaining / remaining.sum() if scheme == "iid_reported_without_replacement" else drawn_from
            children.append((token, float(drawn_from[token]), reported))
            remaining = remaining.clone()
            remaining[token] = 0
        if len(children) == count:
            draws.append(children)
    return draws


def _trees(shape, scheme: str, prefix=(), node=()):
    """Every tree the draft can draw below ``node``: (probability, [(path tokens, parent key, law)] in topological
    order by key). ``shape`` is a dict of child counts or a function of (node, tokens drawn so far)."""
    count = shape(node, prefix) if callable(shape) else shape.get(node, 0)
    if count == 0:
        yield 1.0, []
        return
    for children in _children_laws(Q[prefix], count, scheme):
        weight = 1.0
        for _, probability, _ in children:
            weight *= probability
        subtrees = [list(_trees(shape, scheme, prefix + (token,), node + (rank,)))
                    for rank, (token, _, _) in enumerate(children)]
        for combination in itertools.product(*subtrees):
            nodes, total = [], weight
            for (token, _, law), (sub_weight, sub_nodes) in zip(children, combination):
                total *= sub_weight
                nodes.append(((token,), law, sub_nodes))
            yield total, nodes


def _flatten(nodes, prefix=(), parent=-1, out=None):
    """Topological lists: tokens, parents, laws, and each node's full token prefix."""
    out = out if out is not None else ([], [], [], [])
    for (token,), law, sub_nodes in nodes:
        out[0].append(token), out[1].append(parent), out[2].append(law), out[3].append(prefix + (token,))
        _flatten(sub_nodes, prefix + (token,), len(out[0]) - 1, out)
    return out


def _round_law(shape, scheme: str, stops=traversal_stops, length: int | None = None) -> tuple[dict, int]:
    """The law of one round, each output continued by the target to ``length`` tokens (the deepest path + 1)."""
    length = length or 1 + max(len(node) for node in shape)
    law: dict[tuple[int, ...], float] = {}
    for weight, nodes in _trees(shape, scheme):
        tokens, parents, laws, prefixes = _flatten(nodes)
        target = torch.stack([P[()]] + [P[p] for p in prefixes])
        passed = 1.0
        for stop in stops(torch.tensor(tokens), parents, torch.stack(laws), target):
            kept = () if stop.node < 0 else prefixes[stop.node]
            for y in range(VOCAB):
                _continue(law, kept + (y,), weight * passed * stop.chance * float(stop.law[y]), length)
            passed *= 1 - stop.chance
    return law, length


def _continue(law: dict, emitted: tuple[int, ...], mass: float, length: int) -> None:
    if len(emitted) >= length:
        law[emitted[:length]] = law.get(emitted[:length], 0.0) + mass
        return
    for y in range(VOCAB):
        _continue(law, emitted + (y,), mass * float(P[emitted][y]), length)


def _target_law(length: int) -> dict:
    law = {}
    _continue(law, (), 1.0, length)
    return law


def _distance(law: dict, length: int) -> float:
    exact = _target_law(length)
    return sum(abs(law.get(key, 0.0) - value) for key, value in exact.items()) + sum(
        value for key, value in law.items() if key not in exact)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scheme", ["iid", "without_replacement", "point_mass"])
def test_traversal_gives_the_target_law_exactly(shape, scheme):
    law, length = _round_law(SHAPES[shape], scheme)
    assert _distance(law, length) < 1e-12


def test_traversal_stays_exact_on_trees_shaped_by_their_own_tokens():
    """How many children a node gets may depend on the tokens drawn before them (the dynamic trees of
    `hf_spec.drafting.branching` grow the nodes the draft liked most): here each node's count, 0 to 2, is a random
    function of its path's tokens, 12 such functions, children drawn i.i.d. and without replacement."""
    for seed in range(12):
        counts: dict[tuple[int, ...], int] = {}
        chooser = random.Random(seed)

        def shape(node, prefix):
            if len(node) >= 2:
                return 0
            return counts.setdefault(prefix, chooser.choice([0, 1, 2]) if node else 2)

        for scheme in ("iid", "without_replacement"):
            law, _ = _round_law(shape, scheme, length=3)
            assert _distance(law, 3) < 1e-12, (seed, scheme)


def _stops_without_weight_update(token_ids, parents, draft_probs, target_probs):
    """Broken: after a child's subtree is passed, the parent's law becomes the residual but its weight stays."""
    children, tokens = children_of(parents), token_ids.tolist()

    def visit(node, weight):
        law = target_probs[node + 1].double()
        for child in children[node]:
            q = float(draft_probs[child, tokens[child]])
            yield from visit(child, min(1.0, weight * float(law[tokens[child]]) / q))
            residual = (weight * law - draft_probs[child].double()).clamp_min(0)
            law = residual / residual.sum() if residual.sum() > 0 else law
        yield Stop(node, weight, law)

    return visit(-1, 1.0)


@pytest.mark.parametrize("scheme", ["without_replacement", "iid_reported_without_replacement"])
def test_negative_control_broken_traversal_breaks_the_law(scheme):
    """A rule that forgets the parent's new weight, and children drawn i.i.d. but reported as drawn without
    replacement (the laws the rule is handed are wrong), must both move the law."""
    stops = _stops_without_weight_update if scheme == "without_replacement" else traversal_stops
    law, length = _round_law(SHAPES["bushy"], scheme, stops=stops)
    assert _distance(law, length) > 1e-3


def test_on_a_chain_traversal_is_block_verification():
    """The stops of a chain, leaf first, are block verification's h_k .. h_0 and its residual laws."""
    generator = torch.Generator().manual_seed(5)
    k = 4
    draft_probs = torch.randn(k, VOCAB, generator=generator, dtype=torch.float64).softmax(-1)
    target_probs = torch.randn(k + 1, VOCAB, generator=generator, dtype=torch.float64).softmax(-1)
    tokens = torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1)
    stops = list(traversal_stops(tokens, list(range(-1, k - 1)), draft_probs, target_probs))
    chances, residuals = block_laws(tokens[None], draft_probs[None], target_probs[None])
    assert [stop.node for stop in stops] == list(range(k - 1, -2, -1))
    for i, stop in zip(range(k, -1, -1), stops):
        expected = 1.0 if i == 0 else float(chances[0, i])  # tau = 0 is what is left: the root always stops
        assert stop.chance == pytest.approx(expected, abs=1e-12)
        assert torch.allclose(stop.law, residuals[0, i] / residuals[0, i].sum(), atol=1e-12)


@pytest.mark.parametrize("shape", ["bushy", "two_chains", "chain_of_three"])
def test_traversal_keeps_at_least_as_many_tokens_as_node_by_node(shape):
    """Over every tree the draft can draw, weighted by its probability: the expected accepted depth, exactly
    (`hf_spec.evaluation.exactness.expected_tree_depths`, checked against sampling below)."""
    expected = {"traversal": 0.0, "node": 0.0}
    for weight, nodes in _trees(SHAPES[shape], "without_replacement"):
        tokens, parents, laws, prefixes = _flatten(nodes)
        target = torch.stack([P[()]] + [P[p] for p in prefixes])
        node_by_node, traversal = expected_tree_depths(torch.tensor(tokens), parents, torch.stack(laws), target)
        expected["traversal"] += weight * traversal
        expected["node"] += weight * node_by_node
    print(shape, expected)
    assert expected["traversal"] > expected["node"] + 1e-3, expected


def test_accept_traversal_samples_its_stops():
    """The sampling function follows the stops: kept paths and tokens over 20,000 draws match the laws computed
    from `traversal_stops` on one fixed tree."""
    tokens, parents = torch.tensor([0, 2, 1, 1]), [-1, 0, -1, 2]
    laws = torch.stack([Q[()], Q[(0,)], Q[()], Q[(1,)]])
    target = torch.stack([P[()], P[(0,)], P[(0, 2)], P[(1,)], P[(1, 1)]])
    expected, passed = {}, 1.0
    for stop in traversal_stops(tokens, parents, laws, target):
        for y in range(VOCAB):
            expected[(stop.node, y)] = passed * stop.chance * float(stop.law[y])
        passed *= 1 - stop.chance
    generator = torch.Generator().manual_seed(7)
    counts: dict[tuple[int, int], int] = {}
    draws = 20_000
    for _ in range(draws):
        path, next_id = accept_traversal(tokens, parents, laws, target, generator)
        key = (path[-1] if path else -1, int(next_id))
        counts[key] = counts.get(key, 0) + 1
    for key, probability in expected.items():
        error = 4 * (probability * (1 - probability) / draws) ** 0.5 + 1e-9
        assert abs(counts.get(key, 0) / draws - probability) < error, (key, probability)


def test_expected_depths_match_each_rules_sampled_depth():
    """The exact expectations of `expected_tree_depths` against 20,000 draws of each rule on one tree."""
    tokens, parents = torch.tensor([0, 2, 1, 1, 0]), [-1, 0, -1, 2, 0]
    laws = torch.stack([Q[()], Q[(0,)], Q[()], Q[(1,)], Q[(0,)]])
    target = torch.stack([P[()], P[(0,)], P[(0, 2)], P[(1,)], P[(1, 1)], P[(0, 0)]])
    expected = expected_tree_depths(tokens, parents, laws, target)
    generator = torch.Generator().manual_seed(8)
    for rule, exact in zip((accept_tree, accept_traversal), expected):
        depths = [len(rule(tokens, parents, laws, target, generator)[0]) for _ in range(20_000)]
        assert abs(sum(depths) / len(depths) - exact) < 4 * (1 / len(depths)) ** 0.5, (rule.__name__, exact)
