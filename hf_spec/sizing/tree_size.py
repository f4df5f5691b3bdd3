"""How big a tree to draft each round: a fixed node budget, or the budget and branching with the most expected tokens
per second (``num_tree_nodes="auto"``).

The model of acceptance is Sequoia's positional one (Chen et al. 2024), kept per depth: ``p[d][r]`` is the
probability that the (r+1)-th child tried at depth d+1 is accepted, given that its parent was reached and its earlier
siblings were rejected (``p[d][0]`` is a chain's acceptance at block position d). A node reached through ranks
r_1 .. r_D is on the accepted path with probability

    f(v) = prod_d (prod_{j < r_d} (1 - p[d][j])) p[d][r_d]

and a tree emits 1 + sum_v f(v) tokens in expectation. `grow_values` replays the drafter's own growth rule with f as
the value (level by level, the ``width`` best nodes of a level expanded into ``branching`` children; or best-first
over the whole tree for a drafter without a width, such as suffix matching), giving the expected tokens and the depth
of the tree for every budget N. A round costs one draft pass per depth (a draft model or head; nothing for suffix
matching) plus one target pass over N + 1 tokens, plus a draft model's catch-up: where the accepted path ends at a
node the draft never evaluated (one without children: the deepest level, the siblings not expanded), its next first
pass feeds two tokens (`catch_up_chances`: that happens with chance sum f(v) over those nodes; the premium is the
probe's 2-token pass over its step, learnt apart from the step as auto k does). `AutoTreeSize` estimates p and the
costs online as `AutoDraftLength` does (`hf_spec.sizing.online`: forgetting, shrinkage, the probe's costs as a
start, exploration after rounds without drafting, and the clock overruling the model), and before every round picks
the N in 0 .. ``max_nodes`` and the branching (the drafter's, or 1: a chain) with the most expected tokens per second.
Where blocks are expensive it thus drafts a chain, or nothing. Auto k's two rules for thin evidence hold here too:
where no tree pays but one token would at `HOPE_ERRORS` standard errors above the first depth's estimate, one token;
where the best tree is D deep and a tree D + 1 deep would pay at `REACH_ERRORS` standard errors above the estimate
at depth D (never observed while trees stop at D), the deeper tree. A child the drafter could not draw (a tree
short of its budget: sampled, the draft's nucleus held one token where two children were asked for) counts as a
rejection at its rank, since it adds nothing: without it, the sizer kept pricing siblings that never came (sampled
edit requests: trees of 19 nodes that came out 10-node chains, and a slower climb than auto k).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import TYPE_CHECKING

from hf_spec.checks import check_int

if TYPE_CHECKING:
    from hf_spec.drafting.tree import DraftTree
from hf_spec.sizing.base import TreeSizer
from hf_spec.sizing.costs import CostTable
from hf_spec.sizing.estimates import DecayedMean, PositionalAcceptance
from hf_spec.sizing.online import HOPE_ERRORS, MAX_CHOSEN, REACH_ERRORS, OnlineSizer

#: The node budget most with ``num_tree_nodes="auto"``: the probe measures target passes up to this many + 1 tokens.
DEFAULT_MAX_TREE_NODES = 32
#: Children per node the model considers for a drafter without its own limit (suffix matching).
MAX_RANKS = 8


@dataclasses.dataclass(frozen=True)
class TreeChoice:
    """One round's tree: at most ``num_nodes`` nodes, ``max_depth`` deep, ``branching`` children per node (``None``:
    the drafter's own limit; 1: a chain)."""

    num_nodes: int
    max_depth: int
    branching: int | None = None


class FixedTreeSize(TreeSizer):
    """The same budget every round (shallower near ``max_length``)."""

    def __init__(self, num_nodes: int, max_depth: int):
        self.num_nodes, self.max_depth = check_int("num_tree_nodes", num_nodes), max_depth

    @property
    def max_drafted(self) -> int:
        return self.num_nodes

    def choose_tree(self, depth_limit: int, growth: tuple[int, int | None]) -> TreeChoice:
        depth = min(self.max_depth, depth_limit)
        return TreeChoice(self.num_nodes if depth > 0 else 0, depth)

    def learn_tree(self, tree: DraftTree, path: list[int], draft_seconds: float,
                    verify_seconds: float | None) -> None:
        """Nothing to learn."""


