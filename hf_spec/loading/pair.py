"""`load_pair`: a target and a draft that fit each other, loaded, quantized, placed and on their fastest CPU path, in
one call; `prepare_pair` does the same for models you loaded yourself.

What the command line does for every subcommand, as a library call for notebooks and scripts::

    >>> pair = load_pair()  # Qwen2.5-Coder-1.5B-Instruct drafted by the 0.5B; dtype and kernels chosen for this CPU
    >>> inputs = pair.tokenizer("def fibonacci(n):", return_tensors="pt")
    >>> pair.target.generate(**inputs, assistant_model=pair.draft, max_new_tokens=64)
    >>> print(pair.describe())  # the dtype and CPU forward path chosen, with what was measured

``$HF_SPEC_MODELS=tiny`` makes every loader here load the tiny pair in place of the built-in real models (how the
test suite runs the README's and the docs' examples); folders and Hub ids are left alone, and ``real`` or unset leaves
everything alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch
from transformers import PreTrainedModel

from hf_spec.drafting.model import ModelDrafter
from hf_spec.drafting.vocabulary import prune_vocabulary, pruned_size
from hf_spec.heads.base import DraftHeadBase
from hf_spec.heads.saved import head_kind, load_head
from hf_spec.loading import int8_rows, packed
from hf_spec.loading.cpu import cpu_class, cpu_flags, default_dtype
from hf_spec.loading.gguf_weights import GGUF, gguf_kernel
from hf_spec.loading.pretrained import DEFAULT_DRAFT, DEFAULT_TARGET, PACKAGED_MODELS, cache_dir, is_converted, load
from hf_spec.loading.quantization import SCHEMES, first_device, quantized_copy
from hf_spec.loading.tiny import (
    TINY_OTHER_TOKENIZER,
    build_tiny_other_tokenizer_draft,
    build_tiny_pair,
    tiny_other_tokenizer,
    tiny_tokenizer,
)
from hf_spec.loading.vocabulary import draft_vocabulary
from hf_spec.loading.weight_only import WEIGHT_ONLY_SCHEMES, adopt_torchao, check_runs_here, quantize_weights
from hf_spec.mixin import speculative
from hf_spec.sizing.draft_length import DEFAULT_MAX_DRAFT_TOKENS
from hf_spec.timing.probe import seed_costs
from hf_spec.validation import is_other_vocabulary

#: The name of the built-in random-weight pair (a character tokenizer, random text).
TINY = "tiny"
#: Forces notebooks and examples onto one pair: ``real`` (the names given) or ``tiny``.
MODELS_VARIABLE = "HF_SPEC_MODELS"
#: `load_pair`'s dtypes: ``"fastest"`` (bf16 where the hardware multiplies it natively, else float32), ``"auto"``
#: (transformers' meaning: the checkpoint's own; the built-in models are converted to float32), or a torch dtype.
DTYPES = ("fastest", "auto", "float32", "bfloat16", "float16")

logger = logging.getLogger(__name__)


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
    forced = _forced_models()
    if forced is not None:
        return forced == "real", f"${MODELS_VARIABLE}={forced}"
    cache = cache or cache_dir()
    if is_converted(DEFAULT_TARGET, cache) and is_converted(DEFAULT_DRAFT, cache):
        return True, f"the real pair is converted in {cache}"
    return False, f"the real pair is not converted in {cache} yet (`hf-spec generate` converts it once)"


@dataclasses.dataclass
class Pair:
    """A speculative target, its draft (a model or a draft head) on the target's first device, the target's
    tokenizer, the draft's own when its vocabulary differs (``draft_tokenizer``, else ``None``), and the CPU forward
    paths `hf_spec.loading.packed.optimize` chose (``None`` when not optimized)."""

    target: PreTrainedModel
    draft: PreTrainedModel
    tokenizer: object | None
    target_path: packed.CpuPath | None = None
    draft_path: packed.CpuPath | None = None
    draft_tokenizer: object | None = None

    def assistant(self) -> dict:
        """The ``generate()`` arguments that draft with this pair: ``assistant_model``, and for a draft of another
        tokenizer both tokenizers (`hf_spec.drafting.cross_tokenizer`)."""
        if self.draft_tokenizer is None:
            return {"assistant_model": self.draft}
        return {"assistant_model": self.draft, "tokenizer": self.tokenizer, "assistant_tokenizer": self.draft_tokenizer}

    def check_same_tokenizer(self, purpose: str) -> None:
        """Refuse a draft of another tokenizer where ``purpose`` needs the target's ids."""
        if self.draft_tokenizer is not None:
            raise ValueError(f"--draft {self.draft.name_or_path!r} has a tokenizer of its own; {purpose} needs a "
                             "draft that shares the target's.")

    def save(self, folder: str | Path) -> tuple[str, str]:
        """Save the target and the draft, each with its tokenizer, as ordinary checkpoints in ``folder/target`` and
        ``folder/draft`` (packed layers save their dense weights); returns the two folders."""
        folders = []
        for name, model, tokenizer in (("target", self.target, self.tokenizer),
                                       ("draft", self.draft, self.draft_tokenizer or self.tokenizer)):
            path = Path(folder) / name
            model.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
            folders.append(str(path))
        return folders[0], folders[1]

    def describe(self) -> str:
        full = self.draft.config.get_text_config().vocab_size
        vocabulary = pruned_size(self.draft) or getattr(self.draft.config, "draft_vocab_size", None)  # EAGLE-3's
        vocabulary = vocabulary if vocabulary != full else None
        kept = f", output layer {vocabulary} of {full} ids" if vocabulary else ""
        lines = [f"target: {self.target.name_or_path or TINY} ({_weights(self.target)}), "
                 f"draft: {self.draft.name_or_path or TINY} ({_weights(self.draft)}{kept})"]
        for role, path in (("target", self.target_path), ("draft", self.draft_path)):
            lines.append(f"{role} " + ("CPU forward path: stock (not optimized)" if path is None else path.describe()))
        return "\n".join(lines)


