"""Checking exactness by statistics: the target's enumerated law of the first few tokens against samples.

The exact reference: for a tiny target (a vocabulary of a few ids) the processed next-token law on every prefix of up
to ``num_tokens - 1`` generated tokens gives the joint law of the first ``num_tokens`` generated tokens
(`exact_law`). Speculative samples are compared with it by a chi-square test and the total variation
(`fit_sequences`). The test suite uses these on every processor chain, each with a negative control that must fail;
``scripts/device_check.py`` runs a subset on an accelerator.

The negative control they share is `RESAMPLE_FROM_P`, a broken `hf_spec.verification.Verification` passed to
``generate(verification=...)``: a rejection resamples from p instead of the residual max(0, p - q), which a test of
enough samples must catch. `broken_rules` builds a test's own broken rules the same way.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch
from transformers import LogitsProcessorList, PreTrainedModel

from hf_spec.compat import decoding_chain
from hf_spec.extras import require
from hf_spec.forward import input_names
from hf_spec.rejection import accept_draft_tokens, accept_tree, sample_from_weights
from hf_spec.traversal import traversal_stops
from hf_spec.verification import TOKEN, Verification

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


def fit_sequences(samples: np.ndarray, exact: np.ndarray) -> FitResult:
    """Compare ``samples`` ``[N, T]`` (token ids < V) with the law ``exact`` ``[V] * T`` (sums to 1).

    Chi-square on the V**T cells, pooling the cells whose expected count is below 5 into one. TV bound
    ``sqrt(cells / N)``: the empirical TV of a correct sampler has mean at most ``sqrt(cells / (2 pi N))``.
    """
    stats = require("scipy.stats", "test", "The exactness test")

    exact = exact / exact.sum()  # float32 model probabilities sum to 1 only up to rounding
    if samples.ndim != 2 or samples.shape[1] != exact.ndim:
        raise ValueError(f"`samples` must have shape [N, {exact.ndim}], but has {samples.shape}.")
    num_samples = samples.shape[0]
    cells = np.ravel_multi_index(tuple(samples.T), exact.shape)
    observed = np.bincount(cells, minlength=exact.size).astype(float)
    expected = exact.reshape(-1) * num_samples
    is_small = expected < 5
    observed_pooled = np.append(observed[~is_small], observed[is_small].sum())
    expected_pooled = np.append(expected[~is_small], expected[is_small].sum())
    keep = expected_pooled > 1e-9
    if np.any(observed_pooled[~keep] > 0):  # a sample in a cell of probability 0 is a certain failure
        p_value = 0.0
    else:
        p_value = float(stats.chisquare(observed_pooled[keep], expected_pooled[keep]).pvalue)
    total_variation = 0.5 * float(np.abs(observed / num_samples - exact.reshape(-1)).sum())
    num_cells = int(np.count_nonzero(exact.reshape(-1) > 1e-9))
    return FitResult(p_value, total_variation, float(np.sqrt(num_cells / num_samples)), num_samples)


@torch.no_grad()
def exact_law(model: PreTrainedModel, settings: dict, prompt: torch.Tensor, num_tokens: int,
              user_processors: list | None = None, model_inputs: dict | None = None) -> np.ndarray:
    """``[V] * num_tokens``: P(first ``num_tokens`` generated tokens) under target-only sampling of ``prompt``
    ``[1, S]`` with ``settings`` (plus ``do_sample=True``), through transformers' own processor chain.

    ``model_inputs``: what else every pass reads, for one row (an encoder's inputs, an image); ``prompt`` is then
    the decoder's prompt (an encoder-decoder's decoder start). Prefixes of probability 0 are not run (a suppressed
    image placeholder in a prefix would not match the image)."""
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    chain = decoding_chain(model, {"do_sample": True, **settings}, prompt,
                           LogitsProcessorList(user_processors or []))
    ids_name = input_names(type(model)).ids
    path_probs = np.ones(1)  # P(prefix) for every prefix of the current depth, in itertools.product order
    for depth in range(num_tokens):
        combinations = list(itertools.product(range(vocab_size), repeat=depth))
        live = np.flatnonzero(path_probs > 0)
        prefixes = torch.tensor([combinations[i] for i in live], dtype=torch.long, device=prompt.device)
        ids = torch.cat([prompt.expand(len(live), -1), prefixes.view(len(live), depth)], dim=1)
        extra = {name: value.expand(len(live), *value.shape[1:]) for name, value in (model_inputs or {}).items()}
        logits = model(**{ids_name: ids}, **extra).logits[:, -1].float()
        probs = np.zeros((len(combinations), vocab_size))  # [prefixes, V]: p(next | prefix)
        probs[live] = chain(ids, logits).softmax(-1).double().cpu().numpy()
        path_probs = (path_probs.reshape(-1, 1) * probs).reshape(-1)
    return path_probs.reshape([vocab_size] * num_tokens)


def expected_tree_depths(token_ids: torch.Tensor, parents: list[int], draft_probs: torch.Tensor,
                         target_probs: torch.Tensor) -> tuple[float, float]:
    """``(node by node, traversal)``: the expected accepted depth of one tree under each sampled tree rule, exactly
    (`hf_spec.rejection.accept_tree`, `hf_spec.traversal.accept_traversal`; arguments as theirs)."""
    tokens, depths = token_ids.tolist(), [0] * len(parents)
    for node, parent in enumerate(parents):
        depths[node] = 1 if parent < 0 else depths[parent] + 1

    def node_by_node(node: int, residual: torch.Tensor) -> float:
        # child j is reached when the earlier ones were rejected and kept with min(1, r(x_j) / q_j(x_j))
        expected, reach = 0.0, 1.0
        for child in [c for c, parent in enumerate(parents) if parent == node]:
            law = draft_probs[child].double()
            q, r = float(law[tokens[child]]), float(residual[tokens[child]])
            keep = min(1.0, r / q) if q > 0 else 0.0
            expected += reach * keep * (1 + node_by_node(child, target_probs[child + 1].double()))
            reach *= 1 - keep
            leftover = (residual - law).clamp_min(0)
            residual = leftover / leftover.sum() if leftover.sum() > 0 else residual
        return expected

    traversal, passed = 0.0, 1.0
    for stop in traversal_stops(token_ids, parents, draft_probs, target_probs):
        traversal += passed * stop.chance * (0 if stop.node < 0 else depths[stop.node])
        passed *= 1 - stop.chance
    return node_by_node(-1, target_probs[0].double()), traversal


def resample_from_p(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Broken on purpose (a chain rule, as `hf_spec.rejection.accept_draft_tokens`): a rejection resamples from p
    instead of normalize(max(0, p - q))."""
    output_ids, num_accepted = accept_draft_tokens(draft_ids, draft_probs, target_probs, generator)
    for row, j in enumerate(num_accepted.tolist()):
        if j < draft_ids.shape[1]:
            output_ids[row, j] = sample_from_weights(target_probs[row, j], generator)
    return output_ids, num_accepted


def tree_resample_from_p(token_ids: torch.Tensor, parents: list[int], draft_probs: torch.Tensor,
                         target_probs: torch.Tensor, generator: torch.Generator | None = None):
    """Broken on purpose (a tree rule, as `hf_spec.rejection.accept_tree`): where every child of the path's last
    node was rejected, the next token comes from p instead of the residual."""
    path, _ = accept_tree(token_ids, parents, draft_probs, target_probs, generator)
    last = path[-1] if path else -1
    return path, sample_from_weights(target_probs[last + 1], generator)


def broken_rules(chain=None, tree=None, name: str = "broken") -> Verification:
    """A `Verification` that runs ``chain`` and ``tree`` where given (the token-wise rules elsewhere): how a
    statistical test passes a broken rule to ``generate(verification=...)``."""
    return Verification(chain or TOKEN.chain, tree or TOKEN.tree, name, name)


#: The shared negative control: every rejection resamples from p (chains and trees).
RESAMPLE_FROM_P = broken_rules(resample_from_p, tree_resample_from_p, "resample from p")
