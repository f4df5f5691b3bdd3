"""The arithmetic of speculative decoding's speed-up (Leviathan et al. 2023), in one place.

With a_i the probability that the draft token at block position i is accepted given that the ones before it were
(a_i = 1 - TV(p_i, q_i) in expectation), a round drafting k tokens emits in expectation

    E[tokens](k) = 1 + a_0 + a_0 a_1 + ... + a_0 ... a_{k-1}      (= (1 - a^(k+1)) / (1 - a) when every a_i = a)

and, with c the cost of a draft step and b the cost of a (k+1)-token target pass, both in target decode steps,
runs at E[tokens](k) / (k c + b) times the speed of target-only decoding (b = 1 in the paper's model).
"""

from __future__ import annotations

from collections.abc import Sequence


def fully_accepted(acceptance: float | Sequence[float], k: int) -> float:
    """P(all k drafted tokens accepted) = a_0 a_1 ... a_{k-1} (1 for k = 0)."""
    total = 1.0
    for i in range(k):
        total *= acceptance if isinstance(acceptance, (int, float)) else acceptance[i]
    return total


def expected_tokens(acceptance: float | Sequence[float], k: int) -> float:
    """E[tokens per target pass] drafting k tokens; ``acceptance`` is a or the per-position a_0, a_1, ..."""
    return sum(fully_accepted(acceptance, i) for i in range(k + 1))


def round_cost(k: int, cost_ratio: float, block_cost: float = 1.0) -> float:
    """k c + b: a round's cost in target decode steps (k draft steps, one (k+1)-token target pass)."""
    return k * cost_ratio + block_cost


def predicted_speedup(acceptance: float | Sequence[float], k: int, cost_ratio: float, block_cost: float = 1.0) -> float:
    """E[tokens](k) / (k c + b): speed relative to target-only decoding."""
    return expected_tokens(acceptance, k) / round_cost(k, cost_ratio, block_cost)


def acceptance_from_tokens_per_pass(tokens_per_pass: float, k: int) -> float:
    """The constant a whose E[tokens](k) is ``tokens_per_pass`` (clipped to [1, k + 1]), by bisection."""
    target = min(max(tokens_per_pass, 1.0), k + 1.0)
    low, high = 0.0, 1.0
    for _ in range(60):  # E[tokens] increases with a
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, k) < target else (low, middle)
    return (low + high) / 2
