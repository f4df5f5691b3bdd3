"""Train a `DraftHead` on the target's hidden states with transformers' `Trainer`.

1. `feature_dataset`: run the target once over each training sequence (plain text chunks from `text_dataset`, or
   prompts with the target's own continuations from `continuation_dataset`) and keep, per token, the hidden states
   the head reads and the target's last one (its next-token law is ``lm_head`` of it), as a ``datasets.Dataset``
   saved on disk and reloaded on the next run.
2. `train_head`: `HeadTrainer` minimises, at every pair (f_t, x_{t+1}), the cross-entropy of the head's law against
   the target's law at t + 1 (over the ids a pruned head keeps), plus for EAGLE-1 heads the smooth-L1 distance between
   h_t and the target's feature f_{t+1} (EAGLE-1's two losses; EAGLE-3 drops the feature loss). A held-out split is
   evaluated every ``eval_steps``; early stopping keeps the best head by held-out loss; the held-out top-1 agreement
   at block position 0 (the share of pairs where argmax q = argmax p) is logged beside it as the learning curve.
3. `evaluate_head`: agreement and the expected acceptance 1 - TV(p, q) on held-out pairs, through the project's
   ``evaluate`` metric.

Under ``accelerate launch --num_processes N`` (gloo on CPUs) the `Trainer` distributes the same call; the feature
set is built once, by the main process, and read by the others from disk.

Where it departs from EAGLE: no "training-time test" (EAGLE-3 unrolls the head on its own features while
training); position 1 and later are reached by feeding h back, untrained.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import EarlyStoppingCallback, PreTrainedModel, Trainer, TrainingArguments

from hf_spec.drafting.vocabulary import PrunedOutputLayer
from hf_spec.extras import require
from hf_spec.heads.model import DraftHead


@torch.no_grad()
def feature_dataset(target: PreTrainedModel, sequences: list[list[int]], feature_layers: list[int],
                    path: str | Path | None = None, progress: bool = True):
    """Per sequence: ``input_ids`` [S], ``features`` [S, F] (the ``feature_layers`` hidden states, concatenated) and,
    unless the layers include it, ``last`` [S, hidden] (the target's last hidden state, after its final norm), float32.

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
    with_last = last_layer_slot(layers, text.num_hidden_layers) is None

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


def last_layer_slot(feature_layers: list[int], num_layers: int) -> int | None:
    """Which of ``feature_layers`` is the target's last hidden state (its slot in the features), if any."""
    slots = [slot for slot, index in enumerate(feature_layers) if index % (num_layers + 1) == num_layers]
    return slots[0] if slots else None


def last_hidden(batch: dict[str, torch.Tensor], config) -> torch.Tensor:
    """``[B, S, hidden]`` the target's last hidden state: its own column, or its slot in the features."""
    if "last" in batch:
        return batch["last"]
    slot = last_layer_slot(list(config.feature_layers), config.target_num_layers)
    return batch["features"][..., slot * config.target_hidden_size: (slot + 1) * config.target_hidden_size]


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


def full_output_layer(head: DraftHead) -> torch.nn.Module:
    """The target's whole LM head inside ``head`` (a pruned head keeps it for this)."""
    output = head.get_output_embeddings()
    return output.full if isinstance(output, PrunedOutputLayer) else output


def head_loss(head: torch.nn.Module, batch: dict[str, torch.Tensor], teacher: torch.nn.Module,
              feature_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, agreements, pair mask)`` over the pairs t = 0 .. S - 2 of a batch (`collate`'s keys).

    The loss is the mean cross-entropy of the head's law q_t against the target's p_{t+1} (restricted to the ids q
    can give, renormalised) plus ``feature_weight`` times the smooth-L1 distance of h_t to the target's last hidden
    state at t + 1; ``agreements`` [B, S - 1] is 1 where argmax q_t = argmax p_{t+1}.
    """
    mask = batch["attention_mask"]
    pairs = (mask[:, :-1] * mask[:, 1:]).bool()  # [B, S - 1]
    last = last_hidden(batch, getattr(head, "module", head).config)[:, 1:]  # [B, S - 1, hidden]
    output = head(batch["input_ids"][:, 1:], features=batch["features"][:, :-1],
                  attention_mask=mask[:, 1:])  # logits [B, S - 1, V]
    log_q = F.log_softmax(output.logits.float(), dim=-1)
    with torch.no_grad():
        p = F.softmax(teacher(last.to(teacher.weight.dtype)).float(), dim=-1)  # [B, S - 1, V]
        reachable = torch.isfinite(log_q)
        p = p * reachable
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    cross_entropy = -(p * log_q.masked_fill(~reachable, 0.0)).sum(-1)  # [B, S - 1]
    loss = cross_entropy[pairs].mean()
    if feature_weight:
        distance = F.smooth_l1_loss(output.hidden_states.float(), last.float(), reduction="none")
        loss = loss + feature_weight * distance.mean(-1)[pairs].mean()
    agreements = (output.logits.argmax(-1) == p.argmax(-1)).float()
    return loss, agreements, pairs


class HeadTrainer(Trainer):
    """A `Trainer` with `head_loss`; held-out evaluation also logs ``eval_agreement`` (top-1, block position 0)."""

    def __init__(self, *args, feature_weight: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.feature_weight = feature_weight
        self._agreements: list[torch.Tensor] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        head = self.accelerator.unwrap_model(model)
        loss, agreements, pairs = head_loss(model, inputs, full_output_layer(head), self.feature_weight)
        if not model.training:
            self._agreements.append(agreements[pairs].detach().cpu())
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "eval_loss" in logs:  # every process evaluated its shard: add up (agreements, pairs) over processes
            agreements = torch.cat(self._agreements) if self._agreements else torch.zeros(0)
            totals = torch.tensor([agreements.sum(), len(agreements)], dtype=torch.float64, device=self.args.device)
            totals = self.accelerator.reduce(totals, reduction="sum")
            logs["eval_agreement"] = float(totals[0] / totals[1].clamp_min(1))
            self._agreements = []
        super().log(logs, *args, **kwargs)


def train_head(target: PreTrainedModel, train_dataset, eval_dataset, output_dir: str | Path, *,
               head: DraftHead | None = None, feature_layers: tuple[int, ...] = (-1,), num_layers: int = 1,
               feature_weight: float | None = None, patience: int = 3,
               **training_arguments) -> tuple[DraftHead, list[dict]]:
    """Train ``head`` (default: `DraftHead.from_target(target, feature_layers, num_layers)`, in float32) on
    `feature_dataset` rows; keep the best by held-out loss (early stopping after ``patience`` evaluations without
    improvement), save it to ``output_dir`` with ``save_pretrained``. Returns it and the Trainer's log history.

    ``feature_weight``: of the feature loss (default 1 for EAGLE-1 heads reading the last layer, 0 otherwise).
    ``training_arguments`` go to `TrainingArguments` (``max_steps``, ``learning_rate``, ``eval_steps``, ...).
    """
    for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if dataset is None or len(dataset) == 0:
            raise ValueError(f"`{name}` is empty: build it with `feature_dataset` from a non-empty corpus.")
    head = head if head is not None else DraftHead.from_target(target, feature_layers, num_layers).float()
    if feature_weight is None:
        feature_weight = 1.0 if head.config.feature_layers in ([-1], [head.config.target_num_layers]) else 0.0
    defaults = {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 4, "learning_rate": 3e-4,
                "max_steps": 200, "logging_steps": 10, "eval_strategy": "steps", "eval_steps": 20,
                "save_strategy": "steps", "save_total_limit": 1, "save_only_model": True,
                "load_best_model_at_end": True, "metric_for_best_model": "eval_loss", "greater_is_better": False,
                "report_to": "none",
                "remove_unused_columns": False, "label_names": [], "use_cpu": not torch.cuda.is_available(),
                "dataloader_pin_memory": torch.cuda.is_available()}
    arguments = {**defaults, **training_arguments}
    arguments["save_steps"] = arguments.get("save_steps", arguments["eval_steps"])
    args = TrainingArguments(output_dir=str(output_dir), **arguments)
    head.train()
    trainer = HeadTrainer(model=head, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                          data_collator=collate, feature_weight=feature_weight,
                          callbacks=[EarlyStoppingCallback(early_stopping_patience=patience)])
    trainer.train()
    head = trainer.accelerator.unwrap_model(trainer.model).eval()
    if trainer.is_world_process_zero():
        head.save_pretrained(str(output_dir))
    return head, trainer.state.log_history


@torch.no_grad()
def evaluate_head(head: DraftHead, dataset, max_metric_positions: int = 256) -> dict[str, float]:
    """Held-out block-position-0 figures of ``head``: top-1 ``agreement`` with the target over every pair, and the
    project's ``evaluate`` metric (expected sampling acceptance 1 - TV at temperature 1, and greedy acceptance) over
    the first ``max_metric_positions`` pairs."""
    evaluate = require("evaluate", "train", "Evaluating a draft head")

    from hf_spec.evaluation.draft_fit import METRIC_PATH

    head.eval()
    teacher = full_output_layer(head)
    agreements, p_rows, q_rows = [], [], []
    for start in range(0, len(dataset), 4):
        batch = collate([dataset[i] for i in range(start, min(start + 4, len(dataset)))])
        batch = {name: value.to(head.device) for name, value in batch.items()}
        _, agreement, pairs = head_loss(head, batch, teacher, 0.0)
        agreements.append(agreement[pairs])
        if sum(len(rows) for rows in p_rows) < max_metric_positions:
            output = head(batch["input_ids"][:, 1:], features=batch["features"][:, :-1],
                          attention_mask=batch["attention_mask"][:, 1:])
            last = last_hidden(batch, head.config)[:, 1:]
            p_rows.append(F.softmax(teacher(last.to(teacher.weight.dtype)).double(), -1)[pairs])
            q_rows.append(F.softmax(output.logits.double(), -1)[pairs])
    p, q = torch.cat(p_rows)[:max_metric_positions], torch.cat(q_rows)[:max_metric_positions]
    metric = evaluate.load(METRIC_PATH)
    sampled = metric.compute(target_probs=p.tolist(), draft_probs=q.tolist(), ks=[5])
    greedy = metric.compute(target_probs=p.tolist(), draft_probs=q.tolist(), ks=[5], greedy=True)
    agreement = float(torch.cat(agreements).mean())
    return {"agreement": agreement, "acceptance": sampled["acceptance_rate"],
            "greedy_acceptance": greedy["acceptance_rate"], "num_pairs": int(sum(map(len, agreements))),
            "num_metric_positions": sampled["num_positions"]}
