"""Quantized targets (and drafts) through bitsandbytes: a scheme name becomes transformers' `BitsAndBytesConfig`.

Speculative decoding asks nothing special of a quantized model. Its p is whatever the quantized model computes, so
the output law is exactly that of target-only decoding *with the quantized target*; how far that is from the
full-precision model is the quantization's business, not ours (tested in ``tests/test_quantized.py``). Plain
``from_pretrained`` arguments are all it takes::

    target = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization_config("nf4"),
                                                  device_map="auto")
    draft = AutoModelForCausalLM.from_pretrained(draft_path).to(first_device(target))
    speculative(target).generate(**inputs, assistant_model=draft, do_sample=True)

``hf_spec.pretrained.load(name, quantize="nf4")`` does the same for built-in names, and ``hf-spec ... --quantize``
on the command line. With ``device_map="auto"`` accelerate spreads the target over the visible devices (on a machine
with only a CPU, all of it goes there); its logits come back on its first device, where the draft must live.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import BitsAndBytesConfig, PreTrainedModel

#: ``8bit``: LLM.int8 weights; ``nf4`` / ``fp4``: 4-bit weights of that data type (blocks of 64, fp32 scales).
SCHEMES = ("8bit", "nf4", "fp4")


def quantization_config(scheme: str, compute_dtype: torch.dtype = torch.float32) -> BitsAndBytesConfig:
    """The `BitsAndBytesConfig` of ``scheme`` (one of `SCHEMES`); 4-bit layers compute in ``compute_dtype``."""
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
        return None
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if config.get("load_in_8bit"):
        return "8bit"
    if config.get("load_in_4bit"):
        return config.get("bnb_4bit_quant_type", "fp4")
    return str(config.get("quant_method", "quantized"))


def quantized_copy(model: PreTrainedModel, scheme: str, compute_dtype: torch.dtype = torch.float32,
                   **from_pretrained_kwargs) -> PreTrainedModel:
    """A copy of an in-memory ``model`` with its linear layers quantized by ``scheme``: saved to a temporary folder
    and loaded back through ``from_pretrained`` (``device_map="auto"`` unless given), as a checkpoint would be."""
    quantization = quantization_config(scheme, compute_dtype)  # checks `scheme` before any work
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        kwargs = {"device_map": "auto", "dtype": compute_dtype, **from_pretrained_kwargs}
        return type(model).from_pretrained(folder, quantization_config=quantization, **kwargs).eval()
