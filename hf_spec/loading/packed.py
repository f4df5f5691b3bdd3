"""The fastest CPU forward path for a model, chosen by measurement: linear layers prepacked for oneDNN, and per pass
either torch's own kernels or oneDNN for the rest, by the number of rows in the pass (figures: docs/cpu_kernels.md).

Why: on a CPU with native bf16, torch's own kernels stream the weights for a 1-token step faster than oneDNN, and run
a block of several tokens far slower; with the linear weights prepacked (``torch.ops.mkldnn._reorder_linear_weight``,
run by ``_linear_pointwise``, as inductor's CPU freezing does) a block of a few tokens costs about one step. AVX2:
float32 only.

Paths (`PATHS`): ``stock``: the weights as loaded, oneDNN wherever torch sends them (what transformers does); ``dense``:
the weights as loaded, passes of few rows with oneDNN switched off, blocks with it on; ``packed``: the linear weights
prepacked for oneDNN (a tied output layer stays as it is), the rest as ``dense``.

`optimize` measures them and keeps the fastest for the model's role (`ROLES`): a target that verifies blocks, a draft
(steps, 2-token catch-ups, prefills: `DRAFT_ROUND`), or a target decoding alone. They can differ: the packed path's step
can cost more than the dense path's (what a target loses in a round that drafts nothing: `CpuPath.step_loss`). Each
layer is packed in place of its dense weight (``deoptimize`` restores it). The output law is exactly target-only
decoding *with the optimized model*, which rounds differently from the stock one.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from hf_spec.caches import cache_length, crop_to, new_cache
from hf_spec.checks import check_int, is_int_at_least
from hf_spec.forward import position_table
from hf_spec.loading.cpu import release_freed_memory
from hf_spec.loading.dispatch import ONEDNN_SWITCH, dispatching, stop_dispatch
from hf_spec.loading.packed_layer import PACKED_REFUSAL, PackedLinear, packed_linear  # noqa: F401 (re-exported)
from hf_spec.sizing.draft_length import DEFAULT_NUM_DRAFT_TOKENS
from hf_spec.timing.load import LoadMeter
from hf_spec.timing.probe import forget_costs
from hf_spec.timing.store import STORE_VARIABLE, load_path, path_key, save_path

logger = logging.getLogger(__name__)

PATHS = ("stock", "dense", "packed")
ROLES = ("target", "draft", "steps")
#: Tokens of random context before timing a model's passes.
PREFIX_LENGTH = 64
#: A draft's passes, by tokens, in a round of k = 5: four steps, a 2-token catch-up (after a round accepted in full) and
#: its share of a prompt's prefill (a 128-token prompt is eight 16-token passes, spread over 16 or more rounds).
DRAFT_ROUND = {1: DEFAULT_NUM_DRAFT_TOKENS - 1, 2: 1, 16: 0.5}


@dataclasses.dataclass
class CpuPath:
    """The path `optimize` chose, and what it measured (seconds per pass, by tokens, for each candidate)."""

    name: str  # one of PATHS
    aten_max_rows: int  # passes of at most this many rows (batch x tokens) run with oneDNN switched off; 0: never
    seconds: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)
    reason: str = ""
    quiet: bool = True  # timed while no other process loaded the machine (`hf_spec.timing.load`): kept on disk

    def describe(self) -> str:
        lines = [f"CPU forward path: {self.name}" + (f" ({self.reason})" if self.reason else "")]
        for candidate, by_width in self.seconds.items():
            lines.append(f"  {candidate}: " + ", ".join(f"{w} tok {s * 1e3:.0f} ms" for w, s in by_width.items()))
        if (loss := self.step_loss()) is not None and loss[1] != self.name:
            lines.append(f"  plain steps (rounds that draft nothing) cost {loss[0]:.2f}x the fastest step ({loss[1]})")
        return "\n".join(lines)

    def step_loss(self) -> tuple[float, str] | None:
        """(this path's step / the fastest measured step, that step's path): what a plain step (a round drafting
        nothing) loses at most to target-only decoding on the step path; ``None`` if this path's step was not timed."""
        steps = {name: by_width[1] for name, by_width in self.seconds.items() if 1 in by_width}
        fastest = min(steps, key=steps.__getitem__, default=None)
        return (steps[self.name] / steps[fastest], fastest) if self.name in steps else None

#: The share of a speculating target's passes that are single steps, in the target role's score (`_score`): most of
#: its passes verify a block (a plain step is a round the sizer chose not to draft), so the blocks choose its path.
#: Weighing both alike left paths that verify much faster but step a little slower at a near tie, decided by noise.
TARGET_STEP_SHARE = 0.25


