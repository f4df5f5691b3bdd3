"""Where a speculative call's time goes, when asked: `profile_rounds`.

    with profile_rounds():
        output = model.generate(**inputs, assistant_model=draft, return_dict_in_generate=True)
    output.speculative_stats.profile  # seconds per section, summed over the call's rounds

Sections (`SECTIONS`), from timestamps at the loop's step boundaries and around every model forward pass that goes
through `hf_spec.forward` (a draft model's and the target's; a draft head's passes are timed with its drafting):

- ``draft prefill``: the draft model's first pass of the call (the prompt); ``draft forward``: its passes that feed
  one token; ``draft catch-up``: the later ones that feed more (the tokens it has not read yet: the previous round's
  last accepted token and the bonus token, or what rounds that drafted nothing skipped);
- ``drafting, other``: the rest of step 1 (the processor chain and softmax on the draft's logits, sampling, a
  head's passes, Python);
- ``target forward``: the verify pass (round 1: with the prompt's prefill);
- ``processors and acceptance``: the rest of steps 2 and 3 before the host reads the accepted counts (the processor
  chain at every block position, the softmax, the acceptance rule);
- ``host sync``: reading the accepted counts and the numerical checks back (waits for the device);
- ``stopping``: the stopping criteria (step 4, which reads the device once more);
- ``bookkeeping``: recording outputs, the sizer, commit and rollback (step 5).

``passes`` counts the forward passes of the four forward sections, so that a pass's cost in the run itself can be
set beside the cost probe's (`hf_spec.bench.formula`).

Off by default: without the context the loop takes no extra timestamps. With it, on an accelerator each boundary
synchronizes the device, so that a section holds its own kernels (and the sections no longer overlap). The context
is per thread (a ``contextvars`` variable), so a profiled call does not profile another thread's.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

import torch

SECTIONS = ("draft prefill", "draft forward", "draft catch-up", "drafting, other", "target forward",
            "processors and acceptance", "host sync", "stopping", "bookkeeping")
#: The sections that hold forward passes (`CallProfile.passes` counts them).
FORWARD_SECTIONS = ("draft prefill", "draft forward", "draft catch-up", "target forward")

_IS_PROFILING: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_spec_profiling", default=False)
_CALL: contextvars.ContextVar[CallProfile | None] = contextvars.ContextVar("hf_spec_call_profile", default=None)


@contextlib.contextmanager
def profile_rounds() -> Iterator[None]:
    """Profile the speculative ``generate()`` calls made inside the block (their ``speculative_stats.profile``)."""
    token = _IS_PROFILING.set(True)
    try:
        yield
    finally:
        _IS_PROFILING.reset(token)


class CallProfile:
    """The sections of one call (`SECTIONS`); `hf_spec.recording.RoundLog` marks the loop's boundaries,
    `timed_forward` the passes."""

    def __init__(self, target: torch.nn.Module, device: torch.device):
        self.target, self.device = target, device
        self.seconds = dict.fromkeys(SECTIONS, 0.0)
        self.passes = dict.fromkeys(FORWARD_SECTIONS, 0)
        self._forward = {"draft": 0.0, "target": 0.0}  # forward seconds inside the current section

    def sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def add_forward(self, model: torch.nn.Module, num_fed: int, seconds: float) -> None:
        if model is self.target:
            section, role = "target forward", "target"
        else:
            first = not any(self.passes[name] for name in FORWARD_SECTIONS[:3])
            section = "draft prefill" if first else "draft forward" if num_fed <= 1 else "draft catch-up"
            role = "draft"
        self.seconds[section] += seconds
        self.passes[section] += 1
        self._forward[role] += seconds

    def close_section(self, section: str, seconds: float) -> None:
        """A section's wall time less the forward passes already counted in it."""
        self.seconds[section] += max(0.0, seconds - self._forward["draft"] - self._forward["target"])
        self._forward = {"draft": 0.0, "target": 0.0}


@contextlib.contextmanager
def profiled_call(target: torch.nn.Module, device: torch.device) -> Iterator[CallProfile | None]:
    """The profile of the call that runs inside the block, or ``None`` when none was asked for."""
    if not _IS_PROFILING.get():
        yield None
        return
    profile = CallProfile(target, device)
    token = _CALL.set(profile)
    try:
        yield profile
    finally:
        _CALL.reset(token)


@contextlib.contextmanager
def timed_forward(model: torch.nn.Module, num_fed: int) -> Iterator[None]:
    """Around a model's forward pass: counted in the profiled call's sections (nothing when not profiling)."""
    profile = _CALL.get()
    if profile is None:
        yield
        return
    started = profile.sync()
    yield
    profile.add_forward(model, num_fed, profile.sync() - started)
