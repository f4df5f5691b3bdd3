"""``hf-spec train-head``: train an EAGLE-style draft head on the target's hidden states (transformers' `Trainer`).

Runs as it is on one process, or under ``accelerate launch --num_processes N -m hf_spec train-head ...`` (gloo on
CPUs): the feature sets are built once by the main process and read from disk by the others.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_spec.cli.common import positive_int, prompts, sampling, text_arguments, texts, write_report


def add_parser(commands, shared: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "train-head", parents=[shared, text_arguments()],
        help="train a draft head that reads the target's hidden states (EAGLE-1 with the default --feature-layers "
             "-1, EAGLE-3's fusion with e.g. --feature-layers 2 14 25) on the target's continuations of the "
             "dataset's texts, or the texts themselves with --plain-text; saves with save_pretrained",
    )
    parser.add_argument("--output-dir", required=True, help="where the head, its features and its curve go")
    parser.add_argument("--feature-layers", type=int, nargs="+", default=[-1],
                        help="hidden states the head reads (transformers' output_hidden_states indices; default -1: "
                             "the last, after the final norm)")
    parser.add_argument("--num-layers", type=positive_int, default=1, help="decoder layers in the head")
    parser.add_argument("--plain-text", action="store_true", help="train on the texts, not on continuations")
    parser.add_argument("--max-length", type=positive_int, default=256, help="tokens per plain-text sequence")
    parser.add_argument("--eval-fraction", type=float, default=0.1, help="held-out share of the sequences")
    parser.add_argument("--max-steps", type=positive_int, default=200)
    parser.add_argument("--eval-steps", type=positive_int, default=20)
    parser.add_argument("--patience", type=positive_int, default=3, help="evaluations without improvement")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from accelerate import PartialState

    from hf_spec.evaluation.head_training import evaluate_head, feature_dataset, train_head
    from hf_spec.heads import DraftHead

    if not 0 < args.eval_fraction < 1:
        raise SystemExit(f"--eval-fraction must be in (0, 1), but is {args.eval_fraction}.")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args)
    output_dir = Path(args.output_dir)
    with PartialState().main_process_first():  # the others then read the features from disk
        sequences = training_sequences(args, target, tokenizer, output_dir)
        held = max(1, round(len(sequences) * args.eval_fraction))
        if len(sequences) - held < 1:
            raise SystemExit(f"--num-texts {args.num_texts}: {len(sequences)} sequences cannot be split into a "
                             "training and a held-out set; use more texts.")
        train = feature_dataset(target, sequences[held:], args.feature_layers, output_dir / "features-train",
                                progress=not args.no_progress)
        held_out = feature_dataset(target, sequences[:held], args.feature_layers, output_dir / "features-held-out",
                                   progress=not args.no_progress)
    try:
        head = DraftHead.from_target(target, args.feature_layers, args.num_layers).float()
    except ValueError as error:
        raise SystemExit(f"--feature-layers / --num-layers: {error}") from None
    if args.draft_vocab is not None:
        from hf_spec.loading.vocabulary import draft_vocabulary

        head.prune(draft_vocabulary(target, tokenizer, args.draft_vocab, args.draft_vocab_corpus))
    before = evaluate_head(head, held_out)
    head, history = train_head(
        target, train, held_out, output_dir, head=head, patience=args.patience, max_steps=args.max_steps,
        eval_steps=args.eval_steps, learning_rate=args.learning_rate, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, seed=args.seed, disable_tqdm=args.no_progress,
    )
    if not PartialState().is_main_process:
        return 0
    after = evaluate_head(head, held_out)
    curve = [{"step": entry["step"], "eval_loss": entry["eval_loss"], "eval_agreement": entry["eval_agreement"]}
             for entry in history if "eval_agreement" in entry]
    (output_dir / "learning_curve.json").write_text(json.dumps(curve, indent=2))
    plot_curve(curve, before["agreement"], output_dir / "learning_curve.png")
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    write_report({"output_dir": str(output_dir), "num_processes": PartialState().num_processes,
                  "train_sequences": len(train), "held_out_sequences": len(held_out),
                  "before": before, "after": after, "learning_curve": curve, "log_history": history}, args.output)
    return 0


def load_target(args: argparse.Namespace):
    """The target alone (a head needs no draft model), in ``--dtype``; ``(model, tokenizer or None)``."""
    from hf_spec.loading.cpu import default_dtype
    from hf_spec.loading.pair import TINY
    from hf_spec.loading.pretrained import load
    from hf_spec.loading.tiny import build_tiny_pair

    if args.target == TINY:
        return build_tiny_pair(seed=args.seed)[0], None
    dtype = default_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    return load(args.target, dtype=dtype)


def training_sequences(args: argparse.Namespace, target, tokenizer, output_dir: Path) -> list[list[int]]:
    """Token ids of the training sequences: text chunks (``--plain-text``) or prompts with the target's own
    continuations (generated once, cached under ``output_dir``)."""
    from hf_spec.evaluation.distill import continuation_dataset, text_dataset

    if args.plain_text:
        if tokenizer is None:
            raise SystemExit("--plain-text needs a target with a tokenizer (not the tiny pair).")
        return text_dataset(tokenizer, texts(args), args.max_length)["input_ids"]
    dataset = continuation_dataset(target, prompts(args, tokenizer), args.max_new_tokens, sampling(args),
                                   cache_dir=output_dir / "continuations", seed=args.seed)
    return dataset["input_ids"]


def plot_curve(curve: list[dict], start: float, path: Path) -> None:
    """Held-out agreement at block position 0 against training steps (step 0: the untrained head)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot([0] + [point["step"] for point in curve], [start] + [point["eval_agreement"] for point in curve],
              marker="o")
    axes.set(xlabel="training step", ylabel="held-out top-1 agreement", title="draft head, block position 0",
             ylim=(0, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
