"""What a speculative call records besides its tokens: per-step scores and logits, the streamer, round timings.

The loop (`hf_spec.decoding`) hands each round's results here and reads nothing back, so its steps stay the
algorithm's: draft, verify, accept, stop, commit and roll back.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer


class OutputRecorder:
    """Scores and raw logits of every emitted token, per row, when ``output_scores`` / ``output_logits`` ask for them;
    and the streamer, which receives every emitted token once, in order (batch of one)."""

    def __init__(self, generation_config: GenerationConfig, batch_size: int, streamer: BaseStreamer | None):
        keeps = generation_config.return_dict_in_generate
        self.is_keeping_scores = bool(keeps and generation_config.output_scores)
        self.is_keeping_logits = bool(keeps and generation_config.output_logits)
        self.streamer = streamer
        self._scores: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]  # per row, one [vocab] per token
        self._logits: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]

    def record(self, active_rows: list[int], output_ids: torch.Tensor, block_scores: torch.Tensor,
               block_logits: torch.Tensor, num_kept: list[int]) -> None:
        """One round's emitted tokens.

        Args:
            active_rows: batch index of each active row.
            output_ids: ``[active, k + 1]``; row a emitted its first ``num_kept[a]``.
            block_scores, block_logits: ``[active, k + 1, vocab]`` processed scores and raw logits of the block.
        """
        if self.streamer is not None:
            self.streamer.put(output_ids[:, : num_kept[0]].cpu())
        for a, row in enumerate(active_rows):
            if self.is_keeping_scores:
                self._scores[row] += list(block_scores[a, : num_kept[a]])
            if self.is_keeping_logits:
                self._logits[row] += list(block_logits[a, : num_kept[a]])

    def finish(self) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
        """``(scores, logits)`` in transformers' layout (``None`` where not asked for); ends the stream."""
        if self.streamer is not None:
            self.streamer.end()
        return (_per_step(self._scores) if self.is_keeping_scores else None,
                _per_step(self._logits) if self.is_keeping_logits else None)


def _per_step(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """transformers' layout: one ``[batch, vocab]`` per generated step; rows already finished hold zeros."""
    num_steps = max(len(row) for row in per_row)
    template = next(row[0] for row in per_row if row)
    return tuple(
        torch.stack([row[step] if step < len(row) else torch.zeros_like(template) for row in per_row])
        for step in range(num_steps)
    )


class RoundTimer:
    """Wall-clock seconds of a round's drafting (draft forward passes and sampling) and verification (the target
    pass and acceptance), and of the whole round.

    Args:
        synchronize: wait for an accelerator's kernels before reading the clock after drafting (the draft-length
            chooser needs the draft's own time); on a CPU the clock is exact anyway.
    """

    def __init__(self, synchronize: bool):
        self.synchronize = synchronize
        self.started = self.drafted = self.verified = time.perf_counter()

    def mark_drafted(self, device: torch.device) -> None:
        if self.synchronize and device.type == "cuda":
            torch.cuda.synchronize(device)
        self.drafted = time.perf_counter()

    def mark_verified(self) -> None:
        self.verified = time.perf_counter()

    @property
    def draft_seconds(self) -> float:
        return self.drafted - self.started

    @property
    def verify_seconds(self) -> float:
        return self.verified - self.drafted

    def seconds_since_drafted(self) -> float:
        """Verification with everything after it (stopping, commit, roll-back), for the call's statistics."""
        return time.perf_counter() - self.drafted
