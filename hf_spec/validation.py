"""Checks of a speculative ``generate()`` call: every rule, each raising an error that names its argument and value.

`check_call` runs the rules of one stage on a `Call`, each rule once per call, before any forward pass:

- `ARGUMENT_RULES`, on what the call was given, before transformers prepares it (`hf_spec.mixin`'s ``generate``):
  transformers' own handling fails on some of these without naming the argument (a list as ``input_ids``, a
  decoding mode moved to the Hub), and none of them needs what it prepares;
- `PREPARED_RULES`, on what transformers prepared for the call (the final ids and mask, the processor chain, the
  cache) and on the plan's drafter, just before the prefill (`hf_spec.mixin`'s ``_assisted_decoding``).

`hf_spec.plan` then only turns a checked call into rounds.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.configuration_utils import GenerationMode

from hf_spec.caches import (
    cache_length,
    check_cache_rows,
    check_rollback,
    model_type,
    static_cache_length,
    static_length,
)
from hf_spec.checks import check_int, is_int_at_least
from hf_spec.compat import pad_token_tensor
from hf_spec.drafting.base import Drafter, DraftSource
from hf_spec.drafting.tree import TreeDrafter
from hf_spec.parallel import check_sharded_call
from hf_spec.settings import check_own_settings, check_settings
from hf_spec.sizing.draft_length import AutoDraftLength
from hf_spec.sizing.tree_size import AutoTreeSize
from hf_spec.support import refuse_tree_without_positions, refuse_unsupported_family
from hf_spec.verification import resolve_verification
from logits_processors import check_processors


def check_same_vocabulary(tokenizer: Any, assistant_tokenizer: Any) -> None:
    """Refuse a draft tokenizer whose vocabulary differs from the target's, where a same-tokenizer draft is needed."""
    if is_other_vocabulary(tokenizer, assistant_tokenizer):
        raise ValueError(
            f"`assistant_tokenizer` ({type(assistant_tokenizer).__name__}, {len(assistant_tokenizer)} tokens) and "
            f"`tokenizer` ({type(tokenizer).__name__}, {len(tokenizer)} tokens) have different vocabularies; this "
            "needs a draft that shares the target's tokenizer (generate() itself takes both: pass them there)."
        )


def is_other_vocabulary(tokenizer: Any, assistant_tokenizer: Any) -> bool:
    """Whether a draft tokenizer's vocabulary differs from the target's (``None``: the target's)."""
    return assistant_tokenizer is not None and tokenizer.get_vocab() != assistant_tokenizer.get_vocab()


def validate_input_types(input_ids: Any, attention_mask: Any, prefix: str = "") -> None:
    """``input_ids`` a ``[batch, length]`` integer tensor with at least one token; ``attention_mask`` a tensor of its
    shape. No host synchronization. ``prefix``: ``"decoder_"`` for an encoder-decoder's decoder prompt (the names in
    the errors)."""
    ids_name, mask_name = f"`{prefix}input_ids`", f"`{prefix}attention_mask`"
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{ids_name} must be a torch.Tensor of token ids (tokenize with return_tensors='pt'), but is "
                        f"{type(input_ids).__name__}.")
    if input_ids.dim() != 2:
        raise ValueError(f"{ids_name} must have shape [batch, length], but has shape {tuple(input_ids.shape)}; add "
                         "the batch dimension with input_ids.unsqueeze(0).")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{ids_name} must hold integer token ids (int64, or int32), but has dtype {input_ids.dtype}.")
    if input_ids.shape[0] == 0:
        raise ValueError(f"{ids_name} must hold at least one row, but has shape {tuple(input_ids.shape)}.")
    if input_ids.shape[1] == 0:
        raise ValueError(f"{ids_name} must hold at least one token per row, but has shape {tuple(input_ids.shape)}: "
                         "speculative decoding continues a prompt (start it with the BOS token if you have none).")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{mask_name} must be a torch.Tensor, but is {type(attention_mask).__name__}.")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"{mask_name} must have the shape of {ids_name} {tuple(input_ids.shape)}, but has "
                         f"{tuple(attention_mask.shape)}.")


