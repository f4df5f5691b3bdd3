"""Nothing silently wrong at the edges: saved pruned drafts, count caches keyed by content, threads, packed models,
and the checks that must come before any work (each case a behaviour a user hit)."""

from __future__ import annotations

import collections
import copy
import gc
import json
import threading

import pytest
import torch
from helpers import PAD, PROMPTS, left_padded, make_noisy_copy, make_tiny_model
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from hf_spec import AutoTreeSize, speculative, without_speculation
from hf_spec.drafting.model import ModelDrafter
from hf_spec.drafting.suffix import SuffixDrafter
from hf_spec.drafting.vocabulary import prune_vocabulary
from hf_spec.heads import DraftHead
from hf_spec.loading import packed
from hf_spec.loading.tiny import build_tiny_pair, tiny_tokenizer
from hf_spec.loading.vocabulary import counts_path, draft_vocabulary, read_counts
from hf_spec.sizing.online import MAX_CHOSEN
from hf_spec.timing.probe import _PROBED, probe_costs

PROMPT = torch.tensor([[1, 2, 3, 4]])


# --- Silently wrong --------------------------------------------------------------------------------------------------

def test_a_pruned_draft_saves_as_an_ordinary_checkpoint_and_prunes_back_to_the_same_draft(tmp_path):
    target, draft = build_tiny_pair(seed=1, draft_noise=0.3)
    target = speculative(target)
    kept = list(range(0, 64, 2))
    pruned = prune_vocabulary(copy.deepcopy(draft), kept)
    pruned.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():  # the full output layer came back, not a random one
        assert torch.allclose(reloaded(PROMPT).logits, draft(PROMPT).logits)
    prune_vocabulary(reloaded, kept)
    runs = [target.generate(PROMPT, assistant_model=model, do_sample=True, max_new_tokens=30,
                            generator=torch.Generator().manual_seed(3), return_dict_in_generate=True)
            for model in (pruned, reloaded)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].speculative_stats.acceptance_rate == runs[1].speculative_stats.acceptance_rate > 0


def test_token_counts_are_keyed_by_tokenizer_and_corpus_content(tmp_path):
    tokenizer, other = tiny_tokenizer(), tiny_tokenizer()
    other.add_tokens(["zz"])  # another tokenizer under the same name
    one, two = tmp_path / "a" / "corpus.txt", tmp_path / "b" / "corpus.txt"  # two corpora, one file name
    assert counts_path(tokenizer, ["abc"], tmp_path) != counts_path(tokenizer, ["abd"], tmp_path)
    assert counts_path(tokenizer, ["abc"], tmp_path) != counts_path(other, ["abc"], tmp_path)
    draft = make_tiny_model(seed=0, vocab_size=64)
    target = make_tiny_model(seed=1, vocab_size=64)
    target.generation_config.eos_token_id = 63
    continued = counts_path(tokenizer, ["abc"], tmp_path, target=target)
    target.generation_config.eos_token_id = [63, 5]
    assert counts_path(tokenizer, ["abc"], tmp_path, target=target) != continued, "continuations end elsewhere"
    ids = draft_vocabulary(draft, tokenizer, 4, ["aaaa bbb cc"], cache=tmp_path / "fresh" / "folder", counted_on="text")
    assert set(ids) >= {tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")}
    assert list((tmp_path / "fresh" / "folder" / "token_counts").glob("*.json")), "the cache folder was made"
    assert not one.exists() and not two.exists(), "nothing is written beside a corpus or into a model folder"


@pytest.mark.parametrize("content", ["{not json", '{"source": "x"}', '{"counts": [1, 2]}', '{"counts": {"a": 1}}',
                                     '"text"'])
def test_a_corrupt_count_file_names_the_file_and_the_fix(tmp_path, content):
    path = tmp_path / "counts.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{path}.*delete it"):
        read_counts(path)


def test_counts_from_another_tokenizer_are_refused_naming_the_file(tmp_path):
    tokenizer = tiny_tokenizer()
    path = counts_path(tokenizer, ["abc"], tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"source": "x", "counts": {"5": 3, "900": 2}}))
    with pytest.raises(ValueError, match=f"{path}.*outside the draft's 64 output ids.*Delete the file"):
        draft_vocabulary(make_tiny_model(seed=0, vocab_size=64), tokenizer, 4, ["abc"], cache=tmp_path,
                         counted_on="text")


