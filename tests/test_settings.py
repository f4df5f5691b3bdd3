"""Every transformers generation setting is honoured, refused by name, or warned about (`hf_spec.settings`)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from helpers import exact_law, sample_speculative
from transformers import GenerationConfig, WatermarkingConfig

from hf_spec import speculative
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, broken_rules, fit_sequences, resample_from_p
from hf_spec.loading.tiny import build_tiny_pair
from hf_spec.rejection import accept_block
from hf_spec.settings import METADATA, REFUSED, SETTINGS, WARNED, settings_table
from hf_spec.sizing.draft_length import AutoDraftLength

PROMPT = torch.tensor([[1, 2, 3, 4]])
DOCS = Path(__file__).parent.parent / "docs" / "generation.md"


def test_the_table_covers_every_generation_setting():
    fields = set(GenerationConfig().to_dict()) | set(GenerationConfig._get_default_generation_params())
    assert fields - set(SETTINGS) == set(), "a transformers setting hf_spec says nothing about"
    assert set(SETTINGS) - fields == set(), "a setting transformers no longer has"


def test_the_docs_print_the_table():
    assert settings_table() in DOCS.read_text()


@pytest.fixture(scope="module")
def pair():
    target, draft = build_tiny_pair(seed=9)
    return speculative(target), draft


REFUSED_VALUES = {
    "guidance_scale": 1.5, "num_beams": 2, "num_beam_groups": 2, "diversity_penalty": 0.5, "penalty_alpha": 0.6,
    "dola_layers": "low", "constraints": ["a"], "force_words_ids": [[1]], "num_return_sequences": 2,
    "output_attentions": True, "output_hidden_states": True, "use_cache": False,
    "cache_implementation": "offloaded", "assistant_ensemble_weight": 0.5,
    "compile_config": "CompileConfig(fullgraph=True)",  # without a static cache; built in the test
    "max_cache_len": "abc",
}
REFUSED_ONCE_THE_CACHE_IS_KNOWN = {"compile_config"}  # a static cache passed as `cache=` makes it fine
WARNED_VALUES = {"prefill_chunk_size": 4, "assistant_lookbehind": 3, "target_lookbehind": 3}


def setting_value(name: str, values: dict):
    if name == "compile_config":
        from transformers import CompileConfig

        return CompileConfig(fullgraph=True)
    return values[name]


def test_every_refused_setting_has_a_refused_value_here():
    refusable = {name for name, treatment in SETTINGS.items()
                 if treatment.kind == REFUSED or (treatment.kind == "honoured" and treatment.problem is not None)}
    assert set(REFUSED_VALUES) == refusable | REFUSED_ONCE_THE_CACHE_IS_KNOWN
    assert set(WARNED_VALUES) == {name for name, treatment in SETTINGS.items() if treatment.kind == WARNED}


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_a_refused_setting_is_an_error_naming_it(pair, name):
    target, draft = pair
    extra = {"num_beams": 2} if name in ("num_beam_groups", "diversity_penalty") else {}
    with pytest.raises(ValueError, match=f"`{name}|supports greedy decoding and sampling only") as error:
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4,
                        **{name: setting_value(name, REFUSED_VALUES), **extra})
    assert name in str(error.value) or "select" in str(error.value)


@pytest.mark.parametrize("name", sorted(WARNED_VALUES))
def test_a_warned_setting_says_what_runs_instead(pair, name, caplog):
    target, draft = pair
    value = setting_value(name, WARNED_VALUES)
    with caplog.at_level(logging.WARNING, logger="hf_spec.settings"):
        output = target.generate(PROMPT, assistant_model=draft, max_new_tokens=6, do_sample=False, **{name: value})
    assert output.shape[1] == PROMPT.shape[1] + 6
    assert f"`{name}`" in caplog.text or "hf_spec.settings" not in caplog.text  # said once per process


def test_transformers_global_defaults_turn_nothing_on(pair):
    """transformers' defaults hold assistant_confidence_threshold = 0.4 and 20 assistant tokens; hf_spec reads only
    what a user set: k = 5, no early stop."""
    target, draft = pair
    output = target.generate(PROMPT, assistant_model=draft, max_new_tokens=30, do_sample=False,
                             return_dict_in_generate=True)
    assert output.speculative_stats.rounds_by_draft_length[5] >= output.speculative_stats.num_rounds - 2


def test_the_heuristic_schedule_grows_and_shrinks_k(pair):
    target, _ = pair
    ks = []
    for schedule in ("heuristic", "heuristic_transient"):
        output = target.generate(PROMPT, assistant_model=target, max_new_tokens=40, do_sample=False,
                                 num_assistant_tokens=2, num_assistant_tokens_schedule=schedule,
                                 return_dict_in_generate=True)
        counts = output.speculative_stats.rounds_by_draft_length
        ks.append([k for k, count in enumerate(counts) if count])
    # the target as its own draft: every round accepted in full, so k goes 2, 4, 6, ... (cut near max_length)
    assert ks[0] == ks[1] and {2, 4, 6} <= set(ks[0])
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        target.generate(PROMPT, assistant_model=target, max_new_tokens=4, num_assistant_tokens_schedule="fast")
    with pytest.raises(ValueError, match="both choose k"):
        target.generate(PROMPT, assistant_model=target, max_new_tokens=4, num_assistant_tokens="auto",
                        num_assistant_tokens_schedule="heuristic")


def test_the_confidence_threshold_stops_drafting_early(pair):
    target, draft = pair
    outputs = [target.generate(PROMPT, assistant_model=draft, max_new_tokens=40, do_sample=False,
                               num_assistant_tokens=8, return_dict_in_generate=True, **extra)
               for extra in ({}, {"assistant_confidence_threshold": 0.99})]
    plain, early = (output.speculative_stats for output in outputs)
    assert early.mean_draft_length < plain.mean_draft_length
    assert torch.equal(outputs[0].sequences, outputs[1].sequences), "greedy output is the target's either way"
    with pytest.raises(ValueError, match="`assistant_confidence_threshold` must be a number in \\[0, 1\\)"):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, assistant_confidence_threshold=1.5)
    with pytest.raises(ValueError, match="shapes a chain of drafts"):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, assistant_confidence_threshold=0.5,
                        num_tree_nodes=4)


@pytest.mark.parametrize("extra", [{"assistant_confidence_threshold": 0.6},
                                   {"num_assistant_tokens_schedule": "heuristic"}], ids=["threshold", "heuristic"])
def test_early_stops_and_schedules_keep_the_target_law(small_target, small_draft, extra):
    samples = sample_speculative(small_target, small_draft, {"top_k": 3}, [], 3, seed=41, **extra)
    assert fit_sequences(samples, exact_law(small_target, {"top_k": 3}, [])).is_consistent


def test_auto_k_learning_from_the_reach_keeps_the_target_law(small_target, small_draft, monkeypatch):
    """``"auto"`` learns each round's acceptance from the reach the rule reports (`hf_spec.rejection`), which
    depends on the drafted tokens: k still depends only on finished rounds. Negative control: a rule that reports the
    reach but resamples a rejection from p is caught on the same path."""
    reaches = []
    learn = AutoDraftLength.update
    monkeypatch.setattr(AutoDraftLength, "update", lambda self, *args, **kwargs: (
        reaches.append(kwargs.get("reach")), learn(self, *args, **kwargs))[1])
    samples = sample_speculative(small_target, small_draft, {"top_k": 3}, [], "auto", seed=43)
    assert fit_sequences(samples, exact_law(small_target, {"top_k": 3}, [])).is_consistent
    assert reaches and all(reach is not None for reach in reaches)

    def resample_reporting_reach(draft_ids, draft_probs, target_probs, generator=None, with_reach=False):
        output_ids, num_accepted = resample_from_p(draft_ids, draft_probs, target_probs, generator)
        reach = accept_block(draft_ids, draft_probs, target_probs, generator, with_reach=True)[2]
        return (output_ids, num_accepted, reach) if with_reach else (output_ids, num_accepted)

    broken = dataclasses.replace(broken_rules(resample_reporting_reach), reports_reach=True)
    reaches.clear()
    samples = sample_speculative(small_target, small_draft, {"top_k": 3}, [], "auto", seed=44, verification=broken)
    assert not fit_sequences(samples, exact_law(small_target, {"top_k": 3}, [])).is_consistent
    assert reaches and all(reach is not None for reach in reaches)


def test_negative_control_an_early_stop_with_a_broken_rule_is_caught(small_target, small_draft, monkeypatch):
    samples = sample_speculative(small_target, small_draft, {"top_k": 3}, [], 3, seed=42,
                                 assistant_confidence_threshold=0.6, verification=RESAMPLE_FROM_P)
    assert not fit_sequences(samples, exact_law(small_target, {"top_k": 3}, [])).is_consistent


def test_settings_in_a_generation_config_are_honoured(pair):
    """`num_tree_nodes` and `num_assistant_tokens` in a GenerationConfig passed to the call, or in the target's."""
    target, draft = pair
    config = GenerationConfig(num_tree_nodes=5, num_assistant_tokens=3, max_new_tokens=12, do_sample=False)
    output = target.generate(PROMPT, assistant_model=draft, generation_config=config, return_dict_in_generate=True)
    counts = output.speculative_stats.rounds_by_draft_length
    assert max(k for k, count in enumerate(counts) if count) == 5, "trees of 5 nodes, not chains of 3"


