"""The acceptance rule of speculative decoding, as pure functions on tensors.

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1;
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):

- draft tokens ``x_1 .. x_k``: sampled one after the other, ``x_i ~ q_i``, the draft's law after the processor chain;
- target laws ``p_1 .. p_{k+1}``: the target's law at each block position after the same chain; ``p_{k+1}`` follows
  the last draft token;
- accepted: ``x_i`` is kept with probability ``min(1, p_i(x_i) / q_i(x_i))``, in order, up to the first rejection;
- recovered: at the first rejection ``j``, one token from ``normalize(max(0, p_j - q_j))``;
- bonus: when all ``k`` draft tokens are accepted, one token from ``p_{k+1}``;
- reach: ``P(at least j draft tokens kept | the drafted block)``, j = 0 .. k, over the rule's uniforms only
  (``with_reach=True``). Its mean over blocks is the chance to keep j tokens, as the drawn count's is, with less
  noise: the automatic sizers learn acceptance from it (`hf_spec.sizing.estimates.PositionalAcceptance.add_reach`).

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
    number per row (an exponential race would need one per vocabulary entry, about ten times the work at a large
    vocabulary), and float64 sums keep rounding far below anything a test of the law could see.
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
    *,
    with_reach: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Speculative sampling for one block: accept a prefix of the draft, then recover or add a bonus token.

    Args:
        draft_ids: ``[batch, k]`` the drafted tokens, ``draft_ids[:, i] ~ draft_probs[:, i]``.
        draft_probs: ``[batch, k, vocab]`` q, the exact laws the draft tokens were sampled from.
        target_probs: ``[batch, k + 1, vocab]`` p, the target's laws at the same positions plus one.
        generator: the source of randomness.
        with_reach: also return the reach.

    Returns:
        output_ids: ``[batch, k + 1]``; row b holds ``num_accepted[b]`` draft tokens, then the recovered or bonus
            token, then ``NOT_EMITTED``.
        num_accepted: ``[batch]`` int64 in ``[0, k]``.
        reach (``with_reach``): ``[batch, k + 1]`` float64, ``prod_{i <= j} min(1, p_i(x_i) / q_i(x_i))``.
    """
    batch_size, k, vocab_size = _check_block(draft_ids, draft_probs, target_probs)

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

    output = _assemble_output(draft_ids, num_accepted, next_ids), num_accepted
    if not with_reach:
        return output
    return (*output, F.pad(likelihood_ratios(p_of_draft, q_of_draft).clamp_max(1.0), (1, 0), value=1.0).cumprod(-1))


