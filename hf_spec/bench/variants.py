"""The other models `hf-spec bench` runs beside the main pair, built once for the CLI and for notebooks alike.

- quantized targets (``quantized=("nf4", ...)``): the target again, loaded quantized; every method runs on each;
- other drafts (``drafts=(folder, ...)``): a draft model (same tokenizer) or a draft head trained for the target;
  the methods that use a draft run with each;
- pruned drafts (``draft_vocab_sizes=(N, (N, "text"), ...)``): the main draft with its output layer cut to N ids,
  ranked on the target's continuations (``vocab<N>``) or on the corpus's text alone (``vocab<N>-text``);
- kernel baselines (``kernel_baselines=("stock", "steps")``): the target again, as loaded and on the CPU path fastest
  for 1-token steps, for target-only decoding beside the optimized pair (so a speed-up from kernels shows apart from
  one from speculation). Each copy holds the target's weights again.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from hf_spec.drafting.vocabulary import prune_vocabulary
from hf_spec.heads.saved import head_kind, load_head
from hf_spec.loading import packed
from hf_spec.loading.pair import Pair, load_model, seed_pair_costs
from hf_spec.loading.quantization import first_device
from hf_spec.loading.vocabulary import draft_vocabulary
from hf_spec.validation import check_same_vocabulary

KERNEL_LABELS = ("stock", "steps")


def bench_variants(pair: Pair, target_name: str, *, quantized: tuple[str, ...] = (), drafts: tuple[str, ...] = (),
                   draft_vocab_sizes: tuple[int | tuple[int, str], ...] = (), draft_vocab_corpus: str = "stdlib",
                   kernel_baselines: tuple[str, ...] = KERNEL_LABELS, optimize: bool = True,
                   seed: int = 0) -> dict:
    """Label -> a variant for `hf_spec.bench.runner.run_benchmark`: another target, or a (target, draft) pair.

    Raises:
        ValueError: a label taken twice, a quantized variant of an already-quantized target, a draft that does not
            fit the target.
    """
    target, dtype = pair.target, _plain_dtype(pair.target)
    if getattr(target.config, "quantization_config", None) is not None and quantized:
        raise ValueError(f"`quantized` {list(quantized)}: the target itself is already quantized.")
    variants = {scheme: load_model(target_name, dtype=dtype, quantize=scheme, seed=seed)[0] for scheme in quantized}
    for model in variants.values() if optimize else ():
        packed.optimize(model, role="target")  # times weight-only targets: their first automatic call does not probe
        seed_pair_costs(model, pair.draft)
    for name in drafts:
        label = Path(name).name
        if label in variants:
            raise ValueError(f"--draft-variants {name}: the label {label!r} is taken; rename the folder.")
        variants[label] = (target, _other_draft(pair, target_name, name, dtype, optimize, seed))
    for variant in draft_vocab_sizes:
        size, counted_on = variant if isinstance(variant, tuple) else (variant, "continuations")
        draft = copy.deepcopy(pair.draft)
        packed.deoptimize(draft)
        prune_vocabulary(draft, draft_vocabulary(draft, pair.tokenizer, size, draft_vocab_corpus, target=target,
                                                 counted_on=counted_on))
        if optimize:
            packed.optimize(draft, role="draft")
        variants[f"vocab{size}" + ("" if counted_on == "continuations" else f"-{counted_on}")] = (target, draft)
    if optimize and getattr(target.config, "quantization_config", None) is None:
        for label in dict.fromkeys(kernel_baselines):
            if label not in KERNEL_LABELS:
                raise ValueError(f"`kernel_baselines` must hold {KERNEL_LABELS}, but holds {label!r}.")
            model = load_model(target_name, dtype=dtype, seed=seed)[0]
            if label == "steps":
                packed.optimize(model, role="steps")
            variants[label] = model
    return variants


def _other_draft(pair: Pair, target_name: str, name: str, dtype: torch.dtype, optimize: bool, seed: int):
    """A draft model or head from ``name``, checked against the pair's target, on its fastest path as a draft."""
    if head_kind(name) is not None:
        head = load_head(name, pair.target, dtype)  # checks that the head was built for this target
        if optimize:
            packed.optimize(head, path="dense", role="draft")
        return head
    draft, tokenizer = load_model(name, dtype=dtype, seed=seed, role="draft")
    try:
        check_same_vocabulary(pair.tokenizer, tokenizer)
    except ValueError as error:
        raise ValueError(f"--draft-variants {name} does not fit --target {target_name}: {error}") from None
    draft = draft.to(first_device(pair.target))
    if optimize:
        packed.optimize(draft, role="draft")
    return draft


def _plain_dtype(model) -> torch.dtype:
    return model.dtype if model.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
