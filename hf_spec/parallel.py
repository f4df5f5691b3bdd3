"""Tensor-parallel targets (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``): every rank runs the same loop.

Each pass of a sharded target is a sequence of collectives, so its ranks must feed it the same tokens: the same drafts,
the same accepted prefixes. That holds by construction: the call's randomness is one seed drawn on the group's first
rank and broadcast (`Ranks.shared_generator`), the draft is replicated (or sharded on the target's own mesh), and
sizes follow accepted counts only (automatic sizing times passes on each rank, so it is refused). `Ranks.agree`
checks it once a round, before the target's pass: a digest of each rank's committed tokens and draft, gathered; ranks
that differ raise naming them (a collective fed different shapes would abort the process instead). docs/scale.md.
"""

from __future__ import annotations

import torch

from hf_spec.compat import tensor_parallel_mesh

#: Multiplier of the digest's polynomial (a 61-bit prime: int64 arithmetic wraps, the digest stays a checksum).
_DIGEST_BASE = 2305843009213693951


def digest(*tensors: torch.Tensor) -> torch.Tensor:
    """``[2 * len(tensors)]`` int64: each tensor's size and a position-weighted checksum of its values (integers)."""
    parts = []
    for tensor in tensors:
        values = tensor.reshape(-1).to(torch.int64).cpu()
        weights = torch.arange(1, values.numel() + 1, dtype=torch.int64) * _DIGEST_BASE + 1  # wraps, odd
        parts += [torch.tensor(values.numel()), (values * weights).sum()]
    return torch.stack(parts)


class Ranks:
    """One process: nothing to share, nothing to check."""

    def shared_generator(self, generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
        """The generator every rank draws from: here the call's own."""
        return generator

    def agree(self, what: str, *tensors: torch.Tensor) -> None:
        """Raise unless every rank holds the same ``tensors``; here there is one rank."""


class TensorParallelRanks(Ranks):
    """The ranks of a target's tensor-parallel group (``group``: a ``torch.distributed`` process group whose
    collectives take tensors on ``device``: the CPU for gloo, the rank's GPU for NCCL)."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.first = torch.distributed.get_global_rank(group, 0)
        self.size = torch.distributed.get_world_size(group)
        self.rank = torch.distributed.get_rank(group)

    def shared_generator(self, generator: torch.Generator | None, device: torch.device) -> torch.Generator:
        """A generator seeded on every rank with one seed that the group's first rank draws from ``generator`` (torch's
        default generator when ``None``): the other ranks' generators are not read."""
        seed = torch.randint(2**62, (1,), dtype=torch.int64, generator=generator,
                             device=generator.device if generator is not None else "cpu").to(self.device)
        torch.distributed.broadcast(seed, src=self.first, group=self.group)
        return torch.Generator(device).manual_seed(int(seed))

    def agree(self, what: str, *tensors: torch.Tensor) -> None:
        """Gather ``digest(*tensors)`` from every rank; raise on every rank, naming them, where they differ."""
        mine = digest(*tensors).to(self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        torch.distributed.all_gather(everyone, mine, group=self.group)
        if all(torch.equal(other, everyone[0]) for other in everyone):
            return
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, other in enumerate(everyone):
            groups.setdefault(tuple(other.tolist()), []).append(rank)  # group ranks, by their digest
        split = " vs ".join(("rank " if len(members) == 1 else "ranks ") + ", ".join(map(str, members))
                            for members in groups.values())
        raise RuntimeError(
            f"The ranks of the tensor-parallel target hold different {what} ({split}): their "
            "next target pass would feed different tokens to the same collectives. hf_spec draws every rank's "
            "randomness from one broadcast seed; a draft whose weights or inputs differ by rank, a drafter of your own "
            "that draws from another stream, or a generator changed on one rank during the call does this."
        )


def ranks_of(model) -> Ranks:
    """The target's tensor-parallel ranks (`TensorParallelRanks`) where it is sharded over several, else `Ranks`."""
    mesh = tensor_parallel_mesh(model)
    if mesh is None:
        return Ranks()
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    return TensorParallelRanks(mesh.get_group(), device)


def check_sharded_call(target, assistant_model, rounds, settings: dict) -> None:
    """What a tensor-parallel target cannot run, refused by name before any pass: a sizer that learns from timings
    (each rank's clock differs) and a draft sharded on another mesh than the target's."""
    mesh = tensor_parallel_mesh(target)
    if mesh is None:
        return
    if rounds.is_timed:
        name = "num_tree_nodes" if "num_tree_nodes" in settings else "num_assistant_tokens"
        raise ValueError(
            f"`{name}`={settings.get(name)!r} sizes each round from timings, which differ between the {mesh.size()} "
            "ranks of the tensor-parallel target (the ranks would draft different lengths). Pass an integer.")
    draft_mesh = tensor_parallel_mesh(assistant_model) if isinstance(assistant_model, torch.nn.Module) else None
    if draft_mesh is not None and draft_mesh != mesh:
        raise ValueError(
            f"`assistant_model` is sharded on {draft_mesh}, the target on {mesh}: a draft runs replicated on every "
            "rank (load it without `tp_plan`) or sharded on the target's own mesh.")
