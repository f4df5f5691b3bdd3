"""Every transformers generation setting, and what speculative ``generate()`` does with it: one table, `SETTINGS`.

Each entry says whether the setting is honoured (with its exact meaning under speculation), refused (an error naming
it, before any forward pass), warned about (once, saying what runs instead), or handled by transformers before
hf_spec's loop runs. `check_settings` applies the table to a call; ``docs/generation.md`` prints it, and
``tests/test_settings.py`` walks every field of ``GenerationConfig`` through it, so no setting is ever dropped
silently.

The assisted-generation settings (``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
``assistant_confidence_threshold``, the lookbehinds) are read where the user set them (`hf_spec.plan.user_settings`:
the call, the ``generation_config`` passed, the target's, the draft's), never from transformers' global defaults
(which would turn a confidence threshold of 0.4 on for everyone).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from transformers import GenerationConfig

logger = logging.getLogger(__name__)

HONOURED, REFUSED, WARNED, TRANSFORMERS, METADATA = "honoured", "refused", "warned", "transformers", "metadata"


@dataclasses.dataclass(frozen=True)
class Treatment:
    """What hf_spec does with one setting; ``problem`` says, for a value it does not honour, why (``None``: fine)."""

    kind: str
    note: str
    problem: Callable[[Any, GenerationConfig], str | None] | None = None


def _not(default: Any, why: str) -> Callable[[Any, GenerationConfig], str | None]:
    """A setting honoured only at ``default`` (or unset)."""
    return lambda value, config: None if value in (None, default) else why


_CHAIN = "applied by the one processor chain, identically to draft and target at every position"
_BEAMS = "selects beam search or another decoding mode, which speculation does not run"

SETTINGS: dict[str, Treatment] = {
    # what is generated, and when it stops
    **{name: Treatment(HONOURED, "stops each row exactly where target-only decoding would, even inside a block")
       for name in ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "max_time", "stop_strings",
                    "eos_token_id")},
    "do_sample": Treatment(HONOURED, "greedy or sampling; sampling at temperature 0 is greedy decoding"),
    # the processor chain
    **{name: Treatment(HONOURED, _CHAIN) for name in (
        "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
        "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
        "bad_words_ids", "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
        "forced_eos_token_id", "exponential_decay_length_penalty", "renormalize_logits", "remove_invalid_values")},
    "watermarking_config": Treatment(HONOURED, "the green-red watermark (a pure function of the prefix) is part of "
                                     "the chain; SynthID keeps state between calls and is refused by name"),
    "guidance_scale": Treatment(REFUSED, "classifier-free guidance keeps a cache of the unguided model",
                                _not(1.0, "`guidance_scale` is not supported with speculative decoding: its "
                                     "processor keeps a cache of the unguided model, which drafts would corrupt.")),
    "token_healing": Treatment(HONOURED, "transformers heals the prompt before the loop starts"),
    # other decoding modes
    **{name: Treatment(REFUSED, _BEAMS, _not(default, f"`{name}` {_BEAMS}."))
       for name, default in (("num_beams", 1), ("num_beam_groups", 1), ("diversity_penalty", 0.0),
                             ("penalty_alpha", None), ("dola_layers", None), ("constraints", None),
                             ("force_words_ids", None))},
    **{name: Treatment(TRANSFORMERS, "used by beam search only; transformers warns when it is set without beams")
       for name in ("length_penalty", "early_stopping", "low_memory")},
    # outputs
    "num_return_sequences": Treatment(REFUSED, "repeat the prompt in the batch instead", _not(
        1, "`num_return_sequences` must be 1 with `assistant_model`; repeat the prompt in the batch instead.")),
    **{name: Treatment(REFUSED, "hf_spec returns scores and logits, not attentions or hidden states", _not(
        False, f"`{name}=True` is not supported with `assistant_model` (hf_spec returns scores and logits)."))
       for name in ("output_attentions", "output_hidden_states")},
    **{name: Treatment(HONOURED, "transformers' fields and shapes, plus `speculative_stats`")
       for name in ("output_scores", "output_logits", "return_dict_in_generate")},
    # special tokens
    **{name: Treatment(HONOURED, "as in target-only decoding") for name in ("pad_token_id", "bos_token_id")},
    "decoder_start_token_id": Treatment(METADATA, "starts an encoder-decoder's decoder, as in target-only decoding"),
    # caches and compilation
    "use_cache": Treatment(REFUSED, "speculation needs KV caches", _not(
        True, "`use_cache=False` cannot be combined with `assistant_model`: speculation needs KV caches.")),
    "cache_implementation": Treatment(
        HONOURED, "'dynamic' (the default) and 'static' (preallocated, rolled back by moving its write position; a "
        "draft model gets one of its own, a draft head keeps a small dynamic one); the other caches cannot be "
        "cropped back exactly and are refused",
        lambda value, config: None if value in (None, "dynamic", "static") else (
            f"`cache_implementation={value!r}` cannot be rolled back exactly by speculative decoding; use the "
            "default dynamic cache or 'static'.")),
    "cache_config": Treatment(TRANSFORMERS, "passed to the cache transformers builds"),
    "max_cache_len": Treatment(HONOURED, "sizes a static cache (of the target and of a draft model); it must hold "
                               "`max_length` positions, or the call is refused before any pass; one too small for "
                               "the drafts and a batch's holes is enlarged to what the call needs",
                               lambda value, config: None if value is None or (
                                   isinstance(value, int) and not isinstance(value, bool) and value > 0) else
                               "`max_cache_len` must be a positive integer."),
    "prefill_chunk_size": Treatment(WARNED, "hf_spec's first round feeds the whole prompt in one pass", _not(
        None, "`prefill_chunk_size` is not used by speculative decoding: its first round feeds the whole prompt "
        "in one target pass.")),
    "compile_config": Treatment(
        HONOURED, "with a static cache, the target's verify passes and a draft model's steps run compiled "
        "(`torch.compile` with its mode, backend and fullgraph; widths padded to a few sizes, `hf_spec.compiled`); "
        "without one (`cache_implementation='static'`, or a static cache passed as `cache=`) it is refused before any "
        "pass (`hf_spec.validation.check_cache`)"),
    "disable_compile": Treatment(HONOURED, "no pass is compiled, whatever `compile_config` says"),
    "continuous_batching_config": Treatment(TRANSFORMERS, "`cache_implementation='paged'` switches to transformers' "
                                            "continuous batching, which refuses an assistant model"),
    # assisted generation
    "num_assistant_tokens": Treatment(HONOURED, "k, the chain's length (or a tree's depth); an integer, 'auto' or "
                                      "an AutoDraftLength"),
    "num_assistant_tokens_schedule": Treatment(
        HONOURED, "'constant': k every round; 'heuristic' and 'heuristic_transient': k + 2 after a round whose draft "
        "was accepted in full, k - 1 (at least 1) otherwise, from k; the schedule starts again at every call"),
    "assistant_confidence_threshold": Treatment(
        HONOURED, "a chain stops drafting once the draft's probability of the token it drew falls below it (every "
        "row of a batch); exact, because the decision depends on the draft's own tokens only"),
    "assistant_ensemble_weight": Treatment(REFUSED, "mixes the draft's law into the output: not lossless", _not(
        None, "`assistant_ensemble_weight` mixes the draft's law into the output, which is not exact; hf_spec's "
        "speculative decoding is lossless. Leave it unset.")),
    **{name: Treatment(WARNED, "transformers' window for re-tokenizing between tokenizers; hf_spec's draft of "
                       "another tokenizer re-reads each row's whole committed text", _not(
        None, f"`{name}` is not used: a draft with another tokenizer re-tokenizes each row's whole committed text "
        "every round (hf_spec.drafting.cross_tokenizer)."))
       for name in ("assistant_lookbehind", "target_lookbehind")},
    "prompt_lookup_num_tokens": Treatment(HONOURED, "exact prompt lookup, greedy and sampled, in batches"),
    "max_matching_ngram_size": Treatment(HONOURED, "the longest n-gram prompt lookup matches (default 2)"),
    "assistant_early_exit": Treatment(TRANSFORMERS, "early-exit self-speculation runs transformers' own loop; with "
                                      "`assistant_model` as well, refused (both name the draft)"),
    "use_mtp": Treatment(TRANSFORMERS, "multi-token-prediction drafting runs transformers' own loop"),
    "speculation_type": Treatment(TRANSFORMERS, "'dflash' runs transformers' own generator"),
    "is_assistant": Treatment(METADATA, "transformers' internal flag on an assistant's config"),
    # bookkeeping
    "transformers_version": Treatment(METADATA, "bookkeeping"),
    "_from_model_config": Treatment(METADATA, "bookkeeping"),
}

_WHISPER = "Whisper's generate() sets up its calls before the loop runs"
#: The arguments of Whisper's own ``generate()`` (``WhisperGenerationMixin.generate``) beyond transformers' generic
#: ones: Whisper runs one inner ``generate()`` per 30-second window and per fallback temperature, each through the
#: loop. ``tests/test_settings.py`` walks its signature through this table and compares the honoured ones with
#: target-only decoding.
WHISPER_SETTINGS: dict[str, Treatment] = {
    "return_timestamps": Treatment(HONOURED, "the timestamp processor is part of the chain, applied to draft and "
                                   "target at every position"),
    **{name: Treatment(HONOURED, f"the decoder prompt's task and language tokens; {_WHISPER}")
       for name in ("task", "language", "is_multilingual")},
    **{name: Treatment(HONOURED, f"a text prompt before the decoder prompt; {_WHISPER}")
       for name in ("prompt_ids", "prompt_condition_type", "condition_on_prev_tokens")},
    "temperature": Treatment(HONOURED, "a sequence of temperatures falls back through them, one inner call each: the "
                             "greedy try's tokens and scores, and so the fallback decisions, are target-only's"),
    **{name: Treatment(HONOURED, "decides a fallback from the inner call's tokens and scores, which are "
                       "target-only's (the no-speech detector reads the target's law at the first position)")
       for name in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold")},
    **{name: Treatment(HONOURED, f"long-form audio's windows and the timestamps' units; {_WHISPER}")
       for name in ("num_segment_frames", "time_precision", "time_precision_features", "return_segments",
                    "force_unique_generate_call", "monitor_progress")},
    "return_token_timestamps": Treatment(REFUSED, "needs the cross-attention weights of every token, which "
                                         "hf_spec's loop does not return", _not(
        False, "`return_token_timestamps=True` is not supported with `assistant_model`: token timestamps come from "
        "the cross-attention weights of every generated token, which hf_spec's loop does not return.")),
}
#: Tables of a model's own ``generate()`` arguments, by the class that defines that ``generate()``.
MODEL_SETTINGS: dict[str, dict[str, Treatment]] = {"WhisperGenerationMixin": WHISPER_SETTINGS}

#: Settings whose user value comes from `hf_spec.plan.user_settings` (the merged config holds transformers' defaults).
ASSISTANT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                      "assistant_lookbehind", "target_lookbehind")


def check_settings(generation_config: GenerationConfig, user: dict[str, Any]) -> None:
    """Raise for a refused setting, warn once for a warned one (the merged ``generation_config``; ``user``: the
    assisted-generation settings as the user set them)."""
    for name, treatment in SETTINGS.items():
        if treatment.problem is None:
            continue
        value = user.get(name) if name in ASSISTANT_SETTINGS else getattr(generation_config, name, None)
        problem = treatment.problem(value, generation_config)
        if problem is None:
            continue
        problem = f"{problem} (It is {value!r}.)"
        if treatment.kind in (REFUSED, HONOURED):  # an honoured setting at a value it cannot honour: refused
            raise ValueError(problem)
        warn_once(problem)


def own_settings_table(model_class: type) -> dict[str, Treatment]:
    """`MODEL_SETTINGS` of the class whose own ``generate()`` ``model_class`` runs (empty for transformers' generic
    one)."""
    for klass in model_class.__mro__:
        if klass.__name__ in MODEL_SETTINGS and "generate" in klass.__dict__:
            return MODEL_SETTINGS[klass.__name__]
    return {}


def check_own_settings(model_class: type, arguments: dict[str, Any]) -> None:
    """Raise for a refused argument of the model's own ``generate()`` (`MODEL_SETTINGS`)."""
    for name, treatment in own_settings_table(model_class).items():
        if treatment.problem is not None and name in arguments:
            problem = treatment.problem(arguments[name], None)
            if problem is not None:
                raise ValueError(f"{problem} (It is {arguments[name]!r}.)")


@functools.cache
def warn_once(message: str) -> None:
    """Log ``message`` as a warning, once per process."""
    logger.warning(message)


def settings_table() -> str:
    """`SETTINGS` as a Markdown table (the one in ``docs/generation.md``)."""
    rows = ["| setting | hf_spec | what it means here |", "|---|---|---|"]
    rows += [f"| `{name}` | {treatment.kind} | {treatment.note} |" for name, treatment in SETTINGS.items()
             if treatment.kind != METADATA or not name.startswith("_")]
    return "\n".join(rows)


def whisper_settings_table() -> str:
    """`WHISPER_SETTINGS` as a Markdown table (the one in ``docs/conditioned.md``)."""
    rows = ["| Whisper's `generate()` argument | hf_spec | what it means here |", "|---|---|---|"]
    rows += [f"| `{name}` | {treatment.kind} | {treatment.note} |" for name, treatment in WHISPER_SETTINGS.items()]
    return "\n".join(rows)