def validate_input_values(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, vocab_size: int) -> None:
    """Ids within the target's vocabulary; a mask of 0 and 1 with left padding only, a real token in every row.
    One host synchronization for all of it."""
    checks = [input_ids.min(), input_ids.max()]
    if attention_mask is not None:
        mask = attention_mask.long()
        checks += [((mask != 0) & (mask != 1)).any(), (mask[:, 1:] < mask[:, :-1]).any(), (mask.sum(dim=1) == 0).any()]
    low, high, *mask_flags = torch.stack([value.long() for value in checks]).tolist()
    if low < 0 or high >= vocab_size:
        raise ValueError(f"`input_ids` holds ids from {low} to {high}, but the model's vocabulary has {vocab_size} ids "
                         f"(0 to {vocab_size - 1}).")
    is_not_binary, is_right_padded, has_empty_row = mask_flags or (False, False, False)
    if is_not_binary:
        raise ValueError("`attention_mask` must hold only 0 (padding) and 1 (token).")
    if is_right_padded:
        raise ValueError(
            "`attention_mask` has padding after a token in some row (right padding). Speculative decoding continues "
            "every row from its last token, so rows must be left-padded: set `tokenizer.padding_side = 'left'` "
            "before tokenizing the batch. (Without an `attention_mask`, transformers makes one from `pad_token_id`: "
            "a pad id inside a prompt then looks like padding; pass the mask.)"
        )
    if has_empty_row:
        raise ValueError("`attention_mask` has a row with no token at all (every entry 0).")


@dataclasses.dataclass
class Call:
    """What a speculative ``generate()`` call was given (the argument stage), then what transformers prepared for it
    (the prepared stage fills the fields after ``rounds``)."""

    model: PreTrainedModel
    generation_config: GenerationConfig  # merged: the call's settings over the configs (then transformers' own)
    settings: dict[str, Any]  # `hf_spec.plan.READ_SETTINGS` the user set, by name (`hf_spec.plan.user_settings`)
    generator: Any = None
    assistant_model: Any = None
    tokenizer: Any = None
    assistant_tokenizer: Any = None
    input_ids: Any = None  # as given (an encoder-decoder's: ``decoder_input_ids``, when given), then as prepared
    attention_mask: Any = None
    ids_prefix: str = ""  # "decoder_" where the ids are an encoder-decoder's decoder prompt (the errors' names)
    has_inputs: bool = True  # False where the call's inputs were not seen (the prepared stage checks their values)
    rounds: Any = None  # the plan (`hf_spec.rounds.Rounds`)
    processors: LogitsProcessorList | None = None  # the chain transformers built
    cache: Any = None  # the cache transformers made (or the one passed as ``cache=``)
    streamer: Any = None
    synced_gpus: bool = False
    own_arguments: dict[str, Any] = dataclasses.field(default_factory=dict)  # for the model's own generate() (Whisper)

    @property
    def is_tree(self) -> bool:
        return self.settings.get("num_tree_nodes") is not None

    @property
    def prompt_lookup(self) -> int | None:
        return self.generation_config.prompt_lookup_num_tokens


Rule = Callable[[Call], None]


def check_call(call: Call, stage: str) -> None:
    """Run the rules of ``stage`` on ``call`` in order: ``"arguments"`` (`ARGUMENT_RULES`) or ``"prepared"``
    (`PREPARED_RULES`); the first broken rule raises."""
    for rule in {"arguments": ARGUMENT_RULES, "prepared": PREPARED_RULES}[stage]:
        rule(call)


# --- the argument stage ----------------------------------------------------------------------------------------------

def check_generator(call: Call) -> None:
    """``generator``: a ``torch.Generator`` on the device the models compute on."""
    generator = call.generator
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"`generator` must be a torch.Generator, but is {type(generator).__name__}.")
    if generator.device.type != call.model.device.type:
        raise ValueError(f"`generator` draws on {generator.device}, but the model runs on {call.model.device}: "
                         f"create it there, e.g. torch.Generator({str(call.model.device)!r}).manual_seed(seed).")


def check_family(call: Call) -> None:
    """The target's family can be speculated with exactly (`refuse_unsupported_family`)."""
    refuse_unsupported_family(call.model, "model")


