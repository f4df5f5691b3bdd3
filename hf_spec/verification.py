"""Which exact acceptance rules a call runs on sampled drafts: `Verification`, one rule for chains and one for trees.

    >>> model.generate(**inputs, assistant_model=draft, do_sample=True, verification="token")

- ``"block"`` (`BLOCK`, the default): whole blocks on chains (`hf_spec.rejection.accept_block`), whole paths on trees
  (`hf_spec.traversal.accept_traversal`); never fewer tokens in expectation than token by token.
- ``"token"`` (`TOKEN`): token by token on chains (`hf_spec.rejection.accept_draft_tokens`), node by node on trees
  (`hf_spec.rejection.accept_tree`).
- a `Verification` of your own: the rules the rounds run instead, named in ``speculative_stats.verification``. The
  statistical tests pass their negative controls this way (`hf_spec.evaluation.exactness.RESAMPLE_FROM_P`).

Greedy decoding has one rule (`hf_spec.rejection.accept_greedy`, `accept_tree_greedy`), whatever is chosen here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from hf_spec.rejection import accept_block, accept_draft_tokens, accept_tree
from hf_spec.traversal import accept_traversal


@dataclasses.dataclass(frozen=True)
class Verification:
    """The acceptance rules of sampled rounds.

    Attributes:
        chain: ``(draft_ids [rows, k], draft_probs [rows, k, vocab], target_probs [rows, k + 1, vocab], generator)
            -> (output_ids [rows, k + 1], num_accepted [rows])``, as `hf_spec.rejection.accept_draft_tokens`.
        tree: ``(token_ids [n], parents, draft_probs [n, vocab], target_probs [n + 1, vocab], generator)
            -> (path, next_id)``, as `hf_spec.rejection.accept_tree`.
        chain_name, tree_name: what ``speculative_stats.verification`` reports for each.
        needs_fixed_length: whether the chain rule needs the block's length fixed before drafting (block
            verification does); a draft that stops early on its own confidence (``assistant_confidence_threshold``)
            then runs `TOKEN`'s chain rule.
        reports_reach: whether the chain rule takes ``with_reach=True`` and then also returns each row's reach
            ``[rows, k + 1]`` (`hf_spec.rejection`): the chance, over the rule's own randomness, to keep at least j
            of the drafted tokens. ``num_assistant_tokens="auto"`` learns acceptance from it (less noisy than the
            counts drawn); without it, from the counts.
    """

    chain: Callable
    tree: Callable
    chain_name: str
    tree_name: str
    needs_fixed_length: bool = False
    reports_reach: bool = False

    def for_chains(self, stops_early: bool) -> Verification:
        """The rules a chain call runs: `TOKEN` where the draft stops early and this chain rule cannot."""
        return TOKEN if stops_early and self.needs_fixed_length else self


BLOCK = Verification(accept_block, accept_traversal, "block", "traversal", needs_fixed_length=True,
                     reports_reach=True)
TOKEN = Verification(accept_draft_tokens, accept_tree, "token", "tree", reports_reach=True)
#: The rules by the name ``generate(verification=...)`` takes.
VERIFICATIONS = {"block": BLOCK, "token": TOKEN}


def resolve_verification(value: Any) -> Verification:
    """``verification``: unset (`BLOCK`), a name of `VERIFICATIONS`, or a `Verification`."""
    if value is None:
        return BLOCK
    if isinstance(value, Verification):
        return value
    if isinstance(value, str) and value in VERIFICATIONS:
        return VERIFICATIONS[value]
    raise ValueError(f"`verification` must be one of {tuple(VERIFICATIONS)} or a hf_spec Verification, but is "
                     f"{value!r}.")
