"""Where draft tokens come from: a draft model, prompt lookup (n-gram matching), or lookup first and a model after.

A drafter proposes up to k tokens for every active row, each drawn from a law q that depends only on the row's
prefix, and returns q. That is all the acceptance rule needs for exactness: `hf_spec.rejection` accepts token x with
probability min(1, p(x) / q(x)) and resamples a rejection from normalize(max(0, p - q)), whatever q is.

- `ModelDrafter`: q is the draft model's processed law (the same processor chain as the target's, per position).
- `PromptLookupDrafter`: q is a point mass on the token that followed the longest earlier occurrence of the row's
  last n-gram (prompt or output). So x is accepted with probability p(x), and a rejection is resampled from p
  without x, renormalized. Rows of a batch whose match is shorter than the round's block are filled with a repeat of
  their last candidate: also a point mass fixed by the prefix, so also exact (it is simply less likely accepted).
- `LookupThenModel`: prompt lookup when every active row has a match, else the draft model.

What drafters do not do: choose k (the loop does, see `hf_spec.draft_length`), or touch the target's cache.
"""

from __future__ import annotations

import abc
import dataclasses

import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList, PreTrainedModel

from hf_spec.caches import crop_to, new_cache, select_rows
from hf_spec.forward import extend_mask, forward_missing, has_invalid_values
from hf_spec.rejection import sample_from_weights
from hf_spec.rows import RaggedBatch
from logits_processors import process_step


@dataclasses.dataclass
class Proposal:
    """What a drafter proposes for one round."""

    draft_ids: torch.Tensor  # [active, k]
    draft_probs: torch.Tensor | None  # [active, k, vocab] the law each token was drawn from; None when greedy
    is_invalid: torch.Tensor  # 0-dim bool: NaN/inf draft logits
    num_model_steps: int  # draft-model forward passes it took (0 for lookup): what the draft-length chooser times

    @property
    def num_draft_tokens(self) -> int:
        return self.draft_ids.shape[1]


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What every drafter needs to know about the call."""

    logits_processor: LogitsProcessorList
    vocab_size: int
    do_sample: bool
    generator: torch.Generator | None


class Drafter(abc.ABC):
    """Proposes draft tokens; keeps whatever state it has consistent with the loop's rollbacks."""

    @abc.abstractmethod
    def propose(self, batch: RaggedBatch, max_tokens: int, context: DraftContext) -> Proposal:
        """Up to ``max_tokens`` tokens for every active row of ``batch`` (the same number for all of them)."""

    def roll_back(self, num_cached: int, staying_rows: torch.Tensor | None) -> None:
        """Keep at most ``num_cached`` positions of state, and only ``staying_rows`` (indices into the active rows)."""