def test_a_pruned_vocabulary_keeps_first_what_the_target_emits_then_the_corpus_counts(tmp_path):
    """The default ranking: the ids of the target's own greedy continuations of the corpus's windows (counted as a
    batch-of-one greedy run of each window gives them), then the corpus's most frequent ids; the corpus's counts alone
    miss what the target emits. The continuation counts are cached per target."""
    from hf_spec.loading.vocabulary import continuation_counts, eos_token_ids, token_counts

    tokenizer, target = tiny_tokenizer(), make_tiny_model(seed=0, vocab_size=64)
    texts = ["aaaa aaaa\nbbbb bbbb\nab ab ab", "aaab\nabab abab\nbbbb", "abba\nbaba baba\naaaa"]
    counts = continuation_counts(target, tokenizer, texts, progress=False)  # 64 tokens after each text's window
    eos = eos_token_ids(target) or {tokenizer.eos_token_id}
    expected = collections.Counter()
    for text in texts:
        window = tokenizer(text[text.find("\n", len(text) // 2) + 1:], return_tensors="pt",
                           add_special_tokens=False)["input_ids"][:, :96]
        row = target.generate(window, max_new_tokens=64, do_sample=False, pad_token_id=0)[0, window.shape[1]:]
        ends = [i for i, token in enumerate(row.tolist()) if token in eos]
        expected.update(row.tolist()[: ends[0] + 1] if ends else row.tolist())
    assert counts == expected and set(counts) - {tokenizer.convert_tokens_to_ids(c) for c in "ab \n"}
    always = set(tokenizer.all_special_ids) | eos
    size = len(set(counts) | always)
    kept = draft_vocabulary(target, tokenizer, size, texts, cache=tmp_path, target=target)
    assert set(kept) == set(counts) | always
    in_text = token_counts(tokenizer, texts)
    next_in_text = min((token for token in in_text if token not in kept), key=lambda t: (-in_text[t], t))
    assert set(draft_vocabulary(target, tokenizer, size + 1, texts, cache=tmp_path, target=target)) == {
        *kept, next_in_text}
    by_text = draft_vocabulary(target, tokenizer, size, texts, cache=tmp_path, counted_on="text")
    assert set(counts) - set(by_text), "the corpus alone ranks what the target emits lower"
    cached = sorted((tmp_path / "token_counts").glob("*-continuations-*.json"))
    assert len(cached) == 1
    draft_vocabulary(target, tokenizer, size, texts, cache=tmp_path, target=make_tiny_model(seed=1, vocab_size=64))
    assert len(sorted((tmp_path / "token_counts").glob("*-continuations-*.json"))) == 2, "another target, other counts"
    with pytest.raises(ValueError, match="`counted_on='continuations'` counts the target's own continuations"):
        draft_vocabulary(target, tokenizer, size, texts, cache=tmp_path)
    with pytest.raises(ValueError, match="`counted_on` must be one of"):
        draft_vocabulary(target, tokenizer, size, texts, cache=tmp_path, target=target, counted_on="emitted")


def _dense(model):
    """On the dense path with oneDNN switched per pass (what `optimize` picks on some CPUs)."""
    packed.optimize(model, path="dense")
    return model


def test_two_threads_generating_with_optimized_models_leave_the_onednn_flag_alone():
    target, draft = build_tiny_pair(seed=2, draft_noise=0.3)
    target, draft = speculative(_dense(target)), _dense(draft)
    expected = target.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=24)
    before = torch.backends.mkldnn.enabled
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(target.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=24))
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 10
    assert all(torch.equal(result, expected) for result in results)
    assert torch.backends.mkldnn.enabled == before


def test_without_speculation_holds_for_its_own_thread_only():
    target, draft = build_tiny_pair(seed=3)
    target = speculative(target)
    ids, mask = left_padded(PROMPTS)
    inside, outside = threading.Event(), threading.Event()
    found = {}

    def plain():
        with without_speculation(target):
            inside.set()
            outside.wait(timeout=60)

    thread = threading.Thread(target=plain)
    thread.start()
    inside.wait(timeout=60)
    output = target.generate(ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=6,
                             pad_token_id=PAD, return_dict_in_generate=True)  # a batch: transformers would refuse
    found["stats"] = output.speculative_stats
    outside.set()
    thread.join()
    assert found["stats"].num_rounds > 0


def test_a_packed_model_refuses_training_and_dtype_changes_by_name():
    model = make_tiny_model(seed=0)
    packed.optimize(model, path="packed")
    with pytest.raises(RuntimeError, match="deoptimize"):
        model.train()
    with pytest.raises(RuntimeError, match="deoptimize"):
        model.half()
    packed.deoptimize(model)
    model.train()  # fine again
    assert len(list(model.parameters())) == len(list(make_tiny_model(seed=0).parameters()))


# --- Checks before the work ------------------------------------------------------------------------------------------

def test_one_drafter_instance_in_two_concurrent_calls_is_refused_by_name():
    target, _ = build_tiny_pair(seed=4)
    target = speculative(target)
    started, release = threading.Event(), threading.Event()
    drafter = SuffixDrafter()
    original = drafter.propose_tree
    errors = []

    def slow(*args, **kwargs):
        started.set()
        release.wait(timeout=60)
        return original(*args, **kwargs)

    drafter.propose_tree = slow
    thread = threading.Thread(target=lambda: target.generate(PROMPT, assistant_model=drafter, num_tree_nodes=4,
                                                             max_new_tokens=3))
    thread.start()
    started.wait(timeout=60)
    try:
        target.generate(PROMPT, assistant_model=drafter, num_tree_nodes=4, max_new_tokens=3)
    except RuntimeError as error:
        errors.append(str(error))
    release.set()
    thread.join()
    assert errors and "in use by another generate() call" in errors[0]
    target.generate(PROMPT, assistant_model=drafter, num_tree_nodes=4, max_new_tokens=3)  # free again


