"""The notebooks: committed with the outputs of a real-model run, and executed top to bottom on the tiny pair.

The committed files carry what `scripts/run_notebooks.py` stored from a run on the real Qwen pair (the machine and
date in each first cell), so they read without running. The suite executes each one in a fresh kernel on the tiny
pair: a cell ``REAL_MODELS = False; THREADS = 1`` is inserted after the ``parameters`` cell, as papermill would,
``$HF_SPEC_MODELS`` says ``tiny`` too, and it runs in its own temporary folder, in memory: the committed file is never
written (checked byte for byte) and nothing is downloaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_spec.loading.pair import MODELS_VARIABLE

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
EXPECTED = {"quickstart", "exactness", "draft_distillation", "quantized_target", "benchmark", "trees_and_suffix",
            "draft_heads"}
WITH_PLOTS = EXPECTED - {"quickstart"}
MAX_OUTPUT_BYTES = 200_000  # as scripts/run_notebooks.py
MAX_FILE_BYTES = 1_000_000


def outputs(notebook):
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


def test_every_planned_notebook_is_there():
    assert {path.stem for path in NOTEBOOKS} == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_committed_notebooks_carry_a_real_run(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    parameters = [cell for cell in code if "parameters" in cell.metadata.get("tags", [])]
    assert len(parameters) == 1 and "REAL_MODELS = None" in parameters[0].source
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "run top to bottom, then commit"
    stored = re.search(r"\*\*Stored outputs:\*\* a run on the real Qwen2\.5-Coder pair, (.+?) \((AMX|AVX512-BF16|"
                       r"AVX512|AVX2|other)\), (\d+) threads, .*(\d{4}-\d\d-\d\d)", notebook.cells[0].source)
    assert stored, "the first cell names the machine, CPU class and date of the stored outputs"
    texts = "".join(output.get("text", "") for output in outputs(notebook))
    assert "models: the real Qwen2.5-Coder pair" in texts
    assert "random tiny models" not in texts and "tiny random-weight pair" not in texts
    assert not [output for output in outputs(notebook) if output.output_type == "error"]
    assert all(len(json.dumps(output)) <= MAX_OUTPUT_BYTES for output in outputs(notebook))
    assert path.stat().st_size <= MAX_FILE_BYTES
    images = [output for output in outputs(notebook) if "image/png" in output.get("data", {})]
    assert bool(images) == (path.stem in WITH_PLOTS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_top_to_bottom_on_the_tiny_pair(path, tmp_path, monkeypatch):
    committed = path.read_bytes()
    notebook = nbformat.reads(committed.decode(), as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    index = next(i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", []))
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell("REAL_MODELS = False\nTHREADS = 1"))
    monkeypatch.setenv(MODELS_VARIABLE, "tiny")  # the kernel inherits it
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    assert not [output for output in outputs(notebook) if output.output_type == "error"]
    texts = "".join(output.get("text", "") for output in outputs(notebook))
    assert "models: the tiny random-weight pair (REAL_MODELS = False in the parameters cell)" in texts
    images = [output for output in outputs(notebook) if "image/png" in output.get("data", {})]
    assert bool(images) == (path.stem in WITH_PLOTS)
    assert path.read_bytes() == committed, "executing a notebook must not write its committed file"
