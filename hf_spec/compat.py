"""Every use of transformers' private API, in one place: an upgrade of transformers is one file to review.

Each helper names the private attribute, method or function it reaches; ``tests/test_compat.py`` checks each one
against the pinned transformers version. Outside this module hf_spec reaches no private transformers name, with one
exception by construction: `hf_spec.mixin` overrides the two private `GenerationMixin` methods named in
`OVERRIDDEN_METHODS`, and `check_generation_hooks` fails at import time if transformers stops routing to them.
`logits_processors` (importable on its own) keeps its uses of processor internals in
`logits_processors.compat`; they are re-exported here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings

import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GENERATION_MODES_MAPPING

from logits_processors.compat import encoder_ngram_bans, num_beams, prefix_allowed_tokens, prepare_sequence_bias

__all__ = [
    "OVERRIDDEN_METHODS",
    "TESTED_TRANSFORMERS",
    "WHISPER_OVERRIDES",
    "attention_implementation",
    "cached_batching_manager",
    "check_generation_hooks",
    "continuous_batching",
    "decoding_chain",
    "drop_gguf_quantizer",
    "drop_result_handler",
    "encoder_ngram_bans",
    "forgetting_output_capture",
    "ignores_recurrent_recording",
    "is_rewired_by_universal_assisted_generation",
    "merged_generation_config",
    "modules_kept_in_full_precision",
    "next_request_id",
    "num_beams",
    "pad_token_tensor",
    "prefix_allowed_tokens",
    "prepare_sequence_bias",
    "records_recurrent_states",
    "tensor_parallel_mesh",
    "truncate_paged_request",
]

#: The oldest and the newest transformers minor releases hf_spec is tested with (CI runs the whole suite on the newest
#: and the exactness and greedy core on the oldest); ``setup.cfg`` requires the oldest and caps nothing.
TESTED_TRANSFORMERS = ("5.24", "5.25")


def warn_if_untested(version: str = transformers.__version__) -> str | None:
    """Warn once (at import) when the installed transformers is newer than the newest tested minor release; returns
    the message. A changed private hook still fails loudly (`check_generation_hooks`)."""
    minor = Version(version).release[:2]
    if minor <= Version(TESTED_TRANSFORMERS[1]).release[:2]:
        return None
    message = (f"hf_spec is tested with transformers {TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[1]}, and "
               f"{version} is newer; it checks the hooks it relies on at import, and `python -m pytest` in its "
               "repository runs its exactness tests on your versions.")
    warnings.warn(message, stacklevel=2)
    return message


#: The private `GenerationMixin` methods `hf_spec.mixin.SpeculativeGenerationMixin` overrides, with the parameters
#: it relies on.
OVERRIDDEN_METHODS = {
    "_assisted_decoding": ("input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus",
                           "streamer", "inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer"),
    "_validate_generation_mode": ("generation_mode", "generation_config", "generation_mode_kwargs"),
}


#: Whisper's private method `hf_spec.mixin.SpeculativeGenerationMixin` overrides to put back the call's
#: ``begin_suppress_tokens`` (Whisper's generate() drops them whenever an assistant is in the call), with the
#: parameters it relies on; ``tests/test_compat.py`` checks them.
WHISPER_OVERRIDES = {"_retrieve_logit_processors": ("generation_config", "logits_processor", "begin_index",
                                                    "num_beams", "device")}


def check_generation_hooks() -> None:
    """Raise ``ImportError`` unless ``generate(assistant_model=...)`` still routes to ``_assisted_decoding`` and both
    overridden methods keep the parameters hf_spec relies on: better to fail at import than to run transformers'
    non-exact loop silently."""
    if GENERATION_MODES_MAPPING.get(GenerationMode.ASSISTED_GENERATION) != "_assisted_decoding":
        raise ImportError(
            "hf_spec hooks transformers' `_assisted_decoding`, which this transformers version no longer routes to; "
            "install a supported version (see setup.cfg)."
        )
    for name, expected in OVERRIDDEN_METHODS.items():
        method = getattr(GenerationMixin, name, None)
        parameters = set(inspect.signature(method).parameters) if method is not None else set()
        missing = [parameter for parameter in expected if parameter not in parameters]
        if missing:
            raise ImportError(f"transformers' `GenerationMixin.{name}` lacks {missing}; install a supported version.")


def pad_token_tensor(generation_config: GenerationConfig) -> torch.Tensor | None:
    """The pad id ``generate()`` resolved for this call (``pad_token_id``, else an ``eos_token_id``), as a tensor:
    ``generation_config._pad_token_tensor``."""
    return generation_config._pad_token_tensor


def merged_generation_config(model: PreTrainedModel, generation_config: GenerationConfig | None,
                             kwargs: dict) -> GenerationConfig:
    """The generation config a ``generate(generation_config=..., **kwargs)`` call will run with (a copy): the call's
    settings over ``generation_config`` over the model's over transformers' defaults,
    ``GenerationMixin._prepare_generation_config``."""
    return model._prepare_generation_config(generation_config, **kwargs)[0]


def decoding_chain(model: PreTrainedModel, settings: dict, prompt_ids: torch.Tensor,
                   logits_processor: LogitsProcessorList | None = None) -> LogitsProcessorList:
    """The processor chain ``model.generate(prompt_ids, **settings)`` would build, by transformers' own code:
    ``_prepare_generation_config``, ``_prepare_special_tokens``, ``_get_logits_processor``."""
    generation_config, _ = model._prepare_generation_config(None, **settings)
    model._prepare_special_tokens(generation_config, True, device=prompt_ids.device)
    return model._get_logits_processor(
        generation_config=generation_config, input_ids_seq_length=prompt_ids.shape[1], encoder_input_ids=prompt_ids,
        logits_processor=logits_processor or LogitsProcessorList(), device=prompt_ids.device, model_kwargs={},
    )


def modules_kept_in_full_precision(model: PreTrainedModel) -> list[str]:
    """Names of the modules transformers' bitsandbytes quantizer leaves unquantized by default (the output
    embeddings, tied weights, the last module, ``_keep_in_fp32_modules``):
    ``transformers.quantizers.base.get_keys_to_not_convert``."""
    from transformers.quantizers.base import get_keys_to_not_convert

    return list(get_keys_to_not_convert(model)) + list(getattr(model, "_keep_in_fp32_modules", None) or [])


def drop_gguf_quantizer(model: PreTrainedModel) -> None:
    """Make a model loaded from GGUF (already dequantized to float) saveable: ``save_pretrained`` refuses it while
    ``model.hf_quantizer`` and ``config.quantization_config`` are set."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def is_rewired_by_universal_assisted_generation(model: PreTrainedModel) -> bool:
    """Whether transformers' universal assisted generation (sampling with another tokenizer) replaced ``model``'s
    embeddings in place: ``_PruneReindexingLMHead`` and ``_MapInputEmbedding`` of
    ``transformers.generation.candidate_generator``, which stay after the call."""
    from transformers.generation import candidate_generator

    rewired = (getattr(candidate_generator, "_PruneReindexingLMHead", ()),
               getattr(candidate_generator, "_MapInputEmbedding", ()))
    return isinstance(model.get_output_embeddings(), rewired) or isinstance(model.get_input_embeddings(), rewired)