class ModelDrafter(Drafter):
    """Drafts with a model that shares the target's tokenizer, from its own cache (`hf_spec.caches` invariant)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = new_cache(model)

    def propose(self, batch: RaggedBatch, max_tokens: int, context: DraftContext) -> Proposal:
        model_ids = batch.model_ids
        # Ids past the draft's embedding rows (padding rows of a larger target) are only conditioning for the draft:
        # clamping them changes q, which stays the exact law the draft samples from.
        max_draft_id = self.model.get_input_embeddings().num_embeddings - 1
        needs_clamp = max_draft_id < context.vocab_size - 1
        draft_ids = model_ids.new_empty((batch.num_active, 0))
        probs = []
        is_invalid = torch.zeros((), dtype=torch.bool, device=model_ids.device)
        for i in range(max_tokens):
            prefix_ids = torch.cat([model_ids, draft_ids], dim=1)  # [active, columns + i]
            logits = forward_missing(
                self.model, self.cache, prefix_ids.clamp(max=max_draft_id) if needs_clamp else prefix_ids,
                extend_mask(batch.model_mask, i), num_logits=1,
            )
            logits = align_vocab(logits[:, 0], context.vocab_size)  # [active, vocab]
            row_ids, lengths = batch.row_view(draft_ids)
            step_scores = batch.to_active(
                process_step(context.logits_processor, row_ids, batch.to_batch(logits), lengths)
            )  # [active, vocab]
            is_invalid |= has_invalid_values(logits) | has_invalid_values(step_scores)
            if context.do_sample:
                probs.append(step_scores.softmax(dim=-1))
                next_ids = sample_from_weights(probs[-1], context.generator)  # [active]
            else:
                next_ids = step_scores.argmax(dim=-1)  # [active]
            draft_ids = torch.cat([draft_ids, next_ids.unsqueeze(1)], dim=1)
        draft_probs = None
        if context.do_sample:
            draft_probs = (torch.stack(probs, dim=1) if probs
                           else torch.empty((batch.num_active, 0, context.vocab_size), device=draft_ids.device))
        return Proposal(draft_ids, draft_probs, is_invalid, num_model_steps=max_tokens)

    def roll_back(self, num_cached: int, staying_rows: torch.Tensor | None) -> None:
        if staying_rows is not None:
            select_rows(self.cache, staying_rows)
        crop_to(self.cache, num_cached)


class PromptLookupDrafter(Drafter):
    """Copies the tokens that followed the latest earlier occurrence of a row's last n-gram (longest n first).

    Args:
        max_ngram_size: longest suffix n-gram to look for.
        min_ngram_size: shortest; no match of at least this length means no proposal for the row.
    """

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 1):
        for name, value in (("max_ngram_size", max_ngram_size), ("min_ngram_size", min_ngram_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, but is {value!r}.")
        if min_ngram_size > max_ngram_size:
            raise ValueError(f"`min_ngram_size` ({min_ngram_size}) must not exceed `max_ngram_size` ({max_ngram_size}).")
        self.max_ngram_size, self.min_ngram_size = max_ngram_size, min_ngram_size

    def candidates(self, batch: RaggedBatch, max_tokens: int) -> list[torch.Tensor]:
        """Per active row, its lookup continuation ``[m]``, 0 <= m <= max_tokens."""
        return [
            lookup_continuation(batch.row_ids[row, : batch.lengths[row]], self.max_ngram_size, self.min_ngram_size,
                                max_tokens)
            for row in batch.active_rows.tolist()
        ]

    def propose(self, batch: RaggedBatch, max_tokens: int, context: DraftContext) -> Proposal:
        return point_mass_proposal(self.candidates(batch, max_tokens), batch, context)


class LookupThenModel(Drafter):
    """Prompt lookup when every active row finds a match, the draft model otherwise."""

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter):
        self.lookup, self.model = lookup, model

    def propose(self, batch: RaggedBatch, max_tokens: int, context: DraftContext) -> Proposal:
        candidates = self.lookup.candidates(batch, max_tokens)
        if max_tokens > 0 and all(len(c) > 0 for c in candidates):
            return point_mass_proposal(candidates, batch, context)
        return self.model.propose(batch, max_tokens, context)

    def roll_back(self, num_cached: int, staying_rows: torch.Tensor | None) -> None:
        self.model.roll_back(num_cached, staying_rows)  # its cache may lag behind: it catches up when next used


def lookup_continuation(ids: torch.Tensor, max_ngram_size: int, min_ngram_size: int, max_tokens: int) -> torch.Tensor:
    """The up to ``max_tokens`` ids that followed the latest earlier occurrence of ``ids``' last n-gram.

    Args:
        ids: ``[length]`` one row's tokens so far.

    Returns:
        ``[m]`` ids, empty when no n-gram of ``min_ngram_size`` or more recurs (or ``max_tokens`` is 0).
    """
    length = ids.shape[0]
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        windows = ids[: length - 1].unfold(0, n, 1)  # [length - n, n]: every n-gram that has a next token
        is_match = (windows == ids[length - n:]).all(dim=1)  # [length - n]
        starts = is_match.nonzero()
        if starts.numel() > 0 and max_tokens > 0:
            follow = int(starts[-1]) + n
            return ids[follow: follow + max_tokens]
    return ids[:0]


def point_mass_proposal(candidates: list[torch.Tensor], batch: RaggedBatch, context: DraftContext) -> Proposal:
    """Rows' candidates ``[m_a]`` as one block ``[active, max m_a]``; q is a point mass on each token.

    A row with fewer candidates repeats its last one (the pad id when it has none): a token fixed by the prefix.
    """
    k = max(len(c) for c in candidates)
    device = batch.model_ids.device
    filler = torch.tensor([batch.pad_token_id], dtype=batch.model_ids.dtype, device=device)
    draft_ids = torch.stack([
        torch.cat([c.to(device), (c[-1:] if len(c) else filler).expand(k - len(c))]) for c in candidates
    ])  # [active, k]
    draft_probs = F.one_hot(draft_ids, context.vocab_size).float() if context.do_sample else None  # [active, k, V]
    return Proposal(draft_ids, draft_probs, torch.zeros((), dtype=torch.bool, device=device), num_model_steps=0)


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Make draft logits ``[..., draft_vocab]`` as wide as the target's ``vocab_size``.

    Extra draft rows are dropped (the target cannot emit those ids, so proposing them only wastes a round); missing
    rows get ``-inf``, probability 0. Same tokenizer, different embedding-row counts (e.g. padded to a multiple of 64).
    """
    if logits.shape[-1] == vocab_size:
        return logits
    if logits.shape[-1] > vocab_size:
        return logits[..., :vocab_size]
    return F.pad(logits, (0, vocab_size - logits.shape[-1]), value=float("-inf"))
