"""Weight-only int8 and int4 linear layers on CPU kernels, for targets and drafts at the memory limit.

A decoding step on a CPU reads every weight once, so its time follows the bytes read: a 1.5B model reads 3.1 GB a step
in bf16, 1.5 GB in int8, 0.8 GB in int4. `quantize_weights` replaces a model's ``nn.Linear`` layers, in place, by
`WeightOnlyLinear` layers that keep the weights in fewer bits; activations stay in the model's dtype. int8 (one scale
per output row, symmetric) multiplies a few rows of bf16 activations with `hf_spec.loading.int8_rows` where it runs
(AVX512-BF16; each weight read once for all rows, from tiles laid out for it), and with ``aten._weight_int8pack_mm``
elsewhere; int4 (groups of `INT4_GROUP` inputs, a scale and a zero point each) with
``aten._weight_int4pack_mm_for_cpu``.

Speculative decoding asks nothing of a quantized model: its p is what the quantized model computes, so the output
law is that of target-only decoding with the quantized target (`tests/test_quantized.py`). How far a quantized model
is from the one it was made from is measured separately (perplexity and greedy agreement with the unquantized model:
``scripts/weight_only_costs.py`` for the built-in pair).

The schemes:

- ``"int8"``: every linear layer, the output layer included, int8;
- ``"int4"``: every linear layer int4, the output layer int8 (the layer whose rounding moves the logits most);
- ``"w8a8"``: every linear layer's weights int8 as in ``"int8"``, and its inputs quantized on the fly to int8, each
  row per group of `hf_spec.loading.int8_rows.GROUP` inputs (scale: the group's largest magnitude over 127), so that
  the multiply runs on integer dot products (AVX512-VNNI, `hf_spec.loading.int8_rows.dynamic_kernel`). A row's codes
  depend on that row alone and its group sums are exact integers, so a verify pass computes each position exactly as
  a step would. Runs only where the kernel does; it rounds more of the model than ``"int8"`` does (measure it as
  above).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_spec.loading.int8_rows import (
    GROUP,
    dynamic_kernel,
    fits,
    fits_dynamic,
    from_vnni_tiles,
    rows_kernel,
    tiles,
    untiled,
    vnni_tiles,
    why_not,
)
from hf_spec.loading.packed import deoptimize

#: The schemes on hf_spec's CPU kernels (bitsandbytes' are in `hf_spec.loading.quantization`): weight-only int8 and
#: int4, and int8 weights with activations quantized on the fly (``"w8a8"``).
WEIGHT_ONLY_SCHEMES = ("int8", "int4", "w8a8")
#: Inputs per int4 group (a scale and a zero point each): torch's CPU kernel takes 32, 64, 128 or 256.
INT4_GROUP = 32
#: From this many rows on (a prompt's pass), an int8 layer multiplies by its int8 weight cast to the activations' dtype
#: and scales the result: the int8 kernels are made for a few rows, and a prompt's pass of many rows runs faster
#: through the dense matmul (docs/quantization.md).
DENSE_ROWS = 16
#: Tiles (of `hf_spec.loading.int8_rows.TILE` outputs) cast together in a prompt's pass: 1,024 outputs, a few MB.
DENSE_TILES = 256


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes ``[out, in]`` and float32 scales ``[out]`` of a float32 weight ``[out, in]``, one scale per
    output row."""
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127  # [out]
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


