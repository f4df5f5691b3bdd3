"""Inputs and outputs at the edges: each either equals target-only decoding exactly or is refused by name.

Also run under ``python -O`` (`test_edges_hold_without_asserts`): no check that user input can reach is an assert.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from helpers import PAD, PROMPTS, left_padded, make_tiny_model
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

from hf_spec import speculative, without_speculation

PROMPT = torch.tensor([[1, 5, 9, 2, 6]])


def target_only(target, *args, **kwargs):
    with without_speculation(target):
        return target.generate(*args, **kwargs)


def test_a_batch_returns_no_cache_and_warns_nothing_unasked(target, close_draft, caplog):
    """The documented behaviour (docs/batches.md): ``cache`` is ``None`` for several rows, without a warning to a
    user who never asked for the cache."""
    input_ids, attention_mask = left_padded(PROMPTS)
    with caplog.at_level(logging.WARNING):
        output = target.generate(input_ids, attention_mask=attention_mask, assistant_model=close_draft, do_sample=False,
                                 max_new_tokens=8, pad_token_id=PAD, return_dict_in_generate=True)
    assert output.cache is None
    assert not [record for record in caplog.records if record.name.startswith("hf_spec")]


def test_continuing_a_batch_from_its_sequences_equals_target_only(target, close_draft):
    """What the documentation tells a user to do instead of reusing a batched cache."""
    input_ids, attention_mask = left_padded(PROMPTS)
    common = {"do_sample": False, "pad_token_id": PAD}
    first = target.generate(input_ids, attention_mask=attention_mask, assistant_model=close_draft, max_new_tokens=5,
                            **common)
    mask = torch.cat([attention_mask, torch.ones_like(first[:, input_ids.shape[1]:])], dim=1)
    second = target.generate(first, attention_mask=mask, assistant_model=close_draft, max_new_tokens=5, **common)
    expected = target_only(target, input_ids, attention_mask=attention_mask, max_new_tokens=10, **common)
    assert torch.equal(second, expected)


def test_a_single_row_cache_continues_exactly(target, close_draft):
    output = target.generate(PROMPT, assistant_model=close_draft, do_sample=False, max_new_tokens=6,
                             return_dict_in_generate=True)
    assert output.cache.get_seq_length() == output.sequences.shape[1] - 1
    continued = target.generate(output.sequences, assistant_model=close_draft, do_sample=False, max_new_tokens=6,
                                cache=output.cache)
    assert torch.equal(continued, target_only(target, PROMPT, do_sample=False, max_new_tokens=12))


def test_right_padding_is_refused_with_the_fix():
    target, draft = speculative(make_tiny_model(seed=0)), make_tiny_model(seed=3)
    ids = torch.tensor([[3, 1, 4, PAD], [1, 5, 9, 2]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"`attention_mask` has padding after a token.*padding_side = 'left'"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=4, pad_token_id=PAD)


def test_a_cache_holding_the_whole_prompt_feeds_its_last_token_again(target, close_draft):
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(PROMPT, cache=cache, use_cache=True)
    assert cache.get_seq_length() == PROMPT.shape[1]
    output = target.generate(PROMPT, assistant_model=close_draft, do_sample=False, max_new_tokens=8, cache=cache)
    assert torch.equal(output, target_only(target, PROMPT, do_sample=False, max_new_tokens=8))


def test_a_cache_longer_than_the_prompt_is_refused(target, close_draft):
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(torch.tensor([[1, 5, 9, 2, 6, 5, 3]]), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"`cache` holds 7 positions, but `input_ids` has only 5 tokens"):
        target.generate(PROMPT, assistant_model=close_draft, max_new_tokens=4, cache=cache)


BAD_INPUT_IDS = [
    (torch.zeros((1, 0), dtype=torch.long), ValueError, r"`input_ids` must hold at least one token per row.*\(1, 0\)"),
    (torch.tensor([1, 2, 3]), ValueError, r"`input_ids` must have shape \[batch, length\].*\(3,\)"),
    (torch.tensor([[1.0, 2.0]]), TypeError, r"`input_ids` must hold integer token ids.*float32"),
    ([[1, 2, 3]], TypeError, r"`input_ids` must be a torch.Tensor.*list"),
    (torch.tensor([[1, 2, 99]]), ValueError, r"`input_ids` holds ids from 1 to 99.*16 ids"),
    (torch.tensor([[1, -2, 3]]), ValueError, r"`input_ids` holds ids from -2 to 3"),
]


@pytest.mark.parametrize("input_ids, error, message", BAD_INPUT_IDS, ids=[m for _, _, m in BAD_INPUT_IDS])
def test_bad_input_ids_are_named(target, close_draft, input_ids, error, message):
    with pytest.raises(error, match=message):
        target.generate(input_ids, assistant_model=close_draft, max_new_tokens=4)


@pytest.mark.parametrize("mask", [torch.tensor([[1, 1, 1, 1]]), torch.tensor([[0, 1, 1, 1]])],
                         ids=["all ones", "with a zero"])
def test_an_attention_mask_of_another_shape_is_named(target, close_draft, mask):
    with pytest.raises(ValueError, match=r"`attention_mask` must have the shape of `input_ids` \(1, 5\), but has "
                                         r"\(1, 4\)"):
        target.generate(PROMPT, attention_mask=mask, assistant_model=close_draft, max_new_tokens=4)


class MaskEverything(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return torch.full_like(scores, float("-inf"))


def test_a_processor_that_masks_everything_is_named_as_the_source(target, close_draft):
    with pytest.raises(ValueError, match="logits processor chain left no token to sample at a drafted position"):
        target.generate(PROMPT, assistant_model=close_draft, do_sample=True, max_new_tokens=4,
                        logits_processor=LogitsProcessorList([MaskEverything()]))


def on_a_fake_device(model):
    """The model, reporting the meta device: the checks run before any forward pass."""
    model.__class__ = type("ElsewhereLlama", (type(model),), {"device": property(lambda self: torch.device("meta"))})
    return model


def test_a_generator_on_another_device_is_refused():
    target, draft = speculative(on_a_fake_device(make_tiny_model(seed=0))), on_a_fake_device(make_tiny_model(seed=1))
    with pytest.raises(ValueError, match=r"`generator` draws on cpu, but the model runs on meta"):
        target.generate(PROMPT, assistant_model=draft, do_sample=True, max_new_tokens=4,
                        generator=torch.Generator().manual_seed(0))


def gpt2_draft(positions: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=positions, n_embd=64, n_layer=1, n_head=4)).eval()


def test_a_draft_with_too_few_positions_is_refused_before_the_first_round(target):
    with pytest.raises(ValueError, match=r"`assistant_model` has a table of 12 learned positions, but this call may "
                                         r"reach 15 tokens"):
        target.generate(PROMPT, assistant_model=gpt2_draft(12), max_new_tokens=10)
    output = target.generate(PROMPT, assistant_model=gpt2_draft(12), do_sample=False, max_new_tokens=7)
    assert torch.equal(output, target_only(target, PROMPT, do_sample=False, max_new_tokens=7))


EDGES_WITHOUT_ASSERTS = """
import torch
from transformers import DynamicCache
from hf_spec.loading.tiny import build_tiny_model
from hf_spec import speculative
target, draft = speculative(build_tiny_model(0, vocab_size=16)), build_tiny_model(3, vocab_size=16)
prompt = torch.tensor([[1, 5, 9, 2, 6]])
expected = target.generate(prompt, do_sample=False, max_new_tokens=6)
cache = DynamicCache(config=target.config)
with torch.no_grad():
    target(prompt, cache=cache, use_cache=True)