def load_pair(target: str = DEFAULT_TARGET, draft: str = DEFAULT_DRAFT, *, dtype: torch.dtype | str = "fastest",
              quantize: str | None = "auto", quantize_draft: str | None = "auto",
              draft_dtype: torch.dtype | None = None,
              optimize: bool = True, draft_vocab: int | None = None, draft_vocab_corpus: str | list[str] = "stdlib",
              draft_vocab_counts: str = "continuations", seed: int = 0) -> Pair:
    """Load ``target`` and ``draft`` (built-in names, local folders, Hub ids, ``"tiny"``, or for the draft
    ``"tiny-other-tokenizer"``, a tiny draft of another tokenizer; ``draft`` may also be a
    folder with a draft head trained for ``target``: a `DraftHead`, or an EAGLE-3 head in the speculators format),
    and prepare them as `prepare_pair` does.

    Args:
        dtype: weights of both models (the compute dtype of 4-bit layers), one of `DTYPES`. The tiny pair is always
            float32.
        optimize: put each model on its fastest CPU forward path (`hf_spec.loading.packed.optimize`: the target for
            verifying blocks, the draft for steps), chosen by measurement.
        quantize, quantize_draft: ``"int8"`` or ``"int4"`` (weight-only, on hf_spec's and torch's CPU kernels),
            ``"w8a8"`` (int8 weights and inputs quantized on the fly, where AVX512-VNNI runs), or a bitsandbytes scheme
            (``"8bit"``, ``"nf4"``, ``"fp4"``) for either model; a bitsandbytes target is spread by
            ``device_map="auto"``, and the draft goes to its first device; ``"gguf"``: the model's GGUF file's own
            blocks (a built-in model, `hf_spec.loading.gguf_weights`). ``quantize="auto"`` (the default) is
            ``"gguf"`` for a built-in model on a CPU class where the GGUF kernel measured fastest (`gguf_wins_here`),
            else ``None``; ``quantize_draft="auto"`` is ``"gguf"`` where the target took it and the draft is
            built in, else ``"w8a8"`` or ``"int8"`` for a bf16 draft where hf_spec's kernels run
            (`draft_quantization`), else ``None``: the draft's weights never change the target's law, only how often
            its tokens are accepted.
        draft_dtype: the draft's weights when they should differ (training keeps float32).
        draft_vocab: keep only the draft's N most frequent output ids (FR-Spec, `hf_spec.drafting.vocabulary`),
            counted on the target's greedy continuations of ``draft_vocab_corpus`` then on the corpus itself
            (``draft_vocab_counts="continuations"``), or on the corpus alone (``"text"``) (`hf_spec.loading.vocabulary`:
            counted once, cached by content).
        seed: seeds the tiny pair's weights.

    Raises:
        ValueError: a bad ``dtype``; a head built for another target; ``draft_vocab`` for a draft of another
            tokenizer (which is kept as ``Pair.draft_tokenizer``).
    """
    dtype = resolve_dtype(dtype)
    target, draft = model_name(target), model_name(draft)
    if quantize not in (None, "auto", *SCHEMES):
        raise ValueError(f"`quantize` must be None, 'auto' or one of {SCHEMES}, but is {quantize!r}.")
    quantize = (GGUF if gguf_wins_here(target) else None) if quantize == "auto" else quantize
    if quantize_draft == "auto" and quantize == GGUF and draft in PACKAGED_MODELS:
        quantize_draft = GGUF
    if quantize_draft not in (None, "auto", *SCHEMES):
        raise ValueError(f"`quantize_draft` must be None, 'auto' or one of {SCHEMES}, but is {quantize_draft!r}.")
    is_head = head_kind(draft) is not None
    if is_head and quantize_draft not in (None, "auto"):
        raise ValueError(f"`quantize_draft` {quantize_draft!r}: `draft` {draft!r} is a draft head, which keeps the "
                         "target's dtype; drop `quantize_draft`.")
    check_runs_here(quantize or "", "quantize")
    check_runs_here(quantize_draft or "", "quantize_draft")
    target_model, tokenizer = load_model(target, dtype=dtype, quantize=quantize, seed=seed)
    if is_head:
        if draft_vocab is not None:
            raise ValueError(f"`draft_vocab` {draft_vocab}: a draft head keeps the output ids it was trained with "
                             f"(`hf-spec train-head --draft-vocab`).")
        try:
            draft_model = load_head(draft, target_model)
        except ValueError as error:
            raise ValueError(f"`draft` {draft!r} does not fit `target` {target!r}: {error}") from None
    else:
        loaded_quantized = None if quantize_draft in (*WEIGHT_ONLY_SCHEMES, "auto") else quantize_draft  # bitsandbytes
        draft_model, draft_tokenizer = load_model(draft, dtype=draft_dtype or dtype, quantize=loaded_quantized,
                                                  seed=seed, role="draft")
        other_tokenizer = draft_tokenizer if is_other_vocabulary(tokenizer, draft_tokenizer) else None
        if draft_vocab is not None:
            if other_tokenizer is not None:
                raise ValueError(f"`draft_vocab` {draft_vocab}: `draft` {draft!r} has a tokenizer of its own, and a "
                                 "pruned vocabulary keeps target ids; drop `draft_vocab`.")
            kept = draft_vocabulary(draft_model, tokenizer, draft_vocab, draft_vocab_corpus, target=target_model,
                                    counted_on=draft_vocab_counts)
            prune_vocabulary(draft_model, kept)
        weight_only = draft_quantization(quantize_draft, draft_model, quantize)
        if weight_only is not None:  # after pruning, so that the pruned output layer is quantized too
            quantize_weights(draft_model, weight_only)
        pair = prepare_pair(target_model, draft_model, tokenizer, optimize=optimize)
        pair.draft_tokenizer = other_tokenizer
        return pair
    return prepare_pair(target_model, draft_model, tokenizer, optimize=optimize)


