"""``hf-spec bench``: target-only, transformers' assisted generation and hf_spec side by side (JSON, PNG, table)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path

import torch

from hf_spec.bench.report import format_table, plot
from hf_spec.bench.runner import DEFAULT_METHODS, METHODS, SETTINGS, method_spec, run_benchmark
from hf_spec.bench.workloads import WORKLOADS, random_workloads, text_workloads
from hf_spec.cli.common import load_models, positive_int
from hf_spec.drafting.vocabulary import prune_vocabulary
from hf_spec.heads.model import DraftHead, is_draft_head_folder
from hf_spec.loading.packed import optimize
from hf_spec.loading.pair import TINY, place_draft
from hf_spec.loading.pretrained import load
from hf_spec.loading.quantization import SCHEMES, quantized_copy
from hf_spec.loading.tiny import TINY_VOCAB_SIZE, build_tiny_pair
from hf_spec.loading.vocabulary import draft_vocabulary
from hf_spec.validation import check_same_vocabulary


def _method(text: str) -> str:
    try:
        method_spec(text, 1)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_parser(commands, shared: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "bench", parents=[shared],
        help="target-only, transformers' assisted generation and hf_spec side by side (JSON, PNG, table)",
        description="Runs target-only generate, transformers' generate(assistant_model=) (at its best: constant "
                    "schedule, same k, no confidence threshold; and at its defaults) and hf_spec, interleaved, on "
                    "the same prompts and settings.",
    )
    parser.add_argument("--workloads", nargs="+", default=["code", "prose"], choices=WORKLOADS,
                        help="code: HumanEval prompts completed as text; prose: chat requests for prose; edit: add "
                             "type hints to a given function (default: code prose)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                        help="greedy, and/or sampled at temperature 0.7, top-p 0.9")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), type=_method,
                        help=f"from {', '.join(METHODS)}, or hf_spec_k<N> (ours with k = N), hf_spec_tree<N> (a "
                             "tree of N draft tokens, k deep), hf_spec_suffix<N> (suffix matching, N tokens), "
                             "hf_spec_tree_auto / hf_spec_suffix_auto (num_tree_nodes='auto'); "
                             "target_only is always run, every ratio is relative to it (default: %(default)s)")
    parser.add_argument("--variants", nargs="+", default=[], choices=SCHEMES,
                        help="also run every method on the target quantized with each scheme (reported as "
                             "<method>@<scheme>, same draft, interleaved with the rest)")
    parser.add_argument("--draft-variants", nargs="+", default=[], metavar="DRAFT",
                        help="also run every method that uses a draft with each of these drafts (built-in name or "
                             "folder, e.g. a distilled draft; reported as <method>@<folder name>)")
    parser.add_argument("--draft-vocab-variants", nargs="+", type=positive_int, default=[], metavar="N",
                        help="also run every method that uses a draft with the draft's output layer cut to its N most "
                             "frequent ids (reported as <method>@vocab<N>; ranked on --draft-vocab-corpus)")
    parser.add_argument("--kernel-baselines", nargs="*", default=["stock", "steps"], choices=["stock", "steps"],
                        help="target-only decoding beside the optimized pair on another copy of the target: as loaded "
                             "(stock) and on the path fastest for steps (steps); each copy holds the target's weights "
                             "again (default: both)")
    parser.add_argument("--prompts", type=positive_int, default=3, help="prompts per workload (default: %(default)s)")
    parser.add_argument("--offset", type=int, default=0,
                        help="skip this many prompts of each workload (hold out what a draft was trained on)")
    parser.add_argument("--repeats", type=positive_int, default=1, help="calls per prompt and method")
    parser.add_argument("--json", default="bench.json", help="report file (default: %(default)s)")
    parser.add_argument("--plot", default="bench.png", help="plot file (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def _kernel_baselines(args: argparse.Namespace, pair) -> dict:
    """The target again, as loaded (``stock``) and on the path fastest for steps (``steps``), for target-only runs
    beside the optimized pair: none with ``--no-optimize`` or a quantized target."""
    if args.no_optimize or args.quantize:
        return {}
    baselines = {}
    for label in dict.fromkeys(args.kernel_baselines):
        if args.target == TINY:
            model = build_tiny_pair(seed=args.seed)[0]
        else:
            model = load(args.target, dtype=pair.target.dtype)[0]
        if label == "steps":
            print(f"target for steps: {optimize(model, role='steps').describe()}")
        baselines[label] = model
    return baselines


def runs_on(spec, variant) -> bool:
    """Whether a method runs on a variant: every method on another target; on another draft, the methods that use
    one; on a draft head, hf_spec's chains and trees (transformers cannot run a head)."""
    if not isinstance(variant, tuple):
        return True
    if isinstance(variant[1], DraftHead):
        return spec.uses_draft and spec.is_ours
    return spec.uses_draft


