"""Where draft tokens come from, and how many to ask for.

- `base`: the `Drafter` contract (`Proposal`, `DraftContext`, the hooks the core calls, `DraftSource`);
- `model`: `ModelDrafter`, a draft model;
- `lookup`: `PromptLookupDrafter` and `LookupThenModel`, drafts at no model cost;
- `tree`: the tree contract (`DraftTree`, `TreeDrafter`); `branching`: the exact dynamic tree grown from a draft's
  own laws; `model_tree`: `ModelTreeDrafter`, a draft model that branches; `suffix`: `SuffixDrafter`, several
  continuations from suffix matches;
- `oracle`: `OracleDrafter`, a drafter that knows the answer, for measuring the loop;
- `vocabulary`: pruned draft output layers (FR-Spec);
- `draft_length`: k per round, fixed (`FixedDraftLength`) or chosen from measured acceptance and costs
  (`AutoDraftLength`); `tree_size`: a tree's node budget and branching per round, fixed (`FixedTreeSize`) or chosen
  the same way (`AutoTreeSize`); `online`: what both learn; `costs`: the cost probe; `speedup`: the formula.

Draft heads (EAGLE) live in `hf_spec.heads` and reach the loop through `DraftSource`. Drafting uses the algorithm's
modules (rows, caches, forward passes, the sampler) and never the tools (loading, evaluation, bench, cli, heads).
"""

from hf_spec.drafting.base import DraftContext, Drafter, DraftSource, Proposal, align_vocab
from hf_spec.drafting.draft_length import AutoDraftLength, FixedDraftLength
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
    "DraftSource",
    "DraftTree",
    "Drafter",
    "FixedDraftLength",
    "FixedTreeSize",
    "LookupThenModel",
    "ModelDrafter",
    "ModelTreeDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "SuffixDrafter",
    "TreeDrafter",
    "align_vocab",
]
