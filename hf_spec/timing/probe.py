"""The timing probe: what a round costs on this machine, measured. `probe_costs` times target passes over blocks of
2..k+1 tokens and the draft's steps once per (target, drafter's model, dtypes, devices, threads, sizes), keeps them
for the process and on disk (`hf_spec.timing.store`), and `seed_costs` takes the kernel timings `optimize()` made
anyway; the sizers (`hf_spec.sizing`) read the tables. The process cache holds its models weakly (a model that is
freed takes its costs along), and `forget_costs` drops a model's entries when its kernels change
(`hf_spec.loading.packed.optimize` calls it). Reasoning: docs/draft_length.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from hf_spec.caches import cache_length, crop_to, new_cache, reads_encoder_outputs
from hf_spec.forward import input_names, position_table
from hf_spec.sizing.costs import CostTable, interpolated, merged_costs
from hf_spec.timing.load import LoadMeter
from hf_spec.timing.store import load_table, save_table, store_key

logger = logging.getLogger(__name__)

#: Tokens of random context before the timed passes (costs grow slowly with the cache length).
PROBE_PREFIX_LENGTH = 32
#: A call's observed costs within this factor of the table's (either way) leave the table as it is (`correct_costs`).
AGREEMENT = 1.25
#: The target pass sizes the probe may time; other sizes are interpolated, and sizes past the last extrapolated.
PROBE_BLOCK_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 33, 48, 64)


@torch.no_grad()
def forward_seconds(model: PreTrainedModel, prefix_ids: torch.Tensor, widths: list[int], repeats: int = 5
                    ) -> dict[int, float]:
    """Median seconds of a forward pass over each of ``widths`` tokens on top of a cached ``prefix_ids`` ``[1, S]``,
    the widths interleaved so that slow phases of a shared machine hit them alike."""
    cache = new_cache(model, max_pass=max(widths))
    names, extra = input_names(type(model)), probe_conditioning(model, prefix_ids)

    def positions(start: int, width: int) -> dict:  # given, so that no position state a model keeps from the call
        if names.positions is None:  # it serves (Qwen2-VL's rope deltas, of the call's rows) is read here
            return {}
        return {names.positions: torch.arange(start, start + width, device=prefix_ids.device)[None]}

    model(**{names.ids: prefix_ids}, **positions(0, prefix_ids.shape[1]), **extra, cache=cache, use_cache=True,
          logits_to_keep=1)
    prefix = cache_length(cache)
    seconds = {width: [] for width in widths}
    for _ in range(repeats):
        for width in widths:
            block = prefix_ids[:, -1:].expand(-1, width)  # [1, width]
            synchronize(model.device)
            started = time.perf_counter()
            model(**{names.ids: block}, **positions(prefix, width), **extra, cache=cache, use_cache=True,
                  logits_to_keep=width)
            synchronize(model.device)
            seconds[width].append(time.perf_counter() - started)
            crop_to(cache, prefix)
    return {width: float(np.median(values)) for width, values in seconds.items()}


def probe_conditioning(model: PreTrainedModel, prefix_ids: torch.Tensor) -> dict:
    """What a probe pass of a decoder that reads an encoder's outputs is handed: zeros for as many encoder positions
    as the prefix has tokens (the cost of its cross-attention over a source of that length); nothing for others."""
    if not reads_encoder_outputs(model):
        return {}
    config = model.config.get_text_config(decoder=True)
    width = getattr(config, "d_model", None) or config.hidden_size
    states = torch.zeros((1, prefix_ids.shape[1], width), dtype=model.dtype, device=model.device)
    return {"encoder_outputs": BaseModelOutput(last_hidden_state=states)}


def measure_costs(target: PreTrainedModel, drafter, prefix_ids: torch.Tensor, block_sizes: list[int],
                  repeats: int = 5, draft_widths: tuple[int, ...] = (1,)) -> CostTable:
    """Costs after ``prefix_ids`` ``[1, S]``: target passes over each of ``block_sizes`` tokens (and 1), and the
    drafter's passes over ``draft_widths`` tokens (and 1; a tree's levels), from its `Drafter.measure_passes` hook:
    nothing for a drafter without forward passes (prompt lookup), whose steps then cost 0.

    The two models take turns, one repeat each (a fresh prefill each time), and each figure is the fastest of the
    repeats: a slow phase of a shared machine (seconds long) then spoils one repeat of each, which the minimum drops,
    instead of every pass of one model (a probe that timed the draft's three steps in one such phase put c at 0.80
    where the call's own passes measured 0.32); another process slows a pass, never speeds it up."""
    sizes, widths = sorted({1, *block_sizes}), sorted({1, *draft_widths})
    target_runs, draft_runs = [], []
    for _ in range(repeats):
        target_runs.append(forward_seconds(target, prefix_ids.to(target.device), sizes, repeats=1))
        draft_runs.append({} if drafter is None else drafter.measure_passes(prefix_ids, widths, 1))
    target_seconds = {size: min(run[size] for run in target_runs) for size in sizes}
    draft_passes = {width: min(run[width] for run in draft_runs) for width in draft_runs[0]}
    return CostTable(target_seconds[1], draft_passes.get(1, 0.0), target_seconds, draft_passes)


def synchronize(device: torch.device) -> None:
    """Wait for an accelerator's queued kernels (a no-op on the CPU), so that a clock read after it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {draft model or None -> {key: table}}


def probe_sizes(max_block_size: int) -> tuple[int, ...]:
    """The target pass sizes to time for passes of up to ``max_block_size`` tokens: the sizes of `PROBE_BLOCK_SIZES`
    up to it and the next one (so that every size in between is interpolated; a few calls share one probe)."""
    above = [size for size in PROBE_BLOCK_SIZES if size >= max_block_size][:1]
    return tuple(size for size in PROBE_BLOCK_SIZES if size < max_block_size) + tuple(above)


def probe_costs(target: PreTrainedModel, drafter, block_sizes: tuple[int, ...], repeats: int = 3,
                draft_widths: tuple[int, ...] = (1,)) -> CostTable:
    """`measure_costs` for target passes over ``block_sizes`` tokens after up to `PROBE_PREFIX_LENGTH` random ids,
    once per (target, the drafter's `Drafter.cost_key`, dtypes, devices, threads) in this process, and kept on disk
    for later processes (`hf_spec.timing.store`).

    The table grows: a call that needs sizes (or draft widths) not measured yet times only those, with the target
    step (and the draft step) again to scale them onto the table, so a short call then a longer one do not probe the
    short one's sizes twice. Passes and the prefix are cut to what both models' position tables hold (a size left out
    is extrapolated)."""
    draft_model = None if drafter is None else drafter.cost_key
    positions = _positions(target, draft_model)
    sizes = tuple(sorted({1, *(size for size in block_sizes if size <= max(1, positions // 2))}))
    draft_widths = tuple(width for width in draft_widths if width <= max(sizes)) or (1,)
    threads = torch.get_num_threads()
    key = _process_key(target, draft_model, drafter, threads)
    by_draft = _PROBED.setdefault(target, {})
    for stale in [entry for entry in by_draft if entry.ref is not None and entry.ref() is None]:
        del by_draft[stale]  # a freed draft's costs
    probed = by_draft.setdefault(_WeakKey(draft_model), {})
    stored = store_key(target, draft_model, drafter, threads)
    table = probed.get(key) or load_table(stored, CostTable) or _same_models(probed, key)
    missing = [size for size in sizes if table is None or size not in table.target_block_seconds]
    has_passes = table is not None and len(table.draft_pass_seconds) > 0
    missing_widths = [width for width in draft_widths if has_passes and width not in table.draft_pass_seconds]
    if table is None or missing or missing_widths:
        generator = torch.Generator().manual_seed(0)  # the ids do not matter, only their number
        vocab_size = target.get_input_embeddings().num_embeddings
        if draft_model is not None and hasattr(draft_model, "get_input_embeddings"):
            vocab_size = min(vocab_size, draft_model.get_input_embeddings().num_embeddings)
        length = max(1, min(PROBE_PREFIX_LENGTH, positions - max(sizes) - 1))
        prefix_ids = torch.randint(vocab_size, (1, length), generator=generator)
        with LoadMeter() as load:
            measured = measure_costs(target, drafter, prefix_ids, missing or [1], repeats,
                                     tuple(missing_widths) if table is not None else tuple(draft_widths))
        table = measured if table is None else merged_costs(table, measured)
        keep_unless_loaded(stored, table, load)
    probed[key] = table
    return table


def keep_unless_loaded(stored: str, table: CostTable, load: LoadMeter) -> None:
    """Save ``table`` for later processes unless other processes kept the machine busy while it was timed (it then
    serves this process only; a quiet call's own timings store it later, `correct_costs`)."""
    if load.is_loaded:
        logger.warning("hf_spec timed its passes while other processes used %.0f%% of the CPUs; the costs serve this "
                       "process and are not kept for later ones.", 100 * load.others_share)
        return
    save_table(stored, table)


def correct_costs(target: PreTrainedModel, drafter, seeded: CostTable, draft_ratio: float) -> CostTable | None:
    """Bring the stored costs of ``target`` and ``drafter`` to what a quiet call observed: ``draft_ratio`` is the
    call's draft step against its target passes, over the same in ``seeded`` (the table the call's sizer started
    from: `OnlineSizer.observed_cost_ratio`). Within `AGREEMENT` of 1 nothing changes; otherwise the table becomes
    ``seeded`` with its draft passes scaled by it, in the process and on disk (scaling what the call started from, a
    sizer kept across calls corrects once, not once per call). The target's passes stay: the call's context length
    moves both models' timings alike. Returns the new table, if any."""
    if 1 / AGREEMENT <= draft_ratio <= AGREEMENT:
        return None
    draft_model = None if drafter is None else drafter.cost_key
    threads = torch.get_num_threads()
    key = _process_key(target, draft_model, drafter, threads)
    probed = _PROBED.get(target, {}).get(_WeakKey(draft_model))
    if probed is None or key not in probed:
        return None
    corrected = dataclasses.replace(
        seeded, draft_step_seconds=seeded.draft_step_seconds * draft_ratio,
        draft_pass_seconds={width: seconds * draft_ratio for width, seconds in seeded.draft_pass_seconds.items()},
        target_block_seconds={**probed[key].target_block_seconds, **seeded.target_block_seconds})
    logger.info("stored pass costs corrected from a call's own timings: draft passes x%.2f", draft_ratio)
    probed[key] = corrected
    save_table(store_key(target, draft_model, drafter, threads), corrected)
    return corrected


def seed_costs(target: PreTrainedModel, drafter, target_seconds: dict[int, float],
               draft_seconds: dict[int, float], up_to: int, persist: bool = True) -> CostTable | None:
    """Costs from timings made anyway (`hf_spec.loading.packed.optimize` times each model's passes to choose its
    kernels): the target's passes by tokens, and the draft's, as if `probe_costs` had measured them, so that a first
    automatic call does not probe. Sizes up to ``up_to`` that were not timed are interpolated (extrapolated past the
    widest, with the last slope, as the sizers would). A table already known (in the process or on disk) wins;
    returns the table in use, ``None`` when the timings lack the target step. ``persist``: whether the timings were
    made on a quiet machine, and may be kept for later processes."""
    if 1 not in target_seconds or (drafter is not None and drafter.cost_key is not None and 1 not in draft_seconds):
        return None
    draft_model = None if drafter is None else drafter.cost_key
    threads = torch.get_num_threads()
    key = _process_key(target, draft_model, drafter, threads)
    probed = _PROBED.setdefault(target, {}).setdefault(_WeakKey(draft_model), {})
    stored = store_key(target, draft_model, drafter, threads)
    table = probed.get(key) or load_table(stored, CostTable)
    if table is None:
        known = sorted(target_seconds.items())
        blocks = {size: interpolated(known, size) for size in sorted({*target_seconds, *probe_sizes(up_to)})}
        passes = {width: seconds for width, seconds in draft_seconds.items() if width <= 2}
        table = CostTable(blocks[1], passes.get(1, 0.0), blocks, passes)
        if persist:
            save_table(stored, table)
    probed[key] = table
    return table


def forget_costs(model: PreTrainedModel) -> None:
    """Drop every probed cost that involves ``model`` (as the target or the draft): its kernels changed."""
    _PROBED.pop(model, None)
    for by_draft in list(_PROBED.values()):
        by_draft.pop(_WeakKey(model), None)


class _WeakKey:
    """A dictionary key that holds its object weakly and compares by identity (``None`` for no draft model); a
    key whose object was freed equals no live one, so a new model at a freed one's address gets no stale costs."""

    def __init__(self, obj):
        self.ref = None if obj is None else weakref.ref(obj)

    def _target(self):
        return None if self.ref is None else self.ref()

    def __hash__(self) -> int:
        return hash(None) if self.ref is None else hash(self.ref)

    def __eq__(self, other) -> bool:
        if not isinstance(other, _WeakKey):
            return NotImplemented
        if self.ref is None or other.ref is None:
            return self.ref is other.ref
        return self.ref == other.ref and self._target() is not None


def _positions(*models) -> int:
    """The most positions every model here can take: learned position tables and ``max_position_embeddings``."""
    limits = [1 << 20]
    for model in models:
        if model is None:
            continue
        config = getattr(model, "config", None)
        text = config.get_text_config() if config is not None else None
        limits.append(getattr(text, "max_position_embeddings", None) or 1 << 20)
        limits.append(position_table(model) or 1 << 20)
    return min(limits)


def _process_key(target, draft_model, drafter, threads: int) -> tuple:
    """What a table is kept under in the process: the models' dtypes and devices, the threads and the drafter's kind,
    as on disk (`hf_spec.timing.store.store_key`; a tree drafter's table holds passes a chain's lacks, and kept
    under the chain's key it was measured again in every process, never read back from disk), then how the drafter
    times its passes (`Drafter.measure_passes`: a tree drafter times them as its chain drafter does)."""
    kind = "" if drafter is None else type(drafter).__name__
    timing = "" if drafter is None else type(drafter).measure_passes.__qualname__
    return _describe(target), _describe(draft_model), threads, kind, timing


def _same_models(probed: dict, key: tuple) -> CostTable | None:
    """A table of the same models and threads, made for another drafter kind that times its passes the same way (a
    chain's, seeded from the kernel timings, for a tree of the same draft): its passes hold for this kind too, so
    only what it lacks is measured."""
    return next((table for other, table in probed.items() if other[:3] == key[:3] and other[4] == key[4]), None)


def _describe(model) -> tuple:
    if model is None:
        return ()
    return (str(getattr(model, "dtype", None)), str(getattr(model, "device", None)))
