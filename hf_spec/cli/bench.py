"""``hf-spec bench``: target-only, transformers' assisted generation and hf_spec side by side (JSON, PNG, table)."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from hf_spec.bench.first_call import format_first_calls, run_first_calls
from hf_spec.bench.methods import DEFAULT_METHODS, METHODS, SETTINGS, method_spec, runs_on
from hf_spec.bench.peers import LlamaCppPeer, OpenVINOPeer, Peers
from hf_spec.bench.report import format_table, plot
from hf_spec.bench.runner import run_benchmark
from hf_spec.bench.variants import KERNEL_LABELS, bench_variants
from hf_spec.bench.workloads import WORKLOADS, random_workloads, text_workloads
from hf_spec.cli.common import (
    check_writable,
    draft_arguments,
    emit,
    load_models,
    log,
    output_arguments,
    positive_int,
    target_arguments,
)
from hf_spec.extras import require
from hf_spec.loading.pair import TINY
from hf_spec.loading.pretrained import gguf_file
from hf_spec.loading.quantization import SCHEMES
from hf_spec.loading.tiny import TINY_VOCAB_SIZE
from hf_spec.loading.vocabulary import COUNTED_ON


def _method(text: str) -> str:
    try:
        method_spec(text, 1)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def vocab_variant(text: str) -> tuple[int, str]:
    """``N`` or ``N:<counted on>`` (`hf_spec.loading.vocabulary.COUNTED_ON`) -> (N, counted on)."""
    size, _, counted_on = text.partition(":")
    counted_on = counted_on or "continuations"
    if counted_on not in COUNTED_ON:
        raise argparse.ArgumentTypeError(f"must be N or N:<one of {', '.join(COUNTED_ON)}>, got {text}")
    return positive_int(size), counted_on


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "bench", parents=[target_arguments(), draft_arguments(), output_arguments(default_output="bench.json")],
        help="target-only, transformers' assisted generation and hf_spec side by side (JSON, PNG, table)",
        description="Runs target-only generate, transformers' generate(assistant_model=) (at its best: constant "
                    "schedule, same k, no confidence threshold; and at its defaults) and hf_spec, interleaved, on "
                    "the same prompts, weights, kernels and settings.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workloads", nargs="+", default=["code", "prose"], choices=WORKLOADS,
                        help="code: HumanEval prompts completed as text; prose: chat requests for prose; edit: add "
                             "type hints to a given function")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                        help="greedy, and/or sampled at temperature 0.7, top-p 0.9")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), type=_method,
                        help=f"from {', '.join(METHODS)}, or hf_spec_k<N> (ours with k = N), hf_spec_tree<N> (a "
                             "tree of N draft tokens, k deep), hf_spec_suffix<N> (suffix matching, N tokens), "
                             "hf_spec_tree_auto / hf_spec_suffix_auto (num_tree_nodes='auto'); <method>_token: ours "
                             "with the token-wise acceptance rule; target_only always runs")
    parser.add_argument("--variants", nargs="+", default=[], choices=SCHEMES,
                        help="also run every method on the target quantized with each scheme (<method>@<scheme>)")
    parser.add_argument("--draft-variants", nargs="+", default=[], metavar="DRAFT",
                        help="also run every method that uses a draft with each of these drafts (built-in name or "
                             "folder: a draft model or a draft head; <method>@<folder name>)")
    parser.add_argument("--draft-vocab-variants", nargs="+", type=vocab_variant, default=[], metavar="N[:text]",
                        help="also run every method that uses a draft with the draft's output layer cut to N ids, "
                             "ranked on the target's continuations of --draft-vocab-corpus (<method>@vocab<N>), or "
                             "with :text on the corpus's counts alone (<method>@vocab<N>-text)")
    parser.add_argument("--kernel-baselines", nargs="*", default=list(KERNEL_LABELS), choices=KERNEL_LABELS,
                        help="target-only decoding beside the optimized pair on another copy of the target: as loaded "
                             "(stock) and on the path fastest for steps (steps)")
    parser.add_argument("--prompts", type=positive_int, default=4, help="prompts per workload")
    parser.add_argument("--max-new-tokens", "--max-tokens", type=positive_int, default=128,
                        help="tokens to generate per prompt")
    parser.add_argument("--min-new-tokens", type=positive_int, default=None,
                        help="no end of text before this many new tokens, in every method's calls: with the same "
                             "value as --max-new-tokens, sampled calls of every method decode texts of one length "
                             "(a short completion, which pays its prefill over few tokens, then weighs on no method "
                             "alone)")
    parser.add_argument("--offset", type=int, default=0,
                        help="skip this many prompts of each workload (hold out what a draft was trained on)")
    parser.add_argument("--repeats", type=positive_int, default=1, help="calls per prompt and method")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                        help="profile hf_spec's loop, where each call's time goes (default: on a CPU; on a GPU it "
                             "synchronizes the device at each step)")
    parser.add_argument("--plot", default="bench.png", metavar="PATH", help="the plot (PNG; needs matplotlib)")
    parser.add_argument("--no-plot", action="store_true", help="no plot (matplotlib is then not needed)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--first-call", choices=("shared", "fresh"), default=None,
                        help="time each method's first call in a fresh process instead (one subprocess per method and "
                             "prompt; loading not timed): 'shared' keeps probed costs between processes as a user's "
                             "machine does, 'fresh' starts every process without them (hf_spec's first run)")
    peer_arguments(parser)
    parser.set_defaults(run=run)


def peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The peers run beside hf_spec's methods: OpenVINO GenAI and llama.cpp (`hf_spec.bench.peers`)."""
    parser.add_argument("--openvino", nargs="+", default=[], type=openvino_pair, metavar="LABEL=TARGET[,DRAFT]",
                        help="also run OpenVINO GenAI on these folders exported by `optimum-cli export openvino`: "
                             "openvino_<LABEL> (the target alone) and openvino_<LABEL>_k<k> (with the draft), "
                             "interleaved with the other methods (needs --openvino-python)")
    parser.add_argument("--openvino-python", metavar="PYTHON", default=None,
                        help="the Python of an environment with openvino-genai (docs/benchmark.md)")
    parser.add_argument("--llama-cpp", metavar="BIN_DIR", default=None,
                        help="also run llama.cpp's llama-completion (llamacpp) and llama-speculative-simple "
                             "(llamacpp_k<k>) from this folder on the pair's GGUF files (the built-in pair's as "
                             "shipped; greedy settings), interleaved with the other methods (docs/benchmark.md)")


