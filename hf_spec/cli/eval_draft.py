"""``hf-spec eval-draft``: a draft's expected acceptance for its target, predicted tokens per pass and speed-up;
``--measure`` also runs speculative generation."""

from __future__ import annotations

import argparse
import dataclasses

from hf_spec.cli.common import (
    check_writable,
    decoding_arguments,
    draft_arguments,
    emit,
    load_models,
    output_arguments,
    positive_float,
    prompts,
    sampling,
    target_arguments,
    text_arguments,
)
from hf_spec.extras import require_extra


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "eval-draft", parents=[target_arguments(), draft_arguments(), decoding_arguments(64), text_arguments(),
                               output_arguments()],
        help="expected acceptance of a draft (1 - TV per position on the target's continuations), predicted "
             "tokens per pass and speed-up; --measure also runs speculative generation",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--cost-ratio", type=positive_float, default=None,
                        help="draft step / target step, for the predicted speed-up (default: measured)")
    parser.add_argument("--measure", action="store_true", help="also run speculative generation with -k")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hf_spec.evaluation.continuations import target_continuations
    from hf_spec.evaluation.draft_fit import evaluate_draft, measure_draft
    from hf_spec.plan import make_drafter
    from hf_spec.timing.probe import measure_costs

    require_extra("train", "hf-spec eval-draft")
    if args.num_assistant_tokens == "auto" and args.measure:
        raise ValueError("-k auto: eval-draft --measure runs a fixed k; give a positive integer.")
    check_writable(args.output, "--output")
    pair = load_models(args)
    pair.check_same_tokenizer("eval-draft (which scores the draft on target ids)")
    texts = prompts(args, pair.tokenizer)
    settings = sampling(args)
    continuations = target_continuations(pair.target, texts, args.max_new_tokens, settings, seed=args.seed)
    cost_ratio, costs = args.cost_ratio, None
    k = 5 if args.num_assistant_tokens == "auto" else args.num_assistant_tokens
    if cost_ratio is None:
        costs = measure_costs(pair.target, make_drafter(pair.draft), texts[0], [k + 1])
        cost_ratio = costs.cost_ratio
    predicted = evaluate_draft(pair.target, pair.draft, texts, continuations, settings, cost_ratio=cost_ratio)
    report = {"predicted": dataclasses.asdict(predicted), "cost_ratio": cost_ratio,
              "texts": {"dataset": args.dataset, "offset": args.offset, "count": len(texts)}}
    if costs is not None:
        report["block_cost"] = costs.block_cost(k)
    if args.measure:
        report["measured"] = measure_draft(pair.target, pair.draft, texts, k, args.max_new_tokens, settings,
                                           seed=args.seed).to_dict()
    lines = [f"predicted acceptance {predicted.acceptance_rate:.3f} over {len(texts)} texts; cost ratio c = "
             f"{cost_ratio:.3f}"]
    if args.measure:
        lines.append(f"measured: {report['measured']}")
    emit(args, report, "\n".join(lines))
    return 0
