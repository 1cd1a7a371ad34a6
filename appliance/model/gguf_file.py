"""Reading a GGUF file: architecture metadata and weights dequantized to float32 tensors.

Weights come back under Hugging Face names and layouts, so one model class serves
GGUF files and safetensors folders alike.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from appliance.model.errors import ModelLoadError
from appliance.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from appliance.model.quant import FORMATS, QuantWeight

SUPPORTED_QUANTS = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def open_gguf(path: Path, mode: str = "r") -> GGUFReader:
    """Open a GGUF file or raise ModelLoadError saying why it is not one; mode "c" maps it
    copy-on-write (its tensors writable views, private only where written)."""
    if not path.is_file():
        raise ModelLoadError(path, "no such file")
    try:
        return GGUFReader(path, mode)
    except Exception as exc:  # the reader raises many kinds on a damaged file
        raise ModelLoadError(path, f"not a valid GGUF file ({type(exc).__name__}: {exc})") from None


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """All metadata fields as plain Python values (large arrays left out)."""
    out = {}
    for key, fld in reader.fields.items():
        if key.startswith("tokenizer.ggml.") or key.startswith("GGUF."):
            continue
        out[key] = fld.contents()
    return out


def read_model_config(reader: GGUFReader, path: Path) -> ModelConfig:
    """The architecture facts from the file's metadata."""
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            path,
            f"unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(path, f"metadata key {arch}.{key} is missing")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ModelLoadError(
            path, f"metadata key {arch}.vocab_size is missing and the file has no token list"
        )
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="qwen2" if arch == "qwen2" else "llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2",
        rope_scaling=_rope_scaling(meta, arch),
        eos_token_ids=(int(eos.contents()),) if eos is not None else (),
    )


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    # llama3-style scaling arrives as a rope_freqs tensor, which the model applies itself.
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    return None


def read_weights(reader: GGUFReader, config: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its Hugging Face name and layout."""
    weights = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, path)
        array = dequantize_tensor(tensor, path)
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            array = unpermute_rope_rows(array, heads)
        # F32 data is a view of the read-only file map: copy it so the weights own their memory.
        weights[name] = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
    return weights


def quant_names(path: Path) -> list[str]:
    """Hugging Face names of the file's 2-D weights in block formats (model/quant.py)."""
    reader = open_gguf(path)
    return [
        hf_name(t.name, path)
        for t in reader.tensors
        if t.tensor_type.name in FORMATS and len(t.shape) == 2
    ]


def read_quant_weights(path: Path, config: ModelConfig) -> dict[str, QuantWeight]:
    """The file's weights in block formats (model/quant.py), kept in their blocks under
    their Hugging Face names, Q/K rows in Hugging Face order: views of the mapped file
    (Q/K rows reordered are copies), which the model copies once into its own memory
    (QuantWeight.owned, concat_rows), so a user rewriting the file cannot reach a
    running worker and no weight is held twice."""
    reader = open_gguf(path, "c")
    out = {}
    for tensor in reader.tensors:
        fmt = FORMATS.get(tensor.tensor_type.name)
        if fmt is None or len(tensor.shape) != 2:
            continue
        name = hf_name(tensor.name, path)
        in_features, rows = int(tensor.shape[0]), int(tensor.shape[1])  # fastest first
        blocks = np.asarray(tensor.data).reshape(rows, -1)  # [rows, row bytes]
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            blocks = unpermute_rope_rows(blocks, heads)  # whole rows move: blocks stay
        out[name] = QuantWeight(fmt, torch.from_numpy(blocks), in_features)
    return out


def hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ModelLoadError(path, f"unexpected tensor {gguf_name!r}")


def dequantize_tensor(tensor: Any, path: Path) -> np.ndarray:
    """One tensor as float32 in row-major (PyTorch) shape."""
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_QUANTS:
        supported = ", ".join(sorted(q.name for q in SUPPORTED_QUANTS))
        raise ModelLoadError(
            path,
            f"tensor {tensor.name} has unsupported quant type {qtype.name} "
            f"(supported: {supported})",
        )
    # GGUF lists dimensions fastest-first; PyTorch wants them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return dequantize(tensor.data, qtype).astype(np.float32, copy=False).reshape(shape)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row order llama.cpp gives Q/K projections for its interleaved RoPE.

    GGUF stores each head's rows as (pair, 2) interleaved; Hugging Face's rotate-half
    RoPE wants the two halves of the head contiguous.
    """
    rows = weight.shape[0]
    # [heads, half, 2, in] -> [heads, 2, half, in]
    shaped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)