def optimize(model: PreTrainedModel, path: str = "auto", role: str = "target", widths: list[int] | None = None,
             repeats: int = 3) -> CpuPath:
    """Put ``model`` on its fastest CPU forward path, in place, and return what was chosen (also `cpu_path`).

    Args:
        path: ``"auto"`` measures ``stock``, ``dense`` and ``packed`` and keeps the fastest; or one of `PATHS`.
        role: ``"target"`` weighs a 1-token step by `TARGET_STEP_SHARE` and the blocks in ``widths`` by the rest;
            ``"draft"`` the passes of a round (`DRAFT_ROUND`: steps, a catch-up and a share of a prefill);
            ``"steps"`` the step alone.
        widths: tokens per timed pass, at most `PREFIX_LENGTH` (default: 1, 2, 4, 6, 8 for a target, the widths of
            `DRAFT_ROUND` for a draft, 1 and 2 for steps; a draft's must include them).
        repeats: timed passes per width and candidate (the median is kept).
    """
    if path not in ("auto", *PATHS):
        raise ValueError(f"`path` must be 'auto' or one of {PATHS}, but is {path!r}.")
    if role not in ROLES:
        raise ValueError(f"`role` must be one of {ROLES}, but is {role!r}.")
    check_int("repeats", repeats)
    widths = widths or {"target": [1, 2, 4, 6, 8], "draft": list(DRAFT_ROUND), "steps": [1, 2]}[role]
    needed = set(DRAFT_ROUND) if role == "draft" else {1}
    if not needed <= set(widths) or not all(is_int_at_least(width, 1) and width <= PREFIX_LENGTH for width in widths):
        raise ValueError(f"`widths` must be token counts in [1, {PREFIX_LENGTH}] including {sorted(needed)} (for role "
                         f"{role!r}), but is {widths!r}.")
    deoptimize(model)
    key = path_key(model, role, widths, repeats) if path == "auto" else None
    stored = None if key is None else load_path(key)
    if stored is not None and (chosen := _restore(model, CpuPath(**stored))) is not None:
        return chosen
    with LoadMeter() as load:
        chosen = _measure(model, path, role, widths, repeats)
    chosen.quiet = not load.is_loaded
    if key is not None and chosen.quiet:
        save_path(key, {name: value for name, value in dataclasses.asdict(chosen).items() if name != "quiet"})
    elif key is not None:
        logger.warning("hf_spec timed the CPU paths while other processes used %.0f%% of the CPUs; the choice serves "
                       "this process and is not kept for later ones.", 100 * load.others_share)
    return chosen


def _restore(model: PreTrainedModel, path: CpuPath) -> CpuPath | None:
    """A path chosen in an earlier process (`hf_spec.timing.store.load_path`) put in place without timing
    anything; ``None`` where it no longer applies (oneDNN cannot pack here now)."""
    if _unsupported(model):
        return _keep(model, path) if path.name == "stock" else None
    if path.name == "stock" or (path.name == "packed" and not _pack(model)):
        return None
    logger.info("CPU path %s as chosen by an earlier process (%s)", path.name, STORE_VARIABLE)
    return _keep(model, dispatching(model, path))


def _measure(model: PreTrainedModel, path: str, role: str, widths: list[int], repeats: int) -> CpuPath:
    """`optimize`'s choice, measured (see there)."""
    refusal = _unsupported(model)
    if refusal:  # weight-only layers have no other path, but their timings seed auto k's costs (`prepare_pair`)
        timed = getattr(model, "hf_spec_weight_only", None) is not None and model.device.type == "cpu"
        seconds = {"stock": time_passes(model, widths, repeats)[True]} if timed else {}
        return _keep(model, CpuPath("stock", 0, seconds, reason=refusal))
    seconds = {}
    if path == "auto":
        dense = time_passes(model, widths, repeats)
        seconds["stock"], seconds["dense"] = dense[True], _fastest(dense)
    if path in ("auto", "packed"):
        if not _pack(model):
            reason = "oneDNN cannot prepack this dtype on this CPU"
            if path == "packed":
                return _keep(model, CpuPath("stock", 0, reason=reason))
            return _keep(model, dispatching(model, CpuPath("dense", _aten_rows(dense), seconds, reason)))
        if path == "packed":
            return _keep(model, dispatching(model, CpuPath("packed", 1)))
        packed = time_passes(model, widths, repeats)
        seconds["packed"] = _fastest(packed)
        if _score(seconds["packed"], role) < _score(seconds["dense"], role):
            return _keep(model, dispatching(model, CpuPath("packed", _aten_rows(packed), seconds)))
        _unpack(model)
        return _keep(model, dispatching(model, CpuPath("dense", _aten_rows(dense), seconds)))
    if path == "dense":
        return _keep(model, dispatching(model, CpuPath("dense", 1)))
    return _keep(model, CpuPath("stock", 0))


def deoptimize(model: PreTrainedModel) -> None:
    """Undo `optimize`: dense linear layers (the same values) and no kernel dispatch."""
    stop_dispatch(model)
    _unpack(model)
    _PATHS.pop(model, None)
    forget_costs(model)


def cpu_path(model: PreTrainedModel) -> CpuPath | None:
    """The path `optimize` chose for ``model``, or ``None`` when it was not optimized (or `deoptimize` ran)."""
    return _PATHS.get(model)


