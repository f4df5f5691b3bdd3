"""Do real rounds keep what teacher forcing predicts? Per block position, on the built-in pair, sampled.

    python scripts/realized_reach.py --k 5 --prompts 6 --workload prose

Each prompt is decoded once with a fixed k (64 new tokens, temperature 0.7, top-p 0.9, token-wise verification),
recording every round's accepted count and reach (`hf_spec.rejection`, ``with_reach=True``). The emitted texts are
then scored by teacher forcing (`hf_spec.evaluation.draft_fit.evaluate_draft`: 1 - TV(p, q) at each text position),
and for every round of k tokens that starts at text position t, the prediction for keeping at least j tokens is the
product of the first j positions' acceptance from t. The three rows printed, P(keep >= j) averaged over rounds from
the reach, from the counts drawn and from teacher forcing, agree where the draft proposes each block position as
teacher forcing scores it; a drafter that loses context deep in a block (a stale cache after a catch-up, say) would
keep fewer tokens there than predicted, while its output stays exact.
"""

from __future__ import annotations

import argparse

import torch

import hf_spec
from hf_spec.bench.workloads import text_workloads
from hf_spec.evaluation.draft_fit import evaluate_draft
from hf_spec.sizing.draft_length import FixedDraftLength

SETTINGS = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--workload", default="prose", choices=("code", "prose", "edit"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = hf_spec.load_pair()
    prompts = text_workloads(pair.tokenizer, (args.workload,), args.prompts)[args.workload]
    rounds: list[list[tuple[int, int, list[float]]]] = []

    def recording_update(self, num_draft_tokens, num_accepted, *timings, reach=None, **kwargs):
        rounds[-1].append((num_draft_tokens, num_accepted[0], reach[0]))

    FixedDraftLength.update = recording_update  # a fixed k learns nothing: this process only records
    texts = []
    for index, prompt in enumerate(prompts):
        rounds.append([])
        output = pair.target.generate(
            **prompt, assistant_model=pair.draft, num_assistant_tokens=args.k, max_new_tokens=64,
            min_new_tokens=64, verification="token", generator=torch.Generator().manual_seed(index), **SETTINGS)
        texts.append(output[:, prompt["input_ids"].shape[1]:])
    scored = evaluate_draft(pair.target, pair.draft, [prompt["input_ids"] for prompt in prompts], texts, SETTINGS,
                            progress=False)
    sums = {"reach": [0.0] * (args.k + 1), "counts": [0.0] * (args.k + 1), "teacher-forced": [0.0] * (args.k + 1)}
    num_rounds = 0
    for along, calls_rounds in zip(scored.acceptance_along_text, rounds):
        start = 0
        for num_drafted, accepted, reach in calls_rounds:
            if num_drafted == args.k and start + args.k <= len(along):
                num_rounds += 1
                predicted = 1.0
                for j in range(args.k + 1):
                    sums["reach"][j] += reach[j]
                    sums["counts"][j] += accepted >= j
                    sums["teacher-forced"][j] += predicted
                    predicted *= along[start + j] if j < args.k else 1.0
            start += accepted + 1
    print(f"{args.workload}, k = {args.k}: {num_rounds} rounds of {args.prompts} texts; "
          f"P(keep >= j), j = 0 .. {args.k}")
    for name, values in sums.items():
        print(f"  {name:15} " + " ".join(f"{value / max(1, num_rounds):.3f}" for value in values))


if __name__ == "__main__":
    main()
