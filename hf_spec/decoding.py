"""The speculative decoding loop: draft, verify, accept, roll back.

What it does: for a decoder-only target and a draft that share a tokenizer, each round drafts ``k`` tokens from the
draft's processed law q, runs the target once over the block to get p at ``k + 1`` positions, keeps the accepted
prefix plus one recovered or bonus token (`hf_spec.rejection`), stops exactly where target-only decoding would,
and rolls both caches back (`hf_spec.caches`). The output law equals target-only sampling (or greedy decoding).

What it does not do: beam search, several return sequences, encoder-decoder models, caches other than
``DynamicCache``; these are refused before the loop starts (`hf_spec.validation`). Batches of several rows
are refused too, until per-row rollback lands.
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

from hf_spec.caches import cache_length, crop_to, new_cache
from hf_spec.rejection import accept_draft_tokens, accept_greedy, sample_from_weights
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
    generator: torch.Generator | None = None,
    streamer: BaseStreamer | None = None,
) -> DecodeResult:
    """Generate with the target, speculating ``num_draft_tokens`` draft tokens per round.

    Args:
        target, draft: decoder-only models on the same device, same tokenizer.
        input_ids: ``[batch, prompt]`` the prompt (batch 1).
        attention_mask: ``[batch, prompt]`` or ``None`` when there is no padding.
        target_cache: the target's croppable cache, holding a prefix of ``input_ids`` shorter than all of it.
        num_draft_tokens: k, tokens drafted per round (fewer near ``max_length``).
        logits_processor: the chain applied, identically and per position, to draft and target logits.
        stopping_criteria: checked after every emitted token.
        generation_config: read for ``do_sample``, ``max_length``, ``output_scores``, ``output_logits``.
        generator: randomness for drafting and acceptance; ``None`` uses torch's default generator.
        streamer: receives every emitted token once, in order.
    """
    do_sample = generation_config.do_sample
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    raw_logits: tuple[torch.Tensor, ...] | None = () if keep_logits else None
    stats = SpeculativeStats()
    vocab_size = target.config.get_text_config().vocab_size
    draft_cache = new_cache(draft)
    sequence_ids = input_ids  # [batch, length], the committed tokens

    try:
        is_done = False
        while not is_done:
            length = sequence_ids.shape[1]
            k = max(0, min(num_draft_tokens, generation_config.max_length - length - 1))

            # 1. Draft k tokens, each from the draft's processed law with its own prefix.
            started = time.perf_counter()
            draft_ids, draft_probs, is_draft_invalid = _draft_block(
                draft, draft_cache, sequence_ids, attention_mask, logits_processor, k,
                vocab_size=vocab_size, do_sample=do_sample, generator=generator,
            )  # [batch, k], [batch, k, vocab] or None
            drafted = time.perf_counter()

            # 2. Verify: one target pass over the block gives k + 1 raw logits, processed position by position.
            block_logits = _forward_missing(
                target, target_cache, torch.cat([sequence_ids, draft_ids], dim=1),
                _extend_mask(attention_mask, k), num_logits=k + 1,
            )  # [batch, k + 1, vocab]
            assert block_logits.shape[-1] == vocab_size, (block_logits.shape, vocab_size)
            is_target_invalid = _has_invalid_values(block_logits)
            block_scores = process_block(logits_processor, sequence_ids, draft_ids, block_logits)
            is_target_invalid |= _has_invalid_values(block_scores)

            # 3. Accept a prefix of the draft, then one recovered or bonus token.
            if do_sample:
                output_ids, num_accepted = accept_draft_tokens(
                    draft_ids, draft_probs, block_scores.softmax(dim=-1), generator
                )
            else:
                output_ids, num_accepted = accept_greedy(draft_ids, block_scores)
            # Host synchronization 1 of 2 per round: accepted counts with the numerical checks (2: stopping answers).
            num_accepted_row, draft_bad, target_bad = torch.cat(
                [num_accepted, is_draft_invalid.view(1), is_target_invalid.view(1)]
            ).tolist()
            _raise_if_invalid(draft_bad, target_bad)

            # 4. Stop exactly where target-only decoding would: after the first token that meets a criterion.
            new_ids = output_ids[:, : num_accepted_row + 1]  # [batch, accepted + 1]
            new_scores = block_scores[:, : num_accepted_row + 1]
            num_kept, is_done = _count_until_stop(stopping_criteria, sequence_ids, new_ids, scores, new_scores)
            new_ids = new_ids[:, :num_kept]
            sequence_ids = torch.cat([sequence_ids, new_ids], dim=1)
            attention_mask = _extend_mask(attention_mask, num_kept)
            if streamer is not None:
                streamer.put(new_ids.cpu())
            if keep_scores:
                scores += tuple(new_scores[:, i] for i in range(num_kept))
            if keep_logits:
                raw_logits += tuple(block_logits[:, i] for i in range(num_kept))

            # 5. Roll back: both caches keep at most the committed sequence minus its last token.
            _roll_back(target_cache, draft_cache, sequence_ids.shape[1])
            stats.record_round(k, num_accepted_row, num_kept)
            stats.draft_seconds += drafted - started
            stats.verify_seconds += time.perf_counter() - drafted
    finally:
        # An exception mid-round (or a stop) must never leave a cache holding tokens that were not committed.
        _roll_back(target_cache, draft_cache, sequence_ids.shape[1])

    if streamer is not None:
        streamer.end()
    return DecodeResult(sequences=sequence_ids, scores=scores, logits=raw_logits, stats=stats)


def _draft_block(
    draft: PreTrainedModel,
    draft_cache,
    sequence_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_processor: LogitsProcessorList,
    k: int,
    *,
    vocab_size: int,
    do_sample: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Draft ``k`` tokens after ``sequence_ids`` ``[batch, length]``.

    Returns:
        draft_ids: ``[batch, k]``.
        draft_probs: ``[batch, k, vocab]`` the laws the tokens were sampled from (``None`` when greedy).
        is_invalid: 0-dim bool tensor, true if any draft logits were NaN or infinite.
    """
    batch_size = sequence_ids.shape[0]
    # Ids past the draft's embedding rows (padding rows of a larger target) are only conditioning for the draft:
    # clamping them changes q, which stays the exact law the draft samples from.
    max_draft_id = draft.get_input_embeddings().num_embeddings - 1
    needs_clamp = max_draft_id < vocab_size - 1
    draft_ids = sequence_ids.new_empty((batch_size, 0))
    probs = []
    is_invalid = torch.zeros((), dtype=torch.bool, device=sequence_ids.device)
    for i in range(k):
        prefix_ids = torch.cat([sequence_ids, draft_ids], dim=1)  # [batch, length + i]
        logits = _forward_missing(
            draft, draft_cache, prefix_ids.clamp(max=max_draft_id) if needs_clamp else prefix_ids,
            _extend_mask(attention_mask, i), num_logits=1,
        )
        logits = align_vocab(logits[:, 0], vocab_size)  # [batch, vocab]
        step_scores = process_step(logits_processor, prefix_ids, logits)
        is_invalid |= _has_invalid_values(logits) | _has_invalid_values(step_scores)
        if do_sample:
            probs.append(step_scores.softmax(dim=-1))
            next_ids = sample_from_weights(probs[-1], generator)  # [batch]
        else:
            next_ids = step_scores.argmax(dim=-1)  # [batch]
        draft_ids = torch.cat([draft_ids, next_ids.unsqueeze(1)], dim=1)
    if not do_sample:
        return draft_ids, None, is_invalid
    if not probs:
        return draft_ids, torch.empty((batch_size, 0, vocab_size), device=draft_ids.device), is_invalid
    draft_probs = torch.stack(probs, dim=1)  # [batch, k, vocab]
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


