"""The device check's Whisper section (`scripts/device_check.py`): Whisper large-v3 drafted by a distil-large-v3-shaped
assistant (a 2-layer decoder, `WhisperForCausalLM`, reading the target's encoder outputs), bf16 on the device.

Random weights of the real shapes give real costs (the encoder pass over 30 seconds of audio, a decoder step with its
cross-attention over 1500 encoder positions, the assistant's step) and check greedy equality with target-only
decoding in a batch of two clips with one encoder pass, but no meaningful acceptance: the assistant is the target's
first and last decoder layers (distil-whisper's initialization) without its training. Folders holding real weights,
``HF_SPEC_WHISPER_TARGET`` and ``HF_SPEC_WHISPER_ASSISTANT`` (``save_pretrained`` folders of
``openai/whisper-large-v3`` and ``distil-whisper/distil-large-v3``; nothing is downloaded), replace them where set;
the features stay random (no audio on the device machine), so the transcripts are not speech.
"""

from __future__ import annotations

import copy
import os
import time

import torch
from transformers import WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

import hf_spec.mixin
from hf_spec import speculative
from hf_spec.caches import crop_to
from hf_spec.decoding import speculative_decode
from hf_spec.timing.probe import synchronize

LARGE_V3 = {"d_model": 1280, "encoder_layers": 32, "decoder_layers": 32, "encoder_attention_heads": 20,
            "decoder_attention_heads": 20, "encoder_ffn_dim": 5120, "decoder_ffn_dim": 5120, "vocab_size": 51866,
            "num_mel_bins": 128, "max_source_positions": 1500, "max_target_positions": 448}
TINY = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 256,
        "num_mel_bins": 16, "max_source_positions": 32, "max_target_positions": 128}


