"""Every use of transformers' private API, in one place: an upgrade of transformers is one file to review.

Each helper names the private attribute or function it reaches and is tested against the pinned version
(``tests/test_compat.py``). Nothing else in hf_spec touches a name that starts with an underscore in transformers.
"""

from __future__ import annotations

from transformers import PreTrainedModel


def modules_kept_in_full_precision(model: PreTrainedModel) -> list[str]:
    """Names of the modules transformers' bitsandbytes quantizer leaves unquantized by default (the output
    embeddings, tied weights, the last module): ``transformers.quantizers.base.get_keys_to_not_convert``."""
    from transformers.quantizers.base import get_keys_to_not_convert

    return list(get_keys_to_not_convert(model)) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
