"""Pruned draft vocabularies (FR-Spec, Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models
via Frequency-Ranked Speculative Sampling"): the draft's output layer keeps only the N most frequent token ids.

A draft step's output layer reads ``vocab x hidden`` weights; for the 0.5B Qwen draft that is 151,936 x 896, a
quarter of the model's weights. Keeping N rows cuts that matrix by ``vocab / N``. The pruned draft still returns
logits as wide as the vocabulary, ``-inf`` outside the kept ids, so q = 0 there: such a token is never proposed, and
the acceptance rule's residual max(0, p - q) gives the target's own probability to every token the draft cannot
propose. The output law stays exactly the target's (tested against the enumerated law, with a negative control);
only acceptance can drop, by the target probability that falls outside the kept ids.

Where FR-Spec departs from this: it ranks ids by frequency in a large corpus (SlimPajama) and prunes EAGLE-2 heads;
here the ranking comes from any texts (`hf_spec.loading.vocabulary`), preferably the target's own continuations of
prompts that are never the evaluation prompts, and any draft model with a plain linear output layer can be pruned
(`prune_vocabulary`). A pruned draft saves as an ordinary checkpoint (its full output layer), so ``from_pretrained``
gives the unpruned draft back; prune it again after loading.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PreTrainedModel


class PrunedOutputLayer(nn.Module):
    """An output layer computing only ``kept_ids``' rows; the other logits are ``-inf`` (probability 0).

    Args:
        linear: the full output layer (``[vocab, hidden]`` weight): an ``nn.Linear``, or a layer of the same kind
            (``weight``, ``bias``, ``in_features``, ``out_features``) that a draft head reads from its target; its rows
            for ``kept_ids`` are copied into a layer of its kind.
        kept_ids: ``[N]`` int64 token ids, distinct, each below ``linear.out_features``.
    """

    def __init__(self, linear: nn.Module, kept_ids: torch.Tensor):
        super().__init__()
        self.vocab_size = linear.out_features
        self.register_buffer("kept_ids", kept_ids.to(torch.long), persistent=False)  # [N]
        if hasattr(linear, "select_rows"):  # a layer of its own weight format (a GGUF file's blocks)
            self.kept = linear.select_rows(self.kept_ids)
        elif isinstance(linear, nn.Linear):
            self.kept = nn.Linear(linear.in_features, len(kept_ids), bias=linear.bias is not None,
                                  dtype=linear.weight.dtype, device=linear.weight.device)
            with torch.no_grad():
                self.kept.weight.copy_(linear.weight[self.kept_ids])
                if linear.bias is not None:
                    self.kept.bias.copy_(linear.bias[self.kept_ids])
            self.kept.requires_grad_(linear.weight.requires_grad)  # see `hf_spec.loading.packed.PackedLinear`
        else:
            self.kept = type(linear)(linear.weight[self.kept_ids],
                                     None if linear.bias is None else linear.bias[self.kept_ids])
        self.full = linear  # kept for `restore_vocabulary`; not called (tied output layers share the embeddings)
        self._register_state_dict_hook(self._dense_state)
        self._register_load_state_dict_pre_hook(self._from_dense, with_module=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        kept_logits = self.kept(hidden)  # [..., N]
        logits = kept_logits.new_full((*kept_logits.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.kept_ids, kept_logits)

    def extra_repr(self) -> str:
        return f"{len(self.kept_ids)} of {self.vocab_size} ids"

    @staticmethod
    def _dense_state(module, state_dict, prefix, local_metadata) -> None:
        """State-dict hook: the layer is saved as the full, dense one (``weight``, ``bias``), so a pruned draft's
        checkpoint is an ordinary one; the kept rows are derived from it."""
        for name in ("weight", "bias", "blocks"):
            full = state_dict.pop(prefix + "full." + name, None)
            state_dict.pop(prefix + "kept." + name, None)
            if full is not None:
                state_dict[prefix + name] = full

    @staticmethod
    def _from_dense(module, state_dict, prefix, *args) -> None:
        """Load hook: a dense layer's ``weight`` (and ``bias``; a GGUF layer's ``blocks``) fills the full layer and
        the kept rows."""
        for name in ("weight", "bias", "blocks"):
            value = state_dict.pop(prefix + name, None)
            if value is not None:
                state_dict[prefix + "full." + name] = value
                state_dict[prefix + "kept." + name] = value[module.kept_ids.to(value.device)]


def prune_vocabulary(draft: PreTrainedModel, kept_ids: torch.Tensor | Iterable[int]) -> PreTrainedModel:
    """Give ``draft`` an output layer that computes only ``kept_ids`` (in place; returns the same model).

    The full layer stays reachable (`restore_vocabulary`); a tied layer keeps sharing its weights with the input
    embeddings, and the kept rows are a copy (``N x hidden`` more weights).

    Raises:
        ValueError: an empty, repeated or out-of-range id list, or a draft whose output layer is not a plain linear
            layer (logit soft-capping or scaling models are not supported).
    """
    restore_vocabulary(draft)
    output = draft.get_output_embeddings()
    if type(output) is not nn.Linear and not hasattr(output, "select_rows"):
        packed = type(output).__name__ == "PackedLinear"  # `hf_spec.loading.packed`, which imports this module
        raise ValueError(f"`assistant_model` {type(draft).__name__} has an output layer of type "
                         f"{type(output).__name__}; a pruned vocabulary needs a plain nn.Linear"
                         + (": prune before `hf_spec.loading.packed.optimize`, or `deoptimize(assistant_model)` "
                            "first." if packed else "."))
    for attribute in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(draft.config.get_text_config(), attribute, None) not in (None, 1, 1.0):
            raise ValueError(f"`assistant_model` scales its logits ({attribute}); a pruned vocabulary is not "
                             "supported for it.")
    ids = check_kept_ids(kept_ids, output.out_features)
    device = next(itertools.chain(output.parameters(), output.buffers())).device
    draft.set_output_embeddings(PrunedOutputLayer(output, ids.sort().values.to(device)))
    return draft


def check_kept_ids(kept_ids: torch.Tensor | Iterable[int], num_ids: int) -> torch.Tensor:
    """``kept_ids`` as ``[N]`` int64: distinct integer ids in ``[0, num_ids)``; a clear error naming ``draft_vocab``
    otherwise (floats are refused, not truncated)."""
    ids = torch.as_tensor(list(kept_ids) if not isinstance(kept_ids, torch.Tensor) else kept_ids)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"`draft_vocab` must be a non-empty list of token ids, but has shape {tuple(ids.shape)}.")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"`draft_vocab` must hold integer token ids, but holds {ids.dtype} values such as "
                         f"{ids[:3].tolist()}.")
    ids = ids.long()
    if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= num_ids:
        raise ValueError(f"`draft_vocab` must hold distinct ids in [0, {num_ids}), but holds {ids.numel()} ids from "
                         f"{int(ids.min())} to {int(ids.max())}, {ids.numel() - ids.unique().numel()} repeated.")
    return ids


def restore_vocabulary(draft: PreTrainedModel) -> PreTrainedModel:
    """Undo `prune_vocabulary` (a no-op for a draft that was not pruned)."""
    output = draft.get_output_embeddings()
    if isinstance(output, PrunedOutputLayer):
        draft.set_output_embeddings(output.full)
    return draft


def pruned_size(draft: PreTrainedModel) -> int | None:
    """How many ids ``draft`` computes logits for, or ``None`` when it is not pruned."""
    output = draft.get_output_embeddings()
    return len(output.kept_ids) if isinstance(output, PrunedOutputLayer) else None
