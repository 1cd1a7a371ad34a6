"""Reading GGUF files: metadata, dequantization, tensor names, RoPE row order, errors.

Every test builds its own tiny GGUF file with gguf.GGUFWriter; one test opens the
embedded SmolLM2 file for its metadata only.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import gguf
import gguf_builder
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape
from gguf_builder import (
    BASE_METADATA,
    FF,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    VOCAB,
    assert_load_error,
    model_tensors,
    rand,
)

from appliance.model.errors import ModelLoadError
from appliance.model.formats.gguf_file import (
    dequantize_tensor,
    open_gguf,
    quant_names,
    read_model_config,
    read_quant_weights,
    read_weights,
    tensor_index,
)
from appliance.model.formats.gguf_names import unpermute_rope_rows
from appliance.model.model_config import ModelConfig

Q = GGMLQuantizationType
# rope.freq_base differs from the builder's default, so reading it back proves it is read.
write_gguf = partial(gguf_builder.write_gguf, metadata=BASE_METADATA | {"rope.freq_base": 50000.0})


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def load(path: Path) -> tuple[gguf.GGUFReader, ModelConfig]:
    reader = open_gguf(path)
    return reader, read_model_config(reader, path)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# --- dequantization ------------------------------------------------------------------------


def _f32_tol(x: np.ndarray) -> dict[str, float]:
    return {"rtol": 0.0, "atol": 0.0}


def _f16_tol(x: np.ndarray) -> dict[str, float]:
    return {"rtol": 1e-3, "atol": 1e-4}


def _bf16_tol(x: np.ndarray) -> dict[str, float]:
    return {"rtol": 8e-3, "atol": 1e-6}


def _q8_0_tol(x: np.ndarray) -> dict[str, float]:
    return {"rtol": 0.0, "atol": float(np.abs(x).max()) / 127}


def _q4_0_tol(x: np.ndarray) -> dict[str, float]:
    return {"rtol": 0.0, "atol": float(np.abs(x).max()) / 8}


def _q4_1_tol(x: np.ndarray) -> dict[str, float]:
    return {"rtol": 0.0, "atol": float(x.max() - x.min()) / 15}


@pytest.mark.parametrize(
    ("qtype", "tolerance"),
    [
        (Q.F32, _f32_tol),
        (Q.F16, _f16_tol),
        (Q.BF16, _bf16_tol),
        (Q.Q8_0, _q8_0_tol),
        (Q.Q4_0, _q4_0_tol),
        (Q.Q4_1, _q4_1_tol),
    ],
    ids=["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"],
)
def test_quantized_tensor_round_trips(tmp_path, rng, qtype, tolerance):
    original = rand(rng, VOCAB, HIDDEN)  # not square: a transposed result cannot pass
    encoded = gguf.quants.quantize(original, qtype)
    raw = None if qtype in (Q.F32, Q.F16) else qtype
    path = write_gguf(
        tmp_path / "m.gguf",
        {"token_embd.weight": (encoded, raw) if raw is not None else encoded},
    )
    reader, config = load(path)
    (tensor,) = reader.tensors
    assert tensor.tensor_type == qtype

    array = dequantize_tensor(tensor, path)
    assert array.shape == (VOCAB, HIDDEN)
    assert array.dtype == np.float32
    np.testing.assert_allclose(array, original, **tolerance(original))
    # Exactly what the reference dequantizer gives for the encoded bytes.
    expected = gguf.quants.dequantize(encoded, qtype).astype(np.float32).reshape(VOCAB, HIDDEN)
    np.testing.assert_array_equal(array, expected)

    weights = read_weights(path, config)
    embed = weights["model.embed_tokens.weight"]
    assert embed.dtype == torch.float32
    assert tuple(embed.shape) == (VOCAB, HIDDEN)
    torch.testing.assert_close(embed, torch.from_numpy(expected), rtol=0, atol=0)


def _f16_bytes(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float16).view(np.uint8)


def _k_scales(scale: int, minimum: int) -> np.ndarray:
    """The 12-byte packed 6-bit scales and mins of Q4_K/Q5_K, all 8 sub-blocks alike."""
    sc, mn = [scale] * 8, [minimum] * 8
    return np.array(
        [(sc[j] & 0x3F) | ((sc[j + 4] >> 4) << 6) for j in range(4)]
        + [(mn[j] & 0x3F) | ((mn[j + 4] >> 4) << 6) for j in range(4)]
        + [(sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4) for j in range(4)],
        dtype=np.uint8,
    )


def q4_k_block(d: float, dmin: float, scale: int, minimum: int, nibble: int) -> np.ndarray:
    qs = np.full(128, nibble | (nibble << 4), dtype=np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales(scale, minimum), qs])


def q5_k_block(d: float, dmin: float, scale: int, minimum: int, nibble: int, high: bool):
    qh = np.full(32, 0xFF if high else 0x00, dtype=np.uint8)
    qs = np.full(128, nibble | (nibble << 4), dtype=np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales(scale, minimum), qh, qs])


def q6_k_block(d: float, scale: int, ql: int, qh: int) -> np.ndarray:
    return np.concatenate(
        [
            np.full(128, ql, dtype=np.uint8),
            np.full(64, qh, dtype=np.uint8),
            np.full(16, scale, dtype=np.int8).view(np.uint8),
            _f16_bytes(d),
        ]
    )


# Two rows of one 256-element super-block each, with different known values per row.
K_QUANT_CASES = {
    # d * scale * nibble - dmin * min
    Q.Q4_K: ([q4_k_block(1.0, 0.0, 1, 0, 3), q4_k_block(1.0, 1.0, 1, 2, 7)], [3.0, 5.0]),
    # d * scale * (nibble | high bit << 4) - dmin * min
    Q.Q5_K: (
        [q5_k_block(1.0, 0.0, 1, 0, 3, True), q5_k_block(2.0, 0.5, 1, 4, 5, False)],
        [19.0, 8.0],
    ),
    # d * scale * ((ql nibble | qh 2 bits << 4) - 32)
    Q.Q6_K: ([q6_k_block(1.0, 1, 0x00, 0x00), q6_k_block(1.0, -1, 0xFF, 0xFF)], [-32.0, -31.0]),
}


@pytest.mark.parametrize("qtype", list(K_QUANT_CASES), ids=lambda q: q.name)
def test_k_quant_blocks_dequantize_to_known_values(tmp_path, qtype):
    blocks, row_values = K_QUANT_CASES[qtype]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.stack(blocks)
    assert raw.shape == quant_shape_to_byte_shape((2, block_size), qtype) == (2, type_size)
    path = write_gguf(tmp_path / "m.gguf", {"token_embd.weight": (raw, qtype)})
    reader, config = load(path)
    (tensor,) = reader.tensors
    assert tensor.tensor_type == qtype

    array = dequantize_tensor(tensor, path)
    expected = np.repeat(np.array(row_values, dtype=np.float32)[:, None], block_size, axis=1)
    assert array.dtype == np.float32
    np.testing.assert_array_equal(array, expected)

    embed = read_weights(path, config)["model.embed_tokens.weight"]
    assert embed.dtype == torch.float32
    torch.testing.assert_close(embed, torch.from_numpy(expected), rtol=0, atol=0)


def test_unsupported_quant_type_is_refused_by_name(tmp_path):
    block_size, type_size = GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = np.zeros((VOCAB, HIDDEN // block_size * type_size), dtype=np.uint8)
    path = write_gguf(tmp_path / "iq.gguf", {"token_embd.weight": (raw, Q.IQ4_NL)})
    reader, config = load(path)
    with pytest.raises(ModelLoadError) as excinfo:
        read_weights(path, config)
    assert_load_error(excinfo, path, "IQ4_NL", "token_embd.weight")
    with pytest.raises(ModelLoadError) as excinfo:
        dequantize_tensor(reader.tensors[0], path)
    assert_load_error(excinfo, path, "IQ4_NL")


def mappings_of(path: Path) -> list[str]:
    """This process's memory mappings of `path` (lines of /proc/self/maps)."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(path) in line]


