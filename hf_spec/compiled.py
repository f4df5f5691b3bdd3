"""Compiled forward passes on the static-cache path: ``generate(..., cache_implementation="static",
compile_config=CompileConfig(...))``.

The target's verify passes and a draft model's steps run through ``torch.compile`` with the config's ``fullgraph``,
``dynamic``, ``backend``, ``mode`` and ``options`` (``mode="reduce-overhead"`` gives CUDA graphs on a GPU). With a
static cache every input but the tokens fed has a fixed shape (the 2D mask spans the cache's ``max_cache_len``
positions, `hf_spec.forward`), so a pass is padded to the next of a few widths (`WIDTHS`) and a process compiles at
most one graph per (model, width, batch size): a prefill wider than the largest runs eagerly, as transformers does.
The padded positions are written into the cache like any fed token and cut off right after the pass (a static
cache's crop moves its write position back), so no query ever sees them (`hf_spec.caches`); their logits and hidden
states are dropped. The processor chain, acceptance and sampling stay outside the graphs, adding no host sync.

Dynamo's per-function recompile limit is raised to `RECOMPILE_LIMIT` (a process-wide cap, raised once, never
lowered): past it dynamo would run further shapes eagerly without a word.

A compiled pass calls the model's ``forward``, not the module, so the module's hooks are called around it, outside
the graph, as ``model(**inputs)`` would call them (`run_pre_hooks`, `run_post_hooks`; what they return is not used):
a user's hooks, and the kernel dispatch of `hf_spec.loading.dispatch`, see every pass.

`CompiledForward.num_graphs` counts the graphs compiled per model, so a test can check that a
steady-state call compiles nothing new. Compiled functions are kept per model (weakly) and reused across calls with
the same config.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
import weakref
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel
from transformers.generation.configuration_utils import CompileConfig

#: Widths a compiled pass is padded to; wider passes (a prompt's prefill) run eagerly.
WIDTHS = (1, 2, 4, 8, 16, 32)
#: Graphs dynamo may compile for one code object before it falls back to eager: a target and a draft of one
#: architecture share their ``forward``'s, and each has a graph per width and batch size (dynamo's default is 8).
RECOMPILE_LIMIT = 64

_ACTIVE: contextvars.ContextVar[dict[int, CompiledForward] | None] = contextvars.ContextVar(
    "hf_spec_compiled", default=None)
_COMPILED: weakref.WeakKeyDictionary[PreTrainedModel, dict[str, CompiledForward]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class CompiledForward:
    """A model's compiled ``forward`` (`__call__` runs it), and how many graphs it compiled. The compiled function
    takes the model as an argument and this object holds it weakly, so a model is freed once the caller drops it."""

    function: Callable | None  # compiled: (model, **inputs) -> the model's output
    model: weakref.ref | None = None
    num_graphs: int = 0

    def __call__(self, **inputs):
        return self.function(self.model(), **inputs)


def _forward(model: torch.nn.Module, **inputs):
    return model.forward(**inputs)


def compiled_forward(model: torch.nn.Module, config: CompileConfig) -> CompiledForward:
    """The compiled ``forward`` of ``model`` under ``config`` (made once per model and config)."""
    key = repr(config.to_dict()) if hasattr(config, "to_dict") else repr(config)
    per_model = _COMPILED.setdefault(model, {})
    if key not in per_model:
        compiled = CompiledForward(function=None, model=weakref.ref(model))
        if config.backend == "inductor":  # what torch.compile(mode=..., options=...) builds for inductor
            backend = torch._TorchCompileInductorWrapper(config.mode, config.options, config.dynamic)
        else:
            backend = torch._dynamo.lookup_backend(config.backend)

        def counting_backend(graph, example_inputs):  # every graph dynamo hands over is one compilation
            compiled.num_graphs += 1
            return backend(graph, example_inputs)

        if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:  # raised once per process, never lowered
            torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        own = _forward.__code__.replace(co_name=f"forward_of_{type(model).__name__}")  # dynamo's caches and its
        function = types.FunctionType(own, _forward.__globals__)  # recompile limit are per code object: one per model
        compiled.function = torch.compile(function, backend=counting_backend, fullgraph=config.fullgraph,
                                          dynamic=config.dynamic)
        per_model[key] = compiled
    return per_model[key]


@contextlib.contextmanager
def compiling(models: list[torch.nn.Module | None],
              config: CompileConfig | None) -> Iterator[dict[int, CompiledForward]]:
    """Within the block, `hf_spec.forward` runs these models' passes compiled (nothing when ``config`` is None; a
    ``None`` model, a drafter without one, is skipped)."""
    models = [model for model in models if model is not None]
    active = {} if config is None else {id(model): compiled_forward(model, config) for model in models}
    token = _ACTIVE.set(active or None)
    try:
        yield active
    finally:
        _ACTIVE.reset(token)


def run_pre_hooks(model: torch.nn.Module, inputs: dict) -> None:
    """Call the model's forward pre-hooks before a compiled pass (no positional arguments; results unused)."""
    for key, hook in tuple(model._forward_pre_hooks.items()):
        if key in model._forward_pre_hooks_with_kwargs:
            hook(model, (), inputs)
        else:
            hook(model, ())


def run_post_hooks(model: torch.nn.Module, inputs: dict, output) -> None:
    """Call the model's forward hooks after a compiled pass; ``output`` ``None`` (the pass raised): only those
    registered with ``always_call``."""
    for key, hook in tuple(model._forward_hooks.items()):
        if output is None and key not in model._forward_hooks_always_called:
            continue
        if key in model._forward_hooks_with_kwargs:
            hook(model, (), inputs, output)
        else:
            hook(model, (), output)


def active_forward(model: torch.nn.Module) -> CompiledForward | None:
    """The compiled forward to run ``model``'s pass with in this call, or ``None`` (eager)."""
    active = _ACTIVE.get()
    return None if active is None else active.get(id(model))


def padded_width(num_fed: int) -> int | None:
    """The width a pass of ``num_fed`` tokens is padded to, or ``None`` when it runs eagerly."""
    return next((width for width in WIDTHS if width >= num_fed), None)


def pad_inputs(inputs: dict, width: int) -> dict:
    """The pass's inputs with ``width - fed`` more tokens (the last one repeated, at the following positions) and
    every logit kept (``logits_to_keep`` would otherwise vary with the pass)."""
    extra = width - inputs["input_ids"].shape[1]
    ids, positions = inputs["input_ids"], inputs["position_ids"]  # [batch, fed]
    steps = torch.arange(1, extra + 1, device=positions.device)  # [extra]
    padded = {**inputs, "input_ids": torch.cat([ids, ids[:, -1:].expand(-1, extra)], dim=1),
              "position_ids": torch.cat([positions, positions[:, -1:] + steps], dim=1)}
    if "logits_to_keep" in padded:
        padded["logits_to_keep"] = 0
    return padded


def strip_padding(logits: torch.Tensor, hidden: tuple | None, num_fed: int) -> tuple[torch.Tensor, tuple | None]:
    """Logits ``[batch, fed, vocab]`` and hidden states of the fed tokens only."""
    hidden = None if hidden is None else tuple(None if states is None else states[:, :num_fed] for states in hidden)
    return logits[:, :num_fed], hidden

