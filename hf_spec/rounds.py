"""The shape of a round: a chain of draft tokens, or a tree of them. `hf_spec.decoding` runs one loop for both.

A chain is a tree of width one, and the loop's five steps are the same for both; what differs is how the draft is
sized and proposed, how one target pass verifies it, how a path is accepted, and what the caches keep of it. Each
shape is a strategy object, chosen once per call (`hf_spec.plan`):

- `ChainRounds`: k tokens per row (``num_assistant_tokens``, fixed or ``"auto"``); one causal target pass over the
  block; `hf_spec.rejection.accept_draft_tokens` (vectorized over rows and positions); the accepted prefix is already
  where the cache needs it.
- `TreeRounds`: a tree of at most N tokens (``num_tree_nodes``) for a batch of one row; one target pass under a tree
  attention mask; sampled, `hf_spec.traversal.accept_traversal` keeps one path, judged whole from the leaves up
  (``verification="token"``: `hf_spec.rejection.accept_tree`, node by node from the root); the caches keep the
  committed prefix and the accepted path's entries (`hf_spec.caches.keep_tree_path`), gathered, never recomputed. A
  round whose tree the sizer chose as a chain (or as nothing) runs as a chain round instead: the same tokens and
  laws, but causal passes with no tree mask and one processor pass over the block; so is a drafted tree that came
  out a chain (sampled, where the draft's nucleus holds one token), from its verify pass on: a chain verified as a
  tree pays for the tree mask and a processor pass per node.

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

from hf_spec.caches import check_tree_cache, keep_tree_path, static_length
from hf_spec.conditioning import Conditioning
from hf_spec.drafting.base import DraftContext, Drafter, Proposal
from hf_spec.drafting.draft_length import DEFAULT_MAX_DRAFT_TOKENS, FixedDraftLength
from hf_spec.drafting.tree import DraftTree, TreeDrafter
from hf_spec.forward import extend_mask, forward_missing, forward_tree
from hf_spec.rejection import accept_block, accept_draft_tokens, accept_greedy, accept_tree, accept_tree_greedy
from hf_spec.rows import RaggedBatch
from hf_spec.traversal import accept_traversal
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


class Rounds(abc.ABC):
    """One shape of round; the loop calls these in order, once per round (see `hf_spec.decoding`)."""

    drafter: Drafter
    sizer: object  # chooses each round's size and learns from it (`hf_spec.drafting.draft_length`, `tree_size`)
    stop_below: float | None = None  # a chain's confidence threshold (`hf_spec.drafting.base.DraftContext`)
    draft_cap: int | None = None  # with a static cache or recurrent states, the most tokens a round drafts (`start`)

    @property
    def is_timed(self) -> bool:
        """Whether the sizer learns from timings (the loop then synchronizes an accelerator before reading clocks)."""
        return self.sizer.is_timed

    def start(self, batch: RaggedBatch, target_cache, conditioning: Conditioning) -> None:
        """Before the first round: refuse what this shape cannot do, and reset the drafter's state (a draft model's
        cache of the target's kind, dynamic or static), then hand it what the models read beside the tokens."""
        self.drafter.match_cache(static_length(target_cache))
        self.drafter.reset()
        self.drafter.condition(conditioning, batch.model_ids, batch.model_mask)
        # a static cache holds what `max_drafted` allows (`hf_spec.plan.static_cache_length`), and recurrent layers
        # record the states of that many tokens a pass (`hf_spec.caches.prepare_for_rollback`): no round drafts more
        is_bounded = static_length(target_cache) is not None or not batch.rules.allows_holes
        self.draft_cap = self.max_drafted if is_bounded else None

    @property
    def max_drafted(self) -> int:
        """The most tokens a round may draft (what a static cache is sized for, `hf_spec.plan.static_cache_length`):
        the sizer's largest k or node budget; a schedule without one (transformers' "heuristic") is capped at
        `DEFAULT_MAX_DRAFT_TOKENS` in every round."""
        sizer = self.sizer
        for name in ("max_nodes", "num_nodes", "max_draft_tokens"):
            if hasattr(sizer, name):
                return getattr(sizer, name)
        if isinstance(sizer, FixedDraftLength):
            return sizer.num_draft_tokens
        return DEFAULT_MAX_DRAFT_TOKENS

    def max_pass(self, max_new_tokens: int) -> int:
        """The most tokens a round of a call of ``max_new_tokens`` drafts: what a static cache is sized for."""
        return self.max_drafted

    def rule(self, do_sample: bool) -> str:
        """The acceptance rule the rounds run (`hf_spec.stats.SpeculativeStats.verification`)."""
        return "tree" if do_sample else "greedy"

    @abc.abstractmethod
    def draft(self, batch: RaggedBatch, tokens_left: int, context: DraftContext) -> Proposal | DraftTree:
        """1. The round's draft, sized by the sizer, at most ``tokens_left`` deep."""

    @abc.abstractmethod
    def verify(self, target: PreTrainedModel, target_cache, batch: RaggedBatch, draft,
               logits_processor: LogitsProcessorList) -> Verified:
        """2. One target pass over the tokens its cache lacks and the draft."""

    @abc.abstractmethod
    def accept(self, draft, verified: Verified, context: DraftContext) -> Accepted:
        """3. The acceptance rule."""

    @abc.abstractmethod
    def size(self, draft) -> tuple[int, int | None]:
        """``(tokens drafted, tree depth or None)`` for the statistics."""

    @abc.abstractmethod
    def learn(self, draft, accepted: Accepted, num_accepted: list[int], draft_seconds: float,
              verify_seconds: float | None) -> None:
        """What the sizer learns from the round (``verify_seconds`` is ``None`` for the first, which holds the
        prefill)."""

    def keep(self, target_cache, draft, verified: Verified, accepted: Accepted) -> None:
        """5, first half: what the caches and the drafter keep of the verified draft, before the loop's rollback."""
        if verified.features is not None:  # every token fed; the rollback drops the rejected drafts'
            self.drafter.observe(verified.features, start=verified.num_committed + self.size(draft)[0]
                                 - verified.features.shape[1])


