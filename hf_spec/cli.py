"""The ``hf-spec`` command (also ``python -m hf_spec``): all command-line parsing lives here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from transformers import TextStreamer
from transformers.generation.streamers import BaseStreamer

from hf_spec.acceptance import evaluate_draft, measure_draft, target_continuations
from hf_spec.bench import (
    DEFAULT_METHODS,
    METHODS,
    SETTINGS,
    WORKLOADS,
    method_spec,
    random_workloads,
    run_benchmark,
    text_workloads,
)
from hf_spec.bench_report import format_table, plot
from hf_spec.corpora import load_texts
from hf_spec.measure import forward_costs
from hf_spec.mixin import speculative
from hf_spec.models import TINY_VOCAB_SIZE, build_tiny_pair
from hf_spec.pretrained import DEFAULT_DRAFT, DEFAULT_TARGET, load
from hf_spec.quantization import SCHEMES, first_device, quantized_copy
from hf_spec.validation import DEFAULT_NUM_DRAFT_TOKENS, check_same_vocabulary

TINY = "tiny"  # the built-in random-weight pair: token ids in and out, no tokenizer
DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


class _IdStreamer(BaseStreamer):
    """Prints generated token ids as they arrive (the tiny pair has no tokenizer)."""

    def __init__(self):
        self.is_prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self.is_prompt:  # generate() streams the prompt first
            self.is_prompt = False
            return
        print(" ".join(str(token) for token in value.reshape(-1).tolist()), end=" ", flush=True)

    def end(self) -> None:
        print(flush=True)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _method(text: str) -> str:
    try:
        method_spec(text, 1)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _model_arguments() -> argparse.ArgumentParser:
    """Options shared by every subcommand: which models, in what dtype, on how many threads."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"built-in name, local folder or Hub id; {TINY!r} for the random tiny pair "
                             "(default: %(default)s)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="as --target (default: %(default)s)")
    parser.add_argument("--num-assistant-tokens", "-k", type=_positive_int, default=DEFAULT_NUM_DRAFT_TOKENS,
                        help="draft tokens per round (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model weights (default: %(default)s; bf16 pays off on CPUs with AMX)")
    parser.add_argument("--quantize", default=None, choices=SCHEMES,
                        help="load the target's linear layers quantized by bitsandbytes (8bit, or 4-bit nf4/fp4; "
                             "the rest in --dtype), spread over the devices with device_map='auto'")
    parser.add_argument("--quantize-draft", default=None, choices=SCHEMES, help="as --quantize, for the draft")
    parser.add_argument("--seed", type=int, default=0, help="seeds the tiny pair and sampling")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    return parser


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-spec", description="Exact speculative decoding for transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    shared = _model_arguments()
    generate = commands.add_parser(
        "generate", parents=[shared], help="speculative generation with streamed output, statistics and tokens/s",
    )
    generate.add_argument("--prompt", default=DEFAULT_PROMPT, help="the text, sent as a chat message when the "
                          "tokenizer has a chat template (default: %(default)r)")
    generate.add_argument("--no-chat", action="store_true", help="send --prompt as plain text to complete")
    generate.add_argument("--prompt-ids", default="1 2 3 4 5", help=f"with --target {TINY}: space-separated ids")
    generate.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    generate.add_argument("--temperature", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--compare", action="store_true", help="also time target-only generate, same settings")
    generate.add_argument("--json", action="store_true", help="print the statistics as JSON")

    bench = commands.add_parser(
        "bench", parents=[shared],
        help="target-only, transformers' assisted generation and hf_spec side by side (JSON, PNG, table)",
        description="Runs target-only generate, transformers' generate(assistant_model=) (at its best: constant "
                    "schedule, same k, no confidence threshold; and at its defaults) and hf_spec, interleaved, on "
                    "the same prompts and settings.",
    )
    bench.add_argument("--workloads", nargs="+", default=["code", "prose"], choices=WORKLOADS,
                       help="code: HumanEval prompts completed as text; prose: chat requests for prose; edit: add "
                            "type hints to a given function (default: code prose)")
    bench.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                       help="greedy, and/or sampled at temperature 0.7, top-p 0.9")
    bench.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), type=_method,
                       help=f"from {', '.join(METHODS)}, or hf_spec_k<N> (ours with k = N); target_only is always "
                            "run, every ratio is relative to it (default: %(default)s)")
    bench.add_argument("--variants", nargs="+", default=[], choices=SCHEMES,
                       help="also run every method on the target quantized with each scheme (reported as "
                            "<method>@<scheme>, same draft, interleaved with the rest)")
    bench.add_argument("--draft-variants", nargs="+", default=[], metavar="DRAFT",
                       help="also run every method that uses a draft with each of these drafts (built-in name or "
                            "folder, e.g. a distilled draft; reported as <method>@<folder name>)")
    bench.add_argument("--prompts", type=_positive_int, default=3, help="prompts per workload (default: %(default)s)")
    bench.add_argument("--offset", type=int, default=0,
                       help="skip this many prompts of each workload (hold out what a draft was trained on)")
    bench.add_argument("--repeats", type=_positive_int, default=1, help="calls per prompt and method")
    bench.add_argument("--json", default="bench.json", help="report file (default: %(default)s)")
    bench.add_argument("--plot", default="bench.png", help="plot file (default: %(default)s)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")

    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--dataset", default="humaneval",
                      help="humaneval (prompts), humaneval-solutions (prompt + canonical solution), stdlib, or a "
                           ".json/.jsonl/.csv/.parquet/.txt file (default: %(default)s)")
    data.add_argument("--column", default=None, help="the file's column of texts (default: text for .txt, else prompt)")
    data.add_argument("--offset", type=int, default=0, help="skip this many texts (hold out what you trained on)")
    data.add_argument("--num-texts", type=_positive_int, default=16, help="texts to use (default: %(default)s)")
    data.add_argument("--do-sample", action="store_true", help="sampling (default: greedy)")
    data.add_argument("--temperature", type=float, default=None)
    data.add_argument("--top-p", type=float, default=None)
    data.add_argument("--output", default=None, help="write the JSON report here (default: print it)")

    evaluate_draft = commands.add_parser(
        "eval-draft", parents=[shared, data],
        help="expected acceptance of a draft (1 - TV per position on the target's continuations), predicted "
             "tokens per pass and speed-up; --measure also runs speculative generation",
    )
    evaluate_draft.add_argument("--cost-ratio", type=float, default=None,
                                help="draft step / target step, for the predicted speed-up (default: measured)")
    evaluate_draft.add_argument("--measure", action="store_true", help="also run speculative generation with -k")

    distill = commands.add_parser(
        "distill", parents=[shared, data],
        help="fine-tune the draft toward the target (transformers' Trainer) on the target's continuations of the "
             "dataset's texts (or on the texts themselves with --plain-text); saves with save_pretrained",
    )
    distill.add_argument("--output-dir", required=True, help="where the trained draft is saved")
    distill.add_argument("--plain-text", action="store_true", help="train on the texts, not on continuations")
    distill.add_argument("--loss", default="tv", choices=["tv", "kl"], help="(default: %(default)s)")
    distill.add_argument("--max-steps", type=_positive_int, default=100)
    distill.add_argument("--learning-rate", type=float, default=1e-5)
    distill.add_argument("--batch-size", type=_positive_int, default=1)
    distill.add_argument("--max-length", type=_positive_int, default=256, help="tokens per plain-text sequence")
    distill.add_argument("--train-last-layers", type=_positive_int, default=None)
    distill.add_argument("--lora-rank", type=_positive_int, default=None, help="LoRA adapters through peft")
    return parser.parse_args(argv)


