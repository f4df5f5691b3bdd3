"""The table of docs/conditioned.md: encoder-decoder and vision-language targets (`hf_spec.evaluation.conditioned`),
each checked with its drafts against the target's own greedy `generate()`, and transformers' assisted generation.

    python scripts/conditioned_table.py
"""

from __future__ import annotations

import logging
import warnings

import torch


def main() -> None:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    from hf_spec.evaluation.conditioned import CASES, NEW_TOKENS, check_case, check_transformers_assisted

    print(f"| target | draft | hf_spec, ragged batch of 2 | target passes for {NEW_TOKENS} tokens a row | "
          "encoder passes | transformers, first row |")
    print("|---|---|---|---|---|---|")
    for name in CASES:
        result, theirs = check_case(name), check_transformers_assisted(name)
        for draft, equal in result.equal.items():
            print(f"| {name} | {draft} | {'equal' if equal else 'DIFFERS'} | {result.target_passes[draft]} | "
                  f"{result.encoder_passes[draft]} | {theirs if draft == next(iter(result.equal)) else ''} |")


if __name__ == "__main__":
    main()
