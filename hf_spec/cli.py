"""The ``hf-spec`` command (also ``python -m hf_spec``): all command-line parsing lives here."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers.generation.streamers import BaseStreamer

from hf_spec.models import TINY_VOCAB_SIZE, build_tiny_pair
from hf_spec.validation import DEFAULT_NUM_DRAFT_TOKENS


class _IdStreamer(BaseStreamer):
    """Prints generated token ids as they arrive (the built-in pair has no tokenizer)."""

    def __init__(self):
        self.is_prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self.is_prompt:  # generate() streams the prompt first
            self.is_prompt = False
            return
        print(" ".join(str(token) for token in value.reshape(-1).tolist()), end=" ", flush=True)

    def end(self) -> None:
        print(flush=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-spec", description="Exact speculative decoding for transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser(
        "generate",
        help="speculative generation on the built-in pair, with statistics and a target-only comparison",
    )
    generate.add_argument("--prompt-ids", default="1 2 3 4 5", help="space-separated token ids (default: %(default)s)")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--num-assistant-tokens", "-k", type=int, default=DEFAULT_NUM_DRAFT_TOKENS)
    generate.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    generate.add_argument("--temperature", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--seed", type=int, default=0, help="seeds the models and the sampling generator")
    generate.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    generate.add_argument("--json", action="store_true", help="print the statistics as JSON")
    return parser.parse_args(argv)


def _prompt_ids(text: str) -> torch.Tensor:
    try:
        ids = [int(token) for token in text.split()]
    except ValueError:
        raise SystemExit(f"--prompt-ids must be space-separated integers, got {text!r}") from None
    if not ids or not all(0 <= i < TINY_VOCAB_SIZE for i in ids):
        raise SystemExit(f"--prompt-ids must be 1 or more ids in [0, {TINY_VOCAB_SIZE}), got {text!r}")
    return torch.tensor([ids])


def _generate(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    prompt = _prompt_ids(args.prompt_ids)
    target, draft = build_tiny_pair(seed=args.seed)
    settings = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.do_sample,
        **{name: getattr(args, name) for name in ("temperature", "top_k", "top_p") if getattr(args, name) is not None},
    }
    print("built-in pair: random-weight Llama target and a perturbed copy as draft (no meaningful text)")
    started = time.perf_counter()
    output = target.generate(
        prompt, assistant_model=draft, num_assistant_tokens=args.num_assistant_tokens, streamer=_IdStreamer(),
        generator=torch.Generator().manual_seed(args.seed), return_dict_in_generate=True, **settings,
    )
    speculative_seconds = time.perf_counter() - started
    started = time.perf_counter()
    target_only_ids = target.generate(prompt, **settings)
    target_only_seconds = time.perf_counter() - started

    stats = output.speculative_stats
    num_new = output.sequences.shape[1] - prompt.shape[1]
    report = {
        **stats.to_dict(),
        "new_tokens": num_new,
        "speculative_tokens_per_second": num_new / speculative_seconds,
        "target_only_tokens_per_second": (target_only_ids.shape[1] - prompt.shape[1]) / target_only_seconds,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(stats)
        print(
            f"tokens/s: speculative {report['speculative_tokens_per_second']:.1f}, target only "
            f"{report['target_only_tokens_per_second']:.1f} (same settings, {args.threads} thread(s))"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    return {"generate": _generate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
