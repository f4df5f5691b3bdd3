"""Serving: exact speculation inside transformers' continuous batching (`batching`), behind
``model.init_continuous_batching(assistant_model=...)`` and ``model.generate_batch(..., assistant_model=...)`` of a
model made speculative (docs/serving.md)."""

from __future__ import annotations

import copy
from typing import Any

from transformers import GenerationConfig, PreTrainedModel

from hf_spec.compat import cached_batching_manager
from hf_spec.serving.batching import REQUEST_SETTINGS, SpeculativeBatchingManager

__all__ = ["REQUEST_SETTINGS", "SpeculativeBatchingManager", "speculative_batching_manager"]

#: The draft length when neither the call nor the generation config names one: per request and step
#: (`hf_spec.sizing.batch`).
DEFAULT_NUM_ASSISTANT_TOKENS = "auto"


def speculative_batching_manager(model: PreTrainedModel, assistant_model: Any,
                                 generation_config: GenerationConfig | None = None, continuous_batching_config=None,
                                 workload_hints=None, num_assistant_tokens: int | None = None, verification=None):
    """What ``model.init_continuous_batching(assistant_model=...)`` returns: a manager whose steps speculate."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cached = cached_batching_manager(model)
    if cached is not None:
        if isinstance(cached, SpeculativeBatchingManager) and cached.draft is assistant_model:
            return cached
        raise ValueError("The model keeps a continuous-batching manager from an earlier session with another "
                         "`assistant_model` (or none); call `model.destroy_cached_continuous_batching_manager()` "
                         "first.")
    generation_config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    if generation_config.eos_token_id is None:  # as transformers' init_continuous_batching: no EOS
        generation_config.eos_token_id = -1
    if num_assistant_tokens is None:
        configured = getattr(generation_config, "num_assistant_tokens", None)  # 0 is a setting: no drafting
        num_assistant_tokens = DEFAULT_NUM_ASSISTANT_TOKENS if configured is None else configured
    return SpeculativeBatchingManager(model, assistant_model, generation_config,
                                      continuous_batching_config or ContinuousBatchingConfig(), workload_hints,
                                      num_assistant_tokens, verification)
