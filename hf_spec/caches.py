"""The one place that touches the KV-cache API.

Invariant, stated once: between rounds each model's cache holds the keys and values of a prefix of the accepted
sequence that stops before its last token (the target's holds exactly that; the draft's may stop one token earlier,
after a fully accepted block). The next forward pass of each model feeds the tokens its cache lacks, so the draft
catches up on its last accepted token in the same pass that drafts the next block: nothing accepted is recomputed.

Caches are only ever shortened through ``Cache.crop`` (a negative count drops the newest positions), except after
a round that verified a tree of drafts: there every node's entries were cached, and `keep_tree_path` keeps the
committed prefix and the accepted path's entries (gathered, never recomputed) before the usual crop. A cache whose
layers cannot be cropped back exactly is refused before any forward pass.

Rows and columns. A batch's caches are one rectangle whose columns are cache positions (`hf_spec.rows`); a row that
accepted fewer drafts than another has masked holes there. Two kinds of layer cannot hold holes as they are:

- A sliding-window layer (Mistral, Gemma 2/3, Phi-3, GPT-OSS...) keeps its last ``window - 1`` columns, and its mask
  admits the keys less than ``window`` columns before a query, holes included: a row with holes there would see fewer
  of its own tokens than target-only decoding gives it. So after every round each row's holes in its last columns
  are moved to the left of them (`move_columns`), in every cache of the call, before the rollback crops them back to
  their window. Positions follow the attention mask, so no token's position, key or value changes.
- A recurrent or linear-attention layer (Mamba, Jamba, Qwen3-Next...) holds a state that a hole (a masked token)
  would still change. Its rollback restores the state recorded after each token of the last pass (transformers'
  recurrent-state recording, `activate_past_recording(recurrent_states_to_keep=...)`), the same count for every
  row; so no round of such a call may leave holes (`ColumnRules.allows_holes`: every row keeps as many drafts as the
  row that accepted fewest, `hf_spec.rows.RaggedBatch.usable_counts`).

Two kinds of cache keep the invariant: transformers' ``DynamicCache`` (its tensors grow and are cut), and its
``StaticCache`` (``cache_implementation="static"``: tensors of ``max_cache_len`` positions allocated once, for
``torch.compile``), where a crop moves the write position back and the rejected positions' stale entries stay in
place: the next pass writes over them before any query can see them (a pass writes every position it feeds before
attending, and a query at position i attends to positions up to i only), so they never reach a later query. A
static cache's forward passes take the 2D attention mask padded to ``max_cache_len`` (`static_length`).

An encoder-decoder's ``EncoderDecoderCache`` keeps these rules in its self-attention part (`decoder_part`); its
cross-attention part, and what else the model reads every pass (`attach_inputs`: the encoder's outputs), follow rows.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any

import torch
from transformers import Cache, DynamicCache, EncoderDecoderCache, PreTrainedModel, StaticCache
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    StaticLayer,
)

from hf_spec.compat import records_recurrent_states

#: The widest pass a draft model's cache must be able to roll back by default: a step, or a 2-token catch-up.
DRAFT_PASS_TOKENS = 2
#: The fewest positions of a static cache hf_spec makes for a call (`static_cache_size`).
MIN_STATIC_CACHE = 256


@dataclasses.dataclass(frozen=True)
class ColumnRules:
    """What a call's caches ask of the batch's columns (the module docstring)."""

    window: int | None = None  # the longest sliding window: each row's last `window` columns must be its own tokens
    allows_holes: bool = True  # False with recurrent states: every row keeps the same number of tokens a round

    def __or__(self, other: ColumnRules) -> ColumnRules:
        windows = [w for w in (self.window, other.window) if w is not None]
        return ColumnRules(max(windows, default=None), self.allows_holes and other.allows_holes)


def new_cache(model: PreTrainedModel, static_length: int | None = None,
              max_pass: int = DRAFT_PASS_TOKENS) -> DynamicCache | StaticCache:
    """A fresh, rollback-ready cache for ``model`` (the draft's; generate() makes the target's): dynamic, or static
    with ``static_length`` positions (beside a cross-attention cache where it reads an encoder's outputs);
    ``max_pass``: the most tokens a pass after the first feeds (what a rollback may drop)."""
    config = model.config.get_text_config(decoder=True)
    cache = (DynamicCache(config=config) if static_length is None
             else StaticCache(config=config, max_cache_len=static_length))
    if reads_encoder_outputs(model):
        cache = EncoderDecoderCache(cache, DynamicCache(config=config))
    check_rollback(cache, "assistant_model", model_type(model))
    prepare_for_rollback(cache, max_pass)
    return cache


def reads_encoder_outputs(model: PreTrainedModel) -> bool:
    """Whether ``model``'s decoder attends over an encoder's outputs: an encoder-decoder model, or a decoder taking
    another model's (``encoder_outputs``: Whisper's decoder as distil-whisper's assistant, `WhisperForCausalLM`)."""
    forward = getattr(type(model), "forward", None)  # a draft head's layers stand in for a model without one
    takes_encoder_outputs = forward is not None and "encoder_outputs" in inspect.signature(forward).parameters
    return bool(model.config.is_encoder_decoder) or takes_encoder_outputs


def decoder_part(cache: Cache) -> Cache:
    """The part of ``cache`` the decoder's tokens fill: an ``EncoderDecoderCache``'s self-attention cache, else all."""
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def attach_inputs(cache: Cache, inputs: dict[str, Any]) -> None:
    """What a model reads on every pass beside its tokens, held with its cache (`attached_inputs`): tensors of one row
    per batch row, or model outputs of such tensors (`select_rows` selects them)."""
    _ATTACHED[cache] = dict(inputs)


def attached_inputs(cache: Cache) -> dict[str, Any]:
    return _ATTACHED.get(cache, {})


_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {forward argument: per-row value}


def _select(value: Any, rows: torch.Tensor) -> Any:
    """``value`` with only ``rows`` of every tensor it holds (a model output: a copy of the same class)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_select(item, rows) for item in value)
    if isinstance(value, dict):  # transformers' ModelOutput is a dict of its set fields
        return type(value)(**{name: _select(item, rows) for name, item in value.items()})
    return value.index_select(0, rows.to(value.device)) if isinstance(value, torch.Tensor) else value


def model_type(model: PreTrainedModel) -> str:
    """The model's ``model_type`` (``"mamba"``, ``"mistral"``...) and class, for error messages."""
    return f"{model.config.model_type!r} ({type(model).__name__})"


def static_length(cache: Cache | None) -> int | None:
    """``max_cache_len`` of a static cache, ``None`` for a dynamic one."""
    cache = None if cache is None else decoder_part(cache)
    return cache.layers[0].max_cache_len if isinstance(cache, StaticCache) else None


def check_rollback(cache: Cache | None, argument: str, model: str = "") -> None:
    """Refuse a cache that cannot be rolled back exactly: not croppable (quantized, offloaded, sliding-window static),
    or holding recurrent states that this transformers cannot record.

    Args:
        cache: the cache a model will use.
        argument: the name the user knows this cache by, for the error message.
        model: the model's type, for the error message (`model_type`).
    """
    cache = None if cache is None else decoder_part(cache)
    layers = getattr(cache, "layers", [])
    layer_types = sorted({type(layer).__name__ for layer in layers})
    if _has_recurrent(layers) and not records_recurrent_states():
        raise ValueError(
            f"The model {model or 'given'} keeps recurrent (state-space or linear-attention) states in `{argument}` "
            f"(layers: {', '.join(layer_types)}). Rolling them back to the accepted drafts needs the state after every "
            "token of a pass, which transformers records from version 5.25 on; upgrade transformers "
            "(`pip install -U transformers`) to speculate with this model."
        )
    if not _is_plain_static(cache) and (not isinstance(cache, DynamicCache) or not cache.is_croppable):
        raise ValueError(
            f"Speculative decoding rolls caches back with `crop`, but `{argument}` uses {type(cache).__name__} "
            f"(layers: {', '.join(layer_types) or 'none'}; the model {model or 'given'}), which cannot be cropped back "
            "exactly. Use the default dynamic cache or `cache_implementation='static'` (quantized, offloaded and "
            "sliding-window static caches are refused), and do not pass a `cache=` of another type."
        )


def prepare_for_rollback(cache: Cache, max_pass: int) -> None:
    """Make a cache that `check_rollback` accepted keep what a rollback needs: sliding-window layers keep their columns
    past the window until the next crop, and recurrent layers the state after each of the last ``max_pass`` tokens of a
    pass (transformers' past recording), so that the rollback can drop the rejected drafts of a pass of up to
    ``max_pass`` tokens (the most tokens a forward pass after the first feeds). A static cache needs nothing."""
    cache = decoder_part(cache)
    if _is_plain_static(cache):
        return
    if _has_recurrent(cache.layers):
        cache.activate_past_recording(recurrent_states_to_keep=max_pass)
    else:
        cache.activate_past_recording()


def _is_plain_static(cache: Cache | None) -> bool:
    """A static cache of plain static layers, not offloaded: what a crop rolls back by moving its write position."""
    layers = getattr(cache, "layers", [])
    return (isinstance(cache, StaticCache) and all(type(layer) is StaticLayer for layer in layers)
            and not cache.offloading)


def _has_recurrent(layers) -> bool:
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)


