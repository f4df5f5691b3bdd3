"""The support table of docs/families.md: every causal-LM family of the installed transformers, checked on its tiny
model by hf_spec (`hf_spec.evaluation.zoo.check_family`) and by transformers' own assisted generation.

    python scripts/zoo_table.py [--processes 2] [--output docs/families.md] [--json raw.jsonl] [FAMILY ...]

Each family runs in its own process (a fresh import each time, and a hung family cannot stop the others).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import time
from pathlib import Path

import transformers

HEADER = """# Model families

Every causal-LM family of transformers {version} (its `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), as a tiny random model
(hidden size 64, one layer of each kind the family mixes, every sliding window 8 tokens), decoded greedily by hf_spec
with a near-copy draft and with another random model of the family, in a ragged batch of two (prompts of 30 and 21
tokens) and for one row alone, against the target's own `generate()`. What each column means:

- **hf_spec**: *exact* (equal to target-only, up to float ties), or *refused* before any forward pass with the message
  shown; *not checked* families give the reason the tiny model is out of reach.
- **acceptance**: the near-copy draft's acceptance in the batch (drafts that were accepted: the rollback ran).
- **transformers**: transformers' own `generate(assistant_model=near_copy)` for the first row (it takes no batches).

The sampled law is tested on a sliding-window family (Mistral) and a recurrent one (Mamba), each with its negative
control (`tests/test_windows_and_states.py`); the whole matrix runs in the suite (`tests/test_zoo.py`). What hf_spec
does with each kind of cache: sliding windows move each row's holes out of its window (`hf_spec/caches.py`);
recurrent and linear-attention states are rolled back from transformers' per-token recording (transformers 5.25 or
newer; older releases refuse these models by name), with every row of a batch keeping the same number of tokens a
round; tree drafts need plain attention layers (a sliding window or a recurrent state is refused by name with
`num_tree_nodes`). Encoder-decoder targets (T5, BART, Whisper) and vision-language ones (LLaVA, Qwen2-VL) have their
own matrix: [encoder-decoder and vision-language targets](conditioned.md) (`tests/test_conditioned.py`).

Made by `python scripts/zoo_table.py` on {date}, transformers {version}, torch {torch}.

| family | hf_spec | acceptance | transformers |
|---|---|---|---|
"""


def check(model_type: str) -> dict:
    import logging
    import warnings

    import torch

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    from hf_spec.evaluation.zoo import NOT_CHECKED, check_family, check_transformers_assisted

    if model_type in NOT_CHECKED:
        return {"model_type": model_type, "status": "not checked", "detail": NOT_CHECKED[model_type]}
    started = time.perf_counter()
    result = check_family(model_type)
    return {"model_type": model_type, "status": result.status, "detail": result.detail,
            "acceptance": result.acceptance.get("near-copy"), "transformers": check_transformers_assisted(model_type),
            "seconds": round(time.perf_counter() - started, 1)}


def row(result: dict) -> str:
    status = result["status"]
    detail = " ".join(result.get("detail", "").split()).replace("|", "\\|")
    cell = status if not detail else f"{status}: {detail}"
    acceptance = "" if result.get("acceptance") is None else f"{result['acceptance']:.2f}"
    return f"| `{result['model_type']}` | {cell} | {acceptance} | {result.get('transformers', '')} |"


def main() -> None:
    from hf_spec.evaluation.zoo import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per family")
    parser.add_argument("--output", type=Path, default=Path("docs/families.md"))
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results, one JSON line each")
    args = parser.parse_args()
    results = []
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.processes, maxtasksperchild=1) as pool:
        pending = {name: pool.apply_async(check, (name,)) for name in args.families}
        for name, future in pending.items():
            try:
                results.append(future.get(timeout=args.timeout))
            except Exception as error:  # noqa: BLE001 - a family that hangs or kills its process is a finding
                results.append({"model_type": name, "status": "error", "detail": f"{type(error).__name__}"})
            print(row(results[-1]), flush=True)
    import torch

    header = HEADER.format(version=transformers.__version__, date=datetime.date.today().isoformat(),
                           torch=torch.__version__)
    args.output.write_text(header + "\n".join(row(result) for result in results) + "\n")
    if args.json is not None:
        args.json.write_text("".join(json.dumps(result) + "\n" for result in results))


if __name__ == "__main__":
    main()
