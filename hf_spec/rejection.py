"""The acceptance rule of speculative decoding, as pure functions on tensors.

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1;
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):

- draft tokens ``x_1 .. x_k``: sampled one after the other, ``x_i ~ q_i``, the draft's law after the processor chain;
- target laws ``p_1 .. p_{k+1}``: the target's law at each block position after the same chain; ``p_{k+1}`` follows
  the last draft token;
- accepted: ``x_i`` is kept with probability ``min(1, p_i(x_i) / q_i(x_i))``, in order, up to the first rejection;
- recovered: at the first rejection ``j``, one token from ``normalize(max(0, p_j - q_j))``;
- bonus: when all ``k`` draft tokens are accepted, one token from ``p_{k+1}``.

Each row emits its accepted draft tokens followed by exactly one recovered or bonus token, and that token sequence
has exactly the law of sampling the target alone. The bonus is the recovered rule with ``q_{k+1} = 0``, which is
how it is computed here. Greedy decoding is the limit where every law is a point mass: keep the draft tokens that
equal the target's argmax, then emit the target's argmax.

Nothing here touches a model, a cache or global state; randomness comes only from the explicit ``generator``
(``None`` means torch's default generator, so ``torch.manual_seed`` reproduces a run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Value written into ``output_ids`` after a row's last emitted token; never a valid token id.
NOT_EMITTED = -1


def sample_from_weights(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one index per row with probability proportional to ``weights``.

    Args:
        weights: ``[..., vocab]``, non-negative, each row with a positive sum; need not be normalized.
        generator: the source of randomness.

    Returns:
        ``[...]`` int64 indices.

    Inverse-CDF sampling: one float64 uniform u per row, scaled by the row's total, and the first index whose
    cumulative weight exceeds it, so index i is drawn with probability ``w_i / sum(w)``. A zero weight adds nothing
    to the cumulative sum, so it can never be drawn; u is kept strictly below the total, so the last index with a
    positive weight is the largest that can come out. No normalization and no host synchronization; one random
    number per row (an exponential race would need one per vocabulary entry: 3 ms a row at 151,936 entries here,
    against 0.3 ms), and float64 sums keep rounding far below anything a test of the law could see.
    """
    cumulative = weights.double().cumsum(dim=-1)  # [..., vocab]
    total = cumulative[..., -1:]  # [..., 1]
    uniforms = torch.rand(total.shape, dtype=torch.float64, device=weights.device, generator=generator)
    thresholds = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))  # [..., 1] < total
    # Rows with NaN or no positive weight break the contract; they still get an index in range (the loop's checks
    # then raise a clear error for them instead of an index error deep in a model).
    return torch.searchsorted(cumulative, thresholds, right=True).squeeze(-1).clamp_max_(weights.shape[-1] - 1)


def accept_draft_tokens(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for one block: accept a prefix of the draft, then recover or add a bonus token.

    Args:
        draft_ids: ``[batch, k]`` the drafted tokens, ``draft_ids[:, i] ~ draft_probs[:, i]``.
        draft_probs: ``[batch, k, vocab]`` q, the exact laws the draft tokens were sampled from.
        target_probs: ``[batch, k + 1, vocab]`` p, the target's laws at the same positions plus one.
        generator: the source of randomness.

    Returns:
        output_ids: ``[batch, k + 1]``; row b holds ``num_accepted[b]`` draft tokens, then the recovered or bonus
            token, then ``NOT_EMITTED``.
        num_accepted: ``[batch]`` int64 in ``[0, k]``.
    """
    batch_size, k = _check_shape("draft_ids", draft_ids, 2)
    vocab_size = target_probs.shape[-1]
    _check_shape("draft_probs", draft_probs, 3, (batch_size, k, vocab_size))
    _check_shape("target_probs", target_probs, 3, (batch_size, k + 1, vocab_size))

    # 1. Accept x_i while u_i < p_i(x_i) / q_i(x_i), written u_i * q < p so that nothing is divided. Float64 for
    #    the comparison; u in [0, 1) so a token with p = 0 is rejected even when u is exactly 0. q = 0 for a drafted
    #    token breaks the draft's contract (it cannot have been sampled): rejected, never a NaN.
    p_of_draft = target_probs[:, :k].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).double()  # [batch, k]
    q_of_draft = draft_probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).double()  # [batch, k]
    uniforms = torch.rand(
        (batch_size, k), dtype=torch.float64, device=draft_ids.device, generator=generator
    )  # [batch, k]
    is_accepted = (q_of_draft > 0) & (uniforms * q_of_draft < p_of_draft)  # [batch, k]
    num_accepted = is_accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]

    # 2. At position j = num_accepted sample from max(0, p_j - q_j), with q_{k+1} = 0 giving the bonus token.
    #    A residual that sums to 0 means p_j == q_j, where rejection has probability 0; p_j keeps it well defined.
    index = num_accepted.view(batch_size, 1, 1).expand(batch_size, 1, vocab_size)
    p_next = target_probs.gather(1, index).squeeze(1)  # [batch, vocab]
    q_next = F.pad(draft_probs, (0, 0, 0, 1)).gather(1, index).squeeze(1)  # [batch, vocab]
    residual = (p_next - q_next).clamp_min_(0)  # [batch, vocab]
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next)
    next_ids = sample_from_weights(residual, generator)  # [batch]

    return _assemble_output(draft_ids, num_accepted, next_ids), num_accepted


def accept_greedy(draft_ids: torch.Tensor, target_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: keep the draft tokens equal to the target's argmax, then the target's own token.

    Args:
        draft_ids: ``[batch, k]`` the drafted tokens.
        target_scores: ``[batch, k + 1, vocab]`` the target's processed scores at each block position.

    Returns:
        The same ``(output_ids [batch, k + 1], num_accepted [batch])`` as :func:`accept_draft_tokens`.
    """
    batch_size, k = _check_shape("draft_ids", draft_ids, 2)
    _check_shape("target_scores", target_scores, 3, (batch_size, k + 1, target_scores.shape[-1]))
    target_ids = target_scores.argmax(dim=-1)  # [batch, k + 1]
    num_accepted = (draft_ids == target_ids[:, :k]).long().cumprod(dim=-1).sum(dim=-1)  # [batch]
    next_ids = target_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [batch]
    return _assemble_output(draft_ids, num_accepted, next_ids), num_accepted


def _check_shape(name: str, tensor: torch.Tensor, dims: int, expected: tuple[int, ...] | None = None) -> tuple:
    """``tensor.shape``; ``ValueError`` naming ``name`` unless it has ``dims`` dimensions (and ``expected``)."""
    shape = tuple(tensor.shape)
    if len(shape) != dims or (expected is not None and shape != expected):
        wanted = f"shape {expected}" if expected is not None else f"{dims} dimensions"
        raise ValueError(f"`{name}` must have {wanted} (batch, block positions, vocabulary as documented), but has "
                         f"shape {shape}.")
    return shape


def _assemble_output(draft_ids: torch.Tensor, num_accepted: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, k + 1]``: accepted draft tokens, the next token at ``num_accepted``, then ``NOT_EMITTED``."""
    k = draft_ids.shape[1]
    output_ids = F.pad(draft_ids, (0, 1), value=NOT_EMITTED)  # [batch, k + 1]
    output_ids.scatter_(1, num_accepted.unsqueeze(1), next_ids.unsqueeze(1))
    positions = torch.arange(k + 1, device=draft_ids.device)  # [k + 1]
    return output_ids.masked_fill_(positions > num_accepted.unsqueeze(1), NOT_EMITTED)
