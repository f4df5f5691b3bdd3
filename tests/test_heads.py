"""Draft heads (EAGLE-style): the drafter's bookkeeping against a from-scratch reference, exactness, greedy
equality, training, saving and loading, and errors by name."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import BanSuccessorOfLastToken, exact_law, head_reference_laws, make_tiny_model, with_length
from transformers import AutoModel, LogitsProcessorList

import hf_spec.drafting.branching
import hf_spec.heads.drafter
from hf_spec import speculative, without_speculation
from hf_spec.drafting.tree import path_to
from hf_spec.evaluation.exactness import fit_sequences
from hf_spec.evaluation.head_training import evaluate_head, feature_dataset, train_head
from hf_spec.heads import DraftHead
from hf_spec.heads.drafter import HeadDrafter, HeadTreeDrafter
from hf_spec.heads.eagle3 import Eagle3Head

LAYER_CHOICES = {"eagle1": [-1], "fused": [0, 1, -1]}


@pytest.fixture(scope="module")
def target():
    return speculative(make_tiny_model(seed=3, vocab_size=64, num_layers=2))


@pytest.fixture(scope="module", params=[*LAYER_CHOICES, "eagle3"])
def head(request, target):
    """A `DraftHead` reading the last layer or fused layers, and an `Eagle3Head` with a draft vocabulary of half the
    ids: every test of the loop's bookkeeping runs on both architectures."""
    if request.param == "eagle3":
        head = Eagle3Head.from_target(target, aux_layers=[0, 1, 2], draft_vocab=list(range(0, 64, 2)))
        layers = head.layers
    else:
        head = DraftHead.from_target(target, feature_layers=LAYER_CHOICES[request.param])
        layers = head.decoder.get_decoder().layers
    with torch.no_grad():  # an untrained head agrees with nothing; perturb it so that its laws are its own
        generator = torch.Generator().manual_seed(1)
        for parameter in layers.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return head


def test_drafts_equal_a_from_scratch_reference_in_a_ragged_batch(target, head, monkeypatch):
    """Every round's draft laws, for every row of a left-padded batch, equal the reference: the cache, the features
    handed over by the verify pass, positions and masks are consistent across rounds and rollbacks."""
    rounds = []
    original = HeadDrafter.propose

    def recording(self, batch, num_draft_tokens, context):
        proposal = original(self, batch, num_draft_tokens, context)
        rounds.append((batch.model_ids.clone(), batch.model_mask, proposal.draft_ids, proposal.draft_probs))
        return proposal

    monkeypatch.setattr(HeadDrafter, "propose", recording)
    prompts = [torch.tensor([5, 9, 2, 6, 5, 3, 7]), torch.tensor([4, 8, 1]), torch.tensor([11, 12, 13, 14, 15])]
    width = max(len(p) for p in prompts)
    input_ids = torch.stack([F.pad(p, (width - len(p), 0)) for p in prompts])
    mask = torch.stack([F.pad(torch.ones_like(p), (width - len(p), 0)) for p in prompts])
    target.generate(input_ids, attention_mask=mask, assistant_model=head, do_sample=True, top_k=0, max_new_tokens=12,
                    num_assistant_tokens=3, pad_token_id=0, generator=torch.Generator().manual_seed(0))
    checked = 0
    for model_ids, model_mask, draft_ids, draft_probs in rounds:
        for row in range(model_ids.shape[0]):
            if draft_ids.shape[1] == 0:
                continue
            real = model_ids[row] if model_mask is None else model_ids[row][model_mask[row].bool()]
            expected = head_reference_laws(target, head, real, draft_ids[row])
            torch.testing.assert_close(draft_probs[row], expected, atol=2e-5, rtol=1e-4)
            checked += 1
    assert checked >= 6 and len(rounds) >= 3


def test_greedy_output_equals_target_only_in_a_ragged_batch(target, head):
    prompts = [torch.tensor([5, 9, 2, 6, 5, 3, 7]), torch.tensor([4, 8, 1])]
    input_ids = torch.stack([F.pad(p, (7 - len(p), 0)) for p in prompts])
    mask = torch.stack([F.pad(torch.ones_like(p), (7 - len(p), 0)) for p in prompts])
    greedy = {"attention_mask": mask, "do_sample": False, "max_new_tokens": 24, "pad_token_id": 0}
    output = target.generate(input_ids, assistant_model=head, num_assistant_tokens=4, return_dict_in_generate=True,
                             **greedy)
    with without_speculation(target):
        expected = target.generate(input_ids, **greedy)
    assert torch.equal(output.sequences, expected)
    assert output.speculative_stats.num_draft_tokens > 0


