"""Train a draft head and measure it, in one call: what ``hf-spec train-head`` runs and the ``draft_heads`` notebook
calls.

`train_and_evaluate_head`: split the sequences into training and held-out ones, build both feature sets
(`hf_spec.evaluation.head_training.feature_dataset`, cached under the output folder), make the head
(``architecture="eagle"``: `DraftHead.from_target`, optionally pruned; ``"eagle3"``: `Eagle3Head.from_target`, its
draft vocabulary ``kept_ids``), measure its held-out agreement before training, train it with ``Trainer`` (early
stopping on the held-out loss; ``ttt_steps`` block positions of EAGLE-3's training-time test), measure it again, and
save the head (an EAGLE-3 head in the speculators format, which vLLM and SGLang serve), its learning curve (JSON and
PNG) and nothing else in the output folder (the Trainer's checkpoints are removed). Under ``accelerate launch`` the
main process builds the features first and the others read them from disk.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from transformers import PreTrainedModel

from hf_spec.evaluation.head_training import RECIPES, evaluate_head, feature_dataset, train_head
from hf_spec.extras import require, require_extra
from hf_spec.heads.base import DraftHeadBase
from hf_spec.heads.eagle3 import Eagle3Head
from hf_spec.heads.model import DraftHead

#: What ``architecture`` may be.
ARCHITECTURES = ("eagle", "eagle3")


@dataclasses.dataclass
class HeadRun:
    """What `train_and_evaluate_head` made and measured."""

    head: DraftHeadBase
    before: dict  # held-out figures of the untrained head (`evaluate_head`)
    after: dict  # the same after training
    curve: list[dict]  # per evaluation: step, eval_loss, eval_agreement (block position 0)
    history: list[dict]  # the Trainer's log history
    num_train: int
    num_held_out: int
    recipe: dict  # architecture, ttt_steps and the training arguments given (learning rate, warm-up, decay, ...)

    def to_dict(self) -> dict:
        return {"before": self.before, "after": self.after, "learning_curve": self.curve,
                "train_sequences": self.num_train, "held_out_sequences": self.num_held_out, "recipe": self.recipe,
                "log_history": self.history}


def train_and_evaluate_head(target: PreTrainedModel, sequences: list[list[int]], output_dir: str | Path, *,
                            architecture: str = "eagle", feature_layers: list[int] | tuple[int, ...] | None = None,
                            num_layers: int = 1, kept_ids: list[int] | None = None, ttt_steps: int | None = None,
                            eval_fraction: float = 0.1, progress: bool = True, **training_arguments) -> HeadRun:
    """Train a head for ``target`` on ``sequences`` (token ids: text chunks or prompts with the target's own
    continuations) and save it in ``output_dir``; ``training_arguments`` go to `train_head` (``max_steps``,
    ``learning_rate``, ``eval_steps``, ``patience``, ``ttt_decay``, ...).

    Args:
        architecture: ``"eagle"`` (`DraftHead`) or ``"eagle3"`` (`Eagle3Head`).
        feature_layers: the target hidden states read; default [-1] (EAGLE-1) or [2, L // 2, L - 3] (EAGLE-3).
        kept_ids: the output ids the head may propose (FR-Spec pruning; an EAGLE-3 head's draft vocabulary).
        ttt_steps: block positions trained (EAGLE-3's training-time test); default 1 for ``"eagle"``, 3 for
            ``"eagle3"``.

    Raises:
        ValueError: ``eval_fraction`` outside (0, 1), too few sequences to hold some out, bad ``feature_layers`` or
            ``architecture``.
    """
    require_extra("train", "Training a draft head")
    from accelerate import PartialState

    if not 0 < eval_fraction < 1:
        raise ValueError(f"`eval_fraction` must be in (0, 1), but is {eval_fraction!r}.")
    held = max(1, round(len(sequences) * eval_fraction))
    if len(sequences) - held < 1:
        raise ValueError(f"{len(sequences)} sequences cannot be split into a training and a held-out set; use more "
                         "texts.")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"`architecture` must be one of {ARCHITECTURES}, but is {architecture!r}.")
    if architecture == "eagle3":  # checks the layers first
        head = Eagle3Head.from_target(target, feature_layers, kept_ids, num_layers).float()
    else:
        head = DraftHead.from_target(target, tuple(feature_layers or (-1,)), num_layers).float()
        if kept_ids is not None:
            head.prune(kept_ids)
    feature_layers = list(head.config.feature_layers)
    ttt_steps = ttt_steps or (3 if architecture == "eagle3" else 1)
    output_dir = Path(output_dir)
    with PartialState().main_process_first():  # the others then read the features from disk
        train = feature_dataset(target, sequences[held:], list(feature_layers), output_dir / "features-train",
                                progress=progress)
        held_out = feature_dataset(target, sequences[:held], list(feature_layers), output_dir / "features-held-out",
                                   progress=progress)
    before = evaluate_head(head, held_out)
    head, history = train_head(target, train, held_out, output_dir, head=head, ttt_steps=ttt_steps,
                               **training_arguments)
    after = evaluate_head(head, held_out)
    curve = [{key: value for key, value in entry.items() if key == "step" or key.startswith(("eval_loss",
                                                                                          "eval_agreement"))}
             for entry in history if "eval_agreement" in entry]
    if PartialState().is_main_process:
        for checkpoint in output_dir.glob("checkpoint-*"):  # the Trainer's optimizer, RNG and pickled arguments
            shutil.rmtree(checkpoint)
        (output_dir / "learning_curve.json").write_text(json.dumps(curve, indent=2))
        plot_curve(curve, before["agreement_by_position"], output_dir / "learning_curve.png")
    recipe = {"architecture": architecture, "ttt_steps": ttt_steps, "feature_layers": feature_layers,
              **RECIPES[architecture], **training_arguments}
    return HeadRun(head, before, after, curve, history, len(train), len(held_out), recipe)


def plot_curve(curve: list[dict], start: float | list[float], path: Path) -> None:
    """Held-out agreement against training steps (step 0: the untrained head, ``start``), one line per block position
    the curve has (``eval_agreement``, ``eval_agreement_1``, ...)."""
    require("matplotlib", "train", "The head's learning-curve plot")
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) stays as it is

    starts = [start] if isinstance(start, float | int) else list(start)
    figure = Figure(figsize=(6, 3.5))
    axes = figure.subplots()
    steps = [0] + [point["step"] for point in curve]
    for position in range(len(starts)):
        key = "eval_agreement" + (f"_{position}" if position else "")
        if curve and key not in curve[0]:
            break
        axes.plot(steps, [starts[position]] + [point[key] for point in curve], marker="o",
                  label=f"block position {position}")
    axes.set(xlabel="training step", ylabel="held-out top-1 agreement", title="draft head", ylim=(0, 1))
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