def openvino_pair(text: str) -> tuple[str, tuple[str, str | None]]:
    """``LABEL=TARGET[,DRAFT]`` -> (label, (target folder, draft folder or None))."""
    label, _, folders = text.partition("=")
    target, _, draft = folders.partition(",")
    if not label or not target or not label.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"must be LABEL=TARGET_FOLDER[,DRAFT_FOLDER] with a plain label, got {text}")
    return label, (target, draft or None)


def run(args: argparse.Namespace) -> int:
    check_writable(args.output, "--output")
    if not args.no_plot:
        check_writable(args.plot, "--plot")
    if args.min_new_tokens is not None and args.min_new_tokens > args.max_new_tokens:
        raise ValueError(f"--min-new-tokens {args.min_new_tokens}: more than --max-new-tokens {args.max_new_tokens}.")
    if args.first_call:
        return run_first(args)
    if args.quantize in args.variants:
        raise ValueError(f"--variants {args.quantize}: the target itself is already loaded with --quantize "
                         f"{args.quantize}.")
    if not args.no_plot:
        require("matplotlib", "cli", "hf-spec bench's plot (or pass --no-plot)")
    if bool(args.openvino) != bool(args.openvino_python):
        raise ValueError("--openvino and --openvino-python go together: the folders to run, and the Python that has "
                         f"openvino-genai (got --openvino {args.openvino} --openvino-python {args.openvino_python}).")
    threads = args.threads or torch.get_num_threads()
    peers = [OpenVINOPeer(args.openvino_python, dict(args.openvino), threads)] if args.openvino else []
    if args.llama_cpp:
        peers.append(LlamaCppPeer(args.llama_cpp, str(gguf_file(args.target)),
                                  str(gguf_file(args.draft)), threads))
    peer = None if not peers else peers[0] if len(peers) == 1 else Peers(peers)
    pair = load_models(args)
    if args.kernel_baselines and getattr(pair.target.config, "quantization_config", None) is not None:
        log(f"--kernel-baselines {' '.join(args.kernel_baselines)}: not run, the target is quantized "
            f"({getattr(pair.target, 'hf_spec_weight_only', None) or 'another library'}); they are target-only "
            "decoding of the float target on other kernels (--quantize none runs it)")
    workloads = tuple(dict.fromkeys(args.workloads))
    if args.target == TINY:
        inputs = random_workloads(workloads, args.prompts, TINY_VOCAB_SIZE, seed=args.seed)
    else:
        try:
            inputs = text_workloads(pair.tokenizer, workloads, args.prompts, args.offset)
        except ValueError as error:
            raise ValueError(f"--prompts/--offset: {error}") from None
    methods = tuple(dict.fromkeys(["target_only", *args.methods]))
    variants = bench_variants(pair, args.target, quantized=tuple(args.variants), drafts=tuple(args.draft_variants),
                              draft_vocab_sizes=tuple(args.draft_vocab_variants),
                              draft_vocab_corpus=args.draft_vocab_corpus,
                              kernel_baselines=tuple(args.kernel_baselines), optimize=not args.no_optimize,
                              seed=args.seed)
    methods = (*methods, *(f"{method}@{label}" for label, variant in variants.items() if label not in KERNEL_LABELS
                           for method in methods if runs_on(method_spec(method, 1), variant)),
               *(f"target_only@{label}" for label in variants if label in KERNEL_LABELS))
    report = run_benchmark(
        pair.target, pair.draft, inputs, settings=bench_settings(args.settings, args.min_new_tokens),
        methods=methods, variants=variants, num_draft_tokens=args.num_assistant_tokens,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, seed=args.seed, progress=not args.no_progress,
        tokenizer=pair.tokenizer, profile=args.profile, draft_tokenizer=pair.draft_tokenizer, peer=peer,
    )
    report["config"].update(target=args.target, draft=args.draft, offset=args.offset,
                            draft_quantization=getattr(pair.draft, "hf_spec_weight_only", None)
                            or (None if args.quantize_draft in ("auto", "none") else args.quantize_draft),
                            cpu_paths={role: None if path is None else dataclasses.asdict(path)
                                       for role, path in (("target", pair.target_path), ("draft", pair.draft_path))})
    if not args.no_plot:
        plot(report, args.plot)
        log(f"wrote {args.plot}")
    emit(args, report, format_table(report))
    return 0


