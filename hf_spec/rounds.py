"""The shape of a round: a chain of draft tokens, or a tree of them. `hf_spec.decoding` runs one loop for both.

A chain is a tree of width one, and the loop's five steps are the same for both. A call's `Rounds` (chosen once per
call, `hf_spec.plan`) drafts each round and hands the loop a `Round`, which carries its own verify, accept, learn and
keep steps, so the loop never asks which kind it holds:

- `ChainRounds` drafts k tokens per row (``num_assistant_tokens``, fixed or ``"auto"``) as a `ChainRound`: one causal
  target pass over the block; sampled, the call's chain rule (`hf_spec.verification`: block verification by
  default); the accepted prefix is already where the cache needs it.
- `TreeRounds` drafts a tree of at most N tokens (``num_tree_nodes``) for a batch of one row as a `TreeRound`: one
  target pass under a tree attention mask; sampled, the call's tree rule (traversal verification by default) keeps
  one path; the caches keep the committed prefix and the path's entries (`hf_spec.caches.keep_tree_path`),
  gathered, never recomputed. Where the sizer chooses a chain (or nothing), or the drafted tree comes out a chain
  (sampled, where the draft's nucleus holds one token), the round is a `ChainRound`: the same tokens and laws, but
  causal passes with no tree mask and one processor pass over the block.

Why trees are for one row: each row would need its own tree, 4D mask and gathered path, and the suffix and
branching drafters grow one row's tree from host-side candidates. The loop's holes (`hf_spec.rows`) would carry the
uneven paths, but the drafters would have to grow every row's tree in one pass to keep a batch's draft cost; that is
not done, so a batch with ``num_tree_nodes`` is refused by name.
"""

from __future__ import annotations

import abc
import dataclasses

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from hf_spec.caches import check_tree_cache, crop_to, keep_tree_path, move_columns, select_rows, static_length
from hf_spec.conditioning import Conditioning
from hf_spec.drafting.base import DraftContext, Drafter, Proposal
from hf_spec.drafting.tree import DraftTree, TreeDrafter
from hf_spec.forward import extend_mask, forward_missing, forward_tree, has_invalid_values
from hf_spec.rejection import accept_greedy, accept_tree_greedy
from hf_spec.rows import RaggedBatch, Rollback
from hf_spec.sizing.base import ChainSizer, Sizer, TreeSizer
from hf_spec.timing.probe import correct_costs, probe_costs, probe_sizes
from hf_spec.verification import BLOCK, Verification
from logits_processors import process_block, process_step


@dataclasses.dataclass
class Verified:
    """What the target's pass over a draft gave."""

    logits: torch.Tensor  # chain: [active, k + 1, vocab]; tree: [n + 1, vocab] (root, then each node); raw, float32
    scores: torch.Tensor  # the same, each position processed by the chain with its own prefix
    features: torch.Tensor | None  # the hidden states a draft head reads, of every token fed (None without a head)
    num_committed: int  # model-view columns before the draft


@dataclasses.dataclass
class Accepted:
    """What the acceptance rule kept: per active row, accepted draft tokens and one recovered or bonus token."""

    output_ids: torch.Tensor  # [active, m + 1]; row a's first num_accepted[a] + 1 are emitted
    num_accepted: torch.Tensor  # [active] int64, on the device (read with the numerical checks)
    logits: torch.Tensor  # [active, m + 1, vocab] raw target logits along what was kept
    scores: torch.Tensor  # [active, m + 1, vocab] processed
    path: list[int] | None = None  # a tree's accepted nodes, root's child first
    reach: torch.Tensor | None = None  # [active, m + 1] float64: P(>= j kept | the draft) where the rule reports it


