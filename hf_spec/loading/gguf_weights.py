"""A GGUF file's own quantized weights, never widened: the linear layers of a model loaded from the file multiply by the
file's blocks on hf_spec's CPU kernel.

transformers' ``from_pretrained(gguf_file=...)`` dequantizes every weight to float (a 1.1 GB Q4_K_M file becomes 6 GB of
float32 or 3 GB of bf16, all read at every step). `adopt_gguf` puts each linear layer whose weight the file holds in a
supported type back on the file's bytes (`GGUFLinear`): ggml's blocks, one output row after another, as in the file
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), multiplied by ``kernels/gguf_mm.cpp`` with the activations quantized
on the fly to int8 per block (256 inputs for the K types, 32 for the others, as llama.cpp does; each row from itself:
a verify pass computes each position as a one-token step would). Which file tensor is which layer comes from
transformers' own GGUF name map (and its row order for Llama's q and k); every layer is checked against the model's
float weights (two rows dequantized by the ``gguf`` package must equal them exactly), and a layer that does not match,
or whose type the kernel does not take, keeps its float weight.

The kernel runs on x86 CPUs with AVX2, FMA and F16C (built on first use by torch's extension loader and cached per
machine, like `hf_spec.loading.int8_rows`); elsewhere (`why_not`) models keep their float weights, as before.
``HF_SPEC_GGUF_KERNEL=0`` keeps them too.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from hf_spec.loading.cpu import cpu_flags, release_freed_memory

logger = logging.getLogger(__name__)

#: The ``quantize=`` scheme that loads a model's linear layers from its GGUF file's blocks.
GGUF = "gguf"
#: The C++ source of the kernel.
SOURCE = Path(__file__).with_name("kernels") / "gguf_mm.cpp"
#: ``0`` keeps GGUF models on their float weights; ``1``, the default, takes the kernel where it runs.
SWITCH = "HF_SPEC_GGUF_KERNEL"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
#: ggml's type ids the kernel takes -> (name, inputs per block, bytes per block).
TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
         12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
_BUILDING = threading.Lock()


@functools.cache
def _build() -> tuple[object | None, str | None]:
    with _BUILDING:
        switch = os.environ.get(SWITCH, "1")
        if switch not in ("0", "1"):
            raise ValueError(f"`{SWITCH}` must be '0' (float weights) or '1' (the GGUF kernel where it runs), but is "
                             f"{switch!r}.")
        if switch == "0":
            return None, f"{SWITCH}=0"
        missing = {"avx2", "fma", "f16c"} - cpu_flags()[1]
        if missing:
            return None, f"this CPU has no {', '.join(sorted(missing)).upper()}"
        from torch.utils.cpp_extension import load

        try:
            module = load("hf_spec_gguf_mm", [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"])
        except (OSError, RuntimeError, ImportError, SystemExit) as error:  # no compiler, no ninja, a failed build
            return None, f"building {SOURCE.name} failed ({type(error).__name__}: {str(error).strip()[:200]})"
        return module, None


def gguf_kernel() -> object | None:
    """The compiled module (``gguf_mm(x, blocks, type)``), or ``None`` where it cannot run here (`why_not`)."""
    module, reason = _build()
    if module is None and reason.startswith("building"):
        _warn_once(reason)
    return module


def why_not() -> str | None:
    """Why `gguf_kernel` is ``None``, or ``None`` when it runs."""
    return _build()[1]


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"GGUF models keep their float weights: {reason}.", stacklevel=3)


@torch.library.custom_op("hf_spec::gguf_mm", mutates_args=())
def gguf_mm(rows: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The kernel as a torch operator, so that ``torch.compile`` keeps a layer in its graph: ``rows`` ``[M, K]``
    float32 or bf16, ``blocks`` ``[N, K / block * bytes]`` -> ``[M, N]``."""
    return gguf_kernel().gguf_mm(rows, blocks, ggml_type)


@gguf_mm.register_fake
def _(rows: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], blocks.shape[0]))


