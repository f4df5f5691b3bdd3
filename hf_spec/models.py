"""The built-in tiny pair (``hf-spec generate --target tiny --draft tiny``; real models: `hf_spec.pretrained`).

Built from a config in milliseconds, offline: a small random-weight Llama target and a draft made from it by
perturbing its weights, so that the draft agrees with the target often but not always. It exercises every part of speculative decoding (acceptance, rejection, bonus tokens,
rollback) but, having random weights, produces no meaningful text and no speed-up worth quoting.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_spec.mixin import speculative

TINY_VOCAB_SIZE = 64


def build_tiny_pair(seed: int = 0, draft_noise: float = 0.03) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """``(target, draft)``: a speculative-ready random Llama and a perturbed copy of it, in float32 on the CPU.

    Args:
        seed: seeds the target's weights and the draft's perturbation.
        draft_noise: standard deviation of the perturbation, relative to each weight tensor's own; larger values
            lower the acceptance rate.
    """
    if draft_noise < 0:
        raise ValueError(f"`draft_noise` must be >= 0, but is {draft_noise}.")
    generator = torch.Generator().manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=None, pad_token_id=None,
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in target.parameters():
            if parameter.dim() >= 2:  # weight matrices; norm scales stay 1
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        target.lm_head.weight.mul_(5.0)  # peaked next-token laws, as in trained models
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for parameter in (p for p in draft.parameters() if p.dim() >= 2):
            parameter.add_(torch.randn(parameter.shape, generator=generator) * draft_noise * parameter.std())
    return speculative(target), draft
