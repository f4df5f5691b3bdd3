"""The speculative decoding loop: draft, verify, accept, roll back.

What it does: for a decoder-only target and a draft that share a tokenizer, each round drafts ``k`` tokens from the
draft's processed law q, runs the target once over the block to get p at ``k + 1`` positions, keeps the accepted
prefix plus one recovered or bonus token (`hf_spec.rejection`), stops exactly where target-only decoding would,
and rolls both caches back (`hf_spec.caches`). The output law equals target-only sampling (or greedy decoding).

What it does not do: beam search, several return sequences, encoder-decoder models, caches other than
``DynamicCache``; these are refused before the loop starts (`hf_spec.validation`). Rows of a batch advance by
different amounts; `hf_spec.rows` keeps their bookkeeping out of this loop.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_spec.caches import crop_to, select_rows
from hf_spec.draft_length import AutoDraftLength
from hf_spec.drafters import DraftContext, Drafter
from hf_spec.forward import extend_mask, forward_missing, has_invalid_values
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
    num_draft_tokens: int | AutoDraftLength,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    streamer: BaseStreamer | None = None,
) -> DecodeResult:
    """Generate with the target, speculating up to ``num_draft_tokens`` draft tokens per round.

    Args:
        target: a decoder-only model.
        drafter: where draft tokens come from (`hf_spec.drafters`), on the target's device and tokenizer.
        input_ids: ``[batch, prompt]`` the prompts, left-padded.
        attention_mask: ``[batch, prompt]`` or ``None`` when there is no padding.
        target_cache: the target's croppable cache, holding a prefix of ``input_ids`` shorter than all of it.
        num_draft_tokens: k, tokens drafted per round (fewer near ``max_length``, or when the drafter has fewer),
            or an `AutoDraftLength` that chooses k before every round and learns from each.
        logits_processor: the chain applied, identically and per position, to draft and target logits.
        stopping_criteria: checked after every emitted token of every row.
        generation_config: read for ``do_sample``, ``max_length``, ``output_scores``, ``output_logits``.
        pad_token_id: fills finished rows and holes.
        generator: randomness for drafting and acceptance; ``None`` uses torch's default generator.
        streamer: receives every emitted token once, in order (batch of one).
    """
    do_sample = generation_config.do_sample
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    row_scores = [[] for _ in range(input_ids.shape[0])]  # per row, one [vocab] per new token
    row_logits = [[] for _ in range(input_ids.shape[0])]
    stats = SpeculativeStats()
    vocab_size = target.config.get_text_config().vocab_size
    context = DraftContext(logits_processor, vocab_size, do_sample, generator)
    chooser = num_draft_tokens if isinstance(num_draft_tokens, AutoDraftLength) else None
    batch = RaggedBatch.start(input_ids, attention_mask, pad_token_id)

    try:
        while batch.num_active > 0:
            # Drafting past a row's budget is cut by the stopping criteria; the row furthest from it sets the limit.
            remaining = generation_config.max_length - min(batch.active_lengths())
            limit = max(0, remaining - 1)
            k = chooser.choose(limit) if chooser is not None else min(num_draft_tokens, limit)

            # 1. Draft up to k tokens, each from the drafter's law q given its own prefix.
            started = time.perf_counter()
            proposal = drafter.propose(batch, k, context)
            draft_ids, k = proposal.draft_ids, proposal.num_draft_tokens  # [active, k]
            _synchronize_for_timing(chooser, draft_ids)
            drafted = time.perf_counter()

            # 2. Verify: one target pass over the block gives k + 1 raw logits, processed position by position.
            block_logits = forward_missing(
                target, target_cache, torch.cat([batch.model_ids, draft_ids], dim=1),
                extend_mask(batch.model_mask, k), num_logits=k + 1,
            )  # [active, k + 1, vocab]
            assert block_logits.shape[-1] == vocab_size, (block_logits.shape, vocab_size)
            row_ids, lengths = batch.row_view(draft_ids[:, :0])
            block_scores = batch.to_active(process_block(
                logits_processor, row_ids, batch.to_batch(draft_ids, pad_token_id), batch.to_batch(block_logits),
                lengths,
            ))  # [active, k + 1, vocab]
            is_target_invalid = has_invalid_values(block_logits) | has_invalid_values(block_scores)

            # 3. Accept a prefix of each row's draft, then one recovered or bonus token.
            if do_sample:
                output_ids, num_accepted = accept_draft_tokens(
                    draft_ids, proposal.draft_probs, block_scores.softmax(dim=-1), generator
                )
            else:
                output_ids, num_accepted = accept_greedy(draft_ids, block_scores)
            # Host synchronization 1 of 2 per round: accepted counts with the numerical checks (2: stopping answers).
            *num_accepted, draft_bad, target_bad = torch.cat(
                [num_accepted, proposal.is_invalid.view(1), is_target_invalid.view(1)]
            ).tolist()
            _raise_if_invalid(draft_bad, target_bad)
            verified = time.perf_counter()

            # 4. Stop each row exactly where target-only decoding would: after its first token meeting a criterion.
            num_kept, is_done = batch.count_until_stop(stopping_criteria, output_ids, [n + 1 for n in num_accepted])
            if streamer is not None:
                streamer.put(output_ids[:, : num_kept[0]].cpu())
            for a, row in enumerate(batch.active_rows.tolist()):
                row_scores[row] += list(block_scores[a, : num_kept[a]]) if keep_scores else []
                row_logits[row] += list(block_logits[a, : num_kept[a]]) if keep_logits else []
            stats.record_round(k, num_accepted, num_kept, batch.active_rows.tolist(), input_ids.shape[0])
            if chooser is not None:
                is_prefill = stats.num_rounds == 1
                chooser.update(k, num_accepted, drafted - started, proposal.num_model_steps,
                               None if is_prefill else verified - drafted)

            # 5. Commit, and roll back: both caches keep the model view's columns but its last; finished rows leave.
            staying, num_cached = batch.commit(output_ids, num_accepted, num_kept, is_done)
            _roll_back(target_cache, drafter, num_cached, staying)
            stats.draft_seconds += drafted - started
            stats.verify_seconds += time.perf_counter() - drafted
    finally:
        # An exception mid-round (or a stop) must never leave a cache holding tokens that were not committed.
        _roll_back(target_cache, drafter, batch.model_ids.shape[1] - 1, None)

    if streamer is not None:
        streamer.end()
    return DecodeResult(
        sequences=batch.row_ids,
        scores=_per_step(row_scores) if keep_scores else None,
        logits=_per_step(row_logits) if keep_logits else None,
        stats=stats,
    )


def _per_step(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """transformers' layout: one ``[batch, vocab]`` per generated step; rows already finished hold zeros."""
    num_steps = max(len(row) for row in per_row)
    template = next(row[0] for row in per_row if row)
    return tuple(
        torch.stack([row[step] if step < len(row) else torch.zeros_like(template) for row in per_row])
        for step in range(num_steps)
    )


def _raise_if_invalid(is_draft_invalid: int, is_target_invalid: int) -> None:
    for is_invalid, name in ((is_draft_invalid, "assistant_model (draft)"), (is_target_invalid, "target model")):
        if is_invalid:
            raise ValueError(
                f"The {name} produced NaN or infinite logits, or logits that the processor chain masked entirely; "
                "no token can be sampled from them. Check the model weights and dtype (fp16 overflow is common) "
                "and the logits processors."
            )


def _roll_back(target_cache, drafter: Drafter, num_cached: int, staying_rows: torch.Tensor | None) -> None:
    """Restore the cache invariant: at most ``num_cached`` positions (the model view but its last column), and only
    ``staying_rows`` (indices into the rows the caches held) when given; the drafter follows."""
    if staying_rows is not None:
        select_rows(target_cache, staying_rows)
    crop_to(target_cache, num_cached)
    drafter.roll_back(num_cached, staying_rows)


def _synchronize_for_timing(chooser: AutoDraftLength | None, tensor: torch.Tensor) -> None:
    """The draft-length chooser times the draft; on an accelerator that needs the draft's kernels finished."""
    if chooser is not None and tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
