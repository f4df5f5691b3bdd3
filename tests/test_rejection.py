"""The acceptance rule on hand-built tables and on a Markov-chain "model" with an exact law.

Tier 1 (hand-built rows, a comment on each) and tier 2 (statistical, vectorized over many rows, each with
negative controls that must fail).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_spec.evaluation.exactness import fit_sequences
from hf_spec.rejection import (
    NOT_EMITTED,
    _assemble_output,
    accept_block,
    accept_draft_tokens,
    accept_greedy,
    sample_from_weights,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- tier 1: hand-built tables ------------------------------------------------------------------------------------


def test_draft_equal_to_target_accepts_everything_and_adds_a_bonus():
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.0, 1.0, 0.0]]])  # [1, k + 1 = 3, 3]
    draft_ids = torch.tensor([[0, 2]])
    output_ids, num_accepted = accept_draft_tokens(draft_ids, p[:, :2], p, _gen())
    assert num_accepted.tolist() == [2]
    assert output_ids.tolist() == [[0, 2, 1]]  # the bonus comes from p_3, a point mass on token 1


def test_token_the_target_cannot_emit_is_rejected_even_with_a_zero_uniform(monkeypatch):
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])  # p_1 gives token 0 probability 0
    q = torch.tensor([[[1.0, 0.0]]])  # the draft proposed token 0 with certainty
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.zeros(*args[0], dtype=torch.float64))
    output_ids, num_accepted = accept_draft_tokens(torch.tensor([[0]]), q, p, _gen())
    assert num_accepted.tolist() == [0]
    assert output_ids.tolist() == [[1, NOT_EMITTED]]  # recovered from max(0, p - q) = token 1


def test_draft_token_with_zero_draft_probability_is_rejected_without_nan():
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])
    q = torch.tensor([[[0.0, 1.0]]])  # contract violation: token 0 "drafted" with q = 0
    output_ids, num_accepted = accept_draft_tokens(torch.tensor([[0]]), q, p, _gen())
    assert num_accepted.tolist() == [0]
    assert output_ids[0, 0].item() == 0  # the residual max(0, p - q) is a point mass on token 0


def test_residual_of_identical_laws_falls_back_to_p_instead_of_normalizing_zero():
    p = torch.tensor([[[0.25, 0.75], [1.0, 0.0]]])
    q = p[:, :1].clone()
    # p == q: rejection has probability 0; force the residual path by hand-building a rejection (q > p on token 1).
    q_forced = torch.tensor([[[0.25, 0.75 + 1e-7]]])
    for _ in range(20):
        output_ids, _ = accept_draft_tokens(torch.tensor([[1]]), q_forced, p, _gen(_))
        assert output_ids[0, 0].item() in (0, 1)
    output_ids, num_accepted = accept_draft_tokens(torch.tensor([[1]]), q, p, _gen())
    assert num_accepted.tolist() == [1] and output_ids.tolist() == [[1, 0]]


def test_zero_draft_tokens_samples_one_token_from_p():
    p = torch.tensor([[[0.0, 0.0, 1.0]]])
    output_ids, num_accepted = accept_draft_tokens(torch.empty(1, 0, dtype=torch.long), torch.empty(1, 0, 3), p, _gen())
    assert output_ids.tolist() == [[2]] and num_accepted.tolist() == [0]


def test_greedy_keeps_the_matching_prefix_then_the_target_token():
    scores = torch.tensor([[[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0], [0.0, 9.0, 0.0]]])  # argmax 1, 0, 2, 1
    output_ids, num_accepted = accept_greedy(torch.tensor([[1, 0, 1]]), scores)  # third draft token differs
    assert num_accepted.tolist() == [2]
    assert output_ids.tolist() == [[1, 0, 2, NOT_EMITTED]]
    output_ids, num_accepted = accept_greedy(torch.tensor([[1, 0, 2]]), scores)  # all match: bonus argmax 1
    assert output_ids.tolist() == [[1, 0, 2, 1]] and num_accepted.tolist() == [3]


def test_sample_from_weights_never_picks_a_zero_weight_and_matches_proportions():
    weights = torch.tensor([[0.0, 2.0, 0.0, 6.0]]).expand(200_000, 4)  # unnormalized: 1/4 and 3/4
    samples = sample_from_weights(weights, _gen())
    counts = torch.bincount(samples, minlength=4).double() / samples.numel()
    assert counts[0] == 0 and counts[2] == 0
    assert abs(counts[3].item() - 0.75) < 0.005


def test_sample_from_weights_at_the_top_of_the_uniform_range_stays_on_a_positive_weight(monkeypatch):
    """u as close to 1 as float64 allows, times a total that rounds: the draw is the last positive weight, never a
    trailing zero-weight index and never out of range."""
    from hf_spec import rejection

    monkeypatch.setattr(rejection.torch, "rand", lambda shape, **kwargs: torch.full(shape, 1 - 2**-53,
                                                                                     dtype=torch.float64))
    weights = torch.tensor([[0.1, 0.2, 0.0, 0.0], [0.3, 0.0, 0.7, 0.0]])
    assert sample_from_weights(weights).tolist() == [1, 2]


def test_same_generator_seed_reproduces_the_same_tokens():
    p = torch.softmax(torch.randn(4, 4, 10, generator=_gen(1)), dim=-1)
    q = torch.softmax(torch.randn(4, 3, 10, generator=_gen(2)), dim=-1)
    draft_ids = sample_from_weights(q, _gen(3))
    first = accept_draft_tokens(draft_ids, q, p, _gen(7))
    second = accept_draft_tokens(draft_ids, q, p, _gen(7))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


# ---- tier 2: statistical exactness on a Markov-chain model --------------------------------------------------------
# The "models" are Markov chains: target p(x | previous token) and draft q(x | previous token). The output stream of
# repeated rounds must have the law of the chain p: P(z1, z2, z3) = p(z1 | s) p(z2 | z1) p(z3 | z2).

VOCAB = 5
NUM_TOKENS = 3  # more than k = 2, so bonus tokens and a second round are covered


def _chains(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = _gen(seed)
    p = torch.softmax(2.0 * torch.randn(VOCAB, VOCAB, generator=generator), dim=-1)  # [prev, next]
    q = torch.softmax(2.0 * torch.randn(VOCAB, VOCAB, generator=generator), dim=-1)
    p[:, 3] = 0  # a token the target never emits ...
    q[0, 3] = 0.3  # ... that the draft proposes after token 0
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _draft_block(q_chain, previous: torch.Tensor, k: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(draft_ids [rows, k], draft_probs [rows, k, vocab])``: k tokens of the draft chain after ``previous``."""
    draft_ids, draft_probs, context = [], [], previous
    for _ in range(k):
        probs = q_chain[context]  # [rows, vocab]
        context = sample_from_weights(probs, generator)
        draft_probs.append(probs)
        draft_ids.append(context)
    return torch.stack(draft_ids, dim=1), torch.stack(draft_probs, dim=1)


