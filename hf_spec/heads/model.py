"""`DraftHead`: a small draft that reads the target's hidden states (EAGLE-style), as a transformers model.

What it computes, for a pair (the target's feature f_t at position t, the next token x_{t+1}):

    h_t = decoder(fc([embed(x_{t+1}); fuse(f_t)]))   # the target's own decoder layer type, ``num_layers`` of them
    logits_t = lm_head(h_t)                           # a law for x_{t+2}; h_t also stands in for fuse(f_{t+1})

so after the target's verify pass one head step per draft token gives the next token, feeding its own h back as the
feature of the token it just drafted. The feature is the target's last hidden state after its final norm
(``feature_layers=(-1,)``, EAGLE-1: Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"), or the concatenation of several layers' outputs (``feature_layers=(2, L // 2, L - 3)``, EAGLE-3's
low/middle/high fusion: Li et al. 2025, "EAGLE-3"), which ``fuse`` maps to the hidden size (for one layer ``fuse``
is the identity). A drafted token has no target feature yet, so the next step reads h in place of fuse(f).

Where it departs from EAGLE: the decoder is transformers' own class for the target's architecture built from the
target's config (so attention, rotary positions and the KV cache are transformers'), initialised from the target's
last layers, with its own final norm (EAGLE-1 feeds the un-normed state to the LM head); the embeddings and LM head
are the target's, read at `attach` and never saved (`hf_spec.heads.shared`), and the LM head can be pruned to
frequent ids (`hf_spec.drafting.vocabulary`, FR-Spec). Training (`hf_spec.evaluation.head_training`) matches the
target's law at the next position, plus the feature for EAGLE-1 heads. EAGLE-3's own architecture, in the format vLLM
and SGLang serve, is `hf_spec.heads.eagle3.Eagle3Head`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from hf_spec.drafting.vocabulary import PrunedOutputLayer, check_kept_ids
from hf_spec.heads.base import DraftHeadBase, DraftHeadOutput, check_feature_layers
from hf_spec.heads.shared import FrozenEmbedding, FrozenLinear, target_layers


class DraftHeadConfig(PretrainedConfig):
    """The head's shape and the target it was built for.

    Args:
        decoder: the target's text config as a dict, with ``num_hidden_layers`` set to the head's layer count.
        feature_layers: which of the target's hidden states the head reads, indexed as transformers'
            ``output_hidden_states`` tuple (0: the embeddings, L: the last layer after the final norm; negative
            counts from the end).
        target_num_layers, target_hidden_size, target_vocab_size: the target's, checked before every use.
        target_name_or_path: where the target came from (for error messages).
        kept_ids: the ids a pruned LM head computes (`DraftHead.prune`), or ``None``.
    """

    model_type = "hf_spec_draft_head"

    def __init__(self, decoder: dict | None = None, feature_layers: tuple[int, ...] | list[int] = (-1,),
                 target_num_layers: int = 0, target_hidden_size: int = 0, target_vocab_size: int = 0,
                 target_name_or_path: str = "", kept_ids: list[int] | None = None, **kwargs):
        self.decoder = decoder or {}
        self.kept_ids = kept_ids  # a pruned LM head's ids (FR-Spec), or None
        self.vocab_size = target_vocab_size
        self.feature_layers = list(feature_layers)
        self.target_num_layers = target_num_layers
        self.target_hidden_size = target_hidden_size
        self.target_vocab_size = target_vocab_size
        self.target_name_or_path = target_name_or_path
        super().__init__(**kwargs)

    def get_text_config(self, *args, **kwargs) -> DraftHeadConfig:
        """The head's own config (not the ``decoder`` settings dict, which transformers would otherwise return)."""
        return self

    def decoder_config(self) -> PretrainedConfig:
        decoder = dict(self.decoder)
        if "model_type" not in decoder:
            raise ValueError(f"This DraftHeadConfig has no decoder settings (`decoder` is {self.decoder!r}): it was "
                             "not written by DraftHead.save_pretrained. Build the head with DraftHead.from_target "
                             "(or `hf-spec train-head`).")
        return AutoConfig.for_model(decoder.pop("model_type"), **decoder)