class Round(abc.ABC):
    """One round's draft, with the steps the loop runs on it in order (see `hf_spec.decoding`)."""

    drafter: Drafter
    sizer: Sizer
    verification: Verification

    @property
    @abc.abstractmethod
    def num_drafted(self) -> int:
        """Draft tokens per row (a tree: its nodes)."""

    @property
    @abc.abstractmethod
    def depth(self) -> int | None:
        """A tree round's depth (a chain round of a tree call: its length), ``None`` in a chain call."""

    @property
    @abc.abstractmethod
    def is_invalid(self) -> torch.Tensor:
        """``[2]`` bool: whether the draft's logits, and its processed scores, held NaN or inf."""

    @property
    @abc.abstractmethod
    def drafted_ids(self) -> torch.Tensor:
        """The draft's tokens (a chain's ``[active, k]``; a tree's ``[2, n]``: its ids and parents)."""

    @abc.abstractmethod
    def verify(self, target: PreTrainedModel, target_cache, batch: RaggedBatch,
               logits_processor: LogitsProcessorList) -> Verified:
        """2. One target pass over the tokens its cache lacks and the draft."""

    @abc.abstractmethod
    def accept(self, verified: Verified, context: DraftContext) -> Accepted:
        """3. The acceptance rule."""

    def read_counts(self, accepted: Accepted) -> list[int]:
        """3, on the host: the accepted counts, read with the numerical checks of both laws (`read_accepted`)."""
        return read_accepted(accepted.num_accepted, self.is_invalid, accepted.logits, accepted.scores)

    @abc.abstractmethod
    def learn(self, accepted: Accepted, num_accepted: list[int], draft_seconds: float,
              verify_seconds: float | None) -> None:
        """What the sizer learns from the round (``verify_seconds`` is ``None`` for the call's first, which holds the
        prefill)."""

    def keep(self, target_cache, verified: Verified, accepted: Accepted) -> None:
        """5, first half: what the caches and the drafter keep of the verified draft, before the loop's rollback."""
        if verified.features is not None:  # every token fed; the rollback drops the rejected drafts'
            self.drafter.observe(verified.features,
                                 start=verified.num_committed + self.num_drafted - verified.features.shape[1])


@dataclasses.dataclass
class ChainRound(Round):
    """k draft tokens per active row."""

    proposal: Proposal
    drafter: Drafter
    sizer: Sizer
    verification: Verification
    in_tree_call: bool = False  # a tree call's chain round reports its length as its depth

    @property
    def num_drafted(self) -> int:
        return self.proposal.num_draft_tokens

    @property
    def depth(self) -> int | None:
        return self.proposal.num_draft_tokens if self.in_tree_call else None

    @property
    def is_invalid(self) -> torch.Tensor:
        return self.proposal.is_invalid

    @property
    def drafted_ids(self) -> torch.Tensor:
        return self.proposal.draft_ids

    def verify(self, target: PreTrainedModel, target_cache, batch: RaggedBatch,
               logits_processor: LogitsProcessorList) -> Verified:
        """``[active, k + 1, vocab]`` logits and scores, position i processed with the row's prefix and
        ``draft_ids[:, :i]``."""
        draft_ids = self.proposal.draft_ids  # [active, k]
        k = draft_ids.shape[1]
        sequence_ids, mask = torch.cat([batch.model_ids, draft_ids], dim=1), extend_mask(batch.model_mask, k)
        logits, features = forward_missing(target, target_cache, sequence_ids, mask, k + 1,
                                           self.drafter.feature_layers)  # [active, k + 1, vocab]
        row_ids, lengths = batch.row_view(draft_ids[:, :0])
        scores = batch.to_active(process_block(
            logits_processor, row_ids, batch.to_batch(draft_ids, batch.pad_token_id), batch.to_batch(logits),
            lengths,
        ))  # [active, k + 1, vocab]
        return Verified(logits, scores, features, batch.model_ids.shape[1])

    def accept(self, verified: Verified, context: DraftContext) -> Accepted:
        if not context.do_sample:
            output_ids, num_accepted = accept_greedy(self.proposal.draft_ids, verified.scores)
            return Accepted(output_ids, num_accepted, verified.logits, verified.scores)  # the counts are the reach
        asks_reach = {"with_reach": True} if self.verification.reports_reach else {}
        output_ids, num_accepted, *reach = self.verification.chain(
            self.proposal.draft_ids, self.proposal.draft_probs, verified.scores.softmax(dim=-1), context.generator,
            **asks_reach)
        return Accepted(output_ids, num_accepted, verified.logits, verified.scores, reach=reach[0] if reach else None)

    def learn(self, accepted: Accepted, num_accepted: list[int], draft_seconds: float,
              verify_seconds: float | None) -> None:
        reach = None if accepted.reach is None else accepted.reach.tolist()  # read after the counts: no wait
        self.sizer.learn_chain(self.proposal, num_accepted, draft_seconds, verify_seconds, reach)


