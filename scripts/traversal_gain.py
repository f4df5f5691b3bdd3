"""What traversal verification gains over node-by-node rejection on real draft trees, without the noise of sampled
texts.

Sampled calls draw different texts, so two methods' tokens per pass differ by chance more than by rule. Here one set
of sampled tree calls runs (traversal verification, the default); every round's tree, its draft laws and the
target's laws are recorded, and each rule's *expected* accepted depth on those same trees is computed exactly
(`hf_spec.evaluation.exactness.expected_tree_depths`).

    python scripts/traversal_gain.py --workloads code prose --prompts 4 --max-new-tokens 64 --threads 2

prints a Markdown table and writes ``--output`` (JSON).
"""

from __future__ import annotations

import argparse
import json

import torch

import hf_spec
import hf_spec.rounds
from hf_spec.bench.workloads import text_workloads
from hf_spec.evaluation.exactness import expected_tree_depths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["code", "prose"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--depth", type=int, default=5, help="num_assistant_tokens: the deepest a tree grows")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = hf_spec.load_pair()
    workloads = text_workloads(pair.tokenizer, tuple(args.workloads), args.prompts)
    recorded = []
    original = hf_spec.rounds.accept_traversal

    def recording(token_ids, parents, draft_probs, target_probs, generator):
        recorded.append(expected_tree_depths(token_ids, parents, draft_probs, target_probs))
        return original(token_ids, parents, draft_probs, target_probs, generator)

    hf_spec.rounds.accept_traversal = recording
    rows = []
    for name, prompts in workloads.items():
        for temperature in args.temperatures:
            settings = {"do_sample": True, "temperature": temperature}
            if temperature < 1:
                settings["top_p"] = 0.9
            for nodes in args.nodes:
                recorded.clear()
                for index, prompt in enumerate(prompts):
                    torch.manual_seed(index)
                    pair.target.generate(**prompt, assistant_model=pair.draft, num_tree_nodes=nodes,
                                         num_assistant_tokens=args.depth, max_new_tokens=args.max_new_tokens,
                                         **settings)
                node_by_node = sum(n for n, _ in recorded) / max(len(recorded), 1)
                traversal = sum(t for _, t in recorded) / max(len(recorded), 1)
                rows.append({"workload": name, "settings": settings, "nodes": nodes, "depth": args.depth,
                             "trees": len(recorded), "node_by_node": node_by_node, "traversal": traversal,
                             "gain": traversal - node_by_node})
    print("| workload | sampling | nodes | trees | expected depth, node by node | traversal | gain |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        sampling = f"T {row['settings']['temperature']}" + (", top-p 0.9" if "top_p" in row["settings"] else "")
        print(f"| {row['workload']} | {sampling} | {row['nodes']} | {row['trees']} | {row['node_by_node']:.3f} | "
              f"{row['traversal']:.3f} | {row['gain']:+.3f} |")
    if args.output:
        with open(args.output, "w") as file:
            json.dump(rows, file, indent=2)


if __name__ == "__main__":
    main()