def test_metadata_fields_are_marked():
    assert SETTINGS["transformers_version"].kind == METADATA


def test_a_watermark_runs_in_the_chain(pair):
    target, draft = pair
    config = WatermarkingConfig(bias=2.0)
    expected = target.generate(PROMPT, max_new_tokens=8, do_sample=False, watermarking_config=config)
    output = target.generate(PROMPT, assistant_model=draft, max_new_tokens=8, do_sample=False,
                             watermarking_config=config)
    assert torch.equal(output, expected)


def test_the_whisper_table_covers_whispers_own_generate_arguments():
    """Every argument Whisper's generate() takes beyond transformers' generic ones (and the inputs, the generic
    hooks and the model kwargs) is in `WHISPER_SETTINGS`, and the docs print the table."""
    import inspect

    from transformers import GenerationMixin
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    from hf_spec.settings import WHISPER_SETTINGS, whisper_settings_table

    own = set(inspect.signature(WhisperGenerationMixin.generate).parameters)
    generic = set(inspect.signature(GenerationMixin.generate).parameters) | {"input_features", "attention_mask",
                                                                            "return_dict_in_generate"}
    assert own - generic - {"self", "kwargs"} == set(WHISPER_SETTINGS)
    assert whisper_settings_table() in (DOCS.parent / "conditioned.md").read_text()