@dataclasses.dataclass
class TreeRound(Round):
    """A tree of draft tokens for one row."""

    tree: DraftTree
    drafter: TreeDrafter
    sizer: TreeSizer
    verification: Verification

    @property
    def num_drafted(self) -> int:
        return self.tree.num_nodes

    @property
    def depth(self) -> int | None:
        return max(self.tree.depths, default=0)

    @property
    def is_invalid(self) -> torch.Tensor:
        return self.tree.is_invalid

    @property
    def drafted_ids(self) -> torch.Tensor:
        return torch.stack([self.tree.token_ids, torch.tensor(self.tree.parents, device=self.tree.token_ids.device)])

    def verify(self, target: PreTrainedModel, target_cache, batch: RaggedBatch,
               logits_processor: LogitsProcessorList) -> Verified:
        """``[n + 1, vocab]`` logits and scores after the root and after each node, each processed with the
        committed row and the node's path."""
        tree = self.tree
        depths = torch.tensor(tree.depths, dtype=torch.long, device=tree.token_ids.device)
        logits, features = forward_tree(target, target_cache, batch.model_ids, batch.model_mask, tree.token_ids,
                                        depths, tree.visibility(), tree.num_nodes + 1, self.drafter.feature_layers)
        scores = []
        for node in range(-1, tree.num_nodes):
            row_ids, lengths = batch.row_view(tree.token_ids[tree.path_to(node)][None])
            scores.append(process_step(logits_processor, row_ids, logits[node + 1][None], lengths)[0])
        return Verified(logits, torch.stack(scores), features, batch.model_ids.shape[1])

    def accept(self, verified: Verified, context: DraftContext) -> Accepted:
        tree = self.tree
        if context.do_sample:
            path, next_id = self.verification.tree(tree.token_ids, tree.parents, tree.draft_probs,
                                                   verified.scores.softmax(dim=-1), context.generator)
        else:
            path, next_id = accept_tree_greedy(tree.token_ids, tree.parents, verified.scores)
        device = verified.scores.device
        rows = torch.tensor([-1, *path], device=device) + 1  # score rows along the path
        output_ids = torch.cat([tree.token_ids[path], next_id.view(1)])[None]  # [1, depth + 1]
        return Accepted(output_ids, torch.tensor([len(path)], device=device), verified.logits[rows][None],
                        verified.scores[rows][None], path)

    def learn(self, accepted: Accepted, num_accepted: list[int], draft_seconds: float,
              verify_seconds: float | None) -> None:
        self.sizer.learn_tree(self.tree, accepted.path, draft_seconds, verify_seconds)

    def keep(self, target_cache, verified: Verified, accepted: Accepted) -> None:
        """The caches keep the committed prefix and the accepted path's entries; a draft head gets the target's
        features of the committed tokens fed ``[missing + n, F]`` and of the path's nodes."""
        path, num_committed = accepted.path, verified.num_committed
        if verified.features is not None:
            num_missing = verified.features.shape[0] - self.tree.num_nodes
            fed = torch.tensor([*range(num_missing), *(num_missing + node for node in path)],
                               device=verified.features.device)
            self.drafter.observe(verified.features[fed][None], start=num_committed - num_missing)
        keep_tree_path(target_cache, num_committed, path)
        self.drafter.keep_path(path)