def _run_stream(accept, p_chain, q_chain, k, num_rows, generator) -> np.ndarray:
    """First NUM_TOKENS tokens of each row's speculative stream, rows started from token 0: ``[rows, NUM_TOKENS]``."""
    rows = torch.arange(num_rows)
    previous = torch.zeros(num_rows, dtype=torch.long)
    stream = torch.zeros(num_rows, NUM_TOKENS, dtype=torch.long)
    count = torch.zeros(num_rows, dtype=torch.long)
    while (count < NUM_TOKENS).any():
        draft_ids, draft_probs = _draft_block(q_chain, previous, k, generator)
        contexts = torch.cat([previous.unsqueeze(1), draft_ids], dim=1)  # [rows, k + 1]
        output_ids, num_accepted = accept(draft_ids, draft_probs, p_chain[contexts], generator)
        for j in range(k + 1):
            is_new = (j <= num_accepted) & (count < NUM_TOKENS)
            stream[rows[is_new], count[is_new]] = output_ids[is_new, j]
            count += is_new.long()
        previous = output_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return stream.numpy()


def _exact_law(p_chain: torch.Tensor) -> np.ndarray:
    p = p_chain.double().numpy()
    return np.einsum("a,ab,bc->abc", p[0], p, p)


def _always_accept(draft_ids, draft_probs, target_probs, generator):
    k = draft_ids.shape[1]
    return accept_draft_tokens(draft_ids, draft_probs, torch.cat([draft_probs, target_probs[:, k:]], 1), generator)


