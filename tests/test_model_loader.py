"""load_model_files: Hugging Face folders, GGUF files and the dequantized GGUF cache."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import gguf_builder
import numpy as np
import pytest
import torch
from gguf_builder import (
    FF,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    VOCAB,
    assert_load_error,
    model_tensors,
)
from safetensors.torch import save_file

from appliance.model import gguf_file, loader
from appliance.model.errors import ModelLoadError
from appliance.model.loader import ModelFiles, cache_entry, load_model_files

# A byte-level BPE vocabulary small enough for transformers to convert in milliseconds.
TOKENS = [
    "<|endoftext|>",
    *(chr(c) for c in range(ord("a"), ord("z") + 1)),
    "ab",
    "cd",
    "ef",
    "gh",
    "Ġ",
]
MERGES = ["a b", "c d", "e f", "g h"]
assert len(TOKENS) == VOCAB

HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": FF,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
}


def write_gguf(path: Path, *, seed: int = 0, tokenizer: bool = True) -> Path:
    """A tiny tied llama GGUF with a gpt2-style tokenizer that transformers can convert."""
    tokenizer_keys: dict[str, Any] = {}
    if tokenizer:
        tokenizer_keys = {
            "tokens": TOKENS,
            "pre": "default",
            "token_types": [gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (VOCAB - 1),
            "merges": MERGES,
            "bos": 0,
            "eos": 0,
        }
    tensors = model_tensors(np.random.default_rng(seed), tied=True)
    return gguf_builder.write_gguf(path, tensors, **tokenizer_keys)


def read_directly(path: Path) -> dict[str, torch.Tensor]:
    reader = gguf_file.open_gguf(path)
    config = gguf_file.read_model_config(reader, path)
    return {k: v.clone() for k, v in gguf_file.read_weights(reader, config, path).items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def forbid_reading_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any non-cached load fail loudly, so a success proves a cache hit."""

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was read although the cache is complete")

    monkeypatch.setattr(gguf_file, "open_gguf", refuse)
    monkeypatch.setattr(gguf_file, "read_weights", refuse)
    monkeypatch.setattr(loader, "convert_gguf_tokenizer", refuse)


# --- Hugging Face folders ------------------------------------------------------------------