class GGUFLinear(nn.Module):
    """A linear layer whose weight is a GGUF file's blocks (``blocks`` ``[out, in / block * bytes]`` uint8, ggml type
    ``ggml_type``), with an optional float ``bias``."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        if ggml_type not in TYPES:
            raise ValueError(f"`ggml_type` {ggml_type} is not one the kernel takes ({sorted(TYPES)}).")
        name, inputs, size = TYPES[ggml_type]
        if in_features % inputs or blocks.dim() != 2 or blocks.shape[1] != in_features // inputs * size:
            raise ValueError(f"{name} blocks of shape {tuple(blocks.shape)} do not hold rows of {in_features} inputs.")
        self.ggml_type, self.type_name = ggml_type, name
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        taken = (rows if rows.dtype in (torch.float32, torch.bfloat16) else rows.float()).contiguous()
        if torch.compiler.is_compiling():  # a graph holds the op (`compile_config`); eager calls skip the dispatcher
            out = gguf_mm(taken, self.blocks, self.ggml_type).to(x.dtype)
        else:
            out = gguf_kernel().gguf_mm(taken, self.blocks, self.ggml_type).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def select_rows(self, rows: torch.Tensor) -> GGUFLinear:
        """A layer of these output ``rows`` only (a pruned vocabulary's output layer): the file's blocks of them."""
        return GGUFLinear(self.blocks[rows], self.ggml_type, self.in_features,
                          None if self.bias is None else self.bias[rows])

    @classmethod
    def to_load(cls, in_features: int, out_features: int, ggml_type: int, bias: bool,
                dtype: torch.dtype) -> GGUFLinear:
        """An empty layer of this shape and type, for a loader to fill (`hf_spec.saved_layers`)."""
        _, inputs, size = TYPES[ggml_type]
        blocks = torch.empty((out_features, in_features // inputs * size), dtype=torch.uint8)
        return cls(blocks, ggml_type, in_features, torch.empty(out_features, dtype=dtype) if bias else None)

    def dequantized(self) -> torch.Tensor:
        """The weight ``[out, in]`` the file defines, in float32 (the ``gguf`` package's dequantization)."""
        import gguf

        values = gguf.quants.dequantize(self.blocks.numpy(), gguf.GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.out_features, -1)

    @property
    def saved_kind(self) -> str:
        """What `hf_spec.saved_layers` records of this layer: its ggml type's name."""
        return self.type_name

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.type_name}"


def activation_block(ggml_type: int) -> int:
    """Inputs per activation scale when multiplying by weights of ``ggml_type``: a block of 256 for the K types (as
    ggml's Q8_K), of 32 otherwise (as its Q8_0)."""
    return 256 if TYPES[ggml_type][1] == 256 else 32


def reference_mm(rows: torch.Tensor, layer: GGUFLinear) -> torch.Tensor:
    """What the kernel computes for ``rows`` ``[M, K]``, in float64 from the file's dequantized weights (the ``gguf``
    package) and the rows quantized as the kernel quantizes them (per `activation_block`, round half to even): the
    tests' reference. No bias."""
    block = activation_block(layer.ggml_type)
    groups = rows.double().view(rows.shape[0], -1, block)  # [M, B, block]
    scales = groups.abs().amax(dim=-1) / 127  # [M, B]
    codes = torch.where(scales[..., None] > 0, groups / scales[..., None], 0.0).round().clamp(-127, 127)
    weights = layer.dequantized().double().view(layer.out_features, -1, block)  # [N, B, block]
    return torch.einsum("mbi,nbi,mb->mn", codes, weights, scales)


def adopt_gguf(model: nn.Module, gguf_file: str | Path) -> dict[str, str]:
    """Put each linear layer of ``model`` (loaded from ``gguf_file`` by transformers, its weights dequantized) whose
    weight the file holds in a type the kernel takes on the file's blocks, in place. Returns ``{layer: type}`` of the
    layers that changed (empty where the kernel does not run here: `why_not`); other layers keep their weights.

    Raises:
        ValueError: the file does not hold the model's weights (no layer's rows equal the file's).
    """
    if gguf_kernel() is None:
        return {}
    tensors = _file_tensors(Path(gguf_file))
    layers = {name: module for name, module in model.named_modules() if type(module) is nn.Linear}
    names = _file_names(model)
    adopted: dict[str, str] = {}
    mismatched = []
    for name, layer in layers.items():
        file_name = names.get(f"{name}.weight")
        if file_name not in tensors and layer is getattr(model, "get_output_embeddings", lambda: None)():
            file_name = "token_embd.weight"  # a tied output layer: the file holds the embedding once
        found = tensors.get(file_name)
        if found is None or found[0] not in TYPES:
            continue
        ggml_type, blocks = found
        order = _row_order(model, file_name, layer.out_features)
        rows = torch.from_numpy(np.array(blocks[order] if order is not None else blocks))  # a copy of the map
        candidate = GGUFLinear(rows, ggml_type, layer.in_features, layer.bias)
        if not _matches(candidate, layer.weight):
            mismatched.append(name)
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, candidate)
        adopted[name] = TYPES[ggml_type][0]
        if file_name == "token_embd.weight":  # the output layer on the blocks, the input embedding on its float rows:
            for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
                config.tie_word_embeddings = False  # no longer one weight (a saved model loads them apart)
    if mismatched and not adopted:
        raise ValueError(f"`gguf_file` {str(gguf_file)!r} does not hold this model's weights: no layer's rows equal "
                         f"the file's (first tried: {mismatched[0]!r}).")
    if mismatched:
        logger.warning("GGUF layers %s kept their float weights: their rows differ from the file's.", mismatched)
    if adopted:
        from hf_spec.saved_layers import mark_quantized

        model.hf_spec_weight_only = GGUF
        mark_quantized(model, GGUF)
        release_freed_memory()
    return adopted