def run_first(args: argparse.Namespace) -> int:
    """``--first-call``: each method's first call in a fresh process (`hf_spec.bench.first_call`)."""
    unused = {"--variants": args.variants, "--draft-variants": args.draft_variants,
              "--draft-vocab-variants": args.draft_vocab_variants,
              "--quantize": args.quantize != "auto", "--quantize-draft": args.quantize_draft != "auto",
              "--draft-vocab": args.draft_vocab, "--no-optimize": args.no_optimize, "--repeats": args.repeats != 1,
              "--openvino": args.openvino}
    given = [name for name, value in unused.items() if value]
    if given:
        raise ValueError(f"--first-call times one call per process of the main pair as load_pair loads it; it does "
                         f"not take {', '.join(given)}.")
    report = run_first_calls(args.target, args.draft, tuple(args.methods), tuple(dict.fromkeys(args.workloads)),
                             tuple(args.settings), args.prompts, num_draft_tokens=args.num_assistant_tokens,
                             max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                             dtype=args.dtype, threads=args.threads,
                             offset=args.offset, seed=args.seed, store=args.first_call,
                             kernel_baselines=tuple(dict.fromkeys(args.kernel_baselines)),
                             progress=not args.no_progress)
    emit(args, report, format_first_calls(report))
    return 0


def bench_settings(names: list[str], min_new_tokens: int | None) -> dict[str, dict]:
    """The ``--settings`` by name (`SETTINGS`), each with ``min_new_tokens`` where given."""
    extra = {} if min_new_tokens is None else {"min_new_tokens": min_new_tokens}
    return {name: {**SETTINGS[name], **extra} for name in dict.fromkeys(names)}

