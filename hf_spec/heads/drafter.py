"""`HeadDrafter`: q is a draft head's processed law, the head reading the target's hidden states from the verify pass.

Columns are the loop's model view (`hf_spec.rows.RaggedBatch`): left padding, and masked holes where a row rejected
drafts that other rows kept; each row's newest token is in the last column. The head's cache holds one entry per
column c from ``first_entry`` on: the pair (f, x_c) of the target's feature f at the row's previous real column and
the token of column c (masked where c is a hole, or the row's first token). State between rounds:

- ``features``: the target's features of columns ``features_start ..`` that the head has not read yet (the verify
  pass hands them over through `observe`; rejected drafts' columns are dropped by `roll_back`);
- the head's cache and ``entry_mask``: the entries read with the target's features first (``num_true``), then,
  after drafting, entries read with the head's own predicted features; `roll_back` keeps only the first kind.

Round 1 drafts nothing: no target feature exists before the target's first pass (the prefill). Then each round
reads the entries it lacks in one head pass (whose last output gives the first draft token), and one head pass per
further draft token. The law each token is drawn from is returned, as for any drafter, so the output law is exactly
the target's whatever the head predicts.

`HeadTreeDrafter` grows a tree instead (`hf_spec.drafting.branching`): each level is one head pass over the
expanded nodes under a tree attention mask, each node paired with the head's own h at its parent. Its entries are
dropped like a chain's drafts: the accepted path's tokens are read again next round with the target's features,
which the tree's verify pass hands over for the path's nodes.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from transformers import PreTrainedModel

from hf_spec.caches import cache_length, crop_to, select_rows
from hf_spec.drafting.base import DraftContext, Drafter, Proposal, draw_next, is_unconfident, stack_laws
from hf_spec.drafting.branching import BranchingTreeDrafter, visibility
from hf_spec.forward import extend_mask
from hf_spec.rows import RaggedBatch
from hf_spec.timing.probe import synchronize


class HeadDrafter(Drafter):
    """Drafts with a draft head (`hf_spec.heads.base.DraftHeadBase`) from the target's hidden states
    (``generate(assistant_model=head)`` builds it)."""

    def __init__(self, head):
        self.head = head  # a `hf_spec.heads.base.DraftHeadBase`
        self.reset()

    @property
    def feature_layers(self) -> list[int]:
        """The target hidden states the head reads: known once `check` has attached it (a reference EAGLE-3
        checkpoint names none until then)."""
        return list(self.head.config.feature_layers)

    def check(self, target: PreTrainedModel, max_length: int) -> None:
        """The head must be on the target's device and built for it; it then reads what it takes from the target
        (`hf_spec.heads.base.DraftHeadBase.attach`), once per target."""
        if self.head.device != target.device:
            raise ValueError(f"`assistant_model` (a draft head) is on {self.head.device} but the model is on "
                             f"{target.device}; move it with `head.to({str(target.device)!r})`.")
        if not self.head.is_attached_to(target):
            self.head.attach(target)

    @property
    def cost_key(self):
        return self.head

    @torch.no_grad()
    def measure_passes(self, prefix_ids: torch.Tensor, widths: list[int], repeats: int) -> dict[int, float]:
        """Median seconds of a head step (tokens fed with the head's own predicted features) on top of a cached
        ``prefix_ids`` ``[1, S]`` read with (zero) target features."""
        head, prefix_ids = self.head, prefix_ids.to(self.head.device)
        cache = head.new_cache()
        width = head.config.target_hidden_size * len(head.config.feature_layers)
        features = torch.zeros((*prefix_ids.shape, width), dtype=head.dtype, device=prefix_ids.device)
        predicted = head(prefix_ids, features=features, cache=cache, logits_to_keep=1).hidden_states[:, -1:]
        prefix, seconds = cache_length(cache), {size: [] for size in widths}
        for _ in range(repeats):
            for size in widths:
                synchronize(head.device)
                started = time.perf_counter()
                head(prefix_ids[:, -1:].expand(-1, size), predicted=predicted.expand(-1, size, -1), cache=cache,
                     logits_to_keep=size)
                synchronize(head.device)
                seconds[size].append(time.perf_counter() - started)
                crop_to(cache, prefix)
        return {size: float(np.median(values)) for size, values in seconds.items()}

    def reset(self) -> None:
        self.cache = self.head.new_cache()
        self.features: torch.Tensor | None = None  # [active, unread, F]
        self.features_start = 0  # the column of features[:, 0]
        self.first_entry = 0  # the column of the head cache's first entry
        self.entry_mask: torch.Tensor | None = None  # [active, entries] 1 where an entry is a real pair
        self.num_true = 0  # head cache entries read with the target's features

    def observe(self, features: torch.Tensor, start: int) -> None:
        if self.features is None:  # the first pass: entries start after its first column
            self.features, self.features_start, self.first_entry = features, start, start + 1
            return
        end = self.features_start + self.features.shape[1]
        if not self.features_start <= start <= end:
            raise RuntimeError(f"target features from column {start}, but the head holds columns "
                               f"{self.features_start} to {end}")
        self.features = torch.cat([self.features[:, : start - self.features_start], features], dim=1)

    def propose(self, batch: RaggedBatch, num_draft_tokens: int, context: DraftContext) -> Proposal:
        model_ids = batch.model_ids
        draft_ids = model_ids.new_empty((batch.num_active, 0))
        is_invalid = torch.zeros(2, dtype=torch.bool, device=model_ids.device)  # [raw logits, processed scores]
        if self.features is None or num_draft_tokens == 0:  # round 1: the target has not run yet
            return Proposal(draft_ids, stack_laws([], draft_ids, context), is_invalid, num_model_steps=0)
        real = (torch.ones_like(model_ids, dtype=torch.bool) if batch.model_mask is None
                else batch.model_mask.bool())  # [active, columns]
        positions = real.long().cumsum(-1) - 1  # [active, columns]
        # 1. Read the entries the head lacks, columns read .. columns - 1, with the target's features.
        output = self._read_entries(model_ids, real, positions)
        # 2. Draw a token from each output; feed it back with the head's own h as its feature.
        probs = []
        for i in range(num_draft_tokens):
            next_ids, step_probs, step_invalid = draw_next(output.logits[:, -1].float(), batch, draft_ids, context)
            is_invalid |= step_invalid
            probs += [step_probs] if context.do_sample else []
            draft_ids = torch.cat([draft_ids, next_ids.unsqueeze(1)], dim=1)
            if is_unconfident(step_probs, next_ids, context):
                break
            if i + 1 < num_draft_tokens:  # the entry of column columns + i: (h, the token just drawn)
                output = self.head(
                    next_ids.unsqueeze(1), predicted=output.hidden_states[:, -1:],
                    position_ids=positions[:, -1:] + i, attention_mask=extend_mask(self.entry_mask, i + 1),
                    cache=self.cache, logits_to_keep=1,
                )
        return Proposal(draft_ids, stack_laws(probs, draft_ids, context), is_invalid,
                        num_model_steps=draft_ids.shape[1])

    def _read_entries(self, model_ids: torch.Tensor, real: torch.Tensor, positions: torch.Tensor):
        """One head pass over the entries of columns ``read .. columns - 1``; each pairs the column's token with the
        target's feature at the row's previous real column (``real`` [active, columns] marks real columns)."""
        num_columns, start = model_ids.shape[1], self.features_start
        read = self.first_entry + cache_length(self.cache)
        window = torch.arange(start, num_columns, device=model_ids.device)  # [columns - start]
        last_real = torch.where(real[:, start:], window, -1).cummax(dim=1).values  # last real column <= each one
        previous = last_real[:, read - 1 - start: num_columns - 1 - start]  # [active, m], -1: no earlier token
        features = self.features.gather(
            1, (previous - start).clamp_min(0).unsqueeze(-1).expand(-1, -1, self.features.shape[-1]))  # [active, m, F]
        new_mask = (real[:, read:] & (previous >= 0)).long()  # [active, m]
        self.entry_mask = new_mask if self.entry_mask is None else torch.cat([self.entry_mask, new_mask], dim=1)
        output = self.head(model_ids[:, read:], features=features, attention_mask=self.entry_mask,
                           position_ids=(positions[:, read:] - 1).clamp_min(0), cache=self.cache, logits_to_keep=1)
        self.num_true = num_columns - self.first_entry
        self.features = self.features[:, num_columns - 1 - start:]  # read: keep the last column's on
        self.features_start = num_columns - 1
        return output

    def roll_back(self, num_cached: int, staying_rows: torch.Tensor | None) -> None:
        if staying_rows is not None:
            select_rows(self.cache, staying_rows)
            if self.features is not None:
                self.features = self.features[staying_rows]
            if self.entry_mask is not None:
                self.entry_mask = self.entry_mask[staying_rows]
        if self.entry_mask is not None:  # entries of committed columns (<= num_cached) read with true features
            kept = max(0, min(self.num_true, num_cached + 1 - self.first_entry))
            crop_to(self.cache, kept)
            self.entry_mask = self.entry_mask[:, :kept]
        if self.features is not None:  # features of drafts that were not kept are not the target's
            self.features = self.features[:, : max(0, num_cached - self.features_start)]


class HeadTreeDrafter(HeadDrafter, BranchingTreeDrafter):
    """A draft head that branches (``generate(assistant_model=head, num_tree_nodes=N)`` builds it).

    Args:
        head: the draft head.
        branching, width, replacement: see `BranchingTreeDrafter`; a head's pass over a few nodes costs about one
            over a single node, so by default it expands the two best nodes of each level.
    """

    def __init__(self, head, branching: int = 2, width: int = 2, replacement: bool = False):
        HeadDrafter.__init__(self, head)
        BranchingTreeDrafter.__init__(self, branching, width, replacement)

    def reset(self) -> None:
        super().reset()
        self._hidden: dict[int, torch.Tensor] = {}  # node (-1: root) -> the head's h after it [hidden]
        self._fed: list[int] = []  # tree nodes in the head's cache, in order, after its num_true entries
        self._root_position = 0  # the position of the last committed column's entry + 1

    def _start_tree(self, batch: RaggedBatch) -> torch.Tensor | None:
        if self.features is None:  # round 1: the target has not run yet
            return None
        real = (torch.ones_like(batch.model_ids, dtype=torch.bool) if batch.model_mask is None
                else batch.model_mask.bool())  # [1, columns]
        positions = real.long().cumsum(-1) - 1  # [1, columns]
        output = self._read_entries(batch.model_ids, real, positions)
        self._hidden, self._fed, self._root_position = {-1: output.hidden_states[0, -1]}, [], int(positions[0, -1])
        return output.logits[0, -1].float()

    def _evaluate_level(self, batch: RaggedBatch, level: list[int], parents: list[int], tokens: list[torch.Tensor],
                        depth: int) -> torch.Tensor:
        device = batch.model_ids.device
        nodes = visibility(parents, self._fed + level).to(device)[len(self._fed):]  # [m, fed + m]
        visible = torch.cat([self.entry_mask[0].bool().expand(len(level), -1), nodes], dim=1)  # [m, entries + ...]
        output = self.head(
            torch.stack([tokens[i] for i in level])[None],
            predicted=torch.stack([self._hidden[parents[i]] for i in level])[None],  # [1, m, hidden]
            position_ids=torch.full((1, len(level)), self._root_position + depth - 1, device=device),
            attention_mask=self.head.custom_mask(visible), cache=self.cache,
        )
        self._fed += level
        self._hidden.update(zip(level, output.hidden_states[0]))
        return output.logits[0].float()  # [m, head vocab]

    def keep_path(self, path: list[int]) -> None:
        """Nothing to keep: entries read with the head's own h are dropped at the rollback (`HeadDrafter`)."""
        self._hidden, self._fed = {}, []
