"""Peers of `hf-spec bench` that run outside its process: OpenVINO GenAI (its own environment) and llama.cpp's tools,
target-only and speculative, timed on the same prompts, interleaved with the other methods.

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
import tempfile
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

    def offers(self, method: str) -> bool:
        match = _METHOD.fullmatch(method)
        return match is not None and match.group(1) in self.models

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


_LLAMA_METHOD = re.compile(r"llamacpp(?:_k([1-9][0-9]*))?")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([0-9.]+) ms /\s*([0-9]+) tokens")
_EVAL = re.compile(r"\seval time =\s*([0-9.]+) ms /\s*([0-9]+) runs")
_ENCODED = re.compile(r"encoded\s+([0-9]+) tokens in\s+([0-9.]+) seconds")
_DECODED = re.compile(r"decoded\s+([0-9]+) tokens in\s+([0-9.]+) seconds")


@dataclasses.dataclass
class LlamaCppPeer:
    """llama.cpp's own tools on the pair's GGUF files: ``llamacpp`` (``llama-completion``, the target alone) and
    ``llamacpp_k<N>`` (``llama-speculative-simple`` with the draft, at most N drafted tokens), greedy, one process per
    call (its model loading is not timed: the figures are the tools' own prompt and decoding times, which is what a
    warm server pays). Built from llama.cpp's sources (docs/benchmark.md); outputs are compared with its own
    target-only output (other kernels than hf_spec's), and the speculative tool's runs may go past the token count
    (its tokens per second count them all)."""

    binaries: str
    target: str
    draft: str | None = None
    threads: int = 1

    def __post_init__(self):
        for tool in ("llama-completion", *(["llama-speculative-simple"] if self.draft else [])):
            if not os.access(Path(self.binaries) / tool, os.X_OK):
                raise ValueError(f"--llama-cpp {self.binaries!r}: no executable {tool} there (build llama.cpp's "
                                 "tools: docs/benchmark.md).")

    def methods(self, num_draft_tokens: int) -> list[str]:
        return ["llamacpp", *([f"llamacpp_k{num_draft_tokens}"] if self.draft else [])]

    def offers(self, method: str) -> bool:
        return _LLAMA_METHOD.fullmatch(method) is not None

    def reference(self, method: str) -> str:
        return "llamacpp"

    def run(self, method: str, inputs: dict, settings: dict, eos_ids: set[int], seed: int, max_new_tokens: int,
            tokenizer=None, **where) -> Run:
        if settings.get("do_sample"):
            raise ValueError(f"{method}: the llama.cpp peer runs greedy settings only here.")
        if tokenizer is None:
            raise ValueError(f"{method}: the llama.cpp peer needs the pair's tokenizer (it reads text).")
        k = _LLAMA_METHOD.fullmatch(method).group(1)
        prompt = tokenizer.decode(inputs["input_ids"][0], skip_special_tokens=False)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as file:
            file.write(prompt)
        common = ["-f", file.name, "-n", str(max_new_tokens), "-t", str(self.threads), "--temp", "0", "-c", "4096",
                  "-s", str(seed)]
        if k is None:
            command = [str(Path(self.binaries) / "llama-completion"), "-m", self.target, *common, "-no-cnv",
                       "--no-display-prompt"]
        else:
            command = [str(Path(self.binaries) / "llama-speculative-simple"), "-m", self.target, "-md", self.draft,
                       *common, "--spec-type", "draft-simple", "--spec-draft-n-max", k, "-td", str(self.threads)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        finally:
            os.unlink(file.name)
        if done.returncode != 0:
            raise RuntimeError(f"{method}: {Path(command[0]).name} exited with {done.returncode}: "
                               f"{done.stderr.strip()[-300:]}")
        seconds, new_tokens = _llama_timings(done.stderr, speculative=k is not None)
        text = done.stdout
        new_ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        return Run(method=method, seconds=seconds, new_tokens=new_tokens, target_passes=0, draft_passes=0,
                   proposed=None, accepted=None, working_memory_bytes=None, new_ids=new_ids, text=text, **where)

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *exc_info) -> None:
        pass


def _llama_timings(log: str, speculative: bool) -> tuple[float, int]:
    """``(seconds, new tokens)`` from a llama.cpp tool's log: prompt evaluation plus decoding."""
    if speculative:
        encoded, decoded = _ENCODED.search(log), _DECODED.search(log)
        if encoded is None or decoded is None:
            raise RuntimeError(f"llama-speculative-simple printed no timings: {log.strip()[-300:]}")
        return float(encoded.group(2)) + float(decoded.group(2)), int(decoded.group(1))
    prompt, generated = _PROMPT_EVAL.search(log), _EVAL.search(log)
    if prompt is None or generated is None:
        raise RuntimeError(f"llama-completion printed no timings: {log.strip()[-300:]}")
    return (float(prompt.group(1)) + float(generated.group(1))) / 1000, int(generated.group(2)) + 1


@dataclasses.dataclass
class Peers:
    """Several peers as one: each method goes to the peer that offers it."""

    members: list

    def methods(self, num_draft_tokens: int) -> list[str]:
        return [method for peer in self.members for method in peer.methods(num_draft_tokens)]

    def _owner(self, method: str):
        return next(peer for peer in self.members if peer.offers(method))

    def reference(self, method: str) -> str:
        return self._owner(method).reference(method)

    def run(self, method: str, *args, **kwargs) -> Run:
        return self._owner(method).run(method, *args, **kwargs)

    def __enter__(self) -> Peers:
        for peer in self.members:
            peer.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        for peer in self.members:
            peer.__exit__(*exc_info)
