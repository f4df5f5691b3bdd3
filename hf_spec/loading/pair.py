"""`load_pair`: a target and a draft that fit each other, loaded, quantized and placed, in one call.

What the command line does for every subcommand, as a library call for notebooks and scripts::

    >>> pair = load_pair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")  # dtype and kernels: auto
    >>> pair.target.generate(**pair.tokenizer("def f(", return_tensors="pt"), assistant_model=pair.draft)
    >>> print(pair.describe())  # the dtype and CPU forward path chosen, with what was measured
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from transformers import PreTrainedModel

from hf_spec.drafting.vocabulary import prune_vocabulary, pruned_size
from hf_spec.heads.model import DraftHead, is_draft_head_folder
from hf_spec.loading.cpu import default_dtype
from hf_spec.loading.packed import CpuPath, optimize
from hf_spec.loading.pretrained import DEFAULT_DRAFT, DEFAULT_TARGET, cache_dir, is_converted, load
from hf_spec.loading.quantization import first_device, quantized_copy
from hf_spec.loading.tiny import build_tiny_pair
from hf_spec.loading.vocabulary import draft_vocabulary
from hf_spec.mixin import speculative
from hf_spec.validation import check_same_vocabulary

#: The name of the built-in random-weight pair: token ids in and out, no tokenizer.
TINY = "tiny"
#: Forces notebooks and examples onto one pair: ``real`` (the default Qwen pair) or ``tiny``.
MODELS_VARIABLE = "HF_SPEC_MODELS"


def use_real_models(real_models: bool | None = None, cache: Path | None = None) -> tuple[bool, str]:
    """Whether a notebook runs the default real pair, and a sentence saying why.

    ``real_models`` decides when given; else ``$HF_SPEC_MODELS`` (``real`` or ``tiny``); else the real pair exactly
    when both models are already converted in the cache (after the README's first command), so that nothing is
    downloaded unasked.
    """
    if real_models is not None:
        if not isinstance(real_models, bool):
            raise TypeError(f"`real_models` must be True, False or None, but is {real_models!r}.")
        return real_models, f"REAL_MODELS = {real_models} in the parameters cell"
    forced = os.environ.get(MODELS_VARIABLE)
    if forced is not None:
        if forced not in ("real", TINY):
            raise ValueError(f"${MODELS_VARIABLE} must be 'real' or {TINY!r}, but is {forced!r}.")
        return forced == "real", f"${MODELS_VARIABLE}={forced}"
    cache = cache or cache_dir()
    if is_converted(DEFAULT_TARGET, cache) and is_converted(DEFAULT_DRAFT, cache):
        return True, f"the real pair is converted in {cache}"
    return False, f"the real pair is not converted in {cache} yet (`hf-spec generate` converts it once)"


@dataclasses.dataclass
class Pair:
    """A speculative-ready target, its draft on the target's first device, their shared tokenizer (``None`` for the
    tiny pair), and the CPU forward paths `optimize` chose (``None`` when not optimized)."""

    target: PreTrainedModel
    draft: PreTrainedModel
    tokenizer: object | None
    target_path: CpuPath | None = None
    draft_path: CpuPath | None = None

    def describe(self) -> str:
        vocabulary = pruned_size(self.draft)
        full = self.draft.config.get_text_config().vocab_size
        kept = f", output layer {vocabulary} of {full} ids" if vocabulary else ""
        lines = [(f"target: {self.target.name_or_path or 'tiny'} ({str(self.target.dtype).removeprefix('torch.')}), "
                  f"draft: {self.draft.name_or_path or 'tiny'} ({str(self.draft.dtype).removeprefix('torch.')}"
                  f"{kept})")]
        for role, path in (("target", self.target_path), ("draft", self.draft_path)):
            if path is not None:
                lines.append(f"{role} {path.describe()}")
        return "\n".join(lines)


def load_pair(target: str = DEFAULT_TARGET, draft: str = DEFAULT_DRAFT, *, dtype: torch.dtype | str = "auto",
              quantize: str | None = None, quantize_draft: str | None = None, draft_dtype: torch.dtype | None = None,
              optimize_kernels: bool = True, draft_vocab: int | None = None, draft_vocab_corpus: str = "stdlib",
              seed: int = 0) -> Pair:
    """Load ``target`` and ``draft`` (built-in names, local folders, Hub ids, or ``"tiny"`` for both; ``draft`` may
    also be a folder with a `DraftHead` trained for ``target``).

    Args:
        dtype: weights of both models (the compute dtype of 4-bit layers); ``"auto"``: bf16 where it is native (a
            GPU, a CPU with AMX or AVX512-BF16), else float32 (`hf_spec.loading.cpu.default_dtype`). The tiny pair
            is always float32.
        optimize_kernels: put each model on its fastest CPU forward path (`hf_spec.loading.packed.optimize`: the
            target for verifying blocks, the draft for steps), chosen by measurement.
        quantize, quantize_draft: a bitsandbytes scheme (``"8bit"``, ``"nf4"``, ``"fp4"``) for either model; the
            quantized target is spread by ``device_map="auto"``, and the draft goes to its first device.
        draft_dtype: the draft's weights when they should differ (training keeps float32).
        draft_vocab: keep only the draft's N most frequent output ids (FR-Spec, `hf_spec.drafting.vocabulary`),
            ranked on ``draft_vocab_corpus`` (a `hf_spec.loading.corpora` source; the counts are saved beside the
            draft and reused). The tiny pair keeps ids 0 .. N - 1.
        seed: seeds the tiny pair's weights.

    Raises:
        ValueError: ``"tiny"`` paired with a real model, or a draft whose tokenizer differs from the target's.
    """
    if dtype == "auto":
        dtype = default_dtype()
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"`dtype` must be a torch.dtype or 'auto', but is {dtype!r}.")
    if is_draft_head_folder(draft):
        return _load_with_head(target, draft, dtype, quantize, optimize_kernels, draft_vocab, seed)
    if TINY in (target, draft):
        if target != draft:
            raise ValueError(f"`target` {TINY!r} goes with `draft` {TINY!r}, got {target!r} and {draft!r}.")
        target_model, draft_model = build_tiny_pair(seed=seed)
        if quantize:
            target_model = quantized_copy(target_model, quantize)
        if quantize_draft:
            draft_model = quantized_copy(draft_model, quantize_draft)
        tokenizer = None
    else:
        target_model, tokenizer = load(target, dtype=dtype, quantize=quantize)
        draft_model, draft_tokenizer = load(draft, dtype=draft_dtype or dtype, quantize=quantize_draft)
        try:
            check_same_vocabulary(tokenizer, draft_tokenizer)
        except ValueError as error:
            raise ValueError(f"`draft` {draft!r} does not fit `target` {target!r}: {error}") from None
    pair = Pair(speculative(target_model), place_draft(draft_model, target_model, quantize_draft), tokenizer)
    if draft_vocab is not None:
        prune_vocabulary(pair.draft, draft_vocabulary(pair.draft, tokenizer, draft_vocab, draft_vocab_corpus))
    if optimize_kernels:
        pair.target_path = optimize(pair.target, role="target")
        pair.draft_path = optimize(pair.draft, role="steps")
    return pair


def _load_with_head(target: str, head_folder: str, dtype: torch.dtype, quantize: str | None,
                    optimize_kernels: bool, draft_vocab: int | None, seed: int) -> Pair:
    """`load_pair` with a saved `DraftHead` as the draft, checked against the target; its steps on torch's own
    kernels (its vocabulary is the one it was trained with)."""
    if draft_vocab is not None:
        raise ValueError(f"`draft_vocab` {draft_vocab}: a draft head keeps the output ids it was trained with "
                         f"(`hf-spec train-head --draft-vocab`).")
    if target == TINY:
        target_model, tokenizer = build_tiny_pair(seed=seed)[0], None
        target_model = quantized_copy(target_model, quantize) if quantize else target_model
    else:
        target_model, tokenizer = load(target, dtype=dtype, quantize=quantize)
    head = DraftHead.from_pretrained(head_folder).to(dtype=target_model.dtype, device=first_device(target_model))
    try:
        head.attach(target_model)
    except ValueError as error:
        raise ValueError(f"`draft` {head_folder!r} does not fit `target` {target!r}: {error}") from None
    pair = Pair(speculative(target_model), head.eval(), tokenizer)
    if optimize_kernels:
        pair.target_path = optimize(pair.target, role="target")
        pair.draft_path = optimize(pair.draft, path="dense", role="steps")
    return pair


def place_draft(draft: PreTrainedModel, target: PreTrainedModel, draft_quantization: str | None) -> PreTrainedModel:
    """The draft on the target's first device (a quantized draft was placed by its own ``device_map``)."""
    return draft if draft_quantization is not None else draft.to(first_device(target))
