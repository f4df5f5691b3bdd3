"""Quantized targets (and drafts) through bitsandbytes: a scheme name becomes transformers' `BitsAndBytesConfig`.

Speculative decoding asks nothing special of a quantized model. Its p is whatever the quantized model computes, so
the output law is exactly that of target-only decoding *with the quantized target*; how far that is from the
full-precision model is the quantization's business, not ours (tested in ``tests/test_quantized.py``). Plain
``from_pretrained`` arguments are all it takes::

    target = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization_config("nf4"),
                                                  device_map="auto")
    draft = AutoModelForCausalLM.from_pretrained(draft_path).to(first_device(target))
    speculative(target).generate(**inputs, assistant_model=draft, do_sample=True)

``hf_spec.loading.pretrained.load(name, quantize="nf4")`` does the same for built-in names, and ``hf-spec ...
--quantize`` on the command line. With ``device_map="auto"`` accelerate spreads the target over the visible devices
(on a machine with only a CPU, all of it goes there); its logits come back on its first device, where the draft must
live.

Which CPU matters for 4-bit layers. bitsandbytes has two CPU paths:

- **AVX512-BF16 (or AMX)**: at the first forward pass each 4-bit layer repacks its weights for a fused kernel
  (`bitsandbytes.functional._convert_weight_packed_for_cpu`), which computes in bf16 whatever the compute dtype and
  needs ``in_features`` a multiple of the block size (64) and ``out_features`` a multiple of 32. Any other shape
  crashes mid-forward with a reshape error and leaves that layer half converted.
- **AVX2 only**: every forward dequantizes the weights (slow: several times a bf16 step, docs/quantization.md), any
  shape.

`check_quantizable` refuses, before anything is quantized, a model whose layers the first path cannot take on this
CPU, naming the layer and its size. 8-bit layers have no such limit.
"""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path

import torch
from transformers import BitsAndBytesConfig, PretrainedConfig, PreTrainedModel

from hf_spec.compat import modules_kept_in_full_precision
from hf_spec.extras import require_extra
from hf_spec.loading.gguf_weights import GGUF
from hf_spec.loading.weight_only import WEIGHT_ONLY_SCHEMES, quantize_weights

#: ``8bit``: LLM.int8 weights; ``nf4`` / ``fp4``: 4-bit weights of that data type (blocks of 64, fp32 scales);
#: ``int8`` / ``int4``: weight-only layers on torch's own CPU kernels (`hf_spec.loading.weight_only`).
BITSANDBYTES_SCHEMES = ("8bit", "nf4", "fp4")
SCHEMES = (*BITSANDBYTES_SCHEMES, *WEIGHT_ONLY_SCHEMES, GGUF)

#: bitsandbytes' 4-bit block size (its default, which `quantization_config` keeps).
BLOCK_SIZE = 64
#: Output rows the fused AVX512-BF16 CPU kernel packs together.
PACKED_ROWS = 32


def quantization_config(scheme: str, compute_dtype: torch.dtype = torch.float32) -> BitsAndBytesConfig:
    """The `BitsAndBytesConfig` of a bitsandbytes ``scheme``; 4-bit layers compute in ``compute_dtype``."""
    if scheme in WEIGHT_ONLY_SCHEMES:
        raise ValueError(f"{scheme!r} is quantized by hf_spec on torch's kernels, not by bitsandbytes: "
                         "`hf_spec.loading.weight_only.quantize_weights` (or `quantized_copy`).")
    if scheme == GGUF:
        raise ValueError("'gguf' takes a model's weights from its GGUF file, not from bitsandbytes: "
                         "`hf_spec.loading.gguf_weights.adopt_gguf` (or `load_pair(quantize='gguf')`).")
    if scheme in SCHEMES:
        require_extra("quantization", f"Quantizing with {scheme!r}")
    if scheme == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    if scheme in ("nf4", "fp4"):
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=scheme, bnb_4bit_compute_dtype=compute_dtype)
    raise ValueError(f"`quantize` must be one of {SCHEMES}, but is {scheme!r}.")


def first_device(model: PreTrainedModel) -> torch.device:
    """Where ``model`` takes its inputs and, under an accelerate ``device_map``, returns its logits: the device of
    its input embeddings. The draft goes there."""
    return model.get_input_embeddings().weight.device


def quantization_of(model: PreTrainedModel) -> str | None:
    """How ``model``'s weights are quantized: one of `SCHEMES` for bitsandbytes, another library's ``quant_method``
    (``"gptq"``, ...), or ``None`` for an unquantized model."""
    config = getattr(model.config, "quantization_config", None)
    if config is None:
        return getattr(model, "hf_spec_weight_only", None)
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if config.get("quant_method") == "hf_spec":  # hf_spec's own weight-only layers (`hf_spec.saved_layers`)
        return str(config.get("scheme"))
    if config.get("load_in_8bit"):
        return "8bit"
    if config.get("load_in_4bit"):
        return config.get("bnb_4bit_quant_type", "fp4")
    return str(config.get("quant_method", "quantized"))


