"""Where draft tokens come from (how many to ask for: `hf_spec.sizing`).

- `base`: the `Drafter` contract (`Proposal`, `DraftContext`, the hooks the core calls, `DraftSource`);
- `model`: `ModelDrafter`, a draft model;
- `lookup`: `PromptLookupDrafter` and `LookupThenModel`, drafts at no model cost;
- `tree`: the tree contract (`DraftTree`, `TreeDrafter`); `branching`: the exact dynamic tree grown from a draft's
  own laws; `model_tree`: `ModelTreeDrafter`, a draft model that branches; `suffix`: `SuffixDrafter`, several
  continuations from suffix matches;
- `oracle`: `OracleDrafter`, a drafter that knows the answer, for measuring the loop;
- `vocabulary`: pruned draft output layers (FR-Spec).

Draft heads (EAGLE) live in `hf_spec.heads` and reach the loop through `DraftSource`. Drafting uses the algorithm's
modules (rows, caches, forward passes, the sampler) and never the tools (loading, evaluation, bench, cli, heads).
"""

from hf_spec.drafting.base import DraftContext, Drafter, DraftSource, Proposal, align_vocab
from hf_spec.drafting.lookup import LookupThenModel, PromptLookupDrafter
from hf_spec.drafting.model import ModelDrafter
from hf_spec.drafting.model_tree import ModelTreeDrafter
from hf_spec.drafting.suffix import SuffixDrafter
from hf_spec.drafting.tree import DraftTree, TreeDrafter

__all__ = [
    "DraftContext",
    "DraftSource",
    "DraftTree",
    "Drafter",
    "LookupThenModel",
    "ModelDrafter",
    "ModelTreeDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "SuffixDrafter",
    "TreeDrafter",
    "align_vocab",
]
