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
import functools
import inspect
import time

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_spec.caches import cache_length, crop_to, new_cache, select_rows
from hf_spec.rejection import accept_draft_tokens, accept_greedy, sample_from_weights
from hf_spec.rows import RaggedBatch
from hf_spec.stats import SpeculativeStats
from logits_processors import process_block, process_step


@dataclasses.dataclass
class DecodeResult:
    """The loop's output: sequences and, when asked for, per-token scores and raw logits (transformers' shapes)."""

    sequences: torch.Tensor  # [batch, prompt + new]
    scores: tuple[torch.Tensor, ...] | None  # one [batch, vocab] per new token, after the processor chain
    logits: tuple[torch.Tensor, ...] | None  # one [batch, vocab] per new token, raw target logits
    stats: SpeculativeStats


def speculative_decode(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_cache,
    *,
    num_draft_tokens: int,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    streamer: BaseStreamer | None = None,
) -> DecodeResult:
    """Generate with the target, speculating ``num_draft_tokens`` draft tokens per round.

    Args:
        target, draft: decoder-only models on the same device, same tokenizer.
        input_ids: ``[batch, prompt]`` the prompts, left-padded.
        attention_mask: ``[batch, prompt]`` or ``None`` when there is no padding.
        target_cache: the target's croppable cache, holding a prefix of ``input_ids`` shorter than all of it.
        num_draft_tokens: k, tokens drafted per round (fewer near ``max_length``).
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
    draft_cache = new_cache(draft)
    batch = RaggedBatch.start(input_ids, attention_mask, pad_token_id)

    try:
        while batch.num_active > 0:
            # Drafting past a row's budget is cut by the stopping criteria; the row furthest from it sets k.
            remaining = generation_config.max_length - min(batch.active_lengths())
            k = max(0, min(num_draft_tokens, remaining - 1))

            # 1. Draft k tokens, each from the draft's processed law with its own prefix.
            started = time.perf_counter()
            draft_ids, draft_probs, is_draft_invalid = _draft_block(
                draft, draft_cache, batch, logits_processor, k,
                vocab_size=vocab_size, do_sample=do_sample, generator=generator,
            )  # [active, k], [active, k, vocab] or None
            drafted = time.perf_counter()

            # 2. Verify: one target pass over the block gives k + 1 raw logits, processed position by position.
            block_logits = _forward_missing(
                target, target_cache, torch.cat([batch.model_ids, draft_ids], dim=1),
                _extend_mask(batch.model_mask, k), num_logits=k + 1,
            )  # [active, k + 1, vocab]
            assert block_logits.shape[-1] == vocab_size, (block_logits.shape, vocab_size)
            row_ids, lengths = batch.row_view(draft_ids[:, :0])
            block_scores = batch.to_active(process_block(
                logits_processor, row_ids, batch.to_batch(draft_ids, pad_token_id), batch.to_batch(block_logits),
                lengths,
            ))  # [active, k + 1, vocab]
            is_target_invalid = _has_invalid_values(block_logits) | _has_invalid_values(block_scores)

            # 3. Accept a prefix of each row's draft, then one recovered or bonus token.
            if do_sample:
                output_ids, num_accepted = accept_draft_tokens(
                    draft_ids, draft_probs, block_scores.softmax(dim=-1), generator
                )
            else:
                output_ids, num_accepted = accept_greedy(draft_ids, block_scores)
            # Host synchronization 1 of 2 per round: accepted counts with the numerical checks (2: stopping answers).
            *num_accepted, draft_bad, target_bad = torch.cat(
                [num_accepted, is_draft_invalid.view(1), is_target_invalid.view(1)]
            ).tolist()
            _raise_if_invalid(draft_bad, target_bad)

            # 4. Stop each row exactly where target-only decoding would: after its first token meeting a criterion.
            num_kept, is_done = batch.count_until_stop(stopping_criteria, output_ids, [n + 1 for n in num_accepted])
            if streamer is not None:
                streamer.put(output_ids[:, : num_kept[0]].cpu())
            for a, row in enumerate(batch.active_rows.tolist()):
                row_scores[row] += list(block_scores[a, : num_kept[a]]) if keep_scores else []
                row_logits[row] += list(block_logits[a, : num_kept[a]]) if keep_logits else []
            stats.record_round(k, num_accepted, num_kept, batch.active_rows.tolist(), input_ids.shape[0])

            # 5. Commit, and roll back: both caches keep the model view's columns but its last; finished rows leave.
            staying, num_cached = batch.commit(output_ids, num_accepted, num_kept, is_done)
            _roll_back(target_cache, draft_cache, num_cached, staying)
            stats.draft_seconds += drafted - started
            stats.verify_seconds += time.perf_counter() - drafted
    finally:
        # An exception mid-round (or a stop) must never leave a cache holding tokens that were not committed.
        _roll_back(target_cache, draft_cache, batch.model_ids.shape[1] - 1, None)

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


def _draft_block(
    draft: PreTrainedModel,
    draft_cache,
    batch: RaggedBatch,
    logits_processor: LogitsProcessorList,
    k: int,
    *,
    vocab_size: int,
    do_sample: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Draft ``k`` tokens for every active row of ``batch``.

    Returns:
        draft_ids: ``[active, k]``.
        draft_probs: ``[active, k, vocab]`` the laws the tokens were sampled from (``None`` when greedy).
        is_invalid: 0-dim bool tensor, true if any draft logits were NaN or infinite.
    """
    model_ids = batch.model_ids
    # Ids past the draft's embedding rows (padding rows of a larger target) are only conditioning for the draft:
    # clamping them changes q, which stays the exact law the draft samples from.
    max_draft_id = draft.get_input_embeddings().num_embeddings - 1
    needs_clamp = max_draft_id < vocab_size - 1
    draft_ids = model_ids.new_empty((batch.num_active, 0))
    probs = []
    is_invalid = torch.zeros((), dtype=torch.bool, device=model_ids.device)
    for i in range(k):
        prefix_ids = torch.cat([model_ids, draft_ids], dim=1)  # [active, columns + i]
        logits = _forward_missing(
            draft, draft_cache, prefix_ids.clamp(max=max_draft_id) if needs_clamp else prefix_ids,
            _extend_mask(batch.model_mask, i), num_logits=1,
        )
        logits = align_vocab(logits[:, 0], vocab_size)  # [active, vocab]
        row_ids, lengths = batch.row_view(draft_ids)
        step_scores = batch.to_active(
            process_step(logits_processor, row_ids, batch.to_batch(logits), lengths)
        )  # [active, vocab]
        is_invalid |= _has_invalid_values(logits) | _has_invalid_values(step_scores)
        if do_sample:
            probs.append(step_scores.softmax(dim=-1))
            next_ids = sample_from_weights(probs[-1], generator)  # [active]
        else:
            next_ids = step_scores.argmax(dim=-1)  # [active]
        draft_ids = torch.cat([draft_ids, next_ids.unsqueeze(1)], dim=1)
    if not do_sample:
        return draft_ids, None, is_invalid
    if not probs:
        return draft_ids, torch.empty((batch.num_active, 0, vocab_size), device=draft_ids.device), is_invalid
    draft_probs = torch.stack(probs, dim=1)  # [active, k, vocab]
    return draft_ids, draft_probs, is_invalid


