"""Coverage proxy: share of the target's greedy output tokens (HumanEval prompts, 128 new) outside each pruned set."""
import torch, json, collections
torch.set_num_threads(2)
from hf_spec.loading.pair import load_pair
from hf_spec.loading import vocabulary as V
from hf_spec.loading.corpora import load_texts
from hf_spec.bench.workloads import text_workloads
pair = load_pair(optimize=False)
target, draft, tok = pair.target, pair.draft, pair.tokenizer
outs = {}
for name in ("code", "prose", "edit"):
    n = 8 if name == "prose" else 16
    ws = text_workloads(tok, (name,), n)[name]
    rows = []
    for inputs in ws:
        o = target.generate(**inputs, max_new_tokens=128, do_sample=False)
        rows.append(o[0, inputs["input_ids"].shape[1]:].tolist())
    outs[name] = rows
    print(name, "done", flush=True)
json.dump(outs, open("/tmp/coverage_outputs.json", "w"))
texts = load_texts("stdlib")
counts = V._cached(V.counts_path(tok, texts), lambda: V.token_counts(tok, texts), "stdlib", 151936)
res = {}
for windows in (64, 256):
    path = V.counts_path(tok, texts, target=target)
    if windows != 64:
        path = path.with_name(path.stem + f"-w{windows}.json")
    emitted = V._cached(path, lambda: V.continuation_counts(target, tok, texts, num_prompts=windows), "cont", 151936)
    for size in (16384, 32768, 49152, 65536):
        s = set(V.frequent_token_ids(emitted, size, then_by=counts, num_ids=151936))
        for name, rows in outs.items():
            toks = [t for r in rows for t in r]
            miss = sum(t not in s for t in toks) / len(toks)
            bench = [t for r in rows[:4] for t in r]
            res[f"w{windows} {size} {name}"] = (round(100 * miss, 2), round(100 * sum(t not in s for t in bench) / len(bench), 2))
            print(f"windows {windows} size {size} {name}: miss all {100*miss:.2f}% bench4 {res[f'w{windows} {size} {name}'][1]}%", flush=True)
for size in (32768, 49152):
    s = set(V.frequent_token_ids(counts, size, num_ids=151936))
    for name, rows in outs.items():
        toks = [t for r in rows for t in r]
        print(f"text {size} {name}: miss {100*sum(t not in s for t in toks)/len(toks):.2f}%")
