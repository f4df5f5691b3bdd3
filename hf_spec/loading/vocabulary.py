"""Which ids a pruned draft keeps (FR-Spec, `hf_spec.drafting.vocabulary`): the ids the target itself emits, counted
on its continuations of a corpus's texts, then the corpus's own counts; both cached.

By default (``counted_on="continuations"``, FR-Spec's advice) the ranking is by how often the *target* emits each id
when it continues, greedily, windows of the corpus's texts (`continuation_counts`): the drafted tokens a pruned draft
must keep are the ones the target accepts. Those counts cover a few thousand tokens, so ties and the ids the target
never emitted are ranked by their count in the corpus itself. ``counted_on="text"`` ranks by the corpus counts alone.
Places left when no count reaches ``size`` ids go to the lowest ids not in yet (`frequent_token_ids`).

The counts of a corpus under a tokenizer are computed once (`token_counts`, through ``datasets``) and kept in
``$HF_SPEC_CACHE/token_counts/`` under a name made of two hashes: of the tokenizer (its whole serialized form:
vocabulary, merges, normalizer) and of the corpus's texts. So two corpora that share a file name, or two tokenizers
that share a Hub id's folder, never share counts, and nothing is written into a model's own folder. A count file that
cannot be read, or that holds ids the draft does not have, is an error that names the file and how to fix it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from hf_spec.checks import check_int
from hf_spec.extras import require
from hf_spec.loading.corpora import load_texts
from hf_spec.loading.pretrained import cache_dir


def eos_token_ids(model: PreTrainedModel) -> set[int]:
    """The ids that end ``model``'s generations (its ``generation_config.eos_token_id``)."""
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, list) else [eos])


#: What a pruned vocabulary's ranking may be counted on (`draft_vocabulary`).
COUNTED_ON = ("continuations", "text")


def draft_vocabulary(draft: PreTrainedModel, tokenizer, size: int, corpus: str | list[str],
                     cache: Path | None = None, *, target: PreTrainedModel | None = None,
                     counted_on: str = "continuations") -> list[int]:
    """The ``size`` ids the draft keeps, with the tokenizer's special ids and the draft's EOS always in: the ids
    ``target`` emits most often in its greedy continuations of windows of ``corpus`` (a `hf_spec.loading.corpora`
    name or file, or the texts themselves; `continuation_counts`), then the most frequent in ``corpus`` itself
    (``counted_on="text"``: those alone).

    Raises:
        ValueError: ``size`` is not a positive integer; ``counted_on`` is not one of `COUNTED_ON`, or is
            ``"continuations"`` without a ``target``; a cached count file is unreadable or holds ids past the draft's
            output layer (the error names the file).
    """
    check_int("draft_vocab", size)
    if counted_on not in COUNTED_ON:
        raise ValueError(f"`counted_on` must be one of {COUNTED_ON}, but is {counted_on!r}.")
    if counted_on == "continuations" and target is None:
        raise ValueError("`counted_on='continuations'` counts the target's own continuations: pass `target`.")
    num_ids = draft.get_output_embeddings().out_features
    if tokenizer is None:  # the tiny pair without a tokenizer: no text to count
        return list(range(min(size, num_ids)))
    texts = load_texts(corpus) if isinstance(corpus, str) else list(corpus)
    source = corpus if isinstance(corpus, str) else f"{len(texts)} texts"
    path = counts_path(tokenizer, texts, cache)
    counts = _cached(path, lambda: token_counts(tokenizer, texts), source, num_ids)
    emitted = collections.Counter()
    if counted_on == "continuations":
        path = counts_path(tokenizer, texts, cache, target=target)
        emitted = _cached(path, lambda: continuation_counts(target, tokenizer, texts), f"continuations of {source}",
                          num_ids)
    always = set(tokenizer.all_special_ids) | eos_token_ids(draft)
    return frequent_token_ids(emitted, size, always=sorted(token for token in always if token < num_ids),
                              then_by=counts, num_ids=num_ids)


def _cached(path: Path, count, source: str, num_ids: int) -> collections.Counter:
    """The counts kept at ``path``, or ``count()`` written there; refused when they hold ids past ``num_ids``."""
    counts = read_counts(path) if path.exists() else None
    if counts is None:
        counts = count()
        write_counts(counts, path, source)
    beyond = [token for token in counts if not 0 <= token < num_ids]
    if beyond:
        raise ValueError(f"The token counts in {path} hold ids {sorted(beyond)[:5]} outside the draft's "
                         f"{num_ids} output ids: they were counted with another tokenizer. Delete the file to count "
                         "again.")
    return counts


