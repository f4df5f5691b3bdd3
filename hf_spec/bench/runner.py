"""`hf-spec bench`: target-only decoding, transformers' assisted generation and hf_spec, side by side.

All methods (`hf_spec.bench.methods`) run in one process on the same weights, prompts and settings, interleaved prompt
by prompt (the order rotates), after each method's first call, reported apart (``first_calls``, `_warm_up`: a cost
probe or a compile shows there); graphs compiled during the timed calls are counted (``graphs_compiled_while_timed``).

Workloads: ``code`` (HumanEval prompts completed as text), ``prose`` (chat requests for prose), ``edit`` (chat requests
to add type hints to a given HumanEval solution: the answer copies much of the input). Sampled runs of one prompt
start from the same seed for every method. Target and draft forward passes are counted with forward pre-hooks;
acceptance for transformers is derived from those counts (accepted = tokens - target passes, proposed = draft passes),
for hf_spec it is its own statistics. The report: `hf_spec.bench.report`.

Kernel baselines: with variants labelled ``stock`` (the target as loaded) and ``steps`` (the target on the CPU path
fastest for 1-token steps, `hf_spec.loading.packed`), ``target_only@stock`` and ``target_only@steps`` run beside
``target_only`` on the main pair's weights, so a speed-up from kernels shows apart from one from speculation; every
row is also reported against the best of them.

Variants: other targets (a quantized copy, say) passed as ``variants={"nf4": model}``, or other (target, draft) pairs
(``variants={"distilled": (target, trained_draft)}``); a method named ``<method>@<label>`` runs on that variant,
interleaved with the rest. Its speed-up is reported against the first target's ``target_only`` and against its own
``target_only@<label>`` (``target_only`` when that did not run: a variant with the same target and another draft).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_spec.bench.measure import machine_info, weight_bytes
from hf_spec.bench.methods import (
    DEFAULT_METHODS,
    SETTINGS,
    MethodSpec,
    bench_compile_config,
    generate_once,
    method_spec,
    run_one,
)
from hf_spec.bench.peers import OpenVINOPeer
from hf_spec.bench.report import KERNEL_BASELINES, Run, first_calls, summarize, variant_suffix
from hf_spec.checks import check_int
from hf_spec.compiled import compiled_forward
from hf_spec.drafting.base import Drafter
from hf_spec.drafting.cross_tokenizer import CrossTokenizerDrafter
from hf_spec.evaluation.continuations import count_new_tokens, seeded
from hf_spec.loading.packed import cpu_path
from hf_spec.loading.quantization import quantization_of
from hf_spec.loading.vocabulary import eos_token_ids
from hf_spec.mixin import speculative
from hf_spec.plan import make_drafter
from hf_spec.rounds import chain_draft_widths
from hf_spec.sizing.draft_length import DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_NUM_DRAFT_TOKENS
from hf_spec.timing.probe import measure_costs, probe_costs, probe_sizes

logger = logging.getLogger(__name__)


def run_benchmark(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    workloads: dict[str, list[dict[str, torch.Tensor]]],
    settings: dict[str, dict] | None = None,
    methods: tuple[str, ...] = DEFAULT_METHODS,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    max_new_tokens: int = 128,
    repeats: int = 1,
    seed: int = 0,
    eos_ids: set[int] | None = None,
    progress: bool = True,
    variants: dict[str, PreTrainedModel | tuple[PreTrainedModel, PreTrainedModel]] | None = None,
    tokenizer=None,
    profile: bool | None = None,
    draft_tokenizer=None,
    peer: OpenVINOPeer | None = None,
) -> dict:
    """Run every method on every (workload, setting, prompt, repeat), interleaved; return the report (JSON-ready).

    Args:
        workloads: name -> batch-1 model inputs (``input_ids`` [1, S], ``attention_mask``) of each prompt.
        settings: name -> sampling kwargs of ``generate()`` (default: `SETTINGS`).
        methods: names from `METHODS` or ``hf_spec_k<N>``; must include ``target_only``.
        num_draft_tokens: k of the methods that do not name their own.
        eos_ids: ids that end a generation (default: the target's ``generation_config.eos_token_id``).
        variants: label -> another target (same tokenizer) or ``(target, draft)`` pair, run by the methods named
            ``<method>@<label>``.
        tokenizer: decodes each call's new tokens into the report's runs (``text``).
        draft_tokenizer: the draft's tokenizer when it differs from the target's (``tokenizer``): every method with
            the draft gets both (hf_spec's `hf_spec.drafting.cross_tokenizer`, transformers' universal assisted
            generation).
        profile: profile hf_spec's loop (`hf_spec.profiling`: where each call's time goes); default: on a CPU (where
            it costs a few timestamps a round), not on an accelerator (where it synchronizes the device).
        peer: OpenVINO GenAI in its own environment (`hf_spec.bench.peers`): its methods run interleaved too.
    """
    settings = SETTINGS if settings is None else settings
    check_int("num_draft_tokens", num_draft_tokens), check_int("max_new_tokens", max_new_tokens)
    check_int("repeats", repeats)
    for name, prompts in workloads.items():
        if not prompts:
            raise ValueError(f"Workload {name!r} has no prompts.")
    plan = _Plan.make(target, draft, methods, variants or {}, num_draft_tokens, max_new_tokens, eos_ids, peer)
    methods = (*methods, *plan.peer_methods)
    if draft_tokenizer is not None:
        plan.draft_kwargs = {"tokenizer": tokenizer, "assistant_tokenizer": draft_tokenizer}
        # transformers' sampled universal assisted generation rewires its draft for good: a copy per mode
        plan.transformers_drafts = {False: copy.deepcopy(draft), True: copy.deepcopy(draft)}

    warm = _warm_up(plan, workloads, settings, max_new_tokens, tokenizer)
    fixed_ks = {spec.fixed_num_draft_tokens for spec in plan.specs.values()
                if spec.fixed_num_draft_tokens is not None} or {num_draft_tokens}
    costs = {name + suffix: measure_costs(plan.pairs[suffix][0], plan.drafter(plan.pairs[suffix][1]),
                                          prompts[0]["input_ids"], [k + 1 for k in fixed_ks])
             for suffix in dict.fromkeys(plan.pair_of[m] for m, spec in plan.specs.items() if spec.uses_draft)
             for name, prompts in workloads.items()}
    drafter = plan.drafter(plan.pairs[""][1])
    cost_table = probe_costs(plan.pairs[""][0], drafter, probe_sizes(max(DEFAULT_MAX_DRAFT_TOKENS, *fixed_ks) + 1),
                             draft_widths=chain_draft_widths(drafter))
    profile = plan.pairs[""][0].device.type == "cpu" if profile is None else profile
    graphs_before = _compiled_graphs(plan)
    with peer or contextlib.nullcontext():  # the peer's process ends with the runs
        runs = _interleaved_runs(plan, workloads, settings, repeats, seed, progress, tokenizer, profile)
    graphs_while_timed = {method: count - graphs_before[method] for method, count in _compiled_graphs(plan).items()}

    weights = {role + suffix: weight_bytes(model) for suffix, models in plan.pairs.items()
               for role, model in zip(("target", "draft"), models, strict=True)}
    target, draft = plan.pairs[""]
    return {
        "machine": machine_info(),
        "config": {
            "num_draft_tokens": num_draft_tokens, "max_new_tokens": max_new_tokens, "repeats": repeats,
            "seed": seed, "methods": list(methods), "settings": settings, "profile": profile,
            "draft_tokenizer": None if draft_tokenizer is None else getattr(draft_tokenizer, "name_or_path", None),
            "prompts_per_workload": {name: len(p) for name, p in workloads.items()},
            "dtype": str(target.dtype).removeprefix("torch."),
            "quantization": quantization_of(target),
            "variants": {label: {"target": _describe(plan.pairs[f"@{label}"][0], target),
                                 "draft": _describe(plan.pairs[f"@{label}"][1], draft)} for label in variants or {}},
            "method_specs": {method: {**dataclasses.asdict(spec)} for method, spec in plan.specs.items()},
            "warmup_seconds": {method: entry["seconds"] for method, entry in warm.items()},
            "graphs_compiled_while_timed": graphs_while_timed,
        },
        "weights_bytes": weights,
        "cost_table": dataclasses.asdict(cost_table),
        "costs": {name: {"target_step_seconds": c.target_step_seconds, "draft_step_seconds": c.draft_step_seconds,
                         "target_block_seconds": c.target_block_seconds, "cost_ratio": c.cost_ratio,
                         "block_cost_by_k": {kk: c.block_cost(kk) for kk in sorted(fixed_ks)}}
                  for name, c in costs.items()},
        "results": summarize(runs, list(methods), costs, {**dict.fromkeys(plan.peer_methods), **{
            m: s.fixed_num_draft_tokens for m, s in plan.specs.items()}}, weights, cost_table),
        "first_calls": first_calls(warm, next(iter(workloads))),
        "runs": [dataclasses.asdict(run) for run in runs],
    }


@dataclasses.dataclass
class _Plan:
    """Which (target, draft) pair each method runs on, how it calls ``generate()``, and the shared kwargs."""

    pairs: dict[str, tuple[PreTrainedModel, PreTrainedModel]]  # variant suffix ("" or "@<label>") -> pair
    specs: dict[str, MethodSpec]  # method -> how it calls generate()
    pair_of: dict[str, str]  # method -> variant suffix
    generate_kwargs: dict
    eos_ids: set[int]
    draft_kwargs: dict = dataclasses.field(default_factory=dict)  # calls with the draft: its other tokenizer
    # copies of a draft of another tokenizer for transformers' methods, by do_sample
    transformers_drafts: dict[bool, PreTrainedModel] = dataclasses.field(default_factory=dict)
    peer: OpenVINOPeer | None = None  # methods run by another environment (`hf_spec.bench.peers`)
    peer_methods: tuple[str, ...] = ()

    @classmethod
    def make(cls, target, draft, methods, variants, num_draft_tokens, max_new_tokens, eos_ids, peer=None) -> _Plan:
        if not methods or "target_only" not in methods:
            raise ValueError(f"`methods` must include 'target_only' (every ratio is relative to it), got {methods!r}.")
        pairs = {"": (speculative(target), draft)}
        for label, variant in variants.items():
            variant_target, variant_draft = variant if isinstance(variant, tuple) else (variant, draft)
            pairs[f"@{label}"] = (speculative(variant_target), variant_draft)
        specs, pair_of = {}, {}
        for method in methods:
            pair_of[method] = variant_suffix(method)
            if pair_of[method] not in pairs:
                raise ValueError(f"Method {method!r} runs on variant {pair_of[method][1:]!r}, but `variants` has "
                                 f"{sorted(variants)}.")
            specs[method] = method_spec(method.partition("@")[0], num_draft_tokens)
        eos_ids = eos_token_ids(target) if eos_ids is None else set(eos_ids)
        pad = target.generation_config.pad_token_id
        pad = min(eos_ids) if pad is None and eos_ids else pad
        return cls(pairs, specs, pair_of, {"max_new_tokens": max_new_tokens, "pad_token_id": pad}, eos_ids, peer=peer,
                   peer_methods=tuple(peer.methods(num_draft_tokens)) if peer else ())

    def pair(self, method: str, do_sample: bool = False) -> tuple[PreTrainedModel, PreTrainedModel]:
        target, draft = self.pairs[self.pair_of[method]]
        if self.transformers_drafts and not self.specs[method].is_ours and not self.pair_of[method]:
            return target, self.transformers_drafts[do_sample]
        return target, draft

    def drafter(self, draft) -> Drafter:
        """The drafter hf_spec makes of ``draft`` in these calls (for the cost probes)."""
        if self.draft_kwargs:
            return CrossTokenizerDrafter(draft, *self.draft_kwargs.values())
        return make_drafter(draft)


def _warm_up(plan: _Plan, workloads: dict, settings: dict, max_new_tokens: int, tokenizer=None) -> dict[str, dict]:
    """Each method's first call, timed: the first prompt and setting, to the full ``max_new_tokens``, after one
    untimed target step (the process's own first-use costs land on no method). A compiled method then runs every
    other prompt and setting once (each pass width compiles here); transformers' methods on copies of a draft of
    another tokenizer warm up greedy and sampled. Per method: ``seconds`` (all), ``first_seconds``, ``first_tokens``."""
    first, (setting_name, first_setting) = next(iter(workloads.values()))[0], next(iter(settings.items()))
    generate_once(method_spec("target_only", 1), *plan.pairs[""], first, {**plan.generate_kwargs, "max_new_tokens": 1})
    warm = {}
    for method, spec in plan.specs.items():
        calls = [(first, first_setting)]
        if spec.is_compiled:
            calls += [(prompt, setting) for prompts in workloads.values() for prompt in prompts
                      for setting in settings.values() if prompt is not first or setting is not first_setting]
        elif plan.transformers_drafts and not spec.is_ours:
            calls += [(first, setting) for setting in ({"do_sample": False}, *settings.values())  # the other mode
                      if bool(setting.get("do_sample")) != bool(first_setting.get("do_sample"))][:1]
        started, tokens = time.perf_counter(), None
        for index, (prompt, setting) in enumerate(calls):
            try:
                sequence, _ = generate_once(spec, *plan.pair(method, bool(setting.get("do_sample"))), prompt,
                                            {**plan.generate_kwargs, **setting}, draft_kwargs=plan.draft_kwargs)
            except Exception as error:  # transformers' own assisted generation: its timed calls record the error
                if spec.is_ours or not spec.uses_draft:
                    raise
                logger.warning(f"{method} raised in its warm-up: {type(error).__name__}: {error}")
                sequence = None
            if index == 0:
                first_seconds = time.perf_counter() - started
                tokens = None if sequence is None else count_new_tokens(
                    sequence[prompt["input_ids"].shape[1]:], plan.eos_ids)
        warm[method] = {"seconds": time.perf_counter() - started, "first_seconds": first_seconds,
                        "first_tokens": tokens, "setting": setting_name}
    for method in plan.peer_methods:  # its first call builds and compiles the pipeline
        run = plan.peer.run(method, first, first_setting, plan.eos_ids, 0, max_new_tokens, tokenizer, workload="",
                            prompt=0, setting=setting_name, repeat=0)
        warm[method] = {"seconds": run.seconds, "first_seconds": run.seconds, "first_tokens": run.new_tokens,
                        "setting": setting_name}
    return warm


def _compiled_graphs(plan: _Plan) -> dict[str, int]:
    """Graphs compiled so far for each compiled method's models (`hf_spec.compiled`; transformers' own compiled
    calls are not counted)."""
    counts = {}
    for method, spec in plan.specs.items():
        if spec.is_compiled and spec.is_ours:
            models = plan.pair(method, False)[:2 if spec.uses_draft else 1]
            counts[method] = sum(compiled_forward(model, bench_compile_config()).num_graphs for model in models
                                 if isinstance(model, PreTrainedModel))
    return counts


def _interleaved_runs(plan: _Plan, workloads: dict, settings: dict, repeats: int, seed: int,
                      progress: bool, tokenizer=None, profile: bool = False) -> list[Run]:
    """Every method on every (workload, setting, prompt, repeat), the methods' order rotating from one to the next;
    greedy outputs compared with target-only decoding of the same target."""
    methods = (*plan.specs, *plan.peer_methods)
    device = plan.pairs[""][0].device
    jobs = [(w, s, p, r) for w in workloads for s in settings for p in range(len(workloads[w])) for r in range(repeats)]
    runs: list[Run] = []
    bar = tqdm(total=len(jobs) * len(methods), desc="hf-spec bench", unit="call", disable=not progress)
    for index, (workload, setting, prompt, repeat) in enumerate(jobs):
        order = methods[index % len(methods):] + methods[:index % len(methods)]  # rotate who goes first
        do_sample = bool(settings[setting].get("do_sample"))
        new_ids = {}
        for method in order:
            where = {"workload": workload, "setting": setting, "prompt": prompt, "repeat": repeat}
            if method in plan.peer_methods:
                run = plan.peer.run(method, workloads[workload][prompt], settings[setting], plan.eos_ids,
                                    seed + index, plan.generate_kwargs["max_new_tokens"], tokenizer, **where)
                runs.append(run)
                new_ids[method] = torch.tensor(run.new_ids)
                bar.update()
                continue
            spec = plan.specs[method]
            try:
                with seeded(seed + index, device):  # the same seed for every method
                    run, new_ids[method] = run_one(method, spec, *plan.pair(method, do_sample),
                                                   workloads[workload][prompt],
                                                   {**plan.generate_kwargs, **settings[setting]}, plan.eos_ids,
                                                   tokenizer, profile, plan.draft_kwargs, **where)
            except Exception as error:
                if spec.is_ours or not spec.uses_draft:
                    raise
                run = Run(method=method, seconds=0.0, new_tokens=0, target_passes=0, draft_passes=0, proposed=None,
                          accepted=None, working_memory_bytes=None, error=f"{type(error).__name__}: {error}", **where)
                logger.warning(f"{method} raised on {workload}/{setting} prompt {prompt}: {run.error}")
            runs.append(run)
            bar.update()
            bar.set_postfix_str(f"{workload}/{setting} {method} {run.new_tokens / max(run.seconds, 1e-9):.2f} tok/s")
        if not do_sample:
            for run in runs[-len(methods):]:  # against target-only decoding of its own target where it ran
                if run.error is not None:
                    continue
                if run.method in plan.peer_methods:  # other weights and kernels: against the peer's target alone
                    if run.method != plan.peer.reference(run.method):
                        run.identical_to_target_only = run.new_ids == new_ids[plan.peer.reference(run.method)].tolist()
                    continue
                reference = new_ids.get("target_only" + plan.pair_of[run.method], new_ids["target_only"])
                if run.method in KERNEL_BASELINES:  # the same weights on other kernels: against the main path
                    reference = new_ids["target_only"]
                run.identical_to_target_only = bool(torch.equal(new_ids[run.method], reference))
    bar.close()
    return runs


def _describe(model: PreTrainedModel, base: PreTrainedModel) -> str:
    """How a variant's model differs from the first pair's: ``"same"``, its quantization, or its name and dtype."""
    if model is base:
        return "same"
    path = getattr(cpu_path(model), "name", "stock")
    return quantization_of(model) or (f"{model.name_or_path or 'tiny'} ({str(model.dtype).removeprefix('torch.')}, "
                                      f"CPU path {path})")