class Rounds(abc.ABC):
    """A call's rounds: its drafter, sizer and acceptance rules; the loop asks it for each round's `Round`."""

    drafter: Drafter
    sizer: Sizer
    verification: Verification
    stop_below: float | None = None  # a chain's confidence threshold (`hf_spec.drafting.base.DraftContext`)
    draft_cap: int | None = None  # with a static cache or recurrent states, the most tokens a round drafts (`start`)

    @property
    def is_timed(self) -> bool:
        """Whether the sizer learns from timings (the loop then synchronizes an accelerator before reading clocks)."""
        return self.sizer.is_timed

    @property
    def max_drafted(self) -> int:
        """The most tokens a round may draft (what a static cache is sized for, `caches.static_cache_length`)."""
        return self.sizer.max_drafted

    def max_pass(self, max_new_tokens: int) -> int:
        """The most tokens a round of a call of ``max_new_tokens`` drafts: what a static cache is sized for."""
        return self.max_drafted

    def rule(self, do_sample: bool) -> str:
        """The acceptance rule the rounds run (`hf_spec.stats.SpeculativeStats.verification`)."""
        return self.verification.tree_name if do_sample else "greedy"

    def context(self, logits_processor: LogitsProcessorList, vocab_size: int, do_sample: bool,
                generator: torch.Generator | None) -> DraftContext:
        """What every round's drafting reads (`hf_spec.drafting.base.DraftContext`)."""
        return DraftContext(logits_processor, vocab_size, do_sample, generator, self.stop_below)

    def start_sizer(self, target: PreTrainedModel, max_new_tokens: int) -> None:
        """An automatic sizer without costs starts from the probe's (once per process and models): target passes up
        to the largest the call can use, and the drafter's passes (`probe_widths`)."""
        if not self.sizer.needs_costs:
            return
        sizes = probe_sizes(min(self.max_drafted + 1, max_new_tokens + 1))
        costs = probe_costs(target, self.drafter, sizes, draft_widths=self.probe_widths())
        self.sizer.start_from(costs, catch_up=self.drafter.reports_catch_up)

    def finish_sizer(self, target: PreTrainedModel, is_quiet: bool) -> None:
        """After a call of one row on a machine nothing else loaded (``is_quiet``): where its own timings put the
        draft's step against the target's pass off the probe's costs, the stored costs follow (`correct_costs`: a
        store made while the machine was busy does not outlive its truth)."""
        observed = self.sizer.observed_cost_ratio()
        if observed is not None and is_quiet:
            correct_costs(target, self.drafter, self.sizer.seeded, observed)

    def probe_widths(self) -> tuple[int, ...]:
        """The draft passes the probe times: the step, and the 2-token catch-up where the drafter reports it."""
        return chain_draft_widths(self.drafter)

    def start(self, batch: RaggedBatch, target_cache, conditioning: Conditioning | None) -> None:
        """Before the first round: refuse what this shape cannot do, and reset the drafter's state (a draft model's
        cache of the target's kind, dynamic or static), then hand it what the models read beside the tokens."""
        self.drafter.match_cache(static_length(target_cache))
        self.drafter.reset()
        self.drafter.condition(conditioning or Conditioning(), batch.model_ids, batch.model_mask)
        # a static cache holds what `max_drafted` allows (`hf_spec.caches.static_cache_length`), and recurrent layers
        # record the states of that many tokens a pass (`hf_spec.caches.prepare_for_rollback`): no round drafts more
        is_bounded = static_length(target_cache) is not None or not batch.rules.allows_holes
        self.draft_cap = self.max_drafted if is_bounded else None

    @abc.abstractmethod
    def draft(self, batch: RaggedBatch, tokens_left: int, context: DraftContext) -> Round:
        """1. The round's draft, sized by the sizer, at most ``tokens_left`` deep."""

    def roll_back(self, target_cache, rollback: Rollback) -> None:
        """5, second half: restore the cache invariant (`hf_spec.rows.Rollback`): the rows' moved columns, at most
        ``num_cached`` positions (the model view but its last column), then only ``staying_rows`` when given; the
        drafter follows. The crop comes before the rows leave: a recurrent layer's recorded states hold every row."""
        if rollback.moved is not None:
            move_columns(target_cache, *rollback.moved)
            self.drafter.move_columns(*rollback.moved)
        crop_to(target_cache, rollback.num_cached)
        if rollback.staying_rows is not None:
            select_rows(target_cache, rollback.staying_rows)
        self.drafter.roll_back(rollback.num_cached, rollback.staying_rows)


class ChainRounds(Rounds):
    """k draft tokens per row and round, k from ``sizer`` (`hf_spec.sizing.ChainSizer`); drafting stops early where
    the draft is less confident than ``stop_below`` (transformers' ``assistant_confidence_threshold``), and then runs
    the token-wise rule where the call's chain rule needs the block's length fixed (`Verification.for_chains`)."""

    def __init__(self, drafter: Drafter, sizer: ChainSizer, stop_below: float | None = None,
                 verification: Verification = BLOCK):
        self.drafter, self.sizer, self.stop_below = drafter, sizer, stop_below
        self.verification = verification.for_chains(stops_early=stop_below is not None)

    def rule(self, do_sample: bool) -> str:
        return self.verification.chain_name if do_sample else "greedy"

    def max_pass(self, max_new_tokens: int) -> int:
        return min(self.max_drafted, max_new_tokens)  # a chain never drafts past the answer's end

    def draft(self, batch: RaggedBatch, tokens_left: int, context: DraftContext) -> ChainRound:
        limit = tokens_left if self.draft_cap is None else min(tokens_left, self.draft_cap)
        proposal = self.drafter.propose(batch, self.sizer.choose(limit), context)
        return ChainRound(proposal, self.drafter, self.sizer, self.verification)