class WeightOnlyLinear(nn.Module):
    """A linear layer whose weights are int8 (per output row) or int4 (per group of `INT4_GROUP` inputs).

    Buffers: ``weight_int8`` ``[out, in]`` (or, where the int8 rows kernel runs, ``weight_tiles``, its layout of them:
    `hf_spec.loading.int8_rows.tiles`; with ``dynamic`` where its kernel runs, ``weight_vnni``:
    `hf_spec.loading.int8_rows.vnni_tiles`) and ``scales`` ``[out]``; or ``weight_int4`` (torch's CPU packing of
    ``[out, in]``) and ``scales_and_zeros`` ``[in / group, out, 2]``; ``bias`` ``[out]`` or ``None``.
    """

    def __init__(self, linear: nn.Linear, bits: int, int8: tuple[torch.Tensor, torch.Tensor] | None = None,
                 dynamic: bool = False):
        """``int8``: the codes ``[out, in]`` and scales ``[out]`` another library quantized (`adopt_torchao`);
        otherwise ``linear``'s weight is quantized here. ``dynamic``: inputs quantized on the fly (``"w8a8"``)."""
        super().__init__()
        if bits not in (4, 8) or (dynamic and bits != 8):
            raise ValueError(f"`bits` must be 4 or 8 (8 with `dynamic`), but is {bits!r}.")
        self.bits, self.in_features, self.out_features = bits, linear.in_features, linear.out_features
        self.dynamic = dynamic
        dtype = linear.weight.dtype
        self.takes_rows_kernel = not dynamic and bits == 8 and fits(self.in_features, self.out_features, dtype) \
            and rows_kernel() is not None
        self.takes_dynamic_kernel = dynamic and fits_dynamic(self.in_features, self.out_features) \
            and dynamic_kernel() is not None
        if dynamic:
            codes, scales = int8 if int8 is not None else int8_codes(linear.weight.detach().float())
            if self.takes_dynamic_kernel:
                self.register_buffer("weight_vnni", vnni_tiles(codes))
            else:
                self.register_buffer("weight_int8", codes)
            self.register_buffer("scales", scales.float())
        elif bits == 8:
            codes, scales = int8 if int8 is not None else int8_codes(linear.weight.detach().float())
            if self.takes_rows_kernel:
                self.register_buffer("weight_tiles", tiles(codes))
            else:
                self.register_buffer("weight_int8", codes)
            self.register_buffer("scales", scales.to(dtype))
        else:
            if self.in_features % INT4_GROUP:
                raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, but a layer has "
                                 f"{self.in_features}; use 'int8'.")
            groups = linear.weight.detach().float().view(self.out_features, -1, INT4_GROUP)  # [out, in/group, group]
            low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
            scales = ((high - low) / 15).clamp_min(1e-12)
            codes = ((groups - low) / scales).round().clamp(0, 15).view(self.out_features, -1).to(torch.int32)
            zeros = low + 8 * scales  # torch's convention: w = (code - 8) * scale + zero
            self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8))
            self.register_buffer("scales_and_zeros", torch.stack(
                [scales.squeeze(-1).T, zeros.squeeze(-1).T], dim=-1).contiguous().to(dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [tokens, in]
        if self.dynamic and self.takes_dynamic_kernel:
            taken = rows if rows.dtype in (torch.float32, torch.bfloat16) else rows.float()
            out = dynamic_kernel().int8_dynamic_mm(taken.contiguous(), self.weight_vnni, self.scales).to(rows.dtype)
        elif self.dynamic:
            out = dynamic_int8_mm(rows, self.weight_int8, self.scales).to(rows.dtype)
        elif self.bits == 8 and rows.shape[0] >= DENSE_ROWS:
            out = self._dense_int8(rows)
        elif self.bits == 8 and self.takes_rows_kernel and rows.dtype == torch.bfloat16 and (kernel := rows_kernel()):
            out = kernel.int8_rows_mm(rows.contiguous(), self.weight_tiles, self.scales.to(rows.dtype))
        elif self.bits == 8:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.int8_weight(), self.scales.to(rows.dtype))
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight_int4, INT4_GROUP,
                                                             self.scales_and_zeros.to(rows.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _dense_int8(self, rows: torch.Tensor) -> torch.Tensor:
        """A prompt's pass ``[tokens, in] -> [tokens, out]``: the int8 weight cast to the activations' dtype and the
        result scaled; from tiles, `DENSE_TILES` at a time, so that each cast block is multiplied while in cache."""
        scales = self.scales.to(rows.dtype)
        if not self.takes_rows_kernel:
            return nn.functional.linear(rows, self.weight_int8.to(rows.dtype)) * scales
        blocks = [nn.functional.linear(rows, untiled(self.weight_tiles[start:start + DENSE_TILES].to(rows.dtype)))
                  for start in range(0, self.weight_tiles.shape[0], DENSE_TILES)]
        return torch.cat(blocks, dim=-1) * scales

    def int8_weight(self, dtype: torch.dtype = torch.int8) -> torch.Tensor:
        """The int8 weight ``[out, in]`` in ``dtype`` (from the kernel's tiles: a copy)."""
        if self.takes_dynamic_kernel:
            return from_vnni_tiles(self.weight_vnni).to(dtype)
        if self.takes_rows_kernel:
            return untiled(self.weight_tiles.to(dtype))
        return self.weight_int8.to(dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight ``[out, in]`` this layer multiplies by, in float32."""
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self._buffer().device)
        bias, self.bias = self.bias, None
        try:
            return self.forward(eye).T.contiguous()
        finally:
            self.bias = bias

    def _buffer(self) -> torch.Tensor:
        return self.scales if self.bits == 8 else self.weight_int4

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"
                + (", inputs int8 on the fly" if self.dynamic else ""))


def quantized_inputs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ``[M, K]`` quantized to int8 per group of `GROUP` inputs: the codes ``[M, K / GROUP, GROUP]`` (as
    float32 integers) and scales ``[M, K / GROUP]`` (the group's largest magnitude / 127; round half to even), as
    ``int8_dynamic_mm`` computes them."""
    groups = rows.float().view(rows.shape[0], -1, GROUP)  # [M, G, GROUP]
    scales = groups.abs().amax(dim=-1) / 127  # [M, G]
    codes = torch.where(scales[..., None] > 0, groups / scales[..., None], 0.0).round().clamp(-127, 127)
    return codes, scales


def dynamic_int8_mm(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``int8_dynamic_mm``'s product in torch: ``rows`` ``[M, K]`` quantized by `quantized_inputs`, times int8
    ``codes`` ``[N, K]``, scaled by ``scales`` ``[N]``; float32 ``[M, N]``. Each group's sum is an exact integer in
    float32 (at most 32 * 127 * 127 in magnitude), and groups are added in order, one elementwise step each, so a row's
    output does not depend on the other rows. Where the kernel does not fit a layer's shape; slower than it."""
    inputs, input_scales = quantized_inputs(rows)  # [M, G, GROUP], [M, G]
    weights = codes.float().view(codes.shape[0], -1, GROUP)  # [N, G, GROUP]
    out = rows.new_zeros(rows.shape[0], codes.shape[0], dtype=torch.float32)  # [M, N]
    for group in range(weights.shape[1]):
        exact = inputs[:, group] @ weights[:, group].T  # [M, N] integers
        out = out + exact * input_scales[:, group, None]  # two roundings, the same for every element
    return out * scales


def check_runs_here(scheme: str, argument: str = "quantize") -> None:
    """Refuse ``"w8a8"`` where its kernel does not run (no AVX512-VNNI or AVX512-BF16, or no C++ build), naming
    ``argument``; other schemes run everywhere."""
    if scheme == "w8a8" and dynamic_kernel() is None:
        raise ValueError(f"`{argument}='w8a8'` needs hf_spec's int8 kernel with AVX512-VNNI, which does not run here "
                         f"({why_not() or 'this CPU has no AVX512-VNNI'}); use 'int8'.")


def quantize_weights(model: nn.Module, scheme: str) -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` layers (on the CPU) by `WeightOnlyLinear` layers of ``scheme`` (one of
    `WEIGHT_ONLY_SCHEMES`), in place; returns ``model``. Checks every layer before changing any. A model `optimize`
    put on oneDNN's packed layers goes back to dense ones first (`deoptimize`)."""
    if scheme not in WEIGHT_ONLY_SCHEMES:
        raise ValueError(f"`quantize` must be one of {WEIGHT_ONLY_SCHEMES} here, but is {scheme!r}.")
    deoptimize(model)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if type(child) is nn.Linear]
    plan = [(parent, name, child, 4 if scheme == "int4" and child is not output else 8)
            for parent, name, child in layers]
    check_runs_here(scheme)
    for _, name, child, bits in plan:
        if child.weight.device.type != "cpu":
            raise ValueError(f"`quantize={scheme!r}` runs on torch's CPU kernels, but layer {name!r} is on "
                             f"{child.weight.device}.")
        if bits == 4 and child.in_features % INT4_GROUP:
            raise ValueError(f"`quantize='int4'`: layer {name!r} has {child.in_features} inputs, not a multiple of "
                             f"{INT4_GROUP}; use 'int8'.")
        if scheme == "w8a8" and child.in_features % GROUP:
            raise ValueError(f"`quantize='w8a8'`: layer {name!r} has {child.in_features} inputs, not a multiple of "
                             f"{GROUP}; use 'int8'.")
    for parent, name, child, bits in plan:
        setattr(parent, name, WeightOnlyLinear(child, bits, dynamic=scheme == "w8a8"))
    model.hf_spec_weight_only = scheme
    return model


def torchao_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(codes [out, in], scales [out])`` of a weight torchao quantized to int8 weight-only with one scale per output
    row (``Int8WeightOnlyConfig()``, version 2: an ``Int8Tensor``), or ``None`` for any other weight."""
    if type(weight).__name__ != "Int8Tensor" or getattr(weight, "act_quant_scale", None) is not None:
        return None
    codes, scales = weight.qdata, weight.scale
    if codes.dim() != 2 or list(weight.block_size) != [1, codes.shape[1]] or scales.numel() != codes.shape[0]:
        return None  # per tensor, per group, or batched: not this layer's scheme
    if getattr(weight, "act_pre_scale", None) is not None:
        return None
    return codes.contiguous(), scales.reshape(-1).float()


def adopt_torchao(model: nn.Module) -> int:
    """Put the linear layers torchao quantized to int8 weight-only, one scale per output row (transformers'
    ``TorchAoConfig(Int8WeightOnlyConfig())``), on `WeightOnlyLinear` layers with the same codes and scales, in place:
    the same quantized model, on the int8 kernels of this module. Returns how many layers changed; other layers, and
    other torchao schemes, stay as they are."""
    plan = [(parent, name, child, int8) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and (int8 := torchao_int8(child.weight)) is not None]
    for parent, name, child, int8 in plan:
        setattr(parent, name, WeightOnlyLinear(child, 8, int8=int8))
    if plan:
        model.hf_spec_weight_only = "int8"
    return len(plan)