def test_weights_are_read_into_their_own_memory_and_the_file_is_not_mapped(tmp_path, rng):
    """Each tensor is read when asked for, into writable memory of its own (an in-place op
    on a view of a read-only map kills the process with SIGSEGV), and no page of the file
    stays mapped in this process (it would count against the worker's memory)."""
    path = write_gguf(tmp_path / "m.gguf", model_tensors(rng))
    _, config = load(path)
    before = mappings_of(path)
    weights = read_weights(path, config)
    embed = weights["model.embed_tokens.weight"]
    embed.add_(1)
    assert not torch.equal(embed, weights["model.embed_tokens.weight"])  # read afresh
    assert all(weights[name].data_ptr() != embed.data_ptr() for name in weights)
    assert mappings_of(path) == before


# --- reading a tensor at a time ------------------------------------------------------------


def encoded(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray | tuple:
    """A float32 array as the builder takes it in `qtype`."""
    if qtype == Q.F32:
        return array
    return gguf.quants.quantize(array, qtype), qtype


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_pieces_make_up_the_tensor(tmp_path, rng, qtype):
    tensors = model_tensors(rng)
    tensors["blk.0.ffn_gate.weight"] = encoded(tensors["blk.0.ffn_gate.weight"], qtype)
    path = write_gguf(tmp_path / "m.gguf", tensors)
    _, config = load(path)
    weights = read_weights(path, config)
    name = "model.layers.0.mlp.gate_proj.weight"
    pieces = list(weights.pieces([name], max_bytes=3 * HIDDEN * 4))  # 3 float32 rows
    assert [n for n, _ in pieces] == [name] * len(pieces)
    shapes = [tuple(p.shape) for _, p in pieces]
    assert shapes == [(3, HIDDEN)] * (FF // 3) + [(FF % 3, HIDDEN)]
    assert all(p.dtype == torch.float32 for _, p in pieces)
    torch.testing.assert_close(torch.cat([p for _, p in pieces]), weights[name], rtol=0, atol=0)
    assert weights.shape(name) == (FF, HIDDEN)


def test_q_and_k_pieces_hold_whole_heads_in_hugging_face_order(tmp_path, rng):
    tensors = model_tensors(rng)
    original = tensors["blk.0.attn_q.weight"].copy()
    tensors["blk.0.attn_q.weight"] = llama_cpp_permute(original, HEADS)
    path = write_gguf(tmp_path / "m.gguf", tensors)
    _, config = load(path)
    weights = read_weights(path, config)
    name = "model.layers.0.self_attn.q_proj.weight"
    pieces = [p for _, p in weights.pieces([name], max_bytes=HEAD_DIM * HIDDEN * 4 + 4)]
    assert [p.shape[0] for p in pieces] == [HEAD_DIM] * HEADS  # a head each, not a row more
    np.testing.assert_array_equal(torch.cat(pieces).numpy(), original)
    ((_, norm),) = weights.pieces(["model.norm.weight"], max_bytes=1)
    assert tuple(norm.shape) == (1, HIDDEN)
    np.testing.assert_array_equal(norm[0].numpy(), tensors["output_norm.weight"])


def test_pieces_read_by_threads_come_in_order(tmp_path, rng):
    tensors = model_tensors(rng)
    for name in ("blk.0.ffn_up.weight", "blk.1.attn_k.weight", "token_embd.weight"):
        tensors[name] = encoded(tensors[name], Q.Q8_0)
    path = write_gguf(tmp_path / "m.gguf", tensors)
    _, config = load(path)
    weights = read_weights(path, config)
    alone = list(weights.pieces(weights, max_bytes=2 * FF * 4))
    threaded = list(weights.pieces(weights, threads=3, max_bytes=2 * FF * 4))
    assert [n for n, _ in threaded] == [n for n, _ in alone]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(alone, threaded, strict=True))
    assert len(alone) > 3 * len(weights) // 2  # several pieces to a tensor


def test_block_quantized_is_read_from_the_index(tmp_path, rng):
    tensors = model_tensors(rng)
    floats = write_gguf(tmp_path / "f.gguf", tensors)
    tensors["blk.1.ffn_up.weight"] = encoded(tensors["blk.1.ffn_up.weight"], Q.Q8_0)
    blocks = write_gguf(tmp_path / "q.gguf", tensors)
    _, config = load(floats)
    assert not read_weights(floats, config).block_quantized()
    assert read_weights(blocks, config).block_quantized()


def test_a_tensor_past_the_end_of_the_file_is_refused_before_reading(tmp_path, rng):
    good = write_gguf(tmp_path / "good.gguf", model_tensors(rng))
    _, config = load(good)
    path = tmp_path / "cut.gguf"
    path.write_bytes(good.read_bytes()[:-64])
    with pytest.raises(ModelLoadError) as excinfo:
        read_weights(path, config)
    assert_load_error(excinfo, path, "past the end")


# --- RoPE row order ------------------------------------------------------------------------


@pytest.mark.parametrize("n_head", [HEADS, KV_HEADS, 1, 9])
def test_unpermute_inverts_llama_cpp_permutation(rng, n_head):
    w = rand(rng, n_head * HEAD_DIM, HIDDEN)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    restored = unpermute_rope_rows(permuted, n_head)
    assert restored.shape == w.shape
    np.testing.assert_array_equal(restored, w)


def test_unpermute_handles_bias_vectors(rng):
    b = rand(rng, HEADS * HEAD_DIM)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(b, HEADS), HEADS), b)


