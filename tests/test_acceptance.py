"""Acceptance evaluation: hand-built distributions, the `evaluate` metric, and prediction vs measurement."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_noisy_copy, make_tiny_model

from hf_spec import speculative
from hf_spec.evaluation.continuations import target_continuations
from hf_spec.evaluation.draft_fit import (
    METRIC_PATH,
    acceptance_probability,
    evaluate_draft,
    expected_tokens_along,
    greedy_acceptance,
    measure_draft,
    total_variation,
)
from hf_spec.loading.corpora import load_texts
from hf_spec.sizing.speedup import expected_tokens

evaluate = pytest.importorskip("evaluate")


# Hand-built tables: (p, q, TV, acceptance = sum min(p, q))
TABLES = [
    ([0.5, 0.5], [0.5, 0.5], 0.0, 1.0),  # identical: always accepted
    ([1.0, 0.0], [0.0, 1.0], 1.0, 0.0),  # disjoint supports: never accepted
    ([0.5, 0.5], [0.9, 0.1], 0.4, 0.6),  # the draft over-proposes token 0
    ([0.2, 0.3, 0.5], [0.5, 0.3, 0.2], 0.3, 0.7),  # mass moved between tokens 0 and 2
]


@pytest.mark.parametrize("p, q, tv, acceptance", TABLES)
def test_tables_by_hand(p, q, tv, acceptance):
    p, q = torch.tensor(p), torch.tensor(q)
    assert float(total_variation(p, q)) == pytest.approx(tv)
    assert float(acceptance_probability(p, q)) == pytest.approx(acceptance)


def test_greedy_acceptance_is_argmax_agreement():
    target = torch.tensor([[3.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    draft = torch.tensor([[2.0, 1.9, 0.0], [5.0, 1.0, 0.0]])
    assert greedy_acceptance(target, draft).tolist() == [1.0, 0.0]


def test_expected_tokens_along_a_continuation():
    # constant a far from the end: the closed form; at the end, nothing past the text is accepted
    a = torch.full((1000,), 0.8)
    assert expected_tokens_along(a, 4) == pytest.approx(expected_tokens(0.8, 4), rel=1e-2)
    assert expected_tokens_along(torch.tensor([1.0, 0.5]), 2) == pytest.approx(((1 + 1 + 0.5) + (1 + 0.5)) / 2)


@pytest.fixture(scope="module")
def metric():
    return evaluate.load(METRIC_PATH)


@pytest.mark.parametrize("p, q, tv, acceptance", TABLES)
def test_evaluate_metric_on_hand_built_tables(metric, p, q, tv, acceptance):
    result = metric.compute(target_probs=[p, p], draft_probs=[q, q], ks=[1, 3], cost_ratio=0.25)
    assert result["acceptance_rate"] == pytest.approx(acceptance)
    assert result["total_variation"] == pytest.approx(tv)
    assert result["num_positions"] == 2
    assert result["expected_tokens_per_pass"][3] == pytest.approx(expected_tokens(acceptance, 3))
    assert result["predicted_speedup"][1] == pytest.approx((1 + acceptance) / 1.25)


def test_evaluate_metric_rejects_bad_input(metric):
    with pytest.raises(ValueError, match="differ in shape"):
        metric.compute(target_probs=[[0.5, 0.5]], draft_probs=[[0.2, 0.3, 0.5]])
    with pytest.raises(ValueError, match="`draft_probs` must be a probability distribution"):
        metric.compute(target_probs=[[0.5, 0.5]], draft_probs=[[0.7, 0.7]])


@pytest.fixture(scope="module")
def pair():
    target = speculative(make_tiny_model(seed=40, vocab_size=8, num_layers=1, head_scale=3.0))
    return target, make_noisy_copy(target, seed=41, noise=0.8)


def prompts(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 8, (1, 4), generator=generator) for _ in range(count)]


@pytest.mark.parametrize("settings", [{"do_sample": False}, {"do_sample": True, "temperature": 0.7, "top_k": 4}])
def test_a_draft_with_the_target_weights_is_always_accepted(pair, settings):
    target, _ = pair
    inputs = prompts(4, seed=0)
    report = evaluate_draft(target, target, inputs, target_continuations(target, inputs, 12, settings), settings)
    assert report.acceptance_rate == pytest.approx(1.0)
    assert report.expected_tokens_per_pass[5] == pytest.approx(
        sum(expected_tokens_along(torch.ones(m), 5) * m for m in [12] * 4) / 48, rel=0.2)


def predicted_and_measured(pair, predict_settings: dict, measure_settings: dict):
    target, draft = pair
    inputs = prompts(48, seed=1)
    continuations = target_continuations(target, inputs, 24, measure_settings, seed=2)
    report = evaluate_draft(target, draft, inputs, continuations, predict_settings, ks=[1])
    measured = measure_draft(target, draft, inputs, 1, max_new_tokens=24, settings=measure_settings, seed=3)
    # Standard errors: the measured rate (binomial over rounds) and the predicted mean (over positions).
    a, n = measured.acceptance_rate, measured.stats.num_draft_tokens
    spread = torch.tensor(report.acceptance_by_sequence).std().item() / math.sqrt(len(inputs))
    return report.acceptance_rate, a, math.sqrt(a * (1 - a) / n + spread**2)


def test_prediction_matches_measured_acceptance(pair):
    settings = {"do_sample": True, "temperature": 1.0}
    predicted, measured, error = predicted_and_measured(pair, settings, settings)
    assert 0.2 < measured < 0.95, "the pair must exercise both outcomes"
    assert abs(predicted - measured) < 4 * error, (predicted, measured, error)


def test_negative_control_a_prediction_for_other_settings_is_caught(pair):
    """Predicting with a different temperature than decoding uses must not match the measurement."""
    predicted, measured, error = predicted_and_measured(pair, {"do_sample": True, "temperature": 0.3},
                                                        {"do_sample": True, "temperature": 1.0})
    assert abs(predicted - measured) > 4 * error, (predicted, measured, error)


def test_bad_inputs_are_named(pair, tmp_path):
    target, draft = pair
    with pytest.raises(ValueError, match="`prompts` is empty"):
        evaluate_draft(target, draft, [], [])
    with pytest.raises(ValueError, match="must pair up"):
        evaluate_draft(target, draft, prompts(2, 0), prompts(1, 0))
    data = tmp_path / "texts.jsonl"
    data.write_text('{"body": "def f(): pass"}\n')
    with pytest.raises(ValueError, match="has no column 'prompt'; its columns: \\['body'\\]"):
        load_texts(str(data), "prompt")
    with pytest.raises(ValueError, match="No texts selected"):
        load_texts(str(data), "body", offset=5)
    with pytest.raises(ValueError, match="neither a built-in name"):
        load_texts(str(tmp_path / "missing.jsonl"))
    assert load_texts(str(data), "body") == ["def f(): pass"]


def test_acceptance_is_reported_by_position_too(pair):
    target, draft = pair
    inputs = prompts(3, seed=4)
    settings = {"do_sample": True, "temperature": 1.0}
    continuations = target_continuations(target, inputs, 10, settings)
    report = evaluate_draft(target, draft, inputs, continuations, settings, ks=[3])
    assert [len(values) for values in report.acceptance_along_text] == [c.shape[1] for c in continuations]
    flat = [value for values in report.acceptance_along_text for value in values]
    assert all(0.0 <= value <= 1.0 + 1e-6 for value in flat)
    assert sum(flat) / len(flat) == pytest.approx(report.acceptance_rate, rel=1e-5)
    measured = measure_draft(target, draft, inputs, 3, max_new_tokens=10, settings=settings)
    by_block_position = measured.acceptance_by_position
    stats = measured.stats
    assert len(by_block_position) == 3
    assert by_block_position[0] == pytest.approx(stats.accepted_by_position[0] / stats.proposed_by_position[0])
    assert by_block_position == sorted(by_block_position, reverse=True), "reaching position j needs all before it"


def test_humaneval_solutions_are_each_prompt_and_its_canonical_solution():
    from hf_spec.loading.corpora import humaneval_problems

    problems = humaneval_problems()
    texts = load_texts("humaneval-solutions", offset=0, count=100)
    assert texts == [problem["prompt"] + problem["canonical_solution"] for problem in problems[:100]]
    assert load_texts("humaneval", count=3) == [problem["prompt"] for problem in problems[:3]]