def check_generation_mode(call: Call) -> None:
    """Greedy decoding or sampling: prompt lookup turns those into assisted generation, and only those."""
    config = call.generation_config
    base_mode = config.get_generation_mode()
    if base_mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.ASSISTED_GENERATION):
        raise ValueError(
            "Speculative decoding (`assistant_model` or `prompt_lookup_num_tokens`) supports greedy decoding and "
            f"sampling only, but the generation settings select {base_mode.value!r} (num_beams={config.num_beams}, "
            f"penalty_alpha={config.penalty_alpha}, constraints={config.constraints}, dola_layers="
            f"{config.dola_layers})."
        )


def check_setting_table(call: Call) -> None:
    """Every generation setting against `hf_spec.settings.SETTINGS`: refused values raise, warned ones warn once."""
    check_settings(call.generation_config, call.settings)
    check_own_settings(type(call.model), call.own_arguments)


def check_sampling(call: Call) -> None:
    """``temperature >= 0``; ``top_p`` in (0, 1] when sampling (temperature 0 is greedy decoding,
    `hf_spec.plan.greedy_at_zero_temperature`)."""
    config = call.generation_config
    temperature = config.temperature
    if isinstance(temperature, (tuple, list)) and takes_fallback_temperatures(call.model):
        temperatures = temperature  # Whisper's fallback: its generate() runs one inner call per temperature
    else:
        temperatures = [temperature]
    for value in temperatures:
        if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool) or value < 0):
            raise ValueError(f"`temperature` must be a number >= 0, but is {temperature!r}.")
    if len(temperatures) > 1:
        return
    top_p = config.top_p
    if config.do_sample and temperature != 0 and top_p is not None and not (0 < top_p <= 1):
        raise ValueError(f"`top_p` must be in (0, 1], but is {top_p!r}.")


def takes_fallback_temperatures(model: PreTrainedModel) -> bool:
    """Whether the model's own generate() takes a sequence of temperatures to fall back through (Whisper's), calling
    transformers' generate() with one of them at a time."""
    return any("temperature" in inspect.signature(klass.__dict__["generate"]).parameters
               for klass in type(model).__mro__ if "generate" in klass.__dict__)


def check_tokenizers(call: Call) -> None:
    """``tokenizer`` and ``assistant_tokenizer`` are tokenizers; the second needs the first (the draft reads the
    target's text, `hf_spec.drafting.cross_tokenizer`)."""
    for name in ("tokenizer", "assistant_tokenizer"):
        given = getattr(call, name)
        if given is not None and not isinstance(given, PreTrainedTokenizerBase):
            hint = f" (load it: AutoTokenizer.from_pretrained({given!r}))" if isinstance(given, str) else ""
            raise TypeError(f"`{name}` must be a tokenizer (a transformers PreTrainedTokenizerBase), but is "
                            f"{type(given).__name__} {given!r:.60}{hint}.")
    if call.assistant_tokenizer is not None and call.tokenizer is None:
        raise ValueError("`assistant_tokenizer` was given without `tokenizer`; pass both or neither.")


def check_input_types(call: Call) -> None:
    """The prompt's ids and mask (`validate_input_types`); an encoder-decoder's decoder prompt, where given."""
    if call.has_inputs and (call.input_ids is not None or not call.ids_prefix):
        validate_input_types(call.input_ids, call.attention_mask, call.ids_prefix)


