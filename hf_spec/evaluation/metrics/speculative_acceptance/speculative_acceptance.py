"""`evaluate` metric: expected speculative-decoding acceptance from target and draft next-token distributions.

    >>> import evaluate
    >>> from hf_spec.evaluation.draft_fit import METRIC_PATH
    >>> metric = evaluate.load(METRIC_PATH)  # a local path: no Hub
    >>> metric.compute(target_probs=[[0.5, 0.5]], draft_probs=[[0.9, 0.1]], ks=[1, 4], cost_ratio=0.1)
    {'acceptance_rate': 0.6, 'total_variation': 0.4, 'expected_tokens_per_pass': {1: 1.6, 4: ...}, ...}

Each example is one position: the target's processed law p and the draft's q over the same vocabulary. The
acceptance rate is the mean of sum_x min(p(x), q(x)) = 1 - TV(p, q) (with ``greedy=True``: the share of positions
where argmax p = argmax q); the expected tokens per target pass for each k and the predicted speed-up for a draft /
target cost ratio follow from it (`hf_spec.sizing.speedup`, positions treated as independent). To compute p and q from
models and text, use `hf_spec.evaluation.draft_fit.evaluate_draft`, which this metric's numbers agree with.
"""

import datasets
import evaluate
import torch

from hf_spec.evaluation.draft_fit import acceptance_probability, greedy_acceptance, total_variation
from hf_spec.sizing.speedup import expected_tokens, predicted_speedup

_CITATION = """\
@inproceedings{leviathan2023fast,
  title={Fast Inference from Transformers via Speculative Decoding},
  author={Leviathan, Yaniv and Kalman, Matan and Matias, Yossi},
  booktitle={ICML}, year={2023}
}
"""

_KWARGS_DESCRIPTION = """
Args:
    target_probs: per position, the target's next-token probabilities (a list of floats summing to 1).
    draft_probs: per position, the draft's, over the same vocabulary.
    ks: draft lengths to report expected tokens per pass for (default 1, 2, 3, 4, 5).
    cost_ratio: draft step / target step; with it, the predicted speed-up per k.
    block_cost: a (k+1)-token target pass / a target step (default 1).
    greedy: acceptance of greedy decoding (argmax agreement) instead of sampling.
Returns:
    acceptance_rate, total_variation, num_positions, expected_tokens_per_pass {k: float},
    predicted_speedup {k: float} or None.
"""


@evaluate.utils.file_utils.add_start_docstrings(__doc__, _KWARGS_DESCRIPTION)
class SpeculativeAcceptance(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "target_probs": datasets.Sequence(datasets.Value("float64")),
                "draft_probs": datasets.Sequence(datasets.Value("float64")),
            }),
        )

    def _compute(self, target_probs, draft_probs, ks=(1, 2, 3, 4, 5), cost_ratio=None, block_cost=1.0, greedy=False):
        if not target_probs:
            raise ValueError("No positions: `target_probs` and `draft_probs` are empty.")
        p = torch.tensor(target_probs, dtype=torch.float64)  # [positions, V]
        q = torch.tensor(draft_probs, dtype=torch.float64)
        if p.shape != q.shape:
            raise ValueError(f"`target_probs` {tuple(p.shape)} and `draft_probs` {tuple(q.shape)} differ in shape.")
        for name, probs in (("target_probs", p), ("draft_probs", q)):
            if (probs < 0).any() or not torch.allclose(probs.sum(-1), torch.ones(len(probs), dtype=probs.dtype),
                                                         atol=1e-6):
                raise ValueError(f"Each row of `{name}` must be a probability distribution (>= 0, summing to 1).")
        accepted = greedy_acceptance(p, q) if greedy else acceptance_probability(p, q)
        rate = float(accepted.mean())
        return {
            "acceptance_rate": rate,
            "total_variation": float(total_variation(p, q).mean()),
            "num_positions": len(p),
            "expected_tokens_per_pass": {k: expected_tokens(rate, k) for k in ks},
            "predicted_speedup": None if cost_ratio is None else {
                k: predicted_speedup(rate, k, cost_ratio, block_cost) for k in ks
            },
        }