#: What `optimize` chose per model: held here, never written onto the model.
_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unsupported(model: PreTrainedModel) -> str:
    """Why ``model`` keeps its stock path (empty when it can be optimized)."""
    if model.device.type != "cpu":
        return f"the model is on {model.device}, not the CPU"
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "the model is dispatched over several devices"
    if getattr(model, "hf_spec_weight_only", None) is not None:
        return f"its weights are {model.hf_spec_weight_only}, on weight-only kernels"
    if getattr(model.config, "quantization_config", None) is not None:
        return "the model is quantized"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"{model.dtype} weights"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    return ""


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, name, layer)`` of every plain linear layer whose weight no other module shares (tied output
    embeddings stay dense: packing them would hold the matrix twice)."""
    counts: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    input_embeddings = model.get_input_embeddings()
    shared = {id(input_embeddings.weight)} if input_embeddings is not None else set()
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and counts.get(id(child.weight), 0) == 1 and id(child.weight) not in shared]


def _pack(model: nn.Module) -> bool:
    """Pack every eligible linear layer, one at a time (each dense weight is freed as its packed copy appears);
    ``False``, with nothing changed, when oneDNN cannot pack this dtype here."""
    for index, (parent, name, linear) in enumerate(_linears(model)):
        try:
            setattr(parent, name, PackedLinear(linear))
        except RuntimeError as error:  # e.g. bf16 on a CPU without AVX512: "bf16 path needs the cpu support ..."
            if index > 0:
                _unpack(model)
            logger.info("oneDNN cannot prepack %s weights here: %s", linear.weight.dtype, error)
            return False
    release_freed_memory()
    return True


def _unpack(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.to_linear())


def _keep(model: PreTrainedModel, path: CpuPath) -> CpuPath:
    _PATHS[model] = path
    forget_costs(model)  # the probe's costs were measured on the kernels the model had before
    logger.info(path.describe())
    return path


@torch.no_grad()
def time_passes(model: PreTrainedModel, widths: list[int], repeats: int) -> dict[bool, dict[int, float]]:
    """Median seconds of a pass over each of ``widths`` tokens, with oneDNN on (``True``) and off, interleaved, after
    one prefill of `PREFIX_LENGTH` random ids (made with oneDNN on: torch's bf16 kernels are slow for it)."""
    positions = min(position_table(model) or PREFIX_LENGTH + max(widths),
                    getattr(model.config.get_text_config(), "max_position_embeddings", None) or PREFIX_LENGTH + 64)
    length = max(1, min(PREFIX_LENGTH, positions - max(widths)))  # the prefix and the widest pass fit the table
    prefix_ids = torch.randint(model.get_input_embeddings().num_embeddings, (1, length),
                               generator=torch.Generator().manual_seed(0))
    cache = new_cache(model, max_pass=max(widths))
    seconds = {mode: {width: [] for width in widths} for mode in (True, False)}
    ONEDNN_SWITCH.acquire()  # no other thread's pass runs while the flag is switched here
    was_enabled = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = True
        model(input_ids=prefix_ids, cache=cache, use_cache=True, logits_to_keep=1)
        prefix = cache_length(cache)
        for _ in range(repeats):
            for mode in (True, False):
                torch.backends.mkldnn.enabled = mode
                for width in widths:
                    started = time.perf_counter()
                    model(input_ids=prefix_ids[:, -1:].expand(-1, width), cache=cache, use_cache=True,
                          logits_to_keep=width)
                    seconds[mode][width].append(time.perf_counter() - started)
                    crop_to(cache, prefix)
    finally:
        torch.backends.mkldnn.enabled = was_enabled
        ONEDNN_SWITCH.release()
    return {mode: {width: float(np.median(values)) for width, values in by_width.items()}
            for mode, by_width in seconds.items()}


def _fastest(by_mode: dict[bool, dict[int, float]]) -> dict[int, float]:
    return {width: min(by_mode[True][width], by_mode[False][width]) for width in by_mode[True]}


def _aten_rows(by_mode: dict[bool, dict[int, float]]) -> int:
    """The most rows up to which every measured pass ran faster with oneDNN off (0: oneDNN always)."""
    faster_off = itertools.takewhile(lambda width: by_mode[False][width] < by_mode[True][width], sorted(by_mode[True]))
    return max(faster_off, default=0)


def _score(seconds: dict[int, float], role: str) -> float:
    """What a role pays: a target decoding alone steps; a draft steps, catches up and prefills (`DRAFT_ROUND`); a target
    that speculates mostly verifies, and steps now and then (`TARGET_STEP_SHARE`)."""
    if role == "steps":
        return seconds[1]
    if role == "draft":
        return sum(weight * seconds[width] for width, weight in DRAFT_ROUND.items())
    blocks = [value for width, value in seconds.items() if width > 1]
    if not blocks:
        return seconds[1]
    return TARGET_STEP_SHARE * seconds[1] + (1 - TARGET_STEP_SHARE) * sum(blocks) / len(blocks)