def grow_values(acceptance: list[list[float]], num_nodes: int, branching: int,
                width: int | None) -> tuple[list[float], list[int], list[int]]:
    """``(f, depth, parent)`` of each node in the order the drafter adds them, at most ``num_nodes``: the expected
    tokens of a budget N are ``1 + sum(f[:N])`` and its draft passes ``depth[N - 1]``.

    Args:
        acceptance: ``p[d][r]`` for depths ``0 .. D - 1`` (the tree is at most D deep) and ranks ``0 .. branching - 1``.
        width: nodes expanded per level (level by level), or ``None``: best-first over the whole tree.
    """
    values: list[float] = []
    depths: list[int] = []
    parents: list[int] = []

    def children(node: int, depth: int) -> list[tuple[float, int]]:  # (f, parent) of each child of a node at depth
        reach, out = (values[node] if node >= 0 else 1.0), []
        for rank in range(min(branching, len(acceptance[depth]))):
            out.append((reach * acceptance[depth][rank], node))
            reach *= 1.0 - acceptance[depth][rank]
        return out

    def add(value: float, depth: int, parent: int) -> None:
        values.append(value)
        depths.append(depth)
        parents.append(parent)

    if not acceptance:
        return values, depths, parents
    if width is None:  # best-first: the most valuable node not yet in the tree, which keeps the tree connected
        heap = [(-f, 1, parent) for f, parent in children(-1, 0)]
        heapq.heapify(heap)
        while heap and len(values) < num_nodes:
            negative, depth, parent = heapq.heappop(heap)
            add(-negative, depth, parent)
            if depth < len(acceptance):
                for f, node in children(len(values) - 1, depth):
                    heapq.heappush(heap, (-f, depth + 1, node))
        return values, depths, parents
    frontier, depth = [-1], 0
    while depth < len(acceptance) and len(values) < num_nodes:
        level = []
        for node in frontier:
            for f, parent in children(node, depth):
                if len(values) == num_nodes:
                    break
                add(f, depth + 1, parent)
                level.append(len(values) - 1)
        frontier, depth = sorted(level, key=lambda i: -values[i])[:width], depth + 1
    return values, depths, parents


def catch_up_chances(values: list[float], parents: list[int]) -> list[float]:
    """For each budget N (index N - 1): the chance that the accepted path ends at a node without children among the
    first N, which a draft model never fed (the deepest level is never evaluated), so that its next first pass feeds
    two tokens (that node and the bonus token), a catch-up. A path ends at a childless node v with chance f(v)."""
    chances, childless, has_child = [], 0.0, [False] * len(values)
    for value, parent in zip(values, parents):
        if parent >= 0 and not has_child[parent]:
            has_child[parent] = True
            childless -= values[parent]
        childless += value
        chances.append(childless)
    return chances


def missing_children(parents: list[int], branching: int) -> list[tuple[int, int]]:
    """``(depth, rank)`` of every child up to ``branching`` that a node with children (or the root) did not get;
    depth 0 is the root's children. Where a tree stopped short of its budget, these are children the drafter could
    not draw (sampled, the draft's nucleus held fewer tokens than ``branching``): their value is 0."""
    below, counts = [], collections.Counter(parents)  # below[i]: the depth index of node i's children
    for parent in parents:
        below.append(1 if parent < 0 else below[parent] + 1)
    return [(0 if parent < 0 else below[parent], rank)
            for parent, count in counts.items() for rank in range(count, branching)]


def rank_outcomes(parents: list[int], path: list[int]) -> list[tuple[int, int, bool]]:
    """``(depth, rank, accepted)`` for every child the acceptance rule tried: at the root and at each node of the
    accepted ``path``, its children in order up to the accepted one (all of them where the path ends); depth 0 is the
    root's children."""
    outcomes = []
    for depth, node in enumerate([-1, *path]):
        accepted = path[depth] if depth < len(path) else None
        for rank, child in enumerate(child for child, parent in enumerate(parents) if parent == node):
            outcomes.append((depth, rank, child == accepted))
            if child == accepted:
                break
    return outcomes


