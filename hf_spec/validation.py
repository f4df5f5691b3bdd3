"""Checks at the public boundary of speculative `generate()`: each error names the argument and its value."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.configuration_utils import GenerationMode

from hf_spec.compat import ignores_recurrent_recording, records_recurrent_states
from hf_spec.forward import input_names
from hf_spec.settings import check_settings

#: Families whose forward pass breaks what a speculative loop relies on (found on tiny configs of every causal-LM
#: family, `hf_spec.evaluation.zoo`), by ``model_type``: why none of them can be verified exactly.
UNSUPPORTED_FAMILIES = {
    "xlm": "its forward takes the whole sequence every pass and keeps a legacy cache of its own, not transformers' "
           "cache of the tokens fed",
    "cpmant": "it adds prompt positions of its own to the cache, so the cache does not hold one position per token",
    "moshi": "its sliding-window attention gives a multi-token pass other logits than single steps in transformers "
             "itself (by 0.2 on a tiny config), so no verify pass can reproduce step-by-step decoding",
    "recurrent_gemma": "its recurrent blocks give a multi-token pass other logits than single steps in transformers "
                       "itself (by 0.1 on a tiny config, with or without its window), so no verify pass can reproduce "
                       "step-by-step decoding",
}


def refuse_unsupported_family(model: PreTrainedModel, argument: str) -> None:
    """Refuse, by its ``model_type`` and the reason, a family in `UNSUPPORTED_FAMILIES`, and one whose recurrent
    layers ignore transformers' recurrent-state recording (the rollback would restore a wrong state)."""
    model_type = model.config.model_type
    reason = UNSUPPORTED_FAMILIES.get(model_type)
    if reason is None and ignores_recurrent_recording(model):
        reason = ("its recurrent layers do not record their state after each token of a pass (its modeling code does "
                  "not read `get_recurrent_states_to_keep`), so a rollback cannot restore the state of the accepted "
                  "drafts")
        if not records_recurrent_states():
            reason += "; transformers records recurrent states from version 5.25 on: upgrade transformers"
    if reason is not None:
        raise ValueError(f"`{argument}` is a {model_type!r} model ({type(model).__name__}), which hf_spec cannot "
                         f"speculate with exactly: {reason}. Use another model, or transformers' plain generate().")


def refuse_unsupported(target: PreTrainedModel, generation_config: GenerationConfig,
                       generation_mode_kwargs: dict[str, Any], user_settings: dict[str, Any]) -> None:
    """Refuse what the speculative loop cannot do exactly, before any forward pass and before transformers' own
    handling of the settings (the drafter checks itself: `hf_spec.drafting.base.Drafter.check`).

    Every setting goes through `hf_spec.settings.check_settings` (``user_settings``: the assisted-generation settings
    where the user set them).
    """
    refuse_unsupported_family(target, "model")
    base_mode = generation_config.get_generation_mode()
    # prompt lookup turns greedy and sampling into assisted generation, and only those
    if base_mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.ASSISTED_GENERATION):
        raise ValueError(
            "Speculative decoding (`assistant_model` or `prompt_lookup_num_tokens`) supports greedy decoding and "
            f"sampling only, but the generation settings select {base_mode.value!r} (num_beams="
            f"{generation_config.num_beams}, penalty_alpha={generation_config.penalty_alpha}, constraints="
            f"{generation_config.constraints}, dola_layers={generation_config.dola_layers})."
        )
    check_settings(generation_config, user_settings)
    if user_settings.get("num_tree_nodes") is not None:
        refuse_tree_without_positions(target, "model")
    if generation_config.assistant_early_exit is not None and generation_mode_kwargs.get("assistant_model") is not None:
        raise ValueError(f"`assistant_early_exit`={generation_config.assistant_early_exit} and `assistant_model` both "
                         "name the draft: early exit drafts with the model's own first layers (transformers' loop), "
                         "`assistant_model` with another model (hf_spec's). Pass one of them.")
    _validate_tokenizers(generation_mode_kwargs)


def refuse_tree_without_positions(model: PreTrainedModel, argument: str) -> None:
    """Tree drafts place each node at its depth's position: a model whose forward takes no positions (it places
    tokens by cache position: T5, BART, distil-whisper's decoder) cannot verify or draft a tree."""
    if input_names(type(model)).positions is None:
        raise ValueError(f"`num_tree_nodes`: tree drafts place each node at its depth's position, which `{argument}` "
                         f"({type(model).__name__}) cannot take (its forward places tokens by cache position); "
                         "leave `num_tree_nodes` unset to draft chains.")


def validate_sampling_settings(generation_config: GenerationConfig) -> None:
    """``temperature >= 0`` and ``top_p`` in (0, 1]; sets ``do_sample = False`` when ``temperature == 0``
    (documented: the limit of sampling is greedy decoding; transformers would raise instead)."""
    _validate_sampling_settings(generation_config)


def _validate_sampling_settings(generation_config: GenerationConfig) -> None:
    temperature = generation_config.temperature
    if temperature is not None and (not isinstance(temperature, numbers.Real) or temperature < 0):
        raise ValueError(f"`temperature` must be a number >= 0, but is {temperature!r}.")
    if generation_config.do_sample and temperature == 0:
        # The limit of sampling as temperature -> 0 is greedy decoding; transformers would raise instead.
        generation_config.do_sample = False
    top_p = generation_config.top_p
    if generation_config.do_sample and top_p is not None and not (0 < top_p <= 1):
        raise ValueError(f"`top_p` must be in (0, 1], but is {top_p!r}.")


def _validate_tokenizers(generation_mode_kwargs: dict[str, Any]) -> None:
    """``assistant_tokenizer`` needs ``tokenizer``: the draft reads the target's text (`hf_spec.drafting
    .cross_tokenizer`)."""
    for name in ("tokenizer", "assistant_tokenizer"):
        given = generation_mode_kwargs.get(name)
        if given is not None and not isinstance(given, PreTrainedTokenizerBase):
            hint = f" (load it: AutoTokenizer.from_pretrained({given!r}))" if isinstance(given, str) else ""
            raise TypeError(f"`{name}` must be a tokenizer (a transformers PreTrainedTokenizerBase), but is "
                            f"{type(given).__name__} {given!r:.60}{hint}.")
    has_draft_tokenizer = generation_mode_kwargs.get("assistant_tokenizer") is not None
    if has_draft_tokenizer and generation_mode_kwargs.get("tokenizer") is None:
        raise ValueError("`assistant_tokenizer` was given without `tokenizer`; pass both or neither.")


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
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"{ids_name} must hold integer token ids, but has dtype {input_ids.dtype}.")
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


def validate_generator(generator: torch.Generator | None, model: PreTrainedModel) -> None:
    """The ``generator`` must draw on the device the models compute on."""
    if generator is not None and generator.device.type != model.device.type:
        raise ValueError(f"`generator` draws on {generator.device}, but the model runs on {model.device}: create it "
                         f"there, e.g. torch.Generator({str(model.device)!r}).manual_seed(seed).")