def _prompt_ids(text: str) -> torch.Tensor:
    try:
        ids = [int(token) for token in text.split()]
    except ValueError:
        raise SystemExit(f"--prompt-ids must be space-separated integers, got {text!r}") from None
    if not ids or not all(0 <= i < TINY_VOCAB_SIZE for i in ids):
        raise SystemExit(f"--prompt-ids must be 1 or more ids in [0, {TINY_VOCAB_SIZE}), got {text!r}")
    return torch.tensor([ids])


def _load_models(args: argparse.Namespace, draft_dtype: torch.dtype | None = None):
    """``(speculative target, draft, tokenizer or None)``; the tiny pair has no tokenizer. The draft is loaded in
    ``draft_dtype`` when given (training keeps float32 weights), else in ``--dtype`` like the target."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.target == TINY or args.draft == TINY:
        if args.target != args.draft:
            raise SystemExit(f"--target {TINY} goes with --draft {TINY}, got --target {args.target!r} "
                             f"--draft {args.draft!r}")
        target, draft = build_tiny_pair(seed=args.seed)
        print("built-in tiny pair: random-weight Llama target and a perturbed copy as draft (no meaningful text)")
        if args.quantize:
            target = quantized_copy(target, args.quantize)
        if args.quantize_draft:
            draft = quantized_copy(draft, args.quantize_draft)
        return speculative(target), _on_first_device(draft, target, args.quantize_draft), None
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load(args.target, dtype=dtype, quantize=args.quantize)
    draft, draft_tokenizer = load(args.draft, dtype=draft_dtype or dtype, quantize=args.quantize_draft)
    draft = _on_first_device(draft, target, args.quantize_draft)
    try:
        check_same_vocabulary(tokenizer, draft_tokenizer)
    except ValueError as error:
        raise SystemExit(f"--draft {args.draft} does not fit --target {args.target}: {error}") from None
    return speculative(target), draft, tokenizer


def _on_first_device(draft, target, draft_quantization: str | None):
    """The draft on the target's first device (a quantized draft was placed by its own ``device_map``)."""
    return draft if draft_quantization is not None else draft.to(first_device(target))