def check_drafting(call: Call) -> None:
    """What drafts: a model, a draft head, a `hf_spec.drafting.Drafter`, prompt lookup, in the combinations
    `hf_spec.plan.make_drafter` takes (its table), with a tokenizer of the draft's own only for a draft model."""
    draft, tree, lookup = call.assistant_model, call.is_tree, call.prompt_lookup
    if call.generation_config.assistant_early_exit is not None and draft is not None:
        raise ValueError(f"`assistant_early_exit`={call.generation_config.assistant_early_exit} and `assistant_model` "
                         "both name the draft: early exit drafts with the model's own first layers (transformers' "
                         "loop), `assistant_model` with another model (hf_spec's). Pass one of them.")
    if is_other_vocabulary(call.tokenizer, call.assistant_tokenizer):
        if not isinstance(draft, PreTrainedModel) or isinstance(draft, DraftSource):
            raise ValueError(f"`assistant_tokenizer` with another vocabulary needs a draft model as `assistant_model`, "
                             f"but it is a {type(draft).__name__}: a drafter or draft head proposes the target's ids "
                             "itself; drop `assistant_tokenizer`.")
        for name, value in (("num_tree_nodes", tree or None), ("prompt_lookup_num_tokens", lookup)):
            if value is not None:
                raise ValueError(f"`{name}` with a draft of another tokenizer (`assistant_tokenizer`) is not "
                                 "supported: its drafts are chains from the draft model alone.")
        return
    if isinstance(draft, Drafter):
        if tree and not isinstance(draft, TreeDrafter):
            raise TypeError(f"`num_tree_nodes` needs a drafter that proposes trees (a TreeDrafter), but "
                            f"`assistant_model` is a {type(draft).__name__}.")
    elif isinstance(draft, DraftSource):
        if lookup is not None:
            raise ValueError(f"`prompt_lookup_num_tokens` with a draft head ({type(draft).__name__}) as "
                             "`assistant_model` is not supported: pass one of them.")
    elif draft is not None and not isinstance(draft, PreTrainedModel):
        raise TypeError(f"`assistant_model` must be a transformers PreTrainedModel or an hf_spec Drafter, but is "
                        f"{type(draft).__name__}.")
    elif draft is not None and tree and lookup is not None:
        raise ValueError("`num_tree_nodes` with both `assistant_model` and `prompt_lookup_num_tokens` is not "
                         "supported: pass one of them (the draft model's tree, or suffix matching).")


def check_lengths(call: Call) -> None:
    """``max_new_tokens``, ``max_length``, ``min_new_tokens``, ``min_length``: integers where set (a float reached the
    draft's loops as a bare TypeError)."""
    config = call.generation_config
    for name, minimum in (("max_new_tokens", 1), ("max_length", 1), ("min_new_tokens", 0), ("min_length", 0)):
        value = getattr(config, name, None)
        if value is not None:
            check_int(name, value, minimum)


def check_sizes(call: Call) -> None:
    """``num_assistant_tokens`` (a positive integer, ``"auto"`` or an `AutoDraftLength`; with trees an integer
    capping the depth, or ``"auto"``), ``num_assistant_tokens_schedule``, ``assistant_confidence_threshold``,
    ``num_tree_nodes``, ``prompt_lookup_num_tokens`` and ``max_matching_ngram_size``."""
    settings, config = call.settings, call.generation_config
    k, schedule = settings.get("num_assistant_tokens"), settings.get("num_assistant_tokens_schedule")
    threshold = settings.get("assistant_confidence_threshold")
    for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size"):
        if getattr(config, name) is not None:
            check_int(name, getattr(config, name))
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not 0 <= threshold < 1):
        raise ValueError(f"`assistant_confidence_threshold` must be a number in [0, 1), but is {threshold!r}.")
    if call.is_tree:
        check_tree_size(settings["num_tree_nodes"], k, schedule, threshold)
        return
    if schedule not in (None, "constant", "heuristic", "heuristic_transient"):
        raise ValueError(f"`num_assistant_tokens_schedule` must be 'constant', 'heuristic' or 'heuristic_transient', "
                         f"but is {schedule!r}.")
    is_auto = isinstance(k, AutoDraftLength) or (isinstance(k, str) and k == "auto")
    if schedule in ("heuristic", "heuristic_transient") and is_auto:
        raise ValueError(f"`num_assistant_tokens='auto'` and `num_assistant_tokens_schedule={schedule!r}` both choose "
                         "k every round: pass one of them.")
    if k is not None and not is_auto and not is_int_at_least(k, 1):
        raise ValueError(f"`num_assistant_tokens` (the draft block length k) must be a positive integer, 'auto' or an "
                         f"AutoDraftLength, but is {k!r} ({type(k).__name__}).")


