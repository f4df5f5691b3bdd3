"""The one place that touches the KV-cache API.

Invariant, stated once: between rounds each model's cache holds the keys and values of a prefix of the accepted
sequence that stops before its last token (the target's holds exactly that; the draft's may stop one token earlier,
after a fully accepted block). The next forward pass of each model feeds the tokens its cache lacks, so the draft
catches up on its last accepted token in the same pass that drafts the next block: nothing accepted is recomputed.

Caches are only ever shortened through ``Cache.crop`` (a negative count drops the newest positions), except after
a round that verified a tree of drafts: there every node's entries were cached, and `keep_tree_path` keeps the
committed prefix and the accepted path's entries (gathered, never recomputed) before the usual crop. A cache whose
layers cannot be cropped back exactly is refused before any forward pass.

Two kinds of cache keep the invariant: transformers' ``DynamicCache`` (its tensors grow and are cut), and its
``StaticCache`` (``cache_implementation="static"``: tensors of ``max_cache_len`` positions allocated once, for
``torch.compile``), where a crop moves the write position back and the rejected positions' stale entries stay in
place: the next pass writes over them before any query can see them (a pass writes every position it feeds before
attending, and a query at position i attends to positions up to i only), so they never reach a later query. A
static cache's forward passes take the 2D attention mask padded to ``max_cache_len`` (`static_length`).
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer


def new_cache(model: PreTrainedModel, static_length: int | None = None) -> DynamicCache | StaticCache:
    """A fresh, rollback-ready cache for ``model`` (the draft's; generate() makes the target's): dynamic, or static
    with ``static_length`` positions."""
    config = model.config.get_text_config(decoder=True)
    cache = (DynamicCache(config=config) if static_length is None
             else StaticCache(config=config, max_cache_len=static_length))
    prepare_for_rollback(cache, "assistant_model")
    return cache


def static_length(cache: Cache | None) -> int | None:
    """``max_cache_len`` of a static cache, ``None`` for a dynamic one."""
    return cache.layers[0].max_cache_len if isinstance(cache, StaticCache) else None


def prepare_for_rollback(cache: Cache | None, argument: str) -> None:
    """Refuse a cache that cannot be cropped back exactly; make sliding-window layers keep what a rollback needs.

    Args:
        cache: the cache a model will use.
        argument: the name the user knows this cache by, for the error message.
    """
    is_static = (isinstance(cache, StaticCache) and all(type(layer) is StaticLayer for layer in cache.layers)
                 and not cache.offloading)
    if not is_static and (not isinstance(cache, DynamicCache) or not cache.is_croppable):
        layer_types = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])})
        raise ValueError(
            f"Speculative decoding rolls caches back with `crop`, but `{argument}` uses {type(cache).__name__} "
            f"(layers: {', '.join(layer_types) or 'none'}), which cannot be cropped back exactly. Use the default "
            "dynamic cache or `cache_implementation='static'` (quantized, offloaded and sliding-window static "
            "caches are refused), and do not pass a `cache=` of another type."
        )
    if not is_static:
        cache.activate_past_recording()


def cache_length(cache: Cache) -> int:
    """Number of positions the cache holds (a static cache's write position)."""
    return int(cache.get_seq_length())


def crop_to(cache: Cache, length: int) -> None:
    """Drop the newest positions so that the cache holds ``length`` of them (never grows it).

    ``crop`` is called even when nothing is dropped: sliding-window layers use it to shrink back to their window.
    """
    cache.crop(min(0, length - cache_length(cache)))


def select_rows(cache: Cache, rows: torch.Tensor) -> None:
    """Keep only ``rows`` ``[kept]`` (batch indices) of the cache: finished rows leave it (a static cache's tensors
    are reallocated for the smaller batch: a compiled pass then compiles for the new batch size, once)."""
    if not isinstance(cache, StaticCache):
        cache.batch_select_indices(rows)
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
        crop_to(cache, prompt_length - 1)


def keep_tree_path(cache: Cache, num_committed: int, columns: list[int]) -> None:
    """Keep the first ``num_committed`` positions and, after them, the positions ``num_committed + columns`` in that
    order (a tree's accepted path: its keys and values were computed at the positions the path now has, so they are
    kept as they are, not recomputed); drop the rest of the tree.

    Only ``DynamicLayer`` and ``StaticLayer`` caches can be rearranged this way (`check_tree_cache`).
    The path's few entries are gathered and written over the positions right after the prefix, then the rest is cut
    off (a view): the cache itself is not copied.
    """
    end = num_committed + len(columns)
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
    kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in (DynamicLayer, StaticLayer)})
    if kinds:
        raise ValueError(f"Tree drafts keep the accepted path's entries of `{argument}`, which needs plain "
                         f"DynamicLayer or StaticLayer layers, but it has {', '.join(kinds)}; use a chain of drafts "
                         "(leave `num_tree_nodes` unset) with this model.")
