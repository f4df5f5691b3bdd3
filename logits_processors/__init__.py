"""One logits-processor chain, applied identically to the draft and the target of speculative decoding.

Speculative sampling is exact only if ``q`` is the exact law the draft sampled from and ``p`` is the law the target
alone would sample from, both after the *same* decoding transforms (temperature, top-k, top-p, penalties, user
processors), each position seeing its own prefix. This package takes a transformers ``LogitsProcessorList`` (the
chain ``generate()`` builds from a ``GenerationConfig`` plus any user ``logits_processor=``) and applies it:

- :func:`process_step`: to one position, as the draft drafts;
- :func:`process_block`: to a verification block ``[batch, k + 1, vocab]``, position ``i`` seeing
  ``prefix + block[:i]``, exactly as target-only decoding would have called the chain.

It depends on torch and transformers only, and can be used without ``hf_spec``.
"""

from logits_processors.chain import process_block, process_step

__all__ = ["process_block", "process_step"]
