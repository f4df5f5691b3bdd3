"""Every code block in the README and the docs runs, on the tiny pair.

Python blocks of one page run in order, each in a fresh interpreter with nothing added (a block copied alone must
run: it imports what it uses and defines what it reads; files an earlier block wrote stay);
``hf-spec`` commands in bash blocks run through the command line. ``$HF_SPEC_MODELS=tiny`` makes `load_pair` and
the command line load the built-in tiny pair whatever names a block gives, so the examples that load the real pair
run in seconds here and as written elsewhere. A block that cannot run here (an install command, a GPU, a multi-GPU
launch, a server) carries ``<!-- not run: why -->`` on the line after it; that marker needs its reason.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```\n(<!-- not run: (.*?) -->)?", re.DOTALL | re.MULTILINE)


def blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """``(language, code, reason it is not run or None)`` of every fenced block on a page."""
    return [(match[1], match[2], match[4]) for match in FENCE.finditer(page.read_text())]


def environment() -> dict:
    return {**os.environ, "HF_SPEC_MODELS": "tiny", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1"}  # one thread, as the tests: set outside the code, not added to it


def test_every_page_has_blocks_and_every_skip_says_why():
    for page in PAGES:
        for language, _, reason in blocks(page):
            assert language in ("python", "bash", "text"), f"{page.name}: a {language} block"
            assert reason is None or reason.strip(), f"{page.name}: a `not run` marker without a reason"
    assert sum(reason is None for page in PAGES for _, _, reason in blocks(page)) >= 20


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_the_python_blocks_of_a_page_run(page, tmp_path):
    code = [code for language, code, reason in blocks(page) if language == "python" and reason is None]
    if not code:
        pytest.skip("no python block")
    for number, block in enumerate(code, start=1):
        script = tmp_path / f"block{number}.py"
        script.write_text(block)
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environment(), capture_output=True,
                                text=True, timeout=900, check=False)
        assert result.returncode == 0, f"{page.name}, python block {number}:\n{result.stderr[-4000:]}"


def commands(page: Path) -> list[str]:
    """The ``hf-spec`` command lines of a page's bash blocks that are run (backslash continuations joined)."""
    found = []
    for language, code, reason in blocks(page):
        if language != "bash" or reason is not None:
            continue
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if not line:
                continue
            assert line.startswith("hf-spec "), f"{page.name}: a command the suite cannot run: {line!r}"
            found.append(line)
    return found


@pytest.mark.parametrize("page", [page for page in PAGES if commands(page)], ids=lambda page: page.name)
def test_the_commands_of_a_page_run(page, tmp_path):
    for line in commands(page):
        argv = shlex.split(line)[1:]
        result = subprocess.run([sys.executable, "-m", "hf_spec", *argv, "--threads", "1"] if argv[0] != "--version"
                                else [sys.executable, "-m", "hf_spec", *argv], cwd=tmp_path, env=environment(),
                                capture_output=True, text=True, timeout=900, check=False)
        assert result.returncode == 0, f"{page.name}: {line}\n{result.stderr[-3000:]}"
