"""What a model reads beside the decoder's tokens: an encoder's outputs (T5, BART, Whisper), images in the prompt
(LLaVA and other vision-language models).

transformers' ``generate()`` hands the loop its model kwargs. `split_model_kwargs` sorts them, once per call, into a
`Conditioning`: the decoder's attention mask (the loop's), what every decoder pass reads (an encoder's outputs and
its attention mask: attached to the cache, `hf_spec.caches.attach_inputs`, they follow the batch's rows), and what
only the prompt's pass reads (pixel values and their sizes: `hf_spec.forward.prefill` feeds them once, with the
prompt but its last token, before the first round). Anything else is refused by name.

A draft model reads what fits it (`Conditioning.inputs_for`): an encoder-decoder draft its own encoder's outputs on
the same inputs, computed once per call, or the target's when it holds the target's encoder (the same module, or
equal weights: no second encoder pass); a decoder that attends over another model's encoder (distil-whisper's
assistant, ``WhisperForCausalLM``) the target's; a vision-language draft the prompt's images; a text-only draft
nothing but the tokens.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_spec.caches import reads_encoder_outputs

#: Model kwargs the loop consumes itself, for every model.
LOOP_KWARGS = frozenset({"cache", "use_cache", "logits_to_keep"})
#: What an encoder-decoder target's decoder reads on every pass (``attention_mask``: the encoder's).
ENCODER_KWARGS = frozenset({"encoder_outputs", "attention_mask"})
#: An attached per-row input that is no forward argument: how far a row's multi-axis positions run ahead of its text
#: positions (`with_position_axes`), ``[rows, axes]``.
POSITION_OFFSETS = "position_offsets"
#: Prompt-only inputs with one entry per prompt token (last axis): the prompt's pass reads all but the last.
PER_TOKEN_KWARGS = frozenset({"position_ids", "mm_token_type_ids", "token_type_ids"})


@dataclasses.dataclass
class Conditioning:
    """A call's inputs beside the decoder's tokens."""

    decoder_mask: torch.Tensor | None = None  # [batch, prompt] the decoder's attention mask (padding), or None
    every_pass: dict[str, Any] = dataclasses.field(default_factory=dict)  # the target's: encoder outputs and mask
    prompt_only: dict[str, Any] = dataclasses.field(default_factory=dict)  # the prompt's pass: images
    encoder_inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # what the encoder read
    target: PreTrainedModel | None = None
    media: dict[str, Any] = dataclasses.field(default_factory=dict)  # the raw images (`media_inputs`)

    def inputs_for(self, draft: PreTrainedModel) -> dict[str, Any]:
        """What a draft model reads on every pass, for this call's rows (see the module docstring)."""
        if POSITION_OFFSETS in self.every_pass:  # a vision-language target with multi-axis positions
            if not is_multimodal(draft):
                return {}
            if draft.config.model_type != self.target.config.model_type:
                raise ValueError(f"`assistant_model` ({type(draft).__name__}) is a vision-language model of another "
                                 f"family than the model ({type(self.target).__name__}), whose multi-axis positions "
                                 "it would not read; use a draft of the same family, or a text-only draft.")
            return {POSITION_OFFSETS: self.every_pass[POSITION_OFFSETS]}
        if "encoder_outputs" not in self.every_pass:
            return {}
        if draft.config.is_encoder_decoder:
            if holds_same_encoder(draft, self.target):
                return dict(self.every_pass)
            with torch.no_grad():
                outputs = draft.get_encoder()(**self.encoder_inputs, return_dict=True)
            mask = self.encoder_inputs.get("attention_mask")
            return {"encoder_outputs": outputs, **({} if mask is None else {"attention_mask": mask})}
        if reads_encoder_outputs(draft):
            return {"encoder_outputs": self.every_pass["encoder_outputs"]}
        return {}

    def prompt_inputs_for(self, draft: PreTrainedModel) -> dict[str, Any]:
        """The prompt's images for a draft that reads them (a vision-language draft), else none: encoded by the
        draft's own vision tower (transformers' ``_prepare_multimodal_encoder_kwargs_for_generation``) from the raw
        inputs, or the target's encodings where only those were given (as transformers' assisted generation)."""
        if not self.prompt_only or not is_multimodal(draft):
            return {}
        if "mm_encoder_outputs" not in self.prompt_only or not self.media:
            return dict(self.prompt_only)
        with torch.no_grad():
            own = draft._prepare_multimodal_encoder_kwargs_for_generation(dict(self.media))
        return {**{key: value for key, value in self.prompt_only.items() if key != "mm_encoder_outputs"}, **own}