def quantized_copy(model: PreTrainedModel, scheme: str, compute_dtype: torch.dtype = torch.float32,
                   **from_pretrained_kwargs) -> PreTrainedModel:
    """A copy of an in-memory ``model`` with its linear layers quantized by ``scheme``: saved to a temporary folder
    and loaded back through ``from_pretrained`` (``device_map="auto"`` unless given), as a checkpoint would be; a
    weight-only scheme (``"int8"``, ``"int4"``) quantizes a deep copy in place."""
    if scheme in WEIGHT_ONLY_SCHEMES:
        return quantize_weights(copy.deepcopy(model), scheme)
    if scheme == GGUF:
        return gguf_copy(model)
    quantization = quantization_config(scheme, compute_dtype)  # checks `scheme` before any work
    check_quantizable(model, scheme, from_pretrained_kwargs.get("device_map", "auto"))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        kwargs = {"device_map": "auto", "dtype": compute_dtype, **from_pretrained_kwargs}
        return type(model).from_pretrained(folder, quantization_config=quantization, **kwargs).eval()


def gguf_copy(model: PreTrainedModel, kind: str = "Q4_0") -> PreTrainedModel:
    """A copy of an in-memory Llama or Qwen2 ``model`` written to a GGUF file (its linear layers in ``kind``,
    `hf_spec.loading.gguf_writer`) and loaded back on that file's blocks, as a GGUF checkpoint would be."""
    from transformers import AutoModelForCausalLM

    from hf_spec.compat import drop_gguf_quantizer
    from hf_spec.loading.gguf_writer import write_gguf
    from hf_spec.loading.gguf_weights import adopt_gguf

    with tempfile.TemporaryDirectory() as folder:
        write_gguf(model, Path(folder) / "model.gguf", kind)
        copied = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=model.dtype).eval()
        drop_gguf_quantizer(copied)
        copied.generation_config = copy.deepcopy(model.generation_config)
        copied.name_or_path = model.name_or_path  # not the temporary folder
        adopt_gguf(copied, Path(folder) / "model.gguf")
    return copied


@functools.cache
def packs_4bit_for_cpu() -> bool:
    """Whether bitsandbytes runs 4-bit layers on this CPU through its fused AVX512-BF16 kernel (repacked weights,
    shape limits), rather than by dequantizing them."""
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


def check_quantizable(model: PreTrainedModel | PretrainedConfig, scheme: str, device_map=None) -> None:
    """Refuse ``model`` (or a model built from this config) if bitsandbytes cannot run it quantized by ``scheme`` on
    this machine; nothing is quantized or changed.

    The limit: on a CPU with AVX512-BF16, 4-bit layers need ``in_features % 64 == 0`` and ``out_features % 32 == 0``
    (see the module docstring). It applies where the layers will run on the CPU: ``device_map`` ``"cpu"`` or
    ``{"": "cpu"}``, or ``"auto"``/``None`` on a machine without CUDA.

    Raises:
        ValueError: naming the first layer that does not fit, its size, and what to do.
    """
    if scheme in (*WEIGHT_ONLY_SCHEMES, GGUF):
        return
    quantization_config(scheme)  # checks the name
    if scheme == "8bit" or not _runs_on_cpu(device_map) or not packs_4bit_for_cpu():
        return
    if isinstance(model, PretrainedConfig):
        model = _empty_model(model)
    skipped = set(modules_kept_in_full_precision(model))
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name in skipped:
            continue
        if module.in_features % BLOCK_SIZE or module.out_features % PACKED_ROWS:
            raise ValueError(
                f"`quantize={scheme!r}`: bitsandbytes cannot run layer {name!r} ({module.in_features} -> "
                f"{module.out_features} features) in 4 bits on this CPU. With AVX512-BF16 it repacks 4-bit weights "
                f"for a fused kernel that needs in_features divisible by {BLOCK_SIZE} and out_features divisible by "
                f"{PACKED_ROWS}. Use '8bit', or a model whose hidden sizes are multiples of {BLOCK_SIZE}."
            )


def _runs_on_cpu(device_map) -> bool:
    if device_map in (None, "auto"):
        return not torch.cuda.is_available()
    if isinstance(device_map, dict):
        return any(str(device) == "cpu" for device in device_map.values())
    return str(device_map) == "cpu"


def _empty_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model of ``config`` with its weights on the meta device (no memory): enough to read layer shapes."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)