def _count_until_stop(
    stopping_criteria: StoppingCriteriaList,
    sequence_ids: torch.Tensor,
    new_ids: torch.Tensor,
    scores: tuple[torch.Tensor, ...] | None,
    new_scores: torch.Tensor,
) -> tuple[int, bool]:
    """How many of ``new_ids`` ``[batch, m]`` to keep, and whether generation is done.

    The criteria are asked after each new token in turn, with the sequence as target-only decoding would have it, so
    an EOS, stop string, length limit or custom criterion met inside a block cuts the block right there. All ``m``
    answers are gathered before one host synchronization.
    """
    num_new = new_ids.shape[1]
    candidate_ids = torch.cat([sequence_ids, new_ids], dim=1)  # [batch, length + m]
    length = sequence_ids.shape[1]
    is_done = torch.stack(
        [
            stopping_criteria(
                candidate_ids[:, : length + j],
                None if scores is None else scores + tuple(new_scores[:, i] for i in range(j)),
            ).all()
            for j in range(1, num_new + 1)
        ]
    ).tolist()  # [m]: done after new token j
    return (is_done.index(True) + 1, True) if True in is_done else (num_new, False)


def _roll_back(target_cache, draft_cache, length: int) -> None:
    """Restore the cache invariant for a committed sequence of ``length`` tokens."""
    crop_to(target_cache, length - 1)
    crop_to(draft_cache, length - 1)
