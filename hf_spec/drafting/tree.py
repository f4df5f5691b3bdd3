"""Trees of drafts: what a tree drafter hands the loop, and the contract it keeps.

A tree holds several candidate continuations of the committed text at once. Node i carries one token, its parent
(``-1`` is the root: the last committed token), and, under sampling, the law it was drawn from given its parent and
its earlier siblings. The loop verifies every node in one target pass (each node attends to the committed text and
its own ancestors, at position ``last committed position + depth``) and keeps one root-to-node path
(`hf_spec.rejection.accept_tree`). The rule is exact when each node's stored law is the law it really was drawn from
given everything drawn before it, and when the number of children a node gets is fixed before they are drawn.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from hf_spec.drafting.base import DraftContext, Drafter
from hf_spec.rows import RaggedBatch


@dataclasses.dataclass
class DraftTree:
    """One round's tree for a batch of one row."""

    token_ids: torch.Tensor  # [n] in topological order
    parents: list[int]  # n parent indices, parents[i] < i, -1 for the root
    draft_probs: torch.Tensor | None  # [n, vocab] the law node i was drawn from; None when greedy
    is_invalid: torch.Tensor  # [2] bool: NaN/inf draft logits; processed scores with NaN/+inf or nothing unmasked
    num_model_steps: int  # draft-model forward passes it took (0 for lookup and suffix trees)
    num_catch_up_tokens: int = 0  # committed tokens beyond one that the draft's first pass fed (a draft model's cache)

    def __post_init__(self):
        if self.token_ids.dim() != 1 or len(self.parents) != self.token_ids.shape[0] or any(
            not -1 <= parent < i for i, parent in enumerate(self.parents)
        ):
            raise ValueError(f"A DraftTree needs `token_ids` of shape [n] and `parents` with one index in [-1, i) per "
                             f"node, but got shape {tuple(self.token_ids.shape)} and parents {self.parents}.")

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (empty for the root, -1)."""
        return path_to(self.parents, node)

    def visibility(self) -> torch.Tensor:
        """``[n, n]`` bool: node i attends to node j when j is i or one of its ancestors."""
        visible = torch.eye(self.num_nodes, dtype=torch.bool, device=self.token_ids.device)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                visible[node] |= visible[parent]
        return visible


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (empty for the root, -1), given each node's parent."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


class TreeDrafter(Drafter):
    """A drafter that can also propose a tree; the loop then verifies every node in one target pass."""

    @property
    def growth(self) -> tuple[int, int | None]:
        """How it grows a tree, for the tree-size chooser's model (`hf_spec.sizing.tree_size`): ``(children per
        node, nodes expanded per level)``, the second ``None`` when the most promising nodes anywhere grow first."""
        return (4, None)

    @abc.abstractmethod
    def propose_tree(self, batch: RaggedBatch, num_nodes: int, max_depth: int, context: DraftContext,
                     branching: int | None = None) -> DraftTree:
        """At most ``num_nodes`` nodes, none deeper than ``max_depth``, for the one active row of ``batch``; at most
        ``branching`` children per node when given (1: a chain), the drafter's own limit otherwise."""

    def keep_path(self, path: list[int]) -> None:
        """The loop accepted ``path`` (node indices) of the last tree: keep what state it has for it, drop the rest.
        Called before `Drafter.roll_back`."""