output = target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=6, cache=cache)
if not torch.equal(output, expected):
    raise SystemExit(f"prefilled cache: {output} differs from target-only {expected}")
for bad in (torch.zeros((1, 0), dtype=torch.long), torch.tensor([[1, 2, 99]])):
    try:
        target.generate(bad, assistant_model=draft, max_new_tokens=3)
    except ValueError as error:
        print("refused:", str(error)[:40])
print("ok")
"""


def test_edges_hold_without_asserts():
    """``python -O`` strips asserts: the prefilled cache still equals target-only, bad ids are still refused."""
    result = subprocess.run([sys.executable, "-O", "-c", EDGES_WITHOUT_ASSERTS], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("refused: `input_ids`") == 2 and result.stdout.strip().endswith("ok")


# --- Arguments that crashed without saying which -------------------------------------------------------------------

def test_bad_arguments_are_refused_naming_them_before_any_pass(target, close_draft):
    from transformers import AutoTokenizer  # noqa: F401  (what the message tells a user to call)

    cases = [
        ({"tokenizer": "gpt2", "assistant_tokenizer": "gpt2"}, TypeError,
         r"`tokenizer` must be a tokenizer .* but is str 'gpt2' \(load it: AutoTokenizer.from_pretrained"),
        ({"input_ids": torch.zeros(0, 5, dtype=torch.long)}, ValueError, r"`input_ids` must hold at least one row"),
        ({"cache_implementation": "static", "max_cache_len": "abc"}, ValueError,
         r"`max_cache_len` must be a positive integer"),
        ({"cache_implementation": "static", "num_tree_nodes": 100_000}, ValueError,
         r"`num_tree_nodes`=100000 is more than the model's \d+ positions"),
    ]
    for extra, kind, message in cases:
        inputs = {"input_ids": PROMPT, **extra}
        with pytest.raises(kind, match=message):
            target.generate(assistant_model=close_draft, max_new_tokens=4, do_sample=False, **inputs)


def test_a_filled_cache_of_another_batch_size_is_refused_naming_it(target, close_draft):
    output = target.generate(PROMPT, assistant_model=close_draft, max_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True)
    with pytest.raises(ValueError, match=r"`cache` holds 1 rows, but `input_ids` has 2"):
        target.generate(output.sequences.repeat(2, 1), assistant_model=close_draft, cache=output.cache,
                        max_new_tokens=4, do_sample=False, pad_token_id=PAD)


def test_a_huge_k_with_a_static_cache_sizes_it_for_the_call(target, close_draft):
    from hf_spec.caches import static_length

    output = target.generate(PROMPT, assistant_model=close_draft, num_assistant_tokens=100_000, max_new_tokens=6,
                             cache_implementation="static", do_sample=False, return_dict_in_generate=True)
    assert static_length(output.cache) == 256  # sized for drafts of at most 6 tokens, not 100,000
    assert torch.equal(output.sequences, target_only(target, PROMPT, max_new_tokens=6, do_sample=False))


def test_a_returned_static_cache_continues_compiled(target, close_draft):
    from transformers.generation.configuration_utils import CompileConfig

    first = target.generate(PROMPT, assistant_model=close_draft, max_new_tokens=4, cache_implementation="static",
                            do_sample=False, return_dict_in_generate=True)
    output = target.generate(first.sequences, assistant_model=close_draft, cache=first.cache, max_new_tokens=4,
                             compile_config=CompileConfig(backend="eager"), do_sample=False)
    assert torch.equal(output, target_only(target, PROMPT, max_new_tokens=8, do_sample=False))
    with pytest.raises(ValueError, match="`compile_config` compiles the passes of a static cache"):
        target.generate(PROMPT, assistant_model=close_draft, max_new_tokens=4,
                        compile_config=CompileConfig(backend="eager"), do_sample=False)


def test_a_corpus_of_texts_is_refused_naming_the_entry():
    from hf_spec.drafting.suffix import SuffixDrafter

    with pytest.raises(TypeError, match=r"`corpus`\[1\] is text \('def f'\); the corpus holds token ids"):
        SuffixDrafter(corpus=[[1, 2, 3], "def f"])
    with pytest.raises(TypeError, match=r"`corpus`\[0\] must be a sequence of token ids, but is dict"):
        SuffixDrafter(corpus=[{"a": 1}])


def test_a_packed_model_lists_every_weight_and_pickles():
    import pickle

    from hf_spec.loading.packed import deoptimize, optimize

    from hf_spec.loading.cpu import default_dtype

    # bf16 where the CPU has it natively (oneDNN packs bf16 there), float32 elsewhere (AVX2: oneDNN packs float32 only)
    model = speculative(make_tiny_model(seed=3, vocab_size=64).to(default_dtype()))
    expected = model.generate(PROMPT, max_new_tokens=6, do_sample=False)
    counted = sum(parameter.numel() for parameter in model.parameters())
    assert optimize(model, path="packed").name == "packed"
    assert sum(parameter.numel() for parameter in model.parameters()) == counted
    restored = pickle.loads(pickle.dumps(model))
    assert torch.equal(restored.generate(PROMPT, max_new_tokens=6, do_sample=False), expected)
    deoptimize(model)
    assert sum(parameter.numel() for parameter in model.parameters()) == counted