def _variants(args: argparse.Namespace, target, tokenizer) -> dict:
    """``--variants``: the target again, quantized with each scheme; ``--draft-variants``: (target, other draft)."""
    if args.quantize in args.variants:
        raise SystemExit(f"--variants {args.quantize}: the target itself is already loaded with --quantize "
                         f"{args.quantize}.")
    if args.target == TINY:
        variants = {scheme: quantized_copy(build_tiny_pair(seed=args.seed)[0], scheme) for scheme in args.variants}
    else:
        variants = {scheme: load(args.target, dtype=getattr(torch, args.dtype), quantize=scheme)[0]
                    for scheme in args.variants}
    for name in args.draft_variants:
        label = Path(name).name
        if label in variants:
            raise SystemExit(f"--draft-variants {name}: the label {label!r} is taken; rename the folder.")
        if args.target == TINY:
            raise SystemExit(f"--draft-variants {name}: the tiny pair has no tokenizer to check a draft against.")
        draft, draft_tokenizer = load(name, dtype=getattr(torch, args.dtype), quantize=args.quantize_draft)
        try:
            check_same_vocabulary(tokenizer, draft_tokenizer)
        except ValueError as error:
            raise SystemExit(f"--draft-variants {name} does not fit --target {args.target}: {error}") from None
        variants[label] = (target, _on_first_device(draft, target, args.quantize_draft))
    return variants


def _models_and_inputs(args: argparse.Namespace):
    """``(target, draft, inputs, streamer)`` for the chosen models."""
    target, draft, tokenizer = _load_models(args)
    if tokenizer is None:
        return target, draft, {"input_ids": _prompt_ids(args.prompt_ids)}, _IdStreamer()
    if tokenizer.chat_template and not args.no_chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = args.prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    return target, draft, dict(inputs), TextStreamer(tokenizer, skip_prompt=True)