def resample_from_p(draft_ids, draft_probs, target_probs, generator):
    output_ids, num_accepted = accept_draft_tokens(draft_ids, draft_probs, target_probs, generator)
    at = num_accepted.view(-1, 1, 1).expand(-1, 1, target_probs.shape[-1])
    from_p = sample_from_weights(target_probs.gather(1, at).squeeze(1), generator)
    is_rejected = num_accepted < draft_ids.shape[1]
    rejected_ids = output_ids[is_rejected]
    output_ids[is_rejected] = rejected_ids.scatter(1, num_accepted[is_rejected, None], from_p[is_rejected, None])
    return output_ids, num_accepted


def _bonus_from_wrong_position(draft_ids, draft_probs, target_probs, generator):
    k = draft_ids.shape[1]
    shifted = torch.cat([target_probs[:, :k], target_probs[:, k - 1 : k]], dim=1)
    return accept_draft_tokens(draft_ids, draft_probs, shifted, generator)


def _q_from_wrong_row(draft_ids, draft_probs, target_probs, generator):
    return accept_draft_tokens(draft_ids, draft_probs.roll(1, dims=0), target_probs, generator)


@pytest.mark.parametrize("rule", [accept_draft_tokens, accept_block], ids=lambda f: f.__name__)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_stream_has_the_target_law(rule, k):
    p_chain, q_chain = _chains(seed=0)
    samples = _run_stream(rule, p_chain, q_chain, k, 100_000, _gen(k if rule is accept_draft_tokens else 20 + k))
    result = fit_sequences(samples, _exact_law(p_chain))
    assert result.is_consistent, result


@pytest.mark.parametrize(
    "broken", [_always_accept, resample_from_p, _bonus_from_wrong_position, _q_from_wrong_row],
    ids=lambda f: f.__name__,
)
def test_negative_control_broken_sampler_is_caught(broken):
    p_chain, q_chain = _chains(seed=0)
    samples = _run_stream(broken, p_chain, q_chain, 2, 100_000, _gen(11))
    result = fit_sequences(samples, _exact_law(p_chain))
    assert not result.is_consistent, result


def test_acceptance_rate_is_one_minus_total_variation():
    p_chain, q_chain = _chains(seed=0)
    num_rows = 200_000
    context = torch.zeros(num_rows, dtype=torch.long)
    draft_ids = sample_from_weights(q_chain[context], _gen(5)).unsqueeze(1)
    target_probs = torch.stack([p_chain[context], p_chain[draft_ids[:, 0]]], dim=1)
    _, num_accepted = accept_draft_tokens(draft_ids, q_chain[context].unsqueeze(1), target_probs, _gen(6))
    expected = 1 - 0.5 * (p_chain[0] - q_chain[0]).abs().sum().item()
    assert abs(num_accepted.double().mean().item() - expected) < 4 * (0.25 / num_rows) ** 0.5


# ---- block verification --------------------------------------------------------------------------------------------

