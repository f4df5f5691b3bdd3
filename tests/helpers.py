"""Helpers the test modules share: tiny models, a letters tokenizer, ragged prompts, and the exactness harness.

Test modules import these from here, never from one another (``conftest.py`` holds the fixtures).

The exactness harness: the target's processed next-token law on every prefix of up to two generated tokens (the
chain that transformers' target-only sampling builds, applied by transformers) gives the joint law of the first
three generated tokens (`exact_law`); `sample_speculative` draws speculative samples to compare with it
(`hf_spec.evaluation.exactness.fit_sequences`). Three tokens is more than most block lengths here, so bonus tokens and
second rounds are covered.
"""

from __future__ import annotations

import string

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast

from hf_spec.evaluation.exactness import exact_law as enumerated_law
from hf_spec.loading.tiny import build_tiny_model, noisy_copy

# --- Models and inputs -------------------------------------------------------------------------------------------


def make_tiny_model(seed: int, vocab_size: int = 16, num_layers: int = 2, head_scale: float = 6.0):
    """A random Llama (`hf_spec.loading.tiny`); the LM head is scaled so its laws are peaked and differ by seed."""
    return build_tiny_model(seed, vocab_size=vocab_size, num_layers=num_layers, head_scale=head_scale)


make_noisy_copy = noisy_copy  # a draft close to a model: its weights plus Gaussian noise


def letters_tokenizer(vocab_size: int = 16) -> PreTrainedTokenizerFast:
    """Token i is the letter string.ascii_lowercase[i]; text is the letters joined."""
    vocab = {letter: i for i, letter in enumerate(string.ascii_lowercase[:vocab_size])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


PAD = 0
PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4,
           5, 9, 0, 4, 5, 2, 3, 5, 3]]  # lengths 3, 7, 12, 20


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention mask)``, each ``[batch, longest]``, the prompts padded on the left with `PAD`."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


# --- Draft heads ----------------------------------------------------------------------------------------------------