def column_rules(cache: Cache | None) -> ColumnRules:
    """What ``cache``'s layers ask of the batch's columns (the module docstring)."""
    layers = getattr(None if cache is None else decoder_part(cache), "layers", [])
    windows = [layer.sliding_window for layer in layers if isinstance(layer, DynamicSlidingWindowLayer)]
    has_recurrent = any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)
    return ColumnRules(max(windows, default=None), not has_recurrent)


def attends(cache: Cache) -> bool:
    """Whether any layer of ``cache`` attends over its positions (keys and values); a recurrent-only cache (Mamba's)
    does not, and its model reads the attention mask of the tokens fed only (transformers feeds it none when
    decoding)."""
    layers = decoder_part(cache).layers
    return not layers or any(isinstance(layer, CacheLayerMixin) for layer in layers)


def move_columns(cache: Cache, first: int, order: torch.Tensor) -> None:
    """Rearrange each row's columns ``first ..``: row b's column ``first + j`` takes its column ``first + order[b, j]``
    (``order`` ``[rows, n]``, each row a permutation of ``0 .. n - 1``).

    A layer that holds only its last columns (a sliding window's) rearranges those; a column whose source it does
    not hold keeps its entry: `hf_spec.rows` only moves holes to the left of a row's last ``window`` columns, so a
    source before the layer's first entry feeds a column before the window, which the next crop drops, and a source
    past its last (a draft's cache one column short) is a hole, masked wherever it lands.
    """
    for layer in decoder_part(cache).layers:
        if getattr(layer, "keys", None) is None or not layer.is_initialized or layer.keys.numel() == 0:
            continue  # a recurrent layer has no columns (its calls never move any: `ColumnRules.allows_holes`)
        held = layer.keys.shape[-2]
        start = 0 if isinstance(layer, StaticLayer) else int(layer.get_seq_length()) - held  # column of entry 0
        low, high = max(first, start), min(first + order.shape[1], start + held)
        if low >= high:
            continue
        device = layer.keys.device
        targets = torch.arange(low, high, device=device)  # [m] columns written
        sources = first + order[:, low - first: high - first].to(device)  # [rows, m]
        sources = torch.where((sources >= start) & (sources < start + held), sources, targets) - start  # [rows, m]
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [rows, heads, held, head_dim]
            index = sources[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1])
            states[:, :, low - start: high - start] = states.gather(2, index)