@pytest.mark.parametrize("corpus, message", [
    ("abc", "a list of token-id sequences"), (torch.tensor([1, 2, 3]), "a list of token-id sequences"),
    ([[1, -2]], "negative"), ([[1.5, 2.0]], "integer"), ([[[1, 2]]], "1-D"),
])
def test_a_bad_suffix_corpus_is_refused_when_the_drafter_is_built(corpus, message):
    with pytest.raises(ValueError, match=message):
        SuffixDrafter(corpus=corpus)


def test_suffix_corpus_ids_past_the_vocabulary_are_refused_before_generation():
    target, _ = build_tiny_pair(seed=4)
    with pytest.raises(ValueError, match="`corpus` holds id 99.*64 ids"):
        speculative(target).generate(PROMPT, assistant_model=SuffixDrafter(corpus=[[1, 99]]), num_tree_nodes=4,
                                     max_new_tokens=3)


def _gpt2(positions: int, seed: int = 0):
    config = GPT2Config(vocab_size=64, n_positions=positions, n_embd=64, n_layer=1, n_head=4, bos_token_id=0,
                        eos_token_id=None)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def test_a_draft_position_table_that_fits_exactly_is_accepted():
    """A call of max_length L feeds the draft positions up to L - 3: a table of L - 2 fits, L - 3 does not."""
    target = speculative(_gpt2(64, seed=1))
    max_new = 20
    length = PROMPT.shape[1] + max_new
    target.generate(PROMPT, assistant_model=_gpt2(length - 2), do_sample=False, max_new_tokens=max_new)
    with pytest.raises(ValueError, match="table of .* learned positions"):
        target.generate(PROMPT, assistant_model=_gpt2(length - 3), do_sample=False, max_new_tokens=max_new)


def test_the_cost_probe_and_optimize_fit_a_short_position_table():
    short = speculative(_gpt2(24, seed=2))
    packed.optimize(short)  # a 64-token timing prefix would not fit
    short.generate(PROMPT, assistant_model=_gpt2(24, seed=3), num_tree_nodes="auto", max_new_tokens=6)
    short.generate(PROMPT, assistant_model=_gpt2(24, seed=3), num_assistant_tokens="auto", max_new_tokens=6)


def test_the_probe_is_capped_by_the_call_and_a_ladder_of_sizes(monkeypatch):
    target, draft = build_tiny_pair(seed=5)
    asked = []
    monkeypatch.setattr("hf_spec.rounds.probe_costs",
                        lambda target, drafter, sizes, **kwargs: asked.append(sizes) or probe_costs(
                            target, drafter, sizes, **kwargs))
    speculative(target).generate(PROMPT, prompt_lookup_num_tokens=200, num_assistant_tokens="auto",
                                 max_new_tokens=10)
    speculative(target).generate(PROMPT, assistant_model=draft, num_tree_nodes=AutoTreeSize(max_nodes=500),
                                 max_new_tokens=10)
    assert all(max(sizes) <= 12 and len(sizes) <= 9 for sizes in asked), asked


def test_the_cost_cache_holds_models_weakly():
    target = make_tiny_model(seed=0)
    draft = make_tiny_model(seed=1)
    probe_costs(target, ModelDrafter(draft), (2,))
    assert len(_PROBED[target]) == 1
    del draft
    gc.collect()
    probe_costs(target, ModelDrafter(make_tiny_model(seed=2)), (2,))
    assert len(_PROBED[target]) == 1, "the freed draft's costs went with it"


def test_a_reused_sizer_keeps_a_bounded_history():
    sizer = AutoTreeSize()
    for _ in range(MAX_CHOSEN + 10):
        sizer._chose(3)
    assert len(sizer.chosen) == MAX_CHOSEN


@pytest.mark.parametrize("kwargs, message", [({"repeats": 0}, "`repeats` must be a positive integer"),
                                             ({"widths": [1, 500]}, "`widths` must be token counts in \\[1, 64\\]")])
def test_optimize_refuses_bad_settings_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        packed.optimize(make_tiny_model(seed=0), **kwargs)


def test_a_head_folder_without_its_config_is_named(tmp_path):
    with pytest.raises(OSError, match="config.json"):
        DraftHead.from_pretrained(tmp_path)
    from hf_spec.heads.model import DraftHeadConfig

    with pytest.raises(ValueError, match="no decoder settings"):  # a config.json that save_pretrained did not write
        DraftHead(DraftHeadConfig.from_dict({"model_type": "hf_spec_draft_head"}))
    head = DraftHead.from_target(make_tiny_model(seed=0))
    with pytest.raises(ValueError, match="integer token ids"):
        head.prune([1.5, 2.7])


def test_noisy_copies_are_independent():
    target = make_tiny_model(seed=0)
    assert not torch.equal(make_noisy_copy(target, 1, 0.1).lm_head.weight, target.lm_head.weight)
