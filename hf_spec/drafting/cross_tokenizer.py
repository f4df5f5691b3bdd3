"""`CrossTokenizerDrafter`: a draft model with a tokenizer of its own, exactly: string-level matching when greedy,
token-level intersection when sampling.

``generate(assistant_model=draft, tokenizer=target_tokenizer, assistant_tokenizer=draft_tokenizer)`` with two
different vocabularies. Each round:

1. Every active row's committed text (the target's ids, decoded) is tokenized by the draft's tokenizer. The draft's
   own token grid keeps the longest prefix it already read; the tokens after it are masked out (holes, as in
   `hf_spec.rows`) and the new ones appended, so one pass over a rectangle serves every row.
2. The draft proposes target ids, by one of two methods (`MATCHINGS`; ``"auto"``: strings when greedy, the
   intersection when sampling, as transformers' universal assisted generation chooses):

   - ``"intersection"``: each draft step's logits over the draft's vocabulary are moved onto the target's ids
     (`to_target_space`): a token whose text both vocabularies hold (`vocabulary_map`) keeps its logit, every other
     target id gets ``-inf``. The call's processor chain runs on those target-space scores, and the draft token is
     drawn from their law q, exactly as for a same-tokenizer draft (`hf_spec.drafting.base.draw_next`); the drawn
     target id is fed back to the draft as its draft id.
   - ``"string"``: the draft decodes k of its own tokens greedily (its raw logits, over its whole vocabulary), their
     text is tokenized by the target's tokenizer, and the first k target ids are the proposal, each with q a point
     mass (`hf_spec.drafting.lookup.point_mass_proposal`). A draft text spanning target tokens the intersection lacks
     (runs of spaces in code, say) is proposed all the same.

Why both are exact: q is a law over the target's ids that depends only on the row's prefix (and the draft's own
choices), and it is the law the token was drawn from; the acceptance rule (`hf_spec.rejection`) keeps the target's law
for any such q. Intersection: target ids outside it have q = 0, so they are never proposed, and the residual
max(0, p - q) gives them their full probability when a draft is rejected. Strings: a point mass on x is accepted with
probability p(x), and a rejection is drawn from p without x, renormalized, which together is p: a string-level exact
match (greedy: the longest prefix equal to the target's argmax). These are Timor et al.'s token-level intersection
and string-level exact match (ICML 2025, "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms
for Heterogeneous Vocabularies"), here in ragged batches. Which texts count as equal, and how the draft's text is
cut into target tokens, only decide how often drafts are accepted, never the output law.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_spec.caches import cache_length, crop_to, new_cache, reads_encoder_outputs, select_rows
from hf_spec.compat import is_rewired_by_universal_assisted_generation
from hf_spec.drafting.base import DraftContext, Drafter, Proposal, draw_next, is_unconfident, stack_laws
from hf_spec.drafting.lookup import point_mass_proposal
from hf_spec.drafting.model import check_draft_model
from hf_spec.forward import forward_missing, has_invalid_values, position_table
from hf_spec.rows import RaggedBatch
from hf_spec.timing.probe import forward_seconds

_MAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target tokenizer -> {draft tokenizer -> map}
#: How a draft of another tokenizer proposes target ids (`CrossTokenizerDrafter`).
MATCHINGS = ("auto", "string", "intersection")


def token_texts(tokenizer: Any) -> dict[str, int]:
    """Text -> id of every ordinary token (special tokens and partial UTF-8 pieces left out; the lowest id of a text
    wins). A SentencePiece word start (``▁``) reads as a space, as a byte-level BPE's ``Ġ`` does."""
    special = set(tokenizer.all_special_ids)
    texts: dict[str, int] = {}
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if index in special:
            continue
        text = tokenizer.convert_tokens_to_string([token])
        if token.startswith("\u2581") and not text.startswith(" "):
            text = " " + text
        if text and "\ufffd" not in text:
            texts.setdefault(text, index)
    return texts


