"""What the loop asks of a drafter, and what a drafter hands back.

A drafter proposes up to k tokens for every active row, each drawn from a law q that depends only on the row's
prefix, and returns q. That is all the acceptance rule needs for exactness: `hf_spec.rejection` accepts token x with
probability min(1, p(x) / q(x)) and resamples a rejection from normalize(max(0, p - q)), whatever q is.

What drafters do not do: choose k (`hf_spec.sizing.draft_length` does), or touch the target's cache.

The core knows every drafter through this contract only: a drafter of your own, a draft model (`ModelDrafter`), a draft
head (`hf_spec.heads`: its model hands the loop a drafter through `DraftSource`), prompt lookup. Its hooks say what
it reads from the target's verify pass (``feature_layers``), what it costs (`measure_passes`, for the cost probe) and
whether it fits the target (`check`).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList, PreTrainedModel

from hf_spec.caches import ColumnRules
from hf_spec.conditioning import Conditioning
from hf_spec.forward import has_invalid_values
from hf_spec.rejection import sample_from_weights
from hf_spec.rows import RaggedBatch
from logits_processors import process_step

if TYPE_CHECKING:
    from hf_spec.drafting.tree import DraftTree


@dataclasses.dataclass
class Proposal:
    """What a drafter proposes for one round."""

    draft_ids: torch.Tensor  # [active, k]
    draft_probs: torch.Tensor | None  # [active, k, vocab] the law each token was drawn from; None when greedy
    is_invalid: torch.Tensor  # [2] bool: NaN/inf draft logits; processed scores with NaN/+inf or nothing unmasked
    num_model_steps: int  # draft-model forward passes it took (0 for lookup): what the draft-length chooser times
    # tokens its first pass fed beyond one (after a round accepted in full: the last drafted and the bonus token; after
    # plain steps: what they skipped); 0 for drafters that do not report it, whose catch-ups count as steps
    num_catch_up_tokens: int = 0

    @property
    def num_draft_tokens(self) -> int:
        return self.draft_ids.shape[1]

    def as_tree(self) -> DraftTree:
        """A one-row chain as the tree it is: node i's parent is node i - 1."""
        from hf_spec.drafting.tree import DraftTree  # the tree module builds on this one

        k = self.num_draft_tokens
        return DraftTree(self.draft_ids[0], list(range(-1, k - 1)), None, self.is_invalid, self.num_model_steps,
                         self.num_catch_up_tokens)


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What every drafter needs to know about the call.

    ``stop_below``: transformers' ``assistant_confidence_threshold``: a chain drafter stops drafting once the law it
    drew from gave its token less than this probability, for every row (`is_unconfident`). The decision depends on
    the draft's own tokens and laws only, so the output law stays the target's. Drafters without a model (prompt
    lookup: a point mass) never stop early.
    """

    logits_processor: LogitsProcessorList
    vocab_size: int
    do_sample: bool
    generator: torch.Generator | None
    stop_below: float | None = None


def not_a_transformers_draft(draft) -> str:
    """What to say when transformers' own ``generate()`` (a model not made speculative) is handed an hf_spec draft."""
    return (f"`assistant_model` is {type(draft).__name__}, an hf_spec draft, which only hf_spec's decoding loop runs; "
            "this model's generate() is transformers' own. Make the model speculative first "
            "(`model = hf_spec.speculative(model)`), or pass hf_spec's recipe as `custom_generate=` "
            "(docs/generation.md).")


