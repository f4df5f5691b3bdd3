"""`SpeculativeGenerationMixin`: exact speculative decoding behind ``model.generate(assistant_model=...)``.

transformers routes ``generate(assistant_model=draft)`` and ``generate(prompt_lookup_num_tokens=n)`` to
``GenerationMixin._assisted_decoding``. This mixin replaces that one method with `hf_spec.decoding.speculative_decode`
and adds the checks it needs; every other generation mode (and early-exit or MTP assisted decoding) runs
transformers' own code unchanged. What a call asks for (the drafter: a draft model, a draft head, prompt lookup, a
`hf_spec.drafting.Drafter` of your own; chains or trees; fixed or automatic sizes) is resolved once by
`hf_spec.plan.plan_call`, before any forward pass.

Extra ``generate()`` arguments:

- ``generator``: a ``torch.Generator`` for drafting and acceptance (default: torch's global generator, so
  ``torch.manual_seed`` reproduces a run);
- ``num_assistant_tokens``: k, the draft block length, or ``"auto"`` (`hf_spec.AutoDraftLength`; pass an instance to
  keep what it learnt across calls);
- ``num_tree_nodes``: draft a tree of at most this many tokens per round instead of a chain, all verified in one
  target pass (a batch of one row); ``"auto"`` chooses the budget and branching every round (`hf_spec.AutoTreeSize`).

With ``return_dict_in_generate=True`` the output is a `SpeculativeDecoderOnlyOutput` (an encoder-decoder's:
`SpeculativeEncoderDecoderOutput`), carrying ``speculative_stats`` (`hf_spec.stats.SpeculativeStats`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedModel

from hf_spec.caches import (
    attach_inputs,
    fit_prompt,
    prepare_for_rollback,
    sized_static_cache,
    static_length,
)
from hf_spec.compat import (
    check_generation_hooks,
    forgetting_output_capture,
    merged_generation_config,
    pad_token_tensor,
    warn_if_untested,
)
from hf_spec.compiled import compiling
from hf_spec.conditioning import Conditioning, media_inputs, split_model_kwargs
from hf_spec.decoding import speculative_decode
from hf_spec.forward import prefill
from hf_spec.outputs import generate_output
from hf_spec.plan import CallOptions, greedy_at_zero_temperature, plan_call, user_settings
from hf_spec.rounds import Rounds
from hf_spec.timing.load import LoadMeter
from hf_spec.validation import Call, check_call

logger = logging.getLogger(__name__)

# The hooks this module overrides; fail at import rather than silently run transformers' non-exact loop. A transformers
# newer than the tested range gets one warning.
check_generation_hooks()
warn_if_untested()


@dataclasses.dataclass
class _Call:
    """The current ``generate()`` call's hf_spec options, what it was given (checked), and the plan resolved."""

    options: CallOptions
    rounds: Rounds | None = None
    facts: Call | None = None  # None where the argument rules did not run (a ``custom_generate`` recipe's own call)


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("hf_spec_call", default=None)
#: Models that run transformers' own assisted decoding in the current context (`without_speculation`), by id.
#: The draft a `generate_batch` call hands its `init_continuous_batching` (transformers passes no extra argument on).
_BATCHING_DRAFT: contextvars.ContextVar[tuple[Any, Any, Any]] = contextvars.ContextVar("hf_spec_batching",
                                                                                    default=(None, None, None))
_WITHOUT_SPECULATION: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("hf_spec_off",
                                                                                     default=frozenset())


def _current_call() -> _Call:
    return _CALL.get() or _Call(CallOptions())


