"""`SpeculativeGenerationMixin`: exact speculative decoding behind ``model.generate(assistant_model=...)``.

transformers routes ``generate(assistant_model=draft)`` and ``generate(prompt_lookup_num_tokens=n)`` to
``GenerationMixin._assisted_decoding``. This mixin replaces that one method with `hf_spec.decoding.speculative_decode`
and adds the checks it needs; every other generation mode (and early-exit or MTP assisted decoding) runs
transformers' own code unchanged. The drafter (`hf_spec.drafting`) is:

- ``assistant_model=draft``: the draft model;
- ``prompt_lookup_num_tokens=n`` (with ``max_matching_ngram_size``, default 2): prompt lookup, the exact rule for a
  point-mass proposal, under greedy decoding and sampling alike;
- both: prompt lookup when it finds a match, the draft model otherwise (transformers would ignore the draft).

Extra ``generate()`` arguments:

- ``generator``: a ``torch.Generator`` for drafting and acceptance (default: torch's global generator, so
  ``torch.manual_seed`` reproduces a run);
- ``num_assistant_tokens``: k, the draft block length; the call wins over the draft's ``generation_config``, then
  ``prompt_lookup_num_tokens``. ``"auto"`` chooses k every round from measured acceptance and costs
  (`hf_spec.drafting.AutoDraftLength`; pass an instance to keep what it learnt across calls).
- ``num_tree_nodes``: draft a tree of at most this many tokens per round instead of a chain, all verified in one
  target pass (`hf_spec.tree_decoding`; a batch of one row): the draft model or head branches (`ModelTreeDrafter`,
  `HeadTreeDrafter`), prompt lookup becomes suffix matching with several continuations (`SuffixDrafter`), or a
  `TreeDrafter` passed as ``assistant_model`` is used. ``num_assistant_tokens`` then caps the tree's depth.
  ``"auto"`` chooses the budget and branching every round (a chain, or nothing, where that is faster) from measured
  acceptance and pass costs (`hf_spec.drafting.AutoTreeSize`; pass an instance to keep what it learnt).

With ``return_dict_in_generate=True`` the output is a `SpeculativeDecoderOnlyOutput`, carrying
``speculative_stats`` (`hf_spec.stats.SpeculativeStats`).
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
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_spec.caches import fit_prompt, prepare_for_rollback
from hf_spec.compat import check_generation_hooks, pad_token_tensor
from hf_spec.decoding import speculative_decode
from hf_spec.drafting import AutoDraftLength
from hf_spec.drafting.costs import probe_costs
from hf_spec.drafting.from_arguments import make_drafter, make_tree_drafter
from hf_spec.drafting.tree_size import PROBE_BLOCK_SIZES, AutoTreeSize
from hf_spec.heads.model import DraftHead
from hf_spec.stats import SpeculativeStats
from hf_spec.tree_decoding import tree_decode
from hf_spec.validation import (
    check_tree_nodes,
    resolve_num_draft_tokens,
    resolve_prompt_lookup,
    resolve_tree_size,
    validate_draft_length_limit,
    validate_generator,
    validate_input_types,
    validate_input_values,
    validate_model_kwargs,
    validate_speculative_call,
)
from logits_processors import check_processors

logger = logging.getLogger(__name__)

# The hooks this module overrides; fail at import rather than silently run transformers' non-exact loop.
check_generation_hooks()


@dataclasses.dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only generate output plus the speculative statistics of the call."""

    speculative_stats: SpeculativeStats | None = None


@dataclasses.dataclass(frozen=True)
class _CallOptions:
    """The hf_spec arguments of the current ``generate()`` call, which transformers' kwargs handling would reject."""

    generator: torch.Generator | None = None
    num_assistant_tokens: Any = None
    num_tree_nodes: Any = None


_CALL_OPTIONS: contextvars.ContextVar[_CallOptions | None] = contextvars.ContextVar("hf_spec_call", default=None)


def _call_options() -> _CallOptions:
    return _CALL_OPTIONS.get() or _CallOptions()