class Drafter(abc.ABC):
    """Proposes draft tokens; keeps whatever state it has consistent with the loop's rollbacks.

    A drafter that reads the target's hidden states (a draft head) names them in ``feature_layers`` (indices into
    transformers' ``output_hidden_states`` tuple); the loop's verify pass then hands them to `observe`.
    """

    feature_layers: list[int] | None = None
    #: Whether its proposals count `Proposal.num_catch_up_tokens` (a draft model with its own cache): the cost probe
    #: then times its 2-token pass too, which auto k prices after a round accepted in full.
    reports_catch_up: bool = False

    def __getattr__(self, name: str):
        if name in ("config", "generation_config"):  # what transformers' own assisted generation reads first
            raise AttributeError(not_a_transformers_draft(self))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @abc.abstractmethod
    def propose(self, batch: RaggedBatch, num_draft_tokens: int, context: DraftContext) -> Proposal:
        """Up to ``num_draft_tokens`` tokens for every active row of ``batch`` (the same number for all of them)."""

    def observe(self, features: torch.Tensor, start: int) -> None:
        """The target's ``feature_layers`` hidden states ``[active, fed, F]`` for the columns ``start ..`` its verify
        pass fed (committed tokens and this round's drafts; a rollback follows)."""

    def roll_back(self, num_cached: int, staying_rows: torch.Tensor | None) -> None:
        """Keep at most ``num_cached`` positions of state, and only ``staying_rows`` (indices into the active rows)."""

    def column_rules(self) -> ColumnRules:
        """What the drafter's own cache asks of the batch's columns (a sliding window, recurrent states:
        `hf_spec.caches.ColumnRules`); the default asks nothing."""
        return ColumnRules()

    def move_columns(self, first: int, order: torch.Tensor) -> None:
        """Before `roll_back`, after a round in which the loop moved the rows' columns ``first ..`` (row a's column
        ``first + j`` now holds what its column ``first + order[a, j]`` held; `hf_spec.caches.move_columns`). A
        drafter whose state follows the columns moves it the same way; one that does not keeps an older view, which
        can cost acceptance, never exactness (whatever its law q, the acceptance rule keeps the target's)."""

    def reset(self) -> None:
        """Forget the previous call's state; the loop calls it before a call's first round (a drafter passed as
        ``assistant_model`` serves many calls)."""

    def condition(self, conditioning: Conditioning, prompt_ids: torch.Tensor,
                  prompt_mask: torch.Tensor | None) -> None:
        """After `reset`, before the first round: what the call's models read beside the tokens (an encoder's
        outputs, the prompt's images: `hf_spec.conditioning`), with the prompts ``[batch, prompt]``. A drafter
        without a model ignores it (the default)."""

    def match_cache(self, static_length: int | None) -> None:
        """Before `reset`: the target's cache is static with ``static_length`` positions (``None``: dynamic). A
        drafter with a model of its own may give it a cache of the same kind; the default keeps whatever it has
        (a draft head's small cache stays dynamic)."""

    def check(self, target: PreTrainedModel, max_length: int) -> None:
        """Refuse, before any forward pass and with an error naming ``assistant_model``, a drafter that cannot serve
        ``target`` up to ``max_length`` tokens (another device, another model's head, too short a position table)."""

    @property
    def cost_key(self) -> object | None:
        """What the drafter's cost depends on (its model), weakly referenced by the cost probe's cache; ``None`` for a
        drafter whose proposals cost no forward pass."""
        return None

    def measure_passes(self, prefix_ids: torch.Tensor, widths: list[int], repeats: int) -> dict[int, float]:
        """Median seconds of the drafter's forward pass over each of ``widths`` tokens after a cached ``prefix_ids``
        ``[1, S]`` (the cost probe's draft column); ``{}`` when proposals cost no forward pass (prompt lookup)."""
        return {}


@runtime_checkable
class DraftSource(Protocol):
    """A model passed as ``assistant_model`` that hands the loop its own drafter (a draft head does): the core calls
    ``hf_spec_drafter`` instead of drafting with the model's forward pass."""

    def hf_spec_drafter(self, *, tree: bool) -> Drafter:
        """The drafter for one call: a chain drafter, or a `hf_spec.drafting.tree.TreeDrafter` when ``tree``."""


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Make draft logits ``[..., draft_vocab]`` as wide as the target's ``vocab_size``.

    Extra draft rows are dropped (the target cannot emit those ids, so proposing them only wastes a round); missing
    rows get ``-inf``, probability 0. Same tokenizer, different embedding-row counts (e.g. padded to a multiple of 64).
    """
    if logits.shape[-1] == vocab_size:
        return logits
    if logits.shape[-1] > vocab_size:
        return logits[..., :vocab_size]
    return F.pad(logits, (0, vocab_size - logits.shape[-1]), value=float("-inf"))


def draw_next(logits: torch.Tensor, batch: RaggedBatch, draft_ids: torch.Tensor,
              context: DraftContext) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The next draft token of every active row, from a draft's raw logits ``[active, draft vocab]``: processed by the
    call's chain with the row's prefix and ``draft_ids`` ``[active, i]``, then sampled (argmax when greedy).

    Returns:
        ``(next_ids [active], probs [active, vocab] or None when greedy, is_invalid [2])``: the law each token was
        drawn from, and whether the raw logits / processed scores were unusable.
    """
    logits = align_vocab(logits, context.vocab_size)  # [active, vocab]
    row_ids, lengths = batch.row_view(draft_ids)
    step_scores = batch.to_active(
        process_step(context.logits_processor, row_ids, batch.to_batch(logits), lengths)
    )  # [active, vocab]
    is_invalid = torch.stack([has_invalid_values(logits), has_invalid_values(step_scores)])
    probs = step_scores.softmax(dim=-1) if context.do_sample or context.stop_below is not None else None
    if not context.do_sample:
        return step_scores.argmax(dim=-1), probs, is_invalid
    return sample_from_weights(probs, context.generator), probs, is_invalid


def is_unconfident(probs: torch.Tensor | None, next_ids: torch.Tensor, context: DraftContext) -> bool:
    """Whether drafting stops here: every row's law ``probs`` ``[active, vocab]`` gave its token ``next_ids``
    ``[active]`` less than ``context.stop_below`` (one host synchronization; none without a threshold)."""
    if context.stop_below is None or probs is None:
        return False
    return bool((probs.gather(1, next_ids[:, None]) < context.stop_below).all())


def stack_laws(probs: list[torch.Tensor], draft_ids: torch.Tensor, context: DraftContext) -> torch.Tensor | None:
    """``[active, k, vocab]`` the laws of a chain's draft tokens (``None`` when greedy)."""
    if not context.do_sample:
        return None
    if probs:
        return torch.stack(probs, dim=1)
    return torch.empty((draft_ids.shape[0], 0, context.vocab_size), device=draft_ids.device)
