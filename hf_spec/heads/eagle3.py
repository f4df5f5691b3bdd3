"""`Eagle3Head`: an EAGLE-3 draft head in the speculators format, the one vLLM and SGLang serve.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test"). For a pair (the target's hidden states g_t at the layers ``eagle_aux_hidden_state_layer_ids``, concatenated,
``[n * H_target]``; the next token x_{t+1}):

    a_t = fc(g_t)                                              # [H]; for a drafted token, the head's own h instead
    u   = [input_layernorm(embed(x_{t+1})); hidden_norm(a_t)]  # [2H]: the first layer's attention reads both
    h_t = r + attn(u), r = a_t (hidden_norm(a_t) with norm_before_residual)
    h_t = h_t + mlp(post_attention_layernorm(h_t))             # then any further ordinary decoder layers
    logits_t = lm_head(norm(h_t))                              # [draft vocab]: a law for x_{t+2}; id i is the
                                                               # target's i + d2t[i], every other id gets -inf

and h_t (before the final norm; after it with ``norm_output``) stands in for a_{t+1} at the next drafted token. The
layer ids index transformers' ``output_hidden_states`` tuple (0: the embeddings; id i is the input of decoder layer
i), which is what speculators and vLLM mean by them; the default is [2, L // 2, L - 3].

The files are the speculators format (`hf_spec.heads.speculators`): `Eagle3Head.from_pretrained` reads published
checkpoints (and EAGLE-3's reference layout), `Eagle3Head.save_pretrained` writes what ``vllm serve`` and SGLang load.
Exactness does not depend on the head: the loop samples from the law the head gives, whatever it is
(`hf_spec.rejection`).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from hf_spec.drafting.vocabulary import check_kept_ids
from hf_spec.heads.base import DraftHeadBase, DraftHeadOutput, check_feature_layers
from hf_spec.heads.checkpoints import local_folder, read_checkpoint, write_checkpoint
from hf_spec.heads.shared import FrozenEmbedding, FrozenLinear, target_layers
from hf_spec.heads.speculators import (
    Eagle3HeadConfig,
    check_draft_vocabulary,
    default_aux_layers,
    layer_config_for,
    layers_without_vocabulary,
    serving_problems,
)

logger = logging.getLogger(__name__)


class LayerView(NamedTuple):
    """What the cache and the custom masks need to know of the head's layers."""

    config: PretrainedConfig
    dtype: torch.dtype


class Eagle3FirstLayer(nn.Module):
    """EAGLE-3's first decoder layer: the attention reads [input_layernorm(embedding); hidden_norm(a)] (2H), the
    residual stream starts from a (or hidden_norm(a)). Built from a transformers decoder layer's own parts, so that
    attention, rotary positions and the cache are transformers'."""

    def __init__(self, layer: nn.Module, config: PretrainedConfig, norm_before_residual: bool):
        super().__init__()
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(layer, name):
                raise ValueError(f"{type(layer).__name__} has no `{name}`: not a decoder layer EAGLE-3 can build on.")
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.hidden_norm = type(layer.input_layernorm)(config.hidden_size, eps=config.rms_norm_eps)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            wide = nn.Linear(2 * config.hidden_size, old.out_features, bias=old.bias is not None)
            setattr(self.self_attn, name, wide)
        self.norm_before_residual = norm_before_residual

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:  # [B, m, 2H] -> [B, m, H]
        embeddings, hidden = hidden_states.chunk(2, dim=-1)  # [B, m, H] each
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        attended, _ = self.self_attn(hidden_states=torch.cat([self.input_layernorm(embeddings), hidden], dim=-1),
                                     **kwargs)
        states = residual + attended
        return states + self.mlp(self.post_attention_layernorm(states))


