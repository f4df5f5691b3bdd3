"""The speculators format of an EAGLE-3 head (vllm-project/speculators, ``models/eagle3``), the one vLLM and SGLang
serve: the config's fields (`Eagle3HeadConfig`), reading and writing the files.

- ``config.json``: ``speculators_model_type: "eagle3"``, ``architectures: ["Eagle3Speculator"]``,
  ``speculators_version``, ``transformer_layer_config`` (a Llama or Qwen3 config, ``num_hidden_layers`` = the head's
  layers, ``vocab_size`` = the target's), ``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids``, and ``speculators_config`` (``algorithm``, ``proposal_methods``,
  ``default_proposal_method``, ``verifier``: ``name_or_path``, ``architectures``);
- ``model.safetensors``: ``fc.weight`` ``[H, n * H_target]``, ``layers.0.*`` (q/k/v take 2H inputs;
  ``layers.0.hidden_norm``), ``norm.weight``, ``lm_head.weight`` ``[draft vocab, H]``, ``d2t`` (int64) and ``t2d``
  (bool over the target's vocabulary). No embeddings: the head reads the target's (`attach`), as vLLM does.

`read_checkpoint` also reads EAGLE-3's reference checkpoints (SafeAILab/EAGLE: a Llama config with
``draft_vocab_size``, weights under ``midlayer.*``).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

#: The speculators release whose config schema `save_pretrained` writes.
SPECULATORS_VERSION = "0.3.0"
#: Layer configs the head's decoder may have (speculators' ``model_definitions``).
LAYER_TYPES = ("llama", "qwen3")
#: Reference (SafeAILab) weight names: the single decoder layer is ``midlayer``.
REFERENCE_PREFIX = "midlayer."


class Eagle3HeadConfig(PretrainedConfig):
    """The speculators ``Eagle3SpeculatorConfig`` fields (see the module docstring), and the default k.

    Args:
        transformer_layer_config: the decoder layers' config as a dict (``model_type`` llama or qwen3).
        draft_vocab_size: ids the LM head proposes (``d2t`` maps them to the target's).
        eagle_aux_hidden_state_layer_ids: target hidden states read, as transformers' ``output_hidden_states``
            indices; ``None``: [2, L // 2, L - 3] of the target it is attached to.
        verifier_name_or_path, verifier_architectures: the target it was trained for.
        speculative_tokens: k of the greedy proposal method written to the config.
    """

    model_type = "hf_spec_eagle3"

    def __init__(self, transformer_layer_config: dict | None = None, draft_vocab_size: int = 0,
                 norm_before_residual: bool = False, norm_before_fc: bool = False, fc_norm: bool = False,
                 norm_output: bool = False, target_hidden_size: int | None = None,
                 eagle_aux_hidden_state_layer_ids: list[int] | None = None, verifier_name_or_path: str | None = None,
                 verifier_architectures: list[str] | None = None, speculative_tokens: int = 3, **kwargs):
        self.transformer_layer_config = dict(transformer_layer_config or {})
        self.draft_vocab_size = draft_vocab_size
        self.vocab_size = self.transformer_layer_config.get("vocab_size")  # the target's: the ids its logits span
        self.norm_before_residual, self.norm_before_fc = norm_before_residual, norm_before_fc
        self.fc_norm, self.norm_output = fc_norm, norm_output
        self.target_hidden_size = target_hidden_size or self.transformer_layer_config.get("hidden_size")
        self.eagle_aux_hidden_state_layer_ids = (None if eagle_aux_hidden_state_layer_ids is None
                                                 else list(eagle_aux_hidden_state_layer_ids))
        self.verifier_name_or_path, self.verifier_architectures = verifier_name_or_path, verifier_architectures
        self.speculative_tokens = speculative_tokens
        super().__init__(**kwargs)

    def get_text_config(self, *args, **kwargs) -> Eagle3HeadConfig:
        return self

    @property
    def feature_layers(self) -> list[int]:
        """The layers read, in layer order: vLLM and SGLang join the features as their layers go by, whatever order
        the config lists them in."""
        if self.eagle_aux_hidden_state_layer_ids is None:
            raise ValueError("This EAGLE-3 head does not say which target layers it reads "
                             "(`eagle_aux_hidden_state_layer_ids`); attach it to its target first (`head.attach`), "
                             "which uses EAGLE-3's default [2, L // 2, L - 3].")
        return sorted(self.eagle_aux_hidden_state_layer_ids)

    def layer_config(self) -> PretrainedConfig:
        layers = dict(self.transformer_layer_config)
        model_type = layers.pop("model_type", None)
        if model_type not in LAYER_TYPES:
            raise ValueError(f"An EAGLE-3 head's `transformer_layer_config` must be a {' or '.join(LAYER_TYPES)} "
                             f"config, but its model_type is {model_type!r}.")
        return AutoConfig.for_model(model_type, **layers)

    def to_speculators(self) -> dict:
        """The ``config.json`` speculators writes (and vLLM reads)."""
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": self.transformer_layer_config,
            "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "embed_requires_grad": False,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": self.eagle_aux_hidden_state_layer_ids,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": self.verifier_name_or_path,
                             "architectures": self.verifier_architectures or []},
            },
            "dtype": str(self.transformer_layer_config.get("dtype") or "bfloat16").removeprefix("torch."),
        }

    @classmethod
    def from_speculators(cls, config: dict, source: str) -> Eagle3HeadConfig:
        """A speculators ``config.json``, or a reference EAGLE-3 one (SafeAILab/EAGLE: a Llama config with
        ``draft_vocab_size``; SGLang's ``LlamaForCausalLMEagle3``). A missing ``norm_before_residual`` is what each
        layout's readers take it to be: True in the speculators format (speculators, vLLM), False in the reference
        layout (EAGLE's own code, SGLang)."""
        layout = eagle3_layout(config)
        if layout is None:
            raise ValueError(f"{source} is not an EAGLE-3 head: its config.json has neither "
                             "`speculators_model_type: \"eagle3\"` (the speculators format) nor a Llama config with "
                             "`draft_vocab_size` (EAGLE-3's reference checkpoints).")
        draft_vocab_size = config.get("draft_vocab_size")
        if not (isinstance(draft_vocab_size, int) and not isinstance(draft_vocab_size, bool) and draft_vocab_size > 0):
            raise ValueError(f"{source}: `draft_vocab_size` must be a positive integer, but is {draft_vocab_size!r}.")
        if layout == "speculators":
            verifier = config.get("speculators_config", {}).get("verifier", {})
            methods = config.get("speculators_config", {}).get("proposal_methods") or [{}]
            if config.get("norm_before_fc") and config.get("fc_norm"):
                raise ValueError(f"{source}: `norm_before_fc` and `fc_norm` exclude each other, but both are set.")
            if not isinstance(config.get("transformer_layer_config"), dict):
                raise ValueError(f"{source}: `transformer_layer_config` must be a layer config (a dict), but is "
                                 f"{config.get('transformer_layer_config')!r}.")
            return cls(config["transformer_layer_config"], draft_vocab_size,
                       config.get("norm_before_residual", True), config.get("norm_before_fc", False),
                       config.get("fc_norm", False), config.get("norm_output", False),
                       config.get("target_hidden_size"), config.get("eagle_aux_hidden_state_layer_ids"),
                       verifier.get("name_or_path"), verifier.get("architectures"),
                       methods[0].get("speculative_tokens", 3))
        if config.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{source}: a reference EAGLE-3 checkpoint has one layer (`midlayer`), but its config "
                             f"says num_hidden_layers={config.get('num_hidden_layers')!r}.")
        layers = {key: value for key, value in config.items() if key not in REFERENCE_FIELDS}
        layers["model_type"], layers["num_hidden_layers"] = "llama", 1
        sglang_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(layers, draft_vocab_size, norm_before_residual=config.get("norm_before_residual", False),
                   target_hidden_size=config.get("target_hidden_size"),
                   eagle_aux_hidden_state_layer_ids=None if sglang_ids is None else [i + 1 for i in sglang_ids])

    def to_reference(self) -> dict:
        """The ``config.json`` of EAGLE-3's reference layout, the one SGLang's ``LlamaForCausalLMEagle3`` loads:
        the layer's Llama config with ``draft_vocab_size`` and ``target_hidden_size``; the layers read go under
        ``eagle_config`` as SGLang counts them (the output of layer i, which is our id i + 1)."""
        problems = reference_problems(self)
        if problems:
            raise ValueError("This EAGLE-3 head cannot be written in the reference layout (SGLang, SafeAILab/EAGLE): "
                             + "; ".join(problems) + ". Write the speculators format (`layout=\"speculators\"`), "
                             "which vLLM serves, instead.")
        values = {key: value for key, value in self.transformer_layer_config.items() if key != "model_type"}
        values.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                      draft_vocab_size=self.draft_vocab_size, target_hidden_size=self.target_hidden_size)
        if self.eagle_aux_hidden_state_layer_ids is not None:
            values["eagle_config"] = {"use_aux_hidden_state": True,
                                      "eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.feature_layers]}
        return values


#: Reference-layout config fields that are not the layer's.
REFERENCE_FIELDS = ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config", "norm_before_residual")

def eagle3_layout(config: dict) -> str | None:
    """``"speculators"``, ``"reference"`` (a Llama config with ``draft_vocab_size``: SafeAILab/EAGLE's, SGLang's),
    or ``None`` when ``config`` (a parsed ``config.json``) is not an EAGLE-3 head's."""
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "draft_vocab_size" in config and "speculators_model_type" not in config and \
            config.get("model_type", "llama") == "llama":
        return "reference"
    return None


def serving_problems(config: Eagle3HeadConfig) -> list[str]:
    """What vLLM's and SGLang's EAGLE-3 loaders would not build as this head is: they make ``fc`` for exactly three
    target layers."""
    ids = config.eagle_aux_hidden_state_layer_ids
    return [] if ids is None or len(ids) == 3 else [
        f"it reads {len(ids)} target layers ({ids}), and vLLM and SGLang build `fc` for exactly 3"]


def reference_problems(config: Eagle3HeadConfig) -> list[str]:
    """What the reference layout (SGLang's ``LlamaForCausalLMEagle3``, EAGLE's own code) cannot say of this head."""
    layers = config.transformer_layer_config
    found = {
        f"its layers are {layers.get('model_type')!r}, not 'llama'": layers.get("model_type") != "llama",
        f"it has {layers.get('num_hidden_layers')} layers, not one `midlayer`": layers.get("num_hidden_layers") != 1,
        "its q/k/v have biases": bool(layers.get("attention_bias")),
        "it normalizes before the residual (`norm_before_residual`)": config.norm_before_residual,
        "it normalizes the features (`norm_before_fc`, `fc_norm`)": config.norm_before_fc or config.fc_norm,
        "it feeds back normalized states (`norm_output`)": config.norm_output,
    }
    return serving_problems(config) + [problem for problem, holds in found.items() if holds]


def check_draft_vocabulary(d2t: torch.Tensor, t2d: torch.Tensor, source: str) -> None:
    """``d2t`` must map the draft ids to distinct target ids, and ``t2d`` mark exactly those."""
    target_ids = d2t + torch.arange(len(d2t), device=d2t.device)
    vocab = len(t2d)
    if (len(target_ids) and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab)) or \
            target_ids.unique().numel() != len(target_ids):
        raise ValueError(f"{source}: `d2t` maps the {len(d2t)} draft ids outside the target's {vocab} ids, or two of "
                         "them to one id; the checkpoint is damaged.")
    if int(t2d.sum()) != len(d2t) or not bool(t2d[target_ids].all()):
        raise ValueError(f"{source}: `t2d` marks {int(t2d.sum())} target ids, not the {len(d2t)} that `d2t` maps "
                         "the draft ids to; the checkpoint is damaged.")


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers for a target of ``num_layers``: [2, L // 2, L - 3]."""
    layers = [2, num_layers // 2, num_layers - 3]
    if len(set(layers)) != 3 or min(layers) < 0:
        raise ValueError(f"EAGLE-3's default layers [2, L // 2, L - 3] are {layers} for a target of {num_layers} "
                         "layers, not three distinct ones; pass the layers to read (`aux_layers`).")
    return layers


def layer_config_for(target: PreTrainedModel, num_layers: int) -> dict:
    """The ``transformer_layer_config`` of a new head for ``target``: its width, heads, MLP, norm and rotary
    positions, ``num_layers`` layers, a Llama layer (a Qwen3 one for a Qwen3 target), q/k/v biases where the target's
    attention has them."""
    text = target.config.get_text_config()
    if not (isinstance(num_layers, int) and num_layers >= 1):
        raise ValueError(f"`num_layers` must be a positive integer, but is {num_layers!r}.")
    model_type = "qwen3" if text.model_type == "qwen3" else "llama"
    has_bias = getattr(target.get_decoder().layers[0].self_attn.q_proj, "bias", None) is not None
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    layers = AutoConfig.for_model(
        model_type, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
        head_dim=head_dim, hidden_act=text.hidden_act, rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings, vocab_size=text.vocab_size,
        num_hidden_layers=num_layers, attention_bias=has_bias, tie_word_embeddings=False,
        rope_parameters=getattr(text, "rope_parameters", None),
    ).to_dict()
    for key in ("architectures", "transformers_version", "layer_types", "dtype", "torch_dtype", "use_cache",
                "_name_or_path"):
        layers.pop(key, None)
    layers["model_type"] = model_type
    return layers


def layers_without_vocabulary(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of the layers' config with a 1-id vocabulary, so that building them allocates no embeddings."""
    copy = type(config).from_dict(config.to_dict())
    copy.vocab_size, copy.pad_token_id = 1, None
    copy._attn_implementation = config._attn_implementation
    return copy
