"""How much to draft each round: the sizers and the cost model they choose from.

- `base`: the `Sizer` contract (`ChainSizer` chooses k, `TreeSizer` a tree's budget, depth and branching);
- `draft_length`: k per round, fixed (`FixedDraftLength`), transformers' heuristic schedule
  (`HeuristicDraftLength`), or chosen from measured acceptance and costs (`AutoDraftLength`);
- `tree_size`: a tree's size per round, fixed (`FixedTreeSize`) or chosen the same way (`AutoTreeSize`);
- `online`: what both automatic sizers learn during a call; `estimates`: acceptance and pass costs with forgetting;
- `batch`: k per request and step in a continuous batch (`hf_spec.serving`);
- `costs`: the cost table the sizers read; `speedup`: the expected-tokens formula.

The sizers run no model and import no drafter: the timing probe that fills their tables is `hf_spec.timing`, the
drafters are `hf_spec.drafting`.
"""

from hf_spec.sizing.base import ChainSizer, Sizer, TreeSizer
from hf_spec.sizing.draft_length import AutoDraftLength, FixedDraftLength, HeuristicDraftLength
from hf_spec.sizing.tree_size import AutoTreeSize, FixedTreeSize

__all__ = [
    "AutoDraftLength",
    "AutoTreeSize",
    "ChainSizer",
    "FixedDraftLength",
    "FixedTreeSize",
    "HeuristicDraftLength",
    "Sizer",
    "TreeSizer",
]
