"""Which ids a pruned draft keeps (FR-Spec, `hf_spec.drafting.vocabulary`): token counts over a corpus, cached.

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

from transformers import PreTrainedModel

from hf_spec.checks import check_int
from hf_spec.extras import require
from hf_spec.loading.corpora import load_texts
from hf_spec.loading.pretrained import cache_dir


def eos_token_ids(model: PreTrainedModel) -> set[int]:
    """The ids that end ``model``'s generations (its ``generation_config.eos_token_id``)."""
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, list) else [eos])


def draft_vocabulary(draft: PreTrainedModel, tokenizer, size: int, corpus: str | list[str],
                     cache: Path | None = None) -> list[int]:
    """The ``size`` ids the draft keeps: the most frequent in ``corpus`` (a `hf_spec.loading.corpora` name or file,
    or the texts themselves), with the tokenizer's special ids and the draft's EOS always in.

    Raises:
        ValueError: ``size`` is not a positive integer; a cached count file is unreadable or holds ids past the
            draft's output layer (the error names the file).
    """
    check_int("draft_vocab", size)
    num_ids = draft.get_output_embeddings().out_features
    if tokenizer is None:  # the tiny pair without a tokenizer: no text to count
        return list(range(min(size, num_ids)))
    texts = load_texts(corpus) if isinstance(corpus, str) else list(corpus)
    path = counts_path(tokenizer, texts, cache)
    counts = read_counts(path) if path.exists() else None
    if counts is None:
        counts = token_counts(tokenizer, texts)
        write_counts(counts, path, corpus if isinstance(corpus, str) else f"{len(texts)} texts")
    beyond = [token for token in counts if not 0 <= token < num_ids]
    if beyond:
        raise ValueError(f"The token counts in {path} hold ids {sorted(beyond)[:5]} outside the draft's "
                         f"{num_ids} output ids: they were counted with another tokenizer. Delete the file to count "
                         "again.")
    always = set(tokenizer.all_special_ids) | eos_token_ids(draft)
    return frequent_token_ids(counts, size, always=sorted(token for token in always if token < num_ids))


def counts_path(tokenizer, texts: list[str], cache: Path | None = None) -> Path:
    """Where the counts of ``texts`` under ``tokenizer`` are kept: keyed by what both hold, not by their names."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    serialized = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    tokenizer_hash = hashlib.sha256(f"{type(tokenizer).__name__}\n{serialized}".encode()).hexdigest()[:16]
    corpus_hash = hashlib.sha256()
    for text in texts:
        corpus_hash.update(hashlib.sha256(text.encode(errors="replace")).digest())
    return (cache or cache_dir()) / "token_counts" / f"{tokenizer_hash}-{corpus_hash.hexdigest()[:16]}.json"


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


def frequent_token_ids(counts: collections.Counter, size: int, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` most frequent ids (ties by id), with the ``always`` ids (EOS and other special tokens) in."""
    check_int("draft_vocab", size)
    always = list(dict.fromkeys(always))
    ranked = [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
              if token not in always]
    if size < len(always):
        raise ValueError(f"`draft_vocab` ({size}) must be at least the {len(always)} special ids kept always.")
    return sorted(always + ranked[: size - len(always)])


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