def check_tree_size(num_tree_nodes: Any, num_assistant_tokens: Any, schedule: Any, threshold: Any) -> None:
    """``num_tree_nodes`` a positive integer, ``"auto"`` or an `AutoTreeSize`; ``num_assistant_tokens`` caps its
    depth; a chain's schedule and confidence threshold do not apply."""
    if not (is_int_at_least(num_tree_nodes, 1) or isinstance(num_tree_nodes, AutoTreeSize)
            or (isinstance(num_tree_nodes, str) and num_tree_nodes == "auto")):
        raise ValueError(f"`num_tree_nodes` (draft tokens per tree) must be a positive integer, 'auto' or an "
                         f"AutoTreeSize, but is {num_tree_nodes!r} ({type(num_tree_nodes).__name__}).")
    for name, value in (("num_assistant_tokens_schedule", schedule), ("assistant_confidence_threshold", threshold)):
        if value not in (None, "constant"):
            raise ValueError(f"`{name}`={value!r} shapes a chain of drafts; with `num_tree_nodes` the tree's size "
                             "comes from `num_tree_nodes` (an integer or 'auto'). Pass one of them.")
    if isinstance(num_tree_nodes, AutoTreeSize) or num_assistant_tokens is None:
        return
    if num_tree_nodes == "auto":
        if num_assistant_tokens != "auto" and not is_int_at_least(num_assistant_tokens, 1):
            raise ValueError(f"`num_assistant_tokens` caps a tree's depth: a positive integer, 'auto' or unset, but is "
                             f"{num_assistant_tokens!r}.")
    elif not is_int_at_least(num_assistant_tokens, 1):
        raise ValueError(
            f"`num_assistant_tokens` is {num_assistant_tokens!r}; with a fixed `num_tree_nodes` it caps the tree's "
            "depth and must be a positive integer. Pass `num_tree_nodes='auto'` to let the tree's size and depth "
            "follow measured acceptance and costs."
        )


def check_trees(call: Call) -> None:
    """Trees need a target that takes positions (`refuse_tree_without_positions`)."""
    if call.is_tree:
        refuse_tree_without_positions(call.model, "model")


def check_verification(call: Call) -> None:
    """``verification``: ``"block"``, ``"token"`` or a `hf_spec.verification.Verification`."""
    resolve_verification(call.settings.get("verification"))


#: The rules on what a call was given, in the order they run (`check_call`).
ARGUMENT_RULES: tuple[Rule, ...] = (
    check_generator, check_verification, check_input_types, check_family, check_generation_mode, check_setting_table,
    check_lengths, check_sampling, check_tokenizers, check_drafting, check_sizes, check_trees,
)


# --- the prepared stage ----------------------------------------------------------------------------------------------

def check_batch(call: Call) -> None:
    """``synced_gpus`` off; a batch of several rows has a pad id (finished rows are padded with it) and no
    streamer."""
    batch_size = call.input_ids.shape[0]
    if call.synced_gpus:
        raise ValueError("`synced_gpus=True` (DeepSpeed ZeRO-3 / FSDP) is not supported with `assistant_model`.")
    if batch_size > 1 and pad_token_tensor(call.generation_config) is None:
        raise ValueError(
            f"A batch of {batch_size} rows needs `pad_token_id` (finished rows are padded with it), but neither "
            "`pad_token_id` nor `eos_token_id` is set; pass `pad_token_id=` to generate()."
        )
    if batch_size > 1 and call.streamer is not None:
        raise ValueError(f"`streamer` supports a batch of one row, but `input_ids` has {batch_size} rows.")
    vocab_size = call.model.config.get_text_config(decoder=True).vocab_size
    pad = pad_token_tensor(call.generation_config)
    pad_id = None if pad is None else int(pad.view(-1)[0])
    if batch_size > 1 and pad_id is not None and not 0 <= pad_id < vocab_size:
        raise ValueError(
            f"`pad_token_id`={pad_id} is outside the model's vocabulary (0 to {vocab_size - 1}), and a batch of "
            f"{batch_size} rows feeds it to the models (finished rows and holes are padded with it). A tokenizer that "
            "added a pad token needs `model.resize_token_embeddings(len(tokenizer))`; or pass "
            "`pad_token_id=tokenizer.eos_token_id` (the mask says which tokens are padding).")