class DraftHead(DraftHeadBase):
    """A draft head for one target: ``fc`` over [embedding; features], then a small decoder of the target's kind.

    Build one with `DraftHead.from_target`, train it with `hf_spec.evaluation.head_training.train_head`, and pass it as
    ``assistant_model`` to a `speculative` target's ``generate()``; ``save_pretrained`` / ``from_pretrained`` work as
    for any transformers model.
    """

    config_class = DraftHeadConfig

    def __init__(self, config: DraftHeadConfig):
        super().__init__(config)
        decoder_config = config.decoder_config()
        # the embeddings and the LM head are the target's (`attach`): the decoder is built without its own
        decoder_config.vocab_size, decoder_config.pad_token_id = 1, None
        self.decoder = AutoModelForCausalLM.from_config(decoder_config)
        self.decoder.set_input_embeddings(FrozenEmbedding())
        self.decoder.set_output_embeddings(FrozenLinear())
        hidden, num_features = config.target_hidden_size, len(config.feature_layers)
        self.fuse = nn.Linear(hidden * num_features, hidden, bias=False) if num_features > 1 else nn.Identity()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> DraftHead:
        """transformers' ``from_pretrained``; a local folder without ``config.json`` is named as such first."""
        folder = Path(str(pretrained_model_name_or_path)).expanduser()
        if folder.is_dir() and not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} holds no config.json, so it is not a saved draft head "
                                    "(DraftHead.save_pretrained writes one).")
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def _attach_layers(self, target: PreTrainedModel) -> None:
        """The embeddings and the LM head are ``target``'s, in the head's dtype and device: the target's own tensors
        when those match, never a saved copy. The LM head keeps only ``config.kept_ids`` when set (FR-Spec)."""
        embedding, output = target_layers(target, self.fc.weight.dtype, self.fc.weight.device, self.config.kept_ids)
        self.decoder.set_input_embeddings(embedding)
        self.decoder.set_output_embeddings(output)

    def layer_model(self) -> nn.Module:
        return self.decoder

    def target_output_layer(self) -> nn.Module:
        output = self.get_output_embeddings()
        return output.full if isinstance(output, PrunedOutputLayer) else output

    def prune(self, kept_ids: list[int]) -> DraftHead:
        """Keep only ``kept_ids`` in the LM head (FR-Spec, `hf_spec.drafting.vocabulary`), recorded in the config so
        that the head reads the same rows from its target after ``from_pretrained``; returns the head."""
        ids = check_kept_ids(kept_ids, self.config.target_vocab_size)
        self.config.kept_ids = sorted(int(i) for i in ids.tolist())
        output = self.get_output_embeddings()
        full = output.full if isinstance(output, PrunedOutputLayer) else output
        if full.weight.dim() == 2:  # attached: prune the layer read from the target now
            self.set_output_embeddings(PrunedOutputLayer(full, torch.tensor(self.config.kept_ids,
                                                                            device=full.weight.device)))
        return self

    @classmethod
    def from_target(cls, target: PreTrainedModel, feature_layers: tuple[int, ...] = (-1,),
                    num_layers: int = 1) -> DraftHead:
        """A head for ``target``: decoder layers copied from the target's last ``num_layers`` and final norm copied
        (both trained), embeddings and LM head copied and frozen, ``fc`` starting as embedding + mean of the features.
        """
        text = target.config.get_text_config()
        if not (isinstance(num_layers, int) and 1 <= num_layers <= text.num_hidden_layers):
            raise ValueError(f"`num_layers` must be an integer in [1, {text.num_hidden_layers}] (the target's layer "
                             f"count), but is {num_layers!r}.")
        check_feature_layers(feature_layers, text.num_hidden_layers)
        # untied: the LM head is a copy of the target's, prunable without touching the embeddings
        decoder = {**text.to_dict(), "num_hidden_layers": num_layers, "use_cache": True, "tie_word_embeddings": False}
        decoder.pop("layer_types", None)  # sized for the target's layer count; rebuilt by the config
        config = DraftHeadConfig(decoder, feature_layers, text.num_hidden_layers, text.hidden_size, text.vocab_size,
                                 getattr(target, "name_or_path", "") or "")
        head = cls(config).to(dtype=target.dtype, device=target.device).attach(target)
        source = target.get_decoder()
        with torch.no_grad():
            head.decoder.get_decoder().layers.load_state_dict(source.layers[-num_layers:].state_dict())
            head.decoder.get_decoder().norm.load_state_dict(source.norm.state_dict())
            eye = torch.eye(text.hidden_size, dtype=head.fc.weight.dtype, device=head.fc.weight.device)
            head.fc.weight.copy_(torch.cat([eye, eye], dim=1))  # embedding + fused features
            if isinstance(head.fuse, nn.Linear):
                head.fuse.weight.copy_(torch.cat([eye / len(feature_layers)] * len(feature_layers), dim=1))
        return head.eval()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and module in (getattr(self, "fc", None), getattr(self, "fuse", None)):
            nn.init.normal_(module.weight, std=0.02)

    def get_input_embeddings(self) -> nn.Module:
        return self.decoder.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.decoder.get_output_embeddings()

    def set_output_embeddings(self, layer: nn.Module) -> None:
        self.decoder.set_output_embeddings(layer)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor | None = None,
                predicted: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, logits_to_keep: int = 0) -> DraftHeadOutput:
        """One step per pair (f_t, x_{t+1}).

        Args:
            input_ids: [batch, m] the tokens x_{t+1}.
            features: [batch, m, hidden * len(feature_layers)] the target's hidden states f_t; or
            predicted: [batch, m, hidden] the head's own h_{t-1} in their place (drafted positions).
            attention_mask: [batch, cached + m] over the head's cache and these pairs.

        Returns:
            ``logits`` [batch, m or logits_to_keep, vocab] (laws of x_{t+2}) and ``hidden_states`` [batch, m, hidden].
        """
        if (features is None) == (predicted is None):
            raise ValueError("Pass exactly one of `features` (the target's) and `predicted` (the head's own).")
        embeddings = self.get_input_embeddings()(input_ids)  # [batch, m, hidden]
        fused = self.read_features(features) if predicted is None else predicted  # [batch, m, hidden]
        inputs = self.fc(torch.cat([embeddings, fused.to(embeddings.dtype)], dim=-1))  # [batch, m, hidden]
        states = self.decoder.get_decoder()(
            inputs_embeds=inputs, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            use_cache=cache is not None,
        ).last_hidden_state  # [batch, m, hidden]
        kept = states[:, -logits_to_keep:] if logits_to_keep else states
        return DraftHeadOutput(logits=self.get_output_embeddings()(kept), hidden_states=states)

    def read_features(self, features: torch.Tensor) -> torch.Tensor:  # [batch, m, F] -> [batch, m, hidden]
        return self.fuse(features.to(self.fc.weight.dtype))

    def check_target(self, target: PreTrainedModel) -> None:
        """Refuse a target other than the one this head was built for (its layer count, width or vocabulary)."""
        text = target.config.get_text_config()
        config = self.config
        built = (config.target_num_layers, config.target_hidden_size, config.target_vocab_size)
        given = (text.num_hidden_layers, text.hidden_size, text.vocab_size)
        if built != given:
            raise ValueError(
                f"`assistant_model` is a draft head built for {config.target_name_or_path or 'another target'} "
                f"(layers, hidden size, vocabulary = {built}), but the model has {given}; train a head for this "
                "target (`hf-spec train-head`).")
        check_feature_layers(config.feature_layers, text.num_hidden_layers)
