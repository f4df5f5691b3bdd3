"""The ``hf-spec`` command: the main job end to end on the built-in pair, one output convention, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hf_spec import __version__
from hf_spec.cli import main
from hf_spec.loading.tiny import build_tiny_pair

TINY = ["--target", "tiny", "--draft", "tiny"]


def run_json(capsys, argv) -> dict:
    """The subcommand's stdout parsed as one JSON document (nothing else may be there)."""
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_prints_text_ids_and_statistics_as_json(capsys):
    report = run_json(capsys, ["generate", *TINY, "--max-new-tokens", "20", "--do-sample", "--temperature", "0.7",
                               "--compare"])
    assert report["new_tokens"] == 20 == len(report["new_ids"]) and isinstance(report["text"], str)
    assert 0.0 <= report["acceptance_rate"] <= 1.0 and report["num_rounds"] > 0
    assert report["speculative_tokens_per_second"] > 0 and report["target_only_tokens_per_second"] > 0


def test_json_goes_to_stdout_alone_and_logs_to_stderr():
    """``| python -m json.tool`` works: the banner and the paths chosen are on stderr."""
    result = subprocess.run([sys.executable, "-m", "hf_spec", "generate", *TINY, "--max-new-tokens", "6", "--json"],
                            capture_output=True, text=True, check=True)
    assert json.loads(result.stdout)["new_tokens"] == 6
    assert "tiny pair" in result.stderr


@pytest.mark.parametrize("nodes", ["6", "auto"])
def test_generate_drafts_trees(capsys, nodes):
    report = run_json(capsys, ["generate", *TINY, "--max-new-tokens", "16", "--num-tree-nodes", nodes, "-k", "3"])
    assert report["new_tokens"] == 16 and sum(report["rounds_by_accepted"]) == report["num_rounds"]


def test_k_auto_and_the_usual_aliases(capsys):
    report = run_json(capsys, ["generate", "--target", "tiny", "--draft-model", "tiny", "-k", "auto", "--max-tokens",
                               "9", "--do-sample", "--temp", "0.5"])
    assert report["new_tokens"] == 9


@pytest.mark.parametrize("argv, message", [
    (["generate", *TINY, "--num-tree-nodes", "0"], "--num-tree-nodes: must be a positive integer, got 0"),
    (["generate", *TINY, "--threads", "0"], "--threads: must be a positive integer, got 0"),
    (["generate", *TINY, "--max-new-tokens", "0"], "--max-new-tokens/--max-tokens: must be a positive integer"),
    (["generate", *TINY, "--temperature", "-1"], "must be a number >= 0"),
    (["generate", *TINY, "--top-p", "0"], "--top-p: must be in (0, 1], got 0"),
    (["generate", *TINY, "--top-k", "-1"], "--top-k: must be an integer >= 0"),
    (["generate", *TINY, "--prompt", "  "], "--prompt is empty"),
    (["generate", *TINY, "--prompt-ids", "1 x 3"], "--prompt-ids must be space-separated integers"),
    (["generate", *TINY, "--prompt-ids", "1 999"], "--prompt-ids must be ids in [0, 64)"),
    (["generate", "--target", "./no/such/folder", "--draft", "tiny"], "is neither a built-in model"),
    (["generate", *TINY, "--output", "/no/such/folder/out.json"], "--output /no/such/folder/out.json: the folder"),
    (["bench", *TINY, "--plot", "/no/such/folder/b.png"], "--plot /no/such/folder/b.png: the folder"),
    (["eval-draft", *TINY, "--cost-ratio", "-1"], "--cost-ratio: must be a number > 0, got -1"),
    (["serve", "--target", "tiny", "--draft", "tiny", "--port", "70000"], "--port: must be a port number"),
    (["train-head", "--target", "tiny", "--output-dir", "/proc/no/such/x"], "--output-dir /proc/no/such/x: cannot"),
    (["train-head", "--target", "tiny", "--output-dir", "OUT", "--feature-layers", "99"], "--feature-layers 99"),
    (["train-head", "--target", "tiny", "--output-dir", "OUT", "--ttt-decay", "1.5"], "--ttt-decay must be in (0, 1]"),
    (["train-head", "--target", "tiny", "--output-dir", "OUT", "--warmup-steps", "200"], "--warmup-steps must be in"),
])
def test_every_error_is_one_line_on_stderr_with_exit_code_2(capsys, tmp_path, argv, message):
    argv = [str(tmp_path / "out") if part == "OUT" else part for part in argv]
    capsys.readouterr()
    assert main(argv) == 2
    stderr = capsys.readouterr().err.strip()
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and stderr.splitlines()[-1] == errors[0] and message in errors[0], stderr
    assert "Traceback" not in stderr


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="--prompt is empty"):
        main(["--debug", "generate", *TINY, "--prompt", ""])


def test_version_and_help_show_defaults(capsys):
    assert main(["--version"]) == 0 and __version__ in capsys.readouterr().out
    assert main(["generate", "--help"]) == 0
    help_text = capsys.readouterr().out
    for flag in ("--max-new-tokens", "--temperature", "--top-k", "--top-p", "--dtype"):
        assert flag in help_text
    assert "(default: 128)" in help_text and "(default: fastest)" in help_text


def test_training_commands_list_no_draft_side_flags(capsys):
    assert main(["train-head", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "--draft " not in help_text and "--num-assistant-tokens" not in help_text
    assert main(["distill", "--help"]) == 0
    assert "--num-assistant-tokens" not in capsys.readouterr().out


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
    from hf_spec import speculative

    speculative(target)
    assert torch.equal(target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=60), expected)


def test_the_writable_check_holds_when_processes_check_one_folder_at_once(tmp_path):
    """Under ``accelerate launch`` every rank checks ``--output`` before any work: one rank's probe file must never be
    another's (a shared probe name failed a two-process run with 'cannot write there (No such file or directory)')."""
    from concurrent.futures import ThreadPoolExecutor

    from hf_spec.cli.common import check_writable

    def check_many(_):
        for _ in range(300):
            check_writable(str(tmp_path / "report.json"), "--output")

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(check_many, range(4)))  # re-raises the first ValueError of any thread
    assert list(tmp_path.iterdir()) == [], "the check leaves nothing behind"


def test_json_of_the_training_commands_is_one_document_on_stdout(capsys, tmp_path):
    """The Trainer prints its log dicts; with --json they go to stderr, and stdout parses."""
    tiny = ["--target", "tiny", "--threads", "1", "--num-texts", "4", "--max-new-tokens", "8"]
    distilled = run_json(capsys, ["distill", *tiny, "--draft", "tiny", "--output-dir", str(tmp_path / "d"),
                                  "--max-steps", "2"])
    assert distilled["train_sequences"] == 4
    trained = run_json(capsys, ["train-head", *tiny, "--output-dir", str(tmp_path / "h"), "--max-steps", "2",
                                "--eval-steps", "1"])
    assert trained["log_history"]


def test_bench_json_without_a_plot_needs_no_matplotlib(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, as where it is not installed
    argv = ["bench", *TINY, "--prompts", "1", "--max-new-tokens", "4", "--workloads", "code", "--methods", "hf_spec",
            "--no-progress", "--plot", str(tmp_path / "b.png"), "--output", str(tmp_path / "b.json")]
    assert main(argv) == 2 and "--no-plot" in capsys.readouterr().err
    report = run_json(capsys, [*argv, "--no-plot"])
    assert "hf_spec" in report["config"]["methods"] and not (tmp_path / "b.png").exists()