class SpeculativeGenerationMixin(GenerationMixin):
    """A `GenerationMixin` whose assisted decoding is exact speculative decoding.

    Mix it in before the model class (see `speculative`), then call ``generate`` as usual::

        >>> model = speculative(AutoModelForCausalLM.from_pretrained(...))
        >>> out = model.generate(**inputs, assistant_model=draft, do_sample=True, temperature=0.7,
        ...                      num_assistant_tokens=5, return_dict_in_generate=True)
        >>> out.speculative_stats.acceptance_rate
    """

    def generate(self, inputs=None, generation_config=None, *args, generator: torch.Generator | None = None,
                 num_tree_nodes: int | str | AutoTreeSize | None = None, **kwargs):
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"`generator` must be a torch.Generator, but is {type(generator).__name__}.")
        if num_tree_nodes is not None:
            check_tree_nodes(num_tree_nodes)
        if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens") is not None:
            # before transformers' own input handling, which fails on these without naming the argument
            validate_input_types(inputs if inputs is not None else kwargs.get("input_ids"),
                                 kwargs.get("attention_mask"))
        num_assistant_tokens = kwargs.get("num_assistant_tokens",
                                          getattr(generation_config, "num_assistant_tokens", None))
        token = _CALL_OPTIONS.set(_CallOptions(generator=generator, num_assistant_tokens=num_assistant_tokens,
                                               num_tree_nodes=num_tree_nodes))
        try:
            return super().generate(inputs, generation_config, *args, **kwargs)
        finally:
            _CALL_OPTIONS.reset(token)

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        draft = generation_mode_kwargs.get("assistant_model")
        options = _call_options()
        if draft is None and not _is_our_prompt_lookup(generation_config):
            for name in ("generator", "num_tree_nodes"):
                if getattr(options, name) is not None:
                    raise ValueError(f"`{name}` is used by speculative decoding only; pass `assistant_model=` (or "
                                     "`prompt_lookup_num_tokens=`) too.")
            return super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)
        validate_speculative_call(self, draft, generation_config, generation_mode_kwargs, options.num_assistant_tokens)
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
        if assistant_model is None and not _is_our_prompt_lookup(generation_config):  # early exit, MTP: transformers'
            return super()._assisted_decoding(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
                streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
                assistant_tokenizer=assistant_tokenizer, tokenizer=tokenizer, **model_kwargs,
            )
        target_cache, pad_token_id = self._check_assisted_call(input_ids, generation_config, synced_gpus, streamer,
                                                               assistant_model, logits_processor, model_kwargs)
        options = _call_options()
        prompt_lookup_num_tokens, ngram_size = resolve_prompt_lookup(generation_config)
        if options.num_tree_nodes is not None:
            return self._tree_decoding(input_ids, target_cache, pad_token_id, assistant_model,
                                       prompt_lookup_num_tokens, ngram_size, logits_processor, stopping_criteria,
                                       generation_config, streamer, model_kwargs)
        draft_length = resolve_num_draft_tokens(options.num_assistant_tokens, assistant_model, prompt_lookup_num_tokens)
        if isinstance(draft_length, AutoDraftLength) and not draft_length.has_costs:
            # measured once per process and models: auto k starts from the costs instead of exploring
            # (a draft head's cost is learnt from the rounds: it needs the target's features to run)
            is_model = isinstance(assistant_model, PreTrainedModel) and not isinstance(assistant_model, DraftHead)
            draft_model = assistant_model if is_model else None
            draft_length.start_from(probe_costs(self, draft_model, draft_length.max_draft_tokens))
        result = speculative_decode(
            self,
            make_drafter(assistant_model, prompt_lookup_num_tokens, ngram_size),
            input_ids,
            model_kwargs.get("attention_mask"),
            target_cache,
            draft_length=draft_length,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            generation_config=generation_config,
            pad_token_id=pad_token_id,
            generator=options.generator,
            streamer=streamer,
        )
        return _generate_output(self, result, generation_config, target_cache, input_ids.shape[0])

    def _tree_decoding(self, input_ids, target_cache, pad_token_id, assistant_model,
                       prompt_lookup_num_tokens, ngram_size, logits_processor, stopping_criteria, generation_config,
                       streamer, model_kwargs):
        """``num_tree_nodes`` given: the tree loop, with the drafter's tree form."""
        options = _call_options()
        tree_size = resolve_tree_size(options.num_tree_nodes, options.num_assistant_tokens, prompt_lookup_num_tokens)
        drafter = make_tree_drafter(assistant_model, prompt_lookup_num_tokens, ngram_size)
        if isinstance(tree_size, AutoTreeSize) and not tree_size.has_costs:
            # measured once per process and models, passes of up to max_nodes + 1 tokens (a head: learnt online)
            is_model = isinstance(assistant_model, PreTrainedModel) and not isinstance(assistant_model, DraftHead)
            tree_size.shape = drafter.growth
            sizes = (*(size for size in PROBE_BLOCK_SIZES if size <= tree_size.max_nodes), tree_size.max_nodes + 1)
            tree_size.start_from(probe_costs(self, assistant_model if is_model else None, tree_size.max_nodes,
                                             block_sizes=sizes, draft_widths=(1, drafter.growth[1] or 1)))
        result = tree_decode(
            self, drafter, input_ids, model_kwargs.get("attention_mask"), target_cache, tree_size=tree_size,
            logits_processor=logits_processor, stopping_criteria=stopping_criteria,
            generation_config=generation_config, pad_token_id=pad_token_id, generator=options.generator,
            streamer=streamer,
        )
        return _generate_output(self, result, generation_config, target_cache, input_ids.shape[0])

    def _check_assisted_call(self, input_ids, generation_config, synced_gpus, streamer, assistant_model,
                             logits_processor, model_kwargs):
        """``(target cache, pad id)`` once everything the loop cannot do exactly has been refused by name."""
        if synced_gpus:
            raise ValueError("`synced_gpus=True` (DeepSpeed ZeRO-3 / FSDP) is not supported with `assistant_model`.")
        batch_size = input_ids.shape[0]
        pad_token = pad_token_tensor(generation_config)
        if batch_size > 1 and pad_token is None:
            raise ValueError(
                f"A batch of {batch_size} rows needs `pad_token_id` (finished rows are padded with it), but neither "
                "`pad_token_id` nor `eos_token_id` is set; pass `pad_token_id=` to generate()."
            )
        if batch_size > 1 and streamer is not None:
            raise ValueError(f"`streamer` supports a batch of one row, but `input_ids` has {batch_size} rows.")
        validate_model_kwargs(model_kwargs)
        attention_mask = model_kwargs.get("attention_mask")
        validate_input_types(input_ids, attention_mask)
        validate_input_values(input_ids, attention_mask, self.config.get_text_config().vocab_size)
        validate_generator(_call_options().generator, self)
        validate_draft_length_limit(assistant_model, generation_config.max_length)
        check_processors(logits_processor)
        target_cache = model_kwargs["cache"]
        prepare_for_rollback(target_cache, "cache")
        fit_prompt(target_cache, input_ids.shape[1])
        return target_cache, 0 if pad_token is None else int(pad_token.view(-1)[0])


