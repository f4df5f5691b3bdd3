"""How many tokens to draft each round: a fixed k, or the k that maximizes expected emitted tokens per second.

`FixedDraftLength` drafts the same k every round (fewer near ``max_length``). `AutoDraftLength`: a round that drafts k
tokens emits E[tokens](k) = 1 + a_0 + a_0 a_1 + ... + a_0 ... a_{k-1} in expectation (`hf_spec.sizing.speedup`) and
costs k draft steps plus one target pass over k + 1 tokens. `AutoDraftLength` estimates both online, during the call,
and picks ``argmax_k E[tokens](k) / (k * draft_step_seconds + block_seconds(k + 1) + P(k) * catch_up_seconds)``
before every round, where P(k) = a_0 ... a_{k-1} is the chance that the round is accepted in full, after which the
draft's next first pass feeds two tokens (the last drafted one, the bonus one) and costs ``catch_up_seconds`` more
than a step:

- acceptance per block position: counts with exponential forgetting (so it follows the text as it changes between
  code and prose), shrunk towards the pooled rate of all positions, which is shrunk towards a prior; on sampled
  calls the counts are the rule's reach (the chance to keep each prefix of the draft, over the rule's uniforms:
  the drawn count's mean, without the draw's noise);
- costs: the draft's seconds per 1-token forward pass and the target's seconds per pass of each block size, measured
  (means with forgetting); a block size not measured yet is interpolated, or extrapolated with the slope measured so
  far (flat until two sizes are known). The first round, which includes the prompt's prefill, is not timed. The
  catch-up is the probe's ratio of a 2-token to a 1-token draft pass (timed interleaved, so a slow phase of the
  machine hits both) times the step: a round whose first pass caught up counts as its steps plus that premium (a
  longer catch-up, after plain steps, as one premium too: passes of more tokens cost less per token). Folding the
  catch-up into the step instead priced a step at ``step + P(k) catch_up / k``, the dearer the smaller k, which
  pulled k down where acceptance is high.

k = 0 (no draft: a plain target step) is allowed; after ``explore_every`` rounds without drafting, one round drafts a
single token so the acceptance estimate can recover, and each exploration that does not bring drafting back doubles
the wait, so a draft that does not fit (or blocks too expensive to pay for any draft) costs ever less. Before that,
where the estimate says no k pays but one token would pay at `HOPE_ERRORS` standard errors above the first
position's estimate, k = 1: one early rejection must not switch drafting off while the evidence is thin. Likewise
one position further: where k + 1 would pay at `REACH_ERRORS` standard errors above position k's estimate, k + 1 is
drafted. Rounds that stop at k never observe position k, whose estimate then leans on the pooled rate, which the
first positions dominate; on code acceptance rises with the position, so without this a call that fell to k = 1 or 2
after a hard stretch would stay there. The clock has
the last word: once rounds that drafted have measurably emitted fewer tokens per second than plain target steps, k is
0 until explorations raise the cost model's case for drafting well above the case the clock refuted; then drafting is
measured again. What is learnt, and how, is `hf_spec.sizing.online`. `start_from` seeds the
costs with measured ones (`hf_spec.timing.probe.probe_costs`, which speculative ``generate()`` runs once per process
for ``"auto"``): the first rounds are then chosen from them, and where even a draft accepted every time could not beat a
plain step (`CostTable.best_possible_speedup` below 1), it says so in a warning and decodes with k = 0 once the
call's first draft timings have confirmed the probe (`hf_spec.sizing.estimates`).
With a model-free drafter (prompt lookup) draft steps cost nothing and only the block cost limits k.

No state outlives a ``generate()`` call unless you pass your own instance, ``num_assistant_tokens=AutoDraftLength()``,
to several calls: then it starts each call from what the previous ones measured (warm start).
"""

from __future__ import annotations

from hf_spec.checks import check_int
from hf_spec.sizing.base import ChainSizer
from hf_spec.sizing.online import HOPE_ERRORS, REACH_ERRORS, OnlineSizer
from hf_spec.sizing.speedup import expected_tokens, fully_accepted

