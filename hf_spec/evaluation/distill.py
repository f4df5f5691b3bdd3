"""Fine-tune a draft toward its target with transformers' `Trainer`: forward KL or total variation, per position.

The acceptance rate at a prefix is 1 - TV(p, q) (`hf_spec.evaluation.draft_fit`), so training the draft's q toward the
target's p on the prefixes decoding will meet raises it directly. Each training sequence is a prompt and a
continuation (the target's own, generated once and cached as a `datasets.Dataset`, `continuation_dataset`) or plain
text (`text_dataset`); the loss is taken at every position whose next token belongs to the continuation (every
position for plain text), between p = softmax(target_logits / T) and q = softmax(draft_logits / T) at the decoding
temperature T:

- ``"kl"``: forward KL(p || q) = sum p (log p - log q), smooth, the usual distillation loss;
- ``"tv"``: TV(p, q) = 1/2 sum |p - q|, which is exactly 1 - acceptance.

The rest of the processor chain (top-k, top-p, penalties) is not applied in training. Options: train only the last
N decoder layers, or LoRA adapters through `peft` (merged back, so the result is a plain model). The trained draft
saves with ``save_pretrained`` and works as ``assistant_model`` at once. Under ``accelerate launch`` the same code
trains on several GPUs or nodes (`Trainer` handles the distribution; the teacher is moved to each process's device).

What it does not do: write its own training loop, or change the tokenizer (draft and target must share one).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, Trainer, TrainingArguments

from hf_spec.checks import check_int
from hf_spec.evaluation.continuations import target_continuations

LOSSES = ("kl", "tv")


def distillation_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor, loss_mask: torch.Tensor,
                      temperature: float = 1.0, loss: str = "kl") -> torch.Tensor:
    """Mean over masked positions of KL(p || q) or TV(p, q) at ``temperature``.

    Args:
        target_logits, draft_logits: ``[B, L, V]`` (the common first V columns of both models are used).
        loss_mask: ``[B, L]`` 1 where the position's next-token law is trained.
    """
    width = min(target_logits.shape[-1], draft_logits.shape[-1])
    log_p = F.log_softmax(target_logits[..., :width].float() / temperature, dim=-1)
    log_q = F.log_softmax(draft_logits[..., :width].float() / temperature, dim=-1)
    if loss == "kl":
        per_position = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # [B, L]
    elif loss == "tv":
        per_position = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(dim=-1)
    else:
        raise ValueError(f"`loss` must be one of {LOSSES}, but is {loss!r}.")
    mask = loss_mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1.0)


class DistillationTrainer(Trainer):
    """A `Trainer` whose loss is `distillation_loss` against a frozen ``teacher`` (the target)."""

    def __init__(self, *args, teacher: PreTrainedModel, temperature: float = 1.0, loss: str = "kl", **kwargs):
        super().__init__(*args, **kwargs)
        if loss not in LOSSES:
            raise ValueError(f"`loss` must be one of {LOSSES}, but is {loss!r}.")
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0, but is {temperature!r}.")
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature, self.distillation = temperature, loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss_mask = inputs.pop("loss_mask")
        if self.teacher.device != model.device:
            self.teacher.to(model.device)
        with torch.no_grad():
            target_logits = self.teacher(**inputs).logits
        outputs = model(**inputs)
        loss = distillation_loss(target_logits, outputs.logits, loss_mask, self.temperature, self.distillation)
        return (loss, outputs) if return_outputs else loss


def pad_batch(features: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids``, ``attention_mask`` and ``loss_mask`` of a list of examples into tensors."""
    width = max(len(f["input_ids"]) for f in features)
    batch = {}
    for name, fill in (("input_ids", pad_token_id), ("attention_mask", 0), ("loss_mask", 0)):
        batch[name] = torch.tensor([list(f[name]) + [fill] * (width - len(f[name])) for f in features])
    return batch


def text_dataset(tokenizer, texts: Sequence[str], max_length: int = 256):
    """Plain text as training sequences (chunks of ``max_length`` tokens); every position is trained."""
    import datasets

    check_int("max_length", max_length, minimum=2)

    rows = {"input_ids": [], "attention_mask": [], "loss_mask": []}
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, max(1, len(ids) - 1), max_length):
            chunk = ids[start : start + max_length]
            if len(chunk) < 2:
                continue
            rows["input_ids"].append(chunk)
            rows["attention_mask"].append([1] * len(chunk))
            rows["loss_mask"].append([1] * (len(chunk) - 1) + [0])  # the last position has no next token here
    if not rows["input_ids"]:
        raise ValueError("No training sequence: every text is shorter than 2 tokens (or `texts` is empty).")
    return datasets.Dataset.from_dict(rows)