def test_unpermute_depends_on_head_count(rng):
    w = rand(rng, HEADS * HEAD_DIM, HIDDEN)
    permuted = llama_cpp_permute(w, HEADS)
    assert not np.array_equal(unpermute_rope_rows(permuted, KV_HEADS), w)


def test_read_weights_unpermutes_llama_q_and_k_only(tmp_path, rng):
    tensors = model_tensors(rng)
    original = {k: v.copy() for k, v in tensors.items()}
    for i in range(LAYERS):
        tensors[f"blk.{i}.attn_q.weight"] = llama_cpp_permute(original[f"blk.{i}.attn_q.weight"], 4)
        tensors[f"blk.{i}.attn_k.weight"] = llama_cpp_permute(original[f"blk.{i}.attn_k.weight"], 2)
    path = write_gguf(tmp_path / "llama.gguf", tensors)
    _, config = load(path)
    weights = read_weights(path, config)
    for i in range(LAYERS):
        attn = f"model.layers.{i}.self_attn"
        for proj, gguf_name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
            np.testing.assert_array_equal(
                weights[f"{attn}.{proj}_proj.weight"].numpy(),
                original[f"blk.{i}.{gguf_name}.weight"],
            )
        np.testing.assert_array_equal(
            weights[f"{attn}.o_proj.weight"].numpy(), original[f"blk.{i}.attn_output.weight"]
        )


