"""What a speculative ``generate()`` call asks for, resolved once: the drafter, the round's shape and its sizer.

`plan_call` reads the call's speculative settings and returns the `hf_spec.rounds.Rounds` the loop runs. The drafter
(`make_drafter`), by what is passed:

| ``assistant_model`` | ``prompt_lookup_num_tokens`` | chain (``num_tree_nodes`` unset) | tree (``num_tree_nodes``) |
|---|---|---|---|
| a `Drafter` of your own | ignored by it | the drafter | the drafter, if a `TreeDrafter` |
| a `DraftSource` (a draft head) | refused | its chain drafter | its tree drafter |
| a model | unset | `ModelDrafter` | `ModelTreeDrafter` |
| a model | n | `LookupThenModel` | refused |
| none | n | `PromptLookupDrafter` | `SuffixDrafter` |
| a model, and an ``assistant_tokenizer`` of another vocabulary | refused | `CrossTokenizerDrafter` | refused |

The sizer: k from ``num_assistant_tokens`` (an integer, ``"auto"`` or an `AutoDraftLength`) for a chain; a node
budget from ``num_tree_nodes`` (an integer, ``"auto"`` or an `AutoTreeSize`) for a tree, ``num_assistant_tokens``
then capping its depth. The acceptance rules of sampled rounds from ``verification`` (`hf_spec.verification`). Where
each setting is read from, first found first: the ``generate()`` call, the ``generation_config`` passed to it, the
target's ``generation_config``, the draft's (`user_settings`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from hf_spec.caches import cache_length, new_cache, static_length
from hf_spec.checks import check_int, is_int_at_least
from hf_spec.drafting.base import Drafter, DraftSource
from hf_spec.drafting.cross_tokenizer import CrossTokenizerDrafter
from hf_spec.drafting.lookup import LookupThenModel, PromptLookupDrafter
from hf_spec.drafting.model import ModelDrafter
from hf_spec.drafting.model_tree import ModelTreeDrafter
from hf_spec.drafting.suffix import SuffixDrafter
from hf_spec.drafting.tree import TreeDrafter
from hf_spec.rounds import ChainRounds, Rounds, TreeRounds
from hf_spec.settings import ASSISTANT_SETTINGS
from hf_spec.sizing.draft_length import (
    DEFAULT_MAX_DRAFT_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    AutoDraftLength,
    FixedDraftLength,
    HeuristicDraftLength,
)
from hf_spec.sizing.tree_size import AutoTreeSize, FixedTreeSize
from hf_spec.validation import is_other_vocabulary
from hf_spec.verification import resolve_verification

#: Suffix matching looks for longer matches than prompt lookup's default 2: they choose better continuations.
SUFFIX_NGRAM_SIZE = 4
#: The fewest positions of a static cache hf_spec makes for a call (`static_cache_size`).
MIN_STATIC_CACHE = 256
#: The settings hf_spec reads itself, beside transformers' merged generation config (whose assisted-generation
#: fields hold transformers' global defaults when nobody set them).
READ_SETTINGS = ("num_tree_nodes", "verification", *ASSISTANT_SETTINGS)


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """The hf_spec side of one ``generate()`` call: what transformers' kwargs handling would reject or merge away."""

    generator: torch.Generator | None = None
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # `READ_SETTINGS` the user set, by name
    # a vision-language target's raw image inputs (transformers encodes and drops them before the loop): a
    # vision-language draft encodes them with its own vision tower
    media: dict[str, Any] = dataclasses.field(default_factory=dict)


def user_settings(kwargs: dict, generation_config: GenerationConfig | None, target: PreTrainedModel,
                  draft: Any) -> dict[str, Any]:
    """Each of `READ_SETTINGS` from the first place that sets it: the call's ``kwargs``, the ``generation_config``
    passed, the target's ``generation_config``, the draft's (transformers reads only the draft's)."""
    sources = [kwargs, generation_config, target.generation_config, getattr(draft, "generation_config", None)]
    found = {}
    for name in READ_SETTINGS:
        for source in sources:
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if value is not None:
                found[name] = value
                break
    return found