def continuation_dataset(target: PreTrainedModel, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                         settings: dict | None = None, cache_dir: str | Path | None = None, seed: int = 0,
                         progress: bool = True):
    """Each prompt followed by the target's own continuation, generated once (cached under ``cache_dir``, keyed by
    the target, the prompts and the settings); the positions predicting the continuation are trained."""
    import datasets

    if not prompts:
        raise ValueError("`prompts` is empty: nothing to continue.")
    key = hashlib.sha256(json.dumps({
        "target": target.config.to_json_string(), "prompts": [p.tolist() for p in prompts],
        "max_new_tokens": max_new_tokens, "settings": settings or {}, "seed": seed,
    }, sort_keys=True).encode()).hexdigest()[:16]
    path = None if cache_dir is None else Path(cache_dir) / f"continuations-{key}"
    if path is not None and path.exists():
        return datasets.load_from_disk(str(path))
    continuations = target_continuations(target, prompts, max_new_tokens, settings, seed, progress)
    rows = {"input_ids": [], "attention_mask": [], "loss_mask": []}
    for prompt, continuation in zip(prompts, continuations):
        ids = prompt[0].tolist() + continuation[0].tolist()
        rows["input_ids"].append(ids)
        rows["attention_mask"].append([1] * len(ids))
        # position i predicts token i + 1: train the positions from the prompt's last token to the one before the end
        rows["loss_mask"].append([0] * (prompt.shape[1] - 1) + [1] * continuation.shape[1] + [0])
    dataset = datasets.Dataset.from_dict(rows)
    if path is not None:
        dataset.save_to_disk(str(path))
    return dataset


def select_trainable(draft: PreTrainedModel, train_last_layers: int | None) -> int:
    """Freeze all but the last ``train_last_layers`` decoder layers and the final norm (``None``: train all).
    Returns the number of trainable parameters."""
    if train_last_layers is not None:
        layers = draft.model.layers if hasattr(draft, "model") and hasattr(draft.model, "layers") else None
        if layers is None:
            raise ValueError(f"`train_last_layers` needs a model with `.model.layers`; {type(draft).__name__} has "
                             "none.")
        if not 1 <= train_last_layers <= len(layers):
            raise ValueError(f"`train_last_layers` must be in 1..{len(layers)}, but is {train_last_layers!r}.")
        draft.requires_grad_(False)
        for layer in layers[len(layers) - train_last_layers :]:
            layer.requires_grad_(True)
        if hasattr(draft.model, "norm"):
            draft.model.norm.requires_grad_(True)
    return sum(p.numel() for p in draft.parameters() if p.requires_grad)


def with_lora(draft: PreTrainedModel, rank: int):
    """``draft`` with LoRA adapters on every linear layer (`peft` must be installed)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("`lora_rank` needs `peft`: pip install peft") from None
    check_int("lora_rank", rank)
    return get_peft_model(draft, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))


def distill(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    train_dataset,
    output_dir: str | Path,
    *,
    loss: str = "kl",
    temperature: float = 1.0,
    train_last_layers: int | None = None,
    lora_rank: int | None = None,
    pad_token_id: int = 0,
    **training_arguments,
) -> tuple[PreTrainedModel, list[dict]]:
    """Train ``draft`` toward ``target`` on ``train_dataset`` (``input_ids``, ``attention_mask``, ``loss_mask``);
    save it with ``save_pretrained`` to ``output_dir``. Returns the trained draft and the Trainer's log history.

    ``training_arguments`` go to `TrainingArguments` (``max_steps``, ``learning_rate``,
    ``per_device_train_batch_size``, ...).
    """
    required = {"input_ids", "attention_mask", "loss_mask"}
    missing = required - set(train_dataset.column_names)
    if missing:
        raise ValueError(f"`train_dataset` lacks columns {sorted(missing)}; it has {train_dataset.column_names}. "
                         "Build it with `text_dataset` or `continuation_dataset`.")
    if len(train_dataset) == 0:
        raise ValueError("`train_dataset` is empty.")
    if train_last_layers is not None and lora_rank is not None:
        raise ValueError("Pass `train_last_layers` or `lora_rank`, not both.")
    select_trainable(draft, train_last_layers)
    model = with_lora(draft, lora_rank) if lora_rank is not None else draft
    defaults = {"per_device_train_batch_size": 1, "learning_rate": 1e-5, "max_steps": 100, "logging_steps": 10,
                "report_to": "none", "save_strategy": "no", "remove_unused_columns": False,
                "disable_tqdm": False, "dataloader_pin_memory": torch.cuda.is_available(),
                "use_cpu": not torch.cuda.is_available()}  # so `accelerate launch` on a CPU runs one job on gloo
    args = TrainingArguments(output_dir=str(output_dir), **{**defaults, **training_arguments})
    trainer = DistillationTrainer(
        model=model, args=args, train_dataset=train_dataset, teacher=target, temperature=temperature, loss=loss,
        data_collator=lambda features: pad_batch(features, pad_token_id),
    )
    trainer.train()
    trained = model.merge_and_unload() if lora_rank is not None else model
    trained.eval()
    if trainer.is_world_process_zero():  # under `accelerate launch`, one process writes the draft
        trained.save_pretrained(str(output_dir))
    return trained, trainer.state.log_history
