"""``hf-spec distill``: fine-tune the draft toward the target with transformers' `Trainer`."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hf_spec.cli.common import load_models, positive_int, prompts, sampling, text_arguments, texts, write_report


def add_parser(commands, shared: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "distill", parents=[shared, text_arguments()],
        help="fine-tune the draft toward the target (transformers' Trainer) on the target's continuations of the "
             "dataset's texts (or on the texts themselves with --plain-text); saves with save_pretrained",
    )
    parser.add_argument("--output-dir", required=True, help="where the trained draft is saved")
    parser.add_argument("--plain-text", action="store_true", help="train on the texts, not on continuations")
    parser.add_argument("--loss", default="tv", choices=["tv", "kl"], help="(default: %(default)s)")
    parser.add_argument("--max-steps", type=positive_int, default=100)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--max-length", type=positive_int, default=256, help="tokens per plain-text sequence")
    parser.add_argument("--train-last-layers", type=positive_int, default=None)
    parser.add_argument("--lora-rank", type=positive_int, default=None, help="LoRA adapters through peft")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hf_spec.evaluation.distill import continuation_dataset, distill, text_dataset

    if args.quantize_draft:
        raise SystemExit(f"--quantize-draft {args.quantize_draft}: distill trains the draft in float32; quantize the "
                         "trained draft when you load it.")
    # the draft trains in float32 (bf16 weights would round small updates away); --dtype sets the teacher's
    pair = load_models(args, draft_dtype=torch.float32, optimize=False)
    if args.plain_text:
        if pair.tokenizer is None:
            raise SystemExit("--plain-text needs models with a tokenizer (not the tiny pair).")
        dataset = text_dataset(pair.tokenizer, texts(args), args.max_length)
    else:
        dataset = continuation_dataset(pair.target, prompts(args, pair.tokenizer), args.max_new_tokens,
                                       sampling(args), cache_dir=Path(args.output_dir) / "data", seed=args.seed)
    pad = pair.tokenizer.pad_token_id if pair.tokenizer is not None and pair.tokenizer.pad_token_id is not None else 0
    _, history = distill(
        pair.target, pair.draft, dataset, args.output_dir, loss=args.loss, temperature=args.temperature or 1.0,
        train_last_layers=args.train_last_layers, lora_rank=args.lora_rank, pad_token_id=pad,
        max_steps=args.max_steps, learning_rate=args.learning_rate, per_device_train_batch_size=args.batch_size,
        seed=args.seed,
    )
    if pair.tokenizer is not None:
        pair.tokenizer.save_pretrained(args.output_dir)
    write_report({"output_dir": args.output_dir, "train_sequences": len(dataset), "log_history": history},
                 args.output)
    return 0