def plan_call(assistant_model: Any, generation_config: GenerationConfig, options: CallOptions,
              tokenizers: tuple[Any, Any] = (None, None)) -> Rounds:
    """The round shape, drafter and sizer of a call; errors name the argument and its value. ``tokenizers``: the
    call's ``(tokenizer, assistant_tokenizer)``."""
    lookup_tokens, ngram_size = resolve_prompt_lookup(generation_config)
    settings = options.settings
    num_assistant_tokens, num_tree_nodes = settings.get("num_assistant_tokens"), settings.get("num_tree_nodes")
    schedule = settings.get("num_assistant_tokens_schedule")
    threshold = check_threshold(settings.get("assistant_confidence_threshold"))
    is_tree = num_tree_nodes is not None
    verification = resolve_verification(settings.get("verification"))
    if is_other_vocabulary(*tokenizers):
        drafter = cross_tokenizer_drafter(assistant_model, tokenizers, is_tree, lookup_tokens)
    else:
        drafter = make_drafter(assistant_model, tree=is_tree, prompt_lookup_num_tokens=lookup_tokens,
                               ngram_size=ngram_size)
    if is_tree:
        for name, value in (("num_assistant_tokens_schedule", schedule), ("assistant_confidence_threshold", threshold)):
            if value not in (None, "constant"):
                raise ValueError(f"`{name}`={value!r} shapes a chain of drafts; with `num_tree_nodes` the tree's "
                                 "size comes from `num_tree_nodes` (an integer or 'auto'). Pass one of them.")
        return TreeRounds(drafter, resolve_tree_size(num_tree_nodes, num_assistant_tokens, lookup_tokens),
                          verification)
    return ChainRounds(drafter, resolve_num_draft_tokens(num_assistant_tokens, lookup_tokens, schedule), threshold,
                       verification)


def make_drafter(assistant_model: Any, *, tree: bool = False, prompt_lookup_num_tokens: int | None = None,
                 ngram_size: int = 2) -> Drafter:
    """The drafter ``assistant_model`` and prompt lookup ask for (the module docstring's table)."""
    if isinstance(assistant_model, Drafter):
        if tree and not isinstance(assistant_model, TreeDrafter):
            raise TypeError(f"`num_tree_nodes` needs a drafter that proposes trees (a TreeDrafter), but "
                            f"`assistant_model` is a {type(assistant_model).__name__}.")
        return assistant_model
    if isinstance(assistant_model, DraftSource):
        if prompt_lookup_num_tokens is not None:
            raise ValueError(f"`prompt_lookup_num_tokens` with a draft head ({type(assistant_model).__name__}) as "
                             "`assistant_model` is not supported: pass one of them.")
        return assistant_model.hf_spec_drafter(tree=tree)
    if assistant_model is not None and not isinstance(assistant_model, PreTrainedModel):
        raise TypeError(f"`assistant_model` must be a transformers PreTrainedModel or an hf_spec Drafter, but is "
                        f"{type(assistant_model).__name__}.")
    if assistant_model is None:
        if tree:
            return SuffixDrafter(max_ngram_size=max(SUFFIX_NGRAM_SIZE, ngram_size))
        return PromptLookupDrafter(max_ngram_size=ngram_size)
    if prompt_lookup_num_tokens is None:
        return ModelTreeDrafter(assistant_model) if tree else ModelDrafter(assistant_model)
    if tree:
        raise ValueError("`num_tree_nodes` with both `assistant_model` and `prompt_lookup_num_tokens` is not "
                         "supported: pass one of them (the draft model's tree, or suffix matching).")
    return LookupThenModel(PromptLookupDrafter(max_ngram_size=ngram_size), ModelDrafter(assistant_model))


def cross_tokenizer_drafter(assistant_model: Any, tokenizers: tuple[Any, Any], tree: bool,
                            prompt_lookup_num_tokens: int | None) -> CrossTokenizerDrafter:
    """A draft model with a vocabulary of its own: chains only, from the model alone."""
    if not isinstance(assistant_model, PreTrainedModel) or isinstance(assistant_model, DraftSource):
        raise ValueError(f"`assistant_tokenizer` with another vocabulary needs a draft model as `assistant_model`, "
                         f"but it is a {type(assistant_model).__name__}: a drafter or draft head proposes the "
                         "target's ids itself; drop `assistant_tokenizer`.")
    for name, value in (("num_tree_nodes", tree or None), ("prompt_lookup_num_tokens", prompt_lookup_num_tokens)):
        if value is not None:
            raise ValueError(f"`{name}` with a draft of another tokenizer (`assistant_tokenizer`) is not supported: "
                             "its drafts are chains from the draft model alone.")
    return CrossTokenizerDrafter(assistant_model, *tokenizers)


