"""``hf-spec eval-draft``: a draft's expected acceptance for its target, predicted tokens per pass and speed-up;
``--measure`` also runs speculative generation."""

from __future__ import annotations

import argparse
import dataclasses

from hf_spec.cli.common import load_models, prompts, sampling, text_arguments, write_report
from hf_spec.drafting.costs import measure_costs
from hf_spec.evaluation.continuations import target_continuations
from hf_spec.evaluation.draft_fit import evaluate_draft, measure_draft
from hf_spec.plan import make_drafter


def add_parser(commands, shared: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "eval-draft", parents=[shared, text_arguments()],
        help="expected acceptance of a draft (1 - TV per position on the target's continuations), predicted "
             "tokens per pass and speed-up; --measure also runs speculative generation",
    )
    parser.add_argument("--cost-ratio", type=float, default=None,
                        help="draft step / target step, for the predicted speed-up (default: measured)")
    parser.add_argument("--measure", action="store_true", help="also run speculative generation with -k")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    pair = load_models(args)
    texts = prompts(args, pair.tokenizer)
    settings = sampling(args)
    continuations = target_continuations(pair.target, texts, args.max_new_tokens, settings, seed=args.seed)
    cost_ratio, costs = args.cost_ratio, None
    if cost_ratio is None:
        costs = measure_costs(pair.target, make_drafter(pair.draft), texts[0], [args.num_assistant_tokens + 1])
        cost_ratio = costs.cost_ratio
    predicted = evaluate_draft(pair.target, pair.draft, texts, continuations, settings, cost_ratio=cost_ratio)
    report = {"predicted": dataclasses.asdict(predicted), "cost_ratio": cost_ratio,
              "texts": {"dataset": args.dataset, "offset": args.offset, "count": len(texts)}}
    if costs is not None:
        report["block_cost"] = costs.block_cost(args.num_assistant_tokens)
    if args.measure:
        report["measured"] = measure_draft(pair.target, pair.draft, texts, args.num_assistant_tokens,
                                           args.max_new_tokens, settings, seed=args.seed).to_dict()
    write_report(report, args.output)
    return 0
