"""What the default exact rules gain over token-by-token acceptance on real drafts, without the noise of sampled
texts: block verification on chains, traversal verification on trees (``--trees``).

Sampled calls draw different texts, so two rules' tokens per pass differ by chance more than by rule. Here one set
of sampled calls runs with the default rules (`hf_spec.verification.BLOCK`), wrapped so that every round's draft,
draft laws q and target laws p are recorded, and each rule's *expected* accepted tokens on those same drafts is
computed exactly:

- chains, token by token: sum over j of prod_{i <= j} min(1, p_i(x_i) / q_i(x_i));
- chains, block verification: sum over i of i P(tau = i), P(tau = i) = h_i prod_{j > i} (1 - h_j)
  (`hf_spec.rejection.block_laws`);
- trees, node by node and by traversal: `hf_spec.evaluation.exactness.expected_tree_depths`.

    python scripts/verification_gain.py --workloads code prose --prompts 4 --max-new-tokens 64 --threads 2
    python scripts/verification_gain.py --trees 8 16 --depth 5 --workloads code prose --prompts 4 --threads 2

prints a Markdown table and writes ``--output`` (JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import hf_spec
from hf_spec.bench.workloads import text_workloads
from hf_spec.evaluation.exactness import expected_tree_depths
from hf_spec.rejection import block_laws
from hf_spec.verification import BLOCK


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


def recording_rules(recorded: list) -> hf_spec.verification.Verification:
    """The default rules, recording each sampled draft's expected accepted tokens under both rules first: chains as
    ``([rows] token-wise, [rows] block)``, trees as ``(node by node, traversal)`` floats."""
    def chain(draft_ids, draft_probs, target_probs, generator=None):
        if draft_ids.shape[1]:
            token, block = expected_accepted(draft_ids, draft_probs, target_probs)
            recorded.extend(zip(token.tolist(), block.tolist(), strict=True))
        return BLOCK.chain(draft_ids, draft_probs, target_probs, generator)

    def tree(token_ids, parents, draft_probs, target_probs, generator=None):
        recorded.append(expected_tree_depths(token_ids, parents, draft_probs, target_probs))
        return BLOCK.tree(token_ids, parents, draft_probs, target_probs, generator)

    return dataclasses.replace(BLOCK, chain=chain, tree=tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["code", "prose"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5], help="chains: tokens per round")
    parser.add_argument("--trees", type=int, nargs="+", default=None,
                        help="trees of these many nodes (num_tree_nodes) instead of chains")
    parser.add_argument("--depth", type=int, default=5, help="trees: num_assistant_tokens, the deepest a tree grows")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = hf_spec.load_pair()
    workloads = text_workloads(pair.tokenizer, tuple(args.workloads), args.prompts)
    recorded: list = []
    rules = recording_rules(recorded)
    sizes = [{"num_tree_nodes": n, "num_assistant_tokens": args.depth} for n in args.trees] if args.trees else [
        {"num_assistant_tokens": k} for k in args.ks]
    rows = []
    for name, prompts in workloads.items():
        for temperature in args.temperatures:
            settings = {"do_sample": True, "temperature": temperature, **({"top_p": 0.9} if temperature < 1 else {})}
            for size in sizes:
                recorded.clear()
                for index, prompt in enumerate(prompts):
                    torch.manual_seed(index)
                    pair.target.generate(**prompt, assistant_model=pair.draft, max_new_tokens=args.max_new_tokens,
                                         verification=rules, **size, **settings)
                token = sum(t for t, _ in recorded) / max(len(recorded), 1)
                default = sum(b for _, b in recorded) / max(len(recorded), 1)
                rows.append({"workload": name, "settings": settings, **size, "drafts": len(recorded),
                             "token_wise": token, "default": default, "gain": default - token})
    size_name, rule = ("nodes", "traversal") if args.trees else ("k", "block verification")
    print(f"| workload | sampling | {size_name} | drafts | expected accepted, token by token | {rule} | gain |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        sampling = f"T {row['settings']['temperature']}" + (", top-p 0.9" if "top_p" in row["settings"] else "")
        size = row.get("num_tree_nodes", row["num_assistant_tokens"])
        print(f"| {row['workload']} | {sampling} | {size} | {row['drafts']} | {row['token_wise']:.3f} | "
              f"{row['default']:.3f} | {row['gain']:+.3f} |")
    if args.output:
        with open(args.output, "w") as file:
            json.dump(rows, file, indent=2)


if __name__ == "__main__":
    main()