def _file_tensors(path: Path) -> dict[str, tuple[int, np.ndarray]]:
    """The file's tensors by name: ``(ggml type id, [rows, bytes per row] uint8)`` (memory-mapped, then copied by
    the layers that take them)."""
    import gguf

    reader = gguf.GGUFReader(path)
    found = {}
    for tensor in reader.tensors:
        type_id = int(tensor.tensor_type)
        if type_id not in TYPES:
            found[tensor.name] = (type_id, None)
            continue
        rows = int(np.prod([int(size) for size in tensor.shape[1:]]))
        found[tensor.name] = (type_id, np.asarray(tensor.data).reshape(rows, -1))
    return found


def _file_names(model: nn.Module) -> dict[str, str]:
    """The model's parameter names -> the file's tensor names (transformers' own GGUF map)."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    return {hf: file for file, hf in get_gguf_hf_weights_map(model, TensorProcessor()).items()}


def _row_order(model: nn.Module, file_name: str, rows: int) -> np.ndarray | None:
    """The file's row index of each of the layer's rows where transformers reorders them when it loads the file
    (Llama's q and k: `LlamaTensorProcessor`), else ``None``."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    model_type = model.config.model_type
    processor_class = TENSOR_PROCESSORS.get(model_type)
    if processor_class is None or model_type != "llama":
        return None
    text = model.config.get_text_config()
    processor = processor_class(config={"num_attention_heads": text.num_attention_heads,
                                        "num_key_value_heads": text.num_key_value_heads})
    return processor.process(np.arange(rows)[:, None], file_name).weights[:, 0]


def _matches(layer: GGUFLinear, weight: torch.Tensor) -> bool:
    """Whether the file's first and last rows, dequantized, equal the layer's float weight rows exactly (transformers
    dequantized this file with the same code)."""
    import gguf

    kind = gguf.GGMLQuantizationType(layer.ggml_type)
    for row in (0, layer.out_features - 1):
        values = torch.from_numpy(np.asarray(gguf.quants.dequantize(layer.blocks[row:row + 1].numpy(), kind),
                                             dtype=np.float32)).view(-1)
        if values.shape != weight[row].shape or not torch.equal(values.to(weight.dtype), weight[row].detach()):
            return False
    return True
