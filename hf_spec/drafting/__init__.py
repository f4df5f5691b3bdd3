"""Where draft tokens come from, and how many to ask for.

- `base`: the `Drafter` contract (`Proposal`, `DraftContext`);
- `model`: `ModelDrafter`, a draft model;
- `head`: `HeadDrafter`, a draft head (`hf_spec.heads`) reading the target's hidden states from the verify pass,
  and `HeadTreeDrafter`, a head that branches;
- `lookup`: `PromptLookupDrafter` and `LookupThenModel`, drafts at no model cost;
- `tree`: the tree contract (`DraftTree`, `TreeDrafter`); `branching`: the exact dynamic tree grown from a draft's
  own laws; `model_tree`: `ModelTreeDrafter`, a draft model that branches; `suffix`: `SuffixDrafter`, several
  continuations from suffix matches;
- `from_arguments`: the drafter a ``generate()`` call asks for;
- `draft_length`: k per round, fixed (`FixedDraftLength`) or chosen from measured acceptance and costs
  (`AutoDraftLength`); `tree_size`: a tree's node budget and branching per round, fixed (`FixedTreeSize`) or chosen
  the same way (`AutoTreeSize`);
- `speedup`: the arithmetic of the speed-up formula.

Drafting uses the algorithm's modules (rows, caches, forward passes, the sampler) and never the tools (loading,
evaluation, bench, cli).
"""

from hf_spec.drafting.base import DraftContext, Drafter, Proposal, align_vocab
from hf_spec.drafting.draft_length import AutoDraftLength, FixedDraftLength
from hf_spec.drafting.head import HeadDrafter, HeadTreeDrafter
from hf_spec.drafting.lookup import LookupThenModel, PromptLookupDrafter
from hf_spec.drafting.model import ModelDrafter
from hf_spec.drafting.model_tree import ModelTreeDrafter
from hf_spec.drafting.suffix import SuffixDrafter
from hf_spec.drafting.tree import DraftTree, TreeDrafter
from hf_spec.drafting.tree_size import AutoTreeSize, FixedTreeSize

__all__ = [
    "AutoDraftLength",
    "AutoTreeSize",
    "DraftContext",
    "DraftTree",
    "Drafter",
    "FixedDraftLength",
    "FixedTreeSize",
    "HeadDrafter",
    "HeadTreeDrafter",
    "LookupThenModel",
    "ModelDrafter",
    "ModelTreeDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "SuffixDrafter",
    "TreeDrafter",
    "align_vocab",
]
