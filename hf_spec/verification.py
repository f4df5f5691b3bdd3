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

import torch

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
        return value if value in (BLOCK, TOKEN) else checked(value)
    if isinstance(value, str) and value in VERIFICATIONS:
        return VERIFICATIONS[value]
    raise ValueError(f"`verification` must be one of {tuple(VERIFICATIONS)} or a hf_spec Verification, but is "
                     f"{value!r}.")


def checked(verification: Verification) -> Verification:
    """``verification`` with its rules' outputs checked every round, raising by name where a rule of your own returns
    what the loop cannot use: output ids of another shape, counts or paths past the draft, ids outside the vocabulary
    (one host synchronization more per round)."""
    if getattr(verification.chain, "is_checked", False):
        return verification
    return dataclasses.replace(verification, chain=_CheckedChain(verification.chain, verification.chain_name),
                               tree=_CheckedTree(verification.tree, verification.tree_name))


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"The `verification` rule {name!r} {what}; see hf_spec.verification.Verification for what a "
                      "rule returns.")


@dataclasses.dataclass(frozen=True)
class _CheckedChain:
    rule: Callable
    name: str
    is_checked: bool = True

    def __call__(self, draft_ids, draft_probs, target_probs, generator, **options):
        output_ids, num_accepted, *rest = self.rule(draft_ids, draft_probs, target_probs, generator, **options)
        rows, k = draft_ids.shape
        if not isinstance(output_ids, torch.Tensor) or tuple(output_ids.shape) != (rows, k + 1):
            raise _refuse(self.name, f"returned output ids of shape {_shape(output_ids)} for {rows} rows of {k} "
                          f"drafted tokens; they must be [rows, k + 1] = [{rows}, {k + 1}]")
        if not isinstance(num_accepted, torch.Tensor) or tuple(num_accepted.shape) != (rows,):
            raise _refuse(self.name, f"returned accepted counts of shape {_shape(num_accepted)}; they must be [rows] "
                          f"= [{rows}]")
        vocab_size = target_probs.shape[-1]
        low, largest = torch.stack([num_accepted.min(), num_accepted.max()]).long().tolist()
        if low < 0 or largest > k:
            raise _refuse(self.name, f"accepted from {low} to {largest} tokens of {k} drafted; a row keeps 0 to {k}")
        emitted = output_ids[torch.arange(k + 1, device=output_ids.device) <= num_accepted[:, None]]  # what is kept
        high, most = torch.stack([emitted.min(), emitted.max()]).long().tolist()
        if high < 0 or most >= vocab_size:
            raise _refuse(self.name, f"returned ids from {high} to {most}, outside the vocabulary of {vocab_size} ids")
        return (output_ids, num_accepted, *rest)


@dataclasses.dataclass(frozen=True)
class _CheckedTree:
    rule: Callable
    name: str
    is_checked: bool = True

    def __call__(self, token_ids, parents, draft_probs, target_probs, generator, **options):
        path, next_id = self.rule(token_ids, parents, draft_probs, target_probs, generator, **options)
        num_nodes, vocab_size = token_ids.shape[0], target_probs.shape[-1]
        parent = -1
        for node in path:
            if not isinstance(node, int) or not 0 <= node < num_nodes or parents[node] != parent:
                raise _refuse(self.name, f"returned the path {list(path)}, which is no path of the tree from its root "
                              f"(node {node!r} after {parent}; the tree has {num_nodes} nodes)")
            parent = node
        if not isinstance(next_id, torch.Tensor) or next_id.numel() != 1 or not 0 <= int(next_id) < vocab_size:
            raise _refuse(self.name, f"returned the next id {next_id!r}; it must be one id of the {vocab_size} in the "
                          "vocabulary, as a tensor")
        return path, next_id


def _shape(value: Any) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__