def head_reference_laws(target, head, row_ids: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """``[k, V]``: a draft head's raw laws for a row's drafts, from scratch: one target pass over the whole unpadded
    row for the features, then the head over every pair without a cache, feeding its own h back at drafted
    positions (`hf_spec.heads.base`'s interface: any head architecture)."""
    with torch.no_grad():
        hidden = target(row_ids[None], output_hidden_states=head.config.feature_layers).hidden_states
        features = torch.cat([hidden[i] for i in head.config.feature_layers], dim=-1)[:, :-1]  # [1, n - 1, F]
        fused = head.read_features(features)
        tokens, laws = row_ids[1:], []
        for i in range(draft_ids.shape[0]):
            output = head(tokens[None], predicted=fused)
            laws.append(torch.softmax(output.logits[0, -1].float(), dim=-1))
            tokens = torch.cat([tokens, draft_ids[i: i + 1]])
            fused = torch.cat([fused, output.hidden_states[:, -1:]], dim=1)
    return torch.stack(laws)


# --- The exactness harness ---------------------------------------------------------------------------------------

VOCAB = 4
NUM_TOKENS = 3
NUM_SAMPLES = 1500
PROMPT = torch.tensor([[1, 3, 2]])


def small_target_model():
    """The statistical tests' target: vocabulary 4, one layer, laws peaked enough to differ from the draft's."""
    return make_tiny_model(seed=10, vocab_size=VOCAB, num_layers=1, head_scale=3.0)


class BanSuccessorOfLastToken(LogitsProcessor):
    """A user processor that depends on the prefix: token (last + 1) % vocab is never allowed."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        banned = (input_ids[:, -1:] + 1) % scores.shape[-1]
        return scores.scatter(1, banned, float("-inf"))


def with_length(settings: dict) -> dict:
    """Exactly NUM_TOKENS new tokens: EOS is suppressed until then unless the case sets its own min_new_tokens."""
    return {"max_new_tokens": NUM_TOKENS, "min_new_tokens": NUM_TOKENS, **settings}


def exact_law(model, settings: dict, user_processors: list, prompt: torch.Tensor = PROMPT) -> np.ndarray:
    """``[V, V, V]``: P(first three generated tokens) under target-only sampling of ``prompt`` with ``settings``."""
    return enumerated_law(model, with_length(settings), prompt, NUM_TOKENS, user_processors)


def sample_speculative(
    target, draft, settings: dict, user_processors: list, k: int, seed: int, as_rows: bool = True,
    num_samples: int = NUM_SAMPLES, **extra
) -> np.ndarray:
    """``[num_samples, NUM_TOKENS]`` samples: rows of one batch (independent samples), or one call per sample."""
    generator = torch.Generator().manual_seed(seed)

    def generate(prompt):
        return target.generate(
            prompt, assistant_model=draft, do_sample=True, num_assistant_tokens=k, generator=generator,
            logits_processor=LogitsProcessorList(user_processors), pad_token_id=0, **with_length(settings), **extra,
        )[:, PROMPT.shape[1] :]

    if as_rows:
        return generate(PROMPT.expand(num_samples, -1)).numpy()
    return np.array([generate(PROMPT)[0].tolist() for _ in range(num_samples)])


CASES = {
    "temperature_1": (1, {}, []),
    "temperature_0.7_top_k": (2, {"temperature": 0.7, "top_k": 3}, []),
    "top_p_repetition_penalty": (3, {"top_p": 0.9, "repetition_penalty": 3.0}, []),
    "min_p_typical": (2, {"min_p": 0.1, "typical_p": 0.9}, []),
    "epsilon_no_repeat_ngram": (2, {"epsilon_cutoff": 0.02, "no_repeat_ngram_size": 2}, []),
    "eta_user_processor_k5": (5, {"eta_cutoff": 0.01}, [BanSuccessorOfLastToken()]),
    "bad_words_sequence_bias": (3, {"bad_words_ids": [[2, 1]], "sequence_bias": [[[3], -1.0], [[1, 0], 2.0]]}, []),
    # EOS (token 0) is suppressed for the first two tokens only, so it can end the third.
    "min_new_tokens_suppress_tokens": (2, {"eos_token_id": 0, "min_new_tokens": 2, "suppress_tokens": [3]}, []),
    "combined_chain_k4": (
        4,
        {"temperature": 0.7, "top_k": 3, "top_p": 0.95, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
        [BanSuccessorOfLastToken()],
    ),
}


MIXED_PROMPTS = (torch.tensor([[1, 3, 2]]), torch.tensor([[2, 0, 1, 1, 3]]))
MIXED_SETTINGS = {"temperature": 0.8, "top_k": 3, "repetition_penalty": 1.5}


def sample_mixed_prompts(target, draft, seed: int, **extra) -> list[np.ndarray]:
    """One left-padded batch whose rows alternate between the two prompts (every row's neighbours have the other
    prompt); the samples of each prompt."""
    width = max(prompt.shape[1] for prompt in MIXED_PROMPTS)
    rows = [F.pad(prompt, (width - prompt.shape[1], 0)) for prompt in MIXED_PROMPTS]
    masks = [F.pad(torch.ones_like(prompt), (width - prompt.shape[1], 0)) for prompt in MIXED_PROMPTS]
    half = NUM_SAMPLES // 2
    input_ids = torch.stack([row[0] for row in rows]).repeat(half, 1)  # [2 * half, width]: prompt 0, 1, 0, 1, ...
    output = target.generate(
        input_ids, attention_mask=torch.stack([mask[0] for mask in masks]).repeat(half, 1), assistant_model=draft,
        do_sample=True, num_assistant_tokens=3, generator=torch.Generator().manual_seed(seed), pad_token_id=0,
        logits_processor=LogitsProcessorList([BanSuccessorOfLastToken()]), **with_length(MIXED_SETTINGS), **extra,
    )[:, width:].numpy()
    return [output[0::2], output[1::2]]