def _broken_block(scan_first_failure: bool, kept_weight_one: bool):
    """Block verification with one thing wrong: the stop chosen by the first failed test (token-wise scan order)
    instead of the last passed one, or the residuals and stop chances computed as if p_i were always 1."""

    def accept(draft_ids, draft_probs, target_probs, generator):
        batch_size, k = draft_ids.shape
        p_of = target_probs[:, :k].gather(-1, draft_ids[..., None])[..., 0].double()
        q_of = draft_probs.gather(-1, draft_ids[..., None])[..., 0].double()
        kept = [torch.ones(batch_size, dtype=torch.float64)]
        for i in range(k):
            kept.append((kept[-1] * p_of[:, i] / q_of[:, i]).clamp(max=1.0))
        kept = torch.ones(batch_size, k + 1, dtype=torch.float64) if kept_weight_one else torch.stack(kept, 1)
        residuals = (kept[..., None] * target_probs.double()
                     - torch.nn.functional.pad(draft_probs, (0, 0, 0, 1)).double()).clamp_min(0)
        mass = residuals.sum(-1)
        stop = torch.where(mass + 1 - kept > 0, mass / (mass + 1 - kept).clamp_min(1e-300), 0.0)
        passed = torch.rand((batch_size, k), dtype=torch.float64, generator=generator) < stop[:, 1:]
        if scan_first_failure:
            num_accepted = torch.where(passed.all(1), k, (~passed).long().argmax(1))
        else:
            num_accepted = torch.nn.functional.pad(torch.where(passed, torch.arange(1, k + 1), 0), (1, 0)).amax(-1)
        residual = residuals[torch.arange(batch_size), num_accepted]
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual,
                               target_probs[torch.arange(batch_size), num_accepted].double())
        return _assemble_output(draft_ids, num_accepted, sample_from_weights(residual, generator)), num_accepted

    accept.__name__ = "first_failure_scan" if scan_first_failure else "kept_weight_one"
    return accept


@pytest.mark.parametrize("broken", [_broken_block(True, False), _broken_block(False, True)],
                         ids=lambda f: f.__name__)
def test_negative_control_broken_block_verification_is_caught(broken):
    p_chain, q_chain = _chains(seed=0)
    samples = _run_stream(broken, p_chain, q_chain, 3, 100_000, _gen(31))
    result = fit_sequences(samples, _exact_law(p_chain))
    assert not result.is_consistent, result


def test_block_verification_keeps_at_least_as_many_tokens_as_token_wise():
    """In expectation over blocks of the chain: more kept tokens per round (Sun et al.'s Theorem 2), here by a margin
    far outside the sampling error; one draft token (k = 1) keeps the same."""
    p_chain, q_chain = _chains(seed=0)
    num_rows = 200_000
    means = {}
    for k in (1, 4):
        draft_ids, draft_probs = _draft_block(q_chain, torch.zeros(num_rows, dtype=torch.long), k, _gen(40 + k))
        target_probs = p_chain[torch.cat([torch.zeros(num_rows, 1, dtype=torch.long), draft_ids], 1)]
        for name, rule in (("token", accept_draft_tokens), ("block", accept_block)):
            means[name, k] = rule(draft_ids, draft_probs, target_probs, _gen(50))[1].double().mean().item()
    error = 4 * (4.0 / num_rows) ** 0.5
    assert abs(means["block", 1] - means["token", 1]) < error
    assert means["block", 4] > means["token", 4] + error, means


@pytest.mark.parametrize("k, broken", [(1, False), (2, False), (3, False), (2, True)])
def test_block_verification_laws_give_the_target_law_exactly(k, broken):
    """Not statistical: every block of k draft tokens enumerated, the law of the round's output (tau and the emitted
    token from `block_laws`, tau the last passed stop test), continued by the target to k + 1 tokens, summed over the
    blocks by their draft probability, equals the target's law of k + 1 tokens to rounding. Negative control
    (``broken``): stop wherever a residual exists (h_i without its 1 - p_i term) is far from it."""
    import itertools

    from hf_spec.rejection import block_laws

    p_chain, q_chain = (law.double() / law.double().sum(-1, keepdim=True) for law in _chains(seed=3))
    blocks = torch.tensor(list(itertools.product(range(VOCAB), repeat=k)))  # [V^k, k]
    contexts = torch.cat([torch.zeros(len(blocks), 1, dtype=torch.long), blocks], 1)  # [V^k, k + 1]
    draft_probs, target_probs = q_chain[contexts[:, :k]], p_chain[contexts]
    stop, residuals = block_laws(blocks, draft_probs, target_probs)
    stop = (stop > 0).double() if broken else stop
    law = np.zeros((VOCAB,) * (k + 1))
    for row, block in enumerate(blocks.tolist()):
        weight = float(draft_probs[row].gather(-1, blocks[row, :, None]).prod())
        for tau in range(k + 1):  # P(tau) = h_tau * prod_{j > tau} (1 - h_j), h_0 = 1
            chance = (1.0 if tau == 0 else float(stop[row, tau])) * float((1 - stop[row, tau + 1:]).prod())
            if chance == 0:
                continue
            emitted = residuals[row, tau] / residuals[row, tau].sum()
            for y in range(VOCAB):
                prefix, previous = [*block[:tau], y], y
                for rest in itertools.product(range(VOCAB), repeat=k - tau):  # the target continues alone
                    probability, last = 1.0, previous
                    for token in rest:
                        probability, last = probability * float(p_chain[last, token]), token
                    law[tuple(prefix + list(rest))] += weight * chance * float(emitted[y]) * probability
    exact = p_chain[0].numpy()
    for _ in range(k):
        exact = np.einsum("...a,ab->...ab", exact, p_chain.numpy())
    assert (np.abs(law - exact).max() > 1e-3) if broken else (np.abs(law - exact).max() < 1e-12)


