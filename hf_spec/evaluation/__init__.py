"""How well a draft fits its target, and making it fit better.

- `continuations`: the target's own seeded continuations, cut after EOS;
- `draft_fit`: expected acceptance from the two processed laws (`evaluate_draft`), and measured speculative runs
  (`measure_draft`);
- `distill`: fine-tuning a draft toward its target with `Trainer`;
- `corpora`: the texts the tools work on (HumanEval, the standard library, your own files);
- `metrics/`: the same arithmetic as an `evaluate` metric (`draft_fit.METRIC_PATH`).
"""
