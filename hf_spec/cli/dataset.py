"""``hf-spec generate --dataset``: one column of a dataset through speculative generation, one JSON line per row, in
as many processes as ``accelerate launch`` starts; the output is in the dataset's order and a rerun resumes.

Each line: ``{"index", "generated", "new_tokens", "prompt"}``. Beside ``--output FILE.jsonl``, the folder
``FILE.jsonl.parts`` holds ``rank-<r>.jsonl``, what process r generated (a line per row, flushed per batch), and
``stats-<r>.json``, its counts. Rows are sorted by prompt length and cut into batches the same way whatever the number
of processes (batch j goes to process j mod N, its generator seeded by ``--seed`` and its first row), so 1 and N
processes write the same file. A rerun skips every row already in FILE or a part (a line cut by an interruption is
dropped), then the main process merges the parts into FILE and removes them (docs/scale.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_spec.cli.common import load_models, log, positive_int, sampling
from hf_spec.extras import require
from hf_spec.stats import SpeculativeStats

#: The counts each process reports, summed over processes.
COUNTS = ("num_rounds", "num_draft_tokens", "num_accepted", "num_emitted")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset (generate for every row; under accelerate launch, in parallel)")
    group.add_argument("--dataset", default=None, metavar="NAME_OR_PATH",
                       help="a datasets name or folder, a .json/.jsonl/.csv/.parquet/.txt file, or humaneval; "
                            "--output then names the .jsonl file of results")
    group.add_argument("--split", default="train", help="the dataset's split")
    group.add_argument("--column", default="prompt", help="the column of prompts (a .txt file's is text)")
    group.add_argument("--num-rows", type=positive_int, default=None, help="only the first N rows")
    group.add_argument("--batch-size", type=positive_int, default=8, help="rows per generate() call (similar lengths)")


def check_arguments(args: argparse.Namespace, default_prompt: str) -> None:
    """The dataset options, before any work (``default_prompt``: ``--prompt``'s default, which a dataset replaces)."""
    if args.output is None or not args.output.endswith(".jsonl"):
        raise ValueError(f"--dataset writes one JSON line per row: --output must name a .jsonl file, got "
                         f"{args.output!r}.")
    if args.num_tree_nodes is not None and args.batch_size != 1:
        raise ValueError(f"--num-tree-nodes drafts a tree for one row, and --batch-size is {args.batch_size}: pass "
                         "--batch-size 1, or draft chains.")
    if args.prompt_ids is not None or args.prompt != default_prompt:
        raise ValueError("--prompt (or --prompt-ids) and --dataset both say what to generate from: pass one.")
    if args.compare:
        raise ValueError("--compare times one prompt against target-only decoding; it does not run with --dataset "
                         "(`hf-spec bench` compares methods over many prompts).")


def load_column(source: str, split: str, column: str) -> list[str]:
    """Every row's ``column`` (rows stay numbered as in the dataset; a value that is not text is refused by row)."""
    from hf_spec.loading.corpora import FILE_BUILDERS, load_texts

    if source in ("humaneval", "humaneval-solutions"):
        return load_texts(source)
    datasets = require("datasets", "cli", "--dataset")
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise ValueError(f"--dataset {source}: unknown file type {path.suffix!r}; use one of "
                             f"{sorted(FILE_BUILDERS)}.")
        dataset = datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path), split="train")
        column = "text" if path.suffix == ".txt" else column
    elif (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        dataset = datasets.load_from_disk(str(path))
        dataset = dataset[split] if isinstance(dataset, datasets.DatasetDict) else dataset
    else:
        dataset = datasets.load_dataset(source, split=split)
    if column not in dataset.column_names:
        raise ValueError(f"--column {column}: the dataset {source} has columns {dataset.column_names}.")
    values = dataset[column]
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise TypeError(f"--column {column}: row {index} holds {type(value).__name__}, not text.")
    return values


def read_lines(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (none when it does not exist; a line an interruption cut is dropped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def done_rows(output: Path) -> dict[int, dict]:
    """The rows written already, by index: in the merged file and in every process's part."""
    parts = sorted(parts_folder(output).glob("rank-*.jsonl"))
    return {row["index"]: row for path in (output, *parts) for row in read_lines(path)}


def check_resumable(done: dict[int, dict], texts: list[str], output: Path) -> None:
    """Rows written before were written for these prompts (a changed dataset must not mix with old answers)."""
    for index, row in sorted(done.items()):
        if index < len(texts) and row.get("prompt") != texts[index]:
            raise ValueError(f"--output {output}: row {index} was written for another prompt than the dataset's row "
                             f"{index} now: remove {output} (and {parts_folder(output)}) or choose another --output.")


def parts_folder(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def plan_batches(lengths: dict[int, int], batch_size: int) -> list[list[int]]:
    """The rows to generate, sorted by (prompt length, index) and cut into batches of ``batch_size``."""
    order = sorted(lengths, key=lambda index: (lengths[index], index))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def run(args: argparse.Namespace) -> dict | None:
    """Generate every row not written yet, this process's share of the batches; the main process merges and gets
    the job's report (the others ``None``)."""
    processes = _processes()
    rank, size = processes.process_index, processes.num_processes
    output = Path(args.output).expanduser()
    texts = load_column(args.dataset, args.split, args.column)[:args.num_rows]
    pair = load_models(args)
    tokenizer = pair.tokenizer
    done = done_rows(output)
    check_resumable(done, texts, output)
    todo = {index: text for index, text in enumerate(texts) if index not in done}
    encoded = {index: _prompt_text(text, tokenizer, args.no_chat) for index, text in todo.items()}
    lengths = {index: len(tokenizer(text, add_special_tokens=False)["input_ids"]) for index, text in encoded.items()}
    batches = plan_batches(lengths, args.batch_size)[rank::size]
    folder = parts_folder(output)
    if processes.is_main_process:
        folder.mkdir(exist_ok=True)
        for stale in folder.glob("stats-*.json"):  # an interrupted run's counts
            stale.unlink()
    processes.wait_for_everyone()  # every process read the same rows done before any writes
    part = folder / f"rank-{rank}.jsonl"
    _drop_cut_line(part)
    stats, started = [], time.perf_counter()
    with part.open("a") as stream:
        for batch in batches:
            rows, batch_stats = generate_batch(pair, [encoded[i] for i in batch], batch, args)
            stream.write("".join(json.dumps({**row, "prompt": todo[row["index"]]}) + "\n" for row in rows))
            stream.flush()
            stats.append(batch_stats)
    seconds = time.perf_counter() - started
    total = SpeculativeStats.combine(stats)
    (folder / f"stats-{rank}.json").write_text(json.dumps(
        {"rows": sum(map(len, batches)), "seconds": seconds, **{name: getattr(total, name) for name in COUNTS}}))
    processes.wait_for_everyone()
    report = summarize(folder, size, len(texts), len(done)) if processes.is_main_process else None
    if processes.is_main_process:
        merge(output, len(texts))
    processes.wait_for_everyone()
    return report


def generate_batch(pair, prompts: list[str], indices: list[int], args: argparse.Namespace
                   ) -> tuple[list[dict], SpeculativeStats]:
    """One ``generate()`` call over a batch of prompts (left-padded): a row per prompt and the call's statistics."""
    tokenizer = pair.tokenizer
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    output = pair.target.generate(
        **inputs, **pair.assistant(), num_assistant_tokens=args.num_assistant_tokens,
        num_tree_nodes=args.num_tree_nodes, generator=torch.Generator().manual_seed(args.seed + indices[0]),
        return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, max_new_tokens=args.max_new_tokens,
        **sampling(args),
    )
    stats = output.speculative_stats
    rows = []
    for row, index in enumerate(indices):
        new_ids = output.sequences[row, inputs["input_ids"].shape[1]:][:stats[row].num_emitted]
        rows.append({"index": index, "generated": tokenizer.decode(new_ids, skip_special_tokens=True),
                     "new_tokens": len(new_ids)})
    return rows, stats


def summarize(folder: Path, num_processes: int, num_rows: int, num_done_before: int) -> dict:
    """This run's counts summed over its processes, and its rows per second (the slowest process's clock)."""
    parts = [json.loads(path.read_text()) for path in sorted(folder.glob("stats-*.json"))]
    counts = {name: sum(part[name] for part in parts) for name in ("rows", *COUNTS)}
    seconds = max((part["seconds"] for part in parts), default=0.0)
    return {"rows": num_rows, "rows_done_before": num_done_before, "rows_this_run": counts["rows"],
            "processes": num_processes, "seconds": seconds,
            "rows_per_second": counts["rows"] / seconds if seconds else None,
            "acceptance_rate": counts["num_accepted"] / counts["num_draft_tokens"] if counts["num_draft_tokens"]
            else None, **{name: counts[name] for name in COUNTS}}


def merge(output: Path, num_rows: int) -> None:
    """Write ``output`` with every row in the dataset's order, then remove the parts; refuses a gap."""
    rows = done_rows(output)
    missing = [index for index in range(num_rows) if index not in rows]
    if missing:
        raise RuntimeError(f"--output {output}: rows {missing[:10]} were not generated; rerun to resume.")
    merged = output.with_name(output.name + ".merging")
    merged.write_text("".join(json.dumps(rows[index]) + "\n" for index in range(num_rows)))
    merged.replace(output)
    folder = parts_folder(output)
    for path in folder.glob("*"):
        path.unlink()
    folder.rmdir()
    log(f"wrote {num_rows} rows to {output}")


def _drop_cut_line(part: Path) -> None:
    """Truncate a part to its last complete line (an interrupted write leaves a partial one)."""
    if part.is_file():
        text = part.read_text()
        if text and not text.endswith("\n"):
            part.write_text(text[:text.rfind("\n") + 1])


def _prompt_text(text: str, tokenizer, no_chat: bool) -> str:
    """The row's text, sent as a chat message where the tokenizer has a chat template (unless ``--no-chat``)."""
    if tokenizer.chat_template and not no_chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


def _processes():
    """accelerate's process state (one process without ``accelerate launch``)."""
    from hf_spec.cli.common import training_processes

    require("accelerate", "cli", "--dataset")
    return training_processes()
