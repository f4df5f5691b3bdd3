"""``hf-spec distill``: fine-tune the draft toward the target with transformers' `Trainer`."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hf_spec.cli.common import (
    check_writable,
    decoding_arguments,
    emit,
    load_models,
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
from hf_spec.loading.pretrained import DEFAULT_DRAFT


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "distill", parents=[target_arguments(), decoding_arguments(64), text_arguments(), output_arguments()],
        help="fine-tune the draft toward the target (transformers' Trainer) on the target's continuations of the "
             "dataset's texts (or on the texts themselves with --plain-text); saves with save_pretrained",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--draft", "--draft-model", default=DEFAULT_DRAFT, help="the draft to train, as --target")
    parser.add_argument("--output-dir", required=True, help="where the trained draft is saved")
    parser.add_argument("--plain-text", action="store_true", help="train on the texts, not on continuations")
    parser.add_argument("--loss", default="tv", choices=["tv", "kl"], help="total variation or forward KL")
    parser.add_argument("--max-steps", type=positive_int, default=100, help="optimizer steps")
    parser.add_argument("--learning-rate", type=positive_float, default=1e-5, help="peak learning rate")
    parser.add_argument("--batch-size", type=positive_int, default=1, help="sequences per step and device")
    parser.add_argument("--max-length", type=positive_int, default=256, help="tokens per plain-text sequence")
    parser.add_argument("--train-last-layers", type=positive_int, default=None,
                        help="train only the last N decoder layers and the final norm (default: all)")
    parser.add_argument("--lora-rank", type=positive_int, default=None, help="train LoRA adapters through peft")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    require_extra("train", "hf-spec distill")
    processes = training_processes()
    from hf_spec.evaluation.distill import continuation_dataset, distill, text_dataset

    check_writable(args.output, "--output")
    prepare_folder(args.output_dir, "--output-dir")
    # the draft trains in float32 (bf16 weights would round small updates away); --dtype sets the teacher's
    args.quantize_draft, args.draft_vocab = None, None  # a whole output layer, in float32
    args.draft_vocab_corpus, args.draft_vocab_counts = "stdlib", "continuations"  # unused without --draft-vocab
    pair = load_models(args, draft_dtype=torch.float32, optimize=False)
    pair.check_same_tokenizer("distillation")
    with processes.main_process_first():  # under `accelerate launch`: one process writes the cache, the rest read
        if args.plain_text:
            dataset = text_dataset(pair.tokenizer, texts(args), args.max_length)
        else:
            dataset = continuation_dataset(pair.target, prompts(args, pair.tokenizer), args.max_new_tokens,
                                           sampling(args), cache_dir=Path(args.output_dir) / "data", seed=args.seed)
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else 0
    _, history = distill(
        pair.target, pair.draft, dataset, args.output_dir, loss=args.loss, temperature=args.temperature or 1.0,
        train_last_layers=args.train_last_layers, lora_rank=args.lora_rank, pad_token_id=pad,
        max_steps=args.max_steps, learning_rate=args.learning_rate, per_device_train_batch_size=args.batch_size,
        seed=args.seed,
    )
    if not processes.is_main_process:
        return 0
    pair.tokenizer.save_pretrained(args.output_dir)
    report = {"output_dir": args.output_dir, "num_processes": processes.num_processes,
              "train_sequences": len(dataset), "log_history": history}
    emit(args, report, f"saved the distilled draft in {args.output_dir} ({len(dataset)} training sequences)")
    return 0