class AutoTreeSize(OnlineSizer, TreeSizer):
    """Chooses the node budget and branching before every round from acceptance and costs measured online (see the
    module docstring).

    Args:
        max_nodes: the largest budget considered.
        max_depth: the deepest tree (and the longest chain).
        initial: nodes of the first round, before any cost is known.
        later_prior: acceptance assumed for second and later children before any was tried.
        Other arguments: as `AutoDraftLength` (``prior_acceptance`` is the first children's).

    Attributes:
        chosen, chosen_branching: the budget and branching of the last rounds (up to
            `hf_spec.sizing.online.MAX_CHOSEN`), across calls when reused.
    """

    def __init__(self, max_nodes: int = DEFAULT_MAX_TREE_NODES, max_depth: int = 10, initial: int = 4,
                 later_prior: float = 0.2, prior_acceptance: float = 0.6, prior_weight: float = 2.0,
                 decay: float = 0.97, explore_every: int = 8):
        self.max_nodes, self.max_depth = check_int("max_nodes", max_nodes), check_int("max_depth", max_depth)
        super().__init__(max_depth, max_nodes + 1, initial, prior_acceptance, prior_weight, decay, explore_every)
        if not 0.0 < later_prior < 1.0:
            raise ValueError(f"`later_prior` must be in (0, 1), but is {later_prior!r}.")
        self.later_prior = later_prior
        # rank r + 1 (the second child tried, ...) at each depth, pooled over depths towards later_prior
        self.later = [PositionalAcceptance(max_depth, later_prior, prior_weight, decay) for _ in range(MAX_RANKS - 1)]
        self.tree_step = DecayedMean(decay)  # seconds of a draft pass over a tree level
        self._probed_passes: dict[int, float] = {}  # the probe's draft passes by width, seeding tree_step once
        self._seed_weight = 0.0
        self.chosen_branching: collections.deque[int] = collections.deque(maxlen=MAX_CHOSEN)

    @property
    def max_drafted(self) -> int:
        return self.max_nodes

    def start_from(self, costs: CostTable, weight: float = 4.0, catch_up: bool = True) -> None:
        super().start_from(costs, weight, catch_up)
        passes = costs.draft_pass_seconds or ({1: costs.draft_step_seconds} if costs.draft_step_seconds > 0 else {})
        self._probed_passes, self._seed_weight = dict(passes), weight

    def tree_acceptance(self, branching: int, first: list[float] | None = None) -> list[list[float]]:
        """``p[d][r]`` for ranks ``0 .. branching - 1``: first children from the chain's estimate (or ``first``),
        later ones shrunk towards their rank's pooled rate, which is shrunk towards ``later_prior``."""
        columns = [self.first.estimate() if first is None else first,
                   *(rank.estimate() for rank in self.later[: branching - 1])]
        return [list(row) for row in zip(*columns)]

    def choose_tree(self, depth_limit: int, growth: tuple[int, int | None]) -> TreeChoice:
        """The next round's tree, at most ``depth_limit`` deep (tokens left before ``max_length``), for a drafter
        that grows ``growth`` = (children per node, nodes expanded per level or ``None``: best-first)."""
        depth_limit = max(0, min(depth_limit, self.max_depth))
        self._seed_tree_step(growth[1])
        forced = self._forced_choice()
        if forced is not None:
            branching = 1 if self.exploration.is_exploring or forced == 0 else None
            return self._chose_tree(TreeChoice(forced if depth_limit > 0 else 0, depth_limit, branching), growth)
        plain = 1.0 / self.block_seconds(1)
        best, best_rate = self._best_tree(self.first.estimate(), depth_limit, growth)
        if best.num_nodes > 0 and self.clock.overrules(best_rate / plain):
            best = TreeChoice(0, depth_limit, 1)  # the cost model says draft, the clock says no
        elif best.num_nodes == 0 and depth_limit > 0:  # one token may still pay: it costs little and buys evidence
            hopeful, _ = self._best_tree(self.first.hopeful(HOPE_ERRORS), 1, (1, 1))
            best = TreeChoice(1, 1, 1) if hopeful.num_nodes else best
        elif best.max_depth < depth_limit:  # one level deeper, while the evidence there is thin
            deeper, deeper_rate = self._best_tree(self.first.hopeful(REACH_ERRORS, position=best.max_depth),
                                                  best.max_depth + 1, growth)
            best = deeper if deeper_rate > best_rate else best
        return self._chose_tree(best, growth)

    def _best_tree(self, first: list[float], depth_limit: int, growth: tuple[int, int | None]
                   ) -> tuple[TreeChoice, float]:
        """The budget, depth and branching with the most expected tokens per second, and that rate, where first
        children are accepted at depth d with ``first[d]``: per round, one draft pass per level, the target pass, and
        the draft's catch-up where the accepted path ends at a node it never fed."""
        best, best_rate = TreeChoice(0, depth_limit, 1), 1.0 / self.block_seconds(1)
        drafter_branching, width = growth
        chain_step = self.costs.draft_step.get(0.0)
        catch_up = self.costs.catch_up_ratio * chain_step
        for branching in sorted({1, drafter_branching}):
            step = chain_step if branching == 1 else self.tree_step.get(chain_step)
            acceptance = self.tree_acceptance(min(branching, MAX_RANKS), first)[:depth_limit]
            values, depths, parents = grow_values(acceptance, self.max_nodes, branching, 1 if branching == 1 else width)
            expected = 1.0
            for count, (value, depth, chance) in enumerate(zip(values, depths, catch_up_chances(values, parents)),
                                                           start=1):
                expected += value
                rate = expected / (depth * step + self.block_seconds(count + 1) + chance * catch_up)
                if rate > best_rate:
                    best, best_rate = TreeChoice(count, depth, branching), rate
        return best, best_rate

    def _seed_tree_step(self, width: int | None) -> None:
        """Once: a tree level's draft pass starts from the probe's pass nearest the level's width (a step if none)."""
        if self._probed_passes:
            nearest = min(self._probed_passes, key=lambda size: abs(size - (width or 1)))
            self.tree_step.seed(self._probed_passes[nearest], self._seed_weight)
            self._probed_passes = {}

    def _chose_tree(self, choice: TreeChoice, growth: tuple[int, int | None]) -> TreeChoice:
        self._chose(choice.num_nodes)
        self.chosen_branching.append(choice.branching or growth[0])
        return choice

    def learn_tree(self, tree: DraftTree, path: list[int], draft_seconds: float,
                    verify_seconds: float | None) -> None:
        """Learn from a finished round: the children the rule tried at each depth, and the round's timings."""
        reached = 0  # depths whose first-ranked child was tried
        for depth, rank, accepted in rank_outcomes(tree.parents, path):
            if depth >= self.max_depth or rank >= MAX_RANKS:
                continue
            (self.first if rank == 0 else self.later[rank - 1]).add(depth, accepted)
            if rank == 0:
                reached = max(reached, depth + 1)
        if tree.num_nodes > 0:
            self.first.forget_unreached(reached)
        budget, branching = (self.chosen[-1], self.chosen_branching[-1]) if self.chosen_branching else (0, 1)
        if 0 < tree.num_nodes < budget:  # short of the budget: the children it lacks could not be drawn
            for depth, rank in missing_children(tree.parents, branching):
                if depth < self.max_depth and rank < MAX_RANKS:
                    self.later[rank - 1].add(depth, False)
        is_tree = len(set(tree.parents)) < tree.num_nodes  # some node has a sibling
        self._learn_round(tree.num_nodes + 1, self.tree_step if is_tree else self.costs.draft_step, draft_seconds,
                          tree.num_model_steps, verify_seconds, 1.0 + len(path),
                          self.costs.catch_up_ratio * min(tree.num_catch_up_tokens, 1))