def _variants(args: argparse.Namespace, pair) -> dict:
    """``--variants``: the target again, quantized with each scheme; ``--draft-variants``: (target, other draft)."""
    target, tokenizer = pair.target, pair.tokenizer
    pair_dtype = target.dtype if target.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    if args.quantize in args.variants:
        raise SystemExit(f"--variants {args.quantize}: the target itself is already loaded with --quantize "
                         f"{args.quantize}.")
    if args.target == TINY:
        variants = {scheme: quantized_copy(build_tiny_pair(seed=args.seed)[0], scheme) for scheme in args.variants}
    else:
        variants = {scheme: load(args.target, dtype=pair_dtype, quantize=scheme)[0]
                    for scheme in args.variants}
    for name in args.draft_variants:
        label = Path(name).name
        if label in variants:
            raise SystemExit(f"--draft-variants {name}: the label {label!r} is taken; rename the folder.")
        if is_draft_head_folder(name):  # a head built for this target: checked against it, dense kernels for its steps
            head = DraftHead.from_pretrained(name).to(dtype=pair_dtype, device=target.device).eval()
            try:
                head.attach(target)
            except ValueError as error:
                raise SystemExit(f"--draft-variants {name}: {error}") from None
            if not args.no_optimize:
                optimize(head, path="dense", role="steps")
            variants[label] = (target, head)
            continue
        if args.target == TINY:
            raise SystemExit(f"--draft-variants {name}: the tiny pair has no tokenizer to check a draft against.")
        draft, draft_tokenizer = load(name, dtype=pair_dtype, quantize=args.quantize_draft)
        try:
            check_same_vocabulary(tokenizer, draft_tokenizer)
        except ValueError as error:
            raise SystemExit(f"--draft-variants {name} does not fit --target {args.target}: {error}") from None
        variants[label] = (target, place_draft(draft, target, args.quantize_draft))
    for size in args.draft_vocab_variants:
        draft = copy.deepcopy(pair.draft)
        prune_vocabulary(draft, draft_vocabulary(draft, pair.tokenizer, size, args.draft_vocab_corpus))
        if not args.no_optimize:
            optimize(draft, role="steps")
        variants[f"vocab{size}"] = (target, draft)
    return variants


def run(args: argparse.Namespace) -> int:
    pair = load_models(args)
    workloads = tuple(dict.fromkeys(args.workloads))
    try:
        if pair.tokenizer is None:
            inputs = random_workloads(workloads, args.prompts, TINY_VOCAB_SIZE, seed=args.seed)
        else:
            inputs = text_workloads(pair.tokenizer, workloads, args.prompts, args.offset)
    except ValueError as error:
        raise SystemExit(f"--prompts/--offset: {error}") from None
    methods = tuple(dict.fromkeys(["target_only", *args.methods]))
    variants = _variants(args, pair)
    methods = (*methods, *(f"{method}@{label}" for label, variant in variants.items() for method in methods
                           if runs_on(method_spec(method, 1), variant)))
    baselines = _kernel_baselines(args, pair)
    methods, variants = (*methods, *(f"target_only@{label}" for label in baselines)), {**variants, **baselines}
    report = run_benchmark(
        pair.target, pair.draft, inputs, settings={name: SETTINGS[name] for name in dict.fromkeys(args.settings)},
        methods=methods, variants=variants, num_draft_tokens=args.num_assistant_tokens,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, seed=args.seed, progress=not args.no_progress,
    )
    report["config"].update(target=args.target, draft=args.draft, draft_quantization=args.quantize_draft,
                            cpu_paths={role: None if path is None else dataclasses.asdict(path)
                                       for role, path in (("target", pair.target_path), ("draft", pair.draft_path))})
    with open(args.json, "w") as out:
        json.dump(report, out, indent=2)
    plot(report, args.plot)
    print(format_table(report))
    print(f"wrote {args.json} and {args.plot}")
    return 0
