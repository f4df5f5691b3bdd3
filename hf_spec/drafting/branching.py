"""`BranchingTreeDrafter`: a drafter that grows its tree from its own laws, the dynamic tree of EAGLE-2 (Li et al.
2024) made exact. A draft model (`hf_spec.drafting.model_tree`) and a draft head (`hf_spec.heads.drafter`) differ
only in how they read the committed text and how they evaluate a level of nodes; the growth is here.

A node's value is its cumulative draft probability (the product of q along its path). At each depth the ``width``
most valuable nodes of the newest level are expanded, each into ``branching`` children, until the budget of nodes or
the depth limit is reached. Children are the draft's top tokens when greedy, and under sampling draws *without
replacement* from q, each stored with the law it was drawn from (q without the earlier siblings, renormalized), or
i.i.d. draws from q (SpecInfer), which is what `hf_spec.rejection.accept_tree` needs to be exact.

Where this departs from EAGLE-2: EAGLE-2 reranks all drafted nodes at the end and keeps the best; that drops nodes
after looking at their own values, which breaks exactness under sampling, so here every drawn node is kept and the
budget is spent level by level instead. Which nodes get children depends on values drawn before them only.
"""

from __future__ import annotations

import abc

import torch

from hf_spec.checks import check_int
from hf_spec.drafting.base import DraftContext, align_vocab
from hf_spec.drafting.tree import DraftTree, TreeDrafter, path_to
from hf_spec.forward import has_invalid_values
from hf_spec.rejection import sample_from_weights
from hf_spec.rows import RaggedBatch
from logits_processors import process_step


class BranchingTreeDrafter(TreeDrafter):
    """Grows a tree by value from the draft's own laws; subclasses say how the draft evaluates the root and a level.

    Args:
        branching: children per expanded node.
        width: nodes expanded per depth.
        replacement: under sampling, draw a node's children independently from q (SpecInfer's i.i.d. children)
            instead of without replacement (which never proposes the same token twice, so it is accepted more).
    """

    #: Committed tokens beyond one that the last `_start_tree` fed (a drafter with its own cache sets it).
    num_catch_up_tokens = 0

    def __init__(self, branching: int = 2, width: int = 1, replacement: bool = False):
        self.branching, self.width = check_int("branching", branching), check_int("width", width)
        self.replacement = bool(replacement)

    @property
    def growth(self) -> tuple[int, int | None]:
        return (self.branching, self.width)

    @abc.abstractmethod
    def _start_tree(self, batch: RaggedBatch) -> torch.Tensor | None:
        """Catch up on the committed text; the draft's raw logits ``[draft vocab]`` after it (the root's law), or
        ``None`` when the draft cannot propose yet."""

    @abc.abstractmethod
    def _evaluate_level(self, batch: RaggedBatch, level: list[int], parents: list[int], tokens: list[torch.Tensor],
                        depth: int) -> torch.Tensor:
        """One draft pass over the nodes ``level`` (all at ``depth``, each seeing the committed text and its
        ancestors); their raw logits ``[len(level), draft vocab]``, the laws of their children."""

    def propose_tree(self, batch: RaggedBatch, num_nodes: int, max_depth: int, context: DraftContext,
                     branching: int | None = None) -> DraftTree:
        device = batch.model_ids.device
        branching = self.branching if branching is None else min(self.branching, branching)
        tokens: list[torch.Tensor] = []  # one 0-dim id per node
        parents: list[int] = []
        laws: list[torch.Tensor] = []  # [vocab] per node (sampling)
        values: list[float] = []  # cumulative draft probability per node
        is_invalid = torch.zeros(2, dtype=torch.bool, device=device)  # [raw logits, processed scores]
        logits = self._start_tree(batch) if num_nodes > 0 and max_depth > 0 else None  # [draft vocab]
        if logits is None:
            return _tree(tokens, parents, laws, is_invalid, 0, batch, context)

        # Depth 0: the root's law, the draft having caught up on the committed tokens it lacked.
        is_invalid[0] |= has_invalid_values(logits)
        frontier, scores = [-1], node_scores(batch, [[]], logits[None], context, tokens)  # [[vocab]]
        num_steps, depth = 1, 0
        while True:
            # 1. Children for each frontier node, by value; how many is fixed before any is drawn.
            start = len(parents)
            for node, node_law_scores in zip(frontier, scores):
                count = min(branching, num_nodes - len(parents))
                if count <= 0:
                    break
                is_invalid[1] |= has_invalid_values(node_law_scores)
                probs = node_law_scores.softmax(dim=-1)  # [vocab]
                for token, law in _children(probs, node_law_scores, count, context, self.replacement):
                    tokens.append(token)
                    parents.append(node)
                    laws.append(law)
                    values.append((values[node] if node >= 0 else 1.0) * float(probs[token]))
            depth += 1
            if len(parents) >= num_nodes or depth >= max_depth or len(parents) == start:
                break
            # 2. One draft pass over the newest level's most valuable nodes, to expand them next.
            frontier = sorted(range(start, len(parents)), key=lambda i: -values[i])[: self.width]
            logits = self._evaluate_level(batch, frontier, parents, tokens, depth)  # [len(frontier), draft vocab]
            num_steps += 1
            is_invalid[0] |= has_invalid_values(logits)
            scores = node_scores(batch, [path_to(parents, i) for i in frontier], logits, context, tokens)
        return _tree(tokens, parents, laws, is_invalid, num_steps, batch, context, self.num_catch_up_tokens)


