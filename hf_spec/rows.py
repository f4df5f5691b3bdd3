"""The rows of a batch, which advance by different numbers of tokens each round.

The batch is kept in two views:

- **What the models see** (``model_ids``, ``model_mask`` and both caches): the rows still generating, in one
  rectangle whose columns are cache positions.
- **What processors and stopping criteria see** (``row_ids``, ``lengths``): every row of the batch, in the caller's
  order, as target-only decoding would show it: the (left-padded) prompt, the row's own generated tokens, padding.

Holes, and why: after a round in which row b accepted n_b drafted tokens and the most-accepting row N, both caches
are cropped (``DynamicCache.crop``, the only way a cache is shortened) to the block's first N positions for every
row. Row b's positions n_b .. N - 1 then hold rejected tokens: they become holes, masked out (attention mask 0, pad
id) and never attended to again, and every row's next token goes into one new column. Position ids follow the
attention mask, so holes shift nothing. The cost: each round leaves N - n_b dead positions in row b's caches (memory,
and attention work over them); nothing accepted is recomputed, and the rectangle stays aligned, so one forward pass
serves every row. The alternative, shifting each row's cache to re-align it, would rewrite every layer's keys and
values every round. Rows that finish leave the rectangle (``DynamicCache.batch_select_indices``) and cost no further
forward work; they keep their place in the processors' view (padded), so processors that hold per-row state (e.g.
the repetition penalty's ``prompt_ignore_length``) always see the batch they were built for.

Two kinds of cache layer constrain the holes (`hf_spec.caches.ColumnRules`): with a sliding window, each round moves
a row's new holes to the left of its last ``window`` columns (`commit`), so that the window holds the row's own
tokens as in target-only decoding; with recurrent states, no hole may be made at all, so every row keeps as many
drafts as the row that accepted fewest (`usable_counts`). Any prefix of the acceptance rule's output has the target's
law (each kept token is the rule's token at that position, which is distributed as p given the tokens before it),
so keeping fewer tokens than the rule accepted stays exact; it only costs acceptance.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import StoppingCriteriaList

from hf_spec.caches import ColumnRules
from logits_processors.chain import rows_by_length


@dataclasses.dataclass(frozen=True)
class Rollback:
    """What the caches do after a round (`hf_spec.rounds.Rounds.roll_back`), in this order."""

    num_cached: int  # 2. crop to this many columns: every model-view column but the last
    staying_rows: torch.Tensor | None  # 3. keep these rows (indices into the rows the caches held); None: every row
    moved: tuple[int, torch.Tensor] | None = None  # 1. (first, order [rows held, n]): `hf_spec.caches.move_columns`


@dataclasses.dataclass
class RaggedBatch:
    """Both views of a batch between rounds (see the module docstring)."""

    row_ids: torch.Tensor  # [batch, width]: prompt + generated tokens, then pad; width = max(lengths)
    lengths: list[int]  # [batch]: the real length of each row
    active_rows: torch.Tensor  # [active] int64: rows still generating, as indices into the batch
    active_list: list[int]  # the same on the host, so that bookkeeping never waits for the device
    model_ids: torch.Tensor  # [active, columns]: the last column is every active row's newest token
    model_mask: torch.Tensor | None  # [active, columns]; None only for one row without padding (no holes ever)
    pad_token_id: int
    rules: ColumnRules = dataclasses.field(default_factory=ColumnRules)  # what the caches ask of the holes

    @classmethod
    def start(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id: int,
              rules: ColumnRules | None = None) -> RaggedBatch:
        batch_size, prompt_length = input_ids.shape
        if attention_mask is None and batch_size > 1:
            attention_mask = torch.ones_like(input_ids)
        return cls(
            row_ids=input_ids, lengths=[prompt_length] * batch_size,
            active_rows=torch.arange(batch_size, device=input_ids.device), active_list=list(range(batch_size)),
            model_ids=input_ids, model_mask=attention_mask, pad_token_id=pad_token_id, rules=rules or ColumnRules(),
        )

    @property
    def batch_size(self) -> int:
        return self.row_ids.shape[0]

    @property
    def num_active(self) -> int:
        return self.active_rows.shape[0]

    def active_lengths(self) -> list[int]:
        return [self.lengths[row] for row in self.active_list]

    def to_batch(self, values: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """``[active, ...]`` -> ``[batch, ...]``, finished rows filled with ``fill``."""
        if self.num_active == self.batch_size:
            return values
        full = values.new_full((self.batch_size, *values.shape[1:]), fill)
        return full.index_copy_(0, self.active_rows, values)

    def to_active(self, values: torch.Tensor) -> torch.Tensor:
        """``[batch, ...]`` -> ``[active, ...]``."""
        return values if self.num_active == self.batch_size else values.index_select(0, self.active_rows)

    def row_view(self, new_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row followed by its active row's ``new_ids`` ``[active, m]`` (finished rows get nothing).

        Returns:
            ``[batch, width + m]`` ids, right-padded, and ``[batch]`` int64 lengths of the rows with ``new_ids``.
        """
        lengths = torch.tensor(self.lengths, device=self.row_ids.device)  # [batch]
        num_new = new_ids.shape[1]
        row_ids = F.pad(self.row_ids, (0, num_new), value=self.pad_token_id)
        if num_new > 0:
            columns = lengths[self.active_rows, None] + torch.arange(num_new, device=lengths.device)  # [active, m]
            row_ids[self.active_rows[:, None], columns] = new_ids
            lengths[self.active_rows] += num_new
        return row_ids, lengths

    def usable_counts(self, num_accepted: list[int]) -> list[int]:
        """The accepted drafts each active row keeps: all of them, or, where the caches cannot hold holes, as many as
        the row that accepted fewest (the module docstring: exact)."""
        if self.rules.allows_holes:
            return num_accepted
        return [min(num_accepted)] * len(num_accepted)

    def count_until_stop(
        self, stopping_criteria: StoppingCriteriaList, output_ids: torch.Tensor, num_candidates: list[int]
    ) -> tuple[list[int], list[bool]]:
        """How many of each active row's ``num_candidates`` new tokens to keep, and whether the row is done.

        The criteria are asked after each new token in turn, with the row as target-only decoding would have it, so
        an EOS, stop string, length limit or custom criterion met inside a block cuts that row right there. Rows of
        equal length share one call; all answers are gathered before one host synchronization.

        Args:
            output_ids: ``[active, k + 1]`` each active row's new tokens (``num_candidates[a]`` of them valid).
        """
        candidate_ids, _ = self.row_view(output_ids)
        active_lengths = self.active_lengths()
        answers = []  # (active row indices, j, [rows] bool)
        for j in range(1, max(num_candidates) + 1):
            rows = [a for a in range(self.num_active) if j <= num_candidates[a]]
            by_length = rows_by_length([active_lengths[a] + j for a in rows])
            for length, members in by_length.items():
                active_index = [rows[m] for m in members]
                batch_index = self.active_rows[active_index]
                is_done = stopping_criteria(candidate_ids[batch_index, :length], None)  # [len(members)]
                answers.append((active_index, j, is_done))
        flags = iter(torch.cat([is_done.view(-1) for _, _, is_done in answers]).tolist())  # the synchronization
        first_done: list[int | None] = [None] * self.num_active  # per active row: the first j that met a criterion
        for active_index, j, _ in answers:  # in increasing j
            for a in active_index:
                if next(flags) and first_done[a] is None:
                    first_done[a] = j
        num_kept = [num_candidates[a] if j is None else j for a, j in enumerate(first_done)]
        return num_kept, [j is not None for j in first_done]

    def commit(
        self, output_ids: torch.Tensor, num_accepted: list[int], num_kept: list[int], is_done: list[bool]
    ) -> Rollback:
        """Append each active row's kept tokens to both views; drop rows that are done from the model view.

        Args:
            output_ids: ``[active, k + 1]`` accepted drafts, then the recovered or bonus token.
            num_accepted: per active row, accepted draft tokens.
            num_kept: per active row, new tokens kept (``num_accepted + 1`` unless a stopping criterion cut it).
            is_done: per active row, whether it has finished.

        Returns:
            What the caches do: the rows' columns that moved (with a sliding window), the number of positions to crop
            them to (every model-view column but the last), and the active rows (indices into the previous active
            set) that stay, ``None`` when all do (or none).
        """
        # 1. Processors' view: every row gets its kept tokens.
        new_lengths = list(self.lengths)
        for a, row in enumerate(self.active_list):
            new_lengths[row] += num_kept[a]
        width = max(new_lengths)
        row_ids, _ = self.row_view(output_ids[:, : max(num_kept)])
        self.row_ids = row_ids[:, :width]
        positions = torch.arange(width, device=row_ids.device)
        self.row_ids = self.row_ids.masked_fill(
            positions >= torch.tensor(new_lengths, device=row_ids.device)[:, None], self.pad_token_id
        )
        self.lengths = new_lengths

        # 2. Models' view: continuing rows, holes where a row accepted fewer tokens than the most-accepting one.
        staying = [a for a in range(self.num_active) if not is_done[a]]
        if not staying:  # the last round: every row's kept tokens, holes after a row's last one
            self._append_columns(output_ids, num_kept, None)
            self.active_rows, self.active_list = self.active_rows[:0], []
            return Rollback(self.model_ids.shape[1] - 1, None)
        num_held = self.num_active
        keep = None if len(staying) == self.num_active else torch.tensor(staying, device=output_ids.device)
        if keep is not None:
            output_ids, self.model_ids = output_ids[keep], self.model_ids[keep]
            self.model_mask = None if self.model_mask is None else self.model_mask[keep]
            self.active_rows = self.active_rows[keep]
            self.active_list = [self.active_list[a] for a in staying]
        accepted = [num_accepted[a] for a in staying]
        last = output_ids.gather(1, torch.tensor(accepted, device=output_ids.device)[:, None])  # [active, 1]
        self._append_columns(output_ids, accepted, last)
        moved = None
        if self.rules.window is not None and min(accepted) < max(accepted):  # new holes
            moved = self._move_holes_left(self.rules.window + max(accepted), keep, num_held)
        return Rollback(self.model_ids.shape[1] - 1, keep, moved)

    def _move_holes_left(self, num_columns: int, keep: torch.Tensor | None,
                         num_held: int) -> tuple[int, torch.Tensor]:
        """Move each active row's holes among its last ``num_columns`` cached columns to their left, keeping the order
        of its tokens (positions follow the mask: none changes); returns ``(first, order)`` for the caches, whose
        rows are the ``num_held`` before ``keep`` (the rows that leave keep their columns).

        With ``num_columns`` = window + the round's new columns, the region holds the row's previous ``window - 1``
        columns (its own tokens, by this same move a round earlier) and every column this round added, so afterwards
        the row's last ``window`` columns are its own last tokens, as the layers' masks and crops expect.
        """
        end = self.model_ids.shape[1] - 1  # the last column (every row's newest token) is not cached, never moved
        first = max(0, end - num_columns)
        order = torch.argsort(self.model_mask[:, first:end], dim=1, stable=True)  # [active, n]: holes first
        self.model_ids[:, first:end] = self.model_ids[:, first:end].gather(1, order)
        self.model_mask[:, first:end] = self.model_mask[:, first:end].gather(1, order)
        if keep is not None:  # the caches still hold the rows that leave: they keep their columns
            held = torch.arange(end - first, device=order.device).repeat(num_held, 1)  # [held, n]
            order = held.index_copy_(0, keep, order)
        return first, order

    def _append_columns(self, output_ids: torch.Tensor, counts: list[int], last: torch.Tensor | None) -> None:
        """Append ``counts[a]`` tokens of ``output_ids`` ``[active, k + 1]`` per row, holes up to the longest, then
        ``last`` ``[active, 1]`` (every row's newest token, one shared column) when given."""
        columns = self.model_ids.shape[1]
        most = max(counts)
        counts_tensor = torch.tensor(counts, device=output_ids.device)  # [active]
        is_kept = torch.arange(most, device=output_ids.device) < counts_tensor[:, None]  # [active, most]
        new_ids = [output_ids[:, :most].masked_fill(~is_kept, self.pad_token_id)]
        new_mask = [is_kept.long()]
        if last is not None:
            new_ids.append(last)
            new_mask.append(torch.ones_like(last))
        self.model_ids = torch.cat([self.model_ids, *new_ids], dim=1)
        if self.model_mask is not None or min(counts) < most:
            mask = self.model_mask if self.model_mask is not None else torch.ones_like(self.model_ids[:, :columns])
            self.model_mask = torch.cat([mask, *(m.to(mask.dtype) for m in new_mask)], dim=1)
