"""Each use of transformers' private API (`hf_spec.compat`, `logits_processors.compat`) against the pinned version:
a transformers upgrade that breaks one fails here by name."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_model
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_spec import compat


def test_generate_still_routes_assisted_decoding_to_the_overridden_hooks():
    compat.check_generation_hooks()  # raises ImportError otherwise


def test_pad_token_tensor_is_what_generate_resolved():
    model = make_tiny_model(seed=0)
    config = GenerationConfig(pad_token_id=3, eos_token_id=5)
    model._prepare_special_tokens(config, True, device="cpu")
    assert int(compat.pad_token_tensor(config)) == 3


def test_decoding_chain_is_transformers_own_chain():
    model = make_tiny_model(seed=0)
    chain = compat.decoding_chain(model, {"do_sample": True, "temperature": 0.7, "top_k": 3}, torch.tensor([[1, 2]]))
    assert isinstance(chain, LogitsProcessorList)
    assert {type(p) for p in chain} >= {TemperatureLogitsWarper, TopKLogitsWarper}


def test_modules_kept_in_full_precision_include_the_output_embeddings():
    assert "lm_head" in compat.modules_kept_in_full_precision(make_tiny_model(seed=0))


def test_drop_gguf_quantizer_makes_a_model_saveable(tmp_path):
    model = make_tiny_model(seed=0)
    model.hf_quantizer = object()
    model.config.quantization_config = {"quant_method": "gguf"}
    compat.drop_gguf_quantizer(model)
    assert model.hf_quantizer is None and not hasattr(model.config, "quantization_config")
    model.save_pretrained(tmp_path)


def test_processor_internals_read_by_the_block_implementations():
    bad_words = NoBadWordsLogitsProcessor([[2, 1]], eos_token_id=0)
    compat.prepare_sequence_bias(bad_words, torch.zeros(1, 16))
    assert bad_words.prepared_bias_variables and bad_words.multi_token_biases is not None
    constrained = PrefixConstrainedLogitsProcessor(lambda batch_id, ids: [int(ids[-1]) + 1], num_beams=1)
    assert compat.num_beams(constrained) == 1
    assert compat.prefix_allowed_tokens(constrained, 0, torch.tensor([4, 5])) == [6]


@pytest.mark.parametrize("name", sorted(compat.OVERRIDDEN_METHODS))
def test_overridden_methods_keep_the_parameters_hf_spec_relies_on(name):
    import inspect

    from transformers import GenerationMixin

    parameters = inspect.signature(getattr(GenerationMixin, name)).parameters
    assert set(compat.OVERRIDDEN_METHODS[name]) <= set(parameters)


def test_a_transformers_newer_than_the_tested_range_warns_once_naming_it():
    newest = compat.TESTED_TRANSFORMERS[1]
    major, minor = map(int, newest.split("."))
    with pytest.warns(UserWarning, match=f"tested with transformers {compat.TESTED_TRANSFORMERS[0]} to {newest}"):
        assert compat.warn_if_untested(f"{major}.{minor + 1}.0") is not None
    assert compat.warn_if_untested(f"{newest}.3") is None  # a patch release of the newest tested minor
    assert compat.warn_if_untested(f"{compat.TESTED_TRANSFORMERS[0]}.0") is None


def test_setup_cfg_requires_the_oldest_tested_transformers_and_caps_nothing():
    from pathlib import Path

    setup = (Path(__file__).parent.parent / "setup.cfg").read_text()
    assert f"transformers>={compat.TESTED_TRANSFORMERS[0]}\n" in setup
    assert "transformers<" not in setup.replace(" ", "")


def test_whispers_overridden_method_keeps_the_parameters_hf_spec_relies_on():
    import inspect

    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    for name, expected in compat.WHISPER_OVERRIDES.items():
        assert set(expected) <= set(inspect.signature(getattr(WhisperGenerationMixin, name)).parameters)
    source = inspect.getsource(WhisperGenerationMixin.generate)
    assert "generation_config.begin_suppress_tokens = None" in source, "Whisper no longer drops them: drop the override"


def test_continuous_batching_engine_and_paged_rollback():
    engine = compat.continuous_batching()
    assert hasattr(engine.Manager, "_create_batch_processor") and hasattr(engine.Processor, "update_batch")
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    config = ContinuousBatchingConfig(num_blocks=8, page_size=4, max_memory_percent=0.1, max_batch_tokens=16)
    cache = engine.PagedAttentionCache(make_tiny_model(seed=0).config, config, "cpu",
                                       DistributedHelper(device_mesh=None, cpu_group_timeout=None), dtype=torch.float32)
    allocator = cache.cache_allocators[engine.FULL_ATTENTION]
    assert cache.can_store_request_tokens(engine.RequestState(request_id="r", initial_tokens=[]), 10)  # 3 pages of 4
    assert len(allocator.block_table["r"]) == 3
    free = cache.pool.count_free_blocks(allocator.index)
    compat.truncate_paged_request(cache, "r", 5)  # 2 pages kept, 1 back to the pool
    assert len(allocator.block_table["r"]) == 2
    assert cache.pool.count_free_blocks(allocator.index) == free + 1
    cache.free_blocks("r")
    assert cache.pool.count_free_blocks(allocator.index) == free + 3


def test_request_ids_and_the_cached_manager():
    model = make_tiny_model(seed=0)
    assert compat.cached_batching_manager(model) is None
    manager = model.init_continuous_batching(GenerationConfig(max_new_tokens=2, eos_token_id=-1))
    first, second = compat.next_request_id(manager), compat.next_request_id(manager)
    assert (first, second) == ("req_0", "req_1")
    manager.output_router.result_handlers["r"] = (print, None)  # what register_result_handler leaves until the end
    compat.drop_result_handler(manager, "r")
    compat.drop_result_handler(manager, "r")  # a second time: nothing left, no error
    assert "r" not in manager.output_router.result_handlers
    assert manager._create_batch_processor and compat.continuous_batching().Processor._generation_step
