"""Draft distillation with transformers' Trainer, on tiny models: the loss, a short run that helps, the options."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_noisy_copy, make_tiny_model
from transformers import AutoModelForCausalLM

from hf_spec import speculative
from hf_spec.cli import main

datasets = pytest.importorskip("datasets")
from hf_spec.evaluation.distill import (
    continuation_dataset,
    distill,
    distillation_loss,
    select_trainable,
    text_dataset,
)
from hf_spec.evaluation.draft_fit import measure_draft


def test_loss_is_zero_for_equal_laws_and_tv_for_known_ones():
    logits = torch.randn(2, 3, 5)
    mask = torch.ones(2, 3)
    assert float(distillation_loss(logits, logits, mask, loss="kl")) == pytest.approx(0.0, abs=1e-6)
    assert float(distillation_loss(logits, logits, mask, loss="tv")) == pytest.approx(0.0, abs=1e-6)
    p, q = torch.tensor([[[0.5, 0.5]]]).log(), torch.tensor([[[0.9, 0.1]]]).log()
    assert float(distillation_loss(p, q, torch.ones(1, 1), loss="tv")) == pytest.approx(0.4)
    kl = 0.5 * (torch.tensor(0.5 / 0.9).log() + torch.tensor(0.5 / 0.1).log())
    assert float(distillation_loss(p, q, torch.ones(1, 1), loss="kl")) == pytest.approx(float(kl))
    # masked positions do not count
    assert float(distillation_loss(p.expand(1, 2, 2), torch.cat([p, q], 1), torch.tensor([[1, 0]]), loss="tv")) == 0
    with pytest.raises(ValueError, match="`loss` must be one of"):
        distillation_loss(p, q, torch.ones(1, 1), loss="js")


def prompts(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 16, (1, 5), generator=generator) for _ in range(count)]


@pytest.fixture
def pair():
    target = speculative(make_tiny_model(seed=50, vocab_size=16, head_scale=3.0))
    return target, make_noisy_copy(target, seed=51, noise=1.5)


SETTINGS = {"do_sample": True, "temperature": 1.0}


def test_a_short_distillation_lowers_tv_and_raises_measured_acceptance(pair, tmp_path):
    target, draft = pair
    held_out = prompts(24, seed=99)
    before = measure_draft(target, draft, held_out, 3, max_new_tokens=16, settings=SETTINGS, seed=1)
    dataset = continuation_dataset(target, prompts(32, seed=0), 24, SETTINGS, cache_dir=tmp_path / "data")
    trained, history = distill(target, draft, dataset, tmp_path / "draft", loss="tv", max_steps=120,
                               learning_rate=3e-3, per_device_train_batch_size=8, logging_steps=10,
                               disable_tqdm=True)
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert losses[-1] < 0.8 * losses[0], losses
    after = measure_draft(target, trained, held_out, 3, max_new_tokens=16, settings=SETTINGS, seed=1)
    assert after.acceptance_rate > before.acceptance_rate + 0.05, (before, after)
    # saved with save_pretrained, and works as assistant_model straight away
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    prompt = torch.tensor([[1, 2, 3]])
    assert torch.equal(
        target.generate(prompt, assistant_model=reloaded, do_sample=False, max_new_tokens=12),
        target.generate(prompt, do_sample=False, max_new_tokens=12),
    )


def test_continuations_are_generated_once_and_cached(pair, tmp_path):
    target, _ = pair
    first = continuation_dataset(target, prompts(3, seed=0), 6, SETTINGS, cache_dir=tmp_path)
    cached = list(tmp_path.iterdir())
    assert len(cached) == 1
    again = continuation_dataset(target, prompts(3, seed=0), 6, SETTINGS, cache_dir=tmp_path)
    assert again["input_ids"] == first["input_ids"]
    # the trained positions are exactly those predicting the continuation
    for ids, mask in zip(first["input_ids"], first["loss_mask"]):
        assert len(mask) == len(ids) and mask[:4] == [0, 0, 0, 0] and sum(mask) == len(ids) - 5 and mask[-1] == 0


def test_train_last_layers_leaves_the_rest_unchanged(pair, tmp_path):
    target, draft = pair
    before = {name: p.detach().clone() for name, p in draft.named_parameters()}
    dataset = continuation_dataset(target, prompts(4, seed=0), 8, SETTINGS)
    trained, _ = distill(target, draft, dataset, tmp_path, train_last_layers=1, max_steps=3, learning_rate=1e-2,
                         disable_tqdm=True)
    changed = {name for name, p in trained.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(name.startswith(("model.layers.1.", "model.norm")) for name in changed), changed


def test_lora_adapters_are_merged_into_a_plain_model(pair, tmp_path):
    pytest.importorskip("peft")
    target, draft = pair
    dataset = continuation_dataset(target, prompts(4, seed=0), 8, SETTINGS)
    trained, _ = distill(target, draft, dataset, tmp_path, lora_rank=4, max_steps=3, learning_rate=1e-2,
                         disable_tqdm=True)
    assert type(trained).__name__ == "LlamaForCausalLM"
    assert target.generate(torch.tensor([[1, 2]]), assistant_model=trained, max_new_tokens=4).shape == (1, 6)


def test_bad_inputs_are_named(pair, tmp_path):
    target, draft = pair
    with pytest.raises(ValueError, match="lacks columns \\['loss_mask'\\]"):
        distill(target, draft, datasets.Dataset.from_dict({"input_ids": [[1]], "attention_mask": [[1]]}), tmp_path)
    empty = datasets.Dataset.from_dict({"input_ids": [], "attention_mask": [], "loss_mask": []})
    with pytest.raises(ValueError, match="`train_dataset` is empty"):
        distill(target, draft, empty, tmp_path)
    with pytest.raises(ValueError, match="`train_last_layers` must be in 1..2, but is 5"):
        select_trainable(draft, 5)
    with pytest.raises(ValueError, match="`prompts` is empty"):
        continuation_dataset(target, [], 4)
    with pytest.raises(ValueError, match="`max_length` must be an integer >= 2, but is 0"):
        text_dataset(None, ["x"], max_length=0)


def test_cli_eval_draft_and_distill_on_the_tiny_pair(tmp_path):
    tiny = ["--target", "tiny", "--draft", "tiny", "--threads", "1", "--num-texts", "4", "--max-new-tokens", "8"]
    assert main(["eval-draft", *tiny, "--do-sample", "--measure", "-k", "2", "--output", str(tmp_path / "e.json")]) == 0
    report = json.loads((tmp_path / "e.json").read_text())
    assert 0 <= report["predicted"]["acceptance_rate"] <= 1 and report["cost_ratio"] > 0
    assert set(report["predicted"]["predicted_speedup"]) == {str(k) for k in (1, 2, 3, 4, 5, 6, 8, 10)}
    assert report["measured"]["num_draft_tokens"] == 2 and report["measured"]["stats"]["num_rounds"] > 0
    assert main(["distill", *tiny, "--output-dir", str(tmp_path / "d"), "--max-steps", "2",
                 "--output", str(tmp_path / "d.json")]) == 0
    assert (tmp_path / "d" / "config.json").exists()
    assert json.loads((tmp_path / "d.json").read_text())["train_sequences"] == 4


def test_distill_runs_as_one_job_under_accelerate_launch_with_two_processes(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` on a CPU machine: one process builds the continuations
    cache while the other waits, one Trainer runs over both (gloo: 4 steps of one sequence per process cover the 8
    sequences once), one process writes the draft and the report. Before, the state said one process until the
    Trainer started, and the Trainer (without ``use_cpu``) ran two separate jobs: both wrote the cache, the draft
    and the report, and each step saw one sequence (half an epoch in 4 steps)."""
    import subprocess
    import sys

    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_spec",
               "distill", "--target", "tiny", "--draft", "tiny", "--threads", "1", "--num-texts", "8",
               "--max-new-tokens", "8", "--output-dir", str(tmp_path / "d"), "--max-steps", "4",
               "--output", str(report)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["num_processes"] == 2 and result["train_sequences"] == 8
    assert result["log_history"][-1]["step"] == 4 and result["log_history"][-1]["epoch"] == 1.0
    assert finished.stdout.count("saved the distilled draft") == 1 and (tmp_path / "d" / "config.json").exists()
    # one bar started (tqdm prints "100%" once or twice for one bar, by timing: its last update, then its close)
    assert finished.stderr.count("target continuations:   0%") == 1, "the second process read the cache"
