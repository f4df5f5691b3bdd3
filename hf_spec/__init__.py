"""hf_spec: exact speculative decoding for Hugging Face Transformers.

    >>> from hf_spec import speculative
    >>> model = speculative(target)  # same object, generate() now speculates exactly
    >>> model.generate(**inputs, assistant_model=draft, do_sample=True, temperature=0.7)
"""

from hf_spec.draft_length import AutoDraftLength
from hf_spec.mixin import SpeculativeDecoderOnlyOutput, SpeculativeGenerationMixin, speculative, without_speculation
from hf_spec.rejection import accept_draft_tokens, accept_greedy, sample_from_weights
from hf_spec.stats import SpeculativeStats

__all__ = [
    "AutoDraftLength",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeGenerationMixin",
    "SpeculativeStats",
    "accept_draft_tokens",
    "accept_greedy",
    "sample_from_weights",
    "speculative",
    "without_speculation",
]
