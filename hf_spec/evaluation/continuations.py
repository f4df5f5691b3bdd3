"""What the target alone generates: its own continuations of prompts, seeded, cut after the first EOS.

Shared by draft evaluation (acceptance is measured along these continuations), distillation (the draft learns on
them) and the bench (tokens are counted the same way for every method).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_spec.loading.vocabulary import eos_token_ids


def with_greedy_default(settings: dict | None) -> dict:
    """Decoding settings as ``generate()`` takes them; greedy unless ``settings`` says ``do_sample=True``."""
    return {"do_sample": False, **(settings or {})}


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Inside the block torch's global generators (the CPU's, and ``device``'s when it is a GPU) start from ``seed``;
    the caller's random state is restored afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def count_new_tokens(new_ids: torch.Tensor, eos_ids: set[int]) -> int:
    """Tokens of ``new_ids`` ``[m]`` up to and including the first EOS (all of them without one)."""
    new = new_ids.tolist()
    return next((i + 1 for i, token in enumerate(new) if token in eos_ids), len(new))


@torch.no_grad()
def target_continuations(target: PreTrainedModel, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                         settings: dict | None = None, seed: int = 0, progress: bool = True) -> list[torch.Tensor]:
    """``[1, m_i]`` per prompt ``[1, S_i]``: what target-only ``generate`` continues it with (up to EOS, included),
    prompt i seeded with ``seed + i``."""
    settings = with_greedy_default(settings)
    eos_ids = eos_token_ids(target)
    continuations = []
    for index, prompt in enumerate(tqdm(prompts, desc="target continuations", unit="text", disable=not progress)):
        with seeded(seed + index, target.device):
            new = target.generate(prompt.to(target.device), max_new_tokens=max_new_tokens, **settings)
        new = new[:, prompt.shape[1]:]
        continuations.append(new[:, : count_new_tokens(new[0], eos_ids)])
    return continuations
