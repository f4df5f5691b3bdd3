"""Pruned draft vocabularies (FR-Spec, Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models
via Frequency-Ranked Speculative Sampling"): the draft's output layer keeps only the N most frequent token ids.

A draft step's output layer reads ``vocab x hidden`` weights; for the 0.5B Qwen draft that is 151,936 x 896, a
quarter of the model's weights. Keeping N rows cuts that matrix by ``vocab / N``. The pruned draft still returns
logits as wide as the vocabulary, ``-inf`` outside the kept ids, so q = 0 there: such a token is never proposed, and
the acceptance rule's residual max(0, p - q) gives the target's own probability to every token the draft cannot
propose. The output law stays exactly the target's (tested against the enumerated law, with a negative control);
only acceptance can drop, by the target probability that falls outside the kept ids.

Where FR-Spec departs from this: it ranks ids by frequency in a large corpus (SlimPajama) and prunes EAGLE-2 heads;
here the ranking comes from any texts through `datasets` (`frequent_token_ids`), preferably the target's own
continuations of prompts that are never the evaluation prompts, and any draft model with a plain linear output layer
can be pruned (`prune_vocabulary`).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_spec.checks import check_int


class PrunedOutputLayer(nn.Module):
    """An output layer computing only ``kept_ids``' rows; the other logits are ``-inf`` (probability 0).

    Args:
        linear: the full output layer (``[vocab, hidden]`` weight); its rows for ``kept_ids`` are copied.
        kept_ids: ``[N]`` int64 token ids, distinct, each below ``linear.out_features``.
    """

    def __init__(self, linear: nn.Linear, kept_ids: torch.Tensor):
        super().__init__()
        self.vocab_size = linear.out_features
        self.register_buffer("kept_ids", kept_ids.to(torch.long))  # [N]
        self.kept = nn.Linear(linear.in_features, len(kept_ids), bias=linear.bias is not None,
                              dtype=linear.weight.dtype, device=linear.weight.device)
        with torch.no_grad():
            self.kept.weight.copy_(linear.weight[self.kept_ids])
            if linear.bias is not None:
                self.kept.bias.copy_(linear.bias[self.kept_ids])
        self.kept.requires_grad_(linear.weight.requires_grad)  # see `hf_spec.loading.packed.PackedLinear`
        self.full = linear  # kept for `restore_vocabulary`; not called (tied output layers share the embeddings)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        kept_logits = self.kept(hidden)  # [..., N]
        logits = kept_logits.new_full((*kept_logits.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.kept_ids, kept_logits)

    def extra_repr(self) -> str:
        return f"{len(self.kept_ids)} of {self.vocab_size} ids"


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
    if type(output) is not nn.Linear:
        raise ValueError(f"`assistant_model` {type(draft).__name__} has an output layer of type "
                         f"{type(output).__name__}; a pruned vocabulary needs a plain nn.Linear.")
    for attribute in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(draft.config.get_text_config(), attribute, None) not in (None, 1, 1.0):
            raise ValueError(f"`assistant_model` scales its logits ({attribute}); a pruned vocabulary is not "
                             "supported for it.")
    ids = torch.as_tensor(list(kept_ids) if not isinstance(kept_ids, torch.Tensor) else kept_ids, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"`draft_vocab` must be a non-empty list of token ids, but has shape {tuple(ids.shape)}.")
    if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= output.out_features:
        raise ValueError(f"`draft_vocab` must hold distinct ids in [0, {output.out_features}), but holds "
                         f"{ids.numel()} ids from {int(ids.min())} to {int(ids.max())}, "
                         f"{ids.numel() - ids.unique().numel()} repeated.")
    draft.set_output_embeddings(PrunedOutputLayer(output, ids.sort().values.to(output.weight.device)))
    return draft


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


def token_counts(tokenizer, texts: Iterable[str]) -> collections.Counter:
    """How often each token id occurs in ``texts``, tokenized with ``datasets`` (batched, cached by fingerprint)."""
    import datasets

    texts = [text for text in texts if text]
    if not texts:
        raise ValueError("No text to count tokens in: the corpus is empty.")
    dataset = datasets.Dataset.from_dict({"text": texts})
    ids = dataset.map(lambda batch: {"ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"]},
                      batched=True, remove_columns=["text"], desc="counting tokens")
    counts = collections.Counter()
    for row in ids["ids"]:
        counts.update(row)
    return counts


def frequent_token_ids(counts: collections.Counter, size: int, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` most frequent ids (ties by id), with the ``always`` ids (EOS and other special tokens) in."""
    check_int("draft_vocab", size)
    always = list(dict.fromkeys(always))
    ranked = [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
              if token not in always]
    if size < len(always):
        raise ValueError(f"`draft_vocab` ({size}) must be at least the {len(always)} special ids kept always.")
    return sorted(always + ranked[: size - len(always)])


def save_token_counts(counts: collections.Counter, path: str | Path, source: str) -> None:
    """Write a frequency table (JSON: the corpus it came from, and id -> count) beside the draft."""
    Path(path).write_text(json.dumps({"source": source, "counts": {str(k): v for k, v in counts.most_common()}}))


def load_token_counts(path: str | Path) -> collections.Counter:
    table = json.loads(Path(path).read_text())
    return collections.Counter({int(k): v for k, v in table["counts"].items()})