def media_inputs(target: PreTrainedModel, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a vision-language target's ``generate()`` call that are not text (pixel values, image sizes and
    grids), before transformers encodes them; none for other targets."""
    if not is_multimodal(target):
        return {}
    text = {"input_ids", "attention_mask", "position_ids", "inputs_embeds", "token_type_ids"}
    return {key: value for key, value in kwargs.items() if isinstance(value, torch.Tensor) and key not in text}


def split_model_kwargs(target: PreTrainedModel, model_kwargs: dict[str, Any], inputs_tensor: torch.Tensor | None,
                       media: dict[str, Any] | None = None) -> Conditioning:
    """Sort ``generate()``'s model kwargs into a `Conditioning`; refuse, by name, what the loop would not pass on.
    ``media``: the call's raw image inputs (`media_inputs`)."""
    given = {key: value for key, value in model_kwargs.items()
             if value is not None and not (isinstance(value, dict) and not value)}  # an empty one is nothing
    if target.config.is_encoder_decoder:
        every_pass = {key: given[key] for key in ENCODER_KWARGS if key in given}
        encoder_inputs = {} if inputs_tensor is None else {target.main_input_name: inputs_tensor}
        if "attention_mask" in given:
            encoder_inputs["attention_mask"] = given["attention_mask"]
        known = LOOP_KWARGS | ENCODER_KWARGS | {"decoder_attention_mask"}
        conditioning = Conditioning(given.get("decoder_attention_mask"), every_pass, {}, encoder_inputs, target)
    else:
        known = LOOP_KWARGS | {"attention_mask", "position_ids"}
        prompt_only = {key: value for key, value in given.items() if key not in known} if is_multimodal(target) else {}
        known |= set(prompt_only)
        conditioning = Conditioning(given.get("attention_mask"), {}, prompt_only, {}, target, media or {})
    position_ids = given.get("position_ids")
    if position_ids is not None and position_ids.dim() == 3 and is_multimodal(target):  # [axes, batch, prompt]
        # Qwen2-VL's rotary positions: the text axis, then 3 axes that run ahead of it after an image by a per-row
        # offset; a token after the prompt is at its text position on the first and that plus the offset on the rest
        conditioning.prompt_only["position_ids"] = position_ids
        conditioning.every_pass[POSITION_OFFSETS] = (position_ids[1:, :, -1] - position_ids[:1, :, -1]).T
    elif position_ids is not None and position_ids.dim() != 2:
        raise ValueError(f"{type(target).__name__} places tokens with {position_ids.shape[0]}-axis positions "
                         f"(`position_ids` of shape {tuple(position_ids.shape)}), which hf_spec's loop does not "
                         "compute; use transformers' plain generate() with this model.")
    unsupported = sorted(set(given) - known)
    if unsupported:
        raise ValueError(f"Model inputs {unsupported} are not supported with `assistant_model`; hf_spec feeds "
                         "`input_ids`, `attention_mask` and positions only (and, to encoder-decoder and "
                         "vision-language models, the encoder's outputs and the prompt's images).")
    return conditioning


def prompt_pass_inputs(prompt_inputs: dict[str, Any]) -> dict[str, Any]:
    """``prompt_inputs`` for a pass over the prompt but its last token: per-token inputs cut to match."""
    return {key: value[..., :-1] if key in PER_TOKEN_KWARGS else value for key, value in prompt_inputs.items()}


def with_position_axes(position_ids: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """Text positions ``[batch, n]`` as multi-axis positions ``[1 + axes, batch, n]`` (the text axis, then each axis
    ahead of it by the row's ``offsets`` ``[batch, axes]``); unchanged without offsets."""
    if offsets is None:
        return position_ids
    return torch.cat([position_ids[None], position_ids[None] + offsets.T[:, :, None].to(position_ids.device)])


def is_multimodal(model: PreTrainedModel) -> bool:
    """Whether ``model`` reads more than text: its config holds a language model's config beside others."""
    return model.config.get_text_config() is not model.config and not model.config.is_encoder_decoder


def holds_same_encoder(draft: PreTrainedModel, target: PreTrainedModel | None) -> bool:
    """Whether ``draft``'s encoder is ``target``'s: the same module, or the same weights (distil-whisper's
    assistants keep their teacher's encoder). The comparison is remembered until either encoder's weights change."""
    if target is None or not target.config.is_encoder_decoder:
        return False
    mine, theirs = draft.get_encoder(), target.get_encoder()
    if mine is theirs:
        return True
    mine_state, their_state = mine.state_dict(), theirs.state_dict()
    versions = (id(theirs), tuple(value._version for value in (*mine_state.values(), *their_state.values())))
    known = _SAME_ENCODER.get(mine)
    if known is not None and known[0] == versions:
        return known[1]
    same = mine_state.keys() == their_state.keys() and all(
        value.shape == their_state[name].shape and value.dtype == their_state[name].dtype
        and torch.equal(value, their_state[name].to(value.device)) for name, value in mine_state.items())
    _SAME_ENCODER[mine] = (versions, same)
    return same


_SAME_ENCODER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft encoder -> (weights' versions, same)
