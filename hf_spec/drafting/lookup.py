"""Drafts at no model cost: prompt lookup (n-gram matching), and lookup first with a draft model after.

- `PromptLookupDrafter`: q is a point mass on the token that followed the longest earlier occurrence of the row's
  last n-gram (prompt or output). So x is accepted with probability p(x), and a rejection is resampled from p
  without x, renormalized. Rows of a batch whose match is shorter than the round's block are filled with a repeat of
  their last candidate: also a point mass fixed by the prefix, so also exact (it is simply less likely accepted).
- `LookupThenModel`: prompt lookup when every active row has a match, else the draft model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_spec.caches import ColumnRules
from hf_spec.checks import check_int
from hf_spec.drafting.base import DraftContext, Drafter, Proposal
from hf_spec.drafting.model import ModelDrafter
from hf_spec.rows import RaggedBatch


class PromptLookupDrafter(Drafter):
    """Copies the tokens that followed the latest earlier occurrence of a row's last n-gram (longest n first).

    Args:
        max_ngram_size: longest suffix n-gram to look for.
        min_ngram_size: shortest; no match of at least this length means no proposal for the row.
    """

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 1):
        self.max_ngram_size = check_int("max_ngram_size", max_ngram_size)
        self.min_ngram_size = check_int("min_ngram_size", min_ngram_size)
        if min_ngram_size > max_ngram_size:
            raise ValueError(f"`min_ngram_size` ({min_ngram_size}) must not exceed `max_ngram_size` "
                             f"({max_ngram_size}).")

    def candidates(self, batch: RaggedBatch, num_draft_tokens: int) -> list[torch.Tensor]:
        """Per active row, its lookup continuation ``[m]``, 0 <= m <= num_draft_tokens."""
        return [
            lookup_continuation(batch.row_ids[row, : batch.lengths[row]], self.max_ngram_size, self.min_ngram_size,
                                num_draft_tokens)
            for row in batch.active_list
        ]

    def propose(self, batch: RaggedBatch, num_draft_tokens: int, context: DraftContext) -> Proposal:
        return point_mass_proposal(self.candidates(batch, num_draft_tokens), batch, context)


class LookupThenModel(Drafter):
    """Prompt lookup when every active row finds a match, the draft model otherwise."""

    reports_catch_up = True  # the draft model's rounds do

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter):
        self.lookup, self.model = lookup, model

    def propose(self, batch: RaggedBatch, num_draft_tokens: int, context: DraftContext) -> Proposal:
        candidates = self.lookup.candidates(batch, num_draft_tokens)
        if num_draft_tokens > 0 and all(len(c) > 0 for c in candidates):
            return point_mass_proposal(candidates, batch, context)
        return self.model.propose(batch, num_draft_tokens, context)

    def match_cache(self, static_length: int | None) -> None:
        self.model.match_cache(static_length)

    def reset(self) -> None:
        self.model.reset()

    def condition(self, conditioning, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor | None) -> None:
        self.model.condition(conditioning, prompt_ids, prompt_mask)

    def roll_back(self, num_cached: int, staying_rows: torch.Tensor | None) -> None:
        self.model.roll_back(num_cached, staying_rows)  # its cache may lag behind: it catches up when next used

    def column_rules(self) -> ColumnRules:
        return self.model.column_rules()

    def move_columns(self, first: int, order: torch.Tensor) -> None:
        self.model.move_columns(first, order)

    def check(self, target, max_length: int) -> None:
        self.model.check(target, max_length)

    @property
    def cost_key(self):
        return self.model.cost_key

    def measure_passes(self, prefix_ids: torch.Tensor, widths: list[int], repeats: int) -> dict[int, float]:
        return self.model.measure_passes(prefix_ids, widths, repeats)


def lookup_continuation(ids: torch.Tensor, max_ngram_size: int, min_ngram_size: int,
                        num_draft_tokens: int) -> torch.Tensor:
    """The up to ``num_draft_tokens`` ids that followed the latest earlier occurrence of ``ids``' last n-gram.

    Args:
        ids: ``[length]`` one row's tokens so far.

    Returns:
        ``[m]`` ids, empty when no n-gram of ``min_ngram_size`` or more recurs (or ``num_draft_tokens`` is 0).
    """
    length = ids.shape[0]
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        windows = ids[: length - 1].unfold(0, n, 1)  # [length - n, n]: every n-gram that has a next token
        is_match = (windows == ids[length - n:]).all(dim=1)  # [length - n]
        starts = is_match.nonzero()
        if starts.numel() > 0 and num_draft_tokens > 0:
            follow = int(starts[-1]) + n
            return ids[follow: follow + num_draft_tokens]
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
    return Proposal(draft_ids, draft_probs, torch.zeros(2, dtype=torch.bool, device=device), num_model_steps=0)