def _weights(model) -> str:
    """A model's dtype, and its weight-only scheme if it has one: ``"bfloat16"``, ``"bfloat16, int8 weights"``."""
    scheme = getattr(model, "hf_spec_weight_only", None)
    if scheme == GGUF:  # say which of the file's types the layers multiply by, as shipped
        kinds = sorted(set(model.config.quantization_config.modules.values()))
        return str(model.dtype).removeprefix("torch.") + f", the GGUF file's own {'/'.join(kinds)} blocks"
    return str(model.dtype).removeprefix("torch.") + (f", {scheme} weights" if scheme else "")


def prepare_pair(target: PreTrainedModel, draft: PreTrainedModel, tokenizer=None, *, optimize: bool = True) -> Pair:
    """Models you loaded yourself, ready to speculate: the target made `speculative`, the draft moved to the
    target's first device (a quantized draft stays where its ``device_map`` put it), layers torchao quantized to int8
    weight-only put on hf_spec's int8 kernels (`hf_spec.loading.weight_only.adopt_torchao`), and, with ``optimize``,
    each on its fastest CPU forward path (the target for verifying blocks, a draft model for its steps, 2-token
    catch-ups and prefills; a draft head keeps dense kernels with oneDNN switched off for its 1-token steps)."""
    for model in (target, draft):
        adopt_torchao(model)  # layers torchao quantized to int8 weight-only: the same weights on hf_spec's int8 kernels
    is_quantized = getattr(draft.config, "quantization_config", None) is not None
    draft = draft if is_quantized else draft.to(first_device(target))
    pair = Pair(speculative(target), draft, tokenizer)
    if optimize:
        pair.target_path = packed.optimize(pair.target, role="target")
        pair.draft_path = packed.optimize(pair.draft, path="dense" if isinstance(draft, DraftHeadBase) else "auto",
                                          role="draft")
        seed_pair_costs(pair.target, pair.draft)
    return pair


