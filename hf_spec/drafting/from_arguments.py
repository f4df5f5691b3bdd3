"""Which drafter a ``generate()`` call asks for: a draft model, a draft head, prompt lookup, both, a `Drafter` of the
user's, and the tree form of each (``num_tree_nodes``)."""

from __future__ import annotations

from transformers import PreTrainedModel

from hf_spec.drafting.base import Drafter
from hf_spec.drafting.head import HeadDrafter, HeadTreeDrafter
from hf_spec.drafting.lookup import LookupThenModel, PromptLookupDrafter
from hf_spec.drafting.model import ModelDrafter
from hf_spec.drafting.model_tree import ModelTreeDrafter
from hf_spec.drafting.suffix import SuffixDrafter
from hf_spec.drafting.tree import TreeDrafter
from hf_spec.heads.model import DraftHead

SUFFIX_NGRAM_SIZE = 4


def make_drafter(draft: PreTrainedModel | Drafter | None, prompt_lookup_num_tokens: int | None,
                 ngram_size: int) -> Drafter:
    """A draft model, prompt lookup, or prompt lookup first and the draft model when no n-gram matches; a `Drafter`
    passed as ``assistant_model`` is used as it is (a fresh state for each call is its own business)."""
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, DraftHead):
        if prompt_lookup_num_tokens is not None:
            raise ValueError("`prompt_lookup_num_tokens` with a draft head as `assistant_model` is not supported: "
                             "pass one of them.")
        return HeadDrafter(draft)
    lookup = PromptLookupDrafter(max_ngram_size=ngram_size) if prompt_lookup_num_tokens is not None else None
    if draft is None:
        return lookup
    return ModelDrafter(draft) if lookup is None else LookupThenModel(lookup, ModelDrafter(draft))


def make_tree_drafter(draft: PreTrainedModel | Drafter | None, prompt_lookup_num_tokens: int | None,
                      ngram_size: int) -> TreeDrafter:
    """The tree form of a drafter: the draft model or head branching, or suffix matching for prompt lookup."""
    if isinstance(draft, TreeDrafter):
        return draft
    if isinstance(draft, Drafter):
        raise TypeError(f"`num_tree_nodes` needs a drafter that proposes trees (a TreeDrafter), but "
                        f"`assistant_model` is a {type(draft).__name__}.")
    if isinstance(draft, DraftHead):
        if prompt_lookup_num_tokens is not None:
            raise ValueError("`prompt_lookup_num_tokens` with a draft head as `assistant_model` is not supported: "
                             "pass one of them.")
        return HeadTreeDrafter(draft)
    if draft is None:  # suffix matching: longer matches than prompt lookup's default 2 choose better continuations
        return SuffixDrafter(max_ngram_size=max(SUFFIX_NGRAM_SIZE, ngram_size))
    if prompt_lookup_num_tokens is not None:
        raise ValueError("`num_tree_nodes` with both `assistant_model` and `prompt_lookup_num_tokens` is not "
                         "supported: pass one of them (the draft model's tree, or suffix matching).")
    return ModelTreeDrafter(draft)
