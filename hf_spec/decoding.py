"""The speculative decoding loop: draft, verify, accept, stop, commit and roll back.

What it does: for a decoder-only target and a drafter that shares its tokenizer, each round drafts ``k`` tokens from
the drafter's law q, runs the target once over the block to get p at ``k + 1`` positions, keeps the accepted prefix
plus one recovered or bonus token (`hf_spec.rejection`), stops exactly where target-only decoding would, and rolls
both caches back (`hf_spec.caches`). The output law equals target-only sampling (or greedy decoding).

What it does not do: beam search, several return sequences, encoder-decoder models, caches other than
``DynamicCache``; these are refused before the loop starts (`hf_spec.validation`). Rows of a batch advance by
different amounts: `hf_spec.rows` keeps their bookkeeping out of this loop, `hf_spec.recording` keeps scores,
logits, the streamer and timings, and `hf_spec.drafting.draft_length` chooses k.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_spec.caches import crop_to, select_rows
from hf_spec.drafting.base import DraftContext, Drafter
from hf_spec.drafting.draft_length import AutoDraftLength, FixedDraftLength
from hf_spec.forward import extend_mask, forward_missing, forward_missing_with_features, has_invalid_values
from hf_spec.recording import OutputRecorder, RoundTimer
from hf_spec.rejection import accept_draft_tokens, accept_greedy
from hf_spec.rows import RaggedBatch
from hf_spec.stats import SpeculativeStats
from logits_processors import process_block


@dataclasses.dataclass
class DecodeResult:
    """The loop's output: sequences and, when asked for, per-token scores and raw logits (transformers' shapes)."""

    sequences: torch.Tensor  # [batch, prompt + new]
    scores: tuple[torch.Tensor, ...] | None  # one [batch, vocab] per new token, after the processor chain
    logits: tuple[torch.Tensor, ...] | None  # one [batch, vocab] per new token, raw target logits
    stats: SpeculativeStats


def speculative_decode(
    target: PreTrainedModel,
    drafter: Drafter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_cache,
    *,
    draft_length: FixedDraftLength | AutoDraftLength,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    streamer: BaseStreamer | None = None,
) -> DecodeResult:
    """Generate with the target, speculating a block of draft tokens per round.

    Args:
        target: a decoder-only model.
        drafter: where draft tokens come from (`hf_spec.drafting`), on the target's device and tokenizer.
        input_ids: ``[batch, prompt]`` the prompts, left-padded.
        attention_mask: ``[batch, prompt]`` or ``None`` when there is no padding.
        target_cache: the target's croppable cache, holding a prefix of ``input_ids`` shorter than all of it.
        draft_length: chooses k, the tokens drafted in each round (fewer near ``max_length``, or when the drafter
            has fewer), and learns from each round.
        logits_processor: the chain applied, identically and per position, to draft and target logits.
        stopping_criteria: checked after every emitted token of every row.
        generation_config: read for ``do_sample``, ``max_length``, ``output_scores``, ``output_logits``.
        pad_token_id: fills finished rows and holes.
        generator: randomness for drafting and acceptance; ``None`` uses torch's default generator.
        streamer: receives every emitted token once, in order (batch of one).
    """
    stats = SpeculativeStats()
    recorder = OutputRecorder(generation_config, input_ids.shape[0], streamer)
    vocab_size = target.config.get_text_config().vocab_size
    context = DraftContext(logits_processor, vocab_size, generation_config.do_sample, generator)
    drafter.reset()
    batch = RaggedBatch.start(input_ids, attention_mask, pad_token_id)

    try:
        while batch.num_active > 0:
            # Drafting past a row's budget is cut by the stopping criteria; the row furthest from it sets the limit.
            k = draft_length.choose(max(0, generation_config.max_length - min(batch.active_lengths()) - 1))
            timer = RoundTimer(synchronize=draft_length.is_timed)

            # 1. Draft up to k tokens, each from the drafter's law q given its own prefix.
            proposal = drafter.propose(batch, k, context)
            draft_ids, k = proposal.draft_ids, proposal.num_draft_tokens  # [active, k]
            timer.mark_drafted(draft_ids)

            # 2. Verify: one target pass over the block gives k + 1 raw logits, processed position by position (and
            #    the hidden states a draft head reads).
            block_logits, block_scores = _verify(target, target_cache, batch, draft_ids, logits_processor, drafter)

            # 3. Accept a prefix of each row's draft, then one recovered or bonus token.
            if context.do_sample:
                output_ids, num_accepted = accept_draft_tokens(
                    draft_ids, proposal.draft_probs, block_scores.softmax(dim=-1), generator
                )
            else:
                output_ids, num_accepted = accept_greedy(draft_ids, block_scores)
            num_accepted = read_accepted(num_accepted, proposal.is_invalid, block_logits, block_scores)
            timer.mark_verified()

            # 4. Stop each row exactly where target-only decoding would: after its first token meeting a criterion.
            num_kept, is_done = batch.count_until_stop(stopping_criteria, output_ids, [n + 1 for n in num_accepted])
            recorder.record(batch.active_list, output_ids, block_scores, block_logits, num_kept)
            stats.record_round(k, num_accepted, num_kept, batch.active_list, input_ids.shape[0])
            draft_length.update(k, num_accepted, timer.draft_seconds, proposal.num_model_steps,
                                None if stats.num_rounds == 1 else timer.verify_seconds)  # round 1 holds the prefill

            # 5. Commit, and roll back: both caches keep the model view's columns but its last; finished rows leave.
            staying, num_cached = batch.commit(output_ids, num_accepted, num_kept, is_done)
            roll_back(target_cache, drafter, num_cached, staying)
            stats.record_seconds(timer.draft_seconds, timer.seconds_since_drafted())
    finally:
        # An exception mid-round (or a stop) must never leave a cache holding tokens that were not committed.
        roll_back(target_cache, drafter, batch.model_ids.shape[1] - 1, None)

    scores, logits = recorder.finish()
    return DecodeResult(sequences=batch.row_ids, scores=scores, logits=logits, stats=stats)


def _verify(target: PreTrainedModel, target_cache, batch: RaggedBatch, draft_ids: torch.Tensor,
            logits_processor: LogitsProcessorList, drafter: Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """``(raw logits, processed scores)``, each ``[active, k + 1, vocab]``: one target pass over the tokens its cache
    lacks plus the block ``draft_ids`` ``[active, k]``, each position processed with its own prefix. A drafter with
    ``feature_layers`` observes those hidden states of every token fed."""
    k = draft_ids.shape[1]
    sequence_ids, mask = torch.cat([batch.model_ids, draft_ids], dim=1), extend_mask(batch.model_mask, k)
    if drafter.feature_layers is None:
        block_logits = forward_missing(target, target_cache, sequence_ids, mask, num_logits=k + 1)
    else:
        block_logits, features = forward_missing_with_features(target, target_cache, sequence_ids, mask, k + 1,
                                                               drafter.feature_layers)  # features [active, fed, F]
        drafter.observe(features, start=sequence_ids.shape[1] - features.shape[1])
    # block_logits: [active, k + 1, vocab]
    row_ids, lengths = batch.row_view(draft_ids[:, :0])
    block_scores = batch.to_active(process_block(
        logits_processor, row_ids, batch.to_batch(draft_ids, batch.pad_token_id), batch.to_batch(block_logits),
        lengths,
    ))  # [active, k + 1, vocab]
    return block_logits, block_scores


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


def roll_back(target_cache, drafter: Drafter, num_cached: int, staying_rows: torch.Tensor | None) -> None:
    """Restore the cache invariant: at most ``num_cached`` positions (the model view but its last column), and only
    ``staying_rows`` (indices into the rows the caches held) when given; the drafter follows."""
    if staying_rows is not None:
        select_rows(target_cache, staying_rows)
    crop_to(target_cache, num_cached)
    drafter.roll_back(num_cached, staying_rows)