def test_a_batch_of_one_returns_a_cache_that_continues_exactly(target, head):
    prompt = torch.tensor([[5, 9, 2, 6, 5]])
    first = target.generate(prompt, assistant_model=head, do_sample=False, max_new_tokens=8,
                            return_dict_in_generate=True)
    second = target.generate(first.sequences, assistant_model=head, do_sample=False, max_new_tokens=8,
                             cache=first.cache)
    with without_speculation(target):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=16)
    assert torch.equal(second, expected)


# --- Trees from a head: each node's law from scratch, greedy equality, the returned cache. ---------------------------

def test_tree_nodes_equal_a_from_scratch_reference_in_a_padded_row(target, head, monkeypatch):
    """Every node of every round's tree (i.i.d. children, so each stored law is q given the node's ancestors) equals
    the reference: level passes under the tree mask, the head's h at each parent, the features the tree's verify
    pass hands over for the accepted path, and the rollback of the nodes' entries."""
    rounds = []
    original = HeadTreeDrafter.propose_tree

    def recording(self, batch, num_nodes, max_depth, context, branching=None):
        tree = original(self, batch, num_nodes, max_depth, context, branching)
        rounds.append((batch.model_ids.clone(), batch.model_mask, tree))
        return tree

    monkeypatch.setattr(HeadTreeDrafter, "propose_tree", recording)
    prompt, mask = torch.tensor([[0, 0, 5, 9, 2, 6, 5, 3]]), torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    target.generate(prompt, attention_mask=mask, pad_token_id=0, do_sample=True, top_k=0, max_new_tokens=14,
                    assistant_model=HeadTreeDrafter(head, branching=2, width=2, replacement=True), num_tree_nodes=7,
                    num_assistant_tokens=3, generator=torch.Generator().manual_seed(0))
    checked = 0
    for model_ids, model_mask, tree in rounds:
        real = model_ids[0][model_mask[0].bool()]
        for node in range(tree.num_nodes):
            path = path_to(tree.parents, node)
            expected = head_reference_laws(target, head, real, tree.token_ids[path])[-1]
            torch.testing.assert_close(tree.draft_probs[node], expected, atol=2e-5, rtol=1e-4)
            checked += 1
    assert len(rounds) >= 3 and max(max(tree.depths, default=0) for *_, tree in rounds) == 3 and checked >= 12


def test_greedy_head_trees_equal_target_only_and_return_a_cache_that_continues(target, head):
    prompt = torch.tensor([[5, 9, 2, 6, 5, 3, 7]])
    out = target.generate(prompt, assistant_model=head, num_tree_nodes=6, do_sample=False, max_new_tokens=16,
                          return_dict_in_generate=True)
    more = target.generate(out.sequences, assistant_model=head, num_tree_nodes=6, do_sample=False, max_new_tokens=8,
                           cache=out.cache)
    with without_speculation(target):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
    assert torch.equal(more, expected)
    assert out.speculative_stats.num_draft_tokens > 0


VOCAB = 4
NUM_SAMPLES = 3000
SETTINGS = {"temperature": 0.6, "top_k": 3, "repetition_penalty": 2.0}


