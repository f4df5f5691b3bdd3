"""``hf-spec generate``: speculative generation with streamed output, statistics and tokens/s."""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import TextStreamer
from transformers.generation.streamers import BaseStreamer

from hf_spec.cli.common import load_models, positive_int
from hf_spec.loading.tiny import TINY_VOCAB_SIZE

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def add_parser(commands, shared: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "generate", parents=[shared], help="speculative generation with streamed output, statistics and tokens/s",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the text, sent as a chat message when the "
                        "tokenizer has a chat template (default: %(default)r)")
    parser.add_argument("--no-chat", action="store_true", help="send --prompt as plain text to complete")
    parser.add_argument("--prompt-ids", default="1 2 3 4 5", help="with --target tiny: space-separated ids")
    parser.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--num-tree-nodes", type=_tree_nodes, default=None,
                        help="draft a tree of at most this many tokens per round, at most -k deep ('auto': the "
                             "budget and branching chosen every round; default: a chain of k)")
    parser.add_argument("--compare", action="store_true", help="also time target-only generate, same settings")
    parser.add_argument("--json", action="store_true", help="print the statistics as JSON")
    parser.set_defaults(run=run)


def _tree_nodes(text: str) -> int | str:
    """argparse type of ``--num-tree-nodes``: a positive integer or ``auto``."""
    return text if text == "auto" else positive_int(text)


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


def _prompt_ids(text: str) -> torch.Tensor:
    try:
        ids = [int(token) for token in text.split()]
    except ValueError:
        raise SystemExit(f"--prompt-ids must be space-separated integers, got {text!r}") from None
    if not ids or not all(0 <= i < TINY_VOCAB_SIZE for i in ids):
        raise SystemExit(f"--prompt-ids must be 1 or more ids in [0, {TINY_VOCAB_SIZE}), got {text!r}")
    return torch.tensor([ids])


def _inputs_and_streamer(args: argparse.Namespace, tokenizer) -> tuple[dict, BaseStreamer]:
    if tokenizer is None:
        return {"input_ids": _prompt_ids(args.prompt_ids)}, _IdStreamer()
    text = args.prompt
    if tokenizer.chat_template and not args.no_chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    return dict(inputs), TextStreamer(tokenizer, skip_prompt=True)


def run(args: argparse.Namespace) -> int:
    pair = load_models(args)
    target, draft = pair.target, pair.draft
    inputs, streamer = _inputs_and_streamer(args, pair.tokenizer)
    settings = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.do_sample,
        **{name: getattr(args, name) for name in ("temperature", "top_k", "top_p") if getattr(args, name) is not None},
    }
    prompt_length = inputs["input_ids"].shape[1]
    started = time.perf_counter()
    output = target.generate(
        **inputs, assistant_model=draft, num_assistant_tokens=args.num_assistant_tokens, streamer=streamer,
        num_tree_nodes=args.num_tree_nodes, generator=torch.Generator().manual_seed(args.seed),
        return_dict_in_generate=True, **settings,
    )
    speculative_seconds = time.perf_counter() - started
    stats = output.speculative_stats
    num_new = output.sequences.shape[1] - prompt_length
    report = {
        **stats.to_dict(), "new_tokens": num_new, "speculative_tokens_per_second": num_new / speculative_seconds,
        "threads": torch.get_num_threads(), "dtype": str(target.dtype).removeprefix("torch."), "target": args.target,
        "draft": args.draft,
        "cpu_paths": {role: None if path is None else path.name
                      for role, path in (("target", pair.target_path), ("draft", pair.draft_path))},
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
    paths = report["cpu_paths"]
    print(f"{line}; {report['threads']} thread(s), {report['dtype']}, CPU paths: target {paths['target']}, "
          f"draft {paths['draft']}")
    return 0
