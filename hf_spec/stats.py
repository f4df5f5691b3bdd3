"""What a speculative `generate()` call did: rounds, proposals, acceptances, time spent drafting and verifying."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpeculativeStats:
    """Counters of one speculative ``generate()`` call.

    A round is one target forward pass over a drafted block (for the whole batch). Acceptance counts are what the
    acceptance rule decided; ``num_emitted`` is what reached the output (a stopping criterion may cut a block short).
    Token counts are summed over the rows of a batch; ``rows`` holds the same counters for each row alone (its
    ``num_rounds`` counts the target passes the row took part in; its timings stay 0).

    Attributes:
        num_rounds: target forward passes.
        num_draft_tokens: tokens proposed by the draft, over all rounds.
        num_accepted: proposed tokens the target accepted.
        num_emitted: tokens appended to the output (accepted, recovered and bonus tokens, after stopping).
        expected_accepted: what the acceptance rule was expected to accept, given each round's draft, over the rule's
            own randomness: the sum of its reach (`hf_spec.rejection`, sampled chains); the count itself where the
            rule reports no reach (greedy calls, trees). ``num_accepted - expected_accepted`` is the call's luck in
            the rule's draws, which has mean 0 (in a batch of rows whose caches cannot hold holes, rows keep fewer
            than the rule accepted, and this is the expectation of what the rule accepted).
        accepted_by_position: ``accepted_by_position[i]`` counts rounds whose draft token at block position ``i``
            was accepted (for trees: at depth ``i + 1``).
        proposed_by_position: ``proposed_by_position[i]`` counts rounds that proposed a token at position ``i``
            (for trees: rounds whose tree reached depth ``i + 1``).
        draft_lengths: the k of each round, in order (k varies with ``num_assistant_tokens="auto"``, prompt lookup,
            and near ``max_length``; for trees, k nodes; 0: a plain target step: auto chose not to draft, or prompt
            lookup found no match), so that what an automatic setting chose can be followed through the call.
        rounds_by_accepted: ``rounds_by_accepted[n]`` counts row-rounds that accepted n drafted tokens (for trees,
            the accepted depth).
        draft_seconds: wall-clock time in draft forward passes and draft sampling.
        verify_seconds: wall-clock time in target forward passes, acceptance and rollback.
        rows: per batch row, in the input's order.
        verification: the acceptance rule that ran: ``"block"`` or ``"token"`` (sampled chains,
            `hf_spec.rejection`), ``"traversal"`` (sampled trees judged path by path, `hf_spec.traversal`, their
            chain rounds by block verification) or ``"tree"`` (node by node, ``verification="token"``), ``"greedy"``.
        profile: seconds per section of the loop (`hf_spec.profiling.SECTIONS`) when the call ran inside
            `hf_spec.profiling.profile_rounds`, else ``None``; ``profile_passes``: forward passes per section
            (`hf_spec.profiling.FORWARD_SECTIONS`) then.
    """

    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_emitted: int = 0
    expected_accepted: float = 0.0
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)
    proposed_by_position: list[int] = dataclasses.field(default_factory=list)
    rounds_by_accepted: list[int] = dataclasses.field(default_factory=list)
    draft_lengths: list[int] = dataclasses.field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rows: list[SpeculativeStats] = dataclasses.field(default_factory=list)
    verification: str = ""
    profile: dict[str, float] | None = None
    profile_passes: dict[str, int] | None = None

    def __getitem__(self, row: int) -> SpeculativeStats:
        """Row ``row``'s own counters (`rows`): what splitting a generate() output by row gives (Whisper's generate()
        splits every field of the inner call's output that way)."""
        return self.rows[row]

    def cpu(self) -> SpeculativeStats:
        """Itself: counters live on the host (for code that moves every output field there)."""
        return self

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0.0 before any proposal)."""
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens emitted per target forward pass, recovered and bonus tokens included."""
        return self.num_emitted / self.num_rounds if self.num_rounds else 0.0

    @property
    def rounds_by_draft_length(self) -> list[int]:
        """``rounds_by_draft_length[k]`` counts rounds that drafted k tokens (`draft_lengths` counted)."""
        counts = [0] * (max(self.draft_lengths, default=-1) + 1)
        for num_draft_tokens in self.draft_lengths:
            counts[num_draft_tokens] += 1
        return counts

    @property
    def mean_draft_length(self) -> float:
        """Mean tokens drafted per round."""
        return sum(self.draft_lengths) / self.num_rounds if self.num_rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per block position: accepted / proposed (0.0 where nothing was proposed)."""
        return [a / n if n else 0.0 for a, n in zip(self.accepted_by_position, self.proposed_by_position)]

    @classmethod
    def combine(cls, calls: list[SpeculativeStats]) -> SpeculativeStats:
        """The counters and timings of several calls added up (per-row statistics are not kept)."""
        total = cls()
        for stats in calls:
            for name in ("num_rounds", "num_draft_tokens", "num_accepted", "num_emitted", "expected_accepted",
                         "draft_seconds", "verify_seconds"):
                setattr(total, name, getattr(total, name) + getattr(stats, name))
            for name in ("accepted_by_position", "proposed_by_position", "rounds_by_accepted"):
                mine, theirs = getattr(total, name), getattr(stats, name)
                _grow(mine, len(theirs))
                for i, count in enumerate(theirs):
                    mine[i] += count
            total.draft_lengths.extend(stats.draft_lengths)
            for name in ("profile", "profile_passes"):
                if getattr(stats, name) is not None:
                    mine = getattr(total, name) or {}
                    setattr(total, name, {section: mine.get(section, 0) + value
                                          for section, value in getattr(stats, name).items()})
        return total

    def record_seconds(self, draft_seconds: float, verify_seconds: float) -> None:
        """Add one round's time drafting, and verifying with everything after it."""
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds

    def record_round(
        self, num_draft_tokens: int, num_accepted: list[int], num_emitted: list[int], rows: list[int], batch_size: int,
        depth: int | None = None, expected_accepted: list[float] | None = None,
    ) -> None:
        """Count one target pass in which each of ``rows`` (batch indices) proposed ``num_draft_tokens``, and
        accepted and emitted its entry of ``num_accepted`` and ``num_emitted``; ``depth``: the tree's depth, for a
        round that proposed a tree of ``num_draft_tokens`` nodes; ``expected_accepted``: per row, the rule's expected
        count given the draft (``None``: the counts)."""
        self.rows.extend(SpeculativeStats() for _ in range(batch_size - len(self.rows)))
        self._count_round(num_draft_tokens)
        positions = num_draft_tokens if depth is None else depth
        expected_accepted = num_accepted if expected_accepted is None else expected_accepted
        for row, accepted, emitted, expected in zip(rows, num_accepted, num_emitted, expected_accepted):
            self.rows[row]._count_round(num_draft_tokens)
            self.rows[row]._count_tokens(num_draft_tokens, positions, accepted, emitted, expected)
            self._count_tokens(num_draft_tokens, positions, accepted, emitted, expected)

    def _count_round(self, num_draft_tokens: int) -> None:
        self.num_rounds += 1
        self.draft_lengths.append(num_draft_tokens)

    def _count_tokens(self, num_draft_tokens: int, num_positions: int, num_accepted: int, num_emitted: int,
                      expected_accepted: float) -> None:
        _grow(self.accepted_by_position, num_positions)
        _grow(self.proposed_by_position, num_positions)
        for position in range(num_positions):
            self.proposed_by_position[position] += 1
            self.accepted_by_position[position] += position < num_accepted
        _grow(self.rounds_by_accepted, num_accepted + 1)
        self.rounds_by_accepted[num_accepted] += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted += num_accepted
        self.num_emitted += num_emitted
        self.expected_accepted += float(expected_accepted)

    def to_dict(self) -> dict:
        """Every counter and derived rate, JSON-ready."""
        return {
            **{field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "rows"},
            "rows": [row.to_dict() for row in self.rows],
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
            "acceptance_by_position": self.acceptance_by_position,
            "rounds_by_draft_length": self.rounds_by_draft_length,
            "mean_draft_length": self.mean_draft_length,
        }

    def __str__(self) -> str:
        text = (
            f"rounds {self.num_rounds}, proposed {self.num_draft_tokens}, accepted {self.num_accepted} "
            f"({self.acceptance_rate:.1%}), {self.tokens_per_round:.2f} tokens per target pass, "
            f"drafting {self.draft_seconds:.2f} s, verifying {self.verify_seconds:.2f} s"
        )
        if len([count for count in self.rounds_by_draft_length if count]) > 1:
            text += f"; {self.mean_draft_length:.2f} tokens drafted per round"
        if len(self.rows) > 1:
            text += "; acceptance by row " + ", ".join(f"{row.acceptance_rate:.1%}" for row in self.rows)
        if self.profile is not None:
            text += "; profile " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.profile.items())
        return text


def _grow(counts: list[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))

