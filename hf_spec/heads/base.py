"""What every draft head shares, whatever its architecture: `DraftHeadBase`.

A head is a transformers model that reads its target's hidden states and, in their place for drafted tokens, its
own. The loop (`hf_spec.heads.drafter`) and the trainer (`hf_spec.evaluation.head_training`) use one interface:

- ``head(input_ids, features=..., attention_mask=..., position_ids=..., cache=..., logits_to_keep=...)`` for pairs
  (the target's feature f_t, the token x_{t+1}), or ``predicted=`` (the head's own h) in place of ``features``;
  it returns `DraftHeadOutput`: logits over the *target's* vocabulary (``-inf`` where the head cannot propose) and h;
- ``config.feature_layers``: which of the target's hidden states it reads (indices into transformers'
  ``output_hidden_states`` tuple), ``config.target_hidden_size``;
- `attach` (read what the head takes from its target, checked to fit), `is_attached_to`, `new_cache`, `custom_mask`,
  `read_features` (the target's features as the head's first layer reads them, what its own h stands in for) and
  `target_output_layer` (the target's own LM head, the teacher in training).

Two architectures implement it: `hf_spec.heads.model.DraftHead` (EAGLE-1, or EAGLE-style feature fusion, on the
target's own decoder layer type) and `hf_spec.heads.eagle3.Eagle3Head` (EAGLE-3 in the speculators format that vLLM
and SGLang serve).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_spec.caches import new_cache
from hf_spec.drafting.base import not_a_transformers_draft
from hf_spec.forward import tree_attention_mask
from hf_spec.heads.drafter import HeadDrafter, HeadTreeDrafter


@dataclasses.dataclass
class DraftHeadOutput:
    logits: torch.Tensor  # [batch, kept positions, target vocab]
    hidden_states: torch.Tensor  # [batch, positions, hidden] h: what the head reads in place of the next feature


class TargetReference:
    """A weak reference to the target a head is attached to. A deep copy of the head stays attached to the same
    target; a pickled head is not (the target is not pickled with it): loaded, it attaches again on its first call."""

    def __init__(self, target: PreTrainedModel | None = None):
        self._reference = None if target is None else weakref.ref(target)

    def __call__(self) -> PreTrainedModel | None:
        return None if self._reference is None else self._reference()

    def __deepcopy__(self, memo) -> TargetReference:
        return self

    def __reduce__(self):
        return TargetReference, ()


class DraftHeadBase(PreTrainedModel):
    """The interface above; subclasses build the network and say how they fit a target."""

    base_model_prefix = "head"
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        self._target: TargetReference | None = None  # the model `attach` read from

    def attach(self, target: PreTrainedModel) -> DraftHeadBase:
        """Read what the head takes from ``target`` (checked to fit: `check_target`); returns the head."""
        self.check_target(target)
        self._attach_layers(target)
        self._target = TargetReference(target)
        return self

    def __getattr__(self, name: str):
        if name == "generation_config":  # what transformers' own assisted generation reads first
            raise AttributeError(not_a_transformers_draft(self))
        return super().__getattr__(name)

    def is_attached_to(self, target: PreTrainedModel) -> bool:
        return self._target is not None and self._target() is target

    def check_target(self, target: PreTrainedModel) -> None:
        """Refuse, naming what differs, a target this head was not built for."""
        raise NotImplementedError

    def _attach_layers(self, target: PreTrainedModel) -> None:
        raise NotImplementedError

    def layer_model(self) -> nn.Module:
        """The module whose config shapes the head's cache and attention masks."""
        raise NotImplementedError

    def new_cache(self):
        """A fresh, rollback-ready cache for the head's layers."""
        return new_cache(self.layer_model())

    def custom_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """``visible`` ``[queries, keys]`` (bool) in the form the head's attention takes a custom mask."""
        return tree_attention_mask(self.layer_model(), visible)

    def read_features(self, features: torch.Tensor) -> torch.Tensor:
        """``[batch, m, hidden]``: what the head's first layer reads of the target's features ``[batch, m, F]`` (what
        its own h stands in for at drafted positions)."""
        raise NotImplementedError

    def target_output_layer(self) -> nn.Module:
        """The target's whole LM head, read at `attach` (the teacher of `hf_spec.evaluation.head_training`)."""
        raise NotImplementedError

    def hf_spec_drafter(self, *, tree: bool):
        """What ``generate(assistant_model=head)`` drafts with (`hf_spec.drafting.base.DraftSource`): a
        `HeadDrafter`, or a `HeadTreeDrafter` with ``num_tree_nodes``."""
        return HeadTreeDrafter(self) if tree else HeadDrafter(self)


def check_feature_layers(feature_layers, num_layers: int, name: str = "feature_layers") -> None:
    """``feature_layers`` must name distinct hidden states among the target's ``num_layers + 1``."""
    layers = list(feature_layers) if isinstance(feature_layers, (list, tuple)) else None
    if (not layers or any(not isinstance(i, int) or not -(num_layers + 1) <= i <= num_layers for i in layers)
            or len({i % (num_layers + 1) for i in layers}) != len(layers)):
        raise ValueError(f"`{name}` must be a non-empty list of distinct hidden-state indices in "
                         f"[{-(num_layers + 1)}, {num_layers}] (the target has {num_layers} layers), but is "
                         f"{feature_layers!r}.")