class TreeRounds(Rounds):
    """A tree of draft tokens per round for one row; budget, depth and branching from ``sizer``
    (`hf_spec.sizing.TreeSizer`). Where the sizer chooses a chain (branching 1) or no draft, or the tree comes out a
    chain, the round is a `ChainRound`."""

    def __init__(self, drafter: TreeDrafter, sizer: TreeSizer, verification: Verification = BLOCK):
        self.drafter, self.sizer, self.verification = drafter, sizer, verification

    def start(self, batch: RaggedBatch, target_cache, conditioning: Conditioning | None) -> None:
        if batch.batch_size != 1:
            raise ValueError(f"Tree drafts (`num_tree_nodes`) support a batch of one row, but `input_ids` has "
                             f"{batch.batch_size} rows: each row would need its own tree and accepted path in the "
                             "cache. Leave `num_tree_nodes` unset to draft chains, which batch.")
        check_tree_cache(target_cache, "cache")
        super().start(batch, target_cache, conditioning)

    def probe_widths(self) -> tuple[int, ...]:
        """The chain's passes and the drafter's level width."""
        return tuple(sorted({*chain_draft_widths(self.drafter), self.drafter.growth[1] or 1}))

    def draft(self, batch: RaggedBatch, tokens_left: int, context: DraftContext) -> Round:
        choice = self.sizer.choose_tree(tokens_left, self.drafter.growth)
        if choice.num_nodes == 0 or choice.max_depth == 0 or choice.branching == 1:  # a chain, or a plain step
            return self.chain_round(self.drafter.propose(batch, min(choice.num_nodes, choice.max_depth), context))
        tree = self.drafter.propose_tree(batch, choice.num_nodes, choice.max_depth, context, choice.branching)
        if not is_chain(tree.parents):
            return TreeRound(tree, self.drafter, self.sizer, self.verification)
        # Every node is its parent's only child (sampled, the draft's nucleus often holds one token; a suffix match
        # with one continuation): verified as the chain it is. The drafter keeps its state for the whole chain, as
        # after a chain round; the loop's rollback drops what the target rejects.
        self.drafter.keep_path(list(range(tree.num_nodes)))
        return self.chain_round(chain_proposal(tree))

    def chain_round(self, proposal: Proposal) -> ChainRound:
        """A chain round of this call: the chain rule of its `Verification`; the sizer learns it as a tree."""
        return ChainRound(proposal, self.drafter, self.sizer, self.verification, in_tree_call=True)


def chain_draft_widths(drafter: Drafter | None) -> tuple[int, ...]:
    """The draft passes the probe times for auto k and auto trees: the step, and the 2-token catch-up where ``drafter``
    reports it (`hf_spec.bench` probes chains with the same, so that its timed calls find the probe made)."""
    return (1, 2) if drafter is not None and drafter.reports_catch_up else (1,)


def is_chain(parents: list[int]) -> bool:
    """Whether a tree is a chain: node i's parent is node i - 1 (the root's child first)."""
    return parents == list(range(-1, len(parents) - 1))


def chain_proposal(tree: DraftTree) -> Proposal:
    """A tree whose every node is its parent's only child, as the chain proposal it is: node i's stored law is the
    law it was drawn from, which is all the chain's rule needs (with one child per node, `accept_tree` is the chain's
    rule)."""
    return Proposal(tree.token_ids[None], None if tree.draft_probs is None else tree.draft_probs[None],
                    tree.is_invalid, tree.num_model_steps, tree.num_catch_up_tokens)


def read_accepted(num_accepted: torch.Tensor, is_draft_invalid: torch.Tensor, block_logits: torch.Tensor,
                  block_scores: torch.Tensor) -> list[int]:
    """The accepted counts on the host, read together with the numerical checks of both laws: host synchronization
    1 of 2 per round (2: the stopping answers). Raises, naming the source, on NaN or infinite logits from either
    model, or scores the processor chain left unusable (NaN, +inf, every token masked)."""
    is_target_invalid = torch.stack([has_invalid_values(block_logits), has_invalid_values(block_scores)])  # [2]
    *counts, draft_logits_bad, draft_scores_bad, target_logits_bad, target_scores_bad = torch.cat(
        [num_accepted, is_draft_invalid, is_target_invalid]
    ).tolist()
    for is_bad, name in ((draft_logits_bad, "The assistant_model (draft)"), (target_logits_bad, "The target model")):
        if is_bad:
            raise ValueError(f"{name} produced NaN or infinite logits; no token can be sampled from them. Check its "
                             "weights and dtype (float16 overflow is common).")
    for is_bad, where in ((draft_scores_bad, "a drafted position"), (target_scores_bad, "a verified position")):
        if is_bad:
            raise ValueError(
                f"The logits processor chain left no token to sample at {where}: its scores hold NaN or +inf, or "
                "every token is masked (-inf). The models' own logits were finite. Check your `logits_processor` "
                "and the settings that mask tokens (bad_words_ids, suppress_tokens, sequence_bias, top-k/top-p)."
            )
    return counts
