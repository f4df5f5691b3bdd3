"""Goodness-of-fit of sampled token sequences against an exact, enumerated law (`hf_spec.evaluation.exactness`)."""

from hf_spec.evaluation.exactness import ALPHA, FitResult, fit_sequences

__all__ = ["ALPHA", "FitResult", "fit_sequences"]
