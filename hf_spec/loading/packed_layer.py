"""`PackedLinear`: an ``nn.Linear`` whose weight oneDNN holds prepacked in its own blocked layout
(`hf_spec.loading.packed` chooses when to use it), and the op a compiled graph calls it through."""

from __future__ import annotations

import copy

import torch
from torch import nn


@torch.library.custom_op("hf_spec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
                  ) -> torch.Tensor:  # [..., in] -> [..., out]
    """oneDNN's linear on a prepacked weight, as one op a compiled graph calls as it is (`PackedLinear` under
    ``torch.compile``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x, weight, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight oneDNN holds in its own blocked layout (``[out, in]`` as a dense tensor).

    ``state_dict`` gives the dense weight back (checkpoints are unchanged); ``to_linear`` restores the layer.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # restored by `to_linear`: with requires_grad=False, torch 2.13's oneDNN bf16 matmul of 3 or more rows takes a
        # far slower kernel (docs/cpu_kernels.md)
        self.weight_requires_grad = linear.weight.requires_grad
        # parameters, not trained (`train` is refused): `parameters()` lists every weight, as before packing
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if torch.compiler.is_compiling():  # inductor cannot lower oneDNN's op on a prepacked weight: keep it opaque
            return packed_linear(x, self.weight, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.weight.to_dense(), requires_grad=self.weight_requires_grad)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias, requires_grad=self.weight_requires_grad)
        return linear

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight.to_dense()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def __getstate__(self) -> dict:
        """Pickled with the dense weight (oneDNN's layout has no storage to pickle); packed again when loaded."""
        state = self.__dict__.copy()
        state["_parameters"] = {**self._parameters, "weight": nn.Parameter(self.weight.to_dense(), requires_grad=False)}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        dense = self._parameters["weight"]
        self._parameters["weight"] = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(dense.detach()),
                                                  requires_grad=False)

    def __deepcopy__(self, memo) -> PackedLinear:
        return PackedLinear(copy.deepcopy(self.to_linear(), memo))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"

    def train(self, mode: bool = True) -> PackedLinear:
        """Refused: a packed weight is a buffer, so training would leave it untouched (no gradient, no error)."""
        if mode:
            raise RuntimeError(PACKED_REFUSAL.format(action="be trained (a packed weight gets no gradient)"))
        return super().train(False)

    def _apply(self, fn, recurse: bool = True):
        """``.to(...)``, ``.half()``, ``.cuda()``: oneDNN's layout supports none of them; say so by name."""
        try:
            return super()._apply(fn, recurse)
        except (NotImplementedError, RuntimeError) as error:
            raise RuntimeError(PACKED_REFUSAL.format(action="change dtype or device")) from error


#: The error for what a packed layer cannot do.
PACKED_REFUSAL = ("This model's linear layers are packed for oneDNN (hf_spec.loading.packed.optimize) and cannot "
                  "{action}. Call hf_spec.loading.packed.deoptimize(model) first: it restores the same dense weights.")