def attention_implementation(model: PreTrainedModel) -> str:
    """The attention kernel the model runs ("sdpa", "eager", "flash_attention_2", ...): the private
    ``config._attn_implementation``, which decides the form a custom 4D attention mask must take."""
    return str(model.config.get_text_config()._attn_implementation or "eager")


def records_recurrent_states() -> bool:
    """Whether transformers' caches record a recurrent layer's state after each token of a pass, so that ``crop``
    rolls it back (transformers 5.25 on): ``LinearAttentionCacheLayerMixin.activate_past_recording`` takes
    ``recurrent_states_to_keep``."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    parameters = inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
    return "recurrent_states_to_keep" in parameters


def ignores_recurrent_recording(model: PreTrainedModel) -> bool:
    """Whether the model's recurrent layers update their state without honouring transformers' recurrent-state
    recording: its modeling module calls ``update_recurrent_state`` but never reads ``get_recurrent_states_to_keep``
    (the hook through which a pass hands the cache the state after each token). Read from the module's source, once
    per class, since the layers only show what they record after a pass."""
    return _source_ignores_recording(type(model))


@functools.cache
def _source_ignores_recording(model_class: type) -> bool:
    module = inspect.getmodule(model_class)  # hf_spec's speculative subclass keeps the class's module
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return False
    return "update_recurrent_state" in source and "get_recurrent_states_to_keep" not in source


#: The flag transformers sets on a model (and each model inside it) once it has put its output-capturing hooks on the
#: submodules (`transformers.utils.output_capturing`), and the module those hooks' functions come from.
_CAPTURE_FLAG = "_output_capturing_hooks_installed"
_CAPTURE_MODULE = "transformers.utils.output_capturing"


@contextlib.contextmanager
def forgetting_output_capture(model: torch.nn.Module):
    """Within the block, a model asked for hidden states (a draft head's features) gets transformers' capturing hooks
    as usual; on leaving, the hooks the block put on are taken off again. transformers installs them once per model
    as local functions and keeps them, and a model holding local functions no longer pickles: a call of hf_spec must
    not leave a model that pickled before it unpicklable. Hooks that were there before the block stay."""
    flagged_before = {id(module) for module in model.modules() if _CAPTURE_FLAG in module.__dict__}
    try:
        yield
    finally:
        for flagged in [module for module in model.modules()
                        if _CAPTURE_FLAG in module.__dict__ and id(module) not in flagged_before]:
            for module in flagged.modules():
                for key, hook in tuple(module._forward_hooks.items()):
                    if getattr(hook, "__module__", None) == _CAPTURE_MODULE:
                        del module._forward_hooks[key]
            delattr(flagged, _CAPTURE_FLAG)


def tensor_parallel_mesh(model):
    """The ``torch.distributed`` device mesh a model loaded with ``tp_plan`` is sharded over, when over several ranks,
    else ``None``. Reaches ``PreTrainedModel._tp_size`` and ``_device_mesh`` (its ``"tp"`` dimension where named)."""
    if (getattr(model, "_tp_size", None) or 1) <= 1 or getattr(model, "_device_mesh", None) is None:
        return None
    mesh = model._device_mesh
    return mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else mesh


def continuous_batching():
    """transformers' continuous-batching engine (`transformers.generation.continuous_batching`), the module that
    `hf_spec.serving` extends: its manager, batch processor, paged cache, input builder and request states.
    `hf_spec.serving.batching` overrides the manager's private ``_create_batch_processor`` and the processor's
    ``_generation_step``, and reads the processor's ``model_runner``, ``inputs_and_outputs`` and ``scheduler``.
    ``ImportError`` naming the installed release where it lacks them."""
    try:
        from transformers.generation.continuous_batching import continuous_api, requests
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
        from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    except ImportError as error:
        raise ImportError(f"Speculative continuous batching needs transformers' continuous-batching engine, which "
                          f"transformers {transformers.__version__} lacks ({error}); install transformers "
                          f"{TESTED_TRANSFORMERS[1]}.") from error
    import types

    return types.SimpleNamespace(
        Manager=continuous_api.ContinuousBatchingManager, Processor=continuous_api.ContinuousBatchProcessor,
        PagedAttentionCache=PagedAttentionCache, IOs=ContinuousBatchingIOs, RequestState=requests.RequestState,
        RequestStatus=requests.RequestStatus, FutureRequestState=requests.FutureRequestState,
        FULL_ATTENTION=FULL_ATTENTION)


def truncate_paged_request(cache, request_id: str, length: int) -> None:
    """Give a request's paged-cache blocks past its first ``length`` tokens back to the pool: the rollback of a
    `PagedAttentionCache` (transformers has none). Reaches each allocator's ``block_table``, ``tokens_per_page``,
    ``ledger`` and ``pool``; the request's ``position_offset`` (set by the caller) is what bounds its reads."""
    for allocator in cache.cache_allocators.values():
        blocks = allocator.block_table.get(request_id)
        if blocks is None:
            continue
        keep = -(-length // allocator.tokens_per_page)  # ceil
        dropped, blocks[keep:] = blocks[keep:], []
        allocator.pool.free_blocks(allocator.index, [block for block in dropped if allocator.ledger.release(block)])


def cached_batching_manager(model):
    """The continuous-batching manager a model keeps from an earlier session (``persistent_manager=True``), or
    ``None``: ``model._cached_continuous_batching_manager``."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def drop_result_handler(manager, request_id: str) -> None:
    """Forget the result handler of a request that was cancelled (transformers drops it only once the request
    finishes): ``ContinuousBatchingManager.output_router.result_handlers`` under its ``_lock``."""
    router = manager.output_router
    with router._lock:
        router.result_handlers.pop(request_id, None)


def next_request_id(manager) -> str:
    """The id ``add_request`` would give a request without one (``req_N``), taken under the manager's lock:
    ``ContinuousBatchingManager._request_lock`` and ``_request_counter``."""
    with manager._request_lock:
        request_id = f"req_{manager._request_counter}"
        manager._request_counter += 1
    return request_id
