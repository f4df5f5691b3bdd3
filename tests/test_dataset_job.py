"""``hf-spec generate --dataset``: every row in the dataset's order, the same file from 1 and 2 processes
(``accelerate launch``), resumed after an interruption without duplicates or gaps, bad options refused first."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hf_spec.cli.dataset
from hf_spec import speculative
from hf_spec.cli import main
from hf_spec.loading.tiny import build_tiny_pair, tiny_tokenizer

TINY = ["--target", "tiny", "--draft", "tiny", "--threads", "1", "--max-new-tokens", "10", "--batch-size", "3"]
NUM_ROWS = 11


@pytest.fixture()
def rows(tmp_path):
    """A .jsonl dataset of prompts of different lengths."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"def f{i}(x): return x" + " + 1" * (i % 5), "id": i}) + "\n"
                            for i in range(NUM_ROWS)))
    return path


def job(rows, output, *extra) -> list[str]:
    return ["generate", *TINY, "--dataset", str(rows), "--output", str(output), *extra]


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_row_in_order_equal_to_the_targets_own_greedy_output(rows, tmp_path):
    output = tmp_path / "out.jsonl"
    assert main(job(rows, output)) == 0
    written = lines(output)
    assert [row["index"] for row in written] == list(range(NUM_ROWS))
    assert not (tmp_path / "out.jsonl.parts").exists()
    target, tokenizer = speculative(build_tiny_pair(0)[0]), tiny_tokenizer()
    for row in written:
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        own = target.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        assert row["generated"] == tokenizer.decode(own, skip_special_tokens=True)
        assert row["new_tokens"] == len(own)


def test_two_processes_under_accelerate_launch_write_the_same_file_as_one(rows, tmp_path):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert main(job(rows, one, "--do-sample")) == 0
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_spec",
               *job(rows, two, "--do-sample", "--json")]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = json.loads(finished.stdout)  # one report: the main process's
    assert report["processes"] == 2 and report["rows_this_run"] == NUM_ROWS and report["num_draft_tokens"] > 0
    assert two.read_text() == one.read_text()


def test_an_interrupted_run_resumes_without_duplicates_or_gaps(rows, tmp_path, monkeypatch):
    output, whole = tmp_path / "out.jsonl", tmp_path / "whole.jsonl"
    assert main(job(rows, whole)) == 0
    generate_batch, calls = hf_spec.cli.dataset.generate_batch, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return generate_batch(*args)

    monkeypatch.setattr(hf_spec.cli.dataset, "generate_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(job(rows, output))
    part = tmp_path / "out.jsonl.parts" / "rank-0.jsonl"
    done = {row["index"] for row in lines(part)}
    assert len(done) == 6 and not output.exists()
    with part.open("a") as stream:
        stream.write('{"index": 9, "gener')  # a line the interruption cut
    seen = []
    monkeypatch.setattr(hf_spec.cli.dataset, "generate_batch", lambda pair, prompts, indices, args: (
        seen.extend(indices), generate_batch(pair, prompts, indices, args))[1])
    assert main(job(rows, output)) == 0
    assert sorted(seen) == sorted(set(range(NUM_ROWS)) - done)
    assert output.read_text() == whole.read_text()
    assert main(job(rows, output)) == 0 and output.read_text() == whole.read_text()  # nothing left: unchanged


def test_a_changed_dataset_is_refused_instead_of_mixed_with_old_answers(rows, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    assert main(job(rows, output, "--num-rows", "3")) == 0
    rows.write_text(rows.read_text().replace("def f1(", "def g1("))
    assert main(job(rows, output)) == 2
    assert "row 1 was written for another prompt" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--output", "out.json"], "must name a .jsonl file"),
    (["--num-tree-nodes", "4"], "--batch-size 1"),
    (["--column", "id"], "row 0 holds int"),
    (["--column", "nope"], "has columns"),
    (["--prompt", "hello"], "pass one"),
    (["--compare"], "does not run with --dataset"),
])
def test_bad_dataset_options_are_refused_by_name(rows, tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    argv = job(rows, tmp_path / "out.jsonl")
    assert main([*argv, *extra]) == 2
    assert message in capsys.readouterr().err


def test_rows_are_batched_by_length_and_shared_round_robin():
    batches = hf_spec.cli.dataset.plan_batches({0: 5, 1: 2, 2: 9, 3: 2, 4: 7}, 2)
    assert batches == [[1, 3], [0, 4], [2]]
    assert batches[0::2] == [[1, 3], [2]] and batches[1::2] == [[0, 4]]
