"""`ModelDrafter`: q is a draft model's processed law (the target's processor chain, per position)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_spec.caches import (
    ColumnRules,
    attach_inputs,
    cache_length,
    crop_to,
    move_columns,
    new_cache,
    reads_encoder_outputs,
    select_rows,
)
from hf_spec.conditioning import Conditioning, holds_same_encoder
from hf_spec.drafting.base import DraftContext, Drafter, Proposal, draw_next, is_unconfident, stack_laws
from hf_spec.forward import extend_mask, forward_missing, model_column_rules, position_table, prefill
from hf_spec.rows import RaggedBatch
from hf_spec.settings import warn_once
from hf_spec.support import refuse_unsupported_family
from hf_spec.timing.probe import forward_seconds


class ModelDrafter(Drafter):
    """Drafts with a model that shares the target's tokenizer, from its own cache (`hf_spec.caches` invariant)."""

    reports_catch_up = True

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.static_length: int | None = None  # the target's static cache length, matched (`match_cache`)
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
        num_catch_up = max(0, model_ids.shape[1] - cache_length(self.cache) - 1) if num_draft_tokens else 0
        for i in range(num_draft_tokens):
            prefix_ids = torch.cat([model_ids, draft_ids], dim=1)  # [active, columns + i]
            logits, _ = forward_missing(
                self.model, self.cache, prefix_ids.clamp(max=max_draft_id) if needs_clamp else prefix_ids,
                extend_mask(batch.model_mask, i), num_logits=1,
            )  # [active, 1, draft vocab]
            next_ids, step_probs, step_invalid = draw_next(logits[:, 0], batch, draft_ids, context)
            is_invalid |= step_invalid
            probs += [step_probs] if context.do_sample else []
            draft_ids = torch.cat([draft_ids, next_ids.unsqueeze(1)], dim=1)
            if is_unconfident(step_probs, next_ids, context):
                break
        return Proposal(draft_ids, stack_laws(probs, draft_ids, context), is_invalid,
                        num_model_steps=draft_ids.shape[1], num_catch_up_tokens=num_catch_up)

    def condition(self, conditioning: Conditioning, prompt_ids: torch.Tensor,
                  prompt_mask: torch.Tensor | None) -> None:
        attach_inputs(self.cache, conditioning.inputs_for(self.model))
        prefill(self.model, self.cache, prompt_ids, prompt_mask, conditioning.prompt_inputs_for(self.model))

    def match_cache(self, static_length: int | None) -> None:
        self.static_length = static_length

    def reset(self) -> None:
        self.cache = new_cache(self.model, self.static_length)

    def column_rules(self) -> ColumnRules:
        return model_column_rules(self.model, self.cache)

    def move_columns(self, first: int, order: torch.Tensor) -> None:
        move_columns(self.cache, first, order)

    def check(self, target: PreTrainedModel, max_length: int) -> None:
        check_draft_model(self.model, target, max_length)

    @property
    def cost_key(self) -> PreTrainedModel:
        return self.model

    def measure_passes(self, prefix_ids: torch.Tensor, widths: list[int], repeats: int) -> dict[int, float]:
        return forward_seconds(self.model, prefix_ids.to(self.model.device), widths, repeats)

    def roll_back(self, num_cached: int, staying_rows: torch.Tensor | None) -> None:
        crop_to(self.cache, num_cached)  # first: a recurrent layer's recorded states hold every row
        if staying_rows is not None:
            select_rows(self.cache, staying_rows)


def check_draft_model(draft: PreTrainedModel, target: PreTrainedModel, max_length: int,
                      shares_tokenizer: bool = True) -> None:
    """A draft model must be decoder-only, on the target's (first) device, and hold every position it is fed; one
    meant to share the target's tokenizer (``shares_tokenizer``) whose vocabulary has another size gets a warning.

    A call may reach ``max_length`` tokens, but the draft never reads the last two: a round that drafts k tokens
    after a row of length L feeds the draft L + k - 1 of them, and k <= max_length - L - 1. So positions up to
    ``max_length - 3`` must be in a learned position table (models with rotary or ALiBi positions have no such
    limit)."""
    if draft.config.is_encoder_decoder and not target.config.is_encoder_decoder:
        raise ValueError(f"`assistant_model` ({type(draft).__name__}) is an encoder-decoder model, but the model "
                         f"({type(target).__name__}) is decoder-only: the draft's encoder would have nothing to read.")
    refuse_unsupported_family(draft, "assistant_model")
    if draft.device != target.device:
        raise ValueError(
            f"`assistant_model` is on {draft.device} but the model is on {target.device}; move the draft to the "
            f"target's (first) device, e.g. `assistant_model.to({str(target.device)!r})`."
        )
    draft_vocab, target_vocab = (model.config.get_text_config().vocab_size for model in (draft, target))
    if shares_tokenizer and draft_vocab != target_vocab:
        warn_once(f"`assistant_model` has a vocabulary of {draft_vocab} ids and the model {target_vocab}. A draft with "
                  "the target's tokenizer, padded to another size, is fine; a draft with another tokenizer proposes "
                  "ids that mean other tokens and is almost never accepted: pass `tokenizer=` and "
                  "`assistant_tokenizer=` to generate() to draft across tokenizers.")
    check_encoder_side(draft, target)
    table = position_table(draft)
    if table is not None and max_length - 2 > table:
        raise ValueError(
            f"`assistant_model` has a table of {table} learned positions, but this call may reach {max_length} "
            f"tokens (prompt + max_new_tokens), of which the draft reads up to {max_length - 2}; lower "
            "`max_new_tokens` or use a draft with a longer context."
        )



def check_encoder_side(draft: PreTrainedModel, target: PreTrainedModel) -> None:
    """An encoder-decoder target's draft reads what its encoder read or what it wrote: an encoder-decoder draft with an
    encoder of its own reads the target's encoder ids, so its embedding holds them; a decoder reading the target's
    encoder outputs (distil-whisper's ``WhisperForCausalLM``) has their width."""
    if not target.config.is_encoder_decoder or not reads_encoder_outputs(draft):
        return
    if draft.config.is_encoder_decoder:
        if target.main_input_name != "input_ids" or holds_same_encoder(draft, target):
            return
        rows = draft.get_encoder().get_input_embeddings().num_embeddings
        target_rows = target.get_encoder().get_input_embeddings().num_embeddings
        if rows < target_rows:
            raise ValueError(f"`assistant_model` ({type(draft).__name__}) runs its own encoder on the model's input "
                             f"ids, but its embedding has {rows} rows and the model's {target_rows}: ids past "
                             f"{rows - 1} would not be found. Use a draft with the model's tokenizer and vocabulary.")
        return
    width, target_width = (getattr(model.config, "d_model", None) or model.config.hidden_size
                           for model in (draft, target))
    if width != target_width:
        raise ValueError(f"`assistant_model` ({type(draft).__name__}) attends over the model's encoder outputs, which "
                         f"are {target_width} wide, but it is {width} wide: a decoder-only assistant must be made for "
                         "this model's encoder (distil-whisper's assistants keep their teacher's).")