def _generate_output(target: PreTrainedModel, result, generation_config, target_cache, batch_size: int):
    """What generate() returns: the sequences, or transformers' output with the statistics."""
    if not generation_config.return_dict_in_generate:
        return result.sequences
    if batch_size > 1:
        _warn_no_batched_cache()
    return SpeculativeDecoderOnlyOutput(
        sequences=result.sequences,
        scores=result.scores,
        logits=result.logits,
        cache=target_cache if batch_size == 1 else None,
        speculative_stats=result.stats,
    )


def speculative(model: PreTrainedModel) -> PreTrainedModel:
    """Give ``model`` exact speculative decoding; returns the same object (weights untouched), idempotently.

    The model's class is swapped for a subclass that mixes in `SpeculativeGenerationMixin` and keeps the original
    class name, so ``save_pretrained`` and ``config.architectures`` are unaffected.
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
    """
    speculative_class = type(model)
    if not isinstance(model, SpeculativeGenerationMixin):
        raise TypeError(f"`model` is not speculative (its class is {speculative_class.__name__}); see `speculative`.")
    model.__class__ = speculative_class.__bases__[1]  # bases: (SpeculativeGenerationMixin, the original class)
    try:
        yield model
    finally:
        model.__class__ = speculative_class


@functools.cache
def _warn_no_batched_cache() -> None:
    """Once per process: why ``cache`` is ``None`` for batches."""
    logger.warning(
        "speculative generate() returns `cache=None` for a batch of several rows: its caches dropped the rows that "
        "finished and keep masked holes where rows rejected drafts, so they do not line up with `sequences`. To "
        "continue, call generate() again with the returned sequences (and their attention mask). Batches of one row "
        "get their cache back."
    )


@functools.cache
def _speculative_class(model_class: type) -> type:
    return type(
        model_class.__name__,
        (SpeculativeGenerationMixin, model_class),
        {"__module__": model_class.__module__, "__qualname__": model_class.__qualname__,
         "__doc__": model_class.__doc__},
    )
