"""Acceptance and tokens per target pass of the built-in tiny pair, for several k and decoding settings.

    python scripts/tiny_pair_stats.py [--max-new-tokens 256] [--seeds 3]

Random weights: these numbers describe the mechanics (how acceptance decays along the block, how many tokens a
target pass buys), not a speed-up on real models.
"""

from __future__ import annotations

import argparse

import torch

from hf_spec.loading.tiny import build_tiny_pair

SETTINGS = {"greedy": {"do_sample": False}, "T=0.7": {"do_sample": True, "temperature": 0.7}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=3, help="prompts (one per seed) for each setting")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft = build_tiny_pair()
    print("| setting | k | acceptance | tokens per target pass | rounds |")
    print("|---|---|---|---|---|")
    for name, settings in SETTINGS.items():
        for k in (1, 3, 5):
            accepted = proposed = emitted = rounds = 0
            for seed in range(args.seeds):
                prompt = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(seed))
                stats = target.generate(
                    prompt, assistant_model=draft, num_assistant_tokens=k, max_new_tokens=args.max_new_tokens,
                    generator=torch.Generator().manual_seed(seed), return_dict_in_generate=True, **settings,
                ).speculative_stats
                accepted += stats.num_accepted
                proposed += stats.num_draft_tokens
                emitted += stats.num_emitted
                rounds += stats.num_rounds
            print(f"| {name} | {k} | {accepted / proposed:.3f} | {emitted / rounds:.2f} | {rounds} |")


if __name__ == "__main__":
    main()
