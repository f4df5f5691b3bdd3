"""Public API: `speculative()`, argument precedence, reproducibility, statistics, vocabularies, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import letters_tokenizer, make_tiny_model
from transformers import DynamicCache, GenerationConfig, StaticCache
from transformers.generation.streamers import BaseStreamer

from hf_spec import SpeculativeGenerationMixin, speculative
from hf_spec.evaluation.exactness import broken_rules
from hf_spec.rejection import accept_block

PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


def test_speculative_is_idempotent_keeps_weights_and_class_name():
    model = make_tiny_model(seed=5)
    weights = {name: p.clone() for name, p in model.named_parameters()}
    class_name = type(model).__name__
    same = speculative(speculative(model))
    assert same is model and isinstance(model, SpeculativeGenerationMixin)
    assert type(model).__name__ == class_name
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())


def test_other_generation_modes_behave_exactly_as_before(target):
    plain = make_tiny_model(seed=0)  # same weights as the `target` fixture, not made speculative
    for kwargs in ({"do_sample": False}, {"num_beams": 3, "do_sample": False}, {"prompt_lookup_num_tokens": 2}):
        assert torch.equal(target.generate(PROMPT, max_new_tokens=12, **kwargs),
                           plain.generate(PROMPT, max_new_tokens=12, **kwargs))
    torch.manual_seed(0)
    ours = target.generate(PROMPT, max_new_tokens=12, do_sample=True)
    torch.manual_seed(0)
    assert torch.equal(ours, plain.generate(PROMPT, max_new_tokens=12, do_sample=True))


def test_seed_and_generator_reproduce_the_output(target, close_draft):
    def run(**kwargs):
        return target.generate(PROMPT, assistant_model=close_draft, do_sample=True, max_new_tokens=40, **kwargs)

    torch.manual_seed(123)
    first = run()
    torch.manual_seed(123)
    assert torch.equal(first, run())
    with_generator = run(generator=torch.Generator().manual_seed(7))
    assert torch.equal(with_generator, run(generator=torch.Generator().manual_seed(7)))


def test_num_assistant_tokens_from_the_call_wins_over_the_draft_config(target):
    draft = make_tiny_model(seed=0)
    draft.generation_config.num_assistant_tokens = 2

    def proposed_per_round(**kwargs):
        stats = target.generate(
            PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=30, return_dict_in_generate=True, **kwargs
        ).speculative_stats
        return len(stats.proposed_by_position)

    assert proposed_per_round() == 2
    assert proposed_per_round(num_assistant_tokens=4) == 4
    assert proposed_per_round(generation_config=GenerationConfig(num_assistant_tokens=3, max_new_tokens=30)) == 3


def test_stats_add_up(target, close_draft):
    output = target.generate(
        PROMPT, assistant_model=close_draft, do_sample=True, max_new_tokens=50, num_assistant_tokens=3,
        return_dict_in_generate=True,
    )
    stats = output.speculative_stats
    assert stats.num_emitted == output.sequences.shape[1] - PROMPT.shape[1] == 50
    assert stats.num_draft_tokens == sum(stats.proposed_by_position)
    assert stats.num_accepted == sum(stats.accepted_by_position)
    assert stats.acceptance_rate == stats.num_accepted / stats.num_draft_tokens
    assert stats.tokens_per_round == 50 / stats.num_rounds
    # Every round emits its accepted tokens plus one, except where the budget cut the last block.
    assert stats.num_emitted <= stats.num_accepted + stats.num_rounds
    assert stats.draft_seconds > 0 and stats.verify_seconds > 0
    assert set(stats.to_dict()) >= {"num_rounds", "acceptance_rate", "tokens_per_round", "accepted_by_position"}


def test_expected_accepted_is_the_count_when_greedy_and_the_reach_when_sampled(target, close_draft):
    kwargs = {"assistant_model": close_draft, "max_new_tokens": 40, "num_assistant_tokens": 4,
              "return_dict_in_generate": True}
    greedy = target.generate(PROMPT, do_sample=False, **kwargs).speculative_stats
    assert greedy.expected_accepted == greedy.num_accepted
    sampled = target.generate(PROMPT.repeat(2, 1), do_sample=True, pad_token_id=0, **kwargs).speculative_stats
    assert 0.0 < sampled.expected_accepted < sampled.num_draft_tokens
    assert sampled.expected_accepted == pytest.approx(sum(row.expected_accepted for row in sampled.rows))
    assert "expected_accepted" in sampled.to_dict()


def _luck(target, draft, calls: int, **kwargs) -> tuple[float, float]:
    """Mean and standard error, over ``calls`` sampled calls, of accepted minus expected per call."""
    luck = []
    for seed in range(calls):
        torch.manual_seed(seed)
        stats = target.generate(PROMPT, assistant_model=draft, do_sample=True, max_new_tokens=40,
                                num_assistant_tokens=4, return_dict_in_generate=True, **kwargs).speculative_stats
        luck.append(stats.num_accepted - stats.expected_accepted)
    values = torch.tensor(luck, dtype=torch.float64)
    return values.mean().item(), values.std().item() / calls ** 0.5


@pytest.mark.parametrize("verification", ["block", "token"])
def test_the_luck_in_the_rules_draws_has_mean_zero(target, close_draft, verification):
    """``num_accepted - expected_accepted`` (what `hf-spec bench` reports to take the draws' luck out of a sampled
    speed) averages 0 over calls. Negative control: a rule that keeps every draft while reporting the reach."""
    mean, error = _luck(target, close_draft, 120, verification=verification)
    assert abs(mean) < 4 * error + 1e-9

    def keep_all_reporting_reach(draft_ids, draft_probs, target_probs, generator=None, with_reach=False):
        reach = accept_block(draft_ids, draft_probs, target_probs, generator, with_reach=True)[2]
        output_ids = torch.cat([draft_ids, target_probs[:, -1].argmax(dim=-1, keepdim=True)], dim=1)  # all, a bonus
        num_accepted = torch.full((draft_ids.shape[0],), draft_ids.shape[1], dtype=torch.long)
        return (output_ids, num_accepted, reach) if with_reach else (output_ids, num_accepted)

    broken = dataclasses.replace(broken_rules(keep_all_reporting_reach), reports_reach=True)
    mean, error = _luck(target, close_draft, 30, verification=broken)
    assert mean > 4 * error


@pytest.mark.parametrize("draft_vocab", [12, 16, 20])
def test_draft_with_other_embedding_row_count_works_and_never_emits_unknown_ids(draft_vocab):
    target = speculative(make_tiny_model(seed=0, vocab_size=16))
    draft = make_tiny_model(seed=0, vocab_size=draft_vocab)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=30)
    assert torch.equal(target.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=30), expected)
    sampled = target.generate(PROMPT, assistant_model=draft, do_sample=True, max_new_tokens=200)
    assert sampled.max().item() < 16


def test_same_tokenizer_passed_twice_is_a_same_tokenizer_draft_and_another_vocabulary_is_translated(
        target, close_draft):
    tokenizer = letters_tokenizer(16)
    kwargs = {"assistant_model": close_draft, "max_new_tokens": 12, "tokenizer": tokenizer, "do_sample": False}
    expected = target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    same = target.generate(PROMPT, assistant_tokenizer=letters_tokenizer(16), return_dict_in_generate=True, **kwargs)
    other = target.generate(PROMPT, assistant_tokenizer=letters_tokenizer(12), return_dict_in_generate=True, **kwargs)
    assert torch.equal(same.sequences, expected) and torch.equal(other.sequences, expected)
    assert other.speculative_stats.num_draft_tokens > 0  # letters 12 .. 15 are outside the draft's vocabulary


def test_temperature_zero_takes_the_greedy_path(target, close_draft):
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=20)
    output = target.generate(PROMPT, assistant_model=close_draft, do_sample=True, temperature=0.0, max_new_tokens=20)
    assert torch.equal(output, expected)


BAD_INPUTS = [
    ({"num_assistant_tokens": 0}, "num_assistant_tokens.*0"),
    ({"num_assistant_tokens": -2}, "num_assistant_tokens.*-2"),
    ({"num_assistant_tokens": 2.5}, "num_assistant_tokens.*2.5"),
    ({"num_assistant_tokens": True}, "num_assistant_tokens.*True"),
    ({"do_sample": True, "temperature": -0.5}, "temperature.*-0.5"),
    ({"do_sample": True, "top_p": 1.5}, "top_p.*1.5"),
    ({"do_sample": True, "top_p": 0.0}, "top_p.*0.0"),
    ({"num_beams": 2}, "num_beams=2"),
    ({"do_sample": True, "num_return_sequences": 2}, "num_return_sequences.*2"),
    ({"use_cache": False}, "use_cache"),
    ({"output_attentions": True}, "output_attentions"),
    ({"cache_implementation": "offloaded"}, "cache_implementation='offloaded'"),
    ({"generator": 42}, "generator.*int"),
    ({"guidance_scale": 1.5}, "`guidance_scale` is not supported.*keeps a cache.*1.5"),
]


@pytest.mark.parametrize("kwargs, message", BAD_INPUTS, ids=[str(b[0]) for b in BAD_INPUTS])
def test_bad_input_is_a_clear_error_naming_the_argument(target, close_draft, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        target.generate(PROMPT, assistant_model=close_draft, max_new_tokens=5, **kwargs)


def test_bad_draft_and_cache_objects_are_refused(target, close_draft):
    with pytest.raises(TypeError, match="assistant_model"):
        target.generate(PROMPT, assistant_model="small-model", max_new_tokens=5)
    with pytest.raises(ValueError, match="batch of 2 rows needs `pad_token_id`"):
        target.generate(PROMPT.repeat(2, 1), assistant_model=close_draft, max_new_tokens=5)
    with pytest.raises(ValueError, match="streamer.*2 rows"):
        target.generate(
            PROMPT.repeat(2, 1), assistant_model=close_draft, max_new_tokens=5, pad_token_id=0,
            streamer=type("Recorder", (BaseStreamer,), {"put": lambda self, value: None})(),
        )
    offloaded = StaticCache(config=target.config, max_cache_len=64, offloading=True)
    with pytest.raises(ValueError, match="`cache` uses StaticCache.*cannot be cropped back exactly"):
        target.generate(PROMPT, assistant_model=close_draft, max_new_tokens=5, cache=offloaded)
    with pytest.raises(ValueError, match="generator"):
        target.generate(PROMPT, max_new_tokens=5, generator=torch.Generator())


def test_nan_logits_raise_a_clear_error(target):
    broken = make_tiny_model(seed=0)
    with torch.no_grad():
        broken.lm_head.weight[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"assistant_model \(draft\) produced NaN"):
        target.generate(PROMPT, assistant_model=broken, do_sample=True, max_new_tokens=5)
    cache = DynamicCache(config=target.config)
    nan_target = speculative(make_tiny_model(seed=0))
    with torch.no_grad():
        nan_target.lm_head.weight[3, 0] = float("inf")
    with pytest.raises(ValueError, match="target model produced NaN"):
        nan_target.generate(PROMPT, assistant_model=target, do_sample=False, max_new_tokens=5, cache=cache)
    assert cache.get_seq_length() <= PROMPT.shape[1] - 1  # rolled back: nothing uncommitted stays cached


def test_draft_on_another_device_is_refused(target):
    draft = make_tiny_model(seed=1)
    draft.__class__ = type("ElsewhereLlama", (type(draft),), {"device": property(lambda self: torch.device("meta"))})
    with pytest.raises(ValueError, match="assistant_model.*meta"):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=5)


def test_an_encoder_decoder_draft_of_a_decoder_only_target_is_refused(target):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=16, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    with pytest.raises(ValueError, match="`assistant_model`.*encoder-decoder.*decoder-only"):
        target.generate(PROMPT, assistant_model=T5ForConditionalGeneration(config).eval(), max_new_tokens=3)


@pytest.mark.parametrize("row, is_invalid", [
    ([1.0, 2.0, 3.0], False), ([-float("inf"), 0.0, -float("inf")], False),
    ([1.0, float("nan"), 3.0], True), ([float("nan"), -float("inf"), -float("inf")], True),
    ([1.0, float("inf"), 3.0], True), ([-float("inf")] * 3, True), ([-float("inf"), float("nan"), 5.0], True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invalid_scores_are_found_in_one_pass(row, is_invalid, dtype):
    from hf_spec.forward import has_invalid_values

    batch = torch.tensor([[0.0, 1.0, 2.0], row], dtype=dtype)  # one good row, one under test
    assert bool(has_invalid_values(batch)) == is_invalid


def test_early_exit_beside_a_draft_model_is_refused_by_name(target, close_draft):
    with pytest.raises(ValueError, match="`assistant_early_exit`=1 and `assistant_model` both name the draft"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=close_draft, assistant_early_exit=1,
                        max_new_tokens=4)


def test_a_draft_of_another_vocabulary_without_tokenizers_is_warned_about(target, caplog):
    from helpers import make_tiny_model

    other = make_tiny_model(seed=9, vocab_size=8)  # the target has 16 ids
    with caplog.at_level("WARNING"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=other, max_new_tokens=4, do_sample=False)
    assert "`tokenizer=` and `assistant_tokenizer=`" in caplog.text