WHISPER_CASES = {
    "return_timestamps": ("short", {"return_timestamps": True}),
    "task, language, is_multilingual": ("short", {"task": "translate", "language": "fr", "is_multilingual": True}),
    "prompt_ids, condition_on_prev_tokens, prompt_condition_type": (
        "long", {"prompt_ids": torch.tensor([7, 8, 9]), "condition_on_prev_tokens": True,
                 "prompt_condition_type": "all-segments", "return_timestamps": True}),
    "temperature fallback, thresholds": ("long", {"temperature": (0.0, 0.4), "compression_ratio_threshold": 1.5,
                                                  "logprob_threshold": -50.0, "no_speech_threshold": 0.6,
                                                  "return_timestamps": True}),
    "num_segment_frames, time precision, segments": ("long", {"num_segment_frames": 32, "time_precision": 0.04,
                                                              "time_precision_features": 0.02,
                                                              "return_segments": True, "return_timestamps": True}),
    "force_unique_generate_call, monitor_progress": ("long", {"force_unique_generate_call": True,
                                                              "monitor_progress": lambda progress: None,
                                                              "return_timestamps": True}),
}


@pytest.mark.parametrize("name", sorted(WHISPER_CASES))
def test_whispers_honoured_arguments_equal_target_only(name):
    """Greedy speculation with each draft equals Whisper's own target-only output (the fallback's thresholds are set
    so that the greedy try stands: its decisions come from the inner calls' scores, which are target-only's)."""
    import copy

    from hf_spec import without_speculation
    from hf_spec.evaluation import conditioned
    from hf_spec.settings import WHISPER_SETTINGS

    case = conditioned.build_case("whisper")
    conditioned.with_whisper_tasks(case.target)
    audio, settings = WHISPER_CASES[name]
    assert set(settings) - {"return_timestamps"} <= {key for key in WHISPER_SETTINGS
                                                     if WHISPER_SETTINGS[key].kind != REFUSED}
    inputs = case.inputs if audio == "short" else {
        "input_features": torch.randn((2, 16, 200), generator=torch.Generator().manual_seed(5)),
        "attention_mask": torch.ones((2, 200), dtype=torch.long)}
    target = speculative(copy.deepcopy(case.target))

    def sequences(output):
        return output if isinstance(output, torch.Tensor) else output["sequences"]

    with without_speculation(target):
        expected = sequences(target.generate(**inputs, **settings, max_new_tokens=10, do_sample=False))
    for draft in case.drafts.values():
        actual = sequences(target.generate(**inputs, **settings, assistant_model=draft, max_new_tokens=10,
                                           do_sample=False))
        assert torch.equal(actual, expected)
