"""The speculative decoding loop: draft, verify, accept, stop, commit and roll back. One loop for chains and trees.

What it does: for a target and a drafter that shares its tokenizer, each round drafts tokens from the
drafter's law q (a chain of k per row, or a tree), runs the target once over them to get p after every drafted token,
keeps an accepted prefix (or path) plus one recovered or bonus token (`hf_spec.rejection`), stops exactly where
target-only decoding would, and rolls both caches back (`hf_spec.caches`). The output law equals target-only sampling
(or greedy decoding). The round's shape, chain or tree, is a strategy object (`hf_spec.rounds`) chosen once per call.

Encoder-decoder targets (T5, BART, Whisper) run their encoder once per call, before this loop; the loop speculates
their decoder (`hf_spec.conditioning`). What it does not do: beam search, several return sequences, caches that
cannot be rolled back exactly; these are refused before the loop starts (`hf_spec.validation`, `hf_spec.caches`).
Rows of a batch advance by different amounts: `hf_spec.rows` keeps their bookkeeping (and what sliding windows and
recurrent states ask of it) out of this loop, `hf_spec.recording` keeps scores, logits, the streamer and timings, and
the sizers in `hf_spec.drafting` choose each round's size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_spec.caches import crop_to, move_columns, select_rows
from hf_spec.conditioning import Conditioning
from hf_spec.drafting.base import DraftContext, Drafter
from hf_spec.forward import has_invalid_values, model_column_rules
from hf_spec.profiling import RoundClock, profiled_call
from hf_spec.recording import OutputRecorder, RoundTimer
from hf_spec.rounds import Rounds
from hf_spec.rows import RaggedBatch, Rollback
from hf_spec.stats import SpeculativeStats


@dataclasses.dataclass
class DecodeResult:
    """The loop's output: sequences and, when asked for, per-token scores and raw logits (transformers' shapes)."""

    sequences: torch.Tensor  # [batch, prompt + new]
    scores: tuple[torch.Tensor, ...] | None  # one [batch, vocab] per new token, after the processor chain
    logits: tuple[torch.Tensor, ...] | None  # one [batch, vocab] per new token, raw target logits
    stats: SpeculativeStats


def speculative_decode(
    target: PreTrainedModel,
    rounds: Rounds,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_cache,
    *,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    streamer: BaseStreamer | None = None,
    conditioning: Conditioning | None = None,
) -> DecodeResult:
    """Generate with the target, speculating a chain or a tree of draft tokens per round.

    Args:
        target: a decoder-only model.
        rounds: the round's shape (`hf_spec.rounds.ChainRounds` or `TreeRounds`), holding the drafter (on the
            target's device and tokenizer) and the sizer that chooses each round's size and learns from it.
        input_ids: ``[batch, prompt]`` the prompts, left-padded.
        attention_mask: ``[batch, prompt]`` or ``None`` when there is no padding.
        target_cache: the target's croppable cache, holding a prefix of ``input_ids`` shorter than all of it.
        logits_processor: the chain applied, identically and per position, to draft and target logits.
        stopping_criteria: checked after every emitted token of every row.
        generation_config: read for ``do_sample``, ``max_length``, ``output_scores``, ``output_logits``.
        pad_token_id: fills finished rows and holes.
        generator: randomness for drafting and acceptance; ``None`` uses torch's default generator.
        streamer: receives every emitted token once, in order (batch of one).
        conditioning: what the models read beside the tokens (`hf_spec.conditioning`): an encoder's outputs (attached
            to ``target_cache`` already), the prompt's images (in ``target_cache`` already); the drafter gets it too.
    """
    stats = SpeculativeStats(verification=rounds.rule(generation_config.do_sample))
    recorder = OutputRecorder(generation_config, input_ids.shape[0], streamer)
    context = DraftContext(logits_processor, target.config.get_text_config().vocab_size,
                           generation_config.do_sample, generator, rounds.stop_below)
    rules = model_column_rules(target, target_cache) | rounds.drafter.column_rules()  # windows, recurrent states
    batch = RaggedBatch.start(input_ids, attention_mask, pad_token_id, rules)
    with _exclusive(rounds.drafter), profiled_call(target, input_ids.device) as profile:  # one call per drafter
        rounds.start(batch, target_cache, conditioning or Conditioning())
        try:
            while batch.num_active > 0:
                timer, clock = RoundTimer(synchronize=rounds.is_timed), RoundClock(profile)  # clock: when profiled
                # Drafting past a row's budget is cut by the stopping criteria; the row furthest from it sets the limit.
                tokens_left = max(0, generation_config.max_length - min(batch.active_lengths()) - 1)

                # 1. Draft: a chain or a tree, each token drawn from the drafter's law q given its own prefix.
                draft = rounds.draft(batch, tokens_left, context)
                timer.mark_drafted(batch.model_ids.device)
                clock.mark("drafting, other")

                # 2. Verify: one target pass gives p after every drafted token, each processed with its own prefix (and
                #    the hidden states a draft head reads).
                verified = rounds.verify(target, target_cache, batch, draft, logits_processor)

                # 3. Accept a prefix (a path) of each row's draft, then one recovered or bonus token (with recurrent
                #    states, every row keeps as many drafts as the row that accepted fewest: `hf_spec.rows`).
                accepted = rounds.accept(draft, verified, context)
                clock.mark("processors and acceptance")
                num_accepted = batch.usable_counts(
                    read_accepted(accepted.num_accepted, draft.is_invalid, accepted.logits, accepted.scores))
                timer.mark_verified()
                clock.mark("host sync")

                # 4. Stop each row exactly where target-only decoding would: after its first token meeting a criterion.
                num_kept, is_done = batch.count_until_stop(stopping_criteria, accepted.output_ids,
                                                           [n + 1 for n in num_accepted])
                clock.mark("stopping")
                recorder.record(batch.active_list, accepted.output_ids, accepted.scores, accepted.logits, num_kept)
                num_drafted, depth = rounds.size(draft)
                stats.record_round(num_drafted, num_accepted, num_kept, batch.active_list, batch.batch_size, depth)
                rounds.learn(draft, accepted, num_accepted, timer.draft_seconds,
                             None if stats.num_rounds == 1 else timer.verify_seconds)  # round 1 holds the prefill

                # 5. Commit, and roll back: both caches keep what was accepted (a tree: its path, gathered), then the
                #    model view's columns but its last; finished rows leave.
                rounds.keep(target_cache, draft, verified, accepted)
                rollback = batch.commit(accepted.output_ids, num_accepted, num_kept, is_done)
                roll_back(target_cache, rounds.drafter, rollback)
                stats.record_seconds(timer.draft_seconds, timer.seconds_since_drafted())
                clock.mark("bookkeeping")
        finally:
            # An exception mid-round (or a stop) must never leave a cache holding tokens that were not committed (a
            # tree's nodes sit after the committed positions, so the crop drops them too).
            roll_back(target_cache, rounds.drafter, Rollback(batch.model_ids.shape[1] - 1, None))

    if profile is not None:
        stats.profile, stats.profile_passes = profile.seconds, profile.passes
    scores, logits = recorder.finish()
    return DecodeResult(sequences=batch.row_ids, scores=scores, logits=logits, stats=stats)


@contextlib.contextmanager
def _exclusive(drafter: Drafter) -> Iterator[None]:
    """One call at a time per drafter: a `Drafter` instance keeps per-call state (caches, features), so a second
    call using it before the first ends is refused by name (a draft model or head gets a fresh drafter per call)."""
    with _IN_USE_LOCK:
        if id(drafter) in _IN_USE:
            raise RuntimeError(f"This {type(drafter).__name__} is in use by another generate() call (another thread "
                               "or a nested call): a drafter keeps per-call state. Give each concurrent call its "
                               "own drafter instance.")
        _IN_USE.add(id(drafter))
    try:
        yield
    finally:
        with _IN_USE_LOCK:
            _IN_USE.discard(id(drafter))


_IN_USE: set[int] = set()
_IN_USE_LOCK = threading.Lock()


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


def roll_back(target_cache, drafter: Drafter, rollback: Rollback) -> None:
    """Restore the cache invariant: the rows' moved columns (`hf_spec.rows`), at most ``num_cached`` positions (the
    model view but its last column), then only ``staying_rows`` (indices into the rows the caches held) when given;
    the drafter follows. The crop comes before the rows leave: a recurrent layer's recorded states hold every row."""
    if rollback.moved is not None:
        move_columns(target_cache, *rollback.moved)
        drafter.move_columns(*rollback.moved)
    crop_to(target_cache, rollback.num_cached)
    if rollback.staying_rows is not None:
        select_rows(target_cache, rollback.staying_rows)
    drafter.roll_back(rollback.num_cached, rollback.staying_rows)