class SpeculativeGenerationMixin(GenerationMixin):
    """A `GenerationMixin` whose assisted decoding is exact speculative decoding.

    Mix it in before the model class (see `speculative`), then call ``generate`` as usual::

        >>> model = speculative(AutoModelForCausalLM.from_pretrained(...))
        >>> out = model.generate(**inputs, assistant_model=draft, do_sample=True, temperature=0.7,
        ...                      num_assistant_tokens=5, return_dict_in_generate=True)
        >>> out.speculative_stats.acceptance_rate
    """

    def generate(self, inputs=None, generation_config=None, *args, generator: torch.Generator | None = None,
                 num_tree_nodes: Any = None, verification: Any = None, **kwargs):
        ours = {"generator": generator, "num_tree_nodes": num_tree_nodes, "verification": verification}
        if isinstance(kwargs.get("custom_generate"), str):  # transformers hands every argument to the recipe, which
            given = {**kwargs, **{name: value for name, value in ours.items() if value is not None}}  # calls this again
            positional, given = _forwarded(inputs, generation_config, args, given)
            return super().generate(*positional, **given)
        kwargs.update({name: value for name, value in ours.items() if name != "generator" and value is not None})
        settings = user_settings(kwargs, generation_config, self, kwargs.get("assistant_model"))
        kwargs.pop("num_tree_nodes", None), kwargs.pop("verification", None)  # transformers would keep them
        call = None
        if "custom_generate" not in kwargs and id(self) not in _WITHOUT_SPECULATION.get():
            merged = merged_generation_config(self, generation_config, kwargs)
            if kwargs.get("assistant_model") is not None or _is_our_prompt_lookup(merged):
                # every rule on the arguments, once, before transformers' own handling (which fails on some of them
                # without naming the argument)
                call = self._call_facts(inputs, merged, settings, generator, kwargs)
                check_call(call, "arguments")
        options = CallOptions(generator=generator, settings=settings, media=media_inputs(self, kwargs),
                              begin_suppress_tokens=None if call is None else merged.begin_suppress_tokens)
        token = _CALL.set(_Call(options, facts=call))
        try:
            positional, kwargs = _forwarded(inputs, generation_config, args, kwargs)
            with forgetting_output_capture(self), keeping_draft_config(kwargs.get("assistant_model")):
                return super().generate(*positional, **kwargs)
        finally:
            _CALL.reset(token)

    def _retrieve_logit_processors(self, generation_config, *args, **kwargs):
        """Whisper's processor chain (`hf_spec.compat.WHISPER_OVERRIDES`): its generate() sets
        ``begin_suppress_tokens`` to None whenever an assistant is in the call (transformers' assisted loop would
        otherwise keep the assistant from ending at the first position); hf_spec's loop applies the chain exactly, so
        the call's value is put back."""
        restored = _current_call().options.begin_suppress_tokens
        if restored is not None and generation_config.begin_suppress_tokens is None:
            generation_config.begin_suppress_tokens = restored
        return super()._retrieve_logit_processors(generation_config, *args, **kwargs)

    def _call_facts(self, inputs, merged, settings: dict, generator, kwargs: dict) -> Call:
        """What the call was given, for `hf_spec.validation.check_call`."""
        prefix = "decoder_" if self.config.is_encoder_decoder else ""  # the decoder's prompt; the encoder reads inputs
        input_ids = kwargs.get(f"{prefix}input_ids")
        if not prefix and inputs is not None:
            input_ids = inputs
        return Call(self, merged, settings, generator, kwargs.get("assistant_model"), kwargs.get("tokenizer"),
                    kwargs.get("assistant_tokenizer"), input_ids, kwargs.get(f"{prefix}attention_mask"), prefix,
                    own_arguments=kwargs)

    def _is_speculating(self, assistant_model, generation_config) -> bool:
        """Whether this call runs hf_spec's loop: a draft or our prompt lookup, and not `without_speculation`."""
        if id(self) in _WITHOUT_SPECULATION.get():
            return False
        return assistant_model is not None or _is_our_prompt_lookup(generation_config)

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        draft = generation_mode_kwargs.get("assistant_model")
        call = _current_call()
        if not self._is_speculating(draft, generation_config):
            if call.options.generator is not None or {"num_tree_nodes", "verification"} & set(call.options.settings):
                raise ValueError("`generator`, `num_tree_nodes` and `verification` are used by speculative decoding "
                                 "only; pass `assistant_model=` (or `prompt_lookup_num_tokens=`) too.")
            return super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)
        if call.facts is None:  # a call that reached transformers without hf_spec's generate(): its arguments now
            call.facts = Call(self, generation_config, call.options.settings, call.options.generator, draft,
                              generation_mode_kwargs.get("tokenizer"),
                              generation_mode_kwargs.get("assistant_tokenizer"), has_inputs=False)
            check_call(call.facts, "arguments")
        greedy_at_zero_temperature(generation_config)
        call.rounds = plan_call(draft, generation_config, call.options, (generation_mode_kwargs.get("tokenizer"),
                                                                         generation_mode_kwargs.get("assistant_tokenizer")))
        # transformers' own assistant checks (tokenizer rules of universal assisted decoding) do not apply here.
        others = {key: value for key, value in generation_mode_kwargs.items() if key != "assistant_model"}
        return super()._validate_generation_mode(generation_mode, generation_config, others)

    def _assisted_decoding(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=False,
        streamer=None,
        inputs_tensor=None,
        assistant_model=None,
        assistant_tokenizer=None,
        tokenizer=None,
        **model_kwargs,
    ):
        call = _current_call()
        if not self._is_speculating(assistant_model, generation_config) or call.rounds is None:
            return super()._assisted_decoding(  # early exit, MTP, `without_speculation`: transformers'
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
                streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
                assistant_tokenizer=assistant_tokenizer, tokenizer=tokenizer, **model_kwargs,
            )
        rounds = call.rounds
        input_ids = input_ids.long()  # int32 prompts are taken, as target-only decoding takes them (int64 out)
        conditioning = split_model_kwargs(self, model_kwargs, inputs_tensor, call.options.media)
        target_cache, pad_token_id = self._check_assisted_call(input_ids, generation_config, synced_gpus, streamer,
                                                               rounds, logits_processor, model_kwargs, conditioning)
        attach_inputs(target_cache, conditioning.every_pass)
        prefill(self, target_cache, input_ids, conditioning.decoder_mask, conditioning.prompt_only)
        rounds.start_sizer(self, generation_config.max_length - input_ids.shape[1])
        with compiling([self, rounds.drafter.cost_key], compile_config_of(generation_config, target_cache)), \
                LoadMeter() as load:
            result = speculative_decode(
                self, rounds, input_ids, conditioning.decoder_mask, target_cache,
                logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                generation_config=generation_config, pad_token_id=pad_token_id, generator=call.options.generator,
                streamer=streamer, conditioning=conditioning,
            )
        rounds.finish_sizer(self, is_quiet=input_ids.shape[0] == 1 and load.others_share is not None
                            and not load.is_loaded)
        return generate_output(result, generation_config, target_cache, input_ids.shape[0],
                                self.config.is_encoder_decoder)

    def _check_assisted_call(self, input_ids, generation_config, synced_gpus, streamer, rounds: Rounds,
                             logits_processor, model_kwargs, conditioning: Conditioning):
        """``(target cache, pad id)``: every rule on what transformers prepared, once (`hf_spec.validation`), then
        the cache made ready to roll back, of the size the call needs."""
        facts = dataclasses.replace(
            _current_call().facts, generation_config=generation_config, input_ids=input_ids,
            attention_mask=conditioning.decoder_mask, rounds=rounds, processors=logits_processor,
            cache=model_kwargs.get("cache"), streamer=streamer, synced_gpus=synced_gpus)
        check_call(facts, "prepared")
        target_cache = facts.cache
        max_pass = rounds.max_pass(generation_config.max_length - input_ids.shape[1])
        prepare_for_rollback(target_cache, max_pass + 1)
        target_cache = sized_static_cache(self, target_cache, input_ids, generation_config.max_length,
                                          generation_config.max_cache_len, max_pass)
        fit_prompt(target_cache, input_ids.shape[1])
        pad_token = pad_token_tensor(generation_config)
        return target_cache, 0 if pad_token is None else int(pad_token.view(-1)[0])

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None,
                                 *, assistant_model=None, num_assistant_tokens: int | None = None,
                                 verification: Any = None):
        """transformers' continuous batching; with an ``assistant_model`` (here or from `generate_batch`), each step
        speculates exactly (`hf_spec.serving`)."""
        if assistant_model is None:
            assistant_model, num_assistant_tokens, verification = _BATCHING_DRAFT.get()
        if assistant_model is None:
            return super().init_continuous_batching(generation_config, continuous_batching_config, workload_hints)
        from hf_spec.serving import speculative_batching_manager

        return speculative_batching_manager(self, assistant_model, generation_config, continuous_batching_config,
                                            workload_hints, num_assistant_tokens, verification)

    def generate_batch(self, inputs, generation_config=None, continuous_batching_config=None, *args,
                       assistant_model=None, num_assistant_tokens: int | None = None, verification: Any = None,
                       **kwargs):
        """transformers' `generate_batch`; with an ``assistant_model``, through `init_continuous_batching` above."""
        token = _BATCHING_DRAFT.set((assistant_model, num_assistant_tokens, verification))
        try:
            return super().generate_batch(inputs, generation_config, continuous_batching_config, *args, **kwargs)
        finally:
            _BATCHING_DRAFT.reset(token)

    def __reduce__(self):
        """Pickled as the original class's object, made speculative again when loaded (`torch.save` too)."""
        return _unpickle_speculative, (type(self).__bases__[1],), self.__getstate__()