def cache_length(cache: Cache) -> int:
    """Number of positions the cache holds (a static cache's write position)."""
    return int(cache.get_seq_length())


def crop_to(cache: Cache, length: int) -> None:
    """Drop the newest positions so that the cache holds ``length`` of them (never grows it).

    ``crop`` is called even when nothing is dropped: sliding-window layers use it to shrink back to their window.
    """
    held = cache_length(cache)
    if held > 0:  # an empty cache has nothing to drop (and transformers' sliding layers cannot crop before a pass)
        decoder_part(cache).crop(min(0, length - held))


def select_rows(cache: Cache, rows: torch.Tensor) -> None:
    """Keep only ``rows`` ``[kept]`` (batch indices) of the cache: finished rows leave it (a static cache's tensors
    are reallocated for the smaller batch: a compiled pass then compiles for the new batch size, once). An encoder-
    decoder cache's cross-attention part and the inputs attached to the cache (`attach_inputs`) follow."""
    if cache in _ATTACHED:
        _ATTACHED[cache] = {name: _select(value, rows) for name, value in _ATTACHED[cache].items()}
    if isinstance(cache, EncoderDecoderCache):
        for layer in cache.cross_attention_cache.layers:
            layer.reorder_cache(rows)
        cache = cache.self_attention_cache
    if not isinstance(cache, StaticCache):
        for layer in cache.layers:  # `reorder_cache` selects every state a layer holds (keys, conv, recurrent)
            layer.reorder_cache(rows)
        return
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
            layer.values = layer.values.index_select(0, rows.to(layer.values.device))
            layer.batch_size = layer.keys.shape[0]


