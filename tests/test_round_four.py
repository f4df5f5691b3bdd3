"""The fourth round of adversarial probes (issue 71): each case either equals target-only decoding or is refused by
name before any pass. Every test here failed on the code before the fix; each probes the case's neighbours too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PAD, PROMPTS, left_padded, make_noisy_copy, make_tiny_model
from transformers import GenerationConfig, WhisperForCausalLM

from hf_spec import speculative, without_speculation
from hf_spec.evaluation import conditioned
from hf_spec.loading.weight_only import quantize_weights
from hf_spec.rejection import accept_draft_tokens
from hf_spec.verification import BLOCK, Verification


@pytest.fixture(scope="module")
def pair():
    target = speculative(make_tiny_model(seed=0, vocab_size=64, head_scale=2.0))
    return target, make_noisy_copy(target, seed=1, noise=0.01)


def target_only(target, *args, **kwargs):
    with without_speculation(target):
        return target.generate(*args, **kwargs)


# --- input types and values ------------------------------------------------------------------------------------------

def test_int32_prompts_are_taken_as_target_only_takes_them(pair):
    target, draft = pair
    ids, mask = left_padded(PROMPTS)
    expected = target_only(target, ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD)
    for sample in (False, True):
        actual = target.generate(ids.int(), attention_mask=mask.int(), assistant_model=draft, max_new_tokens=8,
                                 pad_token_id=PAD, do_sample=sample)
        assert actual.dtype == torch.int64 and actual.shape == expected.shape
        if not sample:
            assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8])
def test_other_integer_dtypes_are_named(pair, dtype):
    target, draft = pair
    with pytest.raises(TypeError, match=rf"`input_ids` must hold integer token ids \(int64, or int32\).*{dtype}"):
        target.generate(torch.tensor([[1, 2, 3]], dtype=dtype), assistant_model=draft, max_new_tokens=4)


@pytest.mark.parametrize("name, value", [("max_new_tokens", 2.5), ("max_new_tokens", True), ("max_length", 9.0),
                                         ("min_new_tokens", 1.5), ("min_length", "3")])
def test_lengths_that_are_not_integers_are_named_before_any_pass(pair, name, value):
    target, draft = pair
    with pytest.raises(ValueError, match=rf"`{name}` must be .*integer.*{value!r}"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=draft, **{name: value},
                        **({} if name.startswith("max") else {"max_new_tokens": 4}))


@pytest.mark.parametrize("pad", [-1, 64, 70])
@pytest.mark.parametrize("in_prompt", [False, True])
def test_a_pad_id_outside_the_vocabulary_in_a_batch_is_named(pair, pad, in_prompt):
    """Finished rows and holes are padded with it and fed to the models (target-only decoding dies in the embedding
    once a row finishes): named before any pass, with the fix."""
    target, draft = pair
    ids, mask = left_padded(PROMPTS)
    if in_prompt:
        ids = ids.masked_fill(mask == 0, pad)
    with pytest.raises(ValueError, match=rf"`pad_token_id`={pad} is outside the model's vocabulary \(0 to 63\).*"
                                         "resize_token_embeddings"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=4, pad_token_id=pad,
                        eos_token_id=5)


def test_one_row_needs_no_pad_id_in_the_vocabulary(pair):
    target, draft = pair
    prompt = torch.tensor([PROMPTS[1]])
    expected = target_only(target, prompt, max_new_tokens=6, pad_token_id=-1)
    assert torch.equal(target.generate(prompt, assistant_model=draft, max_new_tokens=6, pad_token_id=-1), expected)


# --- a Verification of your own --------------------------------------------------------------------------------------

def _with_counts_plus(extra):
    def rule(draft_ids, draft_probs, target_probs, generator, **options):
        output_ids, num_accepted, *rest = accept_draft_tokens(draft_ids, draft_probs, target_probs, generator,
                                                              **options)
        return (output_ids, num_accepted + extra, *rest)
    return rule


def _with_width(width):
    def rule(draft_ids, draft_probs, target_probs, generator, **options):
        output_ids, num_accepted, *rest = accept_draft_tokens(draft_ids, draft_probs, target_probs, generator,
                                                              **options)
        return (output_ids[:, :1].repeat(1, width), num_accepted, *rest)
    return rule


def _with_ids(shift):
    def rule(draft_ids, draft_probs, target_probs, generator, **options):
        output_ids, num_accepted, *rest = accept_draft_tokens(draft_ids, draft_probs, target_probs, generator,
                                                              **options)
        return (output_ids + shift, num_accepted, *rest)
    return rule


@pytest.mark.parametrize("rule, message", [
    (_with_counts_plus(9), r"accepted from \d+ to \d+ tokens of 4 drafted; a row keeps 0 to 4"),
    (_with_counts_plus(-1), r"accepted from -1 to"),
    (_with_width(1), r"returned output ids of shape \[4, 1\] for 4 rows of 4 drafted tokens; they must be .* \[4, 5\]"),
    (_with_width(9), r"returned output ids of shape \[4, 9\]"),
    (_with_ids(1000), r"returned ids from .* outside the vocabulary of 64 ids"),
])
def test_a_chain_rule_of_your_own_that_returns_what_the_loop_cannot_use_is_named(pair, rule, message):
    target, draft = pair
    ids, mask = left_padded(PROMPTS)
    verification = Verification(rule, BLOCK.tree, "mine", "my tree")
    with pytest.raises(ValueError, match=rf"The `verification` rule 'mine' {message}"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=8, pad_token_id=PAD,
                        do_sample=True, num_assistant_tokens=4, verification=verification)


@pytest.mark.parametrize("path, next_id, message", [
    ([0, 5, 99], torch.tensor(3), r"returned the path \[0, 5, 99\], which is no path of the tree"),
    ([0, 0], torch.tensor(3), r"returned the path \[0, 0\], which is no path .* from its root \(node 0 after 0"),
    ([], torch.tensor(64), r"returned the next id tensor\(64\)"),
    ([], 3, r"returned the next id 3"),
])
def test_a_tree_rule_of_your_own_that_returns_no_path_is_named(pair, path, next_id, message):
    target, draft = pair
    verification = Verification(BLOCK.chain, lambda *args, **kwargs: (path, next_id), "chain", "mine")
    with pytest.raises(ValueError, match=rf"The `verification` rule 'mine' {message}"):
        target.generate(torch.tensor([PROMPTS[1]]), assistant_model=draft, max_new_tokens=8, do_sample=True,
                        num_tree_nodes=4, verification=verification)


def test_a_rule_of_your_own_that_keeps_the_law_still_runs(pair):
    """The checks change nothing for a rule that returns what it should (the same draws as the built-in rule)."""
    target, draft = pair
    ids, mask = left_padded(PROMPTS)
    common = {"attention_mask": mask, "assistant_model": draft, "max_new_tokens": 8, "pad_token_id": PAD,
              "do_sample": True, "num_assistant_tokens": 3}
    mine = Verification(accept_draft_tokens, BLOCK.tree, "token, mine", "tree")
    expected = target.generate(ids, **common, verification="token", generator=torch.Generator().manual_seed(3))
    actual = target.generate(ids, **common, verification=mine, generator=torch.Generator().manual_seed(3))
    assert torch.equal(actual, expected)


# --- processors with per-row state -----------------------------------------------------------------------------------

@pytest.mark.parametrize("setting", [{"encoder_repetition_penalty": 1.5}, {"encoder_repetition_penalty": 0.7},
                                     {"encoder_no_repeat_ngram_size": 2}])
def test_encoder_processors_in_ragged_batches_equal_target_only(pair, setting):
    """Each row keeps its own encoder input ids (the prompt, for a decoder-only model) when rows of different lengths
    are processed in groups."""
    target, draft = pair
    ids, mask = left_padded(PROMPTS)
    expected = target_only(target, ids, attention_mask=mask, max_new_tokens=16, pad_token_id=PAD, **setting)
    for k in (2, 5):
        assert torch.equal(target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=16,
                                           pad_token_id=PAD, num_assistant_tokens=k, **setting), expected)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_processors_of_encoder_decoders_equal_target_only(name):
    case = conditioned.build_case(name)
    target = speculative(case.target)
    for setting in ({"encoder_repetition_penalty": 1.5}, {"encoder_no_repeat_ngram_size": 2}):
        expected = target_only(target, **case.inputs, max_new_tokens=12, do_sample=False, **setting)
        actual = target.generate(**case.inputs, assistant_model=case.drafts["near-copy"], max_new_tokens=12,
                                 do_sample=False, **setting)
        assert torch.equal(actual, expected)


# --- drafts of encoder-decoder targets -------------------------------------------------------------------------------

def test_an_encoder_decoder_draft_with_a_smaller_embedding_is_named():
    case = conditioned.build_case("t5")
    with pytest.raises(ValueError, match=r"`assistant_model` \(T5ForConditionalGeneration\) runs its own encoder on "
                                         r"the model's input ids, but its embedding has 128 rows and the model's 256"):
        speculative(case.target).generate(**case.inputs, assistant_model=conditioned.t5(vocab_size=128, seed=3),
                                          max_new_tokens=4)


def test_a_decoder_only_assistant_of_another_width_is_named():
    case = conditioned.build_case("whisper")
    config = conditioned.whisper_config()
    config.d_model, config.decoder_ffn_dim = 128, 256
    with pytest.raises(ValueError, match=r"`assistant_model` \(WhisperForCausalLM\) attends over the model's encoder "
                                         r"outputs, which are 64 wide, but it is 128 wide"):
        speculative(case.target).generate(**case.inputs, assistant_model=WhisperForCausalLM(config).eval(),
                                          max_new_tokens=4)


def test_a_full_whisper_draft_is_held_to_its_decoders_positions_not_its_encoders():
    """The draft's encoder table (32 source positions) limits nothing; its decoder's (24 here) does."""
    case = conditioned.build_case("whisper")
    config = conditioned.whisper_config()
    config.max_source_positions, config.max_target_positions = 32, 24
    draft = conditioned.whisper(seed=4)  # 128 decoder positions: a call of 40 tokens is valid
    draft.model.encoder.load_state_dict(case.target.model.encoder.state_dict())
    target = speculative(case.target)
    expected = target_only(target, **case.inputs, max_new_tokens=40, do_sample=False)
    assert torch.equal(target.generate(**case.inputs, assistant_model=draft, max_new_tokens=40, do_sample=False),
                       expected)
    short = conditioned._seeded(4, lambda: type(draft)(config))
    with pytest.raises(ValueError, match=r"`assistant_model` has a table of 24 learned positions"):
        target.generate(**case.inputs, assistant_model=short, max_new_tokens=40, do_sample=False)


def test_generation_config_by_keyword_reaches_whisper():
    case = conditioned.build_case("whisper")
    target = speculative(case.target)
    config = GenerationConfig.from_dict({**target.generation_config.to_dict(), "max_new_tokens": 8})
    expected = target_only(target, case.inputs["input_features"], config)
    assert torch.equal(target.generate(**case.inputs, generation_config=config), expected)
    for draft in case.drafts.values():
        assert torch.equal(target.generate(**case.inputs, generation_config=config, assistant_model=draft), expected)


# --- automatic k on a vision-language target -------------------------------------------------------------------------

def test_auto_k_on_a_qwen2_vl_batch_in_a_fresh_process_equals_target_only():
    """The cost probe times the models with positions of its own: Qwen2-VL keeps the call's rope deltas (a batch of
    two) on the model, and the probe's one row read them."""
    from hf_spec.timing import probe as costs

    costs._PROBED.clear()
    case = conditioned.build_case("qwen2_vl")
    target = speculative(case.target)
    expected = target_only(target, **case.inputs, max_new_tokens=10, do_sample=False)
    for draft in case.drafts.values():
        costs._PROBED.clear()  # every draft's first call probes, as in a fresh process
        assert torch.equal(target.generate(**case.inputs, assistant_model=draft, num_assistant_tokens="auto",
                                           max_new_tokens=10, do_sample=False), expected)


