"""Tiny random-weight Llama models: the built-in pair (``load_pair("tiny", "tiny")``, ``hf-spec generate --target tiny
--draft tiny``), its character tokenizer, and the test suite's models (real models: `hf_spec.loading.pretrained`).

Built from a config in milliseconds, offline. Every dimension is a multiple of 64, so bitsandbytes can quantize
them on every CPU class (its fused AVX512-BF16 4-bit kernel needs that; see `hf_spec.loading.quantization`).
Exactness holds for any weights, so these exercise every part of speculative decoding (acceptance, rejection, bonus
tokens, rollback); having random weights, they produce no meaningful text and no speed-up worth quoting.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

#: Vocabulary of the built-in pair (tests also use 4, 8 and 16).
TINY_VOCAB_SIZE = 64
#: The tiny tokenizer's symbols: id 0 ends a text (and pads), 1 stands for any other character, then one id each.
TINY_SYMBOLS = ("<|endoftext|>", "<unk>", " ", "\n", *"abcdefghijklmnopqrstuvwxyz0123456789",
                *".,:;()[]{}=+-*/_'\"#<>!?%")


def build_tiny_model(seed: int, vocab_size: int = TINY_VOCAB_SIZE, num_layers: int = 2, head_scale: float = 6.0,
                     weight_std: float | None = None) -> LlamaForCausalLM:
    """A random Llama (hidden size 64, MLP 128, 4 heads, 2 key-value heads) in float32 on the CPU, in eval mode.

    Args:
        seed: seeds the weights; the caller's random state is left alone.
        head_scale: the LM head is multiplied by it, so next-token laws are peaked (as in trained models) and differ
            between seeds.
        weight_std: when given, every weight matrix is drawn from N(0, weight_std^2) instead of transformers' init.
    """
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=None, pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        if weight_std is not None:
            generator = torch.Generator().manual_seed(seed)
            for parameter in (p for p in model.parameters() if p.dim() >= 2):  # norm scales stay 1
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * weight_std)
        model.lm_head.weight.mul_(head_scale)
    return model


def noisy_copy(model: LlamaForCausalLM, seed: int, noise: float) -> LlamaForCausalLM:
    """A draft close to ``model``: each weight plus Gaussian noise of ``noise`` times that tensor's own standard
    deviation (0: the same weights, acceptance 1; larger: lower acceptance)."""
    if noise < 0:
        raise ValueError(f"`noise` must be >= 0, but is {noise!r}.")
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * noise * parameter.std())
    return draft


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny pair's tokenizer: one id per character (lowercased; others are ``<unk>``), `TINY_VOCAB_SIZE` ids,
    ``<|endoftext|>`` as EOS and padding, a plain chat template. Text in, text out: random text, from random models."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    assert len(TINY_SYMBOLS) == TINY_VOCAB_SIZE, len(TINY_SYMBOLS)
    backend = Tokenizer(models.WordLevel({symbol: i for i, symbol in enumerate(TINY_SYMBOLS)}, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>", padding_side="left")
    tokenizer.chat_template = ("{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}> {% endif %}")
    return tokenizer


def build_tiny_pair(seed: int = 0, draft_noise: float = 0.03) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """``(target, draft)``: a random Llama (vocabulary 64) and a perturbed copy of it.

    Args:
        seed: seeds the target's weights and the draft's perturbation.
        draft_noise: the perturbation, relative to each weight tensor's standard deviation; larger values lower the
            acceptance rate.
    """
    if draft_noise < 0:
        raise ValueError(f"`draft_noise` must be >= 0, but is {draft_noise}.")
    target = build_tiny_model(seed, head_scale=5.0, weight_std=0.1)
    return target, noisy_copy(target, seed + 1, draft_noise)


#: The tiny draft of another tokenizer (`tiny_other_tokenizer`): what ``$HF_SPEC_MODELS=tiny`` loads in place of a
#: built-in draft with a tokenizer of its own, so that a cross-tokenizer example runs offline as one.
TINY_OTHER_TOKENIZER = "tiny-other-tokenizer"
#: Its merges: pairs of the tiny symbols frequent in code, each one token of its own.
_MERGES = ("de", "ef", "f ", "re", "ur", "rn", "in", "  ", "(n", "n)", "):", "se", "lf", "et", "or")


def tiny_other_tokenizer() -> PreTrainedTokenizerFast:
    """A second tokenizer for the tiny pair's text: BPE over the same symbols plus `_MERGES`, so a draft using it reads
    the same text in other tokens (fewer of them), as a real draft of another family does."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {symbol: i for i, symbol in enumerate(TINY_SYMBOLS)}
    vocab.update({merged: len(TINY_SYMBOLS) + i for i, merged in enumerate(_MERGES)})
    backend = Tokenizer(models.BPE(vocab, [(merged[0], merged[1]) for merged in _MERGES], unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", padding_side="left")


def build_tiny_other_tokenizer_draft(seed: int = 0) -> LlamaForCausalLM:
    """A random Llama over `tiny_other_tokenizer`'s vocabulary (79 ids): the tiny target's draft of another
    tokenizer."""
    return build_tiny_model(seed + 1, vocab_size=TINY_VOCAB_SIZE + len(_MERGES), head_scale=5.0, weight_std=0.1)
