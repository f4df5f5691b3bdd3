"""Goodness-of-fit of sampled token sequences against an exact, enumerated law."""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy import stats

#: Significance level: a correct sampler fails a test with probability 1e-4; a broken one must fail every time.
ALPHA = 1e-4


@dataclasses.dataclass
class FitResult:
    p_value: float
    total_variation: float
    tv_bound: float
    num_samples: int

    @property
    def is_consistent(self) -> bool:
        """Chi-square does not reject at ALPHA and the empirical TV is within its sampling-noise bound."""
        return self.p_value > ALPHA and self.total_variation < self.tv_bound


def fit_sequences(samples: np.ndarray, exact_law: np.ndarray) -> FitResult:
    """Compare ``samples`` ``[N, T]`` (token ids < V) with ``exact_law`` ``[V] * T`` (sums to 1).

    Chi-square on the V**T cells, pooling the cells whose expected count is below 5 into one. TV bound
    ``sqrt(cells / N)``: the empirical TV of a correct sampler has mean at most ``sqrt(cells / (2 pi N))``.
    """
    exact_law = exact_law / exact_law.sum()  # float32 model probabilities sum to 1 only up to rounding
    num_tokens = exact_law.ndim
    assert samples.ndim == 2 and samples.shape[1] == num_tokens, samples.shape
    num_samples = samples.shape[0]
    cells = np.ravel_multi_index(tuple(samples.T), exact_law.shape)
    observed = np.bincount(cells, minlength=exact_law.size).astype(float)
    expected = exact_law.reshape(-1) * num_samples
    is_small = expected < 5
    observed_pooled = np.append(observed[~is_small], observed[is_small].sum())
    expected_pooled = np.append(expected[~is_small], expected[is_small].sum())
    keep = expected_pooled > 1e-9
    # A sample in a cell of probability 0 is a certain failure.
    if np.any(observed_pooled[~keep] > 0):
        p_value = 0.0
    else:
        p_value = float(stats.chisquare(observed_pooled[keep], expected_pooled[keep]).pvalue)
    total_variation = 0.5 * float(np.abs(observed / num_samples - exact_law.reshape(-1)).sum())
    num_cells = int(np.count_nonzero(exact_law.reshape(-1) > 1e-9))
    return FitResult(p_value, total_variation, float(np.sqrt(num_cells / num_samples)), num_samples)
