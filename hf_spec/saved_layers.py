"""Models on hf_spec's quantized layers saved and loaded as transformers does any quantized model: method "hf_spec".

`mark_quantized` (called by `hf_spec.loading.weight_only.quantize_weights` and
`hf_spec.loading.gguf_weights.adopt_gguf`) gives the model a ``config.quantization_config`` (`WeightOnlyConfig`: the
scheme and each layer's bits, or a GGUF layer's ggml type) and a quantizer, so that ``save_pretrained`` writes every
layer in its saved form (the same on every CPU: `WeightOnlyLinear.saved_state`, a GGUF layer's blocks) beside that
config, and ``from_pretrained`` (with hf_spec imported: importing it registers the method; the layers' module is
imported when such a model loads) builds the same layers before the weights load and puts them in this CPU's layout
after: the model that was saved, computing what it computed.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PreTrainedModel
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

#: The ``quant_method`` of a saved model's ``quantization_config``.
METHOD = "hf_spec"


@register_quantization_config(METHOD)
class WeightOnlyConfig(QuantizationConfigMixin):
    """``scheme`` (``"int8"``, ``"int4"``, ``"w8a8"`` or ``"gguf"``) and ``modules``: each quantized layer's name and
    bits (a GGUF file's layers: their ggml type's name)."""

    def __init__(self, scheme: str = "int8", modules: dict[str, int | str] | None = None, **kwargs: Any):
        self.quant_method = METHOD
        self.scheme = scheme
        self.modules = dict(modules or {})


@register_quantizer(METHOD)
class WeightOnlyQuantizer(HfQuantizer):
    """Loads a saved model's `WeightOnlyLinear` layers (it never quantizes: `quantize_weights` does)."""

    requires_calibration = True  # only a model saved quantized loads with it

    def validate_environment(self, *args, **kwargs) -> None:
        device_map = kwargs.get("device_map")
        devices = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
        if devices - {None, "cpu", "auto"}:
            raise ValueError(f"A model saved with hf_spec's weight-only layers runs on torch's CPU kernels, but "
                             f"`device_map` is {device_map!r}; load it on the CPU.")

    def param_needs_quantization(self, model: PreTrainedModel, param_name: str, **kwargs) -> bool:
        return False

    def _process_model_before_weight_loading(self, model: PreTrainedModel, **kwargs) -> PreTrainedModel:
        from hf_spec.loading.gguf_weights import TYPES, GGUFLinear
        from hf_spec.loading.weight_only import WeightOnlyLinear

        ggml_types = {name: type_id for type_id, (name, _, _) in TYPES.items()}
        config = self.quantization_config
        dtype = kwargs.get("dtype") or model.dtype
        for name, bits in config.modules.items():
            parent_name, _, child_name = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, child_name)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"The saved model's quantization_config names {name!r} as a quantized linear layer, "
                                 f"but the model built from its config has a {type(linear).__name__} there.")
            if isinstance(bits, str):  # a GGUF file's blocks, of this ggml type
                layer = GGUFLinear.to_load(linear.in_features, linear.out_features, ggml_types[bits],
                                           linear.bias is not None, dtype)
            else:
                layer = WeightOnlyLinear.to_load(linear.in_features, linear.out_features, bits,
                                                 config.scheme == "w8a8", linear.bias is not None, dtype)
            setattr(parent, child_name, layer)
        return model

    def _process_model_after_weight_loading(self, model: PreTrainedModel, **kwargs) -> PreTrainedModel:
        for module in model.modules():
            if hasattr(module, "unpack"):  # weight-only layers: from the saved form to this CPU's layout
                module.unpack()
        model.hf_spec_weight_only = self.quantization_config.scheme
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def mark_quantized(model: nn.Module, scheme: str) -> None:
    """Give a transformers model on hf_spec's quantized layers (those with a ``saved_kind``: bits, or a ggml type's
    name) the quantization config and quantizer through which ``save_pretrained`` writes them and ``from_pretrained``
    reads them back (other modules: nothing to do)."""
    if not isinstance(model, PreTrainedModel):
        return
    modules = {name: module.saved_kind for name, module in model.named_modules() if hasattr(module, "saved_kind")}
    config = WeightOnlyConfig(scheme, modules)
    model.config.quantization_config = config
    model.hf_quantizer = WeightOnlyQuantizer(config, pre_quantized=True)