def fit_prompt(cache: Cache, prompt_length: int) -> None:
    """Make a cache the caller filled hold a prefix of the prompt shorter than it (the invariant), as transformers
    does: one holding the whole prompt gives back its last position, whose token the first pass feeds again (the
    same keys and values come back); one holding more than the prompt is refused.

    Args:
        prompt_length: tokens in ``input_ids`` (padding included).
    """
    length = cache_length(cache)
    if length > prompt_length:
        raise ValueError(
            f"`cache` holds {length} positions, but `input_ids` has only {prompt_length} tokens per row: pass as "
            "`input_ids` the whole sequence the cache was built from (the prompt and what followed), as "
            "transformers expects."
        )
    if length == prompt_length:
        if not column_rules(cache).allows_holes:
            raise ValueError(
                f"`cache` holds all {length} tokens of `input_ids`, but it keeps recurrent states, which cannot give "
                "back the last token the first pass must feed again; pass a cache that holds fewer tokens than "
                "`input_ids` (the cache returned by a previous speculative call does)."
            )
        crop_to(cache, prompt_length - 1)


def check_cache_rows(cache: Cache, batch_size: int, argument: str) -> None:
    """A filled cache must hold one row per row of the input (its first filled layer says how many it holds)."""
    for layer in decoder_part(cache).layers:
        states = [getattr(layer, name, None) for name in ("keys", "conv_states", "recurrent_states")]
        held = next((tensor.shape[0] for tensor in states if isinstance(tensor, torch.Tensor) and tensor.numel()), None)
        if held is not None and held != batch_size and cache_length(cache) > 0:
            raise ValueError(f"`{argument}` holds {held} rows, but `input_ids` has {batch_size}; pass the cache of "
                             "this batch (or none).")
        if held is not None:
            return


def keep_tree_path(cache: Cache, num_committed: int, columns: list[int]) -> None:
    """Keep the first ``num_committed`` positions and, after them, the positions ``num_committed + columns`` in that
    order (a tree's accepted path: its keys and values were computed at the positions the path now has, so they are
    kept as they are, not recomputed); drop the rest of the tree.

    Only ``DynamicLayer`` and ``StaticLayer`` caches can be rearranged this way (`check_tree_cache`). The path's
    few entries are gathered and written right after the prefix, then the rest is cut off (a view, not a copy).
    """
    end = num_committed + len(columns)
    cache = decoder_part(cache)
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        index = torch.tensor(columns, dtype=torch.long, device=layer.keys.device) + num_committed
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [batch, heads, positions, head_dim]
            states[..., num_committed:end, :] = states.index_select(-2, index)  # gathered first: a small copy
            if type(layer) is not StaticLayer:  # a static layer keeps its tensors; the crop moves its position
                setattr(layer, name, states[..., :end, :])
    if isinstance(cache, StaticCache):
        crop_to(cache, end)


def check_tree_cache(cache: Cache, argument: str) -> None:
    """Refuse a cache whose layers `keep_tree_path` cannot rearrange (sliding windows keep only their window)."""
    layers = decoder_part(cache).layers
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) not in (DynamicLayer, StaticLayer)})
    if kinds:
        raise ValueError(f"Tree drafts keep the accepted path's entries of `{argument}`, which needs plain "
                         f"DynamicLayer or StaticLayer layers, but it has {', '.join(kinds)}; use a chain of drafts "
                         "(leave `num_tree_nodes` unset) with this model.")


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


def sized_static_cache(model: PreTrainedModel, cache: Cache, input_ids: torch.Tensor, max_length: int,
                       max_cache_len: int | None, max_drafted: int) -> Cache:
    """A static cache that holds every position the call may write (`static_cache_length`), of a size that
    depends on this call only: ``max_cache_len`` when the user set one that large, else the needed length rounded
    up (`static_cache_size`: calls of other prompt lengths reuse their compiled graphs). transformers sizes a
    fresh one for ``max_length`` (or for an earlier call's larger size), so it is made again when its size
    differs; a filled one (passed as ``cache=``) is kept (`hf_spec.validation.check_static_cache` refused it where
    too small). A dynamic cache is returned as it is."""
    length = static_length(cache)
    if length is None or cache_length(cache) > 0:
        return cache
    needed = static_cache_length(input_ids.shape[0], input_ids.shape[1], max_length, max_drafted)
    size = max_cache_len if max_cache_len is not None and max_cache_len >= needed else static_cache_size(needed)
    return cache if length == size else new_cache(model, size)