def resolve_num_draft_tokens(value: Any, prompt_lookup_num_tokens: int | None = None, schedule: str | None = None
                             ) -> FixedDraftLength | HeuristicDraftLength | AutoDraftLength:
    """How k is chosen: ``num_assistant_tokens`` (as `user_settings` found it), else ``prompt_lookup_num_tokens``,
    else `DEFAULT_NUM_DRAFT_TOKENS`. ``"auto"`` makes a new `AutoDraftLength` (at most ``prompt_lookup_num_tokens``
    tokens with prompt lookup); an `AutoDraftLength` instance is used as is, keeping what it learnt in earlier calls.
    ``schedule`` (transformers' ``num_assistant_tokens_schedule``) ``"heuristic"``/``"heuristic_transient"`` starts
    a `HeuristicDraftLength` from k."""
    if schedule not in (None, "constant", "heuristic", "heuristic_transient"):
        raise ValueError(f"`num_assistant_tokens_schedule` must be 'constant', 'heuristic' or 'heuristic_transient', "
                         f"but is {schedule!r}.")
    if schedule in ("heuristic", "heuristic_transient"):
        if isinstance(value, AutoDraftLength) or (isinstance(value, str) and value == "auto"):
            raise ValueError(f"`num_assistant_tokens='auto'` and `num_assistant_tokens_schedule={schedule!r}` both "
                             "choose k every round: pass one of them.")
        start = resolve_num_draft_tokens(value, prompt_lookup_num_tokens)
        return HeuristicDraftLength(start.num_draft_tokens)
    if value is None:
        value = prompt_lookup_num_tokens
    if value is None:
        return FixedDraftLength(DEFAULT_NUM_DRAFT_TOKENS)
    if isinstance(value, AutoDraftLength):
        return value
    if isinstance(value, str) and value == "auto":
        return AutoDraftLength(max_draft_tokens=prompt_lookup_num_tokens or DEFAULT_MAX_DRAFT_TOKENS)
    if not is_int_at_least(value, 1):
        raise ValueError(
            f"`num_assistant_tokens` (the draft block length k) must be a positive integer, 'auto' or an "
            f"AutoDraftLength, but is {value!r} ({type(value).__name__})."
        )
    return FixedDraftLength(int(value))


def resolve_tree_size(num_tree_nodes: Any, num_assistant_tokens: Any,
                      prompt_lookup_num_tokens: int | None) -> FixedTreeSize | AutoTreeSize:
    """How each round's tree is sized: ``num_tree_nodes`` nodes at most (an integer), or ``"auto"`` (a new
    `AutoTreeSize`; an instance is used as is, keeping what it learnt). The depth limit is ``num_assistant_tokens``,
    else ``prompt_lookup_num_tokens``, else the node budget (``"auto"``: `DEFAULT_MAX_DRAFT_TOKENS`)."""
    check_tree_nodes(num_tree_nodes)
    if isinstance(num_tree_nodes, AutoTreeSize):
        return num_tree_nodes
    depth = num_assistant_tokens if is_int_at_least(num_assistant_tokens, 1) else prompt_lookup_num_tokens
    if num_tree_nodes == "auto":
        if num_assistant_tokens not in (None, "auto") and not is_int_at_least(num_assistant_tokens, 1):
            raise ValueError(f"`num_assistant_tokens` caps a tree's depth: a positive integer, 'auto' or unset, "
                             f"but is {num_assistant_tokens!r}.")
        return AutoTreeSize(max_depth=depth or DEFAULT_MAX_DRAFT_TOKENS)
    if num_assistant_tokens is not None and not is_int_at_least(num_assistant_tokens, 1):
        raise ValueError(
            f"`num_assistant_tokens` is {num_assistant_tokens!r}; with a fixed `num_tree_nodes` it caps the tree's "
            "depth and must be a positive integer. Pass `num_tree_nodes='auto'` to let the tree's size and depth "
            "follow measured acceptance and costs."
        )
    return FixedTreeSize(num_tree_nodes, depth or num_tree_nodes)


def check_threshold(threshold: Any) -> float | None:
    """``assistant_confidence_threshold``: unset, or a number in [0, 1) (0: never stop early)."""
    if threshold is None:
        return None
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise ValueError(f"`assistant_confidence_threshold` must be a number in [0, 1), but is {threshold!r}.")
    return float(threshold) or None


