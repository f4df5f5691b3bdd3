"""``pip install hf_spec`` without extras: ``generate()`` runs on torch, transformers and numpy alone, importing
hf_spec loads none of the tools' dependencies, and a tool names the extra it needs in one line.

It builds a bare virtual environment (torch from the build this machine keeps, then ``pip install .``), which takes a
few minutes: ``.ci/run`` sets ``HF_SPEC_INSTALL_TEST=1`` to run it.
"""

from __future__ import annotations

import os
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
