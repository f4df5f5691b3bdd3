"""`OracleDrafter`: a drafter that knows the answer, for measuring what the loop itself costs.

It replays a known continuation (the target's own greedy output, say), so under greedy decoding every token it
proposes is accepted (acceptance 1.0), or, with ``acceptance=a``, each proposed token is replaced by a wrong one with
probability 1 - a (independently; a row's first wrong token ends its accepted run). With ``draft_model`` it also runs
that model's forward passes each round, so a round costs what a real draft's would (c), while the tokens still come
from the answer. With these the speed-up that the loop's own overheads leave can be measured at chosen a, k and c
against the formula (`hf_spec.sizing.speedup`); ``scripts/device_check.py`` does that on a GPU.

Its proposal is a point mass, like prompt lookup's, so under sampling it is still exact (the rule accepts the token
with probability p(x)); it is meant for greedy runs.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from hf_spec.caches import ColumnRules
from hf_spec.drafting.base import DraftContext, Drafter, Proposal
from hf_spec.drafting.lookup import point_mass_proposal
from hf_spec.drafting.model import ModelDrafter
from hf_spec.rows import RaggedBatch


class OracleDrafter(Drafter):
    """Proposes the tokens of ``reference_ids`` that follow each row's current length.

    Args:
        reference_ids: ``[batch, length]`` each row as the answer has it, laid out as ``generate()`` returns rows
            (the left-padded prompt, then the continuation).
        acceptance: the probability that each proposed token is the answer's (else it is replaced by another id).
        draft_model: when given, its forward passes run every round (their tokens are discarded), so drafting costs
            what this model's steps cost.
        generator: for the replacements.
    """

    def __init__(self, reference_ids: torch.Tensor, acceptance: float = 1.0,
                 draft_model: PreTrainedModel | None = None, generator: torch.Generator | None = None):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"`acceptance` must be in [0, 1], but is {acceptance!r}.")
        self.reference_ids, self.acceptance, self.generator = reference_ids, acceptance, generator
        self.model = None if draft_model is None else ModelDrafter(draft_model)

    def propose(self, batch: RaggedBatch, num_draft_tokens: int, context: DraftContext) -> Proposal:
        num_model_steps = 0
        if self.model is not None and num_draft_tokens > 0:
            greedy = DraftContext(context.logits_processor, context.vocab_size, False, None)
            num_model_steps = self.model.propose(batch, num_draft_tokens, greedy).num_model_steps
        candidates = []
        for row in batch.active_list:
            start = batch.lengths[row]
            answer = self.reference_ids[row, start: start + num_draft_tokens].to(batch.model_ids.device)
            if self.acceptance < 1.0 and answer.numel():
                draws = torch.rand(answer.shape, generator=self.generator, device=self.reference_ids.device)
                is_wrong = (draws >= self.acceptance).to(answer.device)
                answer = torch.where(is_wrong, (answer + 1) % context.vocab_size, answer)
            candidates.append(answer)
        if num_draft_tokens == 0 or not any(len(c) for c in candidates):
            candidates = [c[:0] for c in candidates]
        proposal = point_mass_proposal(candidates, batch, context)
        proposal.num_model_steps = num_model_steps
        return proposal

    def match_cache(self, static_length: int | None) -> None:
        if self.model is not None:
            self.model.match_cache(static_length)

    def reset(self) -> None:
        if self.model is not None:
            self.model.reset()

    def roll_back(self, num_cached: int, staying_rows: torch.Tensor | None) -> None:
        """The answer is indexed by batch row, which finished rows keep; only the draft model's cache follows."""
        if self.model is not None:
            self.model.roll_back(num_cached, staying_rows)

    def column_rules(self) -> ColumnRules:
        return ColumnRules() if self.model is None else self.model.column_rules()

    def move_columns(self, first: int, order: torch.Tensor) -> None:
        if self.model is not None:
            self.model.move_columns(first, order)

    def check(self, target: PreTrainedModel, max_length: int) -> None:
        if self.model is not None:
            self.model.check(target, max_length)

    @property
    def cost_key(self):
        return None if self.model is None else self.model.cost_key

    def measure_passes(self, prefix_ids: torch.Tensor, widths: list[int], repeats: int) -> dict[int, float]:
        return {} if self.model is None else self.model.measure_passes(prefix_ids, widths, repeats)
