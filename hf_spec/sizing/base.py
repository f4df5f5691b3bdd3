"""The contract of a sizer: what chooses each round's size and learns from the finished round.

A chain round asks a `ChainSizer` for k (`choose`); a tree round asks a `TreeSizer` for a budget, depth and
branching (`choose_tree`). Both learn from a chain round (`learn_chain`: a tree sizer learns it as the tree it is), a
tree sizer from a tree round too (`learn_tree`). ``max_drafted`` is the most tokens any round drafts (what a static
cache and recurrent-state recording are sized for); ``needs_costs`` says whether the sizer wants the cost probe
before its first round (`hf_spec.timing.probe.probe_costs`, run once per process and models).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sizers read what the drafters made; they import no drafter
    from hf_spec.drafting.base import Proposal
    from hf_spec.drafting.tree import DraftTree


class Sizer(abc.ABC):
    """Chooses each round's size and learns from it."""

    #: Whether it learns from timings (the loop then synchronizes an accelerator before reading its clocks).
    is_timed: bool = False

    @property
    @abc.abstractmethod
    def max_drafted(self) -> int:
        """The most tokens a round drafts."""

    @property
    def needs_costs(self) -> bool:
        """Whether the cost probe should seed it before the first round (an automatic sizer without costs)."""
        return False

    def observed_cost_ratio(self) -> float | None:
        """What the call's timings say of the probe's draft step against its target passes (automatic sizers)."""
        return None

    @abc.abstractmethod
    def learn_chain(self, proposal: Proposal, num_accepted: list[int], draft_seconds: float,
                    verify_seconds: float | None, reach: list[list[float]] | None = None) -> None:
        """Learn from a chain round: each active row's accepted count, and the round's timings (``verify_seconds``
        is ``None`` for the call's first round, which holds the prefill); ``reach``: each active row's chance to
        keep at least j = 0 .. k of its draft tokens, where the acceptance rule reports it (`hf_spec.rejection`)."""


class ChainSizer(Sizer):
    """k per round."""

    @abc.abstractmethod
    def choose(self, limit: int) -> int:
        """k for the next round, at most ``limit``."""

    @abc.abstractmethod
    def update(self, num_draft_tokens: int, num_accepted: list[int], draft_seconds: float, num_model_steps: int,
               verify_seconds: float | None, num_catch_up_tokens: int = 0,
               reach: list[list[float]] | None = None) -> None:
        """Learn from a finished round of ``num_draft_tokens`` per row (`learn_chain`'s figures, spelled out)."""

    def learn_chain(self, proposal: Proposal, num_accepted: list[int], draft_seconds: float,
                    verify_seconds: float | None, reach: list[list[float]] | None = None) -> None:
        self.update(proposal.num_draft_tokens, num_accepted, draft_seconds, proposal.num_model_steps, verify_seconds,
                    num_catch_up_tokens=proposal.num_catch_up_tokens, reach=reach)


class TreeSizer(Sizer):
    """A tree's node budget, depth and branching per round (branching 1, or no node: the round is a chain round)."""

    @abc.abstractmethod
    def choose_tree(self, depth_limit: int, growth: tuple[int, int | None]):
        """The next round's `hf_spec.sizing.tree_size.TreeChoice`, at most ``depth_limit`` deep; ``growth``: the
        drafter's ``(children per node, nodes per level or None)``."""

    @abc.abstractmethod
    def learn_tree(self, tree: DraftTree, path: list[int], draft_seconds: float,
                    verify_seconds: float | None) -> None:
        """Learn from a finished tree round: the accepted ``path`` (node indices, root's child first)."""

    def learn_chain(self, proposal: Proposal, num_accepted: list[int], draft_seconds: float,
                    verify_seconds: float | None, reach: list[list[float]] | None = None) -> None:
        """A one-row chain, learnt as the tree it is: node i's parent is node i - 1 (from the path kept: a tree's
        acceptance is learnt per depth and sibling rank, from what each round tried)."""
        self.learn_tree(proposal.as_tree(), list(range(num_accepted[0])), draft_seconds, verify_seconds)
