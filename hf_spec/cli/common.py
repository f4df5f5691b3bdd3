"""What every ``hf-spec`` subcommand shares: its options (each with help text and its default), checked before any
model is loaded, loading the pair, and one output convention.

Output: human-readable text on stdout; with ``--json``, the report as one JSON document on stdout and nothing else
there; ``--output PATH`` also writes it to a file (checked to be writable before any work). Logs, progress bars and
what was loaded go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from hf_spec.loading.pair import DTYPES, TINY, Pair, load_pair
from hf_spec.loading.pretrained import DEFAULT_DRAFT, DEFAULT_TARGET
from hf_spec.loading.quantization import SCHEMES
from hf_spec.loading.vocabulary import COUNTED_ON
from hf_spec.sizing.draft_length import DEFAULT_NUM_DRAFT_TOKENS

# --- argparse types: each refuses a bad value by name, before any work ----------------------------------------------


def positive_int(text: str) -> int:
    """A positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def temperature(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0: greedy), got {text}")
    return value


def top_p(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def top_k(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0: no top-k), got {text}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0: no top-k), got {text}")
    return value


def draft_tokens(text: str) -> int | str:
    """``-k``: a positive integer or ``auto``."""
    return text if text == "auto" else positive_int(text)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text}") from None


# --- option groups ---------------------------------------------------------------------------------------------------


def target_arguments() -> argparse.ArgumentParser:
    """Which target, in what dtype and on which kernels, on how many threads."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("target")
    group.add_argument("--target", default=DEFAULT_TARGET,
                       help=f"built-in name, local folder or Hub id; {TINY!r} for the random tiny pair")
    group.add_argument("--dtype", default="fastest", choices=DTYPES,
                       help="weights: fastest (bf16 where the hardware multiplies it natively, else float32), auto "
                            "(the checkpoint's own, as in transformers; the built-in models are stored in float32), "
                            "or a dtype")
    group.add_argument("--no-optimize", action="store_true",
                       help="keep transformers' stock CPU kernels (default: each model on its fastest forward path, "
                            "chosen by measurement)")
    group.add_argument("--quantize", default="auto", choices=(*SCHEMES, "auto", "none"),
                       help="the target's linear layers quantized: int8 / int4 weight-only on torch's CPU kernels, "
                            "bitsandbytes' 8bit / nf4 / fp4 (the rest in --dtype), or gguf: a built-in model's GGUF "
                            "file's own blocks; auto: gguf for a built-in model where it measured fastest (AVX2-only "
                            "CPUs), else none")
    group.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    group.add_argument("--seed", type=int, default=0, help="seeds sampling and the tiny pair's weights")
    return parser


def draft_arguments() -> argparse.ArgumentParser:
    """Which draft, how much it drafts, and its output layer."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("draft")
    group.add_argument("--draft", "--draft-model", default=DEFAULT_DRAFT,
                       help="as --target, or a folder with a draft head trained for the target")
    group.add_argument("--num-assistant-tokens", "-k", type=draft_tokens, default=DEFAULT_NUM_DRAFT_TOKENS,
                       help="draft tokens per round, or auto (chosen every round from measured acceptance and costs)")
    group.add_argument("--quantize-draft", default="auto", choices=(*SCHEMES, "auto", "none"),
                       help="as --quantize, for the draft; auto: int8 where its int8 layers run hf_spec's rows kernel "
                            "(bf16 on AVX512-BF16 CPUs), else none (the draft as loaded)")
    group.add_argument("--draft-vocab", type=positive_int, default=None, metavar="N",
                       help="keep only the draft's N most frequent output ids (FR-Spec; exact: q = 0 elsewhere)")
    group.add_argument("--draft-vocab-corpus", default="stdlib",
                       help="texts ranking the ids for --draft-vocab: humaneval, humaneval-solutions, stdlib or a file")
    group.add_argument("--draft-vocab-counts", choices=COUNTED_ON, default="continuations",
                       help="rank the ids by how often the target emits them continuing the corpus's texts (then by "
                            "the corpus's counts), or by the corpus's counts alone")
    return parser


def decoding_arguments(max_new_tokens: int = 128) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("decoding")
    group.add_argument("--max-new-tokens", "--max-tokens", type=positive_int, default=max_new_tokens,
                       help="tokens to generate per prompt")
    group.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    group.add_argument("--temperature", "--temp", type=temperature, default=None,
                       help="sampling temperature (default: the model's generation config)")
    group.add_argument("--top-k", type=top_k, default=None, help="keep the k most likely tokens (0: all)")
    group.add_argument("--top-p", type=top_p, default=None, help="keep the smallest set of mass top-p")
    return parser


