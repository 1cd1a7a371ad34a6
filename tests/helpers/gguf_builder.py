"""Tiny GGUF files for tests, written with gguf.GGUFWriter (the one GGUF writer of the
tests: random_models.write_gguf writes a transformers model through it), a toy byte-level
tokenizer for them, and the check that a load failed with one clear line.

The shapes are those of a two-layer llama small enough to write, read and convert in
milliseconds. Tensors are given in GGUF names and PyTorch (row-major) shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from appliance.model.errors import ModelLoadError

HIDDEN, LAYERS, HEADS, KV_HEADS, FF, VOCAB = 64, 2, 4, 2, 128, 32
HEAD_DIM = HIDDEN // HEADS

# Metadata keys without the "<arch>." prefix; floats are written as float32, ints as uint32.
BASE_METADATA: dict[str, int | float] = {
    "block_count": LAYERS,
    "embedding_length": HIDDEN,
    "feed_forward_length": FF,
    "attention.head_count": HEADS,
    "attention.head_count_kv": KV_HEADS,
    "rope.freq_base": 10000.0,
    "attention.layer_norm_rms_epsilon": 1e-5,
    "context_length": 256,
    "vocab_size": VOCAB,
}

Tensor = np.ndarray | tuple[np.ndarray, GGMLQuantizationType]
MetadataValue = int | float | str | list[bool]


def tiny_gguf_metadata(config: Any) -> dict[str, MetadataValue]:
    """The llama keys (without the "<arch>." prefix) of a GGUF of this transformers
    config's shape, as convert_hf_to_gguf writes them: layers, context, widths, heads,
    RoPE base, norm epsilon, vocabulary. A family adds its own keys to these."""
    rope = config.rope_parameters
    # Per layer type (Gemma 3): the full-attention layers' base, as llama.cpp writes it.
    rope = rope.get("full_attention", rope)
    return {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "vocab_size": config.vocab_size,
    }


# A byte-level BPE vocabulary small enough for transformers to convert in milliseconds.
TOY_TOKENS = ["<|endoftext|>", *(chr(c) for c in range(ord("a"), ord("z") + 1))]
TOY_TOKENS += ["ab", "cd", "ef", "gh", "Ġ"]
TOY_MERGES = ["a b", "c d", "e f", "g h"]
assert len(TOY_TOKENS) == VOCAB


def toy_tokenizer() -> dict[str, Any]:
    """write_gguf's tokenizer arguments for the toy vocabulary: a gpt2-style BPE whose
    token 0 is the control token that begins and ends a text."""
    return {
        "tokens": TOY_TOKENS,
        "pre": "default",
        "token_types": [gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (VOCAB - 1),
        "merges": TOY_MERGES,
        "bos": 0,
        "eos": 0,
    }


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Standard normal float32 values of this shape."""
    return rng.standard_normal(shape).astype(np.float32)


def model_tensors(rng: np.random.Generator, *, tied: bool = False) -> dict[str, np.ndarray]:
    """A whole tiny llama model, in GGUF names and PyTorch shapes (no output.weight if tied)."""
    tensors = {
        "token_embd.weight": rand(rng, VOCAB, HIDDEN),
        "output_norm.weight": rand(rng, HIDDEN),
    }
    if not tied:
        tensors["output.weight"] = rand(rng, VOCAB, HIDDEN)
    for i in range(LAYERS):
        tensors |= {
            f"blk.{i}.attn_norm.weight": rand(rng, HIDDEN),
            f"blk.{i}.ffn_norm.weight": rand(rng, HIDDEN),
            f"blk.{i}.attn_q.weight": rand(rng, HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": rand(rng, KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": rand(rng, KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": rand(rng, HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate.weight": rand(rng, FF, HIDDEN),
            f"blk.{i}.ffn_up.weight": rand(rng, FF, HIDDEN),
            f"blk.{i}.ffn_down.weight": rand(rng, HIDDEN, FF),
        }
    return tensors


def write_gguf(
    path: Path,
    tensors: Mapping[str, Tensor],
    *,
    arch: str = "llama",
    metadata: Mapping[str, MetadataValue] = BASE_METADATA,
    drop: Sequence[str] = (),
    tokens: Sequence[str] | None = None,
    pre: str | None = None,
    token_types: Sequence[int] | None = None,
    merges: Sequence[str] | None = None,
    bos: int | None = None,
    eos: int | None = None,
    eot: int | None = None,
    eom: int | None = None,
    general: Mapping[str, MetadataValue] = MappingProxyType({}),
) -> Path:
    """A GGUF file with `metadata` (less `drop`), an optional gpt2 tokenizer and these tensors.
    `general` keys are written as named (general.sampling.temp), ints as int32s.

    Metadata keys get the "<arch>." prefix; ints are written as uint32s, floats as
    float32s, lists as arrays. A tensor is a float32/float16 array in
    PyTorch (row-major) shape, or a pair (uint8 array in byte shape, quant type) for raw
    quantized blocks. Tokenizer keys are written only when given; `tokens` also writes
    tokenizer.ggml.model = "gpt2".
    """
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if key in drop:
            continue
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for key, value in general.items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_int32(key, value)
        else:
            writer.add_string(key, str(value))
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
    if token_types is not None:
        writer.add_token_types(token_types)
    if merges is not None:
        writer.add_token_merges(merges)
    if bos is not None:
        writer.add_bos_token_id(bos)
    if eos is not None:
        writer.add_eos_token_id(eos)
    if eot is not None:
        writer.add_eot_token_id(eot)
    if eom is not None:
        writer.add_eom_token_id(eom)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_load_error(
    excinfo: pytest.ExceptionInfo[ModelLoadError], path: Path, *words: str
) -> None:
    """The error is one line that names the file and says each of `words`."""
    message = str(excinfo.value)
    assert str(path) in message
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
