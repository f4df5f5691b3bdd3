"""hf_spec: exact speculative decoding for Hugging Face Transformers.

    >>> from hf_spec import speculative
    >>> model = speculative(target)  # same object, generate() now speculates exactly
    >>> model.generate(**inputs, assistant_model=draft, do_sample=True, temperature=0.7)

The algorithm sits at the top of the package (mixin, validation, decoding, rejection, rows, caches, forward, stats,
recording); `hf_spec.drafting` holds the drafters and the choice of k (and of a tree's size). The tools sit in
folders beside it: `hf_spec.loading` (models), `hf_spec.evaluation` (draft fit, distillation, corpora, the metric),
`hf_spec.bench`, `hf_spec.cli`. Modules moved there from the top level still import under their old names
(`hf_spec.moved`).
"""

from hf_spec import moved
from hf_spec.drafting.draft_length import AutoDraftLength
from hf_spec.drafting.tree_size import AutoTreeSize
from hf_spec.mixin import SpeculativeDecoderOnlyOutput, SpeculativeGenerationMixin, speculative, without_speculation
from hf_spec.rejection import accept_draft_tokens, accept_greedy, sample_from_weights
from hf_spec.stats import SpeculativeStats

moved.install()

__all__ = [
    "AutoDraftLength",
    "AutoTreeSize",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeGenerationMixin",
    "SpeculativeStats",
    "accept_draft_tokens",
    "accept_greedy",
    "sample_from_weights",
    "speculative",
    "without_speculation",
]