@pytest.mark.parametrize("rule", [accept_draft_tokens, accept_block])
def test_the_reach_is_the_chance_to_keep_each_prefix_of_the_draft(rule):
    """The reach a rule reports for a fixed draft equals the frequency with which it keeps at least j tokens of that
    draft over its own uniforms (60,000 draws of each of 4 drafts of the chain, within 4 standard errors), and it
    is 1, non-increasing, for every row. Negative control: the other rule's reach, for the same drafts, lies outside
    those bounds somewhere (block verification keeps later tokens that token-wise rejection drops)."""
    p_chain, q_chain = _chains(seed=0)
    k, num_draws = 4, 60_000
    draft_ids, draft_probs = _draft_block(q_chain, torch.zeros(4, dtype=torch.long), k, _gen(60))
    target_probs = p_chain[torch.cat([torch.zeros(4, 1, dtype=torch.long), draft_ids], 1)]
    _, _, reach = rule(draft_ids, draft_probs, target_probs, _gen(61), with_reach=True)  # [4, k + 1]
    assert reach.dtype == torch.float64 and reach.shape == (4, k + 1)
    assert (reach[:, 0] == 1).all() and (reach[:, 1:] <= reach[:, :-1]).all(), reach
    other = accept_block if rule is accept_draft_tokens else accept_draft_tokens
    other_reach = other(draft_ids, draft_probs, target_probs, _gen(61), with_reach=True)[2]
    is_other_off = False
    for row in range(4):
        repeat = (lambda tensor: tensor[row:row + 1].expand(num_draws, *tensor.shape[1:]))
        _, num_accepted = rule(repeat(draft_ids), repeat(draft_probs), repeat(target_probs), _gen(62 + row))
        frequency = torch.stack([(num_accepted >= j).double().mean() for j in range(k + 1)])  # [k + 1]
        bound = 4 * (frequency * (1 - frequency) / num_draws).sqrt() + 1e-3
        assert ((frequency - reach[row]).abs() <= bound).all(), (row, frequency, reach[row])
        is_other_off |= bool(((frequency - other_reach[row]).abs() > bound).any())
    assert is_other_off, (reach, other_reach)


def test_the_reach_of_a_draft_the_target_cannot_emit_stops_there():
    """A drafted token the target gives probability 0 is never kept: the reach is 0 from there on, under both rules
    (block verification's later tokens cannot make up for it, since its kept mass p_i is 0)."""
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]])
    q = torch.tensor([[[0.4, 0.3, 0.3], [0.3, 0.3, 0.4]]])
    for rule in (accept_draft_tokens, accept_block):
        _, num_accepted, reach = rule(torch.tensor([[2, 1]]), q, p, _gen(), with_reach=True)
        assert reach.tolist() == [[1.0, 0.0, 0.0]] and num_accepted.item() == 0, rule
