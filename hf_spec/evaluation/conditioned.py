"""The zoo's conditioned targets: encoder-decoder models (T5, BART, Whisper) and a vision-language model (LLaVA), as
tiny random models with drafts that are actually accepted, and their check against the target's own ``generate()``.

Each `CASES` entry builds a target, its drafts and its inputs (`build_case`): a near-copy draft of the same class
(for Whisper: the target's encoder and a near-copy decoder, as distil-whisper's assistants; for LLaVA: the near-copy's
language backbone alone, a text-only draft, as well), a ragged batch of two rows (LLaVA: an image in one row, text
only in the other), and inputs the encoder reads (random ids, random log-mel features, a random image).
`check_case` runs greedy speculative decoding with every draft and compares with target-only decoding, counting the
encoder passes. Weights are scaled up from transformers' initialization, so that greedy text does not repeat one
token (the default initialization of a tiny T5 does), and the drafts' noise is small enough for acceptance between
a third and most tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForCausalLM,
    WhisperForConditionalGeneration,
)

from hf_spec.evaluation.zoo import near_copy
from hf_spec.mixin import speculative

VOCAB_SIZE = 256
NEW_TOKENS = 24
#: LLaVA's image: 32 x 32 pixels in 8 x 8 patches, 16 image tokens in the prompt at this id.
IMAGE_TOKEN_ID, IMAGE_TOKENS = 250, 16


@dataclasses.dataclass
class Case:
    """A conditioned target, its drafts by name, and the ``generate()`` inputs of a ragged batch of two rows."""

    target: PreTrainedModel
    drafts: dict[str, PreTrainedModel]
    inputs: dict[str, torch.Tensor]



def _seeded(seed: int, build: Callable[[], PreTrainedModel]) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = build().eval()
    model.generation_config.eos_token_id = None  # every row generates the same number of tokens
    return model


def _ragged_ids(seed: int, width: int, vocab_size: int = VOCAB_SIZE, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``[2, width]``: random ids 3 .., the second row left-padded by a third of ``width``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(vocab_size, IMAGE_TOKEN_ID), (2, width), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, : width // 3], ids[1, : width // 3] = 0, pad
    return ids, mask


def t5(vocab_size: int = VOCAB_SIZE, seed: int = 0, scale: float = 8.0) -> T5ForConditionalGeneration:
    """``scale``: transformers' ``initializer_factor`` (1: its default, whose greedy text repeats one token)."""
    config = T5Config(vocab_size=vocab_size, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, initializer_factor=scale)
    return _seeded(seed, lambda: T5ForConditionalGeneration(config))


def bart(vocab_size: int = VOCAB_SIZE, seed: int = 0) -> BartForConditionalGeneration:
    config = BartConfig(vocab_size=vocab_size, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                        max_position_embeddings=256, forced_eos_token_id=None, init_std=0.3)
    return _seeded(seed, lambda: BartForConditionalGeneration(config))


def whisper_config(vocab_size: int = VOCAB_SIZE, scale: float = 1.0) -> WhisperConfig:
    return WhisperConfig(vocab_size=vocab_size, d_model=64, encoder_layers=2, decoder_layers=2,
                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                         num_mel_bins=16, max_source_positions=32, max_target_positions=128, init_std=scale,
                         decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
                         suppress_tokens=None, begin_suppress_tokens=None)


def whisper(vocab_size: int = VOCAB_SIZE, seed: int = 0, scale: float = 1.0) -> WhisperForConditionalGeneration:
    """``scale``: the weights' ``init_std`` (transformers' default: 0.02)."""
    return _seeded(seed, lambda: WhisperForConditionalGeneration(whisper_config(vocab_size, scale)))


def with_whisper_tasks(model: WhisperForConditionalGeneration) -> WhisperForConditionalGeneration:
    """``model`` with a generation config that knows timestamps, two languages and both tasks (ids 190-200), as a
    multilingual checkpoint's does (generate() then detects the language where none is given)."""
    config = model.generation_config
    config.no_timestamps_token_id, config.max_initial_timestamp_index, config.is_multilingual = 200, 50, True
    config.lang_to_id, config.task_to_id = {"<|en|>": 190, "<|fr|>": 191}, {"transcribe": 195, "translate": 196}
    return model


