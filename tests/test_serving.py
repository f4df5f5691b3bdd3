"""Speculation inside transformers' continuous batching (`hf_spec.serving`): per request exact, with requests joining
mid-flight, blocks cut by the token budget, a small cache, cancellations, streams and per-request seeds."""

from __future__ import annotations

import contextlib
import itertools
import time

import numpy as np
import pytest
import torch
from helpers import NUM_SAMPLES, PROMPT, exact_law, make_noisy_copy, make_tiny_model, with_length
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from hf_spec import speculative
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, fit_sequences

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 21, [7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def pair():
    target = speculative(make_tiny_model(seed=1, vocab_size=64))
    return target, make_noisy_copy(target, seed=3, noise=0.1)


def small_cache(**settings) -> ContinuousBatchingConfig:
    """A cache of a few pages of 8 tokens and a budget of 16 tokens a pass: prefills are chunked, blocks cut."""
    return ContinuousBatchingConfig(**{"num_blocks": 24, "page_size": 8, "max_batch_tokens": 16, **settings})


def target_only(target, prompt: list[int], **settings) -> list[int]:
    output = target.generate(torch.tensor([prompt]), do_sample=False, **settings)
    return output[0, len(prompt):].tolist()


@contextlib.contextmanager
def running(target, draft, config: GenerationConfig, cache: ContinuousBatchingConfig | None = None, **speculation):
    """A started speculative manager, stopped on the way out whatever happened."""
    manager = target.init_continuous_batching(config, cache or small_cache(), assistant_model=draft, **speculation)
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=True)


def results_of(manager, request_ids: list[str], timeout: float = 60.0) -> dict:
    results, deadline = {}, time.monotonic() + timeout
    while len(results) < len(request_ids) and time.monotonic() < deadline:
        output = manager.get_result(timeout=1)
        if output is not None and output.is_finished():
            results[output.request_id] = output
    assert set(results) == set(request_ids), f"missing {set(request_ids) - set(results)}"
    return results


def test_generate_batch_greedy_equals_each_prompt_alone(pair):
    target, draft = pair
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1)
    outputs = target.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=small_cache(),
                                    assistant_model=draft, num_assistant_tokens=3)
    assert len(outputs) == len(PROMPTS)
    for output, prompt in zip(outputs.values(), PROMPTS, strict=True):
        assert output.error is None
        assert output.generated_tokens == target_only(target, prompt, max_new_tokens=12)
    stats = [output.speculative_stats for output in outputs.values()]
    assert sum(s["num_accepted"] for s in stats) > 0 and all(s["num_drafted"] > 0 for s in stats)


def test_requests_joining_mid_flight_with_their_own_limits_and_eos(pair):
    target, draft = pair
    reference = target_only(target, PROMPTS[0], max_new_tokens=10)
    eos = reference[4]  # a token the first prompt emits: that request stops there
    config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1)
    with running(target, draft, config, num_assistant_tokens=4) as manager:
        ids = [manager.add_request(PROMPTS[0], eos_token_id=eos)]
        time.sleep(0.05)
        ids.append(manager.add_request(PROMPTS[1], max_new_tokens=7))
        time.sleep(0.02)
        ids += [manager.add_request(prompt, max_new_tokens=3 + i) for i, prompt in enumerate(PROMPTS[2:])]
        results = results_of(manager, ids)
    assert results[ids[0]].generated_tokens == reference[: reference.index(eos) + 1]
    assert results[ids[1]].generated_tokens == target_only(target, PROMPTS[1], max_new_tokens=7)
    for i, prompt in enumerate(PROMPTS[2:]):
        assert results[ids[2 + i]].generated_tokens == target_only(target, prompt, max_new_tokens=3 + i)
    assert not manager._speculations  # every request's state left with it