def _forward_missing(
    model: PreTrainedModel,
    cache,
    sequence_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    num_logits: int,
) -> torch.Tensor:
    """Feed ``model`` the tokens of ``sequence_ids`` its cache lacks; return the last ``num_logits`` logits.

    Args:
        sequence_ids: ``[batch, length]`` the whole sequence; the cache holds a prefix of it.
        attention_mask: ``[batch, length]`` or ``None`` (no padding).

    Returns:
        ``[batch, num_logits, vocab]`` float32 logits (a new tensor).
    """
    num_cached = cache_length(cache)
    assert num_cached + num_logits <= sequence_ids.shape[1], (num_cached, num_logits, sequence_ids.shape)
    if attention_mask is None:
        position_ids = torch.arange(num_cached, sequence_ids.shape[1], device=sequence_ids.device).unsqueeze(0)
    else:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min_(0)[:, num_cached:]
    inputs = {"input_ids": sequence_ids[:, num_cached:], "position_ids": position_ids, "cache": cache}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    if _supports_logits_to_keep(type(model)):
        inputs["logits_to_keep"] = num_logits
    logits = model(**inputs, use_cache=True).logits[:, -num_logits:]
    return logits.to(dtype=torch.float32, copy=True)


@functools.cache
def _supports_logits_to_keep(model_class: type) -> bool:
    """Whether ``forward`` takes ``logits_to_keep`` (transformers inspects the signature on every call)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Make draft logits ``[..., draft_vocab]`` as wide as the target's ``vocab_size``.

    Extra draft rows are dropped (the target cannot emit those ids, so proposing them only wastes a round); missing
    rows get ``-inf``, probability 0. Same tokenizer, different embedding-row counts (e.g. padded to a multiple of 64).
    """
    if logits.shape[-1] == vocab_size:
        return logits
    if logits.shape[-1] > vocab_size:
        return logits[..., :vocab_size]
    return F.pad(logits, (0, vocab_size - logits.shape[-1]), value=float("-inf"))


def _has_invalid_values(scores: torch.Tensor) -> torch.Tensor:
    """0-dim bool: any NaN or +inf, or a row with every value -inf (nothing left to sample)."""
    return (
        torch.isnan(scores).any()
        | torch.isposinf(scores).any()
        | torch.isneginf(scores).all(dim=-1).any()
    )


def _raise_if_invalid(is_draft_invalid: int, is_target_invalid: int) -> None:
    for is_invalid, name in ((is_draft_invalid, "assistant_model (draft)"), (is_target_invalid, "target model")):
        if is_invalid:
            raise ValueError(
                f"The {name} produced NaN or infinite logits, or logits that the processor chain masked entirely; "
                "no token can be sampled from them. Check the model weights and dtype (fp16 overflow is common) "
                "and the logits processors."
            )


def _extend_mask(attention_mask: torch.Tensor | None, num_new: int) -> torch.Tensor | None:
    """``[batch, length + num_new]``: the mask with ``num_new`` real (1) positions appended."""
    if attention_mask is None or num_new == 0:
        return attention_mask
    return F.pad(attention_mask, (0, num_new), value=1)


def _roll_back(target_cache, draft_cache, num_cached: int, staying_rows: torch.Tensor | None) -> None:
    """Restore the cache invariant: at most ``num_cached`` positions (the model view but its last column), and only
    ``staying_rows`` (indices into the rows the caches held) when given."""
    for cache in (target_cache, draft_cache):
        if staying_rows is not None:
            select_rows(cache, staying_rows)
        crop_to(cache, num_cached)
