"""The output stops exactly where target-only decoding would; a streamer sees every token once, in order."""

from __future__ import annotations

import pytest
import torch
from helpers import letters_tokenizer
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


def _greedy(target, **kwargs):
    return target.generate(PROMPT, do_sample=False, max_new_tokens=40, **kwargs)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_eos_at_every_position_inside_a_block_cuts_right_after_it(target, k):
    reference = _greedy(target)[0, PROMPT.shape[1] :]
    # Each distinct generated token, taken as EOS, is met at a different position of some block.
    for eos in dict.fromkeys(reference.tolist()):
        expected = _greedy(target, eos_token_id=eos)
        output = target.generate(
            PROMPT, assistant_model=target, do_sample=False, max_new_tokens=40, eos_token_id=eos, num_assistant_tokens=k
        )
        assert torch.equal(output, expected)
        assert output[0, -1].item() == eos


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 4, 5, 6, 7])
def test_max_new_tokens_is_exact_with_full_acceptance_and_bonus(target, max_new_tokens):
    output = target.generate(
        PROMPT, assistant_model=target, do_sample=True, max_new_tokens=max_new_tokens, num_assistant_tokens=3,
        return_dict_in_generate=True,
    )
    assert output.sequences.shape[1] == PROMPT.shape[1] + max_new_tokens
    assert output.speculative_stats.num_emitted == max_new_tokens
    assert output.cache.get_seq_length() == output.sequences.shape[1] - 1


def test_min_new_tokens_rejects_an_early_drafted_eos(target):
    reference = _greedy(target)[0, PROMPT.shape[1] :].tolist()
    eos = reference[1]  # the greedy path would end at the second token
    expected = _greedy(target, eos_token_id=eos, min_new_tokens=10)
    output = target.generate(
        PROMPT, assistant_model=target, do_sample=False, max_new_tokens=40, eos_token_id=eos, min_new_tokens=10,
        num_assistant_tokens=5,
    )
    assert torch.equal(output, expected)
    assert eos not in output[0, PROMPT.shape[1] : PROMPT.shape[1] + 10].tolist()


def test_stop_string_met_inside_a_block_cuts_there(target):
    tokenizer = letters_tokenizer()
    text = tokenizer.decode(_greedy(target)[0, PROMPT.shape[1] :])
    stop = text[5:7]
    expected = _greedy(target, stop_strings=stop, tokenizer=tokenizer)
    output = target.generate(
        PROMPT, assistant_model=target, do_sample=False, max_new_tokens=40, stop_strings=stop, tokenizer=tokenizer,
        num_assistant_tokens=5,
    )
    assert torch.equal(output, expected)
    assert tokenizer.decode(output[0, PROMPT.shape[1] :]).endswith(stop)


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("stop_length", [6, 8, 11, 12, 13])
def test_custom_stopping_criteria_is_evaluated_per_token(target, stop_length):
    output = target.generate(
        PROMPT, assistant_model=target, do_sample=False, max_new_tokens=40, num_assistant_tokens=5,
        stopping_criteria=StoppingCriteriaList([StopAtLength(stop_length)]),
    )
    assert output.shape[1] == stop_length


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], 0

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


def test_streamer_receives_every_token_once_in_order(target, close_draft):
    streamer = RecordingStreamer()
    output = target.generate(
        PROMPT, assistant_model=close_draft, do_sample=True, max_new_tokens=30, num_assistant_tokens=4,
        streamer=streamer,
    )
    streamed = [token for chunk in streamer.chunks for token in chunk]
    assert streamer.chunks[0] == PROMPT[0].tolist()  # generate() streams the prompt first
    assert streamed == output[0].tolist()
    assert streamer.ended == 1
