"""Train a draft head and measure it, in one call: what ``hf-spec train-head`` runs and the ``draft_heads`` notebook
calls.

`train_and_evaluate_head`: split the sequences into training and held-out ones, build both feature sets
(`hf_spec.evaluation.head_training.feature_dataset`, cached under the output folder), make the head
(`DraftHead.from_target`, optionally pruned), measure its held-out agreement before training, train it with
``Trainer`` (early stopping on the held-out loss), measure it again, and save the head, its learning curve (JSON and
PNG) and nothing else in the output folder (the Trainer's checkpoints are removed). Under ``accelerate launch`` the
main process builds the features first and the others read them from disk.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from transformers import PreTrainedModel

from hf_spec.evaluation.head_training import evaluate_head, feature_dataset, train_head
from hf_spec.extras import require, require_extra
from hf_spec.heads.model import DraftHead


@dataclasses.dataclass
class HeadRun:
    """What `train_and_evaluate_head` made and measured."""

    head: DraftHead
    before: dict  # held-out figures of the untrained head (`evaluate_head`)
    after: dict  # the same after training
    curve: list[dict]  # per evaluation: step, eval_loss, eval_agreement (block position 0)
    history: list[dict]  # the Trainer's log history
    num_train: int
    num_held_out: int

    def to_dict(self) -> dict:
        return {"before": self.before, "after": self.after, "learning_curve": self.curve,
                "train_sequences": self.num_train, "held_out_sequences": self.num_held_out,
                "log_history": self.history}


def train_and_evaluate_head(target: PreTrainedModel, sequences: list[list[int]], output_dir: str | Path, *,
                            feature_layers: list[int] | tuple[int, ...] = (-1,), num_layers: int = 1,
                            kept_ids: list[int] | None = None, eval_fraction: float = 0.1, progress: bool = True,
                            **training_arguments) -> HeadRun:
    """Train a head for ``target`` on ``sequences`` (token ids: text chunks or prompts with the target's own
    continuations) and save it in ``output_dir``; ``training_arguments`` go to `train_head` (``max_steps``,
    ``learning_rate``, ``eval_steps``, ``patience``, ...).

    Raises:
        ValueError: ``eval_fraction`` outside (0, 1), too few sequences to hold some out, bad ``feature_layers``.
    """
    require_extra("train", "Training a draft head")
    from accelerate import PartialState

    if not 0 < eval_fraction < 1:
        raise ValueError(f"`eval_fraction` must be in (0, 1), but is {eval_fraction!r}.")
    held = max(1, round(len(sequences) * eval_fraction))
    if len(sequences) - held < 1:
        raise ValueError(f"{len(sequences)} sequences cannot be split into a training and a held-out set; use more "
                         "texts.")
    head = DraftHead.from_target(target, tuple(feature_layers), num_layers).float()  # checks the layers first
    if kept_ids is not None:
        head.prune(kept_ids)
    output_dir = Path(output_dir)
    with PartialState().main_process_first():  # the others then read the features from disk
        train = feature_dataset(target, sequences[held:], list(feature_layers), output_dir / "features-train",
                                progress=progress)
        held_out = feature_dataset(target, sequences[:held], list(feature_layers), output_dir / "features-held-out",
                                   progress=progress)
    before = evaluate_head(head, held_out)
    head, history = train_head(target, train, held_out, output_dir, head=head, **training_arguments)
    after = evaluate_head(head, held_out)
    curve = [{"step": entry["step"], "eval_loss": entry["eval_loss"], "eval_agreement": entry["eval_agreement"]}
             for entry in history if "eval_agreement" in entry]
    if PartialState().is_main_process:
        for checkpoint in output_dir.glob("checkpoint-*"):  # the Trainer's optimizer, RNG and pickled arguments
            shutil.rmtree(checkpoint)
        (output_dir / "learning_curve.json").write_text(json.dumps(curve, indent=2))
        plot_curve(curve, before["agreement"], output_dir / "learning_curve.png")
    return HeadRun(head, before, after, curve, history, len(train), len(held_out))


def plot_curve(curve: list[dict], start: float, path: Path) -> None:
    """Held-out agreement at block position 0 against training steps (step 0: the untrained head)."""
    require("matplotlib", "train", "The head's learning-curve plot")
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) stays as it is

    figure = Figure(figsize=(6, 3.5))
    axes = figure.subplots()
    axes.plot([0] + [point["step"] for point in curve], [start] + [point["eval_agreement"] for point in curve],
              marker="o")
    axes.set(xlabel="training step", ylabel="held-out top-1 agreement", title="draft head, block position 0",
             ylim=(0, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