def test_read_weights_leaves_qwen2_rows_alone(tmp_path, rng):
    tensors = model_tensors(rng)
    for i in range(LAYERS):
        for proj, n in (("q", HEADS), ("k", KV_HEADS)):
            tensors[f"blk.{i}.attn_{proj}.bias"] = rand(rng, n * HEAD_DIM)
        tensors[f"blk.{i}.attn_v.bias"] = rand(rng, KV_HEADS * HEAD_DIM)
    path = write_gguf(tmp_path / "qwen.gguf", tensors, arch="qwen2")
    _, config = load(path)
    assert config.architecture == "qwen2"
    assert config.attention_bias is True
    weights = read_weights(path, config)
    for i in range(LAYERS):
        attn = f"model.layers.{i}.self_attn"
        for proj in ("q", "k", "v"):
            for kind in ("weight", "bias"):
                np.testing.assert_array_equal(
                    weights[f"{attn}.{proj}_proj.{kind}"].numpy(),
                    tensors[f"blk.{i}.attn_{proj}.{kind}"],
                )


# --- names and config ----------------------------------------------------------------------


def _expected_hf_shapes(*, tied: bool) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (HIDDEN,),
            f"{layer}.post_attention_layernorm.weight": (HIDDEN,),
            f"{layer}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{layer}.mlp.gate_proj.weight": (FF, HIDDEN),
            f"{layer}.mlp.up_proj.weight": (FF, HIDDEN),
            f"{layer}.mlp.down_proj.weight": (HIDDEN, FF),
        }
    return shapes


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tensor_names_map_to_hugging_face(tmp_path, rng, tied):
    tensors = model_tensors(rng, tied=tied)
    path = write_gguf(tmp_path / "m.gguf", tensors)
    _, config = load(path)
    assert config.tie_word_embeddings is tied
    weights = read_weights(path, config)
    assert {k: tuple(v.shape) for k, v in weights.items()} == _expected_hf_shapes(tied=tied)
    assert all(v.dtype == torch.float32 for v in weights.values())
    np.testing.assert_array_equal(
        weights["model.embed_tokens.weight"].numpy(), tensors["token_embd.weight"]
    )
    np.testing.assert_array_equal(
        weights["model.layers.1.mlp.down_proj.weight"].numpy(), tensors["blk.1.ffn_down.weight"]
    )
    np.testing.assert_array_equal(
        weights["model.layers.0.post_attention_layernorm.weight"].numpy(),
        tensors["blk.0.ffn_norm.weight"],
    )
    if not tied:
        np.testing.assert_array_equal(weights["lm_head.weight"].numpy(), tensors["output.weight"])


