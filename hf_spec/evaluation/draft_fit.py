"""How well a draft fits its target, before serving it: expected acceptance from the two processed distributions.

At a prefix where the target's processed law is p and the draft's is q (the same processor chain, as in decoding),
the rejection rule accepts the draft's token with probability

    sum_x min(p(x), q(x)) = 1 - TV(p, q),        TV(p, q) = 1/2 sum_x |p(x) - q(x)|

and greedy decoding accepts it when argmax p = argmax q. `evaluate_draft` computes this at every position of given
continuations (the target's own, from `target_continuations`, or any text), then the expected tokens per target pass
for each k (from the acceptance along each continuation: 1 + a_t + a_t a_{t+1} + ..., averaged over start positions
t) and, given a cost ratio, the predicted speed-up (`hf_spec.sizing.speedup`). `measure_draft` runs real
speculative generation and reports what happened, for comparison.

What it does not do: train (`hf_spec.evaluation.distill`), or account for processors that keep state between
calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList, PreTrainedModel

from hf_spec.compat import decoding_chain
from hf_spec.drafting import align_vocab
from hf_spec.evaluation.continuations import with_greedy_default
from hf_spec.mixin import speculative
from hf_spec.sizing.speedup import round_cost
from hf_spec.stats import SpeculativeStats
from logits_processors import process_block

DEFAULT_KS = (1, 2, 3, 4, 5, 6, 8, 10)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[..., V], [..., V] -> [...]``: 1/2 sum |p - q| over the last dimension."""
    return 0.5 * (p - q).abs().sum(dim=-1)


def acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``[..., V], [..., V] -> [...]``: the probability that sampling accepts the draft's token, 1 - TV(p, q)."""
    return torch.minimum(target_probs, draft_probs).sum(dim=-1).clamp(0.0, 1.0)


def greedy_acceptance(target_scores: torch.Tensor, draft_scores: torch.Tensor) -> torch.Tensor:
    """``[..., V], [..., V] -> [...]``: 1.0 where greedy decoding accepts the draft's token (same argmax), else 0.0."""
    return (target_scores.argmax(dim=-1) == draft_scores.argmax(dim=-1)).to(torch.float32)


def expected_tokens_along(acceptance: torch.Tensor, k: int) -> float:
    """Mean over start positions t of E[tokens per pass] = 1 + a_t + a_t a_{t+1} + ... (k terms after the 1).

    Args:
        acceptance: ``[T]`` per-position acceptance along one continuation; past its end nothing is accepted.
    """
    length = acceptance.shape[0]
    padded = torch.cat([acceptance, acceptance.new_zeros(k)])  # [T + k]
    total, reach = torch.ones_like(acceptance), torch.ones_like(acceptance)  # [T]
    for i in range(k):
        reach = reach * padded[i : i + length]  # prod_{j <= i} a_{t + j}
        total = total + reach
    return float(total.mean())


@dataclasses.dataclass
class AcceptanceReport:
    """What `evaluate_draft` found (JSON-ready with `dataclasses.asdict`)."""

    acceptance_rate: float  # mean over positions of 1 - TV(p, q) (greedy: of argmax agreement)
    num_positions: int
    acceptance_by_sequence: list[float]
    acceptance_along_text: list[list[float]]  # per sequence, per continuation token: 1 - TV (greedy: 0 or 1)
    expected_tokens_per_pass: dict[int, float]  # k -> E[tokens per target pass]
    predicted_speedup: dict[int, float] | None  # k -> E[tokens] / (k c + b), when a cost ratio is given
    settings: dict


@torch.no_grad()
def processed_scores(model: PreTrainedModel, prompt_ids: torch.Tensor, continuation_ids: torch.Tensor,
                     chain: LogitsProcessorList, vocab_size: int) -> torch.Tensor:
    """``[1, m, V]``: the processed scores that predicted each of the ``m`` continuation tokens.

    Args:
        prompt_ids: ``[1, S]``; continuation_ids: ``[1, m]``, m >= 1.
    """
    sequence = torch.cat([prompt_ids, continuation_ids], dim=1).to(model.device)
    logits = model(input_ids=sequence).logits[:, prompt_ids.shape[1] - 1 :].float()  # [1, m + 1, V_model]
    logits = align_vocab(logits, vocab_size)
    lengths = torch.tensor([prompt_ids.shape[1]], device=sequence.device)
    return process_block(chain, prompt_ids.to(sequence.device), continuation_ids.to(sequence.device), logits,
                         lengths)[:, :-1]