def check_tree_nodes(num_tree_nodes: Any) -> None:
    """``num_tree_nodes`` must be a positive integer, ``"auto"`` or an `AutoTreeSize`."""
    if not (is_int_at_least(num_tree_nodes, 1) or isinstance(num_tree_nodes, AutoTreeSize)
            or (isinstance(num_tree_nodes, str) and num_tree_nodes == "auto")):
        raise ValueError(f"`num_tree_nodes` (draft tokens per tree) must be a positive integer, 'auto' or an "
                         f"AutoTreeSize, but is {num_tree_nodes!r} ({type(num_tree_nodes).__name__}).")


def resolve_prompt_lookup(generation_config: GenerationConfig) -> tuple[int | None, int]:
    """``(prompt_lookup_num_tokens or None, max_matching_ngram_size)``, validated (transformers' default n-gram: 2)."""
    num_tokens = generation_config.prompt_lookup_num_tokens
    ngram = generation_config.max_matching_ngram_size
    if num_tokens is not None:
        check_int("prompt_lookup_num_tokens", num_tokens)
    return num_tokens, 2 if ngram is None else check_int("max_matching_ngram_size", ngram)


def static_cache_length(batch_size: int, prompt_length: int, max_length: int, max_drafted: int) -> int:
    """Positions a static cache needs for a call: a verify pass writes up to ``max_drafted`` positions after the
    committed ones, and in a batch every round may add holes (`hf_spec.rows`): the model view grows by up to
    ``max_drafted + 1`` columns a round, for at most ``max_length - prompt_length`` rounds (every row gains a token
    each round)."""
    if batch_size == 1:
        return max_length + max_drafted + 1
    return prompt_length + (max_length - prompt_length) * (max_drafted + 1) + max_drafted + 1


def static_cache_size(needed: int) -> int:
    """Positions of a static cache made for a call that needs ``needed``: the next power of two, at least
    `MIN_STATIC_CACHE`. Compiled passes have the cache's size in their shapes (the mask spans it), so calls whose
    prompts differ in length share their graphs instead of compiling new ones (four minutes a prompt for the 1.5B
    target on a CPU); a decode step's attention over the unused slots costs little beside its weights."""
    return max(MIN_STATIC_CACHE, 1 << (needed - 1).bit_length())


def sized_static_cache(model: PreTrainedModel, cache, input_ids: torch.Tensor, generation_config: GenerationConfig,
                       max_drafted: int):
    """A static cache that holds every position the call may write (`static_cache_length`), of a size that
    depends on this call only: ``max_cache_len`` when the user set one that large, else the needed length rounded
    up (`static_cache_size`: calls of other prompt lengths reuse their compiled graphs). transformers sizes a
    fresh one for ``max_length`` (or for an earlier call's larger size), so it is made again when its size
    differs; a ``max_cache_len`` below ``max_length``, and a filled one (passed as ``cache=``) too small, are
    refused."""
    length = static_length(cache)
    if length is None:
        if generation_config.compile_config is not None and not generation_config.disable_compile:
            raise ValueError("`compile_config` compiles the passes of a static cache; pass "
                             "`cache_implementation='static'`, or a static cache as `cache=` (a dynamic cache's "
                             "shapes change every round).")
        return cache
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and max_drafted > positions:  # only a tree's budget can be (a chain's is capped)
        raise ValueError(f"`num_tree_nodes`={max_drafted} is more than the model's {positions} positions "
                         "(`max_position_embeddings`), and a static cache is sized for the largest tree; pass a "
                         "smaller budget, or use the default dynamic cache.")
    needed = static_cache_length(input_ids.shape[0], input_ids.shape[1], generation_config.max_length,
                                 max_drafted)
    user_length = generation_config.max_cache_len
    if user_length is not None and user_length < generation_config.max_length:
        raise ValueError(f"`max_cache_len`={user_length} is smaller than `max_length`="
                         f"{generation_config.max_length} (the prompt and `max_new_tokens`): the static cache could "
                         f"not hold the answer; pass `max_cache_len={needed}` or more, or leave it unset.")
    if cache_length(cache) > 0:
        if length < needed:
            raise ValueError(f"The static `cache` holds {length} positions, but this call may write {needed} "
                             "(drafts past `max_length`, and a batch's rows drifting apart); build it with "
                             f"`max_cache_len={needed}` or more.")
        return cache
    size = user_length if user_length is not None and user_length >= needed else static_cache_size(needed)
    return cache if length == size else new_cache(model, size)
