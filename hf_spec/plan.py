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

from hf_spec.checks import is_int_at_least
from hf_spec.drafting.base import Drafter, DraftSource
from hf_spec.drafting.cross_tokenizer import CrossTokenizerDrafter
from hf_spec.drafting.lookup import LookupThenModel, PromptLookupDrafter
from hf_spec.drafting.model import ModelDrafter
from hf_spec.drafting.model_tree import ModelTreeDrafter
from hf_spec.drafting.suffix import SuffixDrafter
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
    # the ``begin_suppress_tokens`` the call resolved, where hf_spec's loop runs: Whisper's generate() drops them
    # whenever an assistant is in the call (`SpeculativeGenerationMixin._retrieve_logit_processors` restores them)
    begin_suppress_tokens: list[int] | None = None


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
    """The round shape, drafter and sizer of a call that `hf_spec.validation.ARGUMENT_RULES` checked.
    ``tokenizers``: the call's ``(tokenizer, assistant_tokenizer)``."""
    lookup_tokens = generation_config.prompt_lookup_num_tokens
    ngram_size = generation_config.max_matching_ngram_size or 2  # transformers' default n-gram
    settings = options.settings
    num_assistant_tokens, num_tree_nodes = settings.get("num_assistant_tokens"), settings.get("num_tree_nodes")
    verification = resolve_verification(settings.get("verification"))
    is_tree = num_tree_nodes is not None
    if is_other_vocabulary(*tokenizers):
        drafter = CrossTokenizerDrafter(assistant_model, *tokenizers)
    else:
        drafter = make_drafter(assistant_model, tree=is_tree, prompt_lookup_num_tokens=lookup_tokens,
                               ngram_size=ngram_size)
    if is_tree:
        return TreeRounds(drafter, resolve_tree_size(num_tree_nodes, num_assistant_tokens, lookup_tokens),
                          verification)
    sizer = resolve_num_draft_tokens(num_assistant_tokens, lookup_tokens,
                                     settings.get("num_assistant_tokens_schedule"))
    return ChainRounds(drafter, sizer, settings.get("assistant_confidence_threshold") or None, verification)


def greedy_at_zero_temperature(generation_config: GenerationConfig) -> None:
    """Sampling at temperature 0 is greedy decoding (its limit; transformers would raise instead)."""
    if generation_config.do_sample and generation_config.temperature == 0:
        generation_config.do_sample = False


def make_drafter(assistant_model: Any, *, tree: bool = False, prompt_lookup_num_tokens: int | None = None,
                 ngram_size: int = 2) -> Drafter:
    """The drafter ``assistant_model`` and prompt lookup ask for (the module docstring's table; the combinations it
    leaves out are refused by `hf_spec.validation.check_drafting`)."""
    if isinstance(assistant_model, Drafter):
        return assistant_model
    if isinstance(assistant_model, DraftSource):
        return assistant_model.hf_spec_drafter(tree=tree)
    if assistant_model is None:
        if tree:
            return SuffixDrafter(max_ngram_size=max(SUFFIX_NGRAM_SIZE, ngram_size))
        return PromptLookupDrafter(max_ngram_size=ngram_size)
    if prompt_lookup_num_tokens is None:
        return ModelTreeDrafter(assistant_model) if tree else ModelDrafter(assistant_model)
    return LookupThenModel(PromptLookupDrafter(max_ngram_size=ngram_size), ModelDrafter(assistant_model))


def resolve_num_draft_tokens(value: Any, prompt_lookup_num_tokens: int | None = None, schedule: str | None = None
                             ) -> FixedDraftLength | HeuristicDraftLength | AutoDraftLength:
    """How k is chosen: ``num_assistant_tokens`` (as `user_settings` found it), else ``prompt_lookup_num_tokens``,
    else `DEFAULT_NUM_DRAFT_TOKENS`. ``"auto"`` makes a new `AutoDraftLength` (at most ``prompt_lookup_num_tokens``
    tokens with prompt lookup); an `AutoDraftLength` instance is used as is, keeping what it learnt in earlier calls.
    ``schedule`` (transformers' ``num_assistant_tokens_schedule``) ``"heuristic"``/``"heuristic_transient"`` starts
    a `HeuristicDraftLength` from k."""
    if schedule in ("heuristic", "heuristic_transient"):
        return HeuristicDraftLength(resolve_num_draft_tokens(value, prompt_lookup_num_tokens).num_draft_tokens)
    if value is None:
        value = prompt_lookup_num_tokens
    if value is None:
        return FixedDraftLength(DEFAULT_NUM_DRAFT_TOKENS)
    if isinstance(value, AutoDraftLength):
        return value
    if isinstance(value, str) and value == "auto":
        return AutoDraftLength(max_draft_tokens=prompt_lookup_num_tokens or DEFAULT_MAX_DRAFT_TOKENS)
    return FixedDraftLength(int(value))


def resolve_tree_size(num_tree_nodes: Any, num_assistant_tokens: Any,
                      prompt_lookup_num_tokens: int | None) -> FixedTreeSize | AutoTreeSize:
    """How each round's tree is sized: ``num_tree_nodes`` nodes at most (an integer), or ``"auto"`` (a new
    `AutoTreeSize`; an instance is used as is, keeping what it learnt). The depth limit is ``num_assistant_tokens``,
    else ``prompt_lookup_num_tokens``, else the node budget (``"auto"``: `DEFAULT_MAX_DRAFT_TOKENS`)."""
    if isinstance(num_tree_nodes, AutoTreeSize):
        return num_tree_nodes
    depth = num_assistant_tokens if is_int_at_least(num_assistant_tokens, 1) else prompt_lookup_num_tokens
    if num_tree_nodes == "auto":
        return AutoTreeSize(max_depth=depth or DEFAULT_MAX_DRAFT_TOKENS)
    return FixedTreeSize(num_tree_nodes, depth or num_tree_nodes)
