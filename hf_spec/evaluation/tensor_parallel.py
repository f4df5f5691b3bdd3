"""Speculation with a tensor-parallel target, checked on every rank: run under ``torchrun``.

    torchrun --nproc-per-node 2 -m hf_spec.evaluation.tensor_parallel --target DIR --draft DIR --output DIR

loads ``--target`` with ``tp_plan="auto"`` (gloo on CPU, NCCL on GPUs) and ``--draft`` replicated, then writes
``rank<r>.json`` per rank with: greedy speculation against the sharded target's own ``generate()`` on a ragged batch
(chains and a tree), ``--samples`` sampled rows of the first three tokens after ``--prompt`` (block verification,
and the broken rule `RESAMPLE_FROM_P` as the negative control) for the caller to fit against the target's law, what
a timed sizer gets (refused by name), and what one rank's perturbed random stream gets (raised by name on every
rank). ``tests/test_tensor_parallel.py`` runs it; so does ``scripts/device_check.sh`` on a machine with 2 GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from hf_spec.evaluation.exactness import RESAMPLE_FROM_P

#: The ragged batch of the greedy checks (left-padded with 0).
GREEDY_PROMPTS = [[3, 1, 2, 1, 3, 3, 2, 2], [2, 3, 1], [1, 2, 1, 3, 2, 1, 3, 1, 2, 2, 3, 1]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--prompt", type=int, nargs="+", default=[1, 3, 2])
    parser.add_argument("--samples", type=int, default=1500)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from hf_spec import speculative

    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else "cpu"
    target = speculative(AutoModelForCausalLM.from_pretrained(args.target, tp_plan="auto"))
    draft = AutoModelForCausalLM.from_pretrained(args.draft).to(device)
    torch.manual_seed(1000 + rank)  # each rank's own random state differs: the call must not depend on it
    report = {"rank": rank, "tp_size": target.tp_size}
    report["greedy"] = greedy_checks(target, draft, device, args.max_new_tokens)
    prompt = torch.tensor([args.prompt], device=device)
    for name, extra in (("law", {}), ("negative_control", {"verification": RESAMPLE_FROM_P})):
        rows = target.generate(prompt.expand(args.samples, -1), assistant_model=draft, do_sample=True, max_new_tokens=3,
                               min_new_tokens=3, num_assistant_tokens=2, pad_token_id=0, **extra)
        report[name] = rows[:, prompt.shape[1]:].tolist()
    report["refused"] = refusal(target, draft, prompt)
    report["perturbed"] = perturbed(target, draft, prompt, rank)
    Path(args.output).mkdir(parents=True, exist_ok=True)
    (Path(args.output) / f"rank{rank}.json").write_text(json.dumps(report))
    # every rank done before the group goes: a process group left to the interpreter's exit can abort it
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def greedy_checks(target, draft, device, max_new_tokens: int) -> dict:
    """Speculative greedy output (chains of 3 on a ragged batch; a tree of 6 nodes on its first row) and the sharded
    target's own, with the seconds each took."""
    width = max(map(len, GREEDY_PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in GREEDY_PROMPTS], device=device)
    mask = (torch.arange(width, device=device)[None] >= torch.tensor(
        [width - len(p) for p in GREEDY_PROMPTS], device=device)[:, None]).long()
    settings = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": 0}
    start = time.perf_counter()
    own = target.generate(ids, attention_mask=mask, **settings)
    own_seconds = time.perf_counter() - start
    start = time.perf_counter()
    chain = target.generate(ids, attention_mask=mask, assistant_model=draft, num_assistant_tokens=3, **settings)
    chain_seconds = time.perf_counter() - start
    one = ids[:1, width - len(GREEDY_PROMPTS[0]):]
    tree = target.generate(one, assistant_model=draft, num_tree_nodes=6, num_assistant_tokens=3, **settings)
    own_one = target.generate(one, **settings)
    return {"own": own.tolist(), "chain": chain.tolist(), "own_first_row": own_one.tolist(), "tree": tree.tolist(),
            "own_seconds": own_seconds, "chain_seconds": chain_seconds}


def refusal(target, draft, prompt) -> str | None:
    """What ``num_assistant_tokens="auto"`` gets: the refusal's message (``None`` if it ran)."""
    try:
        target.generate(prompt, assistant_model=draft, max_new_tokens=4, num_assistant_tokens="auto")
    except ValueError as error:
        return str(error)
    return None


def perturbed(target, draft, prompt, rank: int) -> str | None:
    """A sampled call in which the last rank's shared generator is reseeded after the broadcast: the error every rank
    raises (``None`` if none did)."""
    import hf_spec.parallel

    shared = hf_spec.parallel.TensorParallelRanks.shared_generator

    def off_by_one(self, generator, device):
        generator = shared(self, generator, device)
        if self.rank == self.size - 1:
            generator.manual_seed(generator.initial_seed() + 1)
        return generator

    hf_spec.parallel.TensorParallelRanks.shared_generator = off_by_one
    try:
        target.generate(prompt.expand(4, -1), assistant_model=draft, do_sample=True, max_new_tokens=24,
                        num_assistant_tokens=3, pad_token_id=0)
    except RuntimeError as error:
        return str(error)
    finally:
        hf_spec.parallel.TensorParallelRanks.shared_generator = shared
    return None


if __name__ == "__main__":
    main()
