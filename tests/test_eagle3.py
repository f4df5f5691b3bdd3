"""EAGLE-3 heads in the speculators format: the files as speculators writes them, the forward pass against an
independent reading of those files (as vLLM computes it), EAGLE-3's reference layout, damaged checkpoints refused
by name, exactness through generate() with a draft vocabulary (and its negative control), the training-time test
against drafting, and the CLI from training to generation.

The loop's bookkeeping with an `Eagle3Head` (from-scratch laws in ragged batches and trees, greedy equality, returned
caches, saving) runs in `test_heads.py`, whose head fixture includes one."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import BanSuccessorOfLastToken, exact_law, make_tiny_model, with_length
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessorList

import hf_spec.heads.drafter
from hf_spec import speculative, without_speculation
from hf_spec.evaluation.exactness import fit_sequences
from hf_spec.evaluation.head_training import collate, feature_dataset, unroll
from hf_spec.heads.eagle3 import Eagle3Head
from hf_spec.heads.model import DraftHead
from hf_spec.loading.packed import PackedLinear, optimize

AUX = [0, 1, 2]


@pytest.fixture(scope="module")
def target():
    return speculative(make_tiny_model(seed=3, vocab_size=64, num_layers=2))


@pytest.fixture(scope="module")
def head(target):
    head = Eagle3Head.from_target(target, aux_layers=AUX, draft_vocab=list(range(1, 64, 3)))
    with torch.no_grad():  # its own laws, not the target's last layer's
        generator = torch.Generator().manual_seed(1)
        for parameter in head.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return head


def features_of(target, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i] for i in AUX], dim=-1)  # [1, S, 3H]


# --- The files -----------------------------------------------------------------------------------------------------

def test_save_pretrained_writes_the_speculators_format(head, tmp_path):
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == 21 and config["eagle_aux_hidden_state_layer_ids"] == AUX
    assert config["target_hidden_size"] == 64 and config["norm_before_residual"] is False
    layers = config["transformer_layer_config"]
    assert layers["model_type"] == "llama" and layers["num_hidden_layers"] == 1 and layers["vocab_size"] == 64
    speculators = config["speculators_config"]
    assert speculators["algorithm"] == "eagle3" and speculators["default_proposal_method"] == "greedy"
    assert speculators["proposal_methods"][0]["proposal_type"] == "greedy"
    assert set(speculators["verifier"]) == {"name_or_path", "architectures"}
    weights = load_file(str(tmp_path / "model.safetensors"))
    shapes = {name: tuple(tensor.shape) for name, tensor in weights.items()}
    assert shapes["fc.weight"] == (64, 3 * 64) and shapes["lm_head.weight"] == (21, 64)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (64, 128) and shapes["layers.0.self_attn.k_proj.weight"] == (
        32, 128) and shapes["layers.0.self_attn.o_proj.weight"] == (64, 64)
    assert shapes["layers.0.hidden_norm.weight"] == (64,) and shapes["norm.weight"] == (64,)
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool and shapes["t2d"] == (64,)
    assert torch.equal(weights["d2t"] + torch.arange(21), torch.arange(1, 64, 3))
    assert not [name for name in weights if "embed" in name or "verifier" in name or "rotary" in name]


def reference_logits(folder, embeddings: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor,
                     swap_halves: bool = False) -> torch.Tensor:
    """``[S, target vocab]``: the EAGLE-3 forward pass read from the files alone, written from speculators' and vLLM's
    definitions (a Llama layer whose attention reads [input_layernorm(e); hidden_norm(fc(g))], no cache, causal),
    with plain torch. ``swap_halves``: the negative control, reading the halves in the other order."""
    config = json.loads((folder / "config.json").read_text())
    layer = config["transformer_layer_config"]
    w = load_file(str(folder / "model.safetensors"))
    eps, heads, kv_heads = layer["rms_norm_eps"], layer["num_attention_heads"], layer["num_key_value_heads"]
    head_dim = layer["hidden_size"] // heads
    theta = layer.get("rope_parameters", {}).get("rope_theta", layer.get("rope_theta", 10000.0))

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, positions):  # [S, n, d]
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = positions[:, None].float() * inv[None]  # [S, d / 2]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    p = "layers.0."
    e, a = embeddings[input_ids[0]], features[0] @ w["fc.weight"].T  # [S, H] each
    halves = [rms(e, w[p + "input_layernorm.weight"]), rms(a, w[p + "hidden_norm.weight"])]
    u = torch.cat(halves[::-1] if swap_halves else halves, dim=-1)  # [S, 2H]
    length = u.shape[0]
    positions = torch.arange(length)
    q = rope((u @ w[p + "self_attn.q_proj.weight"].T).view(length, heads, head_dim), positions)
    k = rope((u @ w[p + "self_attn.k_proj.weight"].T).view(length, kv_heads, head_dim), positions)
    v = (u @ w[p + "self_attn.v_proj.weight"].T).view(length, kv_heads, head_dim)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim ** 0.5
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, -1)
    h = a + attended @ w[p + "self_attn.o_proj.weight"].T
    x = rms(h, w[p + "post_attention_layernorm.weight"])
    h = h + (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"].T
    draft_logits = rms(h, w["norm.weight"]) @ w["lm_head.weight"].T  # [S, draft vocab]
    logits = torch.full((length, len(w["t2d"])), float("-inf"))
    logits[:, torch.arange(len(w["d2t"])) + w["d2t"]] = draft_logits
    return logits


def test_the_forward_pass_matches_an_independent_reading_of_the_files(target, head, tmp_path):
    """What a server loading the folder computes, from the files alone, equals the head's logits; reading the two
    halves of the first layer's input the other way round (a layout mistake) does not."""
    head.save_pretrained(tmp_path)
    loaded = Eagle3Head.from_pretrained(tmp_path).attach(target)
    ids = torch.tensor([[5, 9, 2, 6, 5, 3, 7, 1]])
    features = features_of(target, ids)[:, :-1]
    embeddings = target.get_input_embeddings().weight.detach()
    with torch.no_grad():
        ours = loaded(ids[:, 1:], features=features).logits[0]
    expected = reference_logits(tmp_path, embeddings, ids[:, 1:], features)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    swapped = reference_logits(tmp_path, embeddings, ids[:, 1:], features, swap_halves=True)
    finite = torch.isfinite(expected)
    assert (swapped[finite] - expected[finite]).abs().max() > 1e-2  # the negative control is caught