def whisper_pair(device: torch.device, quick: bool) -> tuple[WhisperForConditionalGeneration, WhisperForCausalLM, str]:
    """``(target, assistant, what they are)``: real weights from the folders named, else random ones."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    folders = os.environ.get("HF_SPEC_WHISPER_TARGET"), os.environ.get("HF_SPEC_WHISPER_ASSISTANT")
    if all(folders) and not quick:
        target = WhisperForConditionalGeneration.from_pretrained(folders[0], dtype=dtype).to(device).eval()
        assistant = WhisperForCausalLM.from_pretrained(folders[1], dtype=dtype).to(device).eval()
        return target, assistant, f"real weights: {folders[0]}, {folders[1]}"
    config = WhisperConfig(**(TINY if quick else LARGE_V3), decoder_start_token_id=1, pad_token_id=0, eos_token_id=2,
                           bos_token_id=1, suppress_tokens=None, begin_suppress_tokens=None, init_std=0.5)
    with torch.device(device), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        target = WhisperForConditionalGeneration(config).to(dtype).eval()
        assistant_config = copy.deepcopy(config)
        assistant_config.decoder_layers = 2
        assistant = WhisperForCausalLM(assistant_config).to(dtype).eval()
    decoder, layers = target.model.decoder, target.model.decoder.layers
    assistant.model.decoder.embed_tokens.load_state_dict(decoder.embed_tokens.state_dict())
    assistant.model.decoder.embed_positions.load_state_dict(decoder.embed_positions.state_dict())
    assistant.model.decoder.layer_norm.load_state_dict(decoder.layer_norm.state_dict())
    for index, source in enumerate((layers[0], layers[-1])):
        assistant.model.decoder.layers[index].load_state_dict(source.state_dict())
    assistant.proj_out.weight = assistant.model.decoder.embed_tokens.weight
    target.generation_config.eos_token_id = None
    return target, assistant, "random weights of the real shapes (distil-whisper's initialization of the assistant)"


def timed(function) -> tuple[float, object]:
    synchronize(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    started = time.perf_counter()
    result = function()
    synchronize(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    return time.perf_counter() - started, result


@torch.no_grad()
def whisper_check(device: torch.device, quick: bool) -> dict:
    """Costs, greedy equality (batch 2, encoder passes counted) and tokens/s of target-only and speculative
    decoding (k = 5 and auto), each on its second call."""
    target, assistant, weights = whisper_pair(device, quick)
    frames = 2 * target.config.max_source_positions
    features = torch.randn((2, target.config.num_mel_bins, frames), generator=torch.Generator().manual_seed(0))
    features = features.to(device, target.dtype)
    new_tokens = 16 if quick else 96
    settings = {"max_new_tokens": new_tokens, "do_sample": False}
    encoder_seconds, encoded = timed(lambda: target.get_encoder()(features[:1]))
    encoder_seconds, encoded = timed(lambda: target.get_encoder()(features[:1]))
    report = {"weights": weights, "encoder_seconds": encoder_seconds, "new_tokens": new_tokens}
    start = torch.tensor([[1]], device=device)
    for name, model, extra in (("target_step_seconds", target, {"encoder_outputs": encoded}),
                               ("assistant_step_seconds", assistant, {"encoder_outputs": encoded})):
        key = "decoder_input_ids" if name.startswith("target") else "input_ids"
        cache = model(**{key: start}, **extra, use_cache=True).cache
        seconds = []
        for _ in range(5):
            seconds.append(timed(lambda: model(**{key: start}, **extra, cache=cache, use_cache=True))[0])
            crop_to(cache, 1)
        report[name] = min(seconds)
    report["cost_ratio"] = report["assistant_step_seconds"] / report["target_step_seconds"]
    expected = target.generate(input_features=features, **settings)
    calls = []
    hook = target.get_encoder().register_forward_pre_hook(lambda *_: calls.append(1))
    speculative_target = speculative(target)
    try:
        actual = speculative_target.generate(input_features=features, assistant_model=assistant, **settings)
    finally:
        hook.remove()
    report["identical"], report["encoder_passes"] = bool(torch.equal(expected, actual)), len(calls)
    runs = {"target-only": {}, "k = 5": {"assistant_model": assistant, "num_assistant_tokens": 5},
            "auto": {"assistant_model": assistant, "num_assistant_tokens": "auto"}}
    results = []  # Whisper's generate() keeps only the sequences: the loop's own results give the statistics

    def recorded(*args, **kwargs):
        results.append(speculative_decode(*args, **kwargs))
        return results[-1]

    hf_spec.mixin.speculative_decode = recorded
    try:
        for name, extra in runs.items():
            for _ in range(2):  # the second call is timed
                results.clear()
                seconds, _ = timed(lambda: speculative_target.generate(input_features=features[:1], **settings,
                                                                       **extra))
            report[name] = {"tokens_per_second": new_tokens / seconds,
                            "acceptance": results[0].stats.acceptance_rate if results else None}
    finally:
        hf_spec.mixin.speculative_decode = speculative_decode
    return report


def whisper_summary(report: dict | None) -> list[str]:
    if not report:
        return []
    lines = ["", "## Whisper large-v3 with a distil-large-v3-shaped assistant (greedy, bf16)", "",
             f"{report['weights']}. Encoder pass (30 s): {report['encoder_seconds'] * 1e3:.1f} ms; target decoder "
             f"step {report['target_step_seconds'] * 1e3:.2f} ms, assistant step "
             f"{report['assistant_step_seconds'] * 1e3:.2f} ms (c = {report['cost_ratio']:.3f}); batch of 2 "
             f"identical to target-only: {report['identical']}, encoder passes: {report['encoder_passes']}.", "",
             "| method | tok/s | acceptance |", "|---|---|---|"]
    for name in ("target-only", "k = 5", "auto"):
        run = report[name]
        acceptance = "-" if run["acceptance"] is None else f"{run['acceptance']:.2f}"
        lines.append(f"| {name} | {run['tokens_per_second']:.1f} | {acceptance} |")
    return lines