def accept_block(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    with_reach: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Block verification (Sun et al. 2025, "Block Verification Accelerates Speculative Decoding", Algorithm 2): the
    drafted block is judged as a whole. Same arguments and returns as :func:`accept_draft_tokens`; the output has
    the target's law too, and in expectation at least as many draft tokens are kept (the paper's Theorem 2: no
    exact rule that sees one block keeps more).

    With ``p_0 = 1`` and, for i = 1 .. k (p, q the target's and the draft's laws at block position i):

        p_i = min(1, p_{i-1} p(x_i) / q(x_i))                       # how much of the block so far the target keeps
        r_i = max(0, p_i p_{i+1}(.) - q_{i+1}(.))                   # what a stop after x_i may emit (q_{k+1} = 0)
        h_i = |r_i| / (|r_i| + 1 - p_i)                             # the chance to stop there (h_k = p_k)

    the row keeps ``x_1 .. x_tau`` with ``tau`` the largest i whose uniform ``u_i < h_i`` (0 if none), then emits one
    token from ``r_tau / |r_tau|`` (``r_0 = max(0, p_1 - q_1)``; at tau = k that is the bonus token from ``p_{k+1}``).
    Token-wise rejection instead stops at the first rejected token: a later draft token the target likes more than
    the draft did cannot make up for an earlier one it liked less. Block verification lets it, which keeps more.

    The rule needs the block's length fixed before drafting (a draft that stops early on its own confidence is
    verified token by token: `hf_spec.rounds.ChainRounds.accept`). With ``with_reach`` it also returns the reach
    ``[batch, k + 1]``: the uniforms are independent, so ``P(tau >= j) = 1 - prod_{i = j .. k} (1 - h_i)``.
    """
    batch_size, k, vocab_size = _check_block(draft_ids, draft_probs, target_probs)

    stop, residuals = block_laws(draft_ids, draft_probs, target_probs)  # [batch, k + 1], [batch, k + 1, vocab]

    # 3. tau: the last i in 1 .. k with u_i < h_i, else 0.
    uniforms = torch.rand((batch_size, k), dtype=torch.float64, device=draft_ids.device, generator=generator)
    positions = torch.arange(1, k + 1, device=draft_ids.device)  # [k]
    stops = torch.where(uniforms < stop[:, 1:], positions, 0)  # [batch, k]: i where the row may stop, else 0
    num_accepted = F.pad(stops, (1, 0)).amax(dim=-1)  # [batch]

    # 4. One token from r_tau (p_{k+1} at tau = k); an empty residual (measure zero) falls back to p at tau.
    index = num_accepted.view(batch_size, 1, 1).expand(batch_size, 1, vocab_size)
    residual = residuals.gather(1, index).squeeze(1)  # [batch, vocab]
    p_next = target_probs.gather(1, index).squeeze(1)  # [batch, vocab]
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next.double())
    next_ids = sample_from_weights(residual, generator)  # [batch]
    output = _assemble_output(draft_ids, num_accepted, next_ids), num_accepted
    if not with_reach:
        return output
    never_after = (1 - stop[:, 1:]).flip(-1).cumprod(dim=-1).flip(-1)  # [batch, k]: no stop at j .. k
    return (*output, F.pad(1 - never_after, (1, 0), value=1.0))


def likelihood_ratios(p_of_draft: torch.Tensor, q_of_draft: torch.Tensor) -> torch.Tensor:
    """p(x) / q(x) of the drafted tokens, float64; q = 0 for a drafted token breaks the draft's contract: its ratio
    counts as 0, a rejection, never a NaN."""
    return torch.where(q_of_draft > 0, p_of_draft / q_of_draft.clamp_min(torch.finfo(torch.float64).tiny), 0.0)


def block_laws(draft_ids: torch.Tensor, draft_probs: torch.Tensor,
               target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's laws (:func:`accept_block`): ``h`` ``[batch, k + 1]``, the chance to stop after draft
    token i (h_0 is not used: tau = 0 is what is left), and ``r`` ``[batch, k + 1, vocab]``, the unnormalized law
    of the token emitted after a stop at i; float64."""
    batch_size, k = draft_ids.shape
    # 1. p_i: the running, clipped likelihood ratio of the block's prefixes. q = 0 for a drafted token breaks the
    #    draft's contract: its ratio counts as 0, a rejection, never a NaN.
    p_of_draft = target_probs[:, :k].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).double()  # [batch, k]
    q_of_draft = draft_probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).double()  # [batch, k]
    ratios = likelihood_ratios(p_of_draft, q_of_draft)  # [batch, k]
    kept = [torch.ones(batch_size, dtype=torch.float64, device=draft_ids.device)]  # p_0
    for i in range(k):
        kept.append(torch.clamp(kept[-1] * ratios[:, i], max=1.0))
    kept = torch.stack(kept, dim=1)  # [batch, k + 1]: p_0 .. p_k
    # 2. r_i and h_i at every stop i = 0 .. k (q after the last draft token is 0).
    q_next = F.pad(draft_probs, (0, 0, 0, 1)).double()  # [batch, k + 1, vocab]
    residuals = (kept.unsqueeze(-1) * target_probs.double() - q_next).clamp_min_(0)  # [batch, k + 1, vocab]
    mass = residuals.sum(dim=-1)  # [batch, k + 1]
    denominator = mass + (1 - kept)
    stop = torch.where(denominator > 0, mass / denominator.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return stop, residuals


def accept_greedy(draft_ids: torch.Tensor, target_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: keep the draft tokens equal to the target's argmax, then the target's own token.

    Args:
        draft_ids: ``[batch, k]`` the drafted tokens.
        target_scores: ``[batch, k + 1, vocab]`` the target's processed scores at each block position.

    Returns:
        The same ``(output_ids [batch, k + 1], num_accepted [batch])`` as :func:`accept_draft_tokens`.
    """
    batch_size, k = check_shape("draft_ids", draft_ids, 2)
    check_shape("target_scores", target_scores, 3, (batch_size, k + 1, target_scores.shape[-1]))
    target_ids = target_scores.argmax(dim=-1)  # [batch, k + 1]
    num_accepted = (draft_ids == target_ids[:, :k]).long().cumprod(dim=-1).sum(dim=-1)  # [batch]
    next_ids = target_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [batch]
    return _assemble_output(draft_ids, num_accepted, next_ids), num_accepted


def _check_block(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
                 ) -> tuple[int, int, int]:
    """``(batch, k, vocab)`` of a chain's block: ``draft_ids`` [batch, k], ``draft_probs`` [batch, k, vocab],
    ``target_probs`` [batch, k + 1, vocab]; ``ValueError`` naming the first that does not fit."""
    batch_size, k = check_shape("draft_ids", draft_ids, 2)
    vocab_size = target_probs.shape[-1]
    check_shape("draft_probs", draft_probs, 3, (batch_size, k, vocab_size))
    check_shape("target_probs", target_probs, 3, (batch_size, k + 1, vocab_size))
    return batch_size, k, vocab_size


def check_shape(name: str, tensor: torch.Tensor, dims: int, expected: tuple[int, ...] | None = None) -> tuple:
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


def accept_tree(
    token_ids: torch.Tensor,
    parents: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Speculative sampling over a tree of drafts: walk down from the root, trying each node's children in order.

    Multi-candidate rejection sampling (SpecInfer, Miao et al. 2024, "multi-step speculative sampling"; its form for
    candidates drawn without replacement is the recursive rejection sampling of Jeon et al. 2024, "Recursive
    Speculative Decoding"). At a node with target law p and children ``x_1 .. x_m``, child j drawn from ``q_j``
    given the earlier children, start from ``r = p`` and for each child in turn: accept ``x_j`` with probability
    ``min(1, r(x_j) / q_j(x_j))`` and descend into it; else ``r <- normalize(max(0, r - q_j))``. When every child is
    rejected, emit one token from r. At a leaf (no children) that is a bonus token from p.

    Why it is exact, by induction over the children tried: let h be the children rejected so far and r_h the current
    residual, a function of h. Claim: the token emitted from here on has law r_h. With child x ~ q_h: it is emitted
    with probability ``min(q_h(x), r_h(x))``; else the next residual is ``normalize(max(0, r_h - q_h))`` whatever x was
    rejected, and by induction what follows has that law; the two add up to r_h. Starting from r = p the emitted token
    has the target's law, and after an accepted child the same holds one level down with that child's p and children.
    So the rule is exact whenever ``q_j`` is the law child j really was drawn from given the earlier ones: for
    i.i.d. children every ``q_j`` is the draft's q; for children drawn without replacement, q with the earlier
    children removed and renormalized; for deterministic children (lookup, suffix matches, greedy top-k), a point
    mass. How many children a node has may depend on anything drawn before them, never on their own values.

    Args:
        token_ids: ``[n]`` the tree's tokens, in topological order.
        parents: ``n`` parent indices (``-1`` for the root, the last committed token), ``parents[i] < i``; a node's
            children are tried in index order.
        draft_probs: ``[n, vocab]`` the law node i was drawn from, given its parent and its earlier siblings.
        target_probs: ``[n + 1, vocab]`` p at the root (row 0) and after each node (row i + 1).
        generator: the source of randomness.

    Returns:
        The accepted path (node indices, root's child first) and the next token (0-dim int64).
    """
    num_nodes = check_tree("token_ids", token_ids, parents)
    vocab_size = target_probs.shape[-1]
    check_shape("draft_probs", draft_probs, 2, (num_nodes, vocab_size))
    check_shape("target_probs", target_probs, 2, (num_nodes + 1, vocab_size))
    children = children_of(parents)
    tokens = token_ids.tolist()
    path, node = [], -1
    while True:
        residual = target_probs[node + 1].double()  # [vocab], r = p at this node
        for child in children[node]:
            law = draft_probs[child].double()  # [vocab], q_j
            q, r = float(law[tokens[child]]), float(residual[tokens[child]])
            uniform = float(torch.rand((), dtype=torch.float64, device=token_ids.device, generator=generator))
            if q > 0 and uniform * q < r:
                path.append(child)
                node = child
                break
            leftover = (residual - law).clamp_min_(0)  # [vocab]
            total = leftover.sum()
            if total > 0:  # 0 only if q_j covers r, where a rejection has probability 0 (kept well defined)
                residual = leftover / total
        else:
            return path, sample_from_weights(residual, generator)


def accept_tree_greedy(token_ids: torch.Tensor, parents: list[int],
                       target_scores: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Greedy verification of a tree: the longest path whose every token is the target's argmax after its prefix,
    then the target's argmax after that path.

    Args:
        token_ids, parents: the tree, as in :func:`accept_tree`.
        target_scores: ``[n + 1, vocab]`` the target's processed scores at the root and after each node.

    Returns:
        The same ``(path, next token)`` as :func:`accept_tree`.
    """
    num_nodes = check_tree("token_ids", token_ids, parents)
    check_shape("target_scores", target_scores, 2, (num_nodes + 1, target_scores.shape[-1]))
    best = target_scores.argmax(dim=-1)  # [n + 1]
    best_list, tokens, children = best.tolist(), token_ids.tolist(), children_of(parents)
    path, node = [], -1
    while True:
        match = [child for child in children[node] if tokens[child] == best_list[node + 1]]
        if not match:
            return path, best[node + 1]
        node = match[0]
        path.append(node)


def check_tree(name: str, token_ids: torch.Tensor, parents: list[int]) -> int:
    """The number of nodes; ``ValueError`` unless ``token_ids`` is 1-D and ``parents`` a matching topological list."""
    (num_nodes,) = check_shape(name, token_ids, 1)
    if len(parents) != num_nodes or any(not -1 <= parent < i for i, parent in enumerate(parents)):
        raise ValueError(f"`parents` must list, for each of the {num_nodes} nodes, a parent index in [-1, i) (-1: "
                         f"the root), but is {list(parents)}.")
    return num_nodes


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Each node's children in index order (the root is -1); every node has an entry."""
    children: dict[int, list[int]] = {node: [] for node in range(-1, len(parents))}
    for node, parent in enumerate(parents):
        children[parent].append(node)
    return children
