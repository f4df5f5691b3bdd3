"""What a speculative call records besides its tokens: per-step scores and logits, the streamer, the statistics,
and one clock per round (`RoundLog`), all held by one `CallRecord`.

The loop (`hf_spec.decoding`) hands each round's results here and reads back only the round's timings (for the
sizer), so its steps stay the algorithm's: draft, verify, accept, stop, commit and roll back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from hf_spec.profiling import CallProfile, profiled_call
from hf_spec.stats import SpeculativeStats


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


class RoundLog:
    """One round's record: its clock, what it drafted, accepted and emitted, for the call's `CallRecord`.

    The loop marks the end of each of the round's sections (`hf_spec.profiling.SECTIONS`): the sizer reads the drafting
    and verifying seconds from the marks, the statistics the whole round's, and a profiled call each section's
    (`hf_spec.profiling.CallProfile`: then every mark synchronizes an accelerator).

    Args:
        index: the round's place in the call (0: the first, whose verify pass holds the prompt's prefill).
        profile: the call's profile, or ``None`` when it is not profiled.
        sync_device: an accelerator to wait for before the drafting mark (a sizer that learns from timings needs the
            draft's own time), or ``None``; on a CPU the clock is exact anyway.
    """

    DRAFTED, VERIFIED = "drafting, other", "host sync"  # the marks that end drafting and verifying

    def __init__(self, index: int, profile: CallProfile | None, sync_device: torch.device | None):
        self.index, self.profile, self.sync_device = index, profile, sync_device
        self.started = self.last = profile.sync() if profile is not None else time.perf_counter()
        self.marks: dict[str, float] = {}
        self.counts: dict = {}  # `count`'s arguments

    def mark(self, section: str) -> None:
        """The section that just ended."""
        if self.profile is not None:
            now = self.profile.sync()
            self.profile.close_section(section, now - self.last)
        else:
            if section == self.DRAFTED and self.sync_device is not None:
                torch.cuda.synchronize(self.sync_device)
            now = time.perf_counter()
        self.marks[section] = self.last = now

    def count(self, active_rows: list[int], num_drafted: int, depth: int | None, output_ids: torch.Tensor,
              scores: torch.Tensor, logits: torch.Tensor, num_accepted: list[int], num_kept: list[int],
              reach: torch.Tensor | None = None) -> None:
        """What the round drafted (per row, ``depth`` for a tree), accepted and emitted: ``output_ids``
        ``[active, m + 1]`` with their processed ``scores`` and raw ``logits`` ``[active, m + 1, vocab]``; row a
        emitted its first ``num_kept[a]``; ``reach`` ``[active, m + 1]``: the rule's chance to keep at least j
        drafts, where it reports one (its sum past j = 0 is the count it expected)."""
        expected = None if reach is None else reach[:, 1:].sum(dim=-1).tolist()
        self.counts = {"active_rows": list(active_rows), "num_drafted": num_drafted, "depth": depth,
                       "output_ids": output_ids, "scores": scores, "logits": logits, "num_accepted": num_accepted,
                       "num_kept": num_kept, "expected_accepted": expected}  # the rows as they were (see commit)

    @property
    def draft_seconds(self) -> float:
        """Drafting: draft forward passes, sampling, the drafter's own work."""
        return self.marks[self.DRAFTED] - self.started

    @property
    def verify_seconds(self) -> float | None:
        """The target pass, the processors, acceptance and reading the counts; ``None`` for the call's first round,
        whose pass holds the prompt's prefill (a sizer must not learn a block's cost from it)."""
        return None if self.index == 0 else self.marks[self.VERIFIED] - self.marks[self.DRAFTED]

    @property
    def seconds_since_drafted(self) -> float:
        """Verification with everything after it (stopping, commit, roll-back), for the call's statistics."""
        return self.last - self.marks[self.DRAFTED]


class CallRecord:
    """What one call records beside its tokens, from its rounds' `RoundLog`: the outputs (`OutputRecorder`), the
    statistics (`hf_spec.stats.SpeculativeStats`) and, when profiled, where the time went."""

    def __init__(self, generation_config: GenerationConfig, batch_size: int, streamer: BaseStreamer | None,
                 verification: str, profile: CallProfile | None, sync_device: torch.device | None):
        self.batch_size = batch_size
        self.outputs = OutputRecorder(generation_config, batch_size, streamer)
        self.stats = SpeculativeStats(verification=verification)
        self.profile, self.sync_device = profile, sync_device

    def start_round(self) -> RoundLog:
        return RoundLog(self.stats.num_rounds, self.profile, self.sync_device)

    def close(self, log: RoundLog) -> None:
        """A finished round: its emitted tokens, counts and seconds."""
        counts = log.counts
        self.outputs.record(counts["active_rows"], counts["output_ids"], counts["scores"], counts["logits"],
                            counts["num_kept"])
        self.stats.record_round(counts["num_drafted"], counts["num_accepted"], counts["num_kept"],
                                counts["active_rows"], self.batch_size, counts["depth"], counts["expected_accepted"])
        self.stats.record_seconds(log.draft_seconds, log.seconds_since_drafted)

    def finish(self) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None, SpeculativeStats]:
        """``(scores, logits, stats)``: the outputs in transformers' layout, the statistics with the profile."""
        if self.profile is not None:
            self.stats.profile, self.stats.profile_passes = self.profile.seconds, self.profile.passes
        return (*self.outputs.finish(), self.stats)


@contextlib.contextmanager
def recorded_call(target: torch.nn.Module, device: torch.device, generation_config: GenerationConfig,
                  batch_size: int, streamer: BaseStreamer | None, verification: str,
                  is_timed: bool) -> Iterator[CallRecord]:
    """The record of the call that runs inside the block, profiled where `hf_spec.profiling.profile_rounds` asks.
    ``is_timed``: whether the sizer learns from timings (an accelerator is then synchronized after drafting)."""
    with profiled_call(target, device) as profile:
        sync_device = device if is_timed and device.type == "cuda" else None
        yield CallRecord(generation_config, batch_size, streamer, verification, profile, sync_device)
