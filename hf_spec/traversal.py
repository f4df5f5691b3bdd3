"""Traversal verification: the exact acceptance rule of a sampled tree of drafts that judges whole paths, leaf to
root (Weng et al. 2025, "Traversal Verification for Speculative Tree Decoding", Algorithm 2).

Node-by-node rejection (`hf_spec.rejection.accept_tree`) walks down from the root and stops at the first node whose
token the target likes less than the draft did, even when the path below it makes up for that. Traversal verification
tests the nodes from the leaves up (post-order: a node after every node of its subtree, children in the order they
were drawn), each as the end of its whole path, as block verification (`hf_spec.rejection.accept_block`) does along a
chain. With, at a node ``v`` holding the target-side law ``m_v`` and the weight ``w_v`` (``w = 1`` and ``m = p`` at
the root; ``m_v = p`` after ``v`` when it is first reached), its child ``c`` with token ``x`` drawn from ``q_c``:

    w_c = min(1, w_v m_v(x) / q_c(x))                        # how much of the path to c the target keeps

and after c's subtree was passed without a stop (c itself is tested last, with ``w_c`` as its children left it):

    r   = max(0, w_v m_v - q_c)                              # what the target keeps beyond c
    w_v = |r| / (|r| + 1 - w_v),   m_v = r / |r|             # v as the next candidate (a chain: block verification)

A node is tested with chance ``w_v``; the first that passes is kept with its path, then one token is drawn from its
``m_v``. The root comes last with ``w = 1``, so one token is always emitted. With one child per node this is block
verification; with one level it is node-by-node rejection. ``q_c`` is the law child c was drawn from given its
parent and its earlier siblings (the draft's q for i.i.d. children, q without the earlier siblings for draws without
replacement, a point mass for deterministic children), as for `accept_tree`.

How many children a node gets may depend on the tokens drawn before them, as the dynamic trees of
`hf_spec.drafting.branching` do (`tests/test_traversal.py` enumerates every tree of such shapes and finds the
target's law to rounding).

Nothing here touches a model, a cache or global state; randomness comes only from ``generator``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from hf_spec.rejection import check_shape, check_tree, children_of, sample_from_weights


@dataclasses.dataclass(frozen=True)
class Stop:
    """A candidate end of the accepted path: ``node`` (-1: the root), the ``chance`` to stop there once every earlier
    candidate was passed, and the ``law`` ``[vocab]`` (float64, normalized) of the token emitted after it."""

    node: int
    chance: float
    law: torch.Tensor


def traversal_stops(token_ids: torch.Tensor, parents: list[int], draft_probs: torch.Tensor,
                    target_probs: torch.Tensor) -> Iterator[Stop]:
    """The candidates in the order the rule tests them, each computed once the earlier ones were passed (lazily: a
    round stops early without paying for the rest). The sequence does not depend on the outcome of the tests, so
    the law of a round is ``sum over stops of prod(1 - earlier chances) * chance * law``. Arguments as for
    :func:`accept_traversal`."""
    num_nodes = check_tree("token_ids", token_ids, parents)
    vocab_size = target_probs.shape[-1]
    check_shape("draft_probs", draft_probs, 2, (num_nodes, vocab_size))
    check_shape("target_probs", target_probs, 2, (num_nodes + 1, vocab_size))
    children, tokens = children_of(parents), token_ids.tolist()

    def visit(node: int, weight: float) -> Iterator[Stop]:
        law = target_probs[node + 1].double()  # [vocab] m_v
        for child in children[node]:
            drawn_from = draft_probs[child].double()  # [vocab] q_c
            q = float(drawn_from[tokens[child]])
            yield from visit(child, min(1.0, weight * float(law[tokens[child]]) / q) if q > 0 else 0.0)
            residual = (weight * law - drawn_from).clamp_min_(0)  # [vocab] r
            mass = float(residual.sum())
            # mass + 1 - w = 0 only where w = 1 and m = q_c: c's subtree then always stops, so nothing changes here.
            if mass + 1 - weight > 0:
                weight = mass / (mass + 1 - weight)
            if mass > 0:
                law = residual / mass
        yield Stop(node, weight, law)

    return visit(-1, 1.0)


def accept_traversal(token_ids: torch.Tensor, parents: list[int], draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, generator: torch.Generator | None = None
                     ) -> tuple[list[int], torch.Tensor]:
    """Traversal verification of one row's tree.

    Args:
        token_ids: ``[n]`` the tree's tokens, in topological order.
        parents: ``n`` parent indices (``-1`` for the root), ``parents[i] < i``; children in the order drawn.
        draft_probs: ``[n, vocab]`` the law node i was drawn from, given its parent and its earlier siblings.
        target_probs: ``[n + 1, vocab]`` p at the root (row 0) and after each node (row i + 1).
        generator: the source of randomness.

    Returns:
        The accepted path (node indices, root's child first) and the next token (0-dim int64), as
        `hf_spec.rejection.accept_tree` returns them.
    """
    for stop in traversal_stops(token_ids, parents, draft_probs, target_probs):
        uniform = float(torch.rand((), dtype=torch.float64, device=token_ids.device, generator=generator))
        if uniform < stop.chance:  # the root's chance is 1: always
            path, node = [], stop.node
            while node >= 0:
                path.append(node)
                node = parents[node]
            return path[::-1], sample_from_weights(stop.law, generator)
    raise AssertionError("the root is always a stop")  # unreachable: the root's chance is 1