def text_arguments() -> argparse.ArgumentParser:
    """The texts a subcommand works on (eval-draft, distill, train-head)."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("texts")
    group.add_argument("--dataset", default="humaneval",
                       help="humaneval (prompts), humaneval-solutions (prompt + canonical solution), stdlib, or a "
                            ".json/.jsonl/.csv/.parquet/.txt file")
    group.add_argument("--column", default=None,
                       help="the file's column of texts (default: text for .txt, else prompt)")
    group.add_argument("--offset", type=int, default=0, help="skip this many texts (hold out what you trained on)")
    group.add_argument("--num-texts", type=positive_int, default=16, help="texts to use")
    return parser


def output_arguments(default_output: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("output")
    group.add_argument("--json", action="store_true",
                       help="print the report as JSON on stdout (and nothing else there; logs go to stderr)")
    group.add_argument("--output", default=default_output, metavar="PATH", help="also write the JSON report here")
    return parser


# --- running a subcommand --------------------------------------------------------------------------------------------


def log(*parts) -> None:
    """A line for the person at the terminal: on stderr, so stdout stays the command's output."""
    print(*parts, file=sys.stderr, flush=True)


def check_writable(path: str | None, flag: str) -> None:
    """Refuse, before any work, an output path whose folder does not exist or cannot be written."""
    if path is None:
        return
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist.")
    try:  # a probe file of its own: several processes (``accelerate launch``) may check one folder at once
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hf_spec_write_check_"):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot write there ({error.strerror}).") from None


def prepare_folder(path: str, flag: str) -> Path:
    """Create an output folder (and its parents) before any work; an error naming ``flag`` when it cannot be."""
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot create it ({error.strerror}).") from None
    check_writable(str(folder / "config.json"), flag)
    return folder


def training_processes():
    """The processes of a training command (``accelerate.PartialState``), set up as `transformers.Trainer` will be:
    on a machine without CUDA, ``cpu=True``. Without it, under ``accelerate launch --num_processes 2`` on a CPU the
    state says one process (``DistributedType.NO``) until the Trainer starts, so ``main_process_first()`` before it
    let both processes write the same cache at once."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def load_models(args: argparse.Namespace, draft_dtype: torch.dtype | None = None, optimize: bool = True) -> Pair:
    """The pair the options name (`hf_spec.loading.load_pair`), on its fastest CPU paths unless ``--no-optimize``
    (or ``optimize=False``: a draft that trains keeps plain layers); what was loaded is logged."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    quantize = None if args.quantize == "none" else args.quantize
    pair = load_pair(args.target, args.draft, dtype=args.dtype, quantize=quantize,
                     quantize_draft=None if args.quantize_draft == "none" else args.quantize_draft,
                     draft_dtype=draft_dtype, seed=args.seed,
                     optimize=optimize and not args.no_optimize, draft_vocab=args.draft_vocab,
                     draft_vocab_corpus=args.draft_vocab_corpus, draft_vocab_counts=args.draft_vocab_counts)
    if pair.target.name_or_path in ("", TINY):
        log("built-in tiny pair: random-weight Llama target and a perturbed copy as draft (random text)")
    log(pair.describe())
    return pair


def sampling(args: argparse.Namespace) -> dict:
    """``generate()`` settings from ``--do-sample``, ``--temperature``, ``--top-k``, ``--top-p``."""
    names = [name for name in ("temperature", "top_k", "top_p") if getattr(args, name, None) is not None]
    return {"do_sample": args.do_sample, **{name: getattr(args, name) for name in names}}


def texts(args: argparse.Namespace) -> list[str]:
    """The texts ``--dataset``, ``--column``, ``--offset`` and ``--num-texts`` select."""
    from hf_spec.loading.corpora import load_texts

    column = args.column or ("text" if args.dataset.endswith(".txt") else "prompt")
    try:
        return load_texts(args.dataset, column, args.offset, args.num_texts)
    except ValueError as error:
        raise ValueError(f"--dataset: {error}") from None


def prompts(args: argparse.Namespace, tokenizer) -> list[torch.Tensor]:
    """``[1, S]`` token ids of the selected texts (random ids for the tiny pair)."""
    if args.target == TINY:
        from hf_spec.bench.workloads import random_workloads
        from hf_spec.loading.tiny import TINY_VOCAB_SIZE

        workloads = random_workloads(("tiny",), args.num_texts, TINY_VOCAB_SIZE, seed=args.seed + args.offset)
        return [inputs["input_ids"] for inputs in workloads["tiny"]]
    return [tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"] for text in texts(args)]


def emit(args: argparse.Namespace, report: dict, text: str | None = None) -> None:
    """The command's result: JSON on stdout with ``--json``, else ``text`` (when given); ``--output`` also gets the
    JSON."""
    document = json.dumps(report, indent=2, default=str)
    if args.output:
        Path(args.output).expanduser().write_text(document)
        log(f"wrote {args.output}")
    stream = getattr(args, "report_stream", None) or sys.stdout
    if args.json:
        print(document, file=stream, flush=True)
    elif text is not None:
        print(text, file=stream, flush=True)