def evaluate_draft(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    continuations: Sequence[torch.Tensor],
    settings: dict | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    cost_ratio: float | None = None,
    block_cost: float = 1.0,
    logits_processor: LogitsProcessorList | None = None,
    progress: bool = True,
) -> AcceptanceReport:
    """Expected acceptance of ``draft`` for ``target`` on ``continuations`` of ``prompts`` (teacher forcing).

    Args:
        prompts: ``[1, S_i]`` token ids each (no padding).
        continuations: ``[1, m_i]`` the text after each prompt: the target's own continuations
            (`target_continuations`) predict what decoding will see.
        settings: decoding settings as ``generate()`` takes them (``do_sample``, ``temperature``, ``top_p``, ...);
            default greedy.
        ks: draft lengths to report expected tokens per pass for.
        cost_ratio: draft step / target step; with it, ``predicted_speedup`` per k (``block_cost``: a (k+1)-token
            target pass / a step).
    """
    settings = with_greedy_default(settings)
    if len(prompts) != len(continuations):
        raise ValueError(f"`prompts` ({len(prompts)}) and `continuations` ({len(continuations)}) must pair up.")
    if not prompts:
        raise ValueError("`prompts` is empty: nothing to evaluate.")
    vocab_size = target.config.get_text_config().vocab_size
    per_sequence = []
    pairs = tqdm(list(zip(prompts, continuations)), desc="acceptance", unit="text", disable=not progress)
    for index, (prompt, continuation) in enumerate(pairs):
        if prompt.dim() != 2 or prompt.shape[0] != 1 or continuation.dim() != 2 or continuation.shape[1] == 0:
            raise ValueError(f"Pair {index}: expected a prompt [1, S] and a non-empty continuation [1, m], got "
                             f"{tuple(prompt.shape)} and {tuple(continuation.shape)}.")
        chain = decoding_chain(target, settings, prompt, logits_processor)
        p = processed_scores(target, prompt, continuation, chain, vocab_size)  # [1, m, V]
        q = processed_scores(draft, prompt, continuation, chain, vocab_size)
        if settings["do_sample"]:
            per_sequence.append(acceptance_probability(p.softmax(-1), q.softmax(-1))[0])  # [m]
        else:
            per_sequence.append(greedy_acceptance(p, q)[0])
    positions = torch.cat(per_sequence)
    weights = [a.shape[0] for a in per_sequence]
    expected = {k: sum(expected_tokens_along(a, k) * w for a, w in zip(per_sequence, weights)) / sum(weights)
                for k in ks}
    return AcceptanceReport(
        acceptance_rate=float(positions.mean()),
        num_positions=positions.shape[0],
        acceptance_by_sequence=[float(a.mean()) for a in per_sequence],
        acceptance_along_text=[a.tolist() for a in per_sequence],
        expected_tokens_per_pass=expected,
        predicted_speedup=None if cost_ratio is None else {
            k: expected[k] / round_cost(k, cost_ratio, block_cost) for k in ks
        },
        settings=settings,
    )


@dataclasses.dataclass
class MeasuredDraft:
    """What `measure_draft` saw: the calls' statistics added up (`SpeculativeStats.combine`)."""

    stats: SpeculativeStats
    num_draft_tokens: int
    settings: dict

    @property
    def acceptance_rate(self) -> float:
        return self.stats.acceptance_rate

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per block position j: the share of rounds drafting a token there in which it was accepted (and all before
        it)."""
        return self.stats.acceptance_by_position

    @property
    def tokens_per_round(self) -> float:
        return self.stats.tokens_per_round

    def to_dict(self) -> dict:
        return {"num_draft_tokens": self.num_draft_tokens, "settings": self.settings, "stats": self.stats.to_dict()}


def measure_draft(target: PreTrainedModel, draft: PreTrainedModel, prompts: Sequence[torch.Tensor],
                  num_draft_tokens: int, max_new_tokens: int, settings: dict | None = None, seed: int = 0,
                  progress: bool = True) -> MeasuredDraft:
    """Run speculative generation on each prompt (prompt i with a generator seeded ``seed + i``) and add up what
    happened."""
    settings = with_greedy_default(settings)
    target = speculative(target)
    calls = []
    for index, prompt in enumerate(tqdm(prompts, desc="speculative runs", unit="text", disable=not progress)):
        output = target.generate(
            prompt.to(target.device), assistant_model=draft, num_assistant_tokens=num_draft_tokens,
            max_new_tokens=max_new_tokens, generator=torch.Generator(target.device).manual_seed(seed + index),
            return_dict_in_generate=True, **settings,
        )
        calls.append(output.speculative_stats)
    return MeasuredDraft(SpeculativeStats.combine(calls), num_draft_tokens, settings)


#: Local path of the `evaluate` metric module: ``evaluate.load(METRIC_PATH)``.
METRIC_PATH = str(Path(__file__).parent / "metrics" / "speculative_acceptance")
