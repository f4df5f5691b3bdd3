"""`ModelDrafter`: q is a draft model's processed law (the target's processor chain, per position)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_spec.caches import crop_to, new_cache, select_rows
from hf_spec.drafting.base import DraftContext, Drafter, Proposal, draw_next, stack_laws
from hf_spec.forward import extend_mask, forward_missing
from hf_spec.rows import RaggedBatch


class ModelDrafter(Drafter):
    """Drafts with a model that shares the target's tokenizer, from its own cache (`hf_spec.caches` invariant)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = new_cache(model)

    def propose(self, batch: RaggedBatch, num_draft_tokens: int, context: DraftContext) -> Proposal:
        model_ids = batch.model_ids
        # Ids past the draft's embedding rows (padding rows of a larger target) are only conditioning for the draft:
        # clamping them changes q, which stays the exact law the draft samples from.
        max_draft_id = self.model.get_input_embeddings().num_embeddings - 1
        needs_clamp = max_draft_id < context.vocab_size - 1
        draft_ids = model_ids.new_empty((batch.num_active, 0))
        probs = []
        is_invalid = torch.zeros(2, dtype=torch.bool, device=model_ids.device)  # [raw logits, processed scores]
        for i in range(num_draft_tokens):
            prefix_ids = torch.cat([model_ids, draft_ids], dim=1)  # [active, columns + i]
            logits = forward_missing(
                self.model, self.cache, prefix_ids.clamp(max=max_draft_id) if needs_clamp else prefix_ids,
                extend_mask(batch.model_mask, i), num_logits=1,
            )  # [active, 1, draft vocab]
            next_ids, step_probs, step_invalid = draw_next(logits[:, 0], batch, draft_ids, context)
            is_invalid |= step_invalid
            probs += [step_probs] if step_probs is not None else []
            draft_ids = torch.cat([draft_ids, next_ids.unsqueeze(1)], dim=1)
        return Proposal(draft_ids, stack_laws(probs, draft_ids, context), is_invalid, num_model_steps=num_draft_tokens)

    def reset(self) -> None:
        self.cache = new_cache(self.model)

    def roll_back(self, num_cached: int, staying_rows: torch.Tensor | None) -> None:
        if staying_rows is not None:
            select_rows(self.cache, staying_rows)
        crop_to(self.cache, num_cached)
