"""Objects a user keeps between calls: an optimized target and a head pickle (also after a head call), compiled
models are freed when dropped, and hf_spec drafts handed to transformers' own generate() say what to do."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.configuration_utils import CompileConfig

from hf_spec import load_pair
from hf_spec.drafting.lookup import PromptLookupDrafter
from hf_spec.heads.eagle3 import Eagle3Head
from hf_spec.heads.model import DraftHead

PROMPT = {"input_ids": torch.tensor([[3, 14, 15, 9, 2, 6]]), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
GREEDY = {"do_sample": False, "max_new_tokens": 10}


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny", "tiny", seed=0)  # optimized: the kernel dispatch hooks are on the target


def _round_trips(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)


def test_an_optimized_target_pickles_before_and_after_a_head_call(pair):
    target = pair.target
    head = Eagle3Head.from_target(target, aux_layers=[0, 1, 2])
    expected = target.generate(**PROMPT, assistant_model=head, **GREEDY)
    for restored in _round_trips(target):  # with the kernel dispatch hooks, and after the head's hidden states
        assert torch.equal(restored.generate(**PROMPT, assistant_model=pickle.loads(pickle.dumps(head)), **GREEDY),
                           expected)
    plain_head = DraftHead.from_target(target)
    target.generate(**PROMPT, assistant_model=plain_head, **GREEDY)
    pickle.dumps(target)
    restored_head = pickle.loads(pickle.dumps(plain_head))
    assert not restored_head.is_attached_to(target)  # the target does not travel with it: attached again on use
    assert torch.equal(target.generate(**PROMPT, assistant_model=restored_head, **GREEDY),
                       target.generate(**PROMPT, assistant_model=plain_head, **GREEDY))
    assert copy.deepcopy(plain_head).is_attached_to(target)  # a deep copy stays attached


def test_hooks_a_model_had_before_a_call_stay(pair):
    target = copy.deepcopy(pair.target)
    target(PROMPT["input_ids"], output_hidden_states=True)  # transformers puts its capturing hooks on now
    hooks = sum(len(module._forward_hooks) for module in target.modules())
    target.generate(**PROMPT, assistant_model=Eagle3Head.from_target(target, aux_layers=[0, 1, 2]), **GREEDY)
    assert sum(len(module._forward_hooks) for module in target.modules()) == hooks
    assert target(PROMPT["input_ids"], output_hidden_states=True).hidden_states is not None


def test_compiled_models_are_freed_when_dropped(pair):
    references = []
    for _ in range(2):
        target, draft = copy.deepcopy(pair.target), copy.deepcopy(pair.draft)
        target.generate(**PROMPT, assistant_model=draft, cache_implementation="static",
                        compile_config=CompileConfig(backend="eager"), **GREEDY)
        references += [weakref.ref(target), weakref.ref(draft)]
        del target, draft
    gc.collect()
    assert [reference() for reference in references] == [None] * 4


@pytest.mark.parametrize("kind", ["draft head", "eagle3 head", "drafter"])
def test_a_model_not_made_speculative_says_how_to_run_an_hf_spec_draft(pair, kind):
    plain = AutoModelForCausalLM.from_config(pair.target.config)
    draft = {"draft head": lambda: DraftHead.from_target(plain),
             "eagle3 head": lambda: Eagle3Head.from_target(plain, aux_layers=[0, 1, 2]),
             "drafter": PromptLookupDrafter}[kind]()
    with pytest.raises(AttributeError, match=r"an hf_spec draft.*hf_spec.speculative\(model\).*custom_generate="):
        plain.generate(**PROMPT, assistant_model=draft, **GREEDY)
