"""Shared fixtures: tiny random-weight Llama models (milliseconds per forward) and one thread per test process."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_spec import speculative

torch.set_num_threads(1)


def make_tiny_model(seed: int, vocab_size: int = 16, num_layers: int = 2, head_scale: float = 6.0) -> LlamaForCausalLM:
    """A random Llama; the LM head is scaled so its next-token laws are peaked and differ between seeds."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def make_noisy_copy(model: LlamaForCausalLM, seed: int, noise: float) -> LlamaForCausalLM:
    """A draft close to ``model``: its weights plus Gaussian noise (acceptance between 0 and 1)."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * noise * parameter.std())
    return draft


@pytest.fixture(scope="session")
def target():
    return speculative(make_tiny_model(seed=0))


@pytest.fixture(scope="session")
def random_draft():
    return make_tiny_model(seed=1)


@pytest.fixture(scope="session")
def close_draft(target):
    return make_noisy_copy(target, seed=2, noise=0.5)


def pytest_report_header(config) -> list[str]:
    """Which CPU path this run takes: the instruction-set flags that decide bf16 speed, oneDNN's use and
    bitsandbytes' 4-bit path (packed for AVX512-BF16, dequantizing otherwise)."""
    from hf_spec.measure import machine_info

    machine = machine_info()
    lines = [f"cpu: {machine['cpu']}; flags: {', '.join(machine['cpu_bf16_flags']) or 'none of avx2/avx512/amx'}; "
             f"class: {machine['cpu_class']}",
             f"torch {machine['torch']} (cpu capability {torch.backends.cpu.get_cpu_capability()}, oneDNN "
             f"{'available' if torch.backends.mkldnn.is_available() else 'unavailable'}), "
             f"transformers {machine['transformers']}"]
    try:
        from hf_spec.quantization import packs_4bit_for_cpu

        lines.append("bitsandbytes 4-bit CPU path: "
                     + ("packed (fused AVX512-BF16 kernel)" if packs_4bit_for_cpu() else "dequantizing (AVX2)"))
    except ImportError:
        lines.append("bitsandbytes: not installed")
    return lines
