"""`hf-spec bench`: every method side by side on the same weights, prompts and settings.

- `runner`: the methods and the interleaved runs (`run_benchmark`);
- `workloads`: code, prose and edit prompts;
- `measure`: forward-pass costs and counts, peak memory, weights, the machine;
- `report`: rows, the formula's prediction, the Markdown table and the plot.
"""
