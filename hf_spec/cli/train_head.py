"""``hf-spec train-head``: train a draft head on the target's hidden states (transformers' `Trainer`): hf_spec's
EAGLE-style `DraftHead` (``--architecture eagle``), or an EAGLE-3 head saved in the speculators format that ``vllm
serve`` and SGLang load (``--architecture eagle3``, with EAGLE-3's training-time test).

Runs as it is on one process, or under ``accelerate launch --num_processes N -m hf_spec train-head ...`` (gloo on
CPUs): the feature sets are built once by the main process and read from disk by the others.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hf_spec.cli.common import (
    check_writable,
    decoding_arguments,
    emit,
    output_arguments,
    positive_float,
    positive_int,
    prepare_folder,
    prompts,
    sampling,
    target_arguments,
    text_arguments,
    texts,
    training_processes,
)
from hf_spec.extras import require_extra
from hf_spec.loading.vocabulary import COUNTED_ON


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "train-head", parents=[target_arguments(), decoding_arguments(64), text_arguments(), output_arguments()],
        help="train a draft head that reads the target's hidden states (hf_spec's EAGLE-style head, or with "
             "--architecture eagle3 an EAGLE-3 head in the speculators format, which vllm serve and SGLang load) on "
             "the target's continuations of the dataset's texts, or the texts themselves with --plain-text",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--output-dir", required=True, help="where the head, its features and its curve go")
    parser.add_argument("--architecture", choices=("eagle", "eagle3"), default="eagle",
                        help="eagle: hf_spec's DraftHead (EAGLE-1 on the last layer, or fused layers); eagle3: "
                             "EAGLE-3 (speculators format, servable by vLLM and SGLang)")
    parser.add_argument("--feature-layers", type=int, nargs="+", default=None,
                        help="hidden states the head reads (transformers' output_hidden_states indices; -1: the "
                             "last, after the final norm) (default: -1 for eagle, 2 L/2 L-3 for eagle3)")
    parser.add_argument("--ttt-steps", type=positive_int, default=None,
                        help="block positions trained, the head reading its own predictions after the first "
                             "(EAGLE-3's training-time test) (default: 1 for eagle, 3 for eagle3)")
    parser.add_argument("--ttt-decay", type=positive_float, default=None,
                        help="weight ratio between consecutive block positions in the loss (default: 0.8 for eagle3, "
                             "as EAGLE-3; 1 for eagle)")
    parser.add_argument("--num-layers", type=positive_int, default=1, help="decoder layers in the head")
    parser.add_argument("--draft-vocab", type=positive_int, default=None, metavar="N",
                        help="keep only the N most frequent output ids in the head's LM head (FR-Spec; eagle3: "
                             "the draft vocabulary, d2t/t2d)")
    parser.add_argument("--draft-vocab-corpus", default="stdlib", help="texts ranking the ids for --draft-vocab")
    parser.add_argument("--draft-vocab-counts", choices=COUNTED_ON, default="continuations",
                        help="rank the ids by how often the target emits them continuing the corpus's texts (then by "
                             "the corpus's counts), or by the corpus's counts alone")
    parser.add_argument("--plain-text", action="store_true", help="train on the texts, not on continuations")
    parser.add_argument("--max-length", type=positive_int, default=256, help="tokens per plain-text sequence")
    parser.add_argument("--eval-fraction", type=float, default=0.1, help="held-out share of the sequences")
    parser.add_argument("--max-steps", type=positive_int, default=200, help="optimizer steps")
    parser.add_argument("--eval-steps", type=positive_int, default=20, help="steps between held-out evaluations")
    parser.add_argument("--patience", type=positive_int, default=3, help="evaluations without improvement")
    parser.add_argument("--learning-rate", type=positive_float, default=None,
                        help="peak learning rate (default: 1e-4 for eagle3, 3e-4 for eagle)")
    parser.add_argument("--warmup-steps", type=float, default=None,
                        help="steps of linear learning-rate warm-up before the linear decay, or below 1 a share of "
                             "--max-steps (default: 0.1 for eagle3, 0 for eagle)")
    parser.add_argument("--max-grad-norm", type=positive_float, default=None,
                        help="gradient clipping norm (default: 0.5 for eagle3, 1 for eagle)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step and device")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    require_extra("train", "hf-spec train-head")
    processes = training_processes()
    from hf_spec.evaluation.head_pipeline import train_and_evaluate_head
    from hf_spec.heads.base import check_feature_layers
    from hf_spec.loading.pair import load_model
    from hf_spec.loading.vocabulary import draft_vocabulary

    if not 0 < args.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in (0, 1), but is {args.eval_fraction}.")
    if args.ttt_decay is not None and not args.ttt_decay <= 1:
        raise ValueError(f"--ttt-decay must be in (0, 1], but is {args.ttt_decay}.")
    if args.warmup_steps is not None and not 0 <= args.warmup_steps < args.max_steps:
        raise ValueError(f"--warmup-steps must be in [0, --max-steps), but is {args.warmup_steps}.")
    check_writable(args.output, "--output")
    prepare_folder(args.output_dir, "--output-dir")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    quantize = None if args.quantize in ("auto", "none") else args.quantize  # heads train on the float target
    target, tokenizer = load_model(args.target, dtype=args.dtype, quantize=quantize, seed=args.seed)
    if args.feature_layers is not None:
        try:  # before any feature is built
            check_feature_layers(args.feature_layers, target.config.get_text_config().num_hidden_layers)
        except ValueError as error:
            raise ValueError(f"--feature-layers {' '.join(map(str, args.feature_layers))}: {error}") from None
    elif args.architecture == "eagle3":
        from hf_spec.heads.speculators import default_aux_layers

        try:
            default_aux_layers(target.config.get_text_config().num_hidden_layers)
        except ValueError as error:
            raise ValueError(f"--architecture eagle3: {error} (--feature-layers)") from None
    kept_ids = None
    with processes.main_process_first():  # under `accelerate launch`: one process writes the caches, the rest read
        if args.draft_vocab is not None:
            kept_ids = draft_vocabulary(target, tokenizer, args.draft_vocab, args.draft_vocab_corpus, target=target,
                                        counted_on=args.draft_vocab_counts)
        sequences = training_sequences(args, target, tokenizer, Path(args.output_dir))
    run_ = train_and_evaluate_head(
        target, sequences, args.output_dir,
        architecture=args.architecture, feature_layers=args.feature_layers, num_layers=args.num_layers,
        kept_ids=kept_ids, ttt_steps=args.ttt_steps, eval_fraction=args.eval_fraction, progress=not args.no_progress,
        patience=args.patience, max_steps=args.max_steps, eval_steps=args.eval_steps, **recipe_flags(args),
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size, seed=args.seed,
        disable_tqdm=args.no_progress,
    )
    if not processes.is_main_process:
        return 0
    tokenizer.save_pretrained(args.output_dir)
    report = {"output_dir": str(args.output_dir), "num_processes": processes.num_processes, **run_.to_dict()}
    emit(args, report, f"held-out agreement at block position 0: {run_.before['agreement']:.3f} untrained -> "
                       f"{run_.after['agreement']:.3f}; head saved in {args.output_dir}")
    return 0


def recipe_flags(args: argparse.Namespace) -> dict:
    """The optimiser flags given; the others come from the head kind's recipe
    (`hf_spec.evaluation.head_training.RECIPES`)."""
    flags = {"ttt_decay": args.ttt_decay, "warmup_steps": args.warmup_steps, "max_grad_norm": args.max_grad_norm,
             "learning_rate": args.learning_rate}
    return {name: value for name, value in flags.items() if value is not None}


def training_sequences(args: argparse.Namespace, target, tokenizer, output_dir: Path) -> list[list[int]]:
    """Token ids of the training sequences: text chunks (``--plain-text``) or prompts with the target's own
    continuations (generated once, cached under ``output_dir``)."""
    from hf_spec.evaluation.distill import continuation_dataset, text_dataset

    if args.plain_text:
        return text_dataset(tokenizer, texts(args), args.max_length)["input_ids"]
    dataset = continuation_dataset(target, prompts(args, tokenizer), args.max_new_tokens, sampling(args),
                                   cache_dir=output_dir / "continuations", seed=args.seed)
    return dataset["input_ids"]