def test_eagle3_reference_checkpoints_load_with_midlayer_names(target, head, tmp_path):
    """SafeAILab/EAGLE's layout: a Llama config with ``draft_vocab_size``, the layer under ``midlayer.*``."""
    head.save_pretrained(tmp_path / "speculators")
    weights = load_file(str(tmp_path / "speculators" / "model.safetensors"))
    reference = tmp_path / "reference"
    reference.mkdir()
    save_file({name.replace("layers.0.", "midlayer."): tensor for name, tensor in weights.items()},
              str(reference / "model.safetensors"))
    layer = json.loads((tmp_path / "speculators" / "config.json").read_text())["transformer_layer_config"]
    (reference / "config.json").write_text(json.dumps({
        **{key: value for key, value in layer.items() if key != "model_type"},
        "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 21}))
    loaded = Eagle3Head.from_pretrained(reference)
    assert loaded.config.eagle_aux_hidden_state_layer_ids is None  # this layout does not say; attach resolves it
    with pytest.raises(ValueError, match=r"default layers \[2, L // 2, L - 3\]"):
        loaded.attach(target)  # too shallow a target for EAGLE-3's default: refused by name
    loaded.config.eagle_aux_hidden_state_layer_ids = AUX
    loaded.attach(target)
    ids, prompt = torch.tensor([[5, 9, 2, 6, 5, 3]]), torch.tensor([[5, 9, 2, 6]])
    features = features_of(target, ids)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids[:, 1:], features=features).logits,
                                   head(ids[:, 1:], features=features).logits)
    output = target.generate(prompt, assistant_model=loaded, do_sample=False, max_new_tokens=12)
    with without_speculation(target):
        assert torch.equal(output, target.generate(prompt, do_sample=False, max_new_tokens=12))


def test_damaged_or_foreign_checkpoints_are_refused_by_name(target, head, tmp_path):
    head.save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    save_file({**weights, "d2t": weights["d2t"] + 100}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="`d2t` maps the 21 draft ids outside the target's 64 ids"):
        Eagle3Head.from_pretrained(tmp_path)
    save_file({name: tensor for name, tensor in weights.items() if name != "fc.weight"},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"the weights do not fit .* missing \['fc.weight'\]"):
        Eagle3Head.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        Eagle3Head.from_pretrained(tmp_path)
    wide = speculative(make_tiny_model(seed=3, vocab_size=64, num_layers=4))
    with pytest.raises(ValueError, match=r"`aux_layers` must be .* but is \[0, 1, 9\]"):
        Eagle3Head.from_target(wide, aux_layers=[0, 1, 9])
    with pytest.raises(ValueError, match=r"default layers \[2, L // 2, L - 3\] are \[2, 2, 1\]"):
        Eagle3Head.from_target(wide)


def test_speculators_own_classes_read_the_folder_unchanged(target, head, tmp_path, monkeypatch):
    """Optional, where vllm-project/speculators imports (0.9.0 pins transformers<=5.19, so install it beside this
    environment with --no-deps, docs/heads.md): its config class parses our config.json and its Eagle3DraftModel loads
    every tensor of ours unchanged (what it adds are the verifier's embeddings and its training-only verifier
    layers); a file whose fc weight has the wrong
    shape (the negative control) is refused by its loader."""
    speculators_models = pytest.importorskip("speculators.models")
    target.save_pretrained(tmp_path / "verifier")
    monkeypatch.setattr(head.config, "verifier_name_or_path", str(tmp_path / "verifier"))
    head.save_pretrained(tmp_path / "head")
    config = speculators_models.Eagle3SpeculatorConfig.from_pretrained(tmp_path / "head")
    assert config.draft_vocab_size == 21 and config.eagle_aux_hidden_state_layer_ids == AUX
    assert config.speculators_config.verifier.name_or_path == str(tmp_path / "verifier")
    theirs = speculators_models.Eagle3DraftModel.from_pretrained(tmp_path / "head").state_dict()
    ours = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert set(theirs) - set(ours) == {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    for name, tensor in ours.items():
        assert torch.equal(theirs[name].to(tensor.dtype), tensor), name
    save_file({**ours, "fc.weight": ours["fc.weight"][:, :128].contiguous()}, str(tmp_path / "head" /
                                                                              "model.safetensors"))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # its loader saw the shape mismatch
        speculators_models.Eagle3DraftModel.from_pretrained(tmp_path / "head")


# --- Exactness through generate() ----------------------------------------------------------------------------------

VOCAB = 4
NUM_SAMPLES = 3000
SETTINGS = {"temperature": 0.6, "top_k": 3, "repetition_penalty": 2.0}


@pytest.fixture(scope="module")
def small_pair():
    """The exactness suite's 4-token target and an EAGLE-3 head proposing ids 0, 1 and 3 only (q = 0 at id 2, where
    the residual must give the target's mass), perturbed so that it is often rejected."""
    small = speculative(make_tiny_model(seed=10, vocab_size=VOCAB, num_layers=1, head_scale=3.0))
    head = Eagle3Head.from_target(small, aux_layers=[0, 1], draft_vocab=[0, 1, 3])
    with torch.no_grad():
        head.fc.weight.add_(torch.randn(head.fc.weight.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    return small, head


def sample_with_head(small, drafter, seed: int, **kwargs) -> np.ndarray:
    return small.generate(
        torch.tensor([[1, 3, 2]]).expand(NUM_SAMPLES, -1), assistant_model=drafter, do_sample=True,
        num_assistant_tokens=2, generator=torch.Generator().manual_seed(seed), pad_token_id=0,
        logits_processor=LogitsProcessorList([BanSuccessorOfLastToken()]), **with_length(SETTINGS), **kwargs,
    )[:, 3:].numpy()


def test_sampling_with_an_eagle3_head_follows_the_target_law(small_pair):
    small, head = small_pair
    result = fit_sequences(sample_with_head(small, head, seed=1),
                           exact_law(small, SETTINGS, [BanSuccessorOfLastToken()]))
    assert result.is_consistent, result


def test_negative_control_a_draft_vocabulary_law_left_unmapped_is_caught(small_pair, monkeypatch):
    """Broken: the draft's law over its own 3 ids is reported as if draft id i were target id i (d2t ignored),
    while the tokens drawn are the mapped ones."""
    small, head = small_pair
    original = hf_spec.heads.drafter.draw_next

    def unmapped(logits, batch, draft_ids, context):
        next_ids, probs, is_invalid = original(logits, batch, draft_ids, context)
        if probs is not None:
            kept = head.draft_to_target()
            probs = F.pad(probs[:, kept], (0, probs.shape[-1] - len(kept)))
        return next_ids, probs, is_invalid

    monkeypatch.setattr(hf_spec.heads.drafter, "draw_next", unmapped)
    result = fit_sequences(sample_with_head(small, head, seed=2),
                           exact_law(small, SETTINGS, [BanSuccessorOfLastToken()]))
    assert not result.is_consistent, result


# --- The training-time test -----------------------------------------------------------------------------------------

def test_the_training_time_test_unrolls_the_head_as_it_drafts(target, head):
    """Position j of `unroll` for anchor s equals drafting after the committed x_0 .. x_{s+1}: the head reads the
    target's features up to s, then its own h, the true tokens as the drafts. A visibility that lets every
    unrolled query see all of position 0 (the anchors' futures) is caught."""
    sequence = [5, 9, 2, 6, 5, 3, 7, 1, 4]
    ids = torch.tensor([sequence])
    batch = collate(list(feature_dataset(target, [sequence], AUX, progress=False)))
    with torch.no_grad():
        outputs = list(unroll(head, batch, 3))
        for s in (0, 2, 4):
            features = features_of(target, ids[:, : s + 2])[:, : s + 1]  # f_0 .. f_s
            output = head(ids[:, 1: s + 2], features=features)  # entries (f_0, x_1) .. (f_s, x_{s+1})
            cache_free = [output.logits[0, -1]]
            tokens, fed = ids[:, 1: s + 2], head.read_features(features)
            for j in range(1, 3):
                tokens = torch.cat([tokens, ids[:, s + 1 + j: s + 2 + j]], dim=1)
                fed = torch.cat([fed, output.hidden_states[:, -1:]], dim=1)
                output = head(tokens, predicted=fed)
                cache_free.append(output.logits[0, -1])
            for j in range(3):
                torch.testing.assert_close(outputs[j].logits[0, s], cache_free[j], atol=1e-4, rtol=1e-4)

    import hf_spec.evaluation.head_training as training

    original = training._unrolled_visibility

    def sees_the_future(is_real, step):
        visible = original(is_real, step)
        visible[..., : is_real.shape[1]] = True
        return visible

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(training, "_unrolled_visibility", sees_the_future)
        broken = list(unroll(head, batch, 2))
    assert not torch.allclose(broken[1].logits[0, 0], outputs[1].logits[0, 0], atol=1e-3)


def test_each_head_kind_trains_with_its_own_recipe_unless_told_otherwise(target, tmp_path):
    """An EAGLE-3 head warms up to a peak of 1e-4 (`RECIPES`); an EAGLE-1 head starts at 3e-4 without warm-up; a
    learning rate given wins over either."""
    from hf_spec.evaluation.head_training import train_head
    from hf_spec.heads import DraftHead

    sequences = [[5, 9, 2, 6, 5, 3, 7, 1, 4], [3, 8, 8, 1, 6, 2], [7, 7, 2, 9, 4, 1, 1]]
    common = {"max_steps": 4, "eval_steps": 4, "logging_steps": 1, "disable_tqdm": True}

    def rates(head, **arguments):
        data = feature_dataset(target, sequences, head.config.feature_layers, progress=False)
        _, history = train_head(target, data, data, tmp_path / "run", head=head, **common, **arguments)
        return [entry["learning_rate"] for entry in history if "learning_rate" in entry]

    eagle3 = rates(Eagle3Head.from_target(target, aux_layers=AUX).float(), ttt_steps=2)
    assert eagle3[0] < max(eagle3) == pytest.approx(1e-4)  # a warm-up step, then the peak
    eagle = rates(DraftHead.from_target(target).float())
    assert eagle[0] == max(eagle) == pytest.approx(3e-4)  # no warm-up: the peak at the first step
    assert max(rates(Eagle3Head.from_target(target, aux_layers=AUX).float(), learning_rate=5e-4)) == pytest.approx(
        5e-4)


# --- From training to generation ---------------------------------------------------------------------------------

def test_the_training_time_test_weighs_block_position_j_by_the_decay_to_the_j(target, head):
    """``ttt_decay`` d: the loss is (L_0 + d L_1 + d^2 L_2) / (1 + d + d^2), each L_j the loss at block position j
    alone (found from the undecayed means over 1, 2 and 3 positions)."""
    from hf_spec.evaluation.head_training import head_loss

    batch = collate(list(feature_dataset(target, [[5, 9, 2, 6, 5, 3, 7, 1, 4], [3, 8, 8, 1, 6]], AUX,
                                         progress=False)))
    teacher = head.target_output_layer()
    with torch.no_grad():
        means = [float(head_loss(head, batch, teacher, 0.0, ttt_steps=n).loss) for n in (1, 2, 3)]
        decayed = float(head_loss(head, batch, teacher, 0.0, ttt_steps=3, ttt_decay=0.5).loss)
    alone = [means[0], 2 * means[1] - means[0], 3 * means[2] - 2 * means[1]]  # L_0, L_1, L_2
    assert len({round(loss, 3) for loss in alone}) == 3  # the positions differ, so the weights show
    assert decayed == pytest.approx((alone[0] + 0.5 * alone[1] + 0.25 * alone[2]) / 1.75, rel=1e-5)
    assert decayed != pytest.approx(means[2], rel=1e-3)


def test_train_head_eagle3_writes_a_servable_folder_that_generate_and_load_pair_run(tmp_path, capsys):
    from hf_spec.cli import main
    from hf_spec.loading.pair import load_pair

    head_dir = tmp_path / "head"
    assert main(["train-head", "--target", "tiny", "--architecture", "eagle3", "--feature-layers", "0", "1", "2",
                 "--draft-vocab", "32", "--output-dir", str(head_dir), "--num-texts", "16", "--max-new-tokens", "12",
                 "--max-steps", "4", "--eval-steps", "2", "--ttt-decay", "0.8", "--warmup-steps", "2",
                 "--max-grad-norm", "0.5", "--no-progress", "--output", str(tmp_path / "t.json")]) == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert {key: report["recipe"][key] for key in ("ttt_steps", "ttt_decay", "warmup_steps", "max_grad_norm")} == {
        "ttt_steps": 3, "ttt_decay": 0.8, "warmup_steps": 2, "max_grad_norm": 0.5}
    assert len(report["after"]["agreement_by_position"]) == 3 and "eval_agreement_2" in report["learning_curve"][0]
    config = json.loads((head_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 32
    pair = load_pair("tiny", str(head_dir))
    assert isinstance(pair.draft, Eagle3Head)
    capsys.readouterr()
    assert main(["generate", "--target", "tiny", "--draft", str(head_dir), "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_draft_tokens"] > 0
    capsys.readouterr()
    assert main(["train-head", "--target", "tiny", "--architecture", "eagle3", "--output-dir",
                 str(tmp_path / "x")]) == 2  # the tiny target is too shallow for EAGLE-3's default layers
    assert "--architecture eagle3: EAGLE-3's default layers" in capsys.readouterr().err


def test_a_head_converted_to_bfloat16_keeps_its_vocabulary_map(head):
    converted = copy.deepcopy(head).to(torch.bfloat16)
    assert converted.d2t.dtype == torch.int64 and converted.t2d.dtype == torch.bool
    assert torch.equal(converted.draft_to_target(), head.draft_to_target())


def test_a_head_built_from_a_packed_target_equals_one_built_from_its_dense_weights(target):
    """The heads' builders read the target's layers; `hf_spec.loading.packed` holds their linear weights in oneDNN's
    layout (the path `load_pair` picks where it is fastest), which a plain ``copy_`` cannot read."""
    packed = copy.deepcopy(target)
    optimize(packed, path="packed")
    assert isinstance(packed.model.layers[-1].self_attn.o_proj, PackedLinear)
    for kind in (Eagle3Head, DraftHead):
        dense_head, packed_head = (kind.from_target(model, aux_layers=AUX) if kind is Eagle3Head
                                   else kind.from_target(model) for model in (target, packed))
        dense_state, packed_state = dense_head.state_dict(), packed_head.state_dict()
        assert dense_state.keys() == packed_state.keys()
        assert all(torch.equal(dense_state[name], packed_state[name]) for name in dense_state), kind.__name__


# --- Published layouts, damaged folders, export ---------------------------------------------------------------------

def _reference_folder(head, folder, weights_name: str = "pytorch_model.bin", **config_fields):
    """``head`` written as SafeAILab/EAGLE's training writes it: a ``LlamaForCausalLM`` config with
    ``draft_vocab_size`` and no layer ids, the layer under ``midlayer.*``, in a ``.bin`` file."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {name.replace("layers.0.", "midlayer."): tensor.clone() for name, tensor in head.state_dict().items()
             if not name.startswith(("embed_tokens", "verifier_lm_head", "rotary_emb"))}
    if weights_name.endswith(".bin"):
        torch.save(state, folder / weights_name)
    else:
        save_file(state, str(folder / weights_name))
    layer = {key: value for key, value in head.config.transformer_layer_config.items() if key != "model_type"}
    (folder / "config.json").write_text(json.dumps({**layer, "architectures": ["LlamaForCausalLM"],
                                                    "model_type": "llama", "draft_vocab_size": 21, **config_fields}))
    return folder


def test_a_reference_bin_head_runs_greedy_equal_through_generate_with_no_extra_call(tmp_path):
    """EAGLE-3's reference training output (``pytorch_model.bin``, ``midlayer.*``, a ``LlamaForCausalLM`` config that
    names no layers) on a target deep enough for the default layers: generate() attaches it and resolves them."""
    deep = speculative(make_tiny_model(seed=4, vocab_size=64, num_layers=8))
    built = Eagle3Head.from_target(deep, draft_vocab=list(range(1, 64, 3)))  # default layers [2, 4, 5]
    loaded = Eagle3Head.from_pretrained(_reference_folder(built, tmp_path / "reference"))
    assert loaded.config.eagle_aux_hidden_state_layer_ids is None and not loaded.config.norm_before_residual
    prompt = torch.tensor([[5, 9, 2, 6, 5, 3]])
    output = deep.generate(prompt, assistant_model=loaded, do_sample=False, max_new_tokens=16,
                           return_dict_in_generate=True)
    with without_speculation(deep):
        assert torch.equal(output.sequences, deep.generate(prompt, do_sample=False, max_new_tokens=16))
    assert loaded.config.feature_layers == [2, 4, 5] and output.speculative_stats.num_draft_tokens > 0
    ids = torch.tensor([[5, 9, 2, 6, 5, 3, 7]])
    with torch.no_grad():
        hidden = deep(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in (2, 4, 5)], dim=-1)[:, :-1]
        torch.testing.assert_close(loaded(ids[:, 1:], features=features).logits,
                                   built(ids[:, 1:], features=features).logits)  # the .bin's weights, all of them


def test_only_the_weights_file_the_folder_names_is_read(target, head, tmp_path):
    head.save_pretrained(tmp_path)
    stray = {name: torch.zeros_like(tensor) if tensor.is_floating_point() else tensor
             for name, tensor in load_file(str(tmp_path / "model.safetensors")).items()}
    save_file(stray, str(tmp_path / "model_v0.safetensors"))  # sorts after model.safetensors: once merged last
    loaded = Eagle3Head.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight)
    weights = load_file(str(tmp_path / "model.safetensors"))
    names = sorted(weights)
    save_file({name: weights[name] for name in names[:3]}, str(tmp_path / "part-1.safetensors"))
    save_file({name: weights[name] for name in names[3:]}, str(tmp_path / "part-2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: "part-1.safetensors" if i < 3 else "part-2.safetensors" for i, name in enumerate(names)}}))
    (tmp_path / "model.safetensors").unlink()  # the index is looked for first anyway
    sharded = Eagle3Head.from_pretrained(tmp_path)
    torch.testing.assert_close(sharded.lm_head.weight, head.lm_head.weight)


def test_a_missing_norm_before_residual_means_what_each_layout_s_readers_take(head, tmp_path):
    head.save_pretrained(tmp_path / "speculators")
    config = json.loads((tmp_path / "speculators" / "config.json").read_text())
    del config["norm_before_residual"]
    (tmp_path / "speculators" / "config.json").write_text(json.dumps(config))
    assert Eagle3Head.from_pretrained(tmp_path / "speculators").config.norm_before_residual  # speculators, vLLM
    assert not Eagle3Head.from_pretrained(_reference_folder(head, tmp_path / "ref")).config.norm_before_residual


@pytest.mark.parametrize("damage, message", [
    ("truncated config", r"config.json cannot be read as JSON"),
    ("truncated weights", r"model.safetensors cannot be read as weights"),
    ("zeroed weights", r"model.safetensors cannot be read as weights"),
    ("string vocabulary", r"`draft_vocab_size` must be a positive integer, but is '21'"),
    ("int64 fc", r"the weight `fc.weight` holds torch.int64 values"),
    ("truncated bin", r"pytorch_model.bin cannot be read as weights"),
    ("no weights", r"holds none of the weight files"),
])
def test_damaged_folders_are_refused_naming_the_folder_and_the_file(head, tmp_path, damage, message):
    folder = tmp_path / "head"
    head.save_pretrained(folder)
    weights, config = folder / "model.safetensors", folder / "config.json"
    if damage == "truncated config":
        config.write_text(config.read_text()[:40])
    elif damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:200])
    elif damage == "zeroed weights":
        weights.write_bytes(bytes(weights.stat().st_size))
    elif damage == "string vocabulary":
        config.write_text(json.dumps({**json.loads(config.read_text()), "draft_vocab_size": "21"}))
    elif damage == "int64 fc":
        state = load_file(str(weights))
        save_file({**state, "fc.weight": state["fc.weight"].long()}, str(weights))
    elif damage == "truncated bin":
        weights.unlink()
        _reference_folder(head, folder)
        (folder / "pytorch_model.bin").write_bytes((folder / "pytorch_model.bin").read_bytes()[:100])
    else:
        weights.unlink()
    with pytest.raises((ValueError, FileNotFoundError), match=message) as error:
        Eagle3Head.from_pretrained(folder)
    assert str(folder) in str(error.value)


def test_the_reference_layout_round_trips_and_says_what_sglang_reads(target, head, tmp_path):
    head.save_pretrained(tmp_path, layout="reference")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 21
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]  # SGLang adds 1
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight"} <= names and not any(name.startswith("layers.") for name in names)
    loaded = Eagle3Head.from_pretrained(tmp_path).attach(target)
    assert loaded.config.feature_layers == AUX
    ids = torch.tensor([[5, 9, 2, 6, 5, 3]])
    features = features_of(target, ids)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids[:, 1:], features=features).logits,
                                   head(ids[:, 1:], features=features).logits)


def test_export_refuses_what_a_layout_cannot_say_and_warns_what_servers_cannot_build(target, tmp_path):
    residual = Eagle3Head.from_target(target, aux_layers=AUX, norm_before_residual=True)
    with pytest.raises(ValueError, match="cannot be written in the reference layout .*norm_before_residual"):
        residual.save_pretrained(tmp_path / "residual", layout="reference")
    residual.save_pretrained(tmp_path / "residual")  # the speculators format says it
    two = Eagle3Head.from_target(target, aux_layers=[1, 2])
    with pytest.warns(UserWarning, match=r"vLLM and SGLang cannot serve this head: it reads 2 target layers"):
        two.save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="reads 2 target layers"):
        two.save_pretrained(tmp_path / "two-reference", layout="reference")
    with pytest.raises(ValueError, match="`layout` must be 'speculators' or 'reference', but is 'sglang'"):
        two.save_pretrained(tmp_path / "x", layout="sglang")


def test_target_layers_are_read_in_layer_order_whatever_order_the_config_lists(target, head, tmp_path):
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [2, 0, 1]}))
    loaded = Eagle3Head.from_pretrained(tmp_path)
    assert loaded.config.feature_layers == [0, 1, 2]  # vLLM appends each layer's state as its loop passes it
    assert Eagle3Head.from_target(target, aux_layers=[2, 0, 1]).config.eagle_aux_hidden_state_layer_ids == [0, 1, 2]


def test_a_reference_checkpoint_converts_to_the_speculators_format_and_back(target, head, tmp_path):
    """Each direction on the tiny target: reference (.bin) -> speculators -> reference, the laws unchanged."""
    reference = Eagle3Head.from_pretrained(_reference_folder(head, tmp_path / "reference"))
    reference.config.eagle_aux_hidden_state_layer_ids = AUX  # a target of 2 layers has no EAGLE-3 default
    reference.save_pretrained(tmp_path / "speculators")
    assert json.loads((tmp_path / "speculators" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    Eagle3Head.from_pretrained(tmp_path / "speculators").save_pretrained(tmp_path / "back", layout="reference")
    ids = torch.tensor([[5, 9, 2, 6, 5, 3]])
    features = features_of(target, ids)[:, :-1]
    with torch.no_grad():
        expected = head(ids[:, 1:], features=features).logits
        for folder in ("speculators", "back"):
            loaded = Eagle3Head.from_pretrained(tmp_path / folder).attach(target)
            torch.testing.assert_close(loaded(ids[:, 1:], features=features).logits, expected)
