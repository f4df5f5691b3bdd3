"""`hf-spec bench`: every method side by side on the same weights, prompts and settings.

- `methods`: how each method calls ``generate()``;
- `runner`: the interleaved runs (`run_benchmark`);
- `variants`: the other targets and drafts a run compares (quantized, other drafts, pruned drafts, kernel baselines);
- `workloads`: code, prose and edit prompts;
- `measure`: forward-pass counts, peak memory, weights, the machine;
- `report`: rows, the formula's prediction, the Markdown table and the plot.
"""