class ChainRounds(Rounds):
    """k draft tokens per row and round, k from ``sizer`` (`FixedDraftLength`, `HeuristicDraftLength` or
    `AutoDraftLength`); drafting stops early where the draft is less confident than ``stop_below`` (transformers'
    ``assistant_confidence_threshold``, `hf_spec.drafting.base.DraftContext`)."""

    def __init__(self, drafter: Drafter, sizer, stop_below: float | None = None, verification: str = "block"):
        self.drafter, self.sizer, self.stop_below, self.verification = drafter, sizer, stop_below, verification

    def rule(self, do_sample: bool) -> str:
        """The acceptance rule of a sampled chain: block verification, unless asked for the token-wise rule or the
        draft stops early on its own confidence (block verification needs the block's length fixed before drafting,
        `hf_spec.rejection.accept_block`)."""
        if not do_sample:
            return "greedy"
        return "block" if self.verification == "block" and self.stop_below is None else "token"

    def max_pass(self, max_new_tokens: int) -> int:
        return min(self.max_drafted, max_new_tokens)  # a chain never drafts past the answer's end

    def draft(self, batch: RaggedBatch, tokens_left: int, context: DraftContext) -> Proposal:
        limit = tokens_left if self.draft_cap is None else min(tokens_left, self.draft_cap)
        return self.drafter.propose(batch, self.sizer.choose(limit), context)

    def verify(self, target: PreTrainedModel, target_cache, batch: RaggedBatch, draft: Proposal,
               logits_processor: LogitsProcessorList) -> Verified:
        """``[active, k + 1, vocab]`` logits and scores, position i processed with the row's prefix and
        ``draft_ids[:, :i]``."""
        draft_ids = draft.draft_ids  # [active, k]
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

    def accept(self, draft: Proposal, verified: Verified, context: DraftContext) -> Accepted:
        if context.do_sample:
            accept = accept_block if self.rule(True) == "block" else accept_draft_tokens
            output_ids, num_accepted = accept(draft.draft_ids, draft.draft_probs, verified.scores.softmax(dim=-1),
                                              context.generator)
        else:
            output_ids, num_accepted = accept_greedy(draft.draft_ids, verified.scores)
        return Accepted(output_ids, num_accepted, verified.logits, verified.scores)

    def size(self, draft: Proposal) -> tuple[int, int | None]:
        return draft.num_draft_tokens, None

    def learn(self, draft: Proposal, accepted: Accepted, num_accepted: list[int], draft_seconds: float,
              verify_seconds: float | None) -> None:
        self.sizer.update(draft.num_draft_tokens, num_accepted, draft_seconds, draft.num_model_steps, verify_seconds,
                          num_catch_up_tokens=draft.num_catch_up_tokens)