def seed_pair_costs(target: PreTrainedModel, draft) -> None:
    """The kernel timings `packed.optimize` made of both models become the costs auto k starts from, so that a first
    automatic call does not probe (`hf_spec.timing.probe.seed_costs`); nothing for a draft head or a model not
    timed."""
    target_path, draft_path = packed.cpu_path(target), packed.cpu_path(draft)
    if target_path is not None and draft_path is not None and not isinstance(draft, DraftHeadBase):
        seed_costs(target, ModelDrafter(draft), target_path.seconds.get(target_path.name, {}),
                   draft_path.seconds.get(draft_path.name, {}), DEFAULT_MAX_DRAFT_TOKENS + 1,
                   persist=target_path.quiet and draft_path.quiet)


#: The CPU classes (`hf_spec.loading.cpu.cpu_class`) where a built-in model runs fastest on its GGUF file's blocks, by
#: measurement (benchmarks/RESULTS.md): on AMD EPYC AVX2 a target step took 65-80 ms on the blocks against 341 ms in
#: float32. Not measured on the other classes yet: they keep their float (and int8 / w8a8 draft) defaults.
GGUF_CLASSES = ("AVX2",)


def gguf_wins_here(name: str) -> bool:
    """Whether ``quantize="auto"`` loads the built-in model ``name`` on its GGUF blocks here (`GGUF_CLASSES`, the
    kernel builds)."""
    return name in PACKAGED_MODELS and cpu_class(cpu_flags()[1]) in GGUF_CLASSES and gguf_kernel() is not None


def draft_quantization(quantize_draft: str | None, draft: PreTrainedModel, quantize: str | None = None
                       ) -> str | None:
    """The scheme of hf_spec's CPU kernels to apply to the loaded ``draft``: ``quantize_draft`` if it is one, or for
    ``"auto"``, on a bf16 draft, ``"w8a8"`` where its kernel runs (AVX512-BF16 and AVX512-VNNI, a C++ build;
    `hf_spec.loading.int8_rows`, built once per machine on first use), else ``"int8"`` where the rows kernel runs,
    else ``None``.

    An int8 draft step reads half the bytes of a bf16 one (on AMD EPYC AVX512-BF16 the 0.5B draft's step fell from
    45 to 28 ms) and is accepted about as often, so each round costs less; w8a8 also multiplies on integer dot
    products, which made the step, the 2-token catch-up and the prefill cheaper again (29.5, 34.3 and 330 ms against
    34.8, 39.1 and 520 ms for int8, same process) at the same perplexity. A bitsandbytes target keeps a bf16 draft
    (it may sit on an accelerator, where the kernels do not run)."""
    if quantize_draft != "auto":
        return quantize_draft if quantize_draft in WEIGHT_ONLY_SCHEMES else None
    on_cpu = quantize is None or quantize in WEIGHT_ONLY_SCHEMES
    if draft.dtype != torch.bfloat16 or not on_cpu or int8_rows.why_not() is not None:
        return None
    return "w8a8" if int8_rows.dynamic_kernel() is not None else "int8"


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    """A torch dtype, or ``"auto"`` (the checkpoint's); ``"fastest"`` becomes this machine's
    (`hf_spec.loading.cpu.default_dtype`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be a torch.dtype or one of {DTYPES}, but is {dtype!r}.")
    if dtype == "fastest":
        return default_dtype()
    return dtype if dtype == "auto" else getattr(torch, dtype)


def load_model(name: str, *, dtype: torch.dtype | str = "fastest", quantize: str | None = None, seed: int = 0,
               role: str = "target") -> tuple[PreTrainedModel, object]:
    """``(model, tokenizer)`` of a built-in name, folder or Hub id; for ``"tiny"``, the tiny pair's target or draft
    (``role``)."""
    name = model_name(name)
    if name == TINY_OTHER_TOKENIZER:
        model, tokenizer = build_tiny_other_tokenizer_draft(seed), tiny_other_tokenizer()
    elif name == TINY:
        model, tokenizer = build_tiny_pair(seed=seed)[0 if role == "target" else 1], tiny_tokenizer()
    else:
        return load(name, dtype=resolve_dtype(dtype), quantize=quantize)
    return (quantized_copy(model, quantize) if quantize else model), tokenizer


def model_name(name: str) -> str:
    """The name a loader uses: ``"tiny"`` in place of a built-in real model under ``$HF_SPEC_MODELS=tiny``."""
    if _forced_models() == TINY and name in PACKAGED_MODELS:
        tiny = TINY_OTHER_TOKENIZER if PACKAGED_MODELS[name].own_tokenizer else TINY
        logger.info("$%s=tiny: %s in place of %s", MODELS_VARIABLE, tiny, name)
        return tiny
    return name


def _forced_models() -> str | None:
    forced = os.environ.get(MODELS_VARIABLE)
    if forced not in (None, "real", TINY):
        raise ValueError(f"${MODELS_VARIABLE} must be 'real' or {TINY!r}, but is {forced!r}.")
    return forced
