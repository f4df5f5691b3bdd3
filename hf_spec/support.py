"""Which models hf_spec can speculate with exactly: the families refused by name, and why.

Found on tiny configs of every causal-LM family (`hf_spec.evaluation.zoo`). `refuse_unsupported_family` names a
target's or a draft's family and the reason; `refuse_tree_without_positions` a model that cannot place a tree's nodes.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from hf_spec.compat import ignores_recurrent_recording, records_recurrent_states
from hf_spec.forward import input_names

#: Families whose forward pass breaks what a speculative loop relies on (found on tiny configs of every causal-LM
#: family, `hf_spec.evaluation.zoo`), by ``model_type``: why none of them can be verified exactly.
UNSUPPORTED_FAMILIES = {
    "xlm": "its forward takes the whole sequence every pass and keeps a legacy cache of its own, not transformers' "
           "cache of the tokens fed",
    "cpmant": "it adds prompt positions of its own to the cache, so the cache does not hold one position per token",
    "moshi": "its sliding-window attention gives a multi-token pass other logits than single steps in transformers "
             "itself (by 0.2 on a tiny config), so no verify pass can reproduce step-by-step decoding",
    "recurrent_gemma": "its recurrent blocks give a multi-token pass other logits than single steps in transformers "
                       "itself (by 0.1 on a tiny config, with or without its window), so no verify pass can reproduce "
                       "step-by-step decoding",
}


def refuse_unsupported_family(model: PreTrainedModel, argument: str) -> None:
    """Refuse, by its ``model_type`` and the reason, a family in `UNSUPPORTED_FAMILIES`, and one whose recurrent
    layers ignore transformers' recurrent-state recording (the rollback would restore a wrong state)."""
    model_type = model.config.model_type
    reason = UNSUPPORTED_FAMILIES.get(model_type)
    if reason is None and ignores_recurrent_recording(model):
        reason = ("its recurrent layers do not record their state after each token of a pass (its modeling code does "
                  "not read `get_recurrent_states_to_keep`), so a rollback cannot restore the state of the accepted "
                  "drafts")
        if not records_recurrent_states():
            reason += "; transformers records recurrent states from version 5.25 on: upgrade transformers"
    if reason is not None:
        raise ValueError(f"`{argument}` is a {model_type!r} model ({type(model).__name__}), which hf_spec cannot "
                         f"speculate with exactly: {reason}. Use another model, or transformers' plain generate().")


def refuse_tree_without_positions(model: PreTrainedModel, argument: str) -> None:
    """Tree drafts place each node at its depth's position: a model whose forward takes no positions (it places
    tokens by cache position: T5, BART, distil-whisper's decoder) cannot verify or draft a tree."""
    if input_names(type(model)).positions is None:
        raise ValueError(f"`num_tree_nodes`: tree drafts place each node at its depth's position, which `{argument}` "
                         f"({type(model).__name__}) cannot take (its forward places tokens by cache position); "
                         "leave `num_tree_nodes` unset to draft chains.")
