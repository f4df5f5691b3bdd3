"""The model zoo: every causal-LM family of the installed transformers, as a tiny random model, is exact against its
own ``generate()`` (greedy, a ragged batch and a row alone, prompts longer than every window, a near-copy draft and
another random model of the family) or refused by hf_spec, by name, before any forward pass
(`hf_spec.evaluation.zoo`). A family a new transformers adds runs here too, and fails until it is exact, refused, or
listed in `NOT_CHECKED` with its reason. The sampled law on a sliding-window family and a recurrent family, with
their negative controls, is in ``test_windows_and_states.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from hf_spec.compat import TESTED_TRANSFORMERS, records_recurrent_states
from hf_spec.evaluation.zoo import FAMILIES, NOT_CHECKED, check_family

#: Families a Transformers user brings every day, with sliding windows, mixtures of experts, recurrent and hybrid
#: caches: each must be exact, not only refused.
MUST_BE_EXACT = {
    "llama", "gemma", "phi", "gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "cohere", "olmo2", "granite",
    "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "starcoder2",
    "gpt_oss", "cohere2", "mamba", "mamba2", "jamba", "qwen3_next", "falcon_h1", "bamba", "granitemoehybrid",
    "deepseek_v3", "llama4_text",
}
RECURRENT = {"mamba", "mamba2", "jamba", "qwen3_next", "falcon_h1", "bamba", "granitemoehybrid"}


def test_the_matrix_enumerates_transformers_own_families():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(FAMILIES) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if Version(transformers.__version__).release[:2] == Version(TESTED_TRANSFORMERS[1]).release[:2]:
        assert set(NOT_CHECKED) <= set(FAMILIES), set(NOT_CHECKED) - set(FAMILIES)  # no stale entry
    assert MUST_BE_EXACT <= set(FAMILIES) - set(NOT_CHECKED)
    assert len(set(FAMILIES) - set(NOT_CHECKED)) >= 150


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_is_exact_or_refused_by_name(model_type):
    if model_type in NOT_CHECKED:
        pytest.skip(f"not checked: {NOT_CHECKED[model_type]}")
    torch.set_num_threads(1)
    result = check_family(model_type)
    if model_type in RECURRENT and not records_recurrent_states():
        assert result.status == "refused" and "5.25" in result.detail, result
        return
    assert result.status in ("exact", "refused"), (
        f"{model_type}: {result.status}: {result.detail} (an unbuildable family needs an override in "
        "hf_spec.evaluation.zoo or a reason in NOT_CHECKED)")
    if model_type in MUST_BE_EXACT:
        assert result.status == "exact", result.detail
        assert result.acceptance["near-copy"] > 0.1  # drafts were accepted: the rollback paths ran


def test_the_docs_table_lists_every_family():
    table = (Path(__file__).parent.parent / "docs" / "families.md").read_text()
    listed = set(re.findall(r"^\| `([\w-]+)` \|", table, flags=re.MULTILINE))
    assert set(FAMILIES) <= listed, sorted(set(FAMILIES) - listed)
