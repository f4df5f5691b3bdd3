"""Encoder-decoder and vision-language targets: T5, BART, Whisper (with distil-whisper's kind of assistant) and LLaVA.

Greedy equality with the target's own ``generate()`` in ragged batches, with drafts that are accepted (a near-copy),
the encoder run once per model (once in all with a shared encoder), the sampled law of each kind with a negative
control, and what is refused by name.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import CompileConfig

import hf_spec.forward
import hf_spec.mixin
from hf_spec import speculative
from hf_spec.conditioning import holds_same_encoder, split_model_kwargs, with_position_axes
from hf_spec.decoding import speculative_decode
from hf_spec.evaluation import conditioned
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, exact_law, fit_sequences
from hf_spec.evaluation.zoo import near_copy

NUM_TOKENS, NUM_SAMPLES, GROUP = 3, 1500, 3
#: The sampling cases' weights: laws spread over many sequences, drafts accepted about half the time.
T5_SCALE, WHISPER_SCALE, NOISE = 1.0, 0.05, {"t5": 0.3, "whisper": 1.0, "llava": 1.0}


@pytest.mark.parametrize("name", conditioned.CASES)
def test_greedy_equals_target_only_in_a_ragged_batch(name):
    result = conditioned.check_case(name)
    assert all(result.equal.values()), result
    # drafts were accepted: fewer target passes than tokens (a row generates NEW_TOKENS, the prefill counts one)
    assert min(result.target_passes.values()) < conditioned.NEW_TOKENS - 4, result
    if name == "whisper":  # both drafts read the target's encoder outputs: one encoder pass per call
        assert result.encoder_passes == {"decoder-only assistant": 1, "same encoder": 1}, result
    if name in ("t5", "bart"):  # the near-copy's own encoder runs once too
        assert result.encoder_passes == {"near-copy": 2}, result
    if name in ("llava", "qwen2_vl"):  # the images go into each model's prompt pass only; a text-only draft reads none
        assert result.encoder_passes == {"near-copy": 2, "text backbone": 1}, result


def test_a_draft_with_another_encoder_runs_it_once():
    case = conditioned.build_case("whisper")
    draft = near_copy(case.target, noise=0.003)  # encoder weights differ: it must read its own encoder's outputs
    counts = []
    hooks = [module.register_forward_pre_hook(lambda *_, name=name: counts.append(name))
             for name, module in (("target", case.target.get_encoder()), ("draft", draft.get_encoder()))]
    try:
        expected = case.target.generate(**case.inputs, max_new_tokens=12, do_sample=False)
        counts.clear()
        actual = speculative(case.target).generate(**case.inputs, assistant_model=draft, max_new_tokens=12,
                                                   do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(expected, actual)
    assert sorted(counts) == ["draft", "target"]


def test_a_shared_encoder_is_found_again_after_its_weights_change():
    case = conditioned.build_case("whisper")
    draft = case.drafts["same encoder"]
    assert holds_same_encoder(draft, case.target) and holds_same_encoder(draft, case.target)  # remembered
    with torch.no_grad():
        draft.get_encoder().layers[0].fc1.weight.add_(1e-3)  # an in-place update: the remembered answer is stale
    assert not holds_same_encoder(draft, case.target)


def test_prompt_lookup_and_auto_k_on_a_decoder():
    case = conditioned.build_case("t5")
    expected = case.target.generate(**case.inputs, max_new_tokens=20, do_sample=False)
    target = speculative(case.target)
    assert torch.equal(target.generate(**case.inputs, prompt_lookup_num_tokens=3, max_new_tokens=20,
                                       do_sample=False), expected)
    assert torch.equal(target.generate(**case.inputs, assistant_model=case.drafts["near-copy"],
                                       num_assistant_tokens="auto", max_new_tokens=20, do_sample=False), expected)


def _sampling_case(name: str):
    """A vocabulary-4 target (LLaVA: 5, its image placeholder suppressed), a near-copy draft of the same class
    (accepted about half the time), its settings, the inputs of one row, and the decoder prompt."""
    settings = {"temperature": 0.8, "top_k": 3}
    if name == "t5":
        target = conditioned.t5(vocab_size=4, scale=T5_SCALE)
        row, prompt = {"input_ids": torch.tensor([[3, 2, 1, 3, 2]])}, torch.tensor([[0]])
    elif name == "whisper":
        target = conditioned.whisper(vocab_size=4, scale=WHISPER_SCALE)
        row = {"input_features": torch.randn((1, 16, 64), generator=torch.Generator().manual_seed(3))}
        prompt = torch.tensor([[1]])
        settings = {**settings, "suppress_tokens": [0]}  # Whisper's generate() cuts trailing padding (id 0) off
    else:
        target = conditioned.llava(vocab_size=5)
        prompt = torch.tensor([[1, *[4] * conditioned.IMAGE_TOKENS, 2, 3]])
        row = {"pixel_values": torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(3))}
        settings = {**settings, "suppress_tokens": [4]}
    return target, near_copy(target, noise=NOISE[name], seed=5), settings, row, prompt


def _sample(name: str, num_calls: int, seed: int, **extra) -> tuple[np.ndarray, list]:
    """``[num_calls * GROUP, NUM_TOKENS]`` speculative samples, ``GROUP`` rows a call (T5 places tokens by cache
    position: in a batch every row keeps as many drafts as the row that accepted fewest, so small batches keep its
    rejections frequent), and each call's statistics (``None`` from Whisper's generate())."""
    target, draft, settings, row, prompt = _sampling_case(name)
    inputs = {key: value.expand(GROUP, *value.shape[1:]) for key, value in row.items()}
    if name == "llava":
        inputs["input_ids"] = prompt.expand(GROUP, -1)
    generator, samples, stats = torch.Generator().manual_seed(seed), [], []
    target = speculative(target)
    for _ in range(num_calls):
        output = target.generate(**inputs, assistant_model=draft, do_sample=True, num_assistant_tokens=2,
                                 max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, generator=generator,
                                 pad_token_id=0, return_dict_in_generate=True, **settings, **extra)
        samples.append(output.sequences[:, -NUM_TOKENS:].numpy())
        stats.append(output.speculative_stats)
    return np.concatenate(samples), stats


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "negative control"])
@pytest.mark.parametrize("name", ["t5", "whisper", "llava"])
def test_sampling_follows_the_target_law(name, broken, monkeypatch):
    target, _, settings, row, prompt = _sampling_case(name)
    exact = exact_law(target, {**settings, "min_new_tokens": NUM_TOKENS}, prompt, NUM_TOKENS, model_inputs=row)
    samples, _ = _sample(name, NUM_SAMPLES // GROUP, seed=11, **({"verification": RESAMPLE_FROM_P} if broken else {}))
    fit = fit_sequences(samples, exact)
    assert fit.is_consistent != broken, fit


@pytest.mark.parametrize("name", ["t5", "llava"])
def test_the_sampling_drafts_are_accepted_and_rejected(name):
    """The statistical cases test both outcomes of the rule: their drafts are accepted neither always nor never
    (Whisper's generate() keeps no statistics; its case is built the same way)."""
    _, stats = _sample(name, 30, seed=1)
    rate = sum(s.num_accepted for s in stats) / sum(s.num_draft_tokens for s in stats)
    assert 0.2 < rate < 0.9, rate


def test_a_prompt_ending_in_an_image_placeholder_is_refused():
    case = conditioned.build_case("llava")
    inputs = dict(case.inputs)
    inputs["input_ids"] = inputs["input_ids"].clone()
    inputs["input_ids"][0, -conditioned.IMAGE_TOKENS:] = conditioned.IMAGE_TOKEN_ID
    inputs["input_ids"][0, 5: 5 + conditioned.IMAGE_TOKENS] = 7
    with pytest.raises(ValueError, match="ends in an image placeholder"):
        speculative(case.target).generate(**inputs, assistant_model=case.drafts["near-copy"], max_new_tokens=4)


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "negative control"])
def test_multi_axis_positions_follow_each_row(broken, monkeypatch):
    """Qwen2-VL's rotary positions: after an image, three axes run behind the text position by the row's offset (-2
    for row 0's image of 4 placeholders on a 2 x 2 grid). The target's logits at every token equal target-only
    decoding's; with the offsets dropped (the negative control) they do not (greedy choices of the tiny model happen
    to survive that, so the logits are compared)."""
    if broken:
        monkeypatch.setattr(hf_spec.forward, "with_position_axes",
                            lambda positions, offsets: with_position_axes(positions, None if offsets is None
                                                                          else torch.zeros_like(offsets)))
    case = conditioned.build_case("qwen2_vl")
    settings = {"max_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    expected = case.target.generate(**case.inputs, **settings)
    actual = speculative(case.target).generate(**case.inputs, assistant_model=case.drafts["near-copy"], **settings)
    difference = max(float((a - b).abs().max()) for a, b in zip(expected.logits, actual.logits, strict=True))
    assert (difference < 1e-4) != broken, difference


def test_a_vision_language_draft_of_another_family_is_refused():
    case = conditioned.build_case("qwen2_vl")
    with pytest.raises(ValueError, match="vision-language model of another family"):
        speculative(case.target).generate(**case.inputs, assistant_model=conditioned.llava(), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"3-axis positions"):
        split_model_kwargs(conditioned.t5(), {"position_ids": torch.zeros((3, 2, 5), dtype=torch.long)}, None)


def test_what_the_loop_cannot_pass_on_is_refused():
    case = conditioned.build_case("t5")
    with pytest.raises(ValueError, match=r"Model inputs \['head_mask'\]"):
        split_model_kwargs(case.target, {"head_mask": torch.ones(2)}, None)
    target = speculative(case.target)
    with pytest.raises(ValueError, match="`compile_config` with an encoder-decoder"):
        target.generate(**case.inputs, assistant_model=case.drafts["near-copy"], cache_implementation="static",
                        compile_config=CompileConfig(), max_new_tokens=4)
    single = {key: value[:1] for key, value in case.inputs.items()}
    with pytest.raises(ValueError, match="`num_tree_nodes`.*`model` \\(T5ForConditionalGeneration\\)"):
        target.generate(**single, assistant_model=case.drafts["near-copy"], num_tree_nodes=4, max_new_tokens=4)
    whisper = conditioned.build_case("whisper")
    single = {key: value[:1] for key, value in whisper.inputs.items()}
    with pytest.raises(ValueError, match="`num_tree_nodes`.*`assistant_model` \\(WhisperForCausalLM\\)"):
        speculative(whisper.target).generate(**single, assistant_model=whisper.drafts["decoder-only assistant"],
                                             num_tree_nodes=4, max_new_tokens=4)


def test_whisper_output_dict_and_a_tree_of_drafts():
    """Whisper's generate() splits the inner call's output by row (the statistics too); a tree's nodes take
    Whisper's decoder positions."""
    case = conditioned.build_case("whisper")
    draft = case.drafts["same encoder"]  # a tree needs positions: distil-whisper's decoder alone takes none
    expected = case.target.generate(**case.inputs, max_new_tokens=12, do_sample=False)
    target = speculative(case.target)
    output = target.generate(**case.inputs, assistant_model=draft, max_new_tokens=12, do_sample=False,
                             return_dict_in_generate=True)
    assert torch.equal(output.sequences[:, -12:], expected[:, -12:])
    single = {key: value[:1] for key, value in case.inputs.items()}
    assert torch.equal(target.generate(**single, assistant_model=draft, num_tree_nodes=6, max_new_tokens=12,
                                       do_sample=False), expected[:1])


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_static_caches_of_encoder_decoders(name):
    """``cache_implementation="static"``: the decoder's static cache is rolled back by its write position; the
    cross-attention cache beside it only follows rows."""
    case = conditioned.build_case(name)
    expected = case.target.generate(**case.inputs, max_new_tokens=16, do_sample=False)
    target = speculative(case.target)
    for draft in case.drafts.values():
        assert torch.equal(target.generate(**case.inputs, assistant_model=draft, cache_implementation="static",
                                           max_new_tokens=16, do_sample=False), expected)


@pytest.mark.parametrize("setting", ["timestamps", "language and task", "prompt ids", "long-form audio"])
def test_whisper_settings_equal_target_only(setting):
    """Whisper's own generate() around the loop: timestamp processing, language and task tokens, a text prompt, and
    long-form audio (chunked by Whisper's generate(), one inner call per 30-second window: here 64 frames)."""
    case = conditioned.build_case("whisper")
    conditioned.with_whisper_tasks(case.target)
    features = case.inputs["input_features"]
    inputs = {
        "timestamps": {"input_features": features, "return_timestamps": True},
        "language and task": {"input_features": features, "language": "fr", "task": "translate"},
        "prompt ids": {"input_features": features, "prompt_ids": torch.tensor([7, 8, 9])},
        "long-form audio": {"input_features": torch.randn((2, 16, 200), generator=torch.Generator().manual_seed(5)),
                            "attention_mask": torch.ones((2, 200), dtype=torch.long), "return_timestamps": True},
    }[setting]
    expected = case.target.generate(**inputs, max_new_tokens=12, do_sample=False)
    target = speculative(copy.deepcopy(case.target))
    for draft in case.drafts.values():
        assert torch.equal(target.generate(**inputs, assistant_model=draft, max_new_tokens=12, do_sample=False),
                           expected)


def test_the_speech_recognition_pipeline_passes_the_assistant_on(monkeypatch):
    """``pipeline("automatic-speech-recognition", generate_kwargs={"assistant_model": ...})`` reaches the loop (with
    ``num_beams=1``: the pipeline's default for Whisper is beam search, which no assisted generation runs)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import WhisperFeatureExtractor, WhisperTokenizerFast, pipeline

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(conditioned.VOCAB_SIZE)}, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = WhisperTokenizerFast(tokenizer_object=words, unk_token="t3", bos_token="t1", eos_token="t2",
                                     pad_token="t0")
    case = conditioned.build_case("whisper")
    conditioned.with_whisper_tasks(case.target).generation_config.is_multilingual = False
    recognizer = pipeline("automatic-speech-recognition", model=case.target, tokenizer=tokenizer, device="cpu",
                          feature_extractor=WhisperFeatureExtractor(feature_size=16, chunk_length=1))
    audio = np.random.default_rng(0).standard_normal(8000).astype(np.float32) * 0.1  # half a second at 16 kHz
    sequences, runs = [], []
    plain_generate = type(case.target).generate

    def recording(model, *args, **kwargs):  # what the pipeline's generate() call returns
        sequences.append(plain_generate(model, *args, **kwargs))
        return sequences[-1]

    with monkeypatch.context() as patch:
        patch.setattr(type(case.target), "generate", recording)
        recognizer(audio, generate_kwargs={"max_new_tokens": 10, "num_beams": 1})
    plain_generate = type(speculative(case.target)).generate  # hf_spec's, on the speculative subclass
    monkeypatch.setattr(type(case.target), "generate", recording)
    monkeypatch.setattr(hf_spec.mixin, "speculative_decode",
                        lambda *args, **kwargs: runs.append(1) or speculative_decode(*args, **kwargs))
    draft = case.drafts["decoder-only assistant"]
    recognizer(audio, generate_kwargs={"max_new_tokens": 10, "num_beams": 1, "assistant_model": draft})
    assert len(runs) == 2  # hf_spec's loop ran, once per window (100 frames: two of the tiny model's 64)
    assert torch.equal(sequences[0], sequences[1]) and sequences[0].shape[1] >= 10


def test_conditioning_follows_finished_rows():
    """A row that stops early leaves the batch: the encoder's outputs and mask of the others stay with them."""
    case = conditioned.build_case("t5")
    target = case.target
    expected = target.generate(**case.inputs, max_new_tokens=16, do_sample=False)
    stop_id = int(expected[1, 5])  # row 1 ends early on this token (row 0 too if it generates it)
    config = copy.deepcopy(target.generation_config)
    config.eos_token_id = stop_id
    expected = target.generate(**case.inputs, generation_config=config, max_new_tokens=16, do_sample=False)
    actual = speculative(target).generate(**case.inputs, generation_config=config,
                                          assistant_model=case.drafts["near-copy"], max_new_tokens=16,
                                          do_sample=False)
    assert torch.equal(actual, expected)
    assert np.any(expected.numpy() == stop_id)