#: k when neither the call nor the draft's generation config sets ``num_assistant_tokens``.
DEFAULT_NUM_DRAFT_TOKENS = 5
#: Drafted tokens per round at most with ``num_assistant_tokens="auto"``, unless the caller says otherwise.
DEFAULT_MAX_DRAFT_TOKENS = 10


def draft_length_rates(acceptance: list[float], draft_step_seconds: float, block_seconds: list[float],
                       catch_up_seconds: float = 0.0) -> list[float]:
    """Expected tokens per second drafting k = ``0 .. len(block_seconds) - 1`` tokens: the speed-up formula with costs
    in seconds instead of target steps, and the catch-up a fully accepted round causes.

    Args:
        acceptance: ``a_i`` for block positions ``0 .. len(block_seconds) - 2``.
        draft_step_seconds: one draft forward pass over one token (0 for a model-free drafter).
        block_seconds: ``block_seconds[k]``: a target pass over ``k + 1`` tokens.
        catch_up_seconds: what the draft's first pass after a round accepted in full costs beyond a step (0 for a
            drafter that does not catch up).
    """
    return [expected_tokens(acceptance, k) / (k * draft_step_seconds + block_seconds[k]
                                              + (catch_up_seconds * fully_accepted(acceptance, k) if k else 0.0))
            for k in range(len(block_seconds))]


def best_draft_length(acceptance: list[float], draft_step_seconds: float, block_seconds: list[float],
                      catch_up_seconds: float = 0.0) -> int:
    """The k with the most expected tokens per second (`draft_length_rates`)."""
    rates = draft_length_rates(acceptance, draft_step_seconds, block_seconds, catch_up_seconds)
    return max(range(len(rates)), key=rates.__getitem__)


class FixedDraftLength(ChainSizer):
    """The same k every round, fewer when fewer tokens are left before ``max_length``."""

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = check_int("num_assistant_tokens", num_draft_tokens)

    @property
    def max_drafted(self) -> int:
        return self.num_draft_tokens

    def choose(self, limit: int) -> int:
        return min(self.num_draft_tokens, limit)

    def update(self, num_draft_tokens: int, num_accepted: list[int], draft_seconds: float, num_model_steps: int,
               verify_seconds: float | None, num_catch_up_tokens: int = 0,
               reach: list[list[float]] | None = None) -> None:
        """Nothing to learn."""


class HeuristicDraftLength(ChainSizer):
    """transformers' "heuristic" schedule: start from k; after a round whose draft every row accepted in full, k + 2,
    otherwise k - 1 (at least 1). It starts again at every call (transformers' "heuristic_transient"; its
    "heuristic" writes k into the draft's config to carry it to the next call, which hf_spec does not do)."""

    def __init__(self, num_draft_tokens: int):
        self.initial = self.num_draft_tokens = check_int("num_assistant_tokens", num_draft_tokens)

    @property
    def max_drafted(self) -> int:
        """No largest k of its own: every round is capped at `DEFAULT_MAX_DRAFT_TOKENS` where a bound is needed."""
        return DEFAULT_MAX_DRAFT_TOKENS

    def choose(self, limit: int) -> int:
        return min(self.num_draft_tokens, limit)

    def update(self, num_draft_tokens: int, num_accepted: list[int], draft_seconds: float, num_model_steps: int,
               verify_seconds: float | None, num_catch_up_tokens: int = 0,
               reach: list[list[float]] | None = None) -> None:
        if num_draft_tokens == 0:
            return
        is_full = all(accepted == num_draft_tokens for accepted in num_accepted)
        self.num_draft_tokens = self.num_draft_tokens + 2 if is_full else max(1, self.num_draft_tokens - 1)


