"""hf_spec: exact speculative decoding for Hugging Face Transformers.

    >>> from hf_spec import speculative
    >>> model = speculative(target)  # same object, generate() now speculates exactly
    >>> model.generate(**inputs, assistant_model=draft, do_sample=True, temperature=0.7)

The algorithm sits at the top of the package (mixin, validation, plan, decoding, rounds, verification, rejection,
traversal, rows, caches, conditioning, forward, stats, outputs, recording, compat) with `hf_spec.drafting` (the
drafters) and `hf_spec.sizing` (how much to draft). The tools sit in folders beside it and import the algorithm, never
the other way round: `hf_spec.heads` (draft heads: EAGLE-style, and EAGLE-3 in the speculators format),
`hf_spec.loading` (models, CPU kernels, quantization), `hf_spec.evaluation` (draft fit, distillation, texts, the model
zoo), `hf_spec.bench`, `hf_spec.cli`.
The acceptance rules' pure functions are in `hf_spec.rejection` and `hf_spec.traversal` (trees).
"""

from pathlib import Path

from hf_spec.drafting.base import Drafter
from hf_spec.drafting.tree import TreeDrafter
from hf_spec.mixin import SpeculativeGenerationMixin, speculative, without_speculation
from hf_spec.outputs import SpeculativeDecoderOnlyOutput, SpeculativeEncoderDecoderOutput
from hf_spec.saved_layers import WeightOnlyConfig  # noqa: F401 (registers the saved layers' format with transformers)
from hf_spec.sizing.draft_length import AutoDraftLength
from hf_spec.sizing.tree_size import AutoTreeSize
from hf_spec.stats import SpeculativeStats

__version__ = "0.2.0"
#: ``model.generate(..., custom_generate=hf_spec.CUSTOM_GENERATE, trust_remote_code=True)`` runs hf_spec on a model
#: that was never made `speculative` (transformers' ``custom_generate`` convention; `hf_spec/custom_generate/`).
CUSTOM_GENERATE = str(Path(__file__).parent)

__all__ = [
    "CUSTOM_GENERATE",
    "AutoDraftLength",
    "AutoTreeSize",
    "DraftHead",
    "Drafter",
    "Eagle3Head",
    "SpeculativeDecoderOnlyOutput",
    "SpeculativeEncoderDecoderOutput",
    "SpeculativeGenerationMixin",
    "SpeculativeStats",
    "TreeDrafter",
    "load_pair",
    "prepare_pair",
    "speculative",
    "without_speculation",
]


def __getattr__(name: str):
    """The tools' entry points are imported on first use: ``import hf_spec`` loads the algorithm only."""
    if name in ("DraftHead", "Eagle3Head"):
        import hf_spec.heads

        return getattr(hf_spec.heads, name)
    if name in ("load_pair", "prepare_pair"):
        from hf_spec.loading import pair

        return getattr(pair, name)
    raise AttributeError(f"module 'hf_spec' has no attribute {name!r}")