def test_unexpected_tensor_name_is_refused(tmp_path, rng):
    path = write_gguf(tmp_path / "m.gguf", {"blk.0.mystery.weight": rand(rng, HIDDEN)})
    _, config = load(path)
    with pytest.raises(ModelLoadError) as excinfo:
        read_weights(path, config)
    assert_load_error(excinfo, path, "blk.0.mystery.weight")


def test_model_config_comes_from_metadata(tmp_path, rng):
    path = write_gguf(tmp_path / "m.gguf", model_tensors(rng), eos=7)
    _, config = load(path)
    assert config.architecture == "llama"
    assert config.vocab_size == VOCAB
    assert config.hidden_size == HIDDEN
    assert config.intermediate_size == FF
    assert config.num_layers == LAYERS
    assert config.num_heads == HEADS
    assert config.num_kv_heads == KV_HEADS
    assert config.head_dim == HEAD_DIM
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.rope_theta == pytest.approx(50000.0)
    assert config.max_position_embeddings == 256
    assert config.tie_word_embeddings is False
    assert config.attention_bias is False
    assert config.rope_scaling is None
    assert config.eos_token_ids == (7,)


def test_end_of_turn_and_message_tokens_stop_too(tmp_path, rng):
    """A Llama 3.1 GGUF names <|end_of_text|>, <|eot_id|> and <|eom_id|>: each stops."""
    path = write_gguf(tmp_path / "m.gguf", model_tensors(rng), eos=7, eot=9, eom=11)
    assert load(path)[1].eos_token_ids == (7, 9, 11)
    same = write_gguf(tmp_path / "s.gguf", model_tensors(rng), eos=7, eot=7)
    assert load(same)[1].eos_token_ids == (7,)


def test_optional_metadata_falls_back(tmp_path, rng):
    path = write_gguf(
        tmp_path / "m.gguf",
        model_tensors(rng),
        drop=("attention.head_count_kv", "vocab_size"),
        tokens=[f"t{i}" for i in range(40)],
    )
    _, config = load(path)
    assert config.num_kv_heads == HEADS
    assert config.vocab_size == 40  # from the token list
    assert config.eos_token_ids == ()


# --- errors --------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(ModelLoadError) as excinfo:
        open_gguf(path)
    assert_load_error(excinfo, path, "no such file")


def test_random_bytes_are_not_gguf(tmp_path, rng):
    path = tmp_path / "noise.gguf"
    path.write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError) as excinfo:
        open_gguf(path)
    assert_load_error(excinfo, path, "not a valid GGUF file")


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.98])
def test_truncated_file_is_refused(tmp_path, rng, keep):
    good = write_gguf(tmp_path / "good.gguf", model_tensors(rng))
    data = good.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError) as excinfo:
        load(path)
    assert_load_error(excinfo, path)


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(ModelLoadError) as excinfo:
        open_gguf(tmp_path)
    assert_load_error(excinfo, tmp_path)