class AutoDraftLength(OnlineSizer, ChainSizer):
    """Chooses k before every round from acceptance and costs measured online (see the module docstring).

    Args:
        max_draft_tokens: largest k considered.
        initial: k of the first round, before anything is measured.
        prior_acceptance, prior_weight: the acceptance assumed before any round, worth this many observations.
        decay: forgetting factor per observation, in (0, 1]; 1 never forgets.
        explore_every: after this many rounds at k = 0 (fewer early on), draft one token once.

    Attributes:
        chosen: k of the last rounds (up to `hf_spec.sizing.online.MAX_CHOSEN`), across calls when reused.
    """

    def __init__(self, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS, initial: int = 4,
                 prior_acceptance: float = 0.6, prior_weight: float = 2.0, decay: float = 0.97, explore_every: int = 8):
        self.max_draft_tokens = check_int("max_draft_tokens", max_draft_tokens)
        super().__init__(max_draft_tokens, max_draft_tokens + 1, min(check_int("initial", initial, minimum=0),
                                                                     max_draft_tokens),
                         prior_acceptance, prior_weight, decay, explore_every)

    @property
    def max_drafted(self) -> int:
        return self.max_draft_tokens

    def acceptance(self) -> list[float]:
        """Estimated P(accepted | reached) per block position."""
        return self.first.estimate()

    def choose(self, limit: int) -> int:
        """k for the next round, at most ``limit`` (tokens left before ``max_length``)."""
        limit = max(0, min(limit, self.max_draft_tokens))
        k = self._forced_choice()
        if k is None:
            draft_step = self.costs.draft_step.get(0.0)  # 0 until a draft model ran (prompt lookup costs nothing)
            blocks = [self.block_seconds(size) for size in range(1, limit + 2)]
            rates = draft_length_rates(self.acceptance(), draft_step, blocks, self.costs.catch_up_ratio * draft_step)
            k = max(range(len(rates)), key=rates.__getitem__)
            if k > 0 and self.clock.overrules(rates[k] / rates[0]):
                k = 0  # the cost model says draft, the clock says no: trust the clock, explore later
            elif k == 0 and len(rates) > 1:  # a draft of one token may still pay: it costs little and buys evidence
                hopeful = self.first.hopeful(HOPE_ERRORS)
                k = int(draft_length_rates(hopeful, draft_step, blocks[:2], self.costs.catch_up_ratio * draft_step)[1]
                        > rates[0])
            elif 0 < k < len(rates) - 1:  # one position further, while the evidence there is thin
                hopeful = self.first.hopeful(REACH_ERRORS, position=k)
                k += int(draft_length_rates(hopeful, draft_step, blocks[:k + 2],
                                            self.costs.catch_up_ratio * draft_step)[k + 1] > rates[k])
        k = min(k, limit)
        self._chose(k)
        return k

    def update(self, num_draft_tokens: int, num_accepted: list[int], draft_seconds: float, num_model_steps: int,
               verify_seconds: float | None, num_catch_up_tokens: int = 0,
               reach: list[list[float]] | None = None) -> None:
        """Learn from a finished round: each active row's accepted count (or its reach), and the round's timings.

        Args:
            num_draft_tokens: tokens proposed per row this round.
            num_accepted: per active row.
            verify_seconds: the target pass, or ``None`` when it must not be timed (the first round's prefill).
            num_catch_up_tokens: tokens the draft's first pass fed beyond one (`Proposal.num_catch_up_tokens`).
            reach: per active row, the chance to keep at least j = 0 .. k draft tokens given its draft, where the
                acceptance rule reports it: acceptance is learnt from it instead of the counts (the same mean, less
                noise, and every drafted position observed).
        """
        if reach is not None:
            for row in reach:
                self.first.add_reach(row)
        else:
            for accepted in num_accepted:
                self.first.add_counts(num_draft_tokens, accepted)
        if num_draft_tokens > 0:  # a plain step reaches no position: nothing to forget
            reached = num_draft_tokens if reach is not None else max(num_accepted, default=-1) + 1
            self.first.forget_unreached(min(num_draft_tokens, reached))
        emitted = 1.0 + sum(num_accepted) / max(1, len(num_accepted))  # per row
        self._learn_round(num_draft_tokens + 1, self.costs.draft_step, draft_seconds, num_model_steps,
                          verify_seconds, emitted, self.costs.catch_up_ratio * min(num_catch_up_tokens, 1))
