"""The package's shape: the algorithm never imports the tools, old import paths still work, lines stay short.

The algorithm is the top of ``hf_spec/`` and ``hf_spec/drafting/``; the tools are ``loading``, ``evaluation``,
``bench`` and ``cli``. A reader can then take the loop without the tools, and a change to a tool cannot change what
the loop computes.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hf_spec
from hf_spec.moved import MOVED

ROOT = Path(hf_spec.__file__).parent
TOOLS = ("hf_spec.loading", "hf_spec.evaluation", "hf_spec.bench", "hf_spec.cli")
ALGORITHM = sorted(path for path in [*ROOT.glob("*.py"), *(ROOT / "drafting").glob("*.py")]
                   if path.name != "__main__.py")  # ``python -m hf_spec`` is the command line's entry point


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions (``from . import x`` resolved)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", ALGORITHM, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_algorithm_never_imports_the_tools(path):
    offending = sorted(name for name in imported_modules(path) if name.startswith(TOOLS))
    assert not offending, f"{path.relative_to(ROOT)} imports {offending}"


def test_the_import_check_catches_a_tool_import(tmp_path):
    """Negative control: a module importing a tool inside a function is caught."""
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from hf_spec.bench.measure import weight_bytes\n")
    assert any(name.startswith(TOOLS) for name in imported_modules(module))


def test_importing_the_algorithm_loads_no_tool():
    code = ("import sys, hf_spec, hf_spec.decoding, hf_spec.drafting; "
            f"print(sorted(m for m in sys.modules if m.startswith({TOOLS!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_old_import_paths_give_the_moved_module(old, new):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert importlib.import_module(old) is importlib.import_module(new)


def test_public_imports():
    from hf_spec.pretrained import load

    from hf_spec import AutoDraftLength, speculative, without_speculation  # noqa: F401

    assert load is importlib.import_module("hf_spec.loading.pretrained").load


def test_modules_and_functions_stay_small():
    """About 300 lines a module and 60 a function body (docstring excluded), as the style guide asks."""
    too_long = []
    for path in ROOT.rglob("*.py"):
        source = path.read_text()
        if source.count("\n") > 320:
            too_long.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                body = node.body[1:] if ast.get_docstring(node) else node.body
                if not body:
                    continue
                length = body[-1].end_lineno - body[0].lineno + 1
                if length > 60:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.name}: {length} lines")
    assert not too_long, too_long


@pytest.mark.skipif(shutil.which("ruff") is None and importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff_line_length():
    repository = ROOT.parent
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "E501", "hf_spec", "logits_processors",
                             "tests", "scripts"], cwd=repository, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
