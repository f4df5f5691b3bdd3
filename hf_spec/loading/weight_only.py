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
#: From this many tokens per sequence on (a prompt's pass), an int8 layer multiplies by its int8 weight cast to the
#: activations' dtype and scales the result: the int8 kernels are made for a few rows, and a prompt's pass of many
#: rows runs faster through the dense matmul (docs/quantization.md). Counted per sequence, not over the batch, so that
#: a step and a verify block of any batch take the same (row-invariant) kernel: only prompts change path.
DENSE_ROWS = 16
#: The activation dtypes torch's int8 and int4 kernels take; others (float64) are computed in float32.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
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
        self._describe(bits, linear.in_features, linear.out_features, dynamic)
        dtype = linear.weight.dtype
        if bits == 8:
            codes, scales = int8 if int8 is not None else int8_codes(linear.weight.detach().float())
            self._hold_int8(codes, scales, dtype)
        else:
            if self.in_features % INT4_GROUP:
                raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, but a layer has "
                                 f"{self.in_features}; use 'int8'.")
            groups = linear.weight.detach().float().view(self.out_features, -1, INT4_GROUP)  # [out, in/group, group]
            low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
            scales = ((high - low) / 15).clamp_min(1e-12)
            codes = ((groups - low) / scales).round().clamp(0, 15).view(self.out_features, -1).to(torch.int32)
            zeros = low + 8 * scales  # torch's convention: w = (code - 8) * scale + zero
            self._hold_int4(codes, torch.stack([scales.squeeze(-1).T, zeros.squeeze(-1).T], dim=-1).to(dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def _describe(self, bits: int, in_features: int, out_features: int, dynamic: bool) -> None:
        if bits not in (4, 8) or (dynamic and bits != 8):
            raise ValueError(f"`bits` must be 4 or 8 (8 with `dynamic`), but is {bits!r}.")
        self.bits, self.in_features, self.out_features, self.dynamic = bits, in_features, out_features, dynamic

    def _hold_int8(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        """Keep int8 ``codes`` ``[out, in]`` and ``scales`` ``[out]`` in the layout of the fastest kernel here."""
        self.takes_rows_kernel = not self.dynamic and fits(self.in_features, self.out_features, dtype) \
            and rows_kernel() is not None
        self.takes_dynamic_kernel = self.dynamic and fits_dynamic(self.in_features, self.out_features) \
            and dynamic_kernel() is not None
        if self.takes_dynamic_kernel:
            self.register_buffer("weight_vnni", vnni_tiles(codes))
        elif self.takes_rows_kernel:
            self.register_buffer("weight_tiles", tiles(codes))
        else:
            self.register_buffer("weight_int8", codes)
        self.register_buffer("scales", scales.float() if self.dynamic else scales.to(dtype))

    def _hold_int4(self, codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        """Keep int4 ``codes`` ``[out, in]`` (0 to 15) and ``scales_and_zeros`` ``[in / group, out, 2]`` in torch's
        CPU packing."""
        self.takes_rows_kernel = self.takes_dynamic_kernel = False
        self.register_buffer("weight_int4",
                             torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 8))
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())

    # --- the saved form: what `state_dict` and ``save_pretrained`` write, the same on every CPU ----------------------

    @classmethod
    def to_load(cls, in_features: int, out_features: int, bits: int, dynamic: bool, bias: bool,
                dtype: torch.dtype) -> WeightOnlyLinear:
        """An empty layer holding the saved form's buffers (`saved_state`), for a loader to fill; `unpack` then puts
        them in the layout of this CPU's kernels."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._describe(bits, in_features, out_features, dynamic)
        layer.takes_rows_kernel = layer.takes_dynamic_kernel = False
        if bits == 8:
            layer.register_buffer("weight_int8", torch.empty((out_features, in_features), dtype=torch.int8))
            layer.register_buffer("scales", torch.empty(out_features, dtype=torch.float32 if dynamic else dtype))
        else:
            layer.register_buffer("weight_int4_codes",
                                  torch.empty((out_features, in_features // 2), dtype=torch.uint8))
            layer.register_buffer("scales_and_zeros", torch.empty((in_features // INT4_GROUP, out_features, 2),
                                                                  dtype=dtype))
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        return layer

    def unpack(self) -> None:
        """After loading the saved form (`to_load`): its buffers put in the layout of this CPU's kernels."""
        if self.bits == 8 and "weight_int8" in self._buffers and not (self.takes_rows_kernel or
                                                                       self.takes_dynamic_kernel):
            codes, scales = self._buffers.pop("weight_int8"), self._buffers.pop("scales")
            self._hold_int8(codes, scales, torch.float32 if self.dynamic else scales.dtype)
        elif self.bits == 4 and "weight_int4_codes" in self._buffers:
            packed = self._buffers.pop("weight_int4_codes")
            codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(self.out_features, self.in_features)
            self._hold_int4(codes, self._buffers.pop("scales_and_zeros"))

    def saved_state(self) -> dict[str, torch.Tensor]:
        """The saved form: int8 ``weight_int8`` ``[out, in]`` and ``scales`` ``[out]``; or int4 ``weight_int4_codes``
        ``[out, in / 2]`` uint8 (two codes a byte, the even input in the low half) and ``scales_and_zeros``; and
        ``bias``. The same whatever this CPU's layout, so that a model saved on one machine loads on any."""
        if "weight_int4_codes" in self._buffers:  # not unpacked yet (`to_load`)
            state = {name: self._buffers[name] for name in ("weight_int4_codes", "scales_and_zeros")}
        elif self.bits == 8:
            state = {"weight_int8": self.int8_weight(), "scales": self.scales}
        else:
            codes = self.int4_codes().to(torch.uint8)  # [out, in]
            state = {"weight_int4_codes": codes[:, 0::2] | (codes[:, 1::2] << 4),
                     "scales_and_zeros": self.scales_and_zeros}
        return state if self.bias is None else {**state, "bias": self.bias}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, value in self.saved_state().items():
            destination[prefix + name] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Loads the saved form (`saved_state`), whatever layout this CPU's kernels keep it in."""
        names = ("weight_int8", "scales") if self.bits == 8 else ("weight_int4_codes", "scales_and_zeros")
        names += () if self.bias is None else ("bias",)
        missing = [prefix + name for name in names if prefix + name not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        saved = {name: state_dict[prefix + name] for name in names}
        for name in list(self._buffers):
            del self._buffers[name]
        for name in names[:2]:
            self.register_buffer(name, saved[name].detach().clone())
        self.takes_rows_kernel = self.takes_dynamic_kernel = False
        self.unpack()
        if self.bias is not None:
            with torch.no_grad():
                self.bias.copy_(saved["bias"])

    def int4_codes(self) -> torch.Tensor:
        """The int4 codes ``[out, in]`` (0 to 15, int32), read back from torch's packing through its own kernel in
        float32 (each weight is exactly ``(code - 8) * scale + zero``), a block of inputs at a time."""
        sz = self.scales_and_zeros.float()  # [in / group, out, 2]
        scale = sz[..., 0].T.repeat_interleave(INT4_GROUP, dim=1)  # [out, in]
        zero = sz[..., 1].T.repeat_interleave(INT4_GROUP, dim=1)
        blocks = []
        for start in range(0, self.in_features, 1024):
            eye = torch.eye(self.in_features, dtype=torch.float32, device=sz.device)[start:start + 1024]
            blocks.append(torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight_int4, INT4_GROUP, sz).T)
        weight = torch.cat(blocks, dim=1)  # [out, in]
        return ((weight - zero) / scale + 8).round().clamp(0, 15).to(torch.int32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [tokens, in]
        if rows.dtype not in KERNEL_DTYPES:  # float64 (a model moved with .to()): computed in float32, cast back
            return self.forward(x.float()).to(x.dtype)
        if self.dynamic:  # its scales stay float32 whatever .to() did to the buffers
            scales = self.scales if self.scales.dtype == torch.float32 else self.scales.float()
        if self.dynamic and self.takes_dynamic_kernel:
            taken = rows if rows.dtype in (torch.float32, torch.bfloat16) else rows.float()
            out = dynamic_kernel().int8_dynamic_mm(taken.contiguous(), self.weight_vnni, scales).to(rows.dtype)
        elif self.dynamic:
            out = dynamic_int8_mm(rows, self.weight_int8, scales).to(rows.dtype)
        elif self.bits == 8 and (x.shape[-2] if x.dim() > 2 else rows.shape[0]) >= DENSE_ROWS:
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

    @property
    def saved_kind(self) -> int:
        """What `hf_spec.saved_layers` records of this layer: its bits."""
        return self.bits

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
    from hf_spec.saved_layers import mark_quantized  # it imports this module

    mark_quantized(model, scheme)
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
        from hf_spec.saved_layers import mark_quantized

        mark_quantized(model, "int8")
    return len(plan)
