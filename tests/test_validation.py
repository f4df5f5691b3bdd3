"""Each check runs once per call: every rule of `hf_spec.validation`, counted through calls of every kind.

A call is checked in two stages (`hf_spec.validation.check_call`): its arguments before transformers prepares it,
then what transformers prepared, before the first forward pass. These tests count every rule, and the validators the
rules call, on calls of each kind hf_spec runs (chains and trees, greedy and sampled, batches, prompt lookup, auto
sizes, static caches, an encoder-decoder, the ``custom_generate`` recipe); each must run exactly once.
"""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import PAD, PROMPTS, left_padded, make_noisy_copy, make_tiny_model

import hf_spec
import hf_spec.validation as validation
from hf_spec import speculative
from hf_spec.evaluation import conditioned

#: The validators the rules call, by name, counted beside the rules themselves.
VALIDATORS = ("validate_input_types", "validate_input_values", "check_settings", "refuse_unsupported_family",
              "refuse_tree_without_positions", "check_processors", "check_cache_rows", "check_tree_size")


@pytest.fixture
def counts(monkeypatch) -> collections.Counter:
    """Every rule and validator of `hf_spec.validation`, counted per name."""
    counter = collections.Counter()

    def counted(name, function):
        def wrapper(*args, **kwargs):
            counter[name] += 1
            return function(*args, **kwargs)
        return wrapper

    for stage in ("ARGUMENT_RULES", "PREPARED_RULES"):
        monkeypatch.setattr(validation, stage, tuple(counted(rule.__name__, rule)
                                                     for rule in getattr(validation, stage)))
    for name in VALIDATORS:
        monkeypatch.setattr(validation, name, counted(name, getattr(validation, name)))
    return counter


@pytest.fixture(scope="module")
def pair():
    target = speculative(make_tiny_model(seed=0))
    return target, make_noisy_copy(target, seed=4, noise=0.3)


def calls(target, draft) -> dict:
    input_ids, attention_mask = left_padded(PROMPTS)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "pad_token_id": PAD, "max_new_tokens": 6}
    one = {"input_ids": torch.tensor([[1, 2, 3, 1, 2]]), "max_new_tokens": 6}
    return {
        "greedy batch": {**batch, "assistant_model": draft},
        "sampled batch, auto k": {**batch, "assistant_model": draft, "do_sample": True, "num_assistant_tokens": "auto",
                                  "generator": torch.Generator().manual_seed(0)},
        "tree": {**one, "assistant_model": draft, "num_tree_nodes": 4, "do_sample": True, "verification": "token"},
        "prompt lookup": {**batch, "prompt_lookup_num_tokens": 3},
        "static cache": {**one, "assistant_model": draft, "cache_implementation": "static"},
        "custom_generate recipe": {**one, "assistant_model": draft, "custom_generate": hf_spec.CUSTOM_GENERATE,
                                   "trust_remote_code": True},
    }


CALLS = list(calls(None, None))
RULES = {rule.__name__ for rule in (*validation.ARGUMENT_RULES, *validation.PREPARED_RULES)}


@pytest.mark.parametrize("case", CALLS)
def test_every_rule_runs_once_per_call(pair, counts, case):
    target, draft = pair
    target.generate(**calls(target, draft)[case])
    twice = {name: count for name, count in counts.items() if count != 1}
    assert not twice and RULES <= set(counts), (twice, RULES - set(counts))
    assert counts["validate_input_types"] == counts["validate_input_values"] == counts["check_settings"] == 1


def test_every_rule_runs_once_for_an_encoder_decoder(counts):
    case = conditioned.build_case("t5")
    speculative(case.target).generate(**case.inputs, assistant_model=next(iter(case.drafts.values())),
                                      max_new_tokens=4, do_sample=False)
    assert not {name: count for name, count in counts.items() if count != 1} and RULES <= set(counts), counts


def test_the_count_catches_a_rule_run_twice(pair, counts, monkeypatch):
    """Negative control: the old shape, where the argument rules ran again while transformers validated the mode."""
    target, draft = pair
    validate_mode = type(target)._validate_generation_mode

    def checked_again(self, mode, config, mode_kwargs):
        validation.check_call(hf_spec.mixin._current_call().facts, "arguments")
        return validate_mode(self, mode, config, mode_kwargs)

    monkeypatch.setattr(type(target), "_validate_generation_mode", checked_again)
    target.generate(**calls(target, draft)["greedy batch"])
    assert counts["check_family"] == 2 and counts["validate_input_types"] == 2


def test_a_call_refused_by_an_argument_rule_prepares_nothing(pair, counts):
    """Refused before transformers prepares the call: no prepared rule ran (no cache was made, no pass ran)."""
    target, draft = pair
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=draft, num_assistant_tokens=0, max_new_tokens=4)
    assert counts["check_sizes"] == 1 and not {rule.__name__ for rule in validation.PREPARED_RULES} & set(counts)
