"""The speculative loop with a tree of drafts per round: many candidate continuations, one target pass.

The same five steps as `hf_spec.decoding`, for a batch of one row: `hf_spec.drafting.tree_size` sizes the round's
tree (a fixed budget, or the budget and branching with the most expected tokens per second), the drafter proposes it
(`hf_spec.drafting.tree`), one target pass verifies every node under a tree attention mask
(`hf_spec.forward.forward_tree`), `hf_spec.rejection.accept_tree` keeps one path and a next token with the target's
exact law, stopping criteria cut it where target-only decoding would stop, and both caches keep the committed prefix
plus the accepted path's entries (`hf_spec.caches.keep_tree_path`; nothing is recomputed) before the usual rollback.
A draft head gets the target's hidden states of the committed tokens and of the accepted path from the same pass.

Why one row: each row of a batch would need its own tree, its own 4D mask and its own accepted path gathered from
the cache; with holes (`hf_spec.rows`) that is a different bookkeeping, left for later. Batches use chains.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_spec.caches import check_tree_cache, keep_tree_path
from hf_spec.decoding import DecodeResult, read_accepted, roll_back
from hf_spec.drafting.base import DraftContext
from hf_spec.drafting.tree import DraftTree, TreeDrafter
from hf_spec.drafting.tree_size import AutoTreeSize, FixedTreeSize
from hf_spec.forward import forward_tree, forward_tree_with_features
from hf_spec.recording import OutputRecorder, RoundTimer
from hf_spec.rejection import accept_tree, accept_tree_greedy
from hf_spec.rows import RaggedBatch
from hf_spec.stats import SpeculativeStats
from logits_processors import process_step


def tree_decode(
    target: PreTrainedModel,
    drafter: TreeDrafter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_cache,
    *,
    tree_size: FixedTreeSize | AutoTreeSize,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    streamer: BaseStreamer | None = None,
) -> DecodeResult:
    """Generate with the target, verifying a tree of draft tokens per round.

    Arguments as `hf_spec.decoding.speculative_decode`, with ``tree_size`` (each round's node budget, depth and
    branching, fixed or chosen from measured acceptance and costs) in place of the draft length.
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"Tree drafts (`num_tree_nodes`) support a batch of one row, but `input_ids` has "
                         f"{input_ids.shape[0]} rows: each row would need its own tree and accepted path in the "
                         "cache. Leave `num_tree_nodes` unset to draft chains, which batch.")
    check_tree_cache(target_cache, "cache")
    stats = SpeculativeStats()
    recorder = OutputRecorder(generation_config, 1, streamer)
    context = DraftContext(logits_processor, target.config.get_text_config().vocab_size,
                           generation_config.do_sample, generator)
    drafter.reset()
    if isinstance(tree_size, AutoTreeSize):
        tree_size.shape = drafter.growth
    batch = RaggedBatch.start(input_ids, attention_mask, pad_token_id)
    try:
        while batch.num_active > 0:
            timer = RoundTimer(synchronize=tree_size.is_timed)

            # 1. Draft a tree: its budget, depth (none past max_length) and branching chosen for this round.
            choice = tree_size.choose_tree(max(0, generation_config.max_length - batch.lengths[0] - 1))
            tree = drafter.propose_tree(batch, choice.num_nodes, choice.max_depth, context, choice.branching)
            timer.mark_drafted(tree.token_ids)

            # 2. Verify: one target pass over the last committed token and every node: p at the root and each node.
            num_committed = batch.model_ids.shape[1]
            tree_logits, tree_scores, features = _verify(target, target_cache, batch, tree, logits_processor,
                                                         drafter.feature_layers)

            # 3. Accept a path from the root, then one recovered or bonus token.
            path, output_ids, path_logits, path_scores = _accept(tree, tree_logits, tree_scores, context)
            timer.mark_verified()

            # 4. Stop exactly where target-only decoding would.
            num_kept, is_done = batch.count_until_stop(stopping_criteria, output_ids, [len(path) + 1])
            recorder.record(batch.active_list, output_ids, path_scores, path_logits, num_kept)
            stats.record_round(tree.num_nodes, [len(path)], num_kept, batch.active_list, 1,
                               depth=max(tree.depths, default=0))
            tree_size.update_tree(tree, path, timer.draft_seconds,
                                  None if stats.num_rounds == 1 else timer.verify_seconds)  # round 1: the prefill

            # 5. Commit: both caches keep the committed prefix and the accepted path's entries, then roll back; a
            #    draft head observes the target's features of the committed tokens fed and of the path.
            if features is not None:
                _observe_path(drafter, features, tree, path, num_committed)
            keep_tree_path(target_cache, num_committed, path)
            drafter.keep_path(path)
            staying, num_cached = batch.commit(output_ids, [len(path)], num_kept, is_done)
            roll_back(target_cache, drafter, num_cached, staying)
            stats.record_seconds(timer.draft_seconds, timer.seconds_since_drafted())
    finally:
        # An exception mid-round must never leave a cache holding tokens that were not committed (tree nodes sit
        # after the committed positions, so cropping drops them).
        roll_back(target_cache, drafter, batch.model_ids.shape[1] - 1, None)

    scores, logits = recorder.finish()
    return DecodeResult(sequences=batch.row_ids, scores=scores, logits=logits, stats=stats)


