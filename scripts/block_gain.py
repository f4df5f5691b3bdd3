"""What block verification gains over token-wise acceptance on real drafts, without the noise of sampled texts.

Sampled calls draw different texts, so two methods' tokens per pass differ by chance more than by rule. Here one set
of sampled calls runs (block verification, the default), every round's draft block, draft laws q and target laws p
are recorded, and each rule's *expected* accepted tokens on those same blocks is computed exactly:

- token by token: sum over j of prod_{i <= j} min(1, p_i(x_i) / q_i(x_i));
- block verification: sum over i of i P(tau = i), P(tau = i) = h_i prod_{j > i} (1 - h_j)
  (`hf_spec.rejection.block_laws`).

    python scripts/block_gain.py --workloads code prose --prompts 4 --max-new-tokens 64 --threads 2

prints a Markdown table and writes ``--output`` (JSON).
"""

from __future__ import annotations

import argparse
import json

import torch

import hf_spec
import hf_spec.rounds
from hf_spec.bench.workloads import text_workloads
from hf_spec.rejection import block_laws


def expected_accepted(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``([batch], [batch])``: the expected accepted draft tokens of the token-wise rule and of block verification."""
    k = draft_ids.shape[1]
    p = target_probs[:, :k].gather(-1, draft_ids[..., None])[..., 0].double()
    q = draft_probs.gather(-1, draft_ids[..., None])[..., 0].double()
    token = torch.where(q > 0, (p / q.clamp_min(1e-300)).clamp(max=1.0), 0.0).cumprod(-1).sum(-1)
    stop, _ = block_laws(draft_ids, draft_probs, target_probs)
    chance = [stop[:, i] * (1 - stop[:, i + 1:]).prod(-1) for i in range(1, k + 1)]
    block = sum(i * c for i, c in zip(range(1, k + 1), chance, strict=True)) if k else torch.zeros_like(token)
    return token, block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["code", "prose"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = hf_spec.load_pair()
    workloads = text_workloads(pair.tokenizer, tuple(args.workloads), args.prompts)
    recorded = []
    original = hf_spec.rounds.accept_block

    def recording(draft_ids, draft_probs, target_probs, generator):
        if draft_ids.shape[1]:
            recorded.append(expected_accepted(draft_ids, draft_probs, target_probs))
        return original(draft_ids, draft_probs, target_probs, generator)

    hf_spec.rounds.accept_block = recording
    rows = []
    for name, prompts in workloads.items():
        for temperature in args.temperatures:
            settings = {"do_sample": True, "temperature": temperature}
            if temperature < 1:
                settings["top_p"] = 0.9
            for k in args.ks:
                recorded.clear()
                for index, prompt in enumerate(prompts):
                    torch.manual_seed(index)
                    pair.target.generate(**prompt, assistant_model=pair.draft, num_assistant_tokens=k,
                                         max_new_tokens=args.max_new_tokens, **settings)
                token = torch.cat([t for t, _ in recorded]).mean().item()
                block = torch.cat([b for _, b in recorded]).mean().item()
                rows.append({"workload": name, "settings": settings, "k": k, "rounds": len(recorded),
                             "token_wise": token, "block": block, "gain": block - token})
    print("| workload | sampling | k | rounds | expected accepted, token by token | block verification | gain |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        sampling = f"T {row['settings']['temperature']}" + (", top-p 0.9" if "top_p" in row["settings"] else "")
        print(f"| {row['workload']} | {sampling} | {row['k']} | {row['rounds']} | {row['token_wise']:.3f} | "
              f"{row['block']:.3f} | {row['gain']:+.3f} |")
    if args.output:
        with open(args.output, "w") as file:
            json.dump(rows, file, indent=2)


if __name__ == "__main__":
    main()
