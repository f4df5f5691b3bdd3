"""GGUF files written from a model, each linear layer in the ggml type you choose (tiny ones test the GGUF kernel).

`write_gguf` writes a Llama or Qwen2 model's config and weights as llama.cpp's converter does (Llama's q and k rows
permuted as transformers expects to undo), the linear layers quantized with the ``gguf`` package (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0) or with `encode_k` (Q4_K, Q5_K, Q6_K: ggml's layouts, made here because the ``gguf`` package only decodes
them), every other tensor in float32. Load it back with ``AutoModelForCausalLM.from_pretrained(folder,
gguf_file=name)``: its weights are the file's values, dequantized by transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

#: The ggml types by name.
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _k_scales(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block ``[blocks, 1]`` float16 super-scale and ``[blocks, groups]`` codes of ``bits`` bits of ``values``
    ``[blocks, groups]`` (non-negative), so that super-scale * code approximates each value."""
    top = values.max(axis=1, keepdims=True)
    d = (top / (2 ** bits - 1)).astype(np.float16)
    safe = np.where(d.astype(np.float32) > 0, d.astype(np.float32), 1.0)
    codes = np.clip(np.rint(values / safe), 0, 2 ** bits - 1).astype(np.uint8)
    return d, codes


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's 12-byte packing of 8 six-bit scales and mins (the inverse of ``get_scale_min_k4``)."""
    packed = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(8):
        if j < 4:
            packed[:, j] |= sc[:, j] & 63
            packed[:, j + 4] |= m[:, j] & 63
        else:
            packed[:, j + 4] |= (sc[:, j] & 0xF) | ((m[:, j] & 0xF) << 4)
            packed[:, j - 4] |= (sc[:, j] >> 4) << 6
            packed[:, j] |= (m[:, j] >> 4) << 6
    return packed


def encode_k(weight: np.ndarray, kind: str) -> np.ndarray:
    """``weight`` ``[rows, K]`` float32 (K a multiple of 256) as ggml's ``kind`` blocks, ``[rows, K / 256 * bytes]``
    uint8: Q4_K and Q5_K (a scale and a min per 32, six bits each, under float16 super-scales), Q6_K (an int8 scale
    per 16 under a float16 super-scale)."""
    rows, inputs = weight.shape
    blocks = weight.reshape(-1, 256).astype(np.float32)  # [B, 256]
    if kind in ("Q4_K", "Q5_K"):
        levels = 15 if kind == "Q4_K" else 31
        groups = blocks.reshape(-1, 8, 32)
        low, high = np.minimum(groups.min(axis=2), 0), groups.max(axis=2)  # [B, 8]
        d, sc = _k_scales((high - low) / levels, 6)
        dmin, m = _k_scales(-low, 6)
        scale = (d.astype(np.float32) * sc)[..., None]  # [B, 8, 1]
        offset = (dmin.astype(np.float32) * m)[..., None]
        codes = np.clip(np.rint((groups + offset) / np.where(scale > 0, scale, 1.0)), 0, levels).astype(np.uint8)
        head = [d.view(np.uint8), dmin.view(np.uint8), _pack_scale_min(sc, m)]
        codes = codes.reshape(-1, 4, 2, 32)  # chunk j: sub-blocks 2j (low nibbles) and 2j + 1 (high)
        nibbles = ((codes[:, :, 0] & 0xF) | ((codes[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
        if kind == "Q4_K":
            body = [nibbles]
        else:
            high_bits = np.zeros((codes.shape[0], 32), dtype=np.uint8)
            for j in range(4):
                high_bits |= ((codes[:, j, 0] >> 4) & 1) << (2 * j)
                high_bits |= ((codes[:, j, 1] >> 4) & 1) << (2 * j + 1)
            body = [high_bits, nibbles]
        out = np.concatenate([*head, *body], axis=1)
    elif kind == "Q6_K":
        groups = blocks.reshape(-1, 16, 16)
        scale = np.abs(groups).max(axis=2) / 31  # [B, 16]
        d = (scale.max(axis=1, keepdims=True) / 127).astype(np.float16)
        sc = np.clip(np.rint(scale / np.where(d.astype(np.float32) > 0, d.astype(np.float32), 1.0)), -128, 127)
        sc = sc.astype(np.int8)
        step = (d.astype(np.float32) * sc)[..., None]  # [B, 16, 1]
        q = np.clip(np.rint(groups / np.where(step != 0, step, 1.0)) + 32, 0, 63).astype(np.uint8).reshape(-1, 256)
        ql, qh = np.zeros((q.shape[0], 128), np.uint8), np.zeros((q.shape[0], 64), np.uint8)
        for half in range(2):
            part = q[:, 128 * half:128 * (half + 1)]
            for l in range(32):
                q1, q2, q3, q4 = part[:, l], part[:, l + 32], part[:, l + 64], part[:, l + 96]
                ql[:, 64 * half + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
                ql[:, 64 * half + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
                qh[:, 32 * half + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
        out = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=1)
    else:
        raise ValueError(f"`kind` must be Q4_K, Q5_K or Q6_K, but is {kind!r}.")
    return out.reshape(rows, -1)


def _permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for Llama's q and k (transformers' `LlamaTensorProcessor` undoes it)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(model: PreTrainedModel, path: str | Path, types: dict[str, str] | str = "Q8_0") -> Path:
    """Write ``model`` (a ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``) to the GGUF file ``path``; ``types``: one ggml
    type name for every linear layer, or ``{file tensor name part: type}`` (e.g. ``{"ffn_down": "Q6_K"}``, the rest
    Q8_0). Returns ``path``."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    config = model.config
    arch = config.model_type
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"`model` must be a Llama or a Qwen2, but is a {arch}.")
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    names = get_gguf_hf_weights_map(model, TensorProcessor())
    state = model.state_dict()
    linear_weights = {f"{name}.weight" for name, module in model.named_modules()
                      if isinstance(module, torch.nn.Linear)}
    for file_name, hf_name in names.items():
        if hf_name not in state or (file_name == "output.weight" and config.tie_word_embeddings):
            continue
        values = state[hf_name].detach().float().numpy()
        if arch == "llama" and (".attn_q." in file_name or ".attn_k." in file_name):
            values = _permuted(values, config.num_attention_heads if ".attn_q." in file_name
                               else config.num_key_value_heads)
        kind = types if isinstance(types, str) else next(
            (kind for part, kind in types.items() if part in file_name), "Q8_0")
        is_tied_output = file_name == "token_embd.weight" and config.tie_word_embeddings  # quantized, as llama.cpp's
        if hf_name not in linear_weights and not is_tied_output:
            writer.add_tensor(file_name, values)
            continue
        quant = gguf.GGMLQuantizationType[kind]
        data = encode_k(values, kind) if kind.endswith("_K") else gguf.quants.quantize(values, quant)
        writer.add_tensor(file_name, data, raw_shape=data.shape, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