class TreeRounds(Rounds):
    """A tree of draft tokens per round for one row; budget, depth and branching from ``sizer`` (`FixedTreeSize`
    or `AutoTreeSize`). Where the sizer chooses a chain (branching 1) or no draft, the round is a chain round
    (``chain``): its draft is a `Proposal`, and every step below hands it to ``chain``."""

    def __init__(self, drafter: TreeDrafter, sizer, verification: str = "block"):
        self.drafter, self.sizer, self.verification = drafter, sizer, verification
        self.chain = ChainRounds(drafter, sizer, verification=verification)  # the same kind of rule on its chains

    def rule(self, do_sample: bool) -> str:
        """Sampled: traversal verification of trees (block verification of chains), or node by node (token by
        token) where ``verification="token"``."""
        if not do_sample:
            return "greedy"
        return "traversal" if self.verification == "block" else "tree"

    def start(self, batch: RaggedBatch, target_cache, conditioning: Conditioning) -> None:
        if batch.batch_size != 1:
            raise ValueError(f"Tree drafts (`num_tree_nodes`) support a batch of one row, but `input_ids` has "
                             f"{batch.batch_size} rows: each row would need its own tree and accepted path in the "
                             "cache. Leave `num_tree_nodes` unset to draft chains, which batch.")
        check_tree_cache(target_cache, "cache")
        super().start(batch, target_cache, conditioning)

    def draft(self, batch: RaggedBatch, tokens_left: int, context: DraftContext) -> DraftTree | Proposal:
        choice = self.sizer.choose_tree(tokens_left, self.drafter.growth)
        if choice.num_nodes == 0 or choice.max_depth == 0 or choice.branching == 1:  # a chain, or a plain step
            return self.drafter.propose(batch, min(choice.num_nodes, choice.max_depth), context)
        tree = self.drafter.propose_tree(batch, choice.num_nodes, choice.max_depth, context, choice.branching)
        if not is_chain(tree.parents):
            return tree
        # Every node is its parent's only child (sampled, the draft's nucleus often holds one token; a suffix match
        # with one continuation): verified as the chain it is. The drafter keeps its state for the whole chain, as
        # after a chain round; the loop's rollback drops what the target rejects.
        self.drafter.keep_path(list(range(tree.num_nodes)))
        return chain_proposal(tree)

    def verify(self, target: PreTrainedModel, target_cache, batch: RaggedBatch, draft: DraftTree | Proposal,
               logits_processor: LogitsProcessorList) -> Verified:
        """``[n + 1, vocab]`` logits and scores after the root and after each node, each processed with the
        committed row and the node's path (a chain: `ChainRounds.verify`)."""
        if isinstance(draft, Proposal):
            return self.chain.verify(target, target_cache, batch, draft, logits_processor)
        depths = torch.tensor(draft.depths, dtype=torch.long, device=draft.token_ids.device)
        logits, features = forward_tree(target, target_cache, batch.model_ids, batch.model_mask, draft.token_ids,
                                        depths, draft.visibility(), draft.num_nodes + 1, self.drafter.feature_layers)
        scores = []
        for node in range(-1, draft.num_nodes):
            row_ids, lengths = batch.row_view(draft.token_ids[draft.path_to(node)][None])
            scores.append(process_step(logits_processor, row_ids, logits[node + 1][None], lengths)[0])
        return Verified(logits, torch.stack(scores), features, batch.model_ids.shape[1])

    def accept(self, draft: DraftTree | Proposal, verified: Verified, context: DraftContext) -> Accepted:
        if isinstance(draft, Proposal):
            return self.chain.accept(draft, verified, context)
        if context.do_sample:
            rule = accept_traversal if self.verification == "block" else accept_tree
            path, next_id = rule(draft.token_ids, draft.parents, draft.draft_probs, verified.scores.softmax(dim=-1),
                                 context.generator)
        else:
            path, next_id = accept_tree_greedy(draft.token_ids, draft.parents, verified.scores)
        device = verified.scores.device
        rows = torch.tensor([-1, *path], device=device) + 1  # score rows along the path
        output_ids = torch.cat([draft.token_ids[path], next_id.view(1)])[None]  # [1, depth + 1]
        return Accepted(output_ids, torch.tensor([len(path)], device=device), verified.logits[rows][None],
                        verified.scores[rows][None], path)

    def size(self, draft: DraftTree | Proposal) -> tuple[int, int | None]:
        if isinstance(draft, Proposal):
            return draft.num_draft_tokens, draft.num_draft_tokens
        return draft.num_nodes, max(draft.depths, default=0)

    def learn(self, draft: DraftTree | Proposal, accepted: Accepted, num_accepted: list[int], draft_seconds: float,
              verify_seconds: float | None) -> None:
        if isinstance(draft, Proposal):  # the sizer learns a chain as the tree it is: node i's parent is node i - 1
            self.sizer.update_tree(chain_tree(draft), list(range(num_accepted[0])), draft_seconds, verify_seconds)
        else:
            self.sizer.update_tree(draft, accepted.path, draft_seconds, verify_seconds)

    def keep(self, target_cache, draft: DraftTree | Proposal, verified: Verified, accepted: Accepted) -> None:
        """The caches keep the committed prefix and the accepted path's entries; a draft head gets the target's
        features of the committed tokens fed ``[missing + n, F]`` and of the path's nodes. A chain round's caches
        keep their columns as they are (the loop's rollback drops the rejected ones)."""
        if isinstance(draft, Proposal):
            return self.chain.keep(target_cache, draft, verified, accepted)
        path, num_committed = accepted.path, verified.num_committed
        if verified.features is not None:
            num_missing = verified.features.shape[0] - draft.num_nodes
            fed = torch.tensor([*range(num_missing), *(num_missing + node for node in path)],
                               device=verified.features.device)
            self.drafter.observe(verified.features[fed][None], start=num_committed - num_missing)
        keep_tree_path(target_cache, num_committed, path)
        self.drafter.keep_path(path)


def is_chain(parents: list[int]) -> bool:
    """Whether a tree is a chain: node i's parent is node i - 1 (the root's child first)."""
    return parents == list(range(-1, len(parents) - 1))


def chain_proposal(tree: DraftTree) -> Proposal:
    """A tree whose every node is its parent's only child, as the chain proposal it is: node i's stored law is the
    law it was drawn from, which is all the chain's rule needs (with one child per node, `accept_tree` is the chain's
    rule)."""
    return Proposal(tree.token_ids[None], None if tree.draft_probs is None else tree.draft_probs[None],
                    tree.is_invalid, tree.num_model_steps, tree.num_catch_up_tokens)


def chain_tree(proposal: Proposal) -> DraftTree:
    """A one-row chain proposal as the tree it is (what `AutoTreeSize.update_tree` learns from)."""
    k = proposal.num_draft_tokens
    return DraftTree(proposal.draft_ids[0], list(range(-1, k - 1)), None, proposal.is_invalid,
                     proposal.num_model_steps, proposal.num_catch_up_tokens)
