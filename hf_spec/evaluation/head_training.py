"""Train a draft head (`DraftHead`, or EAGLE-3's `Eagle3Head`) on the target's hidden states with transformers'
`Trainer`.

1. `feature_dataset`: run the target once over each training sequence (plain text chunks from `text_dataset`, or
   prompts with the target's own continuations from `continuation_dataset`) and keep, per token, the hidden states
   the head reads and the target's last one (its next-token law is ``lm_head`` of it), as a ``datasets.Dataset``
   saved on disk and reloaded on the next run.
2. `train_head`: `HeadTrainer` minimises, at every pair (f_t, x_{t+1}), the cross-entropy of the head's law against
   the target's law at t + 1 (over the ids a pruned head keeps), plus for EAGLE-1 heads the smooth-L1 distance between
   h_t and the target's feature f_{t+1} (EAGLE-1's two losses; EAGLE-3 drops the feature loss). With ``ttt_steps`` > 1
   it also unrolls the head on its own h, as it drafts, and matches the law at every block position (EAGLE-3's
   training-time test, `head_loss`). A held-out split is evaluated every ``eval_steps``; early stopping keeps the best
   head by held-out loss; the held-out top-1 agreement at each block position (the share of pairs where argmax q =
   argmax p) is logged beside it as the learning curve.
3. `evaluate_head`: agreement and the expected acceptance 1 - TV(p, q) on held-out pairs, through the project's
   ``evaluate`` metric.

Under ``accelerate launch --num_processes N`` (gloo on CPUs) the `Trainer` distributes the same call; the feature
set is built once, by the main process, and read by the others from disk.

Where it departs from EAGLE-3: the unrolled positions see the true next tokens (teacher forcing, as speculators
trains), and the loss is the cross-entropy against the target's whole law, not its top-1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import EarlyStoppingCallback, PreTrainedModel, Trainer, TrainingArguments

from hf_spec.checks import check_int
from hf_spec.extras import require
from hf_spec.heads.base import DraftHeadBase
from hf_spec.heads.eagle3 import Eagle3Head
from hf_spec.heads.model import DraftHead


@torch.no_grad()
def feature_dataset(target: PreTrainedModel, sequences: list[list[int]], feature_layers: list[int],
                    path: str | Path | None = None, progress: bool = True):
    """Per sequence: ``input_ids`` [S], ``features`` [S, F] (the ``feature_layers`` hidden states, concatenated) and,
    unless the features are only that, ``last`` [S, hidden] (the target's last hidden state, after its final norm),
    float32.

    With ``path``, the dataset is kept in a folder under it keyed by the target's config, the layers and the
    sequences, and loaded from there when it exists.
    """
    datasets = require("datasets", "train", "Training a draft head")
    from tqdm.auto import tqdm

    sequences = [list(map(int, ids)) for ids in sequences if len(ids) >= 2]
    if not sequences:
        raise ValueError("No training sequence: the corpus is empty, or every text is shorter than 2 tokens.")
    if path is not None:
        key = hashlib.sha256(json.dumps([target.config.to_json_string(), list(feature_layers), sequences]).encode())
        path = Path(path) / f"features-{key.hexdigest()[:16]}"
        if (path / "dataset_info.json").exists():
            return datasets.load_from_disk(str(path)).with_format("torch")
    text = target.config.get_text_config()
    layers = list(feature_layers)
    width = text.hidden_size * len(layers)
    with_last = [i % (text.num_hidden_layers + 1) for i in layers] != [text.num_hidden_layers]  # else: features

    def rows():
        for ids in tqdm(sequences, desc="target features", disable=not progress):
            input_ids = torch.tensor([ids], device=target.device)
            hidden = target(input_ids, output_hidden_states=[*layers, -1]).hidden_states
            features = torch.cat([hidden[i] for i in layers], dim=-1)[0]  # [S, F]
            row = {"input_ids": ids, "features": features.float().cpu().numpy()}
            if with_last:
                row["last"] = hidden[-1][0].float().cpu().numpy()
            yield row

    columns = {"input_ids": datasets.Sequence(datasets.Value("int64")),
               "features": datasets.Array2D((None, width), "float32")}
    if with_last:
        columns["last"] = datasets.Array2D((None, text.hidden_size), "float32")
    schema = datasets.Features(columns)
    dataset = datasets.Dataset.from_list(list(rows()), features=schema)
    if path is not None:
        dataset.save_to_disk(str(path))
    return dataset.with_format("torch")


def last_hidden(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, S, hidden]`` the target's last hidden state: its own column, or the features when they are only that
    (EAGLE-1)."""
    return batch["last"] if "last" in batch else batch["features"]


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad a list of `feature_dataset` rows: ``input_ids`` [B, S], ``features`` [B, S, F], ``last``
    [B, S, hidden] when present, ``attention_mask`` [B, S]."""
    width = max(len(example["input_ids"]) for example in examples)
    batch = {"attention_mask": torch.zeros(len(examples), width, dtype=torch.long)}
    for name in [name for name in ("input_ids", "features", "last") if name in examples[0]]:
        tensors = [torch.as_tensor(example[name]) for example in examples]
        batch[name] = torch.stack([F.pad(t, [0, 0] * (t.dim() - 1) + [0, width - len(t)]) for t in tensors])
    for row, example in enumerate(examples):
        batch["attention_mask"][row, : len(example["input_ids"])] = 1
    return batch


@dataclasses.dataclass
class HeadLoss:
    """What `head_loss` measured on a batch."""

    loss: torch.Tensor  # 0-dim, to minimise
    agreements: list[torch.Tensor]  # per block position j: [B, S - 1], 1 where argmax q = argmax p
    valid: list[torch.Tensor]  # per block position j: [B, S - 1] bool, the anchors that count


def head_loss(head: torch.nn.Module, batch: dict[str, torch.Tensor], teacher: torch.nn.Module,
              feature_weight: float, ttt_steps: int = 1, ttt_decay: float = 1.0) -> HeadLoss:
    """The loss over the pairs s = 0 .. S - 2 of a batch (`collate`'s keys), unrolled ``ttt_steps`` block positions.

    Block position 0: the pair (f_s, x_{s+1}) read with the target's feature; the head's law q is matched to the
    target's p_{s+1} (the law of x_{s+2}). Block position j > 0, EAGLE-3's training-time test: the pair (the head's
    own h of anchor s at position j - 1, x_{s+1+j}), attending, as when it drafts, to the entries read with the
    target's features up to s and to its own entries of anchor s; q is matched to p_{s+1+j}. The loss at a position
    is the mean cross-entropy of q against p (restricted to the ids q can give, renormalised), weighted by
    ``ttt_decay ** j``, plus, at position 0, ``feature_weight`` times the smooth-L1 distance of h to the target's last
    hidden state at s + 1 (EAGLE-1). Positions are averaged by their weights.
    """
    mask = batch["attention_mask"]  # [B, S]
    num_pairs = mask.shape[1] - 1
    pairs = (mask[:, :-1] * mask[:, 1:]).bool()  # [B, m]: pair s is real
    last = last_hidden(batch)[:, 1:]  # [B, m, hidden]: last[:, s] gives p_{s+1}
    with torch.no_grad():
        p = F.softmax(teacher(last.to(teacher.weight.dtype)).float(), dim=-1)  # [B, m, V]
    loss, weights, agreements, valid = 0.0, 0.0, [], []
    is_valid = pairs
    for j, output in enumerate(unroll(head, batch, ttt_steps)):
        if j > 0:  # anchor s at position j also needs pair s + j
            is_valid = is_valid & F.pad(pairs[:, j:], (0, j), value=False)
        kept = num_pairs - j  # anchors whose target law p_{s+1+j} exists
        log_q = F.log_softmax(output.logits[:, :kept].float(), dim=-1)  # [B, kept, V]
        with torch.no_grad():
            reachable = torch.isfinite(log_q)
            target = p[:, j:] * reachable
            target = target / target.sum(-1, keepdim=True).clamp_min(1e-12)
        cross_entropy = -(target * log_q.masked_fill(~reachable, 0.0)).sum(-1)  # [B, kept]
        counted = is_valid[:, :kept]
        if counted.any():
            step_loss = cross_entropy[counted].mean()
            if j == 0 and feature_weight:
                distance = F.smooth_l1_loss(output.hidden_states.float(), last.float(), reduction="none")
                step_loss = step_loss + feature_weight * distance.mean(-1)[pairs].mean()
            loss, weights = loss + ttt_decay ** j * step_loss, weights + ttt_decay ** j
        agreement = (output.logits[:, :kept].argmax(-1) == p[:, j:].argmax(-1)).float()
        agreements.append(F.pad(agreement, (0, j)))
        valid.append(is_valid)
    return HeadLoss(loss / weights if weights else p.new_zeros(()).requires_grad_(), agreements, valid)


def unroll(head: torch.nn.Module, batch: dict[str, torch.Tensor], num_positions: int) -> Iterator:
    """The head's outputs at block positions 0 .. ``num_positions`` - 1 for every anchor s of a batch, as it would
    draft them after reading the target's features up to s (see `head_loss`): position 0 from the pairs
    (f_s, x_{s+1}), position j from (its own h of anchor s at j - 1, x_{s+1+j}) at position s + j, seeing the
    position-0 entries up to s and its own entries of anchor s. Yields `DraftHeadOutput` with ``[B, S - 1, ...]``."""
    module = getattr(head, "module", head)
    mask = batch["attention_mask"]
    ids = batch["input_ids"][:, 1:]  # [B, m]: x_{s+1}
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)  # [B, m]
    cache = module.new_cache() if num_positions > 1 else None
    output = head(ids, features=batch["features"][:, :-1], attention_mask=mask[:, 1:], position_ids=positions,
                  cache=cache)
    yield output
    for j in range(1, num_positions):
        output = head(F.pad(ids[:, j:], (0, j)), predicted=output.hidden_states,
                      attention_mask=module.custom_mask(_unrolled_visibility(mask[:, 1:].bool(), j)),
                      position_ids=positions + j, cache=cache)
        yield output


def _unrolled_visibility(is_real: torch.Tensor, step: int) -> torch.Tensor:
    """``[B, m, (step + 1) m]`` bool: what anchor s sees at block position ``step`` of the training-time test: the
    entries of position 0 (read with the target's features) at real columns up to s, and its own entry at every
    position 1 .. ``step``. ``is_real`` [B, m]."""
    batch, num_pairs = is_real.shape
    causal = torch.ones(num_pairs, num_pairs, dtype=torch.bool, device=is_real.device).tril()
    first = causal[None] & is_real[:, None, :]  # [B, m, m]
    own = torch.eye(num_pairs, dtype=torch.bool, device=is_real.device)[None].expand(batch, -1, -1)
    return torch.cat([first, *[own] * step], dim=-1)


class HeadTrainer(Trainer):
    """A `Trainer` with `head_loss`; held-out evaluation also logs ``eval_agreement`` (top-1, block position 0) and,
    with the training-time test, ``eval_agreement_j`` for the later block positions j."""

    def __init__(self, *args, feature_weight: float = 0.0, ttt_steps: int = 1, ttt_decay: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.feature_weight, self.ttt_steps, self.ttt_decay = feature_weight, ttt_steps, ttt_decay
        self._agreements: list[list[torch.Tensor]] = [[] for _ in range(ttt_steps)]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        head = self.accelerator.unwrap_model(model)
        measured = head_loss(model, inputs, head.target_output_layer(), self.feature_weight, self.ttt_steps,
                             self.ttt_decay)
        if not model.training:
            for kept, agreements, valid in zip(self._agreements, measured.agreements, measured.valid):
                kept.append(agreements[valid].detach().cpu())
        return (measured.loss, None) if return_outputs else measured.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "eval_loss" in logs:  # every process evaluated its shard: add up (agreements, pairs) over processes
            for position, kept in enumerate(self._agreements):
                agreements = torch.cat(kept) if kept else torch.zeros(0)
                totals = torch.tensor([agreements.sum(), len(agreements)], dtype=torch.float64,
                                      device=self.args.device)
                totals = self.accelerator.reduce(totals, reduction="sum")
                key = "eval_agreement" + (f"_{position}" if position else "")
                logs[key] = float(totals[0] / totals[1].clamp_min(1))
                kept.clear()
        super().log(logs, *args, **kwargs)


#: The optimiser settings a head kind trains with unless told otherwise. An EAGLE-3 head: SpecForge's learning rate,
#: EAGLE-3's decay, a 10% warm-up and clipping at 0.5; with these its training-time test trained positions 1 and 2 on
#: the 1.5B target, where 3e-4 without warm-up diverged (docs/heads.md). The EAGLE-1 head: its measured recipe.
RECIPES = {"eagle3": {"learning_rate": 1e-4, "warmup_steps": 0.1, "max_grad_norm": 0.5, "ttt_decay": 0.8},
           "eagle": {"learning_rate": 3e-4, "warmup_steps": 0, "max_grad_norm": 1.0, "ttt_decay": 1.0}}


def train_head(target: PreTrainedModel, train_dataset, eval_dataset, output_dir: str | Path, *,
               head: DraftHeadBase | None = None, feature_layers: tuple[int, ...] = (-1,), num_layers: int = 1,
               feature_weight: float | None = None, ttt_steps: int = 1, ttt_decay: float | None = None,
               patience: int = 3, **training_arguments) -> tuple[DraftHeadBase, list[dict]]:
    """Train ``head`` (default: `DraftHead.from_target(target, feature_layers, num_layers)`, in float32) on
    `feature_dataset` rows; keep the best by held-out loss (early stopping after ``patience`` evaluations without
    improvement), save it to ``output_dir`` with ``save_pretrained``. Returns it and the Trainer's log history.

    ``feature_weight``: of the feature loss (default 1 for EAGLE-1 heads reading the last layer, 0 otherwise).
    ``ttt_steps``, ``ttt_decay``: block positions of EAGLE-3's training-time test and the weight ratio between
    consecutive ones (`head_loss`; 1: position 0 only, as EAGLE-1).
    ``training_arguments`` go to `TrainingArguments` (``max_steps``, ``learning_rate``, ``eval_steps``, ...); the
    head kind's `RECIPES` entry fills in the optimiser settings not given.
    """
    for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if dataset is None or len(dataset) == 0:
            raise ValueError(f"`{name}` is empty: build it with `feature_dataset` from a non-empty corpus.")
    check_int("ttt_steps", ttt_steps)
    head = head if head is not None else DraftHead.from_target(target, feature_layers, num_layers).float()
    recipe = dict(RECIPES["eagle3" if isinstance(head, Eagle3Head) else "eagle"])
    default_decay = recipe.pop("ttt_decay")
    ttt_decay = default_decay if ttt_decay is None else ttt_decay
    if not 0.0 < ttt_decay <= 1.0:
        raise ValueError(f"`ttt_decay` must be in (0, 1], but is {ttt_decay!r}.")
    if feature_weight is None:
        is_eagle1 = (isinstance(head, DraftHead)
                     and head.config.feature_layers in ([-1], [head.config.target_num_layers]))
        feature_weight = 1.0 if is_eagle1 else 0.0
    defaults = {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 4, **recipe, "max_steps": 200,
                "logging_steps": 10, "eval_strategy": "steps", "eval_steps": 20, "save_strategy": "steps",
                "save_total_limit": 1, "save_only_model": True, "load_best_model_at_end": True,
                "metric_for_best_model": "eval_loss", "greater_is_better": False, "report_to": "none",
                "remove_unused_columns": False, "label_names": [], "use_cpu": not torch.cuda.is_available(),
                "dataloader_pin_memory": torch.cuda.is_available()}
    arguments = {**defaults, **training_arguments}
    arguments["save_steps"] = arguments.get("save_steps", arguments["eval_steps"])
    args = TrainingArguments(output_dir=str(output_dir), **arguments)
    head.train()
    trainer = HeadTrainer(model=head, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                          data_collator=collate, feature_weight=feature_weight, ttt_steps=ttt_steps,
                          ttt_decay=ttt_decay, callbacks=[EarlyStoppingCallback(early_stopping_patience=patience)])
    trainer.train()
    head = trainer.accelerator.unwrap_model(trainer.model).eval()
    if trainer.is_world_process_zero():
        head.save_pretrained(str(output_dir))
    return head, trainer.state.log_history


@torch.no_grad()
def evaluate_head(head: DraftHeadBase, dataset, max_metric_positions: int = 256,
                  num_positions: int = 3) -> dict[str, float]:
    """Held-out figures of ``head``: top-1 ``agreement`` with the target at block position 0 over every pair, the
    same at block positions 0 .. ``num_positions`` - 1 (``agreement_by_position``: the head unrolled on its own h
    with the true tokens, as in `head_loss`), and the project's ``evaluate`` metric (expected sampling acceptance
    1 - TV at temperature 1, and greedy acceptance) at position 0 over the first ``max_metric_positions`` pairs."""
    evaluate = require("evaluate", "train", "Evaluating a draft head")

    from hf_spec.evaluation.draft_fit import METRIC_PATH

    head.eval()
    teacher = head.target_output_layer()
    by_position, p_rows, q_rows = [[] for _ in range(num_positions)], [], []
    for start in range(0, len(dataset), 4):
        batch = collate([dataset[i] for i in range(start, min(start + 4, len(dataset)))])
        batch = {name: value.to(head.device) for name, value in batch.items()}
        measured = head_loss(head, batch, teacher, 0.0, ttt_steps=num_positions)
        for kept, agreements, valid in zip(by_position, measured.agreements, measured.valid):
            kept.append(agreements[valid])
        if sum(len(rows) for rows in p_rows) < max_metric_positions:
            pairs = measured.valid[0]
            output = head(batch["input_ids"][:, 1:], features=batch["features"][:, :-1],
                          attention_mask=batch["attention_mask"][:, 1:])
            last = last_hidden(batch)[:, 1:]
            p_rows.append(F.softmax(teacher(last.to(teacher.weight.dtype)).double(), -1)[pairs])
            q_rows.append(F.softmax(output.logits.double(), -1)[pairs])
    p, q = torch.cat(p_rows)[:max_metric_positions], torch.cat(q_rows)[:max_metric_positions]
    metric = evaluate.load(METRIC_PATH)
    sampled = metric.compute(target_probs=p.tolist(), draft_probs=q.tolist(), ks=[5])
    greedy = metric.compute(target_probs=p.tolist(), draft_probs=q.tolist(), ks=[5], greedy=True)
    agreement_by_position = [float(torch.cat(kept).mean()) if kept and torch.cat(kept).numel() else float("nan")
                             for kept in by_position]
    return {"agreement": agreement_by_position[0], "agreement_by_position": agreement_by_position,
            "acceptance": sampled["acceptance_rate"], "greedy_acceptance": greedy["acceptance_rate"],
            "num_pairs": int(sum(map(len, by_position[0]))), "num_metric_positions": sampled["num_positions"]}
