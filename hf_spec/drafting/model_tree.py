"""`ModelTreeDrafter`: a draft model that branches, the dynamic tree of EAGLE-2 (Li et al. 2024) made exact.

Each depth is one draft forward pass over the nodes chosen for expansion (a tree attention mask, as in the target's
verify pass). A node's value is its cumulative draft probability (the product of q along its path); at each depth
the ``width`` most valuable nodes of the newest level are expanded, each into ``branching`` children, until the
budget of nodes or the depth limit is reached. Children are the draft's top tokens when greedy, and under sampling
draws *without replacement* from q, each stored with the law it was drawn from (q without the earlier siblings,
renormalized), which is what `hf_spec.rejection.accept_tree` needs to be exact.

Where this departs from EAGLE-2: EAGLE-2 reranks all drafted nodes at the end and keeps the best; that drops nodes
after looking at their own values, which breaks exactness under sampling, so here every drawn node is kept and the
budget is spent level by level instead. Which nodes get children depends on values drawn before them only.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_spec.caches import keep_tree_path
from hf_spec.checks import check_int
from hf_spec.drafting.base import DraftContext, align_vocab
from hf_spec.drafting.model import ModelDrafter
from hf_spec.drafting.tree import DraftTree, TreeDrafter, path_to
from hf_spec.forward import forward_tree, has_invalid_values
from hf_spec.rejection import sample_from_weights
from hf_spec.rows import RaggedBatch
from logits_processors import process_step


class ModelTreeDrafter(ModelDrafter, TreeDrafter):
    """Args:
        model: the draft model (same tokenizer as the target).
        branching: children per expanded node.
        width: nodes expanded per depth.
        replacement: under sampling, draw a node's children independently from q (SpecInfer's i.i.d. children)
            instead of without replacement (which never proposes the same token twice, so it is accepted more).
    """

    def __init__(self, model: PreTrainedModel, branching: int = 2, width: int = 1, replacement: bool = False):
        super().__init__(model)
        self.branching, self.width = check_int("branching", branching), check_int("width", width)
        self.replacement = bool(replacement)
        self._num_committed, self._fed = 0, []  # cache columns: committed, then these nodes in order

    def propose_tree(self, batch: RaggedBatch, num_nodes: int, max_depth: int, context: DraftContext) -> DraftTree:
        device = batch.model_ids.device
        tokens: list[torch.Tensor] = []  # one 0-dim id per node
        parents: list[int] = []
        laws: list[torch.Tensor] = []  # [vocab] per node (sampling)
        values: list[float] = []  # cumulative draft probability per node
        is_invalid = torch.zeros(2, dtype=torch.bool, device=device)
        self._fed = []

        # Depth 0: the draft catches up on the committed tokens it lacks; q at the root.
        frontier = [-1]
        logits = forward_tree(
            self.model, self.cache, self._clamped(batch.model_ids), batch.model_mask,
            batch.model_ids[0, :0], batch.model_ids.new_zeros(0), torch.zeros((0, 0), dtype=torch.bool, device=device),
            num_logits=1,
        )  # [1, draft vocab]
        is_invalid[0] |= has_invalid_values(logits)
        scores = self._scores(batch, [[]], logits, context)  # [[vocab]]
        self._num_committed = batch.model_ids.shape[1]
        num_steps, depth = 1, 0
        while True:
            # 1. Children for each frontier node, by value; how many is fixed before any is drawn.
            start = len(parents)
            for node, node_scores in zip(frontier, scores):
                count = min(self.branching, num_nodes - len(parents))
                if count <= 0:
                    break
                is_invalid[1] |= has_invalid_values(node_scores)
                probs = node_scores.softmax(dim=-1)  # [vocab]
                for token, law in _children(probs, node_scores, count, context, self.replacement):
                    tokens.append(token)
                    parents.append(node)
                    laws.append(law)
                    values.append((values[node] if node >= 0 else 1.0) * float(probs[token]))
            depth += 1
            if len(parents) >= num_nodes or depth >= max_depth or len(parents) == start:
                break
            # 2. One draft pass over the newest level's most valuable nodes, to expand them next.
            level = sorted(range(start, len(parents)), key=lambda i: -values[i])[: self.width]
            visible = _visibility(parents, self._fed + level).to(device)
            logits = forward_tree(
                self.model, self.cache, self._clamped(batch.model_ids), batch.model_mask,
                self._clamped(torch.stack([tokens[i] for i in level])),
                torch.tensor([depth] * len(level), device=device), visible[len(self._fed):], num_logits=len(level),
            )  # [len(level), draft vocab]
            self._fed += level
            num_steps += 1
            is_invalid[0] |= has_invalid_values(logits)
            scores = self._scores(batch, [path_to(parents, i) for i in level], logits, context, tokens)
            frontier = level

        token_ids = torch.stack(tokens) if tokens else batch.model_ids[0, :0]
        draft_probs = torch.stack(laws) if context.do_sample and laws else None
        if context.do_sample and not laws:
            draft_probs = torch.empty((0, context.vocab_size), device=device)
        return DraftTree(token_ids, parents, draft_probs, is_invalid, num_model_steps=num_steps)

    def keep_path(self, path: list[int]) -> None:
        fed = []
        for node in path:  # the path's nodes this draft has entries for: a prefix of the path
            if node not in self._fed:
                break
            fed.append(self._fed.index(node))
        keep_tree_path(self.cache, self._num_committed, fed)
        self._fed = []

    def _clamped(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids past the draft's embedding rows are only conditioning: clamped (see `ModelDrafter.propose`)."""
        return ids.clamp(max=self.model.get_input_embeddings().num_embeddings - 1)

    def _scores(self, batch: RaggedBatch, paths: list[list[int]], logits: torch.Tensor, context: DraftContext,
                tokens: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Each node's processed scores ``[vocab]``, the chain seeing the committed row and the node's path."""
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


def _visibility(parents: list[int], order: list[int]) -> torch.Tensor:
    """``[len(order), len(order)]`` bool: the nodes of ``order`` (cache order) that each one's path holds."""
    position = {node: i for i, node in enumerate(order)}
    visible = torch.zeros((len(order), len(order)), dtype=torch.bool)
    for row, node in enumerate(order):
        while node >= 0:
            if node in position:
                visible[row, position[node]] = True
            node = parents[node]
    return visible
