"""The ``hf-spec generate`` main job runs end to end on the built-in pair."""

from __future__ import annotations

import json

import pytest
import torch

from hf_spec.cli import main
from hf_spec.loading.tiny import build_tiny_pair

TINY = ["--target", "tiny", "--draft", "tiny"]


def test_generate_prints_tokens_and_statistics(capsys):
    argv = ["generate", *TINY, "--max-new-tokens", "20", "--do-sample", "--temperature", "0.7", "--json", "--compare"]
    assert main(argv) == 0
    output = capsys.readouterr().out
    report = json.loads(output[output.index("{") :])
    assert report["new_tokens"] == 20
    assert 0.0 <= report["acceptance_rate"] <= 1.0 and report["num_rounds"] > 0
    assert report["speculative_tokens_per_second"] > 0 and report["target_only_tokens_per_second"] > 0


@pytest.mark.parametrize("nodes", ["6", "auto"])
def test_generate_drafts_trees(capsys, nodes):
    argv = ["generate", *TINY, "--max-new-tokens", "16", "--num-tree-nodes", nodes, "-k", "3", "--json"]
    assert main(argv) == 0
    output = capsys.readouterr().out
    report = json.loads(output[output.index("{") :])
    assert report["new_tokens"] == 16 and sum(report["rounds_by_accepted"]) == report["num_rounds"]
    with pytest.raises(SystemExit):
        main(["generate", *TINY, "--num-tree-nodes", "0"])
    assert "--num-tree-nodes: must be a positive integer, got 0" in capsys.readouterr().err


def test_generate_rejects_bad_prompt_ids_and_mixed_pairs(capsys):
    with pytest.raises(SystemExit, match="prompt-ids"):
        main(["generate", *TINY, "--prompt-ids", "1 x 3"])
    with pytest.raises(SystemExit, match="--target tiny --draft .*: `target` 'tiny' goes with `draft` 'tiny'"):
        main(["generate", "--target", "tiny"])
    for option in ("--threads", "--max-new-tokens"):
        with pytest.raises(SystemExit):
            main(["generate", *TINY, option, "0"])
    assert f"{option}: must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_streams_text_from_a_real_model(capsys):
    """SmolLM2-135M as target and draft (downloaded once): a chat prompt in, streamed text and statistics out."""
    argv = ["generate", "--target", "smollm2-135m-instruct", "--draft", "smollm2-135m-instruct",
            "--prompt", "What is 2 + 2?", "--max-new-tokens", "12", "--threads", "1"]
    assert main(argv) == 0
    output = capsys.readouterr().out
    assert "accepted" in output and "tokens/s: speculative" in output
    assert "100.0%" in output, "a draft with the target's weights is always accepted"


def test_built_in_pair_greedy_matches_target_only():
    target, draft = build_tiny_pair(seed=3)
    prompt = torch.tensor([[1, 2, 3]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=60)
    assert torch.equal(target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=60), expected)
