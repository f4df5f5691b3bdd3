"""What a round costs: a target step, target passes over blocks of 2..k+1 tokens, and a draft step, measured.

The speed-up formula's b (a (k+1)-token target pass over a target step) and c (a draft step over a target step)
decide how much to draft, and they depend on the machine, the dtype, the thread count and the kernels (`hf_spec.loading
.packed`). `probe_costs` measures them once per (models, dtype, threads, kernel path) and keeps them for the process,
so ``num_assistant_tokens="auto"`` starts from measured costs instead of exploring, and `hf-spec bench` prints them.
"""

from __future__ import annotations

import dataclasses
import time
import weakref

import numpy as np
import torch
from transformers import PreTrainedModel

from hf_spec.caches import cache_length, crop_to, new_cache
from hf_spec.drafting.speedup import predicted_speedup
from hf_spec.heads.model import DraftHead

#: Tokens of random context before the timed passes (costs grow slowly with the cache length).
PROBE_PREFIX_LENGTH = 128


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Median seconds of a target step, of target passes over several block sizes, and of a draft step."""

    target_step_seconds: float
    draft_step_seconds: float  # 0 for a drafter without a model (prompt lookup)
    target_block_seconds: dict[int, float]  # tokens in the pass (k + 1) -> seconds; 1 is the step
    draft_pass_seconds: dict[int, float] = dataclasses.field(default_factory=dict)  # tokens -> seconds (model drafts)

    @property
    def cost_ratio(self) -> float:
        """c: draft step / target step."""
        return self.draft_step_seconds / self.target_step_seconds

    def block_cost(self, k: int) -> float:
        """b: a target pass over k + 1 tokens / a target step."""
        return self.target_block_seconds[k + 1] / self.target_step_seconds

    def best_possible_speedup(self) -> float:
        """The formula's speed-up at acceptance 1 for the best measured k: no draft can do better here."""
        return max(predicted_speedup(1.0, size - 1, self.cost_ratio, self.block_cost(size - 1))
                   for size in self.target_block_seconds if size > 1)


@torch.no_grad()
def forward_seconds(model: PreTrainedModel, prefix_ids: torch.Tensor, widths: list[int], repeats: int = 5
                    ) -> dict[int, float]:
    """Median seconds of a forward pass over each of ``widths`` tokens on top of a cached ``prefix_ids`` ``[1, S]``,
    the widths interleaved so that slow phases of a shared machine hit them alike."""
    cache = new_cache(model)
    model(input_ids=prefix_ids, cache=cache, use_cache=True, logits_to_keep=1)
    prefix = cache_length(cache)
    seconds = {width: [] for width in widths}
    for _ in range(repeats):
        for width in widths:
            block = prefix_ids[:, -1:].expand(-1, width)  # [1, width]
            synchronize(model.device)
            started = time.perf_counter()
            model(input_ids=block, cache=cache, use_cache=True, logits_to_keep=width)
            synchronize(model.device)
            seconds[width].append(time.perf_counter() - started)
            crop_to(cache, prefix)
    return {width: float(np.median(values)) for width, values in seconds.items()}


def measure_costs(target: PreTrainedModel, draft: PreTrainedModel | None, prefix_ids: torch.Tensor,
                  block_sizes: list[int], repeats: int = 5, draft_widths: tuple[int, ...] = (1,)) -> CostTable:
    """Costs after ``prefix_ids`` ``[1, S]``: target passes over each of ``block_sizes`` tokens (and 1), and a draft
    step (0 without a draft model); a draft model's passes over ``draft_widths`` tokens too (a tree's levels)."""
    target_seconds = forward_seconds(target, prefix_ids.to(target.device), sorted({1, *block_sizes}), repeats)
    draft_seconds, draft_passes = 0.0, {}
    if isinstance(draft, DraftHead):
        draft_seconds = head_step_seconds(draft, prefix_ids.to(draft.device), repeats)
    elif draft is not None:
        draft_passes = forward_seconds(draft, prefix_ids.to(draft.device), sorted({1, *draft_widths}), repeats)
        draft_seconds = draft_passes[1]
    return CostTable(target_seconds[1], draft_seconds, target_seconds, draft_passes)


@torch.no_grad()
def head_step_seconds(head: DraftHead, prefix_ids: torch.Tensor, repeats: int = 5) -> float:
    """Median seconds of a draft head's step (one token fed with its own predicted feature) on top of a cached
    ``prefix_ids`` ``[1, S]`` read with (zero) target features."""
    cache = new_cache(head.decoder)
    width = head.config.target_hidden_size * len(head.config.feature_layers)
    features = torch.zeros((*prefix_ids.shape, width), dtype=head.dtype, device=prefix_ids.device)
    predicted = head(prefix_ids, features=features, cache=cache, logits_to_keep=1).hidden_states[:, -1:]
    prefix, seconds = cache_length(cache), []
    for _ in range(repeats):
        synchronize(head.device)
        started = time.perf_counter()
        head(prefix_ids[:, -1:], predicted=predicted, cache=cache, logits_to_keep=1)
        synchronize(head.device)
        seconds.append(time.perf_counter() - started)
        crop_to(cache, prefix)
    return float(np.median(seconds))


def synchronize(device: torch.device) -> None:
    """Wait for an accelerator's queued kernels (a no-op on the CPU), so that a clock read after it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {key: CostTable}


def probe_costs(target: PreTrainedModel, draft: PreTrainedModel | None, max_draft_tokens: int,
                repeats: int = 3, block_sizes: tuple[int, ...] | None = None,
                draft_widths: tuple[int, ...] = (1,)) -> CostTable:
    """`measure_costs` for blocks of 1 .. ``max_draft_tokens + 1`` tokens (or of ``block_sizes``) after
    `PROBE_PREFIX_LENGTH` random ids, once per (target, draft, dtypes, threads, kernel paths, sizes) in this process."""
    sizes = tuple(range(1, max_draft_tokens + 2)) if block_sizes is None else tuple(sorted(block_sizes))
    key = (None if draft is None else id(draft), _describe(target), _describe(draft), torch.get_num_threads(),
           sizes, tuple(draft_widths))
    probed = _PROBED.setdefault(target, {})
    if key not in probed:
        generator = torch.Generator().manual_seed(0)  # the ids do not matter, only their number
        vocab_size = target.get_input_embeddings().num_embeddings
        if draft is not None:
            vocab_size = min(vocab_size, draft.get_input_embeddings().num_embeddings)
        max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None) or 1 << 20
        length = max(1, min(PROBE_PREFIX_LENGTH, max_positions - max(sizes) - 1))
        prefix_ids = torch.randint(vocab_size, (1, length), generator=generator)
        probed[key] = measure_costs(target, draft, prefix_ids, list(sizes), repeats, tuple(draft_widths))
    return probed[key]


def _describe(model: PreTrainedModel | None) -> tuple:
    if model is None:
        return ()
    return (str(model.dtype), str(model.device), getattr(model, "hf_spec_cpu_path", None))
