"""`hf-spec bench`: target-only decoding, transformers' assisted generation and hf_spec, side by side.

All methods run in one process on the same weights, prompts and settings, interleaved prompt by prompt (their order
rotates from one prompt to the next), after a warm-up call of each. Methods (`METHODS`; k is ``--num-assistant-tokens``):

- ``target_only``: ``generate()`` without a draft;
- ``transformers``: transformers' own ``generate(assistant_model=...)`` at its best: constant schedule, the same k,
  confidence threshold off;
- ``transformers_default``: the same with transformers' defaults (20 draft tokens, confidence threshold 0.4);
- ``transformers_heuristic``: its "heuristic" schedule (k + 2 after a full acceptance, k - 1 otherwise), from k;
- ``transformers_lookup``: its prompt lookup, ``prompt_lookup_num_tokens=k``;
- ``hf_spec``: ours, ``num_assistant_tokens=k``; ``hf_spec_k<N>``: ours with k = N; ``hf_spec_auto``: ours with
  ``num_assistant_tokens="auto"``;
- ``hf_spec_lookup``: our prompt lookup, ``prompt_lookup_num_tokens=k``; ``hf_spec_lookup_draft``: lookup first, the
  draft model when nothing matches.

Workloads: ``code`` (HumanEval prompts completed as text), ``prose`` (chat requests for prose), ``edit`` (chat requests
to add type hints to a given HumanEval solution: the answer copies much of the input). Sampled runs of one prompt
start from the same seed for every method. Target and draft forward passes are counted with forward pre-hooks;
acceptance for transformers is derived from those counts (accepted = tokens - target passes, proposed = draft passes),
for hf_spec it is its own statistics. The report: `hf_spec.bench_report`.

Variants: other targets (a quantized copy, say) passed as ``variants={"nf4": model}``, or other (target, draft) pairs
(``variants={"distilled": (target, trained_draft)}``); a method named ``<method>@<label>`` runs on that variant,
interleaved with the rest. Its speed-up is reported against the first target's ``target_only`` and against its own
``target_only@<label>`` (``target_only`` when that did not run: a variant with the same target and another draft).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_spec.bench_report import Run, summarize, variant_suffix
from hf_spec.measure import (
    ForwardCounter,
    PeakMemory,
    count_new_tokens,
    eos_token_ids,
    forward_costs,
    machine_info,
    weight_bytes,
)
from hf_spec.mixin import speculative, without_speculation
from hf_spec.quantization import quantization_of

METHODS = (
    "target_only", "transformers", "transformers_default", "transformers_heuristic", "transformers_lookup",
    "hf_spec", "hf_spec_auto", "hf_spec_lookup", "hf_spec_lookup_draft",
)
DEFAULT_METHODS = ("target_only", "transformers", "transformers_default", "hf_spec")
WORKLOADS = ("code", "prose", "edit")
SETTINGS = {
    "greedy": {"do_sample": False},
    "sampled": {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
}
_FIXED_K = re.compile(r"hf_spec_k([1-9][0-9]*)")

PROSE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a curious ten-year-old why the sky is blue and sunsets are red.",
    "Write a friendly letter to a neighbour inviting them to a garden party next Saturday.",
    "Describe a busy morning market in a small coastal town, with its sounds and smells.",
    "Summarise the main causes of the French Revolution in a few paragraphs.",
    "Give advice to someone starting their first job about managing their time.",
    "Write a product description for a handmade wooden chess set.",
    "Tell the story of how tea spread from China to the rest of the world.",
)

EDIT_REQUEST = "Add type hints to this Python function. Reply with the complete rewritten function only.\n\n"


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """How a benchmarked method calls ``generate()``."""

    is_ours: bool  # hf_spec's loop; otherwise transformers' own (the target without speculation)
    uses_draft: bool
    generate_kwargs: dict  # besides assistant_model
    assistant_settings: dict | None = None  # transformers reads these from the draft's generation_config
    fixed_k: int | None = None  # drafts exactly k tokens a round with a draft model: the formula applies


def method_spec(method: str, k: int) -> MethodSpec:
    """The `MethodSpec` of a method name (see the module docstring)."""
    fixed = _FIXED_K.fullmatch(method)
    if fixed or method == "hf_spec":
        n = int(fixed.group(1)) if fixed else k
        return MethodSpec(True, True, {"num_assistant_tokens": n}, fixed_k=n)
    specs = {
        "target_only": MethodSpec(False, False, {}),
        "transformers": MethodSpec(False, True, {}, {
            "num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}, fixed_k=k),
        "transformers_default": MethodSpec(False, True, {}, {
            "num_assistant_tokens": None, "num_assistant_tokens_schedule": None,
            "assistant_confidence_threshold": None}),
        "transformers_heuristic": MethodSpec(False, True, {}, {
            "num_assistant_tokens": k, "num_assistant_tokens_schedule": "heuristic",
            "assistant_confidence_threshold": 0.0}),
        "transformers_lookup": MethodSpec(False, False, {"prompt_lookup_num_tokens": k}),
        "hf_spec_auto": MethodSpec(True, True, {"num_assistant_tokens": "auto"}),
        "hf_spec_lookup": MethodSpec(True, False, {"prompt_lookup_num_tokens": k}),
        "hf_spec_lookup_draft": MethodSpec(True, True, {"prompt_lookup_num_tokens": k}),
    }
    if method not in specs:
        raise ValueError(f"Unknown method {method!r}; choose from {METHODS} or 'hf_spec_k<N>'.")
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


def generate_once(spec: MethodSpec, target, draft, inputs: dict, generate_kwargs: dict):
    """``(sequence [total], hf_spec stats or None)`` of one batch-1 call."""
    kwargs = {**inputs, **generate_kwargs, **spec.generate_kwargs}
    if spec.uses_draft:
        kwargs["assistant_model"] = draft
    if spec.is_ours:
        output = target.generate(**kwargs, return_dict_in_generate=True)
        return output.sequences[0], getattr(output, "speculative_stats", None)
    with without_speculation(target), assistant_config(draft, **(spec.assistant_settings or {})):
        return target.generate(**kwargs)[0], None


def run_one(method: str, spec: MethodSpec, target, draft, inputs, generate_kwargs, eos_ids, **where):
    """``(Run, new ids [new])`` of one timed call."""
    prompt_length = inputs["input_ids"].shape[1]
    with ForwardCounter(target) as target_calls, ForwardCounter(draft) as draft_calls, PeakMemory(target.device) as memory:
        started = time.perf_counter()
        sequence, stats = generate_once(spec, target, draft, inputs, generate_kwargs)
        seconds = time.perf_counter() - started
    new_tokens = count_new_tokens(sequence[prompt_length:], eos_ids)
    if stats is not None:
        proposed, accepted = stats.num_draft_tokens, stats.num_accepted
    elif spec.uses_draft:  # transformers: every target pass emits its accepted tokens plus one
        proposed, accepted = draft_calls.count, max(0, new_tokens - target_calls.count)
    else:
        proposed = accepted = None
    run = Run(method=method, seconds=seconds, new_tokens=new_tokens, target_passes=target_calls.count,
              draft_passes=draft_calls.count, proposed=proposed, accepted=accepted,
              working_memory_bytes=memory.peak_bytes, **where)
    return run, sequence[prompt_length:]


def run_benchmark(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    workloads: dict[str, list[dict[str, torch.Tensor]]],
    settings: dict[str, dict] | None = None,
    methods: tuple[str, ...] = DEFAULT_METHODS,
    k: int = 5,
    max_new_tokens: int = 128,
    repeats: int = 1,
    seed: int = 0,
    eos_ids: set[int] | None = None,
    progress: bool = True,
    variants: dict[str, PreTrainedModel | tuple[PreTrainedModel, PreTrainedModel]] | None = None,
) -> dict:
    """Run every method on every (workload, setting, prompt, repeat), interleaved; return the report (JSON-ready).

    Args:
        workloads: name -> batch-1 model inputs (``input_ids`` [1, S], ``attention_mask``) of each prompt.
        settings: name -> sampling kwargs of ``generate()`` (default: `SETTINGS`).
        methods: names from `METHODS` or ``hf_spec_k<N>``; must include ``target_only``.
        eos_ids: ids that end a generation (default: the target's ``generation_config.eos_token_id``).
        variants: label -> another target (same tokenizer) or ``(target, draft)`` pair, run by the methods named
            ``<method>@<label>``.
    """
    settings = SETTINGS if settings is None else settings
    for name, value in (("k", k), ("max_new_tokens", max_new_tokens), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, but is {value!r}.")
    if not methods or "target_only" not in methods:
        raise ValueError(f"`methods` must include 'target_only' (every ratio is relative to it), got {methods!r}.")
    pairs = {"": (speculative(target), draft)}  # by variant suffix: "" for the first pair, "@<label>" for a variant
    for label, variant in (variants or {}).items():
        variant_target, variant_draft = variant if isinstance(variant, tuple) else (variant, draft)
        pairs[f"@{label}"] = (speculative(variant_target), variant_draft)
    specs, pair_of = {}, {}
    for method in methods:
        pair_of[method] = variant_suffix(method)
        if pair_of[method] not in pairs:
            raise ValueError(f"Method {method!r} runs on variant {pair_of[method][1:]!r}, but `variants` has "
                             f"{sorted(variants or {})}.")
        specs[method] = method_spec(method.partition("@")[0], k)
    for name, prompts in workloads.items():
        if not prompts:
            raise ValueError(f"Workload {name!r} has no prompts.")
    target = pairs[""][0]
    eos_ids = eos_token_ids(target) if eos_ids is None else set(eos_ids)
    pad = target.generation_config.pad_token_id
    pad = min(eos_ids) if pad is None and eos_ids else pad
    generate_kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": pad}

    first = next(iter(workloads.values()))[0]
    for method, spec in specs.items():  # warm-up
        generate_once(spec, *pairs[pair_of[method]], first, {**generate_kwargs, "max_new_tokens": 4})
    fixed_ks = {spec.fixed_k for spec in specs.values() if spec.fixed_k is not None} or {k}
    costs = {name + suffix: forward_costs(*pairs[suffix], prompts[0]["input_ids"], fixed_ks)
             for suffix in dict.fromkeys(pair_of.values()) for name, prompts in workloads.items()}

    jobs = [(w, s, p, r) for w in workloads for s in settings for p in range(len(workloads[w])) for r in range(repeats)]
    runs: list[Run] = []
    bar = tqdm(total=len(jobs) * len(methods), desc="hf-spec bench", unit="call", disable=not progress)
    for index, (workload, setting, prompt, repeat) in enumerate(jobs):
        inputs = workloads[workload][prompt]
        order = methods[index % len(methods):] + methods[:index % len(methods)]  # rotate who goes first
        new_ids = {}
        for method in order:
            with torch.random.fork_rng(devices=[target.device] if target.device.type == "cuda" else []):
                torch.manual_seed(seed + index)  # the same seed for every method; the caller's state is untouched
                run, new_ids[method] = run_one(method, specs[method], *pairs[pair_of[method]], inputs,
                                               {**generate_kwargs, **settings[setting]}, eos_ids, workload=workload,
                                               setting=setting, prompt=prompt, repeat=repeat)
            runs.append(run)
            bar.update()
            bar.set_postfix_str(f"{workload}/{setting} {method} {run.new_tokens / run.seconds:.2f} tok/s")
        if not settings[setting].get("do_sample"):
            for run in runs[-len(methods):]:  # against target-only decoding of its own target where it ran
                reference = new_ids.get("target_only" + pair_of[run.method], new_ids["target_only"])
                run.identical_to_target_only = bool(torch.equal(new_ids[run.method], reference))
    bar.close()

    weights = {}
    for suffix, (variant_target, variant_draft) in pairs.items():
        weights["target" + suffix] = weight_bytes(variant_target)
        weights["draft" + suffix] = weight_bytes(variant_draft)
    return {
        "machine": machine_info(),
        "config": {
            "k": k, "max_new_tokens": max_new_tokens, "repeats": repeats, "seed": seed, "methods": list(methods),
            "settings": settings, "prompts_per_workload": {name: len(p) for name, p in workloads.items()},
            "dtype": str(target.dtype).removeprefix("torch."),
            "quantization": quantization_of(target),
            "variants": {label: {"target": _describe(pairs[f"@{label}"][0], target),
                                 "draft": _describe(pairs[f"@{label}"][1], draft)} for label in variants or {}},
            "method_specs": {method: {**dataclasses.asdict(spec)} for method, spec in specs.items()},
        },
        "weights_bytes": weights,
        "costs": {name: {"target_step_s": c.target_step_s, "draft_step_s": c.draft_step_s,
                         "target_block_s": c.target_block_s, "cost_ratio": c.cost_ratio,
                         "block_cost_by_k": {kk: c.block_cost(kk) for kk in sorted(fixed_ks)}}
                  for name, c in costs.items()},
        "results": summarize(runs, list(methods), costs, {m: s.fixed_k for m, s in specs.items()}, weights),
        "runs": [dataclasses.asdict(run) for run in runs],
    }


def text_workloads(tokenizer, names: tuple[str, ...], num_prompts: int,
                   offset: int = 0) -> dict[str, list[dict[str, torch.Tensor]]]:
    """``code``: HumanEval prompts, to complete as plain text; ``prose``: `PROSE_PROMPTS`; ``edit``: add type hints to
    HumanEval solutions. ``num_prompts`` of each from ``offset`` on (hold out what a draft was trained on). Requests
    are chat messages (plain text without a chat template)."""
    from hf_spec.pretrained import humaneval_problems

    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"`offset` must be an integer >= 0, but is {offset!r}.")
    for name in names:
        available = {"prose": len(PROSE_PROMPTS)}.get(name) or (len(humaneval_problems()) if name in WORKLOADS else 0)
        if name in WORKLOADS and offset + num_prompts > available:
            raise ValueError(f"The {name} workload has {available} prompts; `offset` + `num_prompts` is "
                             f"{offset + num_prompts}.")
    selected = slice(offset, offset + num_prompts)
    workloads = {}
    for name in names:
        if name == "code":
            texts = [problem["prompt"] for problem in humaneval_problems()[selected]]
        elif name == "prose":
            texts = [_as_chat(tokenizer, text) for text in PROSE_PROMPTS[selected]]
        elif name == "edit":
            texts = [
                _as_chat(tokenizer, f"{EDIT_REQUEST}```python\n{problem['prompt']}{problem['canonical_solution']}```")
                for problem in humaneval_problems()[selected]
            ]
        else:
            raise ValueError(f"Unknown workload {name!r}; choose from {WORKLOADS}.")
        workloads[name] = [dict(tokenizer(text, return_tensors="pt", add_special_tokens=False)) for text in texts]
    return workloads


def _describe(model: PreTrainedModel, base: PreTrainedModel) -> str:
    """How a variant's model differs from the first pair's: ``"same"``, its quantization, or its name and dtype."""
    if model is base:
        return "same"
    return quantization_of(model) or f"{model.name_or_path} ({str(model.dtype).removeprefix('torch.')})"


def random_workloads(names: tuple[str, ...], num_prompts: int, vocab_size: int, seed: int = 0) -> dict:
    """Random-id prompts (lengths 4 to 11) under each workload name, for models without a tokenizer."""
    generator = torch.Generator().manual_seed(seed)
    workloads = {}
    for name in names:
        lengths = torch.randint(4, 12, (num_prompts,), generator=generator).tolist()
        workloads[name] = [{"input_ids": torch.randint(1, vocab_size, (1, n), generator=generator),
                            "attention_mask": torch.ones(1, n, dtype=torch.long)} for n in lengths]
    return workloads




def _as_chat(tokenizer, text: str) -> str:
    if not tokenizer.chat_template:
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
