"""Greedy speculative output against the target's own, on the real pair as `load_pair` loads it here (on AVX2-only
CPUs: the GGUF blocks), 8 held-out code prompts (8-15) alone and in two ragged batches of four, 48 tokens, k = 4.

    python scripts/gguf_greedy_equality.py > REPORT.txt
"""
import json

import torch

torch.set_num_threads(2)
import hf_spec
from hf_spec import without_speculation
from hf_spec.bench.workloads import text_workloads

pair = hf_spec.load_pair()
print(pair.describe().splitlines()[0])
tok = pair.tokenizer
prompts = [p["input_ids"][0] for p in text_workloads(tok, ("code",), 8, 8)["code"]]
target, draft = pair.target, pair.draft
results = {"single": [], "batch": []}
def gen(ids, mask, spec, k=4):
    kw = dict(attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    if spec:
        return target.generate(ids, assistant_model=draft, num_assistant_tokens=k, **kw)
    with without_speculation(target):
        return target.generate(ids, **kw)
for p in prompts:
    ids = p[None]; mask = torch.ones_like(ids)
    a, b = gen(ids, mask, False), gen(ids, mask, True)
    results["single"].append(bool(torch.equal(a, b)))
    print("single", results["single"][-1], flush=True)
tok.padding_side = "left"
for group in (prompts[:4], prompts[4:]):
    width = max(len(p) for p in group)
    ids = torch.stack([torch.cat([torch.full((width - len(p),), tok.pad_token_id or 0), p]) for p in group])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long),
                                   torch.ones(len(p), dtype=torch.long)]) for p in group])
    a, b = gen(ids, mask, False), gen(ids, mask, True)
    rows = [bool(torch.equal(x, y)) for x, y in zip(a, b)]
    results["batch"].append(rows); print("batch", rows, flush=True)
print(json.dumps(results))
