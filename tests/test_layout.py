"""The package's shape: the algorithm never imports the tools, packages import in one direction, every module names
its one purpose, the loop stays readable, and no test reaches into the loop to swap its acceptance rule.

The algorithm is the top of ``hf_spec/``, ``hf_spec/drafting/``, ``hf_spec/sizing/``, ``hf_spec/timing/`` and
``logits_processors/``; the
tools are ``heads``,
``loading``, ``evaluation``, ``bench`` and ``cli``, which import the algorithm and each other in that order only. A
reader can then take the loop without the tools, and a change to a tool cannot change what the loop computes.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_spec

ROOT = Path(hf_spec.__file__).parent
#: The tool packages, each allowed to import only the algorithm and the tools before it.
TOOLS = ("heads", "loading", "evaluation", "serving", "bench", "cli")
ENTRY_POINTS = {"__main__.py"}  # ``python -m hf_spec`` is the command line's entry point
ALGORITHM = sorted(path for path in [*ROOT.glob("*.py"), *(ROOT / "drafting").glob("*.py"),
                                     *(ROOT / "sizing").glob("*.py"), *(ROOT / "timing").glob("*.py"),
                                     *(ROOT.parent / "logits_processors").glob("*.py")]
                   if path.name not in ENTRY_POINTS)


#: The only imports of a tool by the algorithm's files: the facade's lazy ``hf_spec.DraftHead``, ``load_pair`` and
#: ``prepare_pair`` (not run at import; `test_importing_hf_spec_loads_the_algorithm_only` checks).
FACADE, LAZY_EXPORTS = ROOT / "__init__.py", {"hf_spec.heads", "hf_spec.heads.DraftHead", "hf_spec.loading",
                                               "hf_spec.loading.pair"}
#: And the saved format's loader, which builds the loading tool's layers when transformers loads a model saved on them
#: (run by ``from_pretrained``, never at import).
LAZY_IMPORTS = {FACADE: LAZY_EXPORTS, ROOT / "mixin.py": {"hf_spec.serving",
                                                            "hf_spec.serving.speculative_batching_manager"},
                ROOT / "saved_layers.py": {
    "hf_spec.loading.gguf_weights", "hf_spec.loading.gguf_weights.TYPES", "hf_spec.loading.gguf_weights.GGUFLinear",
    "hf_spec.loading.weight_only", "hf_spec.loading.weight_only.WeightOnlyLinear"}}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions (``from . import x`` resolved)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names - LAZY_IMPORTS.get(path, set())


def package_of(module: str) -> str | None:
    """``"core"`` for the algorithm, a tool's name, or ``None`` outside hf_spec."""
    parts = module.split(".")
    if parts[0] == "logits_processors":
        return "core"
    if parts[0] != "hf_spec":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in TOOLS else "core"


def package_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Package -> the packages its modules import (``files``: module name -> path)."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        source = package_of(module)
        for name in imported_modules(path):
            target = package_of(name)
            if target is not None and target != source:
                graph.setdefault(source, set()).add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph, as the list of its nodes, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == 1:
                return [*path[path.index(successor):], successor]
            if successor not in state:
                found = visit(successor, [*path, successor])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def package_files() -> dict[str, Path]:
    files = {}
    for path in [*ROOT.rglob("*.py"), *(ROOT.parent / "logits_processors").rglob("*.py")]:
        if path.name in ENTRY_POINTS or "metrics" in path.parts:  # the metric is loaded by `evaluate`, not imported
            continue
        files[".".join(path.relative_to(ROOT.parent).with_suffix("").parts)] = path
    return files


@pytest.mark.parametrize("path", ALGORITHM, ids=lambda path: str(path.relative_to(ROOT.parent)))
def test_the_algorithm_never_imports_the_tools(path):
    offending = sorted(name for name in imported_modules(path) if package_of(name) not in (None, "core"))
    assert not offending, f"{path.relative_to(ROOT.parent)} imports {offending}"


def test_the_import_check_catches_a_tool_import(tmp_path):
    """Negative control: a module importing a tool inside a function is caught."""
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from hf_spec.bench.measure import weight_bytes\n")
    assert any(package_of(name) == "bench" for name in imported_modules(module))


