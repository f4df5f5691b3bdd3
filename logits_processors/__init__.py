"""One logits-processor chain, applied identically to the draft and the target of speculative decoding.

Speculative sampling is exact only if ``q`` is the exact law the draft sampled from and ``p`` is the law the target
alone would sample from, both after the *same* decoding transforms (temperature, top-k, top-p, penalties, user
processors), each position seeing its own prefix. This package takes a transformers ``LogitsProcessorList`` (the
chain ``generate()`` builds from a ``GenerationConfig`` plus any user ``logits_processor=``) and applies it:

- :func:`process_step`: to one position, as the draft drafts;
- :func:`process_block`: to a verification block ``[batch, k + 1, vocab]``, position ``i`` seeing
  ``prefix + block[:i]``, exactly as target-only decoding would have called the chain.

transformers' common processors have vectorized block implementations (:mod:`logits_processors.warpers`,
:mod:`logits_processors.prefix_dependent`); any other processor is called once per position. Add your own with
:func:`register_block_processor` or :func:`register_position_independent`.

It depends on torch and transformers only, and can be used without ``hf_spec``.
"""

from logits_processors import prefix_dependent, warpers  # noqa: F401  (they register the block implementations)
from logits_processors.chain import check_processors, process_block, process_step
from logits_processors.registry import (
    block_function_for,
    has_block_implementation,
    register_block_processor,
    register_position_independent,
)

__all__ = [
    "block_function_for",
    "check_processors",
    "has_block_implementation",
    "process_block",
    "process_step",
    "register_block_processor",
    "register_position_independent",
]
