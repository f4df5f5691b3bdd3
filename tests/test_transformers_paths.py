"""The routes a Transformers user takes: `custom_generate` without wrapping, pipelines, pickling, and the
generation-config places transformers reads settings from."""

from __future__ import annotations

import io
import pickle

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, pipeline

import hf_spec
from hf_spec import speculative
from hf_spec.loading.tiny import build_tiny_pair, tiny_tokenizer

PROMPT = torch.tensor([[1, 2, 3, 4]])


def test_custom_generate_runs_hf_spec_on_a_model_never_made_speculative():
    target, draft = build_tiny_pair(seed=5)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=12)
    output = target.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=12,
                             custom_generate=hf_spec.CUSTOM_GENERATE, trust_remote_code=True,
                             return_dict_in_generate=True)
    assert torch.equal(output.sequences, expected)
    assert output.speculative_stats.num_rounds > 0, "hf_spec's loop ran (transformers' has no statistics)"


def test_custom_generate_keeps_the_generator_and_tree_nodes_on_every_call():
    """The first `custom_generate` call makes the model speculative in place; later calls go through both generate()s
    (ours, then transformers' hop to the recipe, then ours again) and must keep hf_spec's own arguments."""
    target, draft = build_tiny_pair(seed=8)
    settings = {"assistant_model": draft, "do_sample": True, "max_new_tokens": 12, "return_dict_in_generate": True,
                "custom_generate": hf_spec.CUSTOM_GENERATE, "trust_remote_code": True}
    for _ in range(2):  # the second call finds the model already speculative
        first = target.generate(PROMPT, generator=torch.Generator().manual_seed(3), **settings)
        torch.manual_seed(0)  # the global generator must not matter
        second = target.generate(PROMPT, generator=torch.Generator().manual_seed(3), **settings)
        assert torch.equal(first.sequences, second.sequences)
        tree = target.generate(PROMPT, num_tree_nodes=7, **{**settings, "do_sample": False})
        assert 7 in tree.speculative_stats.draft_lengths  # trees of 7 nodes, not chains of the default 5


def test_a_pipeline_reaches_hf_spec_with_one_line(tmp_path):
    target, draft = build_tiny_pair(seed=6)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    pipe = pipeline("text-generation", model=str(tmp_path / "target"), assistant_model=str(tmp_path / "draft"))
    speculative(pipe.model)  # the documented one-liner: the pipeline's own model, in place
    text = pipe("def f(x):", max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    ids = tiny_tokenizer()("def f(x):", return_tensors="pt").input_ids
    expected = tiny_tokenizer().decode(reference.generate(ids, do_sample=False, max_new_tokens=8)[0, ids.shape[1]:])
    assert text == expected


def test_a_speculative_model_pickles_and_saves_with_torch():
    target, draft = build_tiny_pair(seed=7)
    model = speculative(target)
    expected = model.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=10)
    for restored in (pickle.loads(pickle.dumps(model)), _torch_round_trip(model)):
        assert isinstance(restored, hf_spec.SpeculativeGenerationMixin)
        assert type(restored).__name__ == type(target).__name__
        output = restored.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=10,
                                   return_dict_in_generate=True)
        assert torch.equal(output.sequences, expected) and output.speculative_stats.num_rounds > 0


def _torch_round_trip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_num_assistant_tokens_is_read_from_every_place_transformers_reads_it():
    """The call, the generation_config passed, the target's generation_config, the draft's, in that order."""
    target, draft = build_tiny_pair(seed=8)
    speculative(target)

    def k_of(**kwargs):
        output = target.generate(PROMPT, assistant_model=draft, max_new_tokens=12, do_sample=False,
                                 return_dict_in_generate=True, **kwargs)
        return max(k for k, count in enumerate(output.speculative_stats.rounds_by_draft_length) if count)

    assert k_of() == 5  # hf_spec's default
    draft.generation_config.num_assistant_tokens = 4
    assert k_of() == 4
    target.generation_config.num_assistant_tokens = 3
    assert k_of() == 3
    assert k_of(generation_config=GenerationConfig(num_assistant_tokens=2, max_new_tokens=12)) == 2
    assert k_of(num_assistant_tokens=1) == 1