def runtime_imports(path: Path) -> set[str]:
    """`imported_modules` outside ``if TYPE_CHECKING:`` blocks (annotations only)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def sizing_arrows(paths) -> list[tuple[str, str]]:
    """What sizing modules import beyond themselves, `hf_spec.checks` and the standard library."""
    return sorted((path.name, name) for path in paths for name in runtime_imports(path)
                  if not (name.startswith(("hf_spec.sizing", "hf_spec.checks", "__future__"))
                          or name.split(".")[0] in sys.stdlib_module_names))


def test_sizing_runs_no_model_and_imports_no_drafter():
    """The sizers read tables and counts: no torch, no transformers, no drafter, no probe (`hf_spec.timing` fills
    their tables and imports them, never the other way round)."""
    assert sizing_arrows(sorted((ROOT / "sizing").glob("*.py"))) == []


def test_the_sizing_check_catches_a_probe_import(tmp_path):
    """Negative control: a sizer importing the timing probe, or torch, is caught; a type-only import is not."""
    module = tmp_path / "bad.py"
    module.write_text("from typing import TYPE_CHECKING\nimport torch\nif TYPE_CHECKING:\n"
                      "    from hf_spec.drafting.tree import DraftTree\n"
                      "def f():\n    from hf_spec.timing.probe import probe_costs\n")
    assert sizing_arrows([module]) == [("bad.py", "hf_spec.timing.probe"), ("bad.py", "torch")]


def test_packages_import_each_other_in_one_direction():
    graph = package_graph(package_files())
    assert find_cycle(graph) is None, f"package cycle: {find_cycle(graph)}"
    order = ("core", *TOOLS)
    backwards = sorted((source, target) for source, targets in graph.items() for target in targets
                       if order.index(target) > order.index(source))
    assert not backwards, f"imports against the order {order}: {backwards}"


def test_the_cycle_check_catches_a_cycle(tmp_path):
    """Negative control: loading -> evaluation -> loading is found."""
    (tmp_path / "a.py").write_text("from hf_spec.evaluation.corpora import load_texts\n")
    (tmp_path / "b.py").write_text("from hf_spec.loading.pretrained import load\n")
    graph = package_graph({"hf_spec.loading.a": tmp_path / "a.py", "hf_spec.evaluation.b": tmp_path / "b.py"})
    assert find_cycle(graph) in (["evaluation", "loading", "evaluation"], ["loading", "evaluation", "loading"])


def test_importing_hf_spec_loads_the_algorithm_only():
    """``import hf_spec`` (and ``generate()``'s modules) load no tool and no tool's dependency. (transformers itself
    imports accelerate when it is installed; `tests/test_install.py` runs ``generate()`` where it is not.)"""
    code = ("import sys, hf_spec, hf_spec.decoding, hf_spec.drafting; "
            "print(sorted(m for m in sys.modules if m.startswith(('hf_spec.heads', 'hf_spec.loading', "
            "'hf_spec.evaluation', 'hf_spec.bench', 'hf_spec.cli', 'matplotlib', 'datasets', 'evaluate', 'peft', "
            "'gguf', 'bitsandbytes'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_public_api():
    from hf_spec import (  # noqa: F401
        AutoDraftLength,
        AutoTreeSize,
        Drafter,
        DraftHead,
        SpeculativeDecoderOnlyOutput,
        SpeculativeEncoderDecoderOutput,
        SpeculativeStats,
        TreeDrafter,
        speculative,
        without_speculation,
    )

    assert DraftHead is importlib.import_module("hf_spec.heads.model").DraftHead
    assert not {"accept_draft_tokens", "accept_greedy", "sample_from_weights"} & set(hf_spec.__all__)


def module_purpose(path: Path) -> str | None:
    """The first sentence of a module's docstring (up to its first period or colon), or ``None`` without one."""
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    first = re.match(r"(.+?[.:])(\s|$)", docstring.split("\n\n")[0].replace("\n", " ")) if docstring else None
    return first.group(1) if first else None


def test_every_module_names_its_one_purpose():
    """What a size cap stood for: a module does one thing, and says which in its docstring's first sentence, short
    enough to hold one purpose (160 characters). A module that needs more is two modules. (No line count: a count
    that shapes commits, by moving code only to get under it, measures the wrong thing.)"""
    unnamed = []
    for path in [*ROOT.rglob("*.py"), *(ROOT.parent / "logits_processors").rglob("*.py")]:
        purpose = module_purpose(path)
        if path.name == "__main__.py" or (path.name == "__init__.py" and path.stat().st_size == 0):
            continue
        if not purpose or len(purpose) > 160 or " and also " in purpose:
            unnamed.append(f"{path.relative_to(ROOT.parent)}: {purpose!r}")
    assert not unnamed, unnamed


def test_the_purpose_check_catches_a_module_without_one(tmp_path):
    """Negative control: no docstring, or a docstring without a sentence, has no purpose."""
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text('"""decoding things, padding, printing"""\n')
    (tmp_path / "c.py").write_text('"""Rows of a batch: their\nbookkeeping.\n\nMore."""\n')
    assert module_purpose(tmp_path / "a.py") is None and module_purpose(tmp_path / "b.py") is None
    assert module_purpose(tmp_path / "c.py") == "Rows of a batch:"


def test_functions_stay_short():
    """At most 60 lines a function body (docstring excluded), as the style guide asks: a longer one hides steps that
    want names."""
    too_long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                body = node.body[1:] if ast.get_docstring(node) else node.body
                if not body:
                    continue
                length = body[-1].end_lineno - body[0].lineno + 1
                if length > 60:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.name}: {length} lines")
    assert not too_long, too_long