def whisper_assistant(target: WhisperForConditionalGeneration, noise: float) -> WhisperForCausalLM:
    """distil-whisper's kind of assistant: a decoder alone (``WhisperForCausalLM``), here the target's decoder plus
    noise, reading the target's encoder outputs."""
    assistant = _seeded(0, lambda: WhisperForCausalLM(copy.deepcopy(target.config)))
    assistant.model.decoder.load_state_dict(target.model.decoder.state_dict())
    assistant.proj_out.weight = assistant.model.decoder.embed_tokens.weight
    return near_copy(assistant, noise=noise)


def llava(vocab_size: int = VOCAB_SIZE, seed: int = 0) -> LlavaForConditionalGeneration:
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=64)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=min(IMAGE_TOKEN_ID, vocab_size - 1),
                         vision_feature_layer=-1, vision_feature_select_strategy="default")
    model = _seeded(seed, lambda: LlavaForConditionalGeneration(config))
    model.generation_config.pad_token_id = 0
    return model


def qwen2_vl(vocab_size: int = VOCAB_SIZE, seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """A tiny Qwen2-VL: 4 x 4 patches of 4 pixels merged 2 x 2, so an image of grid (1, 4, 4) is 4 placeholder ids;
    its rotary positions have three axes (time, height, width) beside the text's."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": 0, "rope_parameters": rope}
    vision = {"depth": 1, "embed_dim": 64, "hidden_size": 64, "num_heads": 4, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
    special = {name: min(vocab_size - 1, IMAGE_TOKEN_ID + offset) for offset, name in enumerate(
        ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"))}
    model = _seeded(seed, lambda: Qwen2VLForConditionalGeneration(
        Qwen2VLConfig(text_config=text, vision_config=vision, **special)))
    model.generation_config.pad_token_id = 0
    return model


def text_backbone(model: PreTrainedModel) -> PreTrainedModel:
    """A vision-language model's language model alone, as a text-only draft sharing its tokenizer (Qwen2-VL's as a
    Qwen2: on text its three position axes are equal, which is Qwen2's one-axis rotary embedding)."""
    text = model.config.text_config
    if model.config.model_type == "qwen2_vl":
        sizes = {name: getattr(text, name) for name in ("vocab_size", "hidden_size", "intermediate_size",
                                                        "num_hidden_layers", "num_attention_heads",
                                                        "num_key_value_heads", "max_position_embeddings")}
        theta = text.rope_parameters["rope_theta"]
        backbone = _seeded(0, lambda: Qwen2ForCausalLM(Qwen2Config(**sizes, rope_parameters={
            "rope_type": "default", "rope_theta": theta}, tie_word_embeddings=False)))
    else:
        backbone = _seeded(0, lambda: LlamaForCausalLM(text))
    backbone.model.load_state_dict(model.model.language_model.state_dict())
    backbone.lm_head.load_state_dict(model.lm_head.state_dict())
    return backbone


def build_case(name: str) -> Case:
    """The `CASES` entry ``name``: target, drafts, inputs."""
    if name in ("t5", "bart"):
        target = t5() if name == "t5" else bart()
        ids, mask = _ragged_ids(1, 12)
        return Case(target, {"near-copy": near_copy(target, noise=0.01)}, {"input_ids": ids, "attention_mask": mask})
    if name == "whisper":
        target = whisper()
        same_encoder = copy.deepcopy(target)
        near_copy_decoder = near_copy(target.model.decoder, noise=0.003)
        same_encoder.model.decoder.load_state_dict(near_copy_decoder.state_dict())
        features = torch.randn((2, 16, 64), generator=torch.Generator().manual_seed(1))
        return Case(target, {"decoder-only assistant": whisper_assistant(target, noise=0.003),
                             "same encoder": same_encoder}, {"input_features": features})
    if name == "llava":
        target = llava()
        draft = near_copy(target, noise=0.02)
        ids, mask = _ragged_ids(1, 30)
        ids[0, 5: 5 + IMAGE_TOKENS] = IMAGE_TOKEN_ID  # row 0 holds an image, row 1 is text only
        image = torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(2))
        return Case(target, {"near-copy": draft, "text backbone": text_backbone(draft)},
                    {"input_ids": ids, "attention_mask": mask, "pixel_values": image})
    if name == "qwen2_vl":
        target = qwen2_vl()
        draft = near_copy(target, noise=0.02)
        ids, mask = _ragged_ids(1, 24)
        start = target.config.vision_start_token_id
        ids[0, 4: 10] = torch.tensor([start, *[target.config.image_token_id] * 4, start + 1])  # row 0: an image
        patches = torch.randn((16, 3 * 2 * 4 * 4), generator=torch.Generator().manual_seed(2))  # grid 1 x 4 x 4
        inputs = {"input_ids": ids, "attention_mask": mask, "pixel_values": patches,
                  "image_grid_thw": torch.tensor([[1, 4, 4]]),
                  "mm_token_type_ids": (ids == target.config.image_token_id).long()}
        return Case(target, {"near-copy": draft, "text backbone": text_backbone(draft)}, inputs)
    raise ValueError(f"`name` must be one of {CASES}, but is {name!r}.")


