"""Execute notebooks on the real pair and store their outputs in the committed files.

    python scripts/run_notebooks.py                      # every notebook, real models (converted once if needed)
    python scripts/run_notebooks.py quickstart trees_and_suffix --threads 2

Each notebook runs in a fresh kernel inside a temporary folder (files it writes stay there), with
``HF_SPEC_MODELS=real``, so its parameters cell is stored as committed (``REAL_MODELS = None``). The first markdown
cell gets a line naming the machine, CPU class and date of the stored outputs; each notebook's plots are also written
to ``notebooks/images/<name>-<n>.png`` for the README. The test suite executes the same notebooks on the tiny pair in
memory and never writes them (``tests/test_notebooks.py``).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_spec.bench.measure import describe_machine, machine_info
from hf_spec.loading.pair import MODELS_VARIABLE

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
STORED = "**Stored outputs:**"
MAX_OUTPUT_BYTES = 200_000  # per output; the test suite checks the committed files against the same limit


def stored_line(seconds: float, threads: int) -> str:
    info = machine_info()
    info["threads"] = threads
    return (f"{STORED} a run on the real Qwen2.5-Coder pair, {describe_machine(info)} "
            f"({seconds / 60:.0f} min; `python scripts/run_notebooks.py` refreshes them).")


def final_states(text: str) -> str:
    """A progress bar's last state: of each line's carriage-return-separated updates, only the last."""
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))


def tidy(notebook) -> None:
    """Drop tqdm.auto's note that ipywidgets is missing; merge each cell's consecutive stream messages (a streamer
    sends one per piece of text, a progress bar one per update) and keep each bar's final state only."""
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        merged = []
        for output in cell.outputs:
            if output.output_type == "stream" and "IProgress not found" in output.text:
                continue
            if (output.output_type == "stream" and merged and merged[-1].output_type == "stream"
                    and merged[-1].name == output.name):  # a streamer's pieces, a progress bar's updates
                merged[-1].text += ("\r" if output.name == "stderr" else "") + output.text
            else:
                merged.append(output)
        for output in merged:
            if output.output_type == "stream" and output.name == "stderr":
                output.text = final_states(output.text)
        cell.outputs = merged


def run(path: Path, threads: int) -> None:
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    environment = {**os.environ, MODELS_VARIABLE: "real", "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        os.environ.update(environment)  # the kernel inherits this process's environment
        client = nbclient.NotebookClient(notebook, timeout=3 * 3600, kernel_name="python3", coalesce_streams=True,
                                         resources={"metadata": {"path": folder}})
        client.execute()
    seconds = time.perf_counter() - started
    tidy(notebook)
    header = notebook.cells[0]
    kept = [line for line in header.source.splitlines() if not line.startswith(STORED)]
    header.source = "\n".join([*kept, "", stored_line(seconds, threads)]).replace("\n\n\n", "\n\n")
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if len(json.dumps(output)) > MAX_OUTPUT_BYTES:
                raise RuntimeError(f"{path.name}: an output of {cell.source[:60]!r} is over {MAX_OUTPUT_BYTES} bytes")
    nbformat.write(notebook, path)
    images = [output["data"]["image/png"] for cell in notebook.cells for output in cell.get("outputs", [])
              if "image/png" in output.get("data", {})]
    for number, image in enumerate(images, 1):
        (NOTEBOOKS / "images").mkdir(exist_ok=True)
        (NOTEBOOKS / "images" / f"{path.stem}-{number}.png").write_bytes(base64.b64decode(image))
    print(f"{path.name}: {seconds:.0f} s, {len(images)} plots", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebook names without .ipynb (default: all)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    parser.add_argument("--tidy-only", action="store_true", help="tidy the stored outputs without running")
    args = parser.parse_args()
    paths = [NOTEBOOKS / f"{name}.ipynb" for name in args.names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    missing = [str(path) for path in paths if not path.exists()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    if args.tidy_only:
        for path in paths:
            notebook = nbformat.read(path, as_version=4)
            tidy(notebook)
            nbformat.write(notebook, path)
        return
    failed = []
    for path in paths:
        try:
            run(path, args.threads)
        except (nbclient.exceptions.CellExecutionError, RuntimeError, TimeoutError) as error:  # report, go on
            print(f"{path.name} FAILED: {str(error)[-3000:]}", flush=True)
            failed.append(path.name)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