# --- weight-only models moved to other dtypes ------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_a_weight_only_model_moved_to_another_dtype_runs_and_speculates_exactly(scheme, dtype, monkeypatch):
    """``model.to(dtype)`` after quantizing: the scales follow, the kernels take what they can (float64 is computed in
    float32), and speculation equals the moved model's own decoding. (w8a8 is built directly where its kernel does not
    run: the layers then take its torch path.)"""
    from hf_spec.loading import weight_only

    monkeypatch.setattr(weight_only, "check_runs_here", lambda *args, **kwargs: None)
    target = quantize_weights(make_tiny_model(seed=0, vocab_size=64, head_scale=2.0), scheme)
    target, draft = speculative(target.to(dtype)), make_noisy_copy(make_tiny_model(seed=0, vocab_size=64,
                                                                                   head_scale=2.0), 1, 0.01).to(dtype)
    ids, mask = left_padded(PROMPTS)
    expected = target_only(target, ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD)
    actual = target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=8, pad_token_id=PAD)
    assert actual.shape == expected.shape
    if dtype != torch.float16:  # float16 rounds near-ties apart between a step and a block on torch's kernels
        assert torch.equal(actual, expected)


def test_moving_a_weight_only_model_leaves_the_w8a8_scales_in_float32(monkeypatch):
    from hf_spec.loading import weight_only

    monkeypatch.setattr(weight_only, "check_runs_here", lambda *args, **kwargs: None)
    model = quantize_weights(make_tiny_model(seed=0, vocab_size=64), "w8a8")
    layer = model.model.layers[0].mlp.up_proj
    expected = layer(torch.randn(3, layer.in_features))
    model.to(torch.bfloat16)
    assert layer.scales.dtype == torch.bfloat16  # .to() moved the buffer; the multiply reads it as float32
    assert layer(torch.randn(3, layer.in_features, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert expected.dtype == torch.float32


def test_a_deep_copy_of_a_speculative_target_keeps_its_behaviour(pair):
    target, draft = pair
    copied = copy.deepcopy(target)
    prompt = torch.tensor([PROMPTS[2]])
    assert torch.equal(copied.generate(prompt, assistant_model=draft, max_new_tokens=6),
                       target.generate(prompt, assistant_model=draft, max_new_tokens=6))


# --- Whisper's own settings ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tasks", [False, True])
def test_whisper_keeps_begin_suppress_tokens_with_an_assistant(tasks):
    """Whisper's generate() drops ``begin_suppress_tokens`` whenever ``assistant_model`` is in the call; hf_spec puts
    them back (target-only suppresses the tokens at the first position, and so does speculation), and leaves the
    assistant's generation config as it was."""
    case = conditioned.build_case("whisper")
    if tasks:
        conditioned.with_whisper_tasks(case.target)
    target = speculative(case.target)
    plain = target_only(target, **case.inputs, max_new_tokens=6, do_sample=False)
    first = plain[:, 0].tolist()  # each row's first generated token
    expected = target_only(target, **case.inputs, max_new_tokens=6, do_sample=False, begin_suppress_tokens=first)
    assert not torch.equal(expected, plain), "the setting must change target-only output for this test to mean much"
    for draft in case.drafts.values():
        before = copy.deepcopy(draft.generation_config.to_dict())
        actual = target.generate(**case.inputs, assistant_model=draft, max_new_tokens=6, do_sample=False,
                                 begin_suppress_tokens=first)
        assert torch.equal(actual, expected)
        assert draft.generation_config.to_dict() == before
    target.generation_config.begin_suppress_tokens = first  # from the model's own config, as checkpoints have it
    assert torch.equal(target.generate(**case.inputs, assistant_model=case.drafts["same encoder"], max_new_tokens=6,
                                       do_sample=False), expected)


def test_whisper_token_timestamps_are_refused_by_name_before_any_pass():
    case = conditioned.build_case("whisper")
    case.target.generation_config.alignment_heads = [[0, 0], [1, 1]]
    encoder = case.target.get_encoder()
    calls = []
    handle = encoder.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=r"`return_token_timestamps=True` is not supported with `assistant_model`"):
        speculative(case.target).generate(**case.inputs, assistant_model=case.drafts["same encoder"],
                                          max_new_tokens=4, return_token_timestamps=True)
    handle.remove()
    assert calls == []
