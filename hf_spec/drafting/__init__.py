"""Where draft tokens come from, and how many to ask for.

- `base`: the `Drafter` contract (`Proposal`, `DraftContext`);
- `model`: `ModelDrafter`, a draft model;
- `lookup`: `PromptLookupDrafter` and `LookupThenModel`, drafts at no model cost;
- `draft_length`: k per round, fixed (`FixedDraftLength`) or chosen from measured acceptance and costs
  (`AutoDraftLength`);
- `speedup`: the arithmetic of the speed-up formula.

Drafting uses the algorithm's modules (rows, caches, forward passes, the sampler) and never the tools (loading,
evaluation, bench, cli).
"""

from hf_spec.drafting.base import DraftContext, Drafter, Proposal, align_vocab
from hf_spec.drafting.draft_length import AutoDraftLength, FixedDraftLength
from hf_spec.drafting.lookup import LookupThenModel, PromptLookupDrafter
from hf_spec.drafting.model import ModelDrafter

__all__ = [
    "AutoDraftLength",
    "DraftContext",
    "Drafter",
    "FixedDraftLength",
    "LookupThenModel",
    "ModelDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "align_vocab",
]