def test_unknown_architecture(tmp_path, rng):
    path = write_gguf(tmp_path / "m.gguf", model_tensors(rng), arch="mamba")
    reader = open_gguf(path)
    with pytest.raises(ModelLoadError) as excinfo:
        read_model_config(reader, path)
    assert_load_error(excinfo, path, "unknown architecture", "mamba")


@pytest.mark.parametrize(
    "key", ["block_count", "embedding_length", "feed_forward_length", "attention.head_count"]
)
def test_missing_required_metadata_key(tmp_path, rng, key):
    path = write_gguf(tmp_path / "m.gguf", model_tensors(rng), drop=(key,))
    reader = open_gguf(path)
    with pytest.raises(ModelLoadError) as excinfo:
        read_model_config(reader, path)
    assert_load_error(excinfo, path, f"llama.{key}")


def test_missing_vocab_size_without_token_list(tmp_path, rng):
    """No llama.vocab_size and no tokenizer.ggml.tokens: still a ModelLoadError."""
    path = write_gguf(tmp_path / "m.gguf", model_tensors(rng), drop=("vocab_size",))
    reader = open_gguf(path)
    with pytest.raises(ModelLoadError) as excinfo:
        read_model_config(reader, path)
    assert_load_error(excinfo, path, "vocab")


# --- the embedded model --------------------------------------------------------------------


def test_embedded_model_metadata():
    from appliance.model.model_source import default_model_path

    path = default_model_path()
    assert path.is_file()
    reader = open_gguf(path)
    config = read_model_config(reader, path)
    assert config.architecture == "llama"
    assert config.num_layers == 30
    assert config.num_heads == 9
    assert config.num_kv_heads == 3
    assert config.head_dim == 64
    assert config.tie_word_embeddings is True
    assert config.vocab_size == 49152


# --- the tensor index read from the header alone ---------------------------------------


def test_tensor_index_agrees_with_gguf_reader(tmp_path, rng):
    """Every tensor's type, dimensions and data offset as gguf-py reads them, past
    metadata of every kind (strings, string and number arrays, a custom alignment)."""
    tensors = model_tensors(rng)
    blocks = rng.integers(0, 256, (VOCAB, HIDDEN // 32 * 18), dtype=np.uint8)
    tensors["token_embd.weight"] = (blocks, GGMLQuantizationType.Q4_0)
    path = tmp_path / "model.gguf"
    writer_args = dict(tokens=[f"t{i}" for i in range(VOCAB)], merges=["a b", "c d"],
                       token_types=[1] * VOCAB, eos=2)  # fmt: skip
    write_gguf(path, tensors, **writer_args)
    reader = gguf.GGUFReader(path)
    index = tensor_index(path)
    assert [e.name for e in index] == [t.name for t in reader.tensors]
    for entry, tensor in zip(index, reader.tensors, strict=True):
        assert entry.type_id == int(tensor.tensor_type)
        assert entry.dims == tuple(int(d) for d in tensor.shape)
        assert entry.offset == tensor.data_offset
    assert quant_names(path) == ["model.embed_tokens.weight"]
    config = read_model_config(reader, path)
    weight = read_quant_weights(path, config)["model.embed_tokens.weight"]
    assert np.array_equal(weight.blocks.numpy(), blocks)


@pytest.mark.parametrize("keep", [0, 3, 40, 200])
def test_tensor_index_refuses_a_cut_header(tmp_path, rng, keep):
    good = write_gguf(tmp_path / "good.gguf", model_tensors(rng), tokens=["a", "b"])
    path = tmp_path / "cut.gguf"
    path.write_bytes(good.read_bytes()[:keep])
    with pytest.raises(ModelLoadError) as excinfo:
        tensor_index(path)
    assert_load_error(excinfo, path, "not a valid GGUF file")