class Eagle3Head(DraftHeadBase):
    """An EAGLE-3 head (see the module docstring): ``generate(assistant_model=head)`` on a `speculative` target runs
    it, exactly; `from_pretrained` loads a published speculators (or reference EAGLE-3) checkpoint and
    `save_pretrained` writes one that ``vllm serve`` and SGLang load."""

    config_class = Eagle3HeadConfig
    _keys_to_ignore_on_load_missing = [r"embed_tokens\.weight"]

    def __init__(self, config: Eagle3HeadConfig):
        super().__init__(config)
        layer_config = config.layer_config()
        layer_config._attn_implementation = config._attn_implementation or "sdpa"
        hidden, target_hidden = layer_config.hidden_size, config.target_hidden_size or layer_config.hidden_size
        num_aux = len(config.eagle_aux_hidden_state_layer_ids or [0, 0, 0])
        built = AutoModel.from_config(layers_without_vocabulary(layer_config))  # transformers' layers, rotary and norm
        self.layer_config = layer_config
        self.fc = nn.Linear(num_aux * target_hidden, hidden, bias=False)
        self.input_norm = (type(built.norm)(num_aux * target_hidden, eps=layer_config.rms_norm_eps)
                           if config.norm_before_fc else None)
        self.fc_norm = (nn.ModuleList(type(built.norm)(target_hidden, eps=layer_config.rms_norm_eps)
                                      for _ in range(num_aux)) if config.fc_norm else None)
        self.layers = nn.ModuleList([Eagle3FirstLayer(built.layers[0], layer_config, config.norm_before_residual),
                                     *built.layers[1:]])
        self.rotary_emb = built.rotary_emb
        self.norm = built.norm
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        vocab = layer_config.vocab_size
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # [draft vocab]
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))  # [target vocab]
        self.embed_tokens = FrozenEmbedding()  # the target's (`attach`), unless the checkpoint has its own
        self._own_embeddings = False
        self.verifier_lm_head = FrozenLinear()  # the target's, the teacher in training (`attach`)
        self.post_init()

    # Building, loading, saving

    @classmethod
    def from_target(cls, target: PreTrainedModel, aux_layers: list[int] | None = None,
                    draft_vocab: list[int] | None = None, num_layers: int = 1,
                    norm_before_residual: bool = False) -> Eagle3Head:
        """A new head for ``target``, to train (`hf_spec.evaluation.head_training`): a Llama-type layer of the
        target's width (Qwen3 for a Qwen3 target), ``aux_layers`` (default [2, L // 2, L - 3]), the LM head over
        ``draft_vocab`` (token ids of the target, default all) initialised from the target's rows, the layer's
        attention, MLP and norms from the target's last layer (q/k/v reading both halves), ``fc`` the mean of the
        features."""
        text = target.config.get_text_config()
        aux_layers = default_aux_layers(text.num_hidden_layers) if aux_layers is None else list(aux_layers)
        check_feature_layers(aux_layers, text.num_hidden_layers, "aux_layers")
        aux_layers = sorted(i % (text.num_hidden_layers + 1) for i in aux_layers)  # layer order, as vLLM joins them
        kept = (torch.arange(text.vocab_size) if draft_vocab is None
                else check_kept_ids(draft_vocab, text.vocab_size).sort().values)
        config = Eagle3HeadConfig(layer_config_for(target, num_layers), len(kept),
                                  norm_before_residual=norm_before_residual, target_hidden_size=text.hidden_size,
                                  eagle_aux_hidden_state_layer_ids=aux_layers,
                                  verifier_name_or_path=getattr(target, "name_or_path", None) or None,
                                  verifier_architectures=list(target.config.architectures or []))
        head = cls(config).to(dtype=target.dtype, device=target.device)
        head.set_draft_vocabulary(kept)
        source = target.get_decoder()
        last = source.layers[-1]
        with torch.no_grad():
            first = head.layers[0]
            theirs = last.self_attn.state_dict()  # dense weights, also where the target's linears are packed (oneDNN)
            first.self_attn.o_proj.weight.copy_(theirs["o_proj.weight"])
            for name in ("q_proj", "k_proj", "v_proj"):
                mine, weight = getattr(first.self_attn, name), theirs[f"{name}.weight"]
                mine.weight.copy_(torch.cat([weight, weight], dim=1) / 2)
                if mine.bias is not None and f"{name}.bias" in theirs:
                    mine.bias.copy_(theirs[f"{name}.bias"])
            first.mlp.load_state_dict(last.mlp.state_dict())
            first.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
            first.input_layernorm.load_state_dict(last.input_layernorm.state_dict())
            first.hidden_norm.load_state_dict(last.input_layernorm.state_dict())
            head.norm.load_state_dict(source.norm.state_dict())
            eye = torch.eye(text.hidden_size, dtype=head.fc.weight.dtype, device=head.fc.weight.device)
            head.fc.weight.copy_(torch.cat([eye] * len(aux_layers), dim=1) / len(aux_layers))
            output = target.get_output_embeddings().weight
            head.lm_head.weight.copy_((output.to_dense() if output.is_mkldnn else output)[kept.to(output.device)])
        return head.attach(target).eval()

    def set_draft_vocabulary(self, target_ids: torch.Tensor) -> None:
        """``d2t`` and ``t2d`` for a draft vocabulary of ``target_ids`` (``[draft vocab]``, sorted)."""
        target_ids = target_ids.to(self.d2t.device)
        self.d2t.copy_(target_ids - torch.arange(len(target_ids), device=self.d2t.device))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def draft_to_target(self) -> torch.Tensor:
        """``[draft vocab]`` the target id of each draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, dtype: torch.dtype | None = None,
                        **kwargs) -> Eagle3Head:
        """Load a speculators-format EAGLE-3 head (or a reference EAGLE-3 checkpoint) from a local folder or a Hub
        repository; ``dtype`` converts it (default: as stored). The head is ready once attached to its target
        (``generate()`` does that)."""
        folder = local_folder(str(pretrained_model_name_or_path), **kwargs)
        config, state = read_checkpoint(folder)
        own_embeddings = state.pop("embed_tokens.weight", None)
        head = cls(config)
        missing, unexpected = head.load_state_dict(state, strict=False)
        if "d2t" in missing and config.draft_vocab_size == head.layer_config.vocab_size:
            head.set_draft_vocabulary(torch.arange(config.draft_vocab_size))  # the whole vocabulary, in order
            missing = [name for name in missing if name not in ("d2t", "t2d")]
        if missing or unexpected:
            raise ValueError(f"{folder}: the weights do not fit an EAGLE-3 head of this config: missing "
                             f"{missing[:6]}, unexpected {unexpected[:6]}.")
        if own_embeddings is not None:  # a checkpoint with its own embeddings keeps them (vLLM does the same)
            head.embed_tokens, head._own_embeddings = FrozenEmbedding(own_embeddings), True
        check_draft_vocabulary(head.d2t, head.t2d, str(folder))
        return head.to(dtype=dtype or state["fc.weight"].dtype).eval()

    def save_pretrained(self, save_directory, state_dict: dict | None = None, layout: str = "speculators",
                        **kwargs) -> None:
        """``config.json`` and ``model.safetensors`` (no embeddings) in the speculators format, which vLLM reads, or
        (``layout="reference"``) EAGLE-3's reference layout, which SGLang reads; what a layout cannot say is refused,
        what vLLM and SGLang cannot build is warned about (`hf_spec.heads.speculators.serving_problems`)."""
        for problem in serving_problems(self.config):
            warnings.warn(f"{save_directory}: written, but vLLM and SGLang cannot serve this head: {problem}.",
                          stacklevel=2)
        state = self.state_dict() if state_dict is None else state_dict
        state = {name: value for name, value in state.items()
                 if not name.startswith(("embed_tokens", "verifier_lm_head", "rotary_emb"))}
        if self._own_embeddings:
            state["embed_tokens.weight"] = self.embed_tokens.weight
        write_checkpoint(Path(save_directory), self.config, state, self.dtype, layout)

    # What it takes from its target

    def check_target(self, target: PreTrainedModel) -> None:
        text = target.config.get_text_config()
        config, layers = self.config, self.layer_config
        aux = config.eagle_aux_hidden_state_layer_ids
        is_default = aux is None
        aux = default_aux_layers(text.num_hidden_layers) if is_default else aux
        check_feature_layers(aux, text.num_hidden_layers, "eagle_aux_hidden_state_layer_ids")
        target_hidden = config.target_hidden_size or layers.hidden_size
        built = {"hidden size": target_hidden, "vocabulary": layers.vocab_size}
        given = {"hidden size": text.hidden_size, "vocabulary": text.vocab_size}
        if not self._own_embeddings:
            built["hidden size of the embeddings it reads"] = layers.hidden_size
            given["hidden size of the embeddings it reads"] = text.hidden_size
        if built != given or self.fc.in_features != len(aux) * text.hidden_size:
            raise ValueError(
                f"`assistant_model` is an EAGLE-3 head for {config.verifier_name_or_path or 'another target'} "
                f"({built}, reading {len(aux)} layers of {self.fc.in_features // len(aux)} values), but the model has "
                f"{given}; use a head trained for this target.")
        if is_default:  # only once the head is known to fit
            logger.warning("This EAGLE-3 head does not say which target layers it reads; using EAGLE-3's default %s "
                           "for a target of %d layers.", aux, text.num_hidden_layers)
            config.eagle_aux_hidden_state_layer_ids = aux

    def _attach_layers(self, target: PreTrainedModel) -> None:
        dtype, device = self.fc.weight.dtype, self.fc.weight.device
        embedding, output = target_layers(target, dtype, device, None)
        if not self._own_embeddings:
            self.embed_tokens = embedding
        self.verifier_lm_head = output

    def layer_model(self) -> LayerView:
        return LayerView(self.layer_config, self.dtype)

    def target_output_layer(self) -> nn.Module:
        return self.verifier_lm_head

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    # The pass

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor | None = None,
                predicted: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, logits_to_keep: int = 0) -> DraftHeadOutput:
        """One step per pair (g_t, x_{t+1}); the interface of `hf_spec.heads.base`.

        Args:
            input_ids: [batch, m] the tokens x_{t+1}.
            features: [batch, m, n * H_target] the target's hidden states g_t; or
            predicted: [batch, m, H] the head's own h_{t-1} in their place (drafted positions).
            attention_mask: [batch, cached + m] over the head's cache and these pairs, or a 4D custom mask.

        Returns:
            ``logits`` [batch, m or logits_to_keep, target vocab] (laws of x_{t+2}; -inf outside the draft
            vocabulary) and ``hidden_states`` [batch, m, H].
        """
        if (features is None) == (predicted is None):
            raise ValueError("Pass exactly one of `features` (the target's) and `predicted` (the head's own).")
        embeddings = self.embed_tokens(input_ids).to(self.fc.weight.dtype)  # [batch, m, H]
        hidden = self.read_features(features) if predicted is None else predicted.to(embeddings.dtype)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
        mask = create_causal_mask(config=self.layer_config, inputs_embeds=embeddings, attention_mask=attention_mask,
                                  cache=cache, position_ids=position_ids)
        rotary = self.rotary_emb(embeddings, position_ids)
        states = torch.cat([embeddings, hidden], dim=-1)  # [batch, m, 2H]
        for layer in self.layers:
            states = layer(states, attention_mask=mask, position_ids=position_ids, cache=cache,
                           use_cache=cache is not None, position_embeddings=rotary)  # [batch, m, H]
        normed = self.norm(states)
        kept = normed[:, -logits_to_keep:] if logits_to_keep else normed
        return DraftHeadOutput(logits=self._target_logits(self.lm_head(kept)),
                               hidden_states=normed if self.config.norm_output else states)

    def read_features(self, features: torch.Tensor) -> torch.Tensor:  # [batch, m, n * H_target] -> [batch, m, H]
        features = features.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            parts = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(features)

    def _target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """``[..., draft vocab]`` -> ``[..., target vocab]``, -inf where the draft vocabulary has no id."""
        vocab = len(self.t2d)
        if draft_logits.shape[-1] == vocab and not self.d2t.any():
            return draft_logits
        logits = draft_logits.new_full((*draft_logits.shape[:-1], vocab), float("-inf"))
        return logits.index_copy_(-1, self.draft_to_target(), draft_logits)