CASES = ("t5", "bart", "whisper", "llava", "qwen2_vl")


@dataclasses.dataclass
class CaseResult:
    """Per draft: whether greedy speculative decoding equals target-only, and the passes of the encoders (vision
    towers) of both models it took."""

    equal: dict[str, bool]
    encoder_passes: dict[str, int]
    target_passes: dict[str, int]  # decoder (language model) passes of the target, for NEW_TOKENS tokens a row


def check_case(name: str, num_assistant_tokens: int = 4) -> CaseResult:
    """Greedy speculative decoding of the case's ragged batch with each draft, against the target's own."""
    case = build_case(name)
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    expected = case.target.generate(**case.inputs, **settings)
    target = speculative(case.target)
    equal, encoder_passes, target_passes = {}, {}, {}
    for draft_name, draft in case.drafts.items():
        encoders = [module for module in (_encoder_of(case.target), _encoder_of(draft)) if module is not None]
        with _Counter(*encoders) as encoder_count, _Counter(_decoder_of(case.target)) as target_count:
            actual = target.generate(**case.inputs, **settings, assistant_model=draft,
                                     num_assistant_tokens=num_assistant_tokens)
        equal[draft_name] = torch.equal(expected, actual)
        encoder_passes[draft_name], target_passes[draft_name] = encoder_count.calls, target_count.calls
    return CaseResult(equal, encoder_passes, target_passes)


def check_transformers_assisted(name: str) -> str:
    """transformers' own assisted generation (``without_speculation``) with the near-copy draft on the case's first
    row (it takes no batches): ``"equal"`` to target-only, ``"differs"``, or the error it raised."""
    case = build_case(name)
    draft = next(iter(case.drafts.values()))
    inputs = {key: value[:1] for key, value in case.inputs.items()}
    for key in ("pixel_values", "image_grid_thw"):  # images are not rows
        if key in case.inputs:
            inputs[key] = case.inputs[key]
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    expected = case.target.generate(**inputs, **settings)
    try:
        actual = case.target.generate(**inputs, **settings, assistant_model=draft)
    except Exception as error:  # noqa: BLE001 - what transformers refuses is the finding
        return f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
    return "equal" if torch.equal(expected, actual) else "differs"


def _encoder_of(model: PreTrainedModel) -> torch.nn.Module | None:
    """What reads the non-text input: an encoder-decoder's encoder, a vision-language model's vision tower."""
    if model.config.is_encoder_decoder:
        return model.get_encoder()
    inner = getattr(model, "model", None)
    return getattr(inner, "vision_tower", None) or getattr(inner, "visual", None)


def _decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    return model.get_decoder() if model.config.is_encoder_decoder else model.model.language_model


class _Counter:
    """Counts the forward calls of some modules while the block runs."""

    def __init__(self, *modules: torch.nn.Module):
        self.modules, self.calls, self.handles = modules, 0, []

    def __enter__(self) -> _Counter:
        self.handles = [module.register_forward_pre_hook(self._count) for module in self.modules]
        return self

    def _count(self, module, args) -> None:
        self.calls += 1

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
