"""What every ``hf-spec`` subcommand shares: the model options, loading the pair, the text options, reports."""

from __future__ import annotations

import argparse
import json

import torch

from hf_spec.drafting.draft_length import DEFAULT_NUM_DRAFT_TOKENS
from hf_spec.loading.corpora import load_texts
from hf_spec.loading.pair import TINY, Pair, load_pair
from hf_spec.loading.pretrained import DEFAULT_DRAFT, DEFAULT_TARGET
from hf_spec.loading.quantization import SCHEMES
from hf_spec.loading.tiny import TINY_VOCAB_SIZE


def positive_int(text: str) -> int:
    """argparse type: a positive integer."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def model_arguments() -> argparse.ArgumentParser:
    """Options shared by every subcommand: which models, in what dtype, on how many threads."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"built-in name, local folder or Hub id; {TINY!r} for the random tiny pair "
                             "(default: %(default)s)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="as --target (default: %(default)s)")
    parser.add_argument("--num-assistant-tokens", "-k", type=positive_int, default=DEFAULT_NUM_DRAFT_TOKENS,
                        help="draft tokens per round (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="model weights (default: auto, bf16 where it is native: a GPU, a CPU with AMX or "
                             "AVX512-BF16; float32 otherwise)")
    parser.add_argument("--no-optimize", action="store_true",
                        help="keep the models' stock CPU kernels (default: each model on its fastest forward path, "
                             "chosen by measurement; see hf_spec.loading.packed)")
    parser.add_argument("--quantize", default=None, choices=SCHEMES,
                        help="load the target's linear layers quantized by bitsandbytes (8bit, or 4-bit nf4/fp4; "
                             "the rest in --dtype), spread over the devices with device_map='auto'")
    parser.add_argument("--quantize-draft", default=None, choices=SCHEMES, help="as --quantize, for the draft")
    parser.add_argument("--draft-vocab", type=positive_int, default=None, metavar="N",
                        help="keep only the draft's N most frequent output ids (FR-Spec; exact: q = 0 elsewhere)")
    parser.add_argument("--draft-vocab-corpus", default="stdlib",
                        help="texts ranking the ids for --draft-vocab: humaneval, humaneval-solutions, stdlib or a "
                             "file (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the tiny pair and sampling")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    return parser


def text_arguments() -> argparse.ArgumentParser:
    """Options of the subcommands that work on a set of texts (eval-draft, distill)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dataset", default="humaneval",
                        help="humaneval (prompts), humaneval-solutions (prompt + canonical solution), stdlib, or a "
                             ".json/.jsonl/.csv/.parquet/.txt file (default: %(default)s)")
    parser.add_argument("--column", default=None,
                        help="the file's column of texts (default: text for .txt, else prompt)")
    parser.add_argument("--offset", type=int, default=0, help="skip this many texts (hold out what you trained on)")
    parser.add_argument("--num-texts", type=positive_int, default=16, help="texts to use (default: %(default)s)")
    parser.add_argument("--do-sample", action="store_true", help="sampling (default: greedy)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--output", default=None, help="write the JSON report here (default: print it)")
    return parser


def load_models(args: argparse.Namespace, draft_dtype: torch.dtype | None = None, optimize: bool = True) -> Pair:
    """The pair the options name (`hf_spec.loading.load_pair`), on its fastest CPU paths unless ``--no-optimize``
    (or ``optimize=False``: a draft that trains keeps plain layers); a bad pairing exits with the flags named."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        pair = load_pair(args.target, args.draft, dtype=dtype_of(args), quantize=args.quantize,
                         quantize_draft=args.quantize_draft, draft_dtype=draft_dtype, seed=args.seed,
                         optimize_kernels=optimize and not args.no_optimize, draft_vocab=args.draft_vocab,
                         draft_vocab_corpus=args.draft_vocab_corpus)
    except ValueError as error:
        raise SystemExit(f"--target {args.target} --draft {args.draft}: {error}") from None
    if pair.tokenizer is None:
        print("built-in tiny pair: random-weight Llama target and a perturbed copy as draft (no meaningful text)")
    print(pair.describe())
    return pair


def dtype_of(args: argparse.Namespace) -> torch.dtype | str:
    """``--dtype`` as `load_pair` takes it."""
    return "auto" if args.dtype == "auto" else getattr(torch, args.dtype)


def sampling(args: argparse.Namespace) -> dict:
    """``generate()`` settings from ``--do-sample``, ``--temperature``, ``--top-p``."""
    return {"do_sample": args.do_sample,
            **{name: getattr(args, name) for name in ("temperature", "top_p") if getattr(args, name) is not None}}


def texts(args: argparse.Namespace) -> list[str]:
    """The texts ``--dataset``, ``--column``, ``--offset`` and ``--num-texts`` select."""
    column = args.column or ("text" if args.dataset.endswith(".txt") else "prompt")
    try:
        return load_texts(args.dataset, column, args.offset, args.num_texts)
    except ValueError as error:
        raise SystemExit(f"--dataset: {error}") from None


def prompts(args: argparse.Namespace, tokenizer) -> list[torch.Tensor]:
    """``[1, S]`` token ids of the selected texts (random ids for the tiny pair)."""
    if tokenizer is None:
        from hf_spec.bench.workloads import random_workloads

        workloads = random_workloads(("tiny",), args.num_texts, TINY_VOCAB_SIZE, seed=args.seed + args.offset)
        return [inputs["input_ids"] for inputs in workloads["tiny"]]
    return [tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"] for text in texts(args)]


def write_report(report: dict, path: str | None) -> None:
    """The report as JSON, to ``path`` or to standard output."""
    text = json.dumps(report, indent=2, default=str)
    if path is None:
        print(text)
        return
    with open(path, "w") as out:
        out.write(text)
    print(f"wrote {path}")