@torch.no_grad()
def continuation_counts(target: PreTrainedModel, tokenizer, texts: list[str], num_prompts: int = 64,
                        prompt_tokens: int = 96, new_tokens: int = 64, batch_size: int = 16,
                        progress: bool = True) -> collections.Counter:
    """How often ``target`` emits each id when it continues, greedily, ``num_prompts`` windows of ``texts``: texts
    spread evenly over the list, each window the ``prompt_tokens`` tokens from the first line start after the text's
    middle (``new_tokens`` each, in left-padded batches; a row's count stops at its first EOS)."""
    from tqdm.auto import tqdm

    count = min(num_prompts, len(texts))
    picked = [texts[round(i * (len(texts) - 1) / max(1, count - 1))] for i in range(count)]  # evenly spread
    windows = []
    for text in picked:
        start = text.find("\n", len(text) // 2) + 1
        ids = tokenizer(text[start:] or text, add_special_tokens=False)["input_ids"][:prompt_tokens]
        windows += [ids] if ids else []
    if not windows:
        raise ValueError("No text to continue: the corpus is empty.")
    eos = eos_token_ids(target) or {tokenizer.eos_token_id}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    counts = collections.Counter()
    for start in tqdm(range(0, len(windows), batch_size), desc="target continuations", disable=not progress):
        rows = windows[start: start + batch_size]
        width = max(map(len, rows))
        input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=target.device)
        output = target.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=sorted(eos))
        for row in output[:, width:].tolist():
            ends = [i for i, token in enumerate(row) if token in eos]
            counts.update(row[: ends[0] + 1] if ends else row)
    return counts


def counts_path(tokenizer, texts: list[str], cache: Path | None = None, target: PreTrainedModel | None = None) -> Path:
    """Where the counts of ``texts`` under ``tokenizer`` (with ``target``: of its continuations of them) are kept:
    keyed by what they hold (the target's config, a checksum of its weights and the ids that end its continuations),
    not by their names."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    serialized = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    tokenizer_hash = hashlib.sha256(f"{type(tokenizer).__name__}\n{serialized}".encode()).hexdigest()[:16]
    corpus_hash = hashlib.sha256()
    for text in texts:
        corpus_hash.update(hashlib.sha256(text.encode(errors="replace")).digest())
    name = f"{tokenizer_hash}-{corpus_hash.hexdigest()[:16]}"
    if target is not None:
        ends = ",".join(map(str, sorted(eos_token_ids(target))))
        name += "-continuations-" + model_fingerprint(target) + "-" + hashlib.sha256(ends.encode()).hexdigest()[:8]
    return (cache or cache_dir()) / "token_counts" / f"{name}.json"


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short hash of ``model``'s config and of a sample of its weights (two models under one name differ)."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for _, parameter in list(model.named_parameters())[:: 16]:
        dense = parameter.to_dense() if parameter.is_mkldnn else parameter  # packed (`hf_spec.loading.packed`)
        sample = dense.detach().flatten()[:: max(1, parameter.numel() // 256)][:256].float().cpu()
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def token_counts(tokenizer, texts: Iterable[str]) -> collections.Counter:
    """How often each token id occurs in ``texts``, tokenized with ``datasets`` (batched, cached by fingerprint)."""
    datasets = require("datasets", "cli", "Counting tokens for a pruned draft vocabulary (`draft_vocab`)")

    texts = [text for text in texts if text]
    if not texts:
        raise ValueError("No text to count tokens in: the corpus is empty.")
    dataset = datasets.Dataset.from_dict({"text": texts})
    ids = dataset.map(lambda batch: {"ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"]},
                      batched=True, remove_columns=["text"], desc="counting tokens")
    counts = collections.Counter()
    for row in ids["ids"]:
        counts.update(row)
    return counts


def frequent_token_ids(counts: collections.Counter, size: int, always: Iterable[int] = (),
                       then_by: collections.Counter | None = None, num_ids: int | None = None) -> list[int]:
    """The ``size`` most frequent ids (ties by their count in ``then_by``, then by id; ids only ``then_by`` holds
    come after), with the ``always`` ids (EOS and other special tokens) in. With ``num_ids``, the places no count
    fills go to the lowest ids below it that are not in yet: BPE tokenizers number their tokens in merge order, so a
    lower id was merged from a more frequent pair."""
    check_int("draft_vocab", size)
    always = list(dict.fromkeys(always))
    then_by = then_by or collections.Counter()
    ranked = [token for token in sorted(set(counts) | set(then_by), key=lambda t: (-counts[t], -then_by[t], t))
              if token not in always]
    if size < len(always):
        raise ValueError(f"`draft_vocab` ({size}) must be at least the {len(always)} special ids kept always.")
    kept = always + ranked[: size - len(always)]
    if num_ids is not None and len(kept) < size:
        taken = set(kept)
        kept += [token for token in range(num_ids) if token not in taken][: size - len(kept)]
    return sorted(kept)


def write_counts(counts: collections.Counter, path: Path, source: str) -> None:
    """Write a frequency table (JSON: the corpus it came from, and id -> count), atomically (a unique temporary
    file renamed into place), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"source": source, "counts": {str(k): v for k, v in counts.most_common()}})
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        out.write(text)
    os.replace(temporary, path)


def read_counts(path: Path) -> collections.Counter:
    """A frequency table written by `write_counts`; a clear error naming the file when it is not one."""
    try:
        table = json.loads(Path(path).read_text())
        counts = table["counts"]
        if not isinstance(counts, dict):
            raise TypeError("`counts` is not a mapping")
        result = collections.Counter({int(token): int(count) for token, count in counts.items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"The token-count file {path} cannot be read ({type(error).__name__}: {error}); delete it "
                         "and the counts are made again.") from None
    if any(count < 0 for count in result.values()):
        raise ValueError(f"The token-count file {path} holds negative counts; delete it and the counts are made again.")
    return result