def test_a_cancelled_request_leaves_and_the_others_stay_exact(pair):
    target, draft = pair
    with running(target, draft, GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=-1)) as manager:
        cancelled = manager.add_request(PROMPTS[2], max_new_tokens=200, streaming=True)
        kept = manager.add_request(PROMPTS[4])
        manager.cancel_request(manager.add_request(PROMPTS[3]))  # before it ever ran
        for output in manager.request_id_iter(cancelled):
            if len(output.generated_tokens) >= 3:
                break
        manager.cancel_request(cancelled)
        results = results_of(manager, [kept])
        processor = manager.batch_processor  # stop() lets go of it
    assert results[kept].generated_tokens == target_only(target, PROMPTS[4], max_new_tokens=30)
    assert not processor.draft_cache.cache_allocators["full_attention"].block_table  # the draft blocks left too
    assert not manager._speculations


def test_streams_deliver_growing_prefixes(pair):
    target, draft = pair
    with running(target, draft, GenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=-1)) as manager:
        request_id = manager.add_request(PROMPTS[1], streaming=True)
        seen = [list(output.generated_tokens) for output in manager.request_id_iter(request_id)]
    assert seen[-1] == target_only(target, PROMPTS[1], max_new_tokens=9)
    assert all(a == b[: len(a)] and len(a) < len(b) for a, b in itertools.pairwise(seen))


def _sample_requests(target, draft, settings: dict, seed: int, verification=None, k=2) -> np.ndarray:
    """NUM_SAMPLES requests of `PROMPT`, each with its own seed, arriving in four waves while the batch runs."""
    config = GenerationConfig(**with_length(settings), do_sample=True, eos_token_id=-1)
    cache = ContinuousBatchingConfig(num_blocks=512, page_size=8, max_batch_tokens=512)
    prompt = PROMPT[0].tolist()
    with running(target, draft, config, cache, num_assistant_tokens=k, verification=verification) as manager:
        ids = []
        for wave in range(4):
            ids += [manager.add_request(prompt, seed=seed * NUM_SAMPLES + i)
                    for i in range(wave * NUM_SAMPLES // 4, (wave + 1) * NUM_SAMPLES // 4)]
            time.sleep(0.05)
        results = results_of(manager, ids, timeout=300)
    return np.array([results[request_id].generated_tokens for request_id in ids])


SAMPLED = {"temperature": 0.8, "top_k": 3, "repetition_penalty": 1.5}


@pytest.mark.parametrize("k", [2, "auto"])
def test_sampled_requests_arriving_mid_flight_follow_the_target_law(small_target, small_draft, k):
    samples = _sample_requests(small_target, small_draft, SAMPLED, seed=1, k=k)
    result = fit_sequences(samples, exact_law(small_target, SAMPLED, []))
    assert result.is_consistent, result


def test_negative_control_resampling_from_p_is_caught(small_target, small_draft):
    samples = _sample_requests(small_target, small_draft, SAMPLED, seed=2, verification=RESAMPLE_FROM_P)
    result = fit_sequences(samples, exact_law(small_target, SAMPLED, []))
    assert not result.is_consistent, result


def test_a_seed_reproduces_a_request_whatever_shares_its_batch(pair):
    target, draft = pair
    config = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.5, eos_token_id=-1)

    def run(prompts: list[list[int]]) -> list[int]:
        with running(target, draft, config, num_assistant_tokens=3) as manager:  # auto k would follow the timings
            ids = [manager.add_request(prompt, seed=7 if i == 0 else 100 + i) for i, prompt in enumerate(prompts)]
            return results_of(manager, ids)[ids[0]].generated_tokens

    alone = run(PROMPTS[:1])
    assert run(PROMPTS) == alone
    assert run([PROMPTS[0], *PROMPTS[3:]]) == alone


def _fixed_costs(manager, target_seconds, draft_seconds) -> None:
    """The sizer sees these pass costs (sizes 1 to 64) and no timing of its own."""
    for size in (1, 64):
        manager.sizer.add_target_pass(size, target_seconds(size))
        manager.sizer.add_draft_pass(size, draft_seconds(size))
    manager.sizer.add_target_pass = manager.sizer.add_draft_pass = lambda *_: None


@pytest.mark.parametrize(("target_seconds", "drafts"), [(lambda n: 0.1 + 0.001 * n, True),  # memory-bound
                                                        (lambda n: 0.1 * n, False)])  # compute-bound
def test_auto_k_per_request_drafts_where_it_pays_and_stays_exact(pair, target_seconds, drafts):
    target, draft = pair
    config = GenerationConfig(max_new_tokens=14, do_sample=False, eos_token_id=-1)
    with running(target, draft, config, num_assistant_tokens="auto") as manager:
        _fixed_costs(manager, target_seconds, lambda n: 0.01 + 0.001 * n)
        ids = [manager.add_request(prompt) for prompt in PROMPTS]
        results = results_of(manager, ids)
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        assert results[request_id].generated_tokens == target_only(target, prompt, max_new_tokens=14)
    drafted = [results[request_id].speculative_stats["num_drafted"] for request_id in ids]
    assert all(drafted) if drafts else not any(drafted)


def test_a_cache_too_small_for_every_block_makes_requests_wait_not_fail(pair):
    target, draft = pair
    config = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=-1)
    outputs = target.generate_batch(PROMPTS, generation_config=config,
                                    continuous_batching_config=small_cache(num_blocks=10),
                                    assistant_model=draft, num_assistant_tokens=6)
    for output, prompt in zip(outputs.values(), PROMPTS, strict=True):
        assert output.error is None
        assert output.generated_tokens == target_only(target, prompt, max_new_tokens=16)


