"""What a draft head reads from its target instead of holding its own copy: the input embeddings and the output layer.

A head's checkpoint holds neither (for the 1.5B Qwen target that is 2 x 151,936 x 1,536 weights, 1.9 GB in float32):
`attach` takes them from the target the head is used with, as the speculators format takes ``embed_tokens`` from the
verifier. They are held as buffers (`FrozenEmbedding`, `FrozenLinear`), never trained and never saved, and they are
the target's own tensors whenever dtype and device match (no copy); converting the head (``head.float()``) makes a
converted copy for the head and leaves the target alone. A pruned output layer (FR-Spec) keeps a copy of its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_spec.drafting.vocabulary import PrunedOutputLayer

#: Why a head cannot run yet.
NOT_ATTACHED = ("This draft head holds no embeddings or output layer yet: they are read from its target. Call "
                "`head.attach(target)` (generate(assistant_model=head) on the target does it).")


class FrozenEmbedding(nn.Module):
    """Input embeddings held as a buffer: the target's, not trained, not saved."""

    def __init__(self, weight: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", torch.empty(0) if weight is None else weight, persistent=False)  # [V, H]

    @property
    def num_embeddings(self) -> int:
        return self.weight.shape[0] if self.weight.dim() == 2 else 0

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[-1] if self.weight.dim() == 2 else 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        if self.weight.dim() != 2:
            raise RuntimeError(NOT_ATTACHED)
        return F.embedding(input_ids, self.weight)


class FrozenLinear(nn.Module):
    """A linear layer held as buffers: the target's output layer, not trained, not saved."""

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", torch.empty(0) if weight is None else weight, persistent=False)  # [out, in]
        self.register_buffer("bias", bias, persistent=False)  # [out] or None

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.weight.dim() != 2:
            raise RuntimeError(NOT_ATTACHED)
        return F.linear(hidden, self.weight, self.bias)


def target_layers(target, dtype: torch.dtype, device: torch.device,
                  kept_ids: list[int] | None) -> tuple[FrozenEmbedding, nn.Module]:
    """``target``'s input embeddings and output layer as frozen modules in ``dtype`` on ``device`` (shared when
    they match), the output layer pruned to ``kept_ids`` when given."""
    embedding = target.get_input_embeddings().weight.detach()
    output = target.get_output_embeddings()
    weight = output.weight.to_dense() if output.weight.is_mkldnn else output.weight  # a packed target (oneDNN)
    bias = getattr(output, "bias", None)
    layer = FrozenLinear(weight.detach().to(dtype=dtype, device=device),
                         None if bias is None else bias.detach().to(dtype=dtype, device=device))
    if kept_ids is not None:
        layer = PrunedOutputLayer(layer, torch.tensor(kept_ids, dtype=torch.long, device=device))
    return FrozenEmbedding(embedding.to(dtype=dtype, device=device)), layer
