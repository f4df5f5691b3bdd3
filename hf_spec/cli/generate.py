"""``hf-spec generate``: speculative generation with streamed output, statistics and tokens/s."""

from __future__ import annotations

import argparse
import time

import torch
from transformers import TextStreamer

from hf_spec.cli import dataset
from hf_spec.cli.common import (
    check_writable,
    decoding_arguments,
    draft_arguments,
    emit,
    load_models,
    output_arguments,
    positive_int,
    sampling,
    target_arguments,
)

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "generate", parents=[target_arguments(), draft_arguments(), decoding_arguments(), output_arguments()],
        help="speculative generation with streamed output, statistics and tokens/s",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the text, sent as a chat message when the tokenizer "
                        "has a chat template")
    parser.add_argument("--no-chat", action="store_true", help="send --prompt as plain text to complete")
    parser.add_argument("--prompt-ids", default=None, help="space-separated token ids instead of --prompt")
    parser.add_argument("--num-tree-nodes", type=_tree_nodes, default=None,
                        help="draft a tree of at most this many tokens per round, at most -k deep ('auto': the "
                             "budget and branching chosen every round; default: a chain of k)")
    parser.add_argument("--compare", action="store_true", help="also time target-only generate, same settings")
    dataset.add_arguments(parser)
    parser.set_defaults(run=run)


def _tree_nodes(text: str) -> int | str:
    """argparse type of ``--num-tree-nodes``: a positive integer or ``auto``."""
    return text if text == "auto" else positive_int(text)


def _prompt_ids(text: str) -> torch.Tensor:
    try:
        ids = [int(token) for token in text.split()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be space-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError(f"--prompt-ids must hold at least one id, got {text!r}")
    return torch.tensor([ids])


def _inputs(args: argparse.Namespace, tokenizer) -> dict:
    if args.prompt_ids is not None:
        return {"input_ids": _prompt_ids(args.prompt_ids)}
    text = args.prompt
    if tokenizer.chat_template and not args.no_chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return dict(tokenizer(text, return_tensors="pt", add_special_tokens=False))


def run(args: argparse.Namespace) -> int:
    if args.dataset is not None:
        dataset.check_arguments(args, DEFAULT_PROMPT)
        check_writable(args.output, "--output")
        report = dataset.run(args)
        if report is not None:  # the main process
            acceptance = report["acceptance_rate"]
            emit(argparse.Namespace(**{**vars(args), "output": None}), report,
                 f"{report['rows_this_run']} rows generated ({report['rows']} in all) by {report['processes']} "
                 f"process(es) in {report['seconds']:.1f} s; acceptance "
                 f"{'-' if acceptance is None else f'{acceptance:.2f}'}")
        return 0
    if args.prompt_ids is None and not args.prompt.strip():
        raise ValueError("--prompt is empty: give a text to continue (or --prompt-ids).")
    if args.prompt_ids is not None:
        _prompt_ids(args.prompt_ids)  # before the models load
    check_writable(args.output, "--output")
    pair = load_models(args)
    target, tokenizer = pair.target, pair.tokenizer
    inputs = _inputs(args, tokenizer)
    vocab_size = target.config.get_text_config().vocab_size
    if int(inputs["input_ids"].max()) >= vocab_size or int(inputs["input_ids"].min()) < 0:
        raise ValueError(f"--prompt-ids must be ids in [0, {vocab_size}) for this target, got {args.prompt_ids!r}")
    settings = {"max_new_tokens": args.max_new_tokens, **sampling(args)}
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True)
    prompt_length = inputs["input_ids"].shape[1]
    started = time.perf_counter()
    output = target.generate(
        **inputs, **pair.assistant(), num_assistant_tokens=args.num_assistant_tokens, streamer=streamer,
        num_tree_nodes=args.num_tree_nodes, generator=torch.Generator().manual_seed(args.seed),
        return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, **settings,
    )
    seconds = time.perf_counter() - started
    stats = output.speculative_stats
    new_ids = output.sequences[0, prompt_length:]
    report = {
        "new_ids": new_ids.tolist(), "text": tokenizer.decode(new_ids, skip_special_tokens=True),
        "new_tokens": len(new_ids), "speculative_tokens_per_second": len(new_ids) / seconds, **stats.to_dict(),
        "threads": torch.get_num_threads(), "dtype": str(target.dtype).removeprefix("torch."), "target": args.target,
        "draft": args.draft,
        "cpu_paths": {role: None if path is None else path.name
                      for role, path in (("target", pair.target_path), ("draft", pair.draft_path))},
    }
    lines = [str(stats), f"tokens/s: speculative {report['speculative_tokens_per_second']:.2f}"]
    if args.compare:
        started = time.perf_counter()
        target_only_ids = target.generate(**inputs, pad_token_id=tokenizer.pad_token_id, **settings)
        report["target_only_tokens_per_second"] = (target_only_ids.shape[1] - prompt_length) / (
            time.perf_counter() - started)
        lines[-1] += f", target only {report['target_only_tokens_per_second']:.2f} (same weights, kernels, settings)"
    paths = report["cpu_paths"]
    lines[-1] += (f"; {report['threads']} thread(s), {report['dtype']}, CPU paths: target {paths['target'] or 'stock'}"
                  f", draft {paths['draft'] or 'stock'}")
    emit(args, report, "\n".join(lines))
    return 0