def _accept(tree: DraftTree, tree_logits: torch.Tensor, tree_scores: torch.Tensor, context: DraftContext
            ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepted path (node indices), the emitted ids ``[1, depth + 1]`` (the path's tokens, then the recovered or
    bonus token), and the raw logits and processed scores along the path ``[1, depth + 1, vocab]``, read with the
    numerical checks of both laws."""
    if context.do_sample:
        path, next_id = accept_tree(tree.token_ids, tree.parents, tree.draft_probs, tree_scores.softmax(dim=-1),
                                    context.generator)
    else:
        path, next_id = accept_tree_greedy(tree.token_ids, tree.parents, tree_scores)
    rows = torch.tensor([-1, *path], device=tree_scores.device) + 1  # score rows along the path
    path_logits, path_scores = tree_logits[rows][None], tree_scores[rows][None]  # [1, depth + 1, vocab]
    read_accepted(torch.tensor([len(path)], device=tree_scores.device), tree.is_invalid, path_logits, path_scores)
    return path, torch.cat([tree.token_ids[path], next_id.view(1)])[None], path_logits, path_scores


def _observe_path(drafter: TreeDrafter, features: torch.Tensor, tree: DraftTree, path: list[int],
                  num_committed: int) -> None:
    """Hand a draft head the target's features ``[missing + n, F]`` of the committed tokens the verify pass fed and
    of the accepted path's nodes: the columns they now hold, from ``num_committed - missing`` on."""
    num_missing = features.shape[0] - tree.num_nodes
    fed = torch.tensor([*range(num_missing), *(num_missing + node for node in path)], device=features.device)
    drafter.observe(features[fed][None], start=num_committed - num_missing)


def _verify(target: PreTrainedModel, target_cache, batch: RaggedBatch, tree: DraftTree,
            logits_processor: LogitsProcessorList, feature_layers: list[int] | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(raw logits, processed scores)``, each ``[n + 1, vocab]``: after the root and after each node, each
    processed with its own prefix (the committed row and the node's path); and, when ``feature_layers`` are named,
    those hidden states of every token fed ``[missing committed + n, F]`` (``None`` otherwise)."""
    inputs = (target, target_cache, batch.model_ids, batch.model_mask, tree.token_ids,
              torch.tensor(tree.depths, dtype=torch.long, device=tree.token_ids.device), tree.visibility())
    features = None
    if feature_layers is None:
        logits = forward_tree(*inputs, num_logits=tree.num_nodes + 1)  # [n + 1, vocab]
    else:
        logits, features = forward_tree_with_features(*inputs, num_logits=tree.num_nodes + 1,
                                                      feature_layers=feature_layers)
    scores = []
    for node in range(-1, tree.num_nodes):
        row_ids, lengths = batch.row_view(tree.token_ids[tree.path_to(node)][None])
        scores.append(process_step(logits_processor, row_ids, logits[node + 1][None], lengths)[0])
    return logits, torch.stack(scores), features
