"""The speculative decoding loop: draft, verify, accept, stop, commit and roll back. One loop for chains and trees.

What it does: for a target and a drafter that shares its tokenizer, each round drafts tokens from the
drafter's law q (a chain of k per row, or a tree), runs the target once over them to get p after every drafted token,
keeps an accepted prefix (or path) plus one recovered or bonus token (`hf_spec.rejection`), stops exactly where
target-only decoding would, and rolls both caches back (`hf_spec.caches`). The output law equals target-only sampling
(or greedy decoding). Each round is a `hf_spec.rounds.Round`, a chain or a tree, that carries its own verify, accept,
learn and keep steps; the call's `hf_spec.rounds.Rounds` drafts it.

Encoder-decoder targets (T5, BART, Whisper) run their encoder once per call, before this loop; the loop speculates
their decoder (`hf_spec.conditioning`). What it does not do: beam search, several return sequences, caches that
cannot be rolled back exactly; these are refused before the loop starts (`hf_spec.validation`, `hf_spec.caches`).
Rows of a batch advance by different amounts: `hf_spec.rows` keeps their bookkeeping (and what sliding windows and
recurrent states ask of it) out of this loop, `hf_spec.recording` keeps scores, logits, the streamer, the statistics
and each round's clock, and the sizers in `hf_spec.sizing` choose each round's size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_spec.conditioning import Conditioning
from hf_spec.forward import model_column_rules
from hf_spec.parallel import ranks_of
from hf_spec.recording import SpeculativeStats, recorded_call
from hf_spec.rounds import Rounds
from hf_spec.rows import RaggedBatch, Rollback


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
    ranks = ranks_of(target)  # a tensor-parallel target's ranks draw from one seed and check they agree
    context = rounds.context(logits_processor, target.config.get_text_config().vocab_size,
                             generation_config.do_sample, ranks.shared_generator(generator, input_ids.device))
    rules = model_column_rules(target, target_cache) | rounds.drafter.column_rules()  # windows, recurrent states
    batch = RaggedBatch.start(input_ids, attention_mask, pad_token_id, rules)
    with _exclusive(rounds.drafter), recorded_call(target, input_ids.device, generation_config, batch.batch_size,
                                                   streamer, rounds.rule(generation_config.do_sample),
                                                   rounds.is_timed) as record:  # one call per drafter
        rounds.start(batch, target_cache, conditioning)
        try:
            while batch.num_active > 0:
                log = record.start_round()  # the round's one record: its clock and its counts
                # Drafting past a row's budget is cut by the stopping criteria; the row furthest from it sets the limit.
                tokens_left = max(0, generation_config.max_length - min(batch.active_lengths()) - 1)

                # 1. Draft: a chain or a tree, each token drawn from the drafter's law q given its own prefix.
                round_ = rounds.draft(batch, tokens_left, context)
                ranks.agree("drafts", batch.row_ids, round_.drafted_ids)  # before the pass that would feed them
                log.mark("drafting, other")

                # 2. Verify: one target pass gives p after every drafted token, each processed with its own prefix (and
                #    the hidden states a draft head reads).
                verified = round_.verify(target, target_cache, batch, logits_processor)

                # 3. Accept a prefix (a path) of each row's draft, then one recovered or bonus token (with recurrent
                #    states, every row keeps as many drafts as the row that accepted fewest: `hf_spec.rows`).
                accepted = round_.accept(verified, context)
                log.mark("processors and acceptance")
                num_accepted = batch.usable_counts(round_.read_counts(accepted))
                log.mark("host sync")

                # 4. Stop each row exactly where target-only decoding would: after its first token meeting a criterion.
                num_kept, is_done = batch.count_until_stop(stopping_criteria, accepted.output_ids,
                                                           [n + 1 for n in num_accepted])
                log.mark("stopping")
                log.count(batch.active_list, round_.num_drafted, round_.depth, accepted.output_ids, accepted.scores,
                          accepted.logits, num_accepted, num_kept, accepted.reach)
                round_.learn(accepted, num_accepted, log.draft_seconds, log.verify_seconds)

                # 5. Commit, and roll back: both caches keep what was accepted (a tree: its path, gathered), then the
                #    model view's columns but its last; finished rows leave.
                round_.keep(target_cache, verified, accepted)
                rounds.roll_back(target_cache, batch.commit(accepted.output_ids, num_accepted, num_kept, is_done))
                log.mark("bookkeeping")
                record.close(log)
        finally:
            # An exception mid-round (or a stop) must never leave a cache holding tokens that were not committed (a
            # tree's nodes sit after the committed positions, so the crop drops them too).
            rounds.roll_back(target_cache, Rollback(batch.model_ids.shape[1] - 1, None))

    ranks.agree("outputs", batch.row_ids)
    scores, logits, stats = record.finish()
    return DecodeResult(sequences=batch.row_ids, scores=scores, logits=logits, stats=stats)


@contextlib.contextmanager
def _exclusive(drafter) -> Iterator[None]:
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
