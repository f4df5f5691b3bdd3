"""What a speculative ``generate()`` returns with ``return_dict_in_generate=True``: transformers' output classes plus
the call's `hf_spec.stats.SpeculativeStats`."""

from __future__ import annotations

import dataclasses

from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from hf_spec.stats import SpeculativeStats


@dataclasses.dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only generate output plus the speculative statistics of the call."""

    speculative_stats: SpeculativeStats | None = None


@dataclasses.dataclass
class SpeculativeEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """transformers' encoder-decoder generate output plus the speculative statistics of the call."""

    speculative_stats: SpeculativeStats | None = None


def generate_output(result, generation_config, target_cache, batch_size: int, is_encoder_decoder: bool):
    """What generate() returns: the sequences, or transformers' output with the statistics."""
    if not generation_config.return_dict_in_generate:
        return result.sequences
    output_class = SpeculativeEncoderDecoderOutput if is_encoder_decoder else SpeculativeDecoderOnlyOutput
    return output_class(
        sequences=result.sequences,
        scores=result.scores,
        logits=result.logits,
        cache=target_cache if batch_size == 1 else None,
        speculative_stats=result.stats,
    )