def _tree(tokens: list[torch.Tensor], parents: list[int], laws: list[torch.Tensor], is_invalid: torch.Tensor,
          num_steps: int, batch: RaggedBatch, context: DraftContext, num_catch_up_tokens: int = 0) -> DraftTree:
    token_ids = torch.stack(tokens) if tokens else batch.model_ids[0, :0]
    draft_probs = None
    if context.do_sample:
        draft_probs = (torch.stack(laws) if laws
                       else torch.empty((0, context.vocab_size), device=batch.model_ids.device))
    return DraftTree(token_ids, parents, draft_probs, is_invalid, num_model_steps=num_steps,
                     num_catch_up_tokens=num_catch_up_tokens)


def node_scores(batch: RaggedBatch, paths: list[list[int]], logits: torch.Tensor, context: DraftContext,
                tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each node's processed scores ``[vocab]`` from its raw draft logits ``[nodes, draft vocab]``: the call's chain
    seeing the committed row and the node's path (``paths``: node indices into ``tokens``)."""
    scores = []
    for path, node_logits in zip(paths, align_vocab(logits, context.vocab_size)):
        path_ids = (torch.stack([tokens[i] for i in path]) if path else batch.model_ids[0, :0])[None]
        row_ids, lengths = batch.row_view(path_ids)
        scores.append(batch.to_active(process_step(
            context.logits_processor, row_ids, batch.to_batch(node_logits[None]), lengths))[0])
    return scores


def _children(probs: torch.Tensor, scores: torch.Tensor, count: int, context: DraftContext,
              replacement: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` children as (token, the law it was drawn from): the top tokens when greedy; under sampling, i.i.d.
    draws from q, or draws without replacement, each from q without the earlier draws, renormalized."""
    if not context.do_sample:
        return [(token, probs) for token in scores.topk(count).indices]
    if replacement:
        return [(sample_from_weights(probs, context.generator), probs) for _ in range(count)]
    children, law = [], probs
    for _ in range(count):
        if not law.sum() > 0:  # q has fewer tokens than count: no further child can be drawn
            break
        law = law / law.sum()
        token = sample_from_weights(law, context.generator)
        children.append((token, law))
        law = law.clone()
        law[token] = 0
    return children


def visibility(parents: list[int], order: list[int]) -> torch.Tensor:
    """``[len(order), len(order)]`` bool: the nodes of ``order`` (cache order) that each one's path holds."""
    position = {node: i for i, node in enumerate(order)}
    visible = torch.zeros((len(order), len(order)), dtype=torch.bool)
    for row, node in enumerate(order):
        while node >= 0:
            if node in position:
                visible[row, position[node]] = True
            node = parents[node]
    return visible