def check_input_values(call: Call) -> None:
    """The prepared ids within the target's vocabulary, and a left-padded 0/1 mask (`validate_input_values`)."""
    vocab_size = call.model.config.get_text_config(decoder=True).vocab_size
    validate_input_values(call.input_ids, call.attention_mask, vocab_size)


def check_drafter(call: Call) -> None:
    """The plan's drafter can serve the target up to ``max_length`` (`hf_spec.drafting.base.Drafter.check`)."""
    call.rounds.drafter.check(call.model, call.generation_config.max_length)


def check_ranks(call: Call) -> None:
    """A tensor-parallel target: sizes every rank agrees on and a draft it can run (`check_sharded_call`)."""
    check_sharded_call(call.model, call.assistant_model, call.rounds, call.settings)


def check_processor_chain(call: Call) -> None:
    """No processor that keeps state between calls (`logits_processors.check_processors`)."""
    check_processors(call.processors)


def check_cache(call: Call) -> None:
    """A cache to roll back, exactly (`hf_spec.caches.check_rollback`), with the batch's rows; a static one holds what
    the call may write, and compiled passes need one (an encoder-decoder's runs eagerly)."""
    cache, config, model = call.cache, call.generation_config, call.model
    if cache is None:
        raise ValueError(f"The model {model_type(model)} made no cache for generate() to hand over (it builds a "
                         "cache of its own inside its forward pass), and speculative decoding rolls the cache back "
                         "after every round; hf_spec cannot speculate with this model.")
    check_rollback(cache, "cache", model_type(model))
    check_cache_rows(cache, call.input_ids.shape[0], "cache")
    is_compiled = config.compile_config is not None and not config.disable_compile
    if static_length(cache) is None:
        if is_compiled:
            raise ValueError("`compile_config` compiles the passes of a static cache; pass "
                             "`cache_implementation='static'`, or a static cache as `cache=` (a dynamic cache's "
                             "shapes change every round).")
        return
    if is_compiled and model.config.is_encoder_decoder:
        raise ValueError(f"`compile_config` with an encoder-decoder model ({type(model).__name__}) is not "
                         "supported by hf_spec: its static cache runs eagerly; leave `compile_config` unset.")
    check_static_cache(call)


def check_static_cache(call: Call) -> None:
    """A static cache is sized for the largest tree (within the model's positions); ``max_cache_len`` at least
    ``max_length``; a filled cache passed as ``cache=`` holds what the call may write (`static_cache_length`)."""
    config, input_ids = call.generation_config, call.input_ids
    max_drafted = call.rounds.max_pass(config.max_length - input_ids.shape[1])
    positions = getattr(call.model.config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and max_drafted > positions:  # only a tree's budget can be (a chain's is capped)
        raise ValueError(f"`num_tree_nodes`={max_drafted} is more than the model's {positions} positions "
                         "(`max_position_embeddings`), and a static cache is sized for the largest tree; pass a "
                         "smaller budget, or use the default dynamic cache.")
    needed = static_cache_length(input_ids.shape[0], input_ids.shape[1], config.max_length, max_drafted)
    user_length = config.max_cache_len
    if user_length is not None and user_length < config.max_length:
        raise ValueError(f"`max_cache_len`={user_length} is smaller than `max_length`={config.max_length} (the prompt "
                         f"and `max_new_tokens`): the static cache could not hold the answer; pass "
                         f"`max_cache_len={needed}` or more, or leave it unset.")
    if cache_length(call.cache) > 0 and static_length(call.cache) < needed:
        raise ValueError(f"The static `cache` holds {static_length(call.cache)} positions, but this call may write "
                         f"{needed} (drafts past `max_length`, and a batch's rows drifting apart); build it with "
                         f"`max_cache_len={needed}` or more.")


#: The rules on what transformers prepared, in the order they run (`check_call`).
PREPARED_RULES: tuple[Rule, ...] = (check_batch, check_input_values, check_drafter, check_ranks, check_processor_chain,
                                    check_cache)
