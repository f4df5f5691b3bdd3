"""The prepared GPU check (`scripts/device_check.py`) in its ``--quick`` form on the CPU, so that it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "device_check.py"


def test_the_quick_device_check_runs_and_every_check_passes(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--output", str(tmp_path)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["quick"] and report["device"] == "cpu"
    assert all(case["passed"] for case in report["exactness"]), report["exactness"]
    assert any(case["case"].startswith("negative control") for case in report["exactness"])
    assert report["greedy"]["identical"] and report["greedy"]["tree_identical"]
    assert any(case["case"].startswith("tree of 6") for case in report["exactness"])
    assert {run["oracle_acceptance"] for run in report["oracle"]} == {1.0, 0.8}
    perfect = next(run for run in report["oracle"] if run["oracle_acceptance"] == 1.0)
    assert perfect["measured_acceptance"] == 1.0 and perfect["identical_to_target_only"]
    assert [run["batch_size"] for run in report["batches"]] == [1, 4, 16]
    assert all(run["identical_to_target_only"] for run in report["batches"])
    costs = report["costs"][0]
    assert set(costs["target_block_seconds"]) >= {"2", "4", "8", "16", "32"} and costs["cost_ratio"] > 0
    compiled = {(run["case"], run["method"]): run for run in report["compiled"]}
    assert set(compiled) == {(case, method) for case in ("dynamic", "static", "static, compiled")
                             for method in ("target_only", "hf_spec")}
    assert all(run["identical_to_target_only"] for run in compiled.values()), compiled
    assert compiled[("static, compiled", "hf_spec")]["graphs"] > 0
    whisper = report["whisper"]
    assert whisper["identical"] and whisper["encoder_passes"] == 1 and whisper["cost_ratio"] > 0, whisper
    assert "## Whisper large-v3" in (tmp_path / "device_check.md").read_text()
    assert "## Exactness" in (tmp_path / "device_check.md").read_text()
    assert "## Static caches and compiled passes" in (tmp_path / "device_check.md").read_text()
