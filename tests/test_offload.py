"""A target spread over the CPU and the disk by accelerate's big-model inference (``device_map`` with ``"disk"``,
``offload_folder``) speculates exactly: greedy equal to its own ``generate()`` on a ragged batch, and the sampled law
with its negative control."""

from __future__ import annotations

import pytest
import torch
from helpers import CASES, exact_law, left_padded, make_noisy_copy, sample_speculative, small_target_model
from transformers import AutoModelForCausalLM

from hf_spec import speculative
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, fit_sequences

pytest.importorskip("accelerate")
#: Half the decoder and the output layer on the disk, the rest in memory.
DEVICE_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
              "model.rotary_emb": "cpu", "lm_head": "disk"}


def offloaded(model, folder):
    model.save_pretrained(folder / "model")
    device_map = {name: place for name, place in DEVICE_MAP.items()
                  if name != "model.layers.1" or model.config.num_hidden_layers > 1}
    loaded = AutoModelForCausalLM.from_pretrained(folder / "model", device_map=device_map,
                                                  offload_folder=folder / "offload")
    assert "disk" in loaded.hf_device_map.values() and loaded.lm_head.weight.device.type == "meta"
    return speculative(loaded)


def test_greedy_equals_the_offloaded_targets_own_output_on_a_ragged_batch(tmp_path):
    from hf_spec.loading.tiny import build_tiny_pair

    target, draft = build_tiny_pair(3)
    target = offloaded(target, tmp_path)
    ids, mask = left_padded([[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [3, 4, 5, 6, 7]])
    settings = {"attention_mask": mask, "max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    own = target.generate(ids, **settings)
    output = target.generate(ids, assistant_model=draft, num_assistant_tokens=4, return_dict_in_generate=True,
                             **settings)
    assert torch.equal(output.sequences, own)
    assert output.speculative_stats.acceptance_rate > 0.5  # the draft is accepted: the rollback is exercised


def test_the_offloaded_target_samples_its_law_and_the_negative_control_fails(tmp_path):
    plain = small_target_model()
    draft = make_noisy_copy(plain, seed=12, noise=1.0)
    target = offloaded(plain, tmp_path)
    k, settings, processors = CASES["temperature_0.7_top_k"]
    law = exact_law(plain, settings, processors)
    assert fit_sequences(sample_speculative(target, draft, settings, processors, k, seed=4), law).is_consistent
    broken = sample_speculative(target, draft, settings, processors, k, seed=4, verification=RESAMPLE_FROM_P)
    assert not fit_sequences(broken, law).is_consistent
