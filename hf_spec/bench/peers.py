"""Peers of `hf-spec bench` that run in another Python environment: OpenVINO GenAI's LLM pipeline, target-only and
speculative, on models exported by optimum-intel, timed on the same prompts, interleaved with the other methods.

OpenVINO GenAI pins its own OpenVINO and tokenizer builds, and optimum-intel its own transformers range, so they live
in an environment of their own (docs/benchmark.md says how to make it); the bench talks to
`hf_spec.bench.openvino_worker` there over a pipe, one call at a time, so the two processes never run at once. Methods
``openvino_<label>`` (the target alone) and ``openvino_<label>_k<N>`` (with its draft, ``num_assistant_tokens=N``)
for each exported pair ``label``: their greedy outputs are compared with the peer's own target-only output (other
weights and kernels than the bench's target), and their figures have no pass counts (the pipeline does not report
them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from pathlib import Path

import torch

from hf_spec.bench.report import Run

_METHOD = re.compile(r"openvino_(.+?)(?:_k([1-9][0-9]*))?")
WORKER = Path(__file__).with_name("openvino_worker.py")


@dataclasses.dataclass
class OpenVINOPeer:
    """The peer's Python and its exported pairs: label -> (target folder, draft folder or None)."""

    python: str
    models: dict[str, tuple[str, str | None]]
    threads: int = 1
    process: subprocess.Popen | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"--openvino-python {self.python!r}: not an executable Python.")
        for label, (target, draft) in self.models.items():
            for role, folder in (("target", target), ("draft", draft)):
                if folder is not None and not (Path(folder) / "openvino_model.xml").is_file():
                    raise ValueError(f"--openvino {label}: the {role} folder {folder!r} holds no openvino_model.xml "
                                     "(export it with `optimum-cli export openvino`).")

    def methods(self, num_draft_tokens: int) -> list[str]:
        """Each pair's target-only method, and its speculative one where it has a draft."""
        return [name for label, (_, draft) in self.models.items()
                for name in (f"openvino_{label}", *([f"openvino_{label}_k{num_draft_tokens}"] if draft else []))]

    def reference(self, method: str) -> str:
        """The method whose greedy output this one's is compared with: the pair's own target-only."""
        return f"openvino_{_METHOD.fullmatch(method).group(1)}"

    def generate(self, method: str, input_ids: torch.Tensor, settings: dict, eos_ids: set[int], seed: int,
                 max_new_tokens: int) -> tuple[float, list[int]]:
        """``(seconds, new ids)`` of one call; a pipeline's first call builds it (the warm-up's)."""
        label, k = _METHOD.fullmatch(method).groups()
        self._start()
        call = {"pipeline": f"{label}_draft" if k else label, "input_ids": input_ids[0].tolist(),
                "max_new_tokens": max_new_tokens, "num_assistant_tokens": int(k) if k else None,
                "eos_token_ids": sorted(eos_ids), "seed": seed,
                **{name: settings[name] for name in ("do_sample", "temperature", "top_p", "top_k", "min_new_tokens")
                   if settings.get(name) is not None}}
        self.process.stdin.write(json.dumps(call) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline() or '{"error": "the OpenVINO worker exited"}')
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer["seconds"], answer["new_ids"]

    def run(self, method: str, inputs: dict, settings: dict, eos_ids: set[int], seed: int, max_new_tokens: int,
            tokenizer=None, **where) -> Run:
        """One timed call as the bench's `Run` (new tokens counted up to and including the first end token)."""
        seconds, new_ids = self.generate(method, inputs["input_ids"], settings, eos_ids, seed, max_new_tokens)
        ends = [i for i, token in enumerate(new_ids) if token in eos_ids]
        new_ids = new_ids[:ends[0] + 1] if ends else new_ids
        return Run(method=method, seconds=seconds, new_tokens=len(new_ids), target_passes=0, draft_passes=0,
                   proposed=None, accepted=None, working_memory_bytes=None, new_ids=new_ids,
                   text=None if tokenizer is None else tokenizer.decode(new_ids, skip_special_tokens=True), **where)

    def _start(self) -> None:
        if self.process is not None:
            return
        self.process = subprocess.Popen([self.python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, bufsize=1)
        pipelines = {}
        for label, (target, draft) in self.models.items():
            pipelines[label] = {"target": target, "draft": None}
            if draft is not None:  # one speculative pipeline per pair, k set by each call
                pipelines[f"{label}_draft"] = {"target": target, "draft": draft}
        self.process.stdin.write(json.dumps({"pipelines": pipelines, "threads": self.threads}) + "\n")

    def __enter__(self) -> OpenVINOPeer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
            self.process = None

    def __getstate__(self):
        return {**self.__dict__, "process": None}
