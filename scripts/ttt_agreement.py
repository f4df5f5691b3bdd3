"""Held-out agreement per block position of heads trained with and without EAGLE-3's training-time test.

    hf-spec train-head --architecture eagle3 --ttt-steps 1 ... --output-dir A --output ttt_1.json
    hf-spec train-head --architecture eagle3 --ttt-steps 3 ... --output-dir B --output ttt_3.json
    python scripts/ttt_agreement.py ttt_1.json ttt_3.json --output ttt_agreement.json --plot ttt_agreement.png

Each report's ``before`` and ``after`` hold ``agreement_by_position``: top-1 agreement with the target at block
positions 0, 1, 2, the head unrolled on its own outputs (`hf_spec.evaluation.head_training.evaluate_head`). The
script puts the reports' curves side by side (JSON) and draws them (PNG): one line per report, untrained and trained.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="JSON reports of hf-spec train-head --output")
    parser.add_argument("--labels", nargs="+", default=None, help="one per report (default: the file names)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--plot", required=True)
    args = parser.parse_args()
    reports = [json.loads(Path(path).read_text()) for path in args.reports]
    labels = args.labels or [Path(path).stem for path in args.reports]
    if len(labels) != len(reports):
        parser.error(f"--labels: {len(labels)} labels for {len(reports)} reports")
    curves = {label: {"before": report["before"]["agreement_by_position"],
                      "after": report["after"]["agreement_by_position"],
                      "report": str(path)}
              for label, report, path in zip(labels, reports, args.reports, strict=True)}
    Path(args.output).write_text(json.dumps(curves, indent=2) + "\n")
    figure = Figure(figsize=(6, 3.5))
    axes = figure.subplots()
    for label, curve in curves.items():
        positions = range(len(curve["after"]))
        line, = axes.plot(positions, curve["after"], marker="o", label=f"{label}, trained")
        axes.plot(positions, curve["before"], marker="x", linestyle=":", color=line.get_color(),
                  label=f"{label}, untrained")
    axes.set(xlabel="block position", ylabel="held-out top-1 agreement", title="EAGLE-3 head, training-time test",
             ylim=(0, 1), xticks=list(positions))
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.plot, dpi=100)
    for label, curve in curves.items():
        before, after = ([round(x, 3) for x in curve[key]] for key in ("before", "after"))
        print(label, "untrained", before, "trained", after)


if __name__ == "__main__":
    main()