def _generate(args: argparse.Namespace) -> int:
    target, draft, inputs, streamer = _models_and_inputs(args)
    settings = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.do_sample,
        **{name: getattr(args, name) for name in ("temperature", "top_k", "top_p") if getattr(args, name) is not None},
    }
    prompt_length = inputs["input_ids"].shape[1]
    started = time.perf_counter()
    output = target.generate(
        **inputs, assistant_model=draft, num_assistant_tokens=args.num_assistant_tokens, streamer=streamer,
        generator=torch.Generator().manual_seed(args.seed), return_dict_in_generate=True, **settings,
    )
    speculative_seconds = time.perf_counter() - started
    stats = output.speculative_stats
    num_new = output.sequences.shape[1] - prompt_length
    report = {
        **stats.to_dict(), "new_tokens": num_new, "speculative_tokens_per_second": num_new / speculative_seconds,
        "threads": torch.get_num_threads(), "dtype": args.dtype, "target": args.target, "draft": args.draft,
    }
    if args.compare:
        started = time.perf_counter()
        target_only_ids = target.generate(**inputs, **settings)
        report["target_only_tokens_per_second"] = (
            (target_only_ids.shape[1] - prompt_length) / (time.perf_counter() - started)
        )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(stats)
    line = f"tokens/s: speculative {report['speculative_tokens_per_second']:.2f}"
    if args.compare:
        line += f", target only {report['target_only_tokens_per_second']:.2f} (same settings)"
    print(f"{line}; {report['threads']} thread(s), {args.dtype}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    target, draft, tokenizer = _load_models(args)
    workloads = tuple(dict.fromkeys(args.workloads))
    try:
        if tokenizer is None:
            inputs = random_workloads(workloads, args.prompts, TINY_VOCAB_SIZE, seed=args.seed)
        else:
            inputs = text_workloads(tokenizer, workloads, args.prompts, args.offset)
    except ValueError as error:
        raise SystemExit(f"--prompts/--offset: {error}") from None
    methods = tuple(dict.fromkeys(["target_only", *args.methods]))
    variants = _variants(args, target, tokenizer)
    methods = (*methods, *(f"{method}@{label}" for label, variant in variants.items() for method in methods
                           if not isinstance(variant, tuple) or method_spec(method, 1).uses_draft))
    report = run_benchmark(
        target, draft, inputs, settings={name: SETTINGS[name] for name in dict.fromkeys(args.settings)},
        methods=methods, variants=variants, k=args.num_assistant_tokens, max_new_tokens=args.max_new_tokens,
        repeats=args.repeats, seed=args.seed, progress=not args.no_progress,
    )
    report["config"].update(target=args.target, draft=args.draft, draft_quantization=args.quantize_draft)
    with open(args.json, "w") as out:
        json.dump(report, out, indent=2)
    plot(report, args.plot)
    print(format_table(report))
    print(f"wrote {args.json} and {args.plot}")
    return 0


def _sampling(args: argparse.Namespace) -> dict:
    return {"do_sample": args.do_sample,
            **{name: getattr(args, name) for name in ("temperature", "top_p") if getattr(args, name) is not None}}


def _prompts(args: argparse.Namespace, tokenizer) -> list[torch.Tensor]:
    """``[1, S]`` token ids of the selected texts (random ids for the tiny pair)."""
    if tokenizer is None:
        workloads = random_workloads(("tiny",), args.num_texts, TINY_VOCAB_SIZE, seed=args.seed + args.offset)
        return [inputs["input_ids"] for inputs in workloads["tiny"]]
    try:
        texts = load_texts(args.dataset, _column(args), args.offset, args.num_texts)
    except ValueError as error:
        raise SystemExit(f"--dataset: {error}") from None
    return [tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"] for text in texts]


def _column(args: argparse.Namespace) -> str:
    return args.column or ("text" if args.dataset.endswith(".txt") else "prompt")


def _write_report(report: dict, path: str | None) -> None:
    text = json.dumps(report, indent=2, default=str)
    if path is None:
        print(text)
        return
    with open(path, "w") as out:
        out.write(text)
    print(f"wrote {path}")


def _eval_draft(args: argparse.Namespace) -> int:
    target, draft, tokenizer = _load_models(args)
    prompts = _prompts(args, tokenizer)
    settings = _sampling(args)
    continuations = target_continuations(target, prompts, args.max_new_tokens, settings, seed=args.seed)
    cost_ratio = args.cost_ratio
    costs = None
    if cost_ratio is None:
        costs = forward_costs(target, draft, prompts[0], {args.num_assistant_tokens})
        cost_ratio = costs.cost_ratio
    report = {"predicted": dataclasses.asdict(evaluate_draft(
        target, draft, prompts, continuations, settings, cost_ratio=cost_ratio,
    )), "cost_ratio": cost_ratio, "texts": {"dataset": args.dataset, "offset": args.offset, "count": len(prompts)}}
    if costs is not None:
        report["block_cost"] = costs.block_cost(args.num_assistant_tokens)
    if args.measure:
        report["measured"] = measure_draft(target, draft, prompts, args.num_assistant_tokens, args.max_new_tokens,
                                           settings, seed=args.seed)
    _write_report(report, args.output)
    return 0


def _distill(args: argparse.Namespace) -> int:
    from hf_spec.distill import continuation_dataset, distill, text_dataset

    if args.quantize_draft:
        raise SystemExit(f"--quantize-draft {args.quantize_draft}: distill trains the draft in float32; quantize the "
                         "trained draft when you load it.")
    # the draft trains in float32 (bf16 weights would round small updates away); --dtype sets the teacher's
    target, draft, tokenizer = _load_models(args, draft_dtype=torch.float32)
    if args.plain_text:
        if tokenizer is None:
            raise SystemExit("--plain-text needs models with a tokenizer (not the tiny pair).")
        try:
            texts = load_texts(args.dataset, _column(args), args.offset, args.num_texts)
        except ValueError as error:
            raise SystemExit(f"--dataset: {error}") from None
        dataset = text_dataset(tokenizer, texts, args.max_length)
    else:
        dataset = continuation_dataset(target, _prompts(args, tokenizer), args.max_new_tokens, _sampling(args),
                                       cache_dir=Path(args.output_dir) / "data", seed=args.seed)
    pad = (tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0)
    _, history = distill(
        target, draft, dataset, args.output_dir, loss=args.loss, temperature=args.temperature or 1.0,
        train_last_layers=args.train_last_layers, lora_rank=args.lora_rank, pad_token_id=pad,
        max_steps=args.max_steps, learning_rate=args.learning_rate, per_device_train_batch_size=args.batch_size,
        seed=args.seed,
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(args.output_dir)
    _write_report({"output_dir": args.output_dir, "train_sequences": len(dataset), "log_history": history},
                  args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    commands = {"generate": _generate, "bench": _bench, "eval-draft": _eval_draft, "distill": _distill}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
