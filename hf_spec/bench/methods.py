"""How each method of `hf-spec bench` calls ``generate()`` (`METHODS`; k is ``--num-assistant-tokens``,
``num_draft_tokens`` in Python):

- ``target_only``: ``generate()`` without a draft;
- ``transformers``: transformers' own ``generate(assistant_model=...)`` at its best: constant schedule, the same k,
  confidence threshold off;
- ``transformers_default``: the same with transformers' defaults (20 draft tokens, confidence threshold 0.4);
- ``transformers_heuristic``: its "heuristic" schedule (k + 2 after a full acceptance, k - 1 otherwise), from k;
- ``transformers_lookup``: its prompt lookup, ``prompt_lookup_num_tokens=k``;
- ``hf_spec``: ours, ``num_assistant_tokens=k``; ``hf_spec_k<N>``: ours with k = N; ``hf_spec_auto``: ours with
  ``num_assistant_tokens="auto"``; ``quickstart``: the README's call, ``generate(assistant_model=draft)`` with no
  draft setting (hf_spec's defaults);
- ``hf_spec_lookup``: our prompt lookup, ``prompt_lookup_num_tokens=k``; ``hf_spec_lookup_draft``: lookup first, the
  draft model when nothing matches;
- ``hf_spec_tree<N>``: ours with a tree of at most N draft-model tokens per round, at most k deep
  (``num_tree_nodes=N``); ``hf_spec_suffix<N>``: suffix matching, a tree of at most N continuation tokens, at most k
  deep (``prompt_lookup_num_tokens=k, num_tree_nodes=N``); ``hf_spec_tree_auto`` and ``hf_spec_suffix_auto``: the
  budget and branching chosen every round (``num_tree_nodes="auto"``; the draft's tree at most 10 deep, suffix
  matching's at most k);
- ``<method>_static``: any of these on a static cache (``cache_implementation="static"``); ``<method>_compiled``: on a
  static cache with compiled passes (``compile_config``: inductor, ``fullgraph=False``, ``dynamic=False``, on every
  device; the warm-up then runs every timed call once at the full length, so that the graphs of every pass width
  compile before the timed calls: its time, in the report's ``warmup_seconds``, is the compile time);
- ``<method>_token``: any of hf_spec's methods with the token-wise (node-by-node on trees) acceptance rule
  (``verification="token"``; block and traversal verification are the defaults), to measure what those gain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator

from transformers import CompileConfig, PreTrainedModel

from hf_spec.bench.measure import ForwardCounter, PeakMemory
from hf_spec.bench.report import Run
from hf_spec.drafting.base import DraftSource
from hf_spec.evaluation.continuations import count_new_tokens
from hf_spec.mixin import without_speculation
from hf_spec.profiling import profile_rounds

METHODS = (
    "target_only", "transformers", "transformers_default", "transformers_heuristic", "transformers_lookup",
    "hf_spec", "hf_spec_auto", "hf_spec_lookup", "hf_spec_lookup_draft", "quickstart",
)
DEFAULT_METHODS = ("target_only", "transformers", "transformers_default", "hf_spec")
SETTINGS = {
    "greedy": {"do_sample": False},
    "sampled": {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
}
_FIXED_K = re.compile(r"hf_spec_k([1-9][0-9]*)")
_TREE = re.compile(r"hf_spec_(tree|suffix)([1-9][0-9]*|_auto)")
_CACHE = re.compile(r"(.+)_(static|compiled)")
_RULE = re.compile(r"(.+)_token")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """How a benchmarked method calls ``generate()``."""

    is_ours: bool  # hf_spec's loop; otherwise transformers' own (the target without speculation)
    uses_draft: bool
    generate_kwargs: dict  # besides assistant_model
    assistant_settings: dict | None = None  # transformers reads these from the draft's generation_config
    fixed_num_draft_tokens: int | None = None  # drafts exactly k tokens a round with a draft model: the formula applies
    is_compiled: bool = False  # on a static cache, passes compiled (`compile_config`)


def method_spec(method: str, num_draft_tokens: int) -> MethodSpec:
    """The `MethodSpec` of a method name (see the module docstring); ``num_draft_tokens`` is k."""
    k = num_draft_tokens
    rule = _RULE.fullmatch(method)
    if rule:
        base = method_spec(rule.group(1), k)
        if not base.is_ours:
            raise ValueError(f"Method {method!r}: '_token' selects the token-wise (node-by-node) acceptance rule of "
                             "hf_spec's sampled chains and trees (block and traversal verification are the "
                             "defaults), not of transformers' methods.")
        return dataclasses.replace(base, generate_kwargs={**base.generate_kwargs, "verification": "token"})
    cache = _CACHE.fullmatch(method)
    if cache:
        base = method_spec(cache.group(1), k)
        if base.uses_draft and not base.is_ours:
            raise ValueError(f"Method {method!r}: transformers' assisted generation refuses static caches.")
        return dataclasses.replace(base, generate_kwargs={**base.generate_kwargs, "cache_implementation": "static"},
                                   is_compiled=cache.group(2) == "compiled")
    fixed = _FIXED_K.fullmatch(method)
    if fixed or method == "hf_spec":
        n = int(fixed.group(1)) if fixed else k
        return MethodSpec(True, True, {"num_assistant_tokens": n}, fixed_num_draft_tokens=n)
    tree = _TREE.fullmatch(method)
    if tree:
        uses_draft, is_auto = tree.group(1) == "tree", tree.group(2) == "_auto"
        depth = {"num_assistant_tokens": k} if uses_draft else {"prompt_lookup_num_tokens": k}
        if uses_draft and is_auto:
            depth = {}  # the chooser's default depth limit
        return MethodSpec(True, uses_draft, {**depth, "num_tree_nodes": "auto" if is_auto else int(tree.group(2))})
    specs = {
        "target_only": MethodSpec(False, False, {}),
        "transformers": MethodSpec(False, True, {}, {
            "num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}, fixed_num_draft_tokens=k),
        "transformers_default": MethodSpec(False, True, {}, {
            "num_assistant_tokens": None, "num_assistant_tokens_schedule": None,
            "assistant_confidence_threshold": None}),
        "transformers_heuristic": MethodSpec(False, True, {}, {
            "num_assistant_tokens": k, "num_assistant_tokens_schedule": "heuristic",
            "assistant_confidence_threshold": 0.0}),
        "transformers_lookup": MethodSpec(False, False, {"prompt_lookup_num_tokens": k}),
        "hf_spec_auto": MethodSpec(True, True, {"num_assistant_tokens": "auto"}),
        "quickstart": MethodSpec(True, True, {}),
        "hf_spec_lookup": MethodSpec(True, False, {"prompt_lookup_num_tokens": k}),
        "hf_spec_lookup_draft": MethodSpec(True, True, {"prompt_lookup_num_tokens": k}),
    }
    if method not in specs:
        raise ValueError(f"Unknown method {method!r}; choose from {METHODS}, 'hf_spec_k<N>', 'hf_spec_tree<N>', "
                         "'hf_spec_suffix<N>', 'hf_spec_tree_auto' or 'hf_spec_suffix_auto', each optionally with "
                         "'_static' or '_compiled', and hf_spec's methods with '_token'.")
    return specs[method]


@contextlib.contextmanager
def assistant_config(draft: PreTrainedModel, **fields) -> Iterator[None]:
    """Set fields of ``draft.generation_config`` (where transformers reads its assistant settings) for the block."""
    config = draft.generation_config
    saved = {name: getattr(config, name, None) for name in fields}
    for name, value in fields.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def generate_once(spec: MethodSpec, target, draft, inputs: dict, generate_kwargs: dict, profile: bool = False,
                  draft_kwargs: dict | None = None):
    """``(sequence [total], hf_spec stats or None)`` of one batch-1 call; ``profile``: hf_spec's calls fill
    ``stats.profile`` (`hf_spec.profiling`); ``draft_kwargs``: what a call with the draft adds (a draft of another
    tokenizer: ``tokenizer`` and ``assistant_tokenizer``)."""
    kwargs = {**inputs, **generate_kwargs, **spec.generate_kwargs}
    if spec.is_compiled:
        kwargs["compile_config"] = bench_compile_config()
    if spec.uses_draft:
        kwargs.update(assistant_model=draft, **(draft_kwargs or {}))
    if spec.is_ours:
        with profile_rounds() if profile else contextlib.nullcontext():
            output = target.generate(**kwargs, return_dict_in_generate=True)
        return output.sequences[0], getattr(output, "speculative_stats", None)
    with without_speculation(target), assistant_config(draft, **(spec.assistant_settings or {})):
        return target.generate(**kwargs)[0], None


def bench_compile_config() -> CompileConfig:
    """What ``<method>_compiled`` compiles with: inductor's default mode, graphs that may break, static shapes; on
    every device (transformers' own generate compiles on a CPU only when told to)."""
    config = CompileConfig(fullgraph=False, dynamic=False)
    config._compile_all_devices = True
    return config


def runs_on(spec: MethodSpec, variant) -> bool:
    """Whether a method runs on a variant: every method on another target; on another draft, the methods that use
    one; on a draft head, hf_spec's chains and trees (transformers cannot run a head)."""
    if not isinstance(variant, tuple):
        return True
    if isinstance(variant[1], DraftSource):
        return spec.uses_draft and spec.is_ours
    return spec.uses_draft


def run_one(method: str, spec: MethodSpec, target, draft, inputs, generate_kwargs, eos_ids, tokenizer=None,
            profile: bool = False, draft_kwargs: dict | None = None, **where):
    """``(Run, new ids [new])`` of one timed call (``profile``: hf_spec's loop profiled, `hf_spec.profiling`)."""
    prompt_length = inputs["input_ids"].shape[1]
    with (ForwardCounter(target) as target_calls, ForwardCounter(draft) as draft_calls,
          PeakMemory(target.device) as memory):
        started = time.perf_counter()
        sequence, stats = generate_once(spec, target, draft, inputs, generate_kwargs, profile, draft_kwargs)
        seconds = time.perf_counter() - started
    new_tokens = count_new_tokens(sequence[prompt_length:], eos_ids)
    if stats is not None:
        proposed, accepted = stats.num_draft_tokens, stats.num_accepted
    elif spec.uses_draft:  # transformers: every target pass emits its accepted tokens plus one
        proposed, accepted = draft_calls.count, max(0, new_tokens - target_calls.count)
    else:
        proposed = accepted = None
    new_ids = sequence[prompt_length:prompt_length + new_tokens].tolist()
    run = Run(method=method, seconds=seconds, new_tokens=new_tokens, target_passes=target_calls.count,
              draft_passes=draft_calls.count, proposed=proposed, accepted=accepted,
              working_memory_bytes=memory.peak_bytes, new_ids=new_ids,
              profile=None if stats is None else stats.profile,
              profile_passes=None if stats is None else stats.profile_passes,
              draft_lengths=None if stats is None else stats.draft_lengths,
              expected_accepted=None if stats is None else stats.expected_accepted,
              text=None if tokenizer is None else tokenizer.decode(new_ids, skip_special_tokens=True), **where)
    return run, sequence[prompt_length:]