def test_stop_strings_end_a_request_as_generate_does(pair):
    from hf_spec.loading.tiny import tiny_tokenizer

    target, draft = pair
    tokenizer = tiny_tokenizer()
    full = target_only(target, PROMPTS[1], max_new_tokens=20)
    stop = tokenizer.decode(full[6:8])
    expected = target_only(target, PROMPTS[1], max_new_tokens=20, stop_strings=stop, tokenizer=tokenizer)
    assert len(expected) < len(full)  # generate() stopped at the stop string
    with running(target, draft, GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=-1)) as manager:
        ids = [manager.add_request(PROMPTS[1], stop_strings=stop, tokenizer=tokenizer), manager.add_request(PROMPTS[0])]
        results = results_of(manager, ids)
    assert results[ids[0]].generated_tokens == expected
    assert results[ids[1]].generated_tokens == target_only(target, PROMPTS[0], max_new_tokens=20)
    with pytest.raises(ValueError, match="tokenizer"):
        manager.add_request(PROMPTS[1], stop_strings=stop)


def test_refusals_name_the_argument(pair):
    target, draft = pair
    config = GenerationConfig(max_new_tokens=4, eos_token_id=-1)
    with pytest.raises(ValueError, match="vocabulary"):
        target.init_continuous_batching(config, assistant_model=make_tiny_model(seed=4, vocab_size=128))
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        target.init_continuous_batching(config, assistant_model=draft, num_assistant_tokens=-1)
    with pytest.raises(ValueError, match="'auto'"):
        target.init_continuous_batching(config, assistant_model=draft, num_assistant_tokens="fast")
    with pytest.raises(ValueError, match="use_async_batching"):
        target.init_continuous_batching(config, ContinuousBatchingConfig(use_async_batching=True),
                                        assistant_model=draft)
    with pytest.raises(ValueError, match="num_return_sequences"):
        target.init_continuous_batching(GenerationConfig(num_return_sequences=2, do_sample=True),
                                        assistant_model=draft)
    with pytest.raises(TypeError, match="assistant_model"):
        target.init_continuous_batching(config, assistant_model="draft")
    manager = target.init_continuous_batching(config, assistant_model=draft)
    with pytest.raises(ValueError, match="frequency_penalty"):
        manager.add_request([1, 2], frequency_penalty=0.5)
    with pytest.raises(ValueError, match="seed"):
        manager.add_request([1, 2], seed="7")
    assert not manager._speculations
    no_drafts = GenerationConfig(max_new_tokens=4, eos_token_id=-1, num_assistant_tokens=0)
    assert target.init_continuous_batching(no_drafts, assistant_model=draft).num_assistant_tokens == 0  # not auto