def vocabulary_map(tokenizer: Any, draft_tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target_ids [M], draft_ids [M])``: the tokens whose text both vocabularies hold, paired (made once per pair
    of tokenizers and their sizes)."""
    per_target = _MAPS.setdefault(tokenizer, weakref.WeakKeyDictionary())
    key = (len(tokenizer), len(draft_tokenizer))
    cached = per_target.get(draft_tokenizer)
    if cached is None or cached[0] != key:
        target_texts, draft_texts = token_texts(tokenizer), token_texts(draft_tokenizer)
        pairs = sorted((index, draft_texts[text]) for text, index in target_texts.items() if text in draft_texts)
        if not pairs:
            raise ValueError("`tokenizer` and `assistant_tokenizer` share no token text: the draft could never "
                             "propose a token the target can emit.")
        cached = (key, torch.tensor([t for t, _ in pairs]), torch.tensor([d for _, d in pairs]))
        per_target[draft_tokenizer] = cached
    return cached[1], cached[2]


def _below(ids: list[int], vocab_size: int) -> list[int]:
    """``ids`` up to the first one the target's logits do not cover (a tokenizer's added token past them)."""
    return next((ids[:i] for i, index in enumerate(ids) if index >= vocab_size), ids)


def to_target_space(logits: torch.Tensor, target_ids: torch.Tensor, draft_ids: torch.Tensor,
                    vocab_size: int) -> torch.Tensor:
    """Draft logits ``[active, draft vocab]`` -> ``[active, vocab_size]``: each shared token's logit at its target id,
    ``-inf`` at every other target id."""
    scores = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return scores.index_copy_(1, target_ids, logits.index_select(1, draft_ids))


class CrossTokenizerDrafter(Drafter):
    """Drafts with a model whose tokenizer differs from the target's (see the module docstring); ``matching`` is one
    of `MATCHINGS`. Its proposals count the draft tokens its first pass caught up on beyond one
    (`Proposal.num_catch_up_tokens`), which auto k prices as a draft model's."""

    reports_catch_up = True

    def __init__(self, model: PreTrainedModel, tokenizer: Any, draft_tokenizer: Any, matching: str = "auto"):
        if matching not in MATCHINGS:
            raise ValueError(f"`matching` must be one of {MATCHINGS}, but is {matching!r}.")
        self.model, self.tokenizer, self.draft_tokenizer, self.matching = model, tokenizer, draft_tokenizer, matching
        target_ids, draft_ids = vocabulary_map(tokenizer, draft_tokenizer)
        device = model.device
        self.target_ids, self.draft_ids = target_ids.to(device), draft_ids.to(device)
        self.fallback = next((index for index in (draft_tokenizer.unk_token_id, draft_tokenizer.eos_token_id)
                              if index is not None), 0)  # a target id outside the map (a forced token); empty text
        size = int(target_ids.max()) + 1
        self.to_draft = torch.full((max(size, len(tokenizer)),), self.fallback, device=device)  # target id -> draft id
        self.to_draft[self.target_ids] = self.draft_ids
        self.table = position_table(model)  # learned positions (GPT-2's 1024), or None
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.ids = self.mask = None  # [active, columns] the draft's own grid, once the first round made it
        self.fed: list[list[int]] = []  # per active row: the draft ids its cache holds, in order
        self.columns: list[list[int]] = []  # per active row: the grid column of each of them

    def condition(self, conditioning, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor | None) -> None:
        if reads_encoder_outputs(self.model) or conditioning.prompt_inputs_for(self.model):
            raise ValueError(f"`assistant_model` ({type(self.model).__name__}) reads an encoder's outputs or the "
                             "prompt's images, which a draft of another tokenizer cannot be handed (its tokens are "
                             "other tokens); use a draft that shares the target's tokenizer.")

    def propose(self, batch: RaggedBatch, num_draft_tokens: int, context: DraftContext) -> Proposal:
        wanted = self._draft_tokens(batch)
        longest = max(map(len, wanted)) + num_draft_tokens - 1  # positions the draft reads this round
        if self.table is not None and longest > self.table:
            raise ValueError(f"`assistant_model` has a table of {self.table} learned positions, but its tokenizer "
                             f"turns a row into {longest - num_draft_tokens + 1} tokens and this round drafts "
                             f"{num_draft_tokens} more; lower `max_new_tokens` or use a draft with a longer context "
                             "(generate() checks the target's token count up front; the draft's own is known only "
                             "once its tokenizer has read the text).")
        self._catch_up(wanted)
        num_catch_up = max(0, self.ids.shape[1] - cache_length(self.cache) - 1) if num_draft_tokens else 0
        if self.matching == "string" or (self.matching == "auto" and not context.do_sample):
            return self._propose_text(batch, num_draft_tokens, context, num_catch_up)
        draft_ids = batch.model_ids.new_empty((batch.num_active, 0))  # target ids
        probs = []
        is_invalid = torch.zeros(2, dtype=torch.bool, device=draft_ids.device)
        for i in range(num_draft_tokens):
            logits, _ = forward_missing(self.model, self.cache, self.ids, self.mask, num_logits=1)
            scores = to_target_space(logits[:, 0], self.target_ids, self.draft_ids, context.vocab_size)
            next_ids, step_probs, step_invalid = draw_next(scores, batch, draft_ids, context)
            is_invalid |= step_invalid
            probs += [step_probs] if context.do_sample else []
            draft_ids = torch.cat([draft_ids, next_ids.unsqueeze(1)], dim=1)
            if is_unconfident(step_probs, next_ids, context):
                break
            if i + 1 < num_draft_tokens:  # the next step reads it
                ids = next_ids.to(self.to_draft.device)  # an id past the table (embedding padding): the fallback
                known = ids < len(self.to_draft)
                fed = torch.where(known, self.to_draft[ids.clamp(max=len(self.to_draft) - 1)], self.fallback)
                self._append([[index] for index in fed.tolist()])
        return Proposal(draft_ids, stack_laws(probs, draft_ids, context), is_invalid,
                        num_model_steps=draft_ids.shape[1], num_catch_up_tokens=num_catch_up)

    def _propose_text(self, batch: RaggedBatch, num_draft_tokens: int, context: DraftContext,
                      num_catch_up: int) -> Proposal:
        """String-level matching: the draft's greedy text, tokenized by the target's tokenizer, as point masses."""
        own = []  # per step: [active] the draft's own ids
        is_invalid = torch.zeros(2, dtype=torch.bool, device=batch.model_ids.device)
        for i in range(num_draft_tokens):
            logits, _ = forward_missing(self.model, self.cache, self.ids, self.mask, num_logits=1)
            step = logits[:, 0]  # [active, draft vocab]
            is_invalid[0] |= has_invalid_values(step)
            own.append(step.argmax(dim=-1))
            if context.stop_below is not None and bool((step.softmax(-1).amax(-1) < context.stop_below).all()):
                break  # the draft's own confidence (transformers' assistant_confidence_threshold)
            if i + 1 < num_draft_tokens:  # the next step reads it
                self._append([[index] for index in own[-1].tolist()])
        texts = self.draft_tokenizer.batch_decode(torch.stack(own, dim=1).tolist() if own else [[]] * batch.num_active,
                                                  skip_special_tokens=True, clean_up_tokenization_spaces=False)
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        candidates = [torch.tensor(_below(ids[:num_draft_tokens], context.vocab_size), dtype=torch.long)
                      for ids in encoded]
        proposal = point_mass_proposal(candidates, batch, context)
        return Proposal(proposal.draft_ids, proposal.draft_probs, is_invalid, num_model_steps=len(own),
                        num_catch_up_tokens=num_catch_up)

    def _draft_tokens(self, batch: RaggedBatch) -> list[list[int]]:
        """Every active row's committed text, tokenized by the draft's tokenizer."""
        ids = batch.model_ids.tolist()
        mask = None if batch.model_mask is None else batch.model_mask.tolist()
        rows = [[t for j, t in enumerate(row) if mask is None or mask[b][j]] for b, row in enumerate(ids)]
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        encoded = self.draft_tokenizer(texts, add_special_tokens=True)["input_ids"]
        return [tokens or [self.fallback] for tokens in encoded]

    def _catch_up(self, wanted: list[list[int]]) -> None:
        """Keep each row's longest prefix of ``wanted`` the draft already read (never its last token: the next
        step reads that token's logits), mask the rest out, append the new tokens."""
        new = []
        for row, tokens in enumerate(wanted):
            fed = self.fed[row] if self.fed else []
            kept = 0
            while kept < min(len(fed), len(tokens) - 1) and fed[kept] == tokens[kept]:
                kept += 1
            if self.fed:
                for column in self.columns[row][kept:]:
                    self.mask[row, column] = 0  # a hole: read before, not part of the text now
                del self.fed[row][kept:], self.columns[row][kept:]
            new.append(tokens[kept:])
        if not self.fed:
            self.fed, self.columns = [[] for _ in wanted], [[] for _ in wanted]
        self._drop_trailing_holes()
        self._append(new)

    def _append(self, new: list[list[int]]) -> None:
        """Append each row's ``new`` draft ids in one block of columns, right-aligned (holes before shorter rows)."""
        width = max(map(len, new))
        start = 0 if self.ids is None else self.ids.shape[1]
        block = torch.zeros((len(new), width), dtype=torch.long)
        block_mask = torch.zeros_like(block)
        for row, tokens in enumerate(new):
            offset = width - len(tokens)
            block[row, offset:] = torch.tensor(tokens, dtype=torch.long)
            block_mask[row, offset:] = 1
            self.fed[row] += tokens
            self.columns[row] += range(start + offset, start + width)
        block, block_mask = block.to(self.model.device), block_mask.to(self.model.device)
        self.ids = block if self.ids is None else torch.cat([self.ids, block], dim=1)
        self.mask = block_mask if self.mask is None else torch.cat([self.mask, block_mask], dim=1)

    def _drop_trailing_holes(self) -> None:
        """Crop the columns past the last one any row still reads (a batch of one: every rejected draft)."""
        if self.mask is None:
            return
        alive = self.mask.any(dim=0).nonzero()
        width = int(alive[-1]) + 1 if alive.numel() else 0
        if width < self.ids.shape[1]:
            crop_to(self.cache, width)
            self.ids, self.mask = self.ids[:, :width], self.mask[:, :width]

    def roll_back(self, num_cached: int, staying_rows: torch.Tensor | None) -> None:
        """Only finished rows matter here (the next round's `_catch_up` finds what the target kept)."""
        if staying_rows is None or self.ids is None:
            return
        select_rows(self.cache, staying_rows)
        rows = staying_rows.to(self.ids.device)
        self.ids, self.mask = self.ids.index_select(0, rows), self.mask.index_select(0, rows)
        kept = staying_rows.tolist()
        self.fed, self.columns = [self.fed[row] for row in kept], [self.columns[row] for row in kept]

    def check(self, target: PreTrainedModel, max_length: int) -> None:
        check_draft_model(self.model, target, max_length, shares_tokenizer=False)
        if is_rewired_by_universal_assisted_generation(self.model):
            raise ValueError("`assistant_model`'s embeddings were replaced by transformers' universal assisted "
                             "generation (sampling with another tokenizer prunes the draft's output layer and remaps "
                             "its input ids, in place, for good); load the draft again for hf_spec.")

    @property
    def cost_key(self) -> PreTrainedModel:
        return self.model

    def measure_passes(self, prefix_ids: torch.Tensor, widths: list[int], repeats: int) -> dict[int, float]:
        vocab = self.model.get_input_embeddings().num_embeddings
        return forward_seconds(self.model, prefix_ids.clamp(max=vocab - 1).to(self.model.device), widths, repeats)