@pytest.fixture(scope="module")
def small_pair():
    """A 4-token target (the exactness suite's) and an EAGLE-1 head, perturbed so that it is often rejected."""
    small = speculative(make_tiny_model(seed=10, vocab_size=VOCAB, num_layers=1, head_scale=3.0))
    head = DraftHead.from_target(small)
    with torch.no_grad():
        head.fc.weight.add_(torch.randn(head.fc.weight.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    return small, head


def sample_with_head(small, head, seed: int) -> np.ndarray:
    return small.generate(
        torch.tensor([[1, 3, 2]]).expand(NUM_SAMPLES, -1), assistant_model=head, do_sample=True,
        num_assistant_tokens=2, generator=torch.Generator().manual_seed(seed), pad_token_id=0,
        logits_processor=LogitsProcessorList([BanSuccessorOfLastToken()]), **with_length(SETTINGS),
    )[:, 3:].numpy()


@pytest.mark.parametrize("pruned", [False, True], ids=["full_vocabulary", "pruned_to_ids_0_1_3"])
def test_sampling_with_a_head_follows_the_target_law(small_pair, pruned):
    """With a pruned LM head q = 0 outside the kept ids and the residual gives the target's mass there."""
    small, head = small_pair
    if pruned:
        head = copy.deepcopy(head).prune([0, 1, 3])
    result = fit_sequences(sample_with_head(small, head, seed=1),
                           exact_law(small, SETTINGS, [BanSuccessorOfLastToken()]))
    assert result.is_consistent, result


def test_negative_control_laws_without_the_processor_chain_are_caught(small_pair, monkeypatch):
    """Broken: tokens are drawn from the processed law, but q is reported as the head's raw softmax (the chain
    forgotten in q)."""
    small, head = small_pair
    original = hf_spec.heads.drafter.draw_next

    def raw_law(logits, batch, draft_ids, context):
        next_ids, probs, is_invalid = original(logits, batch, draft_ids, context)
        return next_ids, None if probs is None else F.softmax(logits, dim=-1), is_invalid

    monkeypatch.setattr(hf_spec.heads.drafter, "draw_next", raw_law)
    result = fit_sequences(sample_with_head(small, head, seed=2),
                           exact_law(small, SETTINGS, [BanSuccessorOfLastToken()]))
    assert not result.is_consistent, result


def test_save_and_load_round_trip(target, head, tmp_path):
    head.save_pretrained(tmp_path / "head")
    kind = type(head)
    loaders = [kind.from_pretrained] + ([AutoModel.from_pretrained] if kind is DraftHead else [])
    for loaded in (load(tmp_path / "head") for load in loaders):
        assert isinstance(loaded, kind)
        assert loaded.config.feature_layers == head.config.feature_layers
        for name, tensor in head.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name
        prompt = torch.tensor([[5, 9, 2, 6]])
        settings = {"do_sample": True, "max_new_tokens": 10, "num_assistant_tokens": 3}
        ours = target.generate(prompt, assistant_model=head, generator=torch.Generator().manual_seed(4), **settings)
        theirs = target.generate(prompt, assistant_model=loaded.eval(), generator=torch.Generator().manual_seed(4),
                                 **settings)
        assert torch.equal(ours, theirs)


def test_a_head_for_another_target_is_refused_by_name(head):
    other = speculative(make_tiny_model(seed=3, vocab_size=128, num_layers=2))
    built_for = (r"`assistant_model` is an EAGLE-3 head for .*'vocabulary': 64.*'vocabulary': 128"
                 if isinstance(head, Eagle3Head) else
                 r"`assistant_model` is a draft head built for .*\(2, 64, 64\).*\(2, 64, 128\)")
    with pytest.raises(ValueError, match=built_for):
        other.generate(torch.tensor([[1, 2, 3]]), assistant_model=head, max_new_tokens=4)


def test_missing_layers_and_bad_combinations_are_refused_by_name(target, head):
    with pytest.raises(ValueError, match=r"`feature_layers` must be .* in \[-3, 2\] .* but is \[5\]"):
        DraftHead.from_target(target, feature_layers=[5])
    with pytest.raises(ValueError, match=r"`feature_layers` must be .*distinct.* but is \[-1, 2\]"):
        DraftHead.from_target(target, feature_layers=[-1, 2])
    with pytest.raises(ValueError, match=r"`num_layers` must be an integer in \[1, 2\].* but is 0"):
        DraftHead.from_target(target, num_layers=0)
    with pytest.raises(ValueError, match="`prompt_lookup_num_tokens` with a draft head"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=head, prompt_lookup_num_tokens=2,
                        num_tree_nodes=4, max_new_tokens=4)
    with pytest.raises(ValueError, match="`prompt_lookup_num_tokens` with a draft head"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=head, prompt_lookup_num_tokens=2,
                        max_new_tokens=4)


def test_an_empty_corpus_is_refused_by_name(target):
    with pytest.raises(ValueError, match="the corpus is empty"):
        feature_dataset(target, [[1]], [-1], progress=False)
    with pytest.raises(ValueError, match="`eval_dataset` is empty"):
        train_head(target, feature_dataset(target, [[1, 2, 3]], [-1], progress=False), [], "unused")


def test_training_a_few_steps_raises_agreement_and_acceptance(tmp_path):
    """A head trained on the target's own sampled continuations agrees with it more, held out, and is accepted
    more often in generate() (a target with peaked laws, as trained models have)."""
    target = speculative(make_tiny_model(seed=3, vocab_size=64, num_layers=2, head_scale=20.0))
    torch.manual_seed(0)
    prompts = torch.randint(1, 64, (48, 4))
    with without_speculation(target):
        sequences = target.generate(prompts, do_sample=True, top_k=0, max_new_tokens=28, pad_token_id=0).tolist()
    train = feature_dataset(target, sequences[:40], [-1], path=tmp_path / "features", progress=False)
    held_out = feature_dataset(target, sequences[40:], [-1], progress=False)
    with pytest.MonkeyPatch.context() as patch:  # the same call again reads the disk, not the target
        patch.setattr(type(target), "forward", lambda *args, **kwargs: pytest.fail("features recomputed"))
        assert len(feature_dataset(target, sequences[:40], [-1], path=tmp_path / "features")) == 40

    untrained = DraftHead.from_target(target).float()
    before = evaluate_head(untrained, held_out)
    trained, history = train_head(target, train, held_out, tmp_path / "head", max_steps=60, eval_steps=20,
                                  learning_rate=1e-2, disable_tqdm=True, logging_steps=20)
    after = evaluate_head(trained, held_out)
    assert after["agreement"] > before["agreement"] + 0.1, (before, after)
    assert after["acceptance"] > before["acceptance"] + 0.05, (before, after)
    assert [entry["eval_agreement"] for entry in history if "eval_agreement" in entry]

    def accepted(model):
        output = target.generate(prompts[40:], assistant_model=model, do_sample=True, max_new_tokens=16,
                                 pad_token_id=0, generator=torch.Generator().manual_seed(5),
                                 return_dict_in_generate=True)
        return output.speculative_stats.acceptance_rate

    assert accepted(trained) > accepted(untrained)
    assert isinstance(DraftHead.from_pretrained(tmp_path / "head"), DraftHead)


def test_train_head_runs_under_accelerate_launch_with_two_processes(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` on a CPU machine: two processes, gloo, one Trainer."""
    import json
    import subprocess
    import sys

    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_spec",
               "train-head", "--target", "tiny", "--output-dir", str(tmp_path / "head"), "--num-texts", "24",
               "--max-new-tokens", "16", "--max-steps", "10", "--eval-steps", "5", "--no-progress", "--threads", "1",
               "--output", str(report)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["num_processes"] == 2
    assert [point["step"] for point in result["learning_curve"]] == [5, 10]
    assert (tmp_path / "head" / "learning_curve.png").stat().st_size > 0
    assert isinstance(DraftHead.from_pretrained(tmp_path / "head"), DraftHead)


def test_a_trained_head_runs_in_hf_spec_bench_beside_the_draft(tmp_path):
    """``hf-spec train-head`` then ``hf-spec bench --draft-variants HEAD``: hf_spec's methods run on the head (its
    step cost measured), transformers' methods do not, and greedy output stays target-only's."""
    import json

    from hf_spec.cli import main

    head_dir = tmp_path / "head"
    assert main(["train-head", "--target", "tiny", "--output-dir", str(head_dir), "--num-texts", "16",
                 "--max-new-tokens", "12", "--max-steps", "4", "--eval-steps", "2", "--no-progress",
                 "--output", str(tmp_path / "train.json")]) == 0
    assert main(["bench", "--target", "tiny", "--draft", "tiny", "--prompts", "1", "--max-new-tokens", "8",
                 "--workloads", "code", "--methods", "transformers", "hf_spec", "--draft-variants", str(head_dir),
                 "--no-progress", "--output", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "bench.png")]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    methods = report["config"]["methods"]
    assert "hf_spec@head" in methods and "transformers@head" not in methods
    assert report["costs"]["code@head"]["draft_step_seconds"] > 0
    greedy = [row for row in report["results"] if row["setting"] == "greedy" and row["method"] == "hf_spec@head"]
    assert greedy and greedy[0]["identical_to_target_only"] == 1.0


def test_a_pruned_head_of_a_tied_target_saves_and_loads(tmp_path):
    """FR-Spec on a head (`DraftHead.prune`): the kept ids travel in the config, the pruned LM head in the weights,
    also for a target whose LM head is tied to its embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    tied = speculative(LlamaForCausalLM(config).eval())
    head = DraftHead.from_target(tied).prune(list(range(0, 64, 2)))
    head.save_pretrained(tmp_path)
    loaded = DraftHead.from_pretrained(tmp_path).eval()
    assert loaded.config.kept_ids == list(range(0, 64, 2))
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    prompt, settings = torch.tensor([[1, 2, 3, 4]]), {"do_sample": True, "max_new_tokens": 12}
    ours = tied.generate(prompt, assistant_model=head, generator=torch.Generator().manual_seed(0), **settings)
    theirs = tied.generate(prompt, assistant_model=loaded, generator=torch.Generator().manual_seed(0), **settings)
    assert torch.equal(ours, theirs)
    output = tied.generate(prompt, assistant_model=loaded, return_dict_in_generate=True, **settings)
    assert output.speculative_stats.num_draft_tokens > 0


def test_hf_spec_generate_takes_a_head_folder_as_the_draft(tmp_path, capsys):
    """``hf-spec generate --draft HEAD`` (and `load_pair`): the head is checked against the target and drafts."""
    import json

    from hf_spec.cli import main
    from hf_spec.loading.pair import load_pair

    head_dir = tmp_path / "head"
    assert main(["train-head", "--target", "tiny", "--output-dir", str(head_dir), "--num-texts", "16",
                 "--max-new-tokens", "12", "--max-steps", "2", "--eval-steps", "2", "--no-progress",
                 "--output", str(tmp_path / "train.json")]) == 0
    pair = load_pair("tiny", str(head_dir))
    assert isinstance(pair.draft, DraftHead) and pair.draft_path.name == "dense"
    capsys.readouterr()
    assert main(["generate", "--target", "tiny", "--draft", str(head_dir), "--max-new-tokens", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft"] == str(head_dir) and report["num_draft_tokens"] > 0
    with pytest.raises(ValueError, match="`draft_vocab` 8: a draft head keeps the output ids"):
        load_pair("tiny", str(head_dir), draft_vocab=8)


TREE_SAMPLES = int(os.environ.get("HF_SPEC_TREE_SAMPLES", "2000"))  # 20,000 for the recorded run
TREE_CASES = {"plain": ({}, []), "combined_chain": (SETTINGS, [BanSuccessorOfLastToken()])}


@pytest.fixture(scope="module")
def sharp_head(small_pair):
    """A confident head that is often wrong: where drawing a second child matters, so broken rules show."""
    head = copy.deepcopy(small_pair[1])
    with torch.no_grad():
        head.fc.weight.add_(torch.randn(head.fc.weight.shape, generator=torch.Generator().manual_seed(5)))
        head.get_output_embeddings().weight.mul_(4.0)
    return head


def sample_head_trees(small, drafter, case: str, seed: int) -> np.ndarray:
    """One generate() call per sample (trees take a batch of one row), prompt [1, 3, 2] as `exact_law`'s."""
    settings, processors = TREE_CASES[case]
    generator = torch.Generator().manual_seed(seed)
    return np.array([
        small.generate(torch.tensor([[1, 3, 2]]), assistant_model=drafter, do_sample=True, num_tree_nodes=6,
                       num_assistant_tokens=2, generator=generator, pad_token_id=0,
                       logits_processor=LogitsProcessorList(processors), **with_length(settings))[0, 3:].tolist()
        for _ in range(TREE_SAMPLES)
    ])


@pytest.mark.parametrize("case", list(TREE_CASES))
def test_sampling_with_a_head_tree_follows_the_target_law(small_pair, sharp_head, case):
    """Children drawn without replacement from a confident, often wrong head."""
    small = small_pair[0]
    samples = sample_head_trees(small, HeadTreeDrafter(sharp_head, branching=3, width=1), case, seed=3)
    result = fit_sequences(samples, exact_law(small, *TREE_CASES[case]))
    print("head tree", case, result)
    assert result.is_consistent, result


def test_negative_control_head_tree_children_reported_as_iid_are_caught(small_pair, sharp_head, monkeypatch):
    """Broken: children drawn without replacement, each reported with the full q (the i.i.d. rule's law)."""
    original = hf_spec.drafting.branching._children

    def reported_as_iid(probs, scores, count, context, replacement):
        return [(token, probs) for token, _ in original(probs, scores, count, context, False)]

    monkeypatch.setattr(hf_spec.drafting.branching, "_children", reported_as_iid)
    small = small_pair[0]
    samples = sample_head_trees(small, HeadTreeDrafter(sharp_head, branching=3, width=1), "plain", seed=4)
    result = fit_sequences(samples, exact_law(small, *TREE_CASES["plain"]))
    print("negative control, head tree children reported as i.i.d.:", result)
    assert not result.is_consistent, result
