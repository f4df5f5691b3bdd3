"""`ModelTreeDrafter`: a draft model that branches (`hf_spec.drafting.branching`), each depth one draft forward pass
over the nodes chosen for expansion, under a tree attention mask as in the target's verify pass."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_spec.caches import cache_length, keep_tree_path
from hf_spec.drafting.branching import BranchingTreeDrafter, visibility
from hf_spec.drafting.model import ModelDrafter
from hf_spec.forward import forward_tree
from hf_spec.rows import RaggedBatch
from hf_spec.support import refuse_tree_without_positions


class ModelTreeDrafter(ModelDrafter, BranchingTreeDrafter):
    """Args:
        model: the draft model (same tokenizer as the target).
        branching, width, replacement: see `BranchingTreeDrafter`.
    """

    def __init__(self, model: PreTrainedModel, branching: int = 2, width: int = 1, replacement: bool = False):
        ModelDrafter.__init__(self, model)
        BranchingTreeDrafter.__init__(self, branching, width, replacement)
        self._num_committed, self._fed = None, []  # cache columns: committed, then these nodes in order

    def _start_tree(self, batch: RaggedBatch) -> torch.Tensor:
        self.num_catch_up_tokens = max(0, batch.model_ids.shape[1] - cache_length(self.cache) - 1)
        empty = batch.model_ids[0, :0]
        logits, _ = forward_tree(
            self.model, self.cache, self._clamped(batch.model_ids), batch.model_mask, empty, empty,
            torch.zeros((0, 0), dtype=torch.bool, device=empty.device), num_logits=1,
        )  # [1, draft vocab]
        self._num_committed, self._fed = batch.model_ids.shape[1], []
        return logits[0]

    def _evaluate_level(self, batch: RaggedBatch, level: list[int], parents: list[int], tokens: list[torch.Tensor],
                        depth: int) -> torch.Tensor:
        device = batch.model_ids.device
        visible = visibility(parents, self._fed + level).to(device)
        logits, _ = forward_tree(
            self.model, self.cache, self._clamped(batch.model_ids), batch.model_mask,
            self._clamped(torch.stack([tokens[i] for i in level])),
            torch.full((len(level),), depth, device=device), visible[len(self._fed):], num_logits=len(level),
        )  # [len(level), draft vocab]
        self._fed += level
        return logits

    def check(self, target: PreTrainedModel, max_length: int) -> None:
        super().check(target, max_length)
        refuse_tree_without_positions(self.model, "assistant_model")

    def keep_path(self, path: list[int]) -> None:
        if self._num_committed is None:  # no tree was drafted this round
            return
        fed = []
        for node in path:  # the path's nodes this draft has entries for: a prefix of the path
            if node not in self._fed:
                break
            fed.append(self._fed.index(node))
        keep_tree_path(self.cache, self._num_committed, fed)
        self._num_committed, self._fed = None, []

    def reset(self) -> None:
        super().reset()
        self._num_committed, self._fed = None, []

    def _clamped(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids past the draft's embedding rows are only conditioning: clamped (see `ModelDrafter.propose`)."""
        return ids.clamp(max=self.model.get_input_embeddings().num_embeddings - 1)
