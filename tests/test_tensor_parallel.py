"""A tensor-parallel target (``tp_plan="auto"``, gloo, 2 processes under ``torchrun``) speculates exactly: greedy equal
to the sharded target's own ``generate()`` on every rank, the sampled law with its negative control, timed sizers
refused, and a rank whose random stream is perturbed detected by name (`hf_spec.evaluation.tensor_parallel`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import NUM_TOKENS, exact_law, make_noisy_copy, small_target_model

from hf_spec.evaluation.exactness import fit_sequences

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo")
NUM_RANKS = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's report of one ``torchrun --nproc-per-node 2`` run on the statistical tests' pair."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    target = small_target_model()
    target.save_pretrained(root / "target")
    make_noisy_copy(target, seed=12, noise=1.0).save_pretrained(root / "draft")
    # a clean environment: what earlier tests' libraries set in this process (a rank, a port) stays here
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "PYTHONPATH", "HF_HOME") if name in os.environ}
    env |= {"OMP_NUM_THREADS": "1", "HF_SPEC_COST_STORE": "off", "HF_SPEC_LOAD_METER": "off"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NUM_RANKS),
               "-m", "hf_spec.evaluation.tensor_parallel", "--target", str(root / "target"),
               "--draft", str(root / "draft"), "--output", str(root / "out")]
    failures = []
    for _ in range(2):  # once more only where a rank was killed by a signal (gloo aborted once in a full CI-like run)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False,
                              cwd=Path(__file__).parent.parent)
        if done.returncode == 0:
            break
        failures.append(done.stderr[-3000:])
        assert "Signal" in done.stderr or "exitcode  : -" in done.stderr, done.stderr[-4000:]
    assert done.returncode == 0, "\n---\n".join(failures)
    return [json.loads((root / "out" / f"rank{rank}.json").read_text()) for rank in range(NUM_RANKS)], target


def test_every_rank_is_sharded_and_ends_with_the_same_tokens(ranks):
    reports, _ = ranks
    assert [report["tp_size"] for report in reports] == [NUM_RANKS] * NUM_RANKS
    for name in ("greedy", "law", "negative_control"):
        first = reports[0][name]
        assert all(report[name] == first if name != "greedy" else
                   {k: v for k, v in report[name].items() if "seconds" not in k} ==
                   {k: v for k, v in first.items() if "seconds" not in k} for report in reports), name


def test_greedy_chains_and_trees_equal_the_sharded_targets_own_output(ranks):
    greedy = ranks[0][0]["greedy"]
    assert greedy["chain"] == greedy["own"]
    assert greedy["tree"] == greedy["own_first_row"]


def test_sampled_rows_follow_the_targets_law_and_the_negative_control_fails(ranks):
    reports, target = ranks
    law = exact_law(target, {}, [])
    assert fit_sequences(np.array(reports[0]["law"]), law).is_consistent
    negative = fit_sequences(np.array(reports[0]["negative_control"]), law)
    assert not negative.is_consistent, negative
    assert np.array(reports[0]["law"]).shape[1] == NUM_TOKENS


def test_timed_sizers_are_refused_by_name(ranks):
    for report in ranks[0]:
        assert "`num_assistant_tokens`='auto'" in report["refused"] and "Pass an integer" in report["refused"]


def test_a_perturbed_rank_is_detected_on_every_rank_naming_the_ranks(ranks):
    for report in ranks[0]:
        assert report["perturbed"] is not None and "rank 0" in report["perturbed"] and "rank 1" in report["perturbed"]