def hf_folder(tmp_path: Path, *, config=True, shards=True, tokenizer=True) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    if config:
        (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    if shards:
        save_file(
            {"model.embed_tokens.weight": torch.ones(VOCAB, HIDDEN)}, folder / "a.safetensors"
        )
        save_file({"model.norm.weight": torch.full((HIDDEN,), 2.0)}, folder / "b.safetensors")
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def test_hf_folder_loads(tmp_path):
    folder = hf_folder(tmp_path)
    files = load_model_files(folder, tmp_path / "cache")
    assert isinstance(files, ModelFiles)
    assert files.source == folder
    assert files.tokenizer_dir == folder
    assert files.config.num_layers == LAYERS
    assert files.config.num_kv_heads == KV_HEADS
    assert files.config.tie_word_embeddings is True
    assert files.config.eos_token_ids == (0,)
    assert sorted(files.weights) == ["model.embed_tokens.weight", "model.norm.weight"]
    torch.testing.assert_close(files.weights["model.norm.weight"], torch.full((HIDDEN,), 2.0))
    assert not (tmp_path / "cache").exists()  # folders are not cached


@pytest.mark.parametrize(
    ("missing", "word"),
    [("config", "config.json"), ("shards", "safetensors"), ("tokenizer", "tokenizer.json")],
)
def test_hf_folder_missing_part(tmp_path, missing, word):
    folder = hf_folder(tmp_path, **{missing: False})
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_files(folder, tmp_path / "cache")
    assert_load_error(excinfo, folder, word)


@pytest.mark.parametrize(
    "config_text",
    [
        "{not json",
        json.dumps({k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}),
        json.dumps(HF_CONFIG | {"model_type": "mamba"}),
    ],
    ids=["invalid-json", "missing-key", "unknown-architecture"],
)
def test_hf_folder_bad_config(tmp_path, config_text):
    folder = hf_folder(tmp_path)
    (folder / "config.json").write_text(config_text)
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_files(folder, tmp_path / "cache")
    assert_load_error(excinfo, folder)


def test_hf_folder_corrupt_safetensors(tmp_path):
    folder = hf_folder(tmp_path)
    shard = folder / "b.safetensors"
    shard.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_files(folder, tmp_path / "cache")
    assert_load_error(excinfo, shard, "safetensors")


@pytest.mark.parametrize("cut", [4, 40, -8], ids=["no-header", "header-cut", "data-cut"])
def test_hf_folder_truncated_safetensors(tmp_path, cut):
    folder = hf_folder(tmp_path)
    shard = folder / "b.safetensors"
    save_file({"x": torch.arange(64, dtype=torch.float32)}, shard)
    shard.write_bytes(shard.read_bytes()[:cut])
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_files(folder, tmp_path / "cache")
    assert_load_error(excinfo, shard, "safetensors")


@pytest.mark.parametrize(
    ("header", "data", "why"),
    [
        ([1, 2], b"", "not a JSON object"),
        ({"x": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0", "F8_E4M3"),
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "8 bytes"),
        ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "outside"),
        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "outside"),
        ({"x": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "data_offsets"),
    ],
    ids=["list-header", "dtype", "size", "past-end", "negative", "no-offsets"],
)
def test_malformed_safetensors_are_one_clear_error(tmp_path, header, data, why):
    text = json.dumps(header).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    with pytest.raises(ModelLoadError, match=why):
        loader._read_safetensors(path)


def test_safetensors_are_mapped_with_every_dtype_and_shape(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "u8": torch.arange(9, dtype=torch.uint8).view(3, 3),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    mapped = loader._read_safetensors(tmp_path / "t.safetensors")
    assert sorted(mapped) == sorted(tensors)
    for name, tensor in tensors.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor)
    mapped["f32"].mul_(0)  # copy-on-write: the file keeps its values
    again = loader._read_safetensors(tmp_path / "t.safetensors")
    assert torch.equal(again["f32"], tensors["f32"])


# --- GGUF files ----------------------------------------------------------------------------


def test_missing_path(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_files(path, tmp_path / "cache")
    assert_load_error(excinfo, path, "no such file")


def test_corrupt_gguf_leaves_no_cache_entry(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 2048, dtype=np.uint8).tobytes())
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_files(path, cache)
    assert_load_error(excinfo, path, "not a valid GGUF file")
    assert not cache_entry(path, cache).exists()


def test_gguf_without_tokenizer_is_refused(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tokenizer=False)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_files(path, cache)
    assert_load_error(excinfo, path, "tokenizer")
    assert not cache_entry(path, cache).exists()


def test_cache_entry_is_keyed_by_size_and_mtime(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    first = cache_entry(path, cache)
    assert first.parent == cache
    assert cache_entry(path, cache) == first
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    moved = cache_entry(path, cache)
    assert moved != first
    with path.open("ab") as f:  # same mtime, other size
        f.write(b"\0" * 32)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert cache_entry(path, cache) not in (first, moved)


def test_gguf_is_cached_and_reloaded_from_cache(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    expected = read_directly(path)

    first = load_model_files(path, cache)
    entry = cache_entry(path, cache)
    assert first.source == path
    assert first.tokenizer_dir == entry
    assert (entry / "complete").is_file()
    assert (entry / "model.safetensors").is_file()
    assert (entry / "tokenizer.json").is_file()
    assert first.config.tie_word_embeddings is True
    assert first.config.eos_token_ids == (0,)
    assert_same_weights(first.weights, expected)
    assert [p.name for p in cache.iterdir()] == [entry.name]  # no staging folder left

    forbid_reading_gguf(monkeypatch)
    second = load_model_files(path, cache)
    assert second.tokenizer_dir == entry
    assert second.config == first.config
    assert_same_weights(second.weights, expected)


def test_prepare_model_caches_once_then_reads_no_weights(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    config, tokenizer_dir = loader.prepare_model(path, cache)
    assert tokenizer_dir == cache_entry(path, cache) and (tokenizer_dir / "complete").is_file()

    forbid_reading_gguf(monkeypatch)
    monkeypatch.setattr(loader, "_read_safetensors", forbid_weights)
    assert loader.prepare_model(path, cache) == (config, tokenizer_dir)


def forbid_weights(*args, **kwargs):
    raise AssertionError("weights were read although only the config was asked for")


def test_cached_tokenizer_is_usable(tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "m.gguf")
    files = load_model_files(path, tmp_path / "cache")
    tokenizer = AutoTokenizer.from_pretrained(str(files.tokenizer_dir))
    assert tokenizer.convert_ids_to_tokens(tokenizer("abcd")["input_ids"]) == ["ab", "cd"]


def test_touched_gguf_gets_a_new_cache_entry(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    load_model_files(path, cache)
    old_entry = cache_entry(path, cache)

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    new_entry = cache_entry(path, cache)
    assert new_entry != old_entry
    assert not new_entry.exists()

    files = load_model_files(path, cache)
    assert files.tokenizer_dir == new_entry
    assert (new_entry / "complete").is_file()
    assert_same_weights(files.weights, read_directly(path))


def test_rewritten_gguf_is_not_served_stale_weights(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", seed=1)
    cache = tmp_path / "cache"
    load_model_files(path, cache)
    before = path.stat()
    write_gguf(path, seed=2)  # same size, new contents
    # Coarse file-system clocks may give the rewrite the same mtime; make it differ.
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_size == before.st_size
    files = load_model_files(path, cache)
    assert_same_weights(files.weights, read_directly(path))


def test_same_named_files_in_different_folders_do_not_share_a_cache_entry(tmp_path):
    """Two different models called m.gguf, equal in size and mtime (e.g. copied with
    `cp -p`, `rsync -a`, or unpacked from archives), must each get their own weights."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = write_gguf(tmp_path / "one" / "m.gguf", seed=1)
    two = write_gguf(tmp_path / "two" / "m.gguf", seed=2)
    assert one.stat().st_size == two.stat().st_size
    stat = one.stat()
    os.utime(two, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    cache = tmp_path / "cache"
    load_model_files(one, cache)
    files = load_model_files(two, cache)
    assert_same_weights(files.weights, read_directly(two))