def _unpickle_speculative(model_class: type) -> PreTrainedModel:
    return _speculative_class(model_class).__new__(_speculative_class(model_class))


def _forwarded(inputs, generation_config, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """generate()'s arguments as given, ``inputs`` left out when unset and ``generation_config`` then passed by name: a
    model's own generate() may call its first argument otherwise (Whisper's ``input_features``, passed by name)."""
    if inputs is None and not args:
        return (), kwargs if generation_config is None else {**kwargs, "generation_config": generation_config}
    return (inputs, generation_config, *args), kwargs


@contextlib.contextmanager
def keeping_draft_config(draft: Any) -> Iterator[None]:
    """The draft model's generation config as it was, after the call: Whisper's generate() sets the assistant's
    ``force_unique_generate_call`` (for transformers' assisted loop, which calls the assistant's generate())."""
    config = getattr(draft, "generation_config", None)
    if config is None:
        yield
        return
    before = dict(config.__dict__)
    try:
        yield
    finally:
        config.__dict__.clear()
        config.__dict__.update(before)


def compile_config_of(generation_config, target_cache):
    """The ``compile_config`` to run this call's passes with: set, on a static cache, and not ``disable_compile``."""
    if generation_config.disable_compile or static_length(target_cache) is None:
        return None
    return generation_config.compile_config


def speculative(model: PreTrainedModel) -> PreTrainedModel:
    """Give ``model`` exact speculative decoding; returns the same object (weights untouched), idempotently.

    The model's class is swapped for a subclass that mixes in `SpeculativeGenerationMixin` and keeps the original
    class name, so ``save_pretrained`` and ``config.architectures`` are unaffected; ``pickle`` and ``torch.save``
    give a speculative model back. A model reloaded with ``from_pretrained`` is a plain transformers model: wrap it
    again.
    """
    if not isinstance(model, PreTrainedModel) or not isinstance(model, GenerationMixin):
        raise TypeError(f"`model` must be a transformers generative PreTrainedModel, but is {type(model).__name__}.")
    if not isinstance(model, SpeculativeGenerationMixin):
        model.__class__ = _speculative_class(type(model))
    return model


def _is_our_prompt_lookup(generation_config) -> bool:
    """Prompt lookup (without a draft model) runs hf_spec's exact loop; early exit and MTP stay transformers'."""
    return (
        generation_config.prompt_lookup_num_tokens is not None
        and generation_config.assistant_early_exit is None
        and not generation_config.use_mtp
    )


@contextlib.contextmanager
def without_speculation(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Within the block, ``model`` (made `speculative`) runs transformers' own assisted decoding again.

    For side-by-side comparisons on one set of weights::

        >>> with without_speculation(model):
        ...     model.generate(**inputs, assistant_model=draft)  # transformers' assisted generation

    It holds for the current thread (and asyncio task) only: other threads using the same model keep speculating.
    """
    if not isinstance(model, SpeculativeGenerationMixin):
        raise TypeError(f"`model` is not speculative (its class is {type(model).__name__}); see `speculative`.")
    token = _WITHOUT_SPECULATION.set(_WITHOUT_SPECULATION.get() | {id(model)})
    try:
        yield model
    finally:
        _WITHOUT_SPECULATION.reset(token)


@functools.cache
def _speculative_class(model_class: type) -> type:
    return type(
        model_class.__name__,
        (SpeculativeGenerationMixin, model_class),
        {"__module__": model_class.__module__, "__qualname__": model_class.__qualname__,
         "__doc__": model_class.__doc__},
    )