def sibling_imports(path: Path) -> set[str]:
    """The hf_spec modules (and packages) a module imports, at their top level below ``hf_spec``."""
    return {name.split(".")[1] for name in imported_modules(path) if name.startswith("hf_spec.")}


def test_the_loop_imports_only_what_its_steps_need():
    """``decoding.py`` is the five steps; what they need comes from at most six sibling modules (the rounds, the
    rows, the record, the forward rules, the conditioning, a sharded target's ranks), so the loop reads without the
    rest of the package."""
    assert len(sibling_imports(ROOT / "decoding.py")) <= 6, sorted(sibling_imports(ROOT / "decoding.py"))


#: The kinds a round or a draft comes in: the loop's strategy objects carry their behaviour instead.
ROUND_KINDS = {"Proposal", "DraftTree", "ChainRound", "TreeRound", "ChainRounds", "TreeRounds", "FixedDraftLength",
               "AutoDraftLength", "HeuristicDraftLength", "FixedTreeSize", "AutoTreeSize", "OnlineSizer"}


def kind_dispatches(path: Path) -> list[str]:
    """``isinstance`` calls in a module whose class argument names a round, draft or sizer kind."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if names & ROUND_KINDS:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("name", ["rounds.py", "plan.py", "decoding.py", "mixin.py"])
def test_rounds_and_plans_never_ask_what_kind_they_hold(name):
    """A round carries its own verify, accept, learn and keep steps, and a sizer its own bounds and costs: no
    ``isinstance`` on their kinds. (Checks on what a user passed, such as an `AutoTreeSize` instance given as
    ``num_tree_nodes``, are refusals and resolutions of arguments, not dispatch: only the round modules are held.)"""
    allowed = {"plan.py": {"AutoDraftLength", "AutoTreeSize"}}  # a user's instance, kept as given
    found = [line for line in kind_dispatches(ROOT / name)
             if not any(kind in line for kind in allowed.get(name, ()))]
    assert not found, found


def test_the_dispatch_check_catches_isinstance_on_a_kind(tmp_path):
    """Negative control."""
    (tmp_path / "m.py").write_text("def f(draft):\n    return isinstance(draft, Proposal)\n")
    assert kind_dispatches(tmp_path / "m.py")


def test_no_test_or_script_monkeypatches_an_acceptance_rule():
    """Negative controls pass their broken rules in (``generate(verification=...)``, one definition in
    `hf_spec.evaluation.exactness`), so what a test breaks is what the call runs, whichever rule is the default."""
    repository = ROOT.parent
    pattern = re.compile(r"setattr\(\s*hf_spec\.(rounds|verification|rejection|traversal)\s*,\s*[\"']accept|"
                         r"hf_spec\.(rounds|verification)\.accept_\w+\s*=")
    files = [*(repository / "tests").glob("*.py"), *(repository / "scripts").glob("*.py"),
             *(repository / "notebooks").glob("*.ipynb")]
    offending = [str(path.relative_to(repository)) for path in files
                 if path.name != "test_layout.py" and pattern.search(path.read_text())]
    assert not offending, offending


@pytest.mark.skipif(shutil.which("ruff") is None and importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff_line_length():
    repository = ROOT.parent
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "E501", "hf_spec", "logits_processors",
                             "tests", "scripts"], cwd=repository, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
