"""load_model_files: Hugging Face folders, GGUF files and the dequantized GGUF cache."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_builder import FF, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, assert_load_error
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_gguf import read_directly, write_gguf

from appliance.model import gguf_cache, gguf_dense_cache, model_source
from appliance.model.errors import ModelLoadError
from appliance.model.formats import gguf_file, safetensors_file
from appliance.model.gguf_cache import cache_entry
from appliance.model.loader import ModelFiles, load_model_files

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


def assert_same_weights(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> None:
    """`a` holds `b`'s float32 values: matrices in `dtype`, vectors in float32."""
    assert sorted(a) == sorted(b)
    for name in a:
        expected = b[name].to(dtype) if b[name].dim() == 2 else b[name]
        assert a[name].dtype == expected.dtype, name
        torch.testing.assert_close(a[name], expected, rtol=0, atol=0, msg=name)


def forbid_reading_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make reading the file's metadata, converting its tokenizer or dequantizing any of
    its weights fail loudly, so a success proves they came from the cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was read although the cache is complete")

    monkeypatch.setattr(gguf_file, "open_gguf", refuse)
    monkeypatch.setattr(gguf_file.GGUFWeights, "_read", refuse)
    monkeypatch.setattr(gguf_cache, "convert_gguf_tokenizer", refuse)


def cached_files(entry: Path) -> list[str]:
    return sorted(p.name for p in entry.iterdir() if p.name.startswith("weights-"))


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
        safetensors_file.read_safetensors(path)


def test_safetensors_are_mapped_with_every_dtype_and_shape(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "u8": torch.arange(9, dtype=torch.uint8).view(3, 3),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    mapped = safetensors_file.read_safetensors(tmp_path / "t.safetensors")
    assert sorted(mapped) == sorted(tensors)
    for name, tensor in tensors.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor)
    mapped["f32"].mul_(0)  # copy-on-write: the file keeps its values
    again = safetensors_file.read_safetensors(tmp_path / "t.safetensors")
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
    assert first.tokenizer_dir == first.cache_entry == entry
    assert (entry / "complete").is_file()
    assert (entry / "tokenizer.json").is_file()
    assert first.config.tie_word_embeddings is True
    assert first.config.eos_token_ids == (0,)
    assert cached_files(entry) == []  # weights are cached per dtype, when a model needs them
    assert_same_weights(first.weights, expected)  # read from the file, a tensor at a time
    assert_same_weights(first.dense_weights(torch.float32), expected)
    assert cached_files(entry) == [
        "weights-float32.safetensors",
        "weights-float32.safetensors.lock",
    ]
    assert [p.name for p in cache.iterdir()] == [entry.name]  # no staging folder left

    forbid_reading_gguf(monkeypatch)
    second = load_model_files(path, cache)
    assert second.tokenizer_dir == entry
    assert second.config == first.config
    assert_same_weights(second.dense_weights(torch.float32), expected)


def test_the_cache_holds_matrices_in_the_dtype_asked_for_and_vectors_in_float32(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    files = load_model_files(path, tmp_path / "cache")
    weights = files.dense_weights(torch.bfloat16)
    assert_same_weights(weights, read_directly(path), torch.bfloat16)
    assert isinstance(weights, safetensors_file.MappedTensors)
    # a file safetensors itself reads
    stored = files.cache_entry / "weights-bfloat16.safetensors"
    with safe_open(str(stored), "pt") as opened:
        assert sorted(opened.keys()) == sorted(weights)
        for name in opened.keys():
            assert torch.equal(opened.get_tensor(name), weights[name]), name
    assert stored.stat().st_size < sum(4 * t.numel() for t in read_directly(path).values())


def test_a_gguf_of_float_tensors_is_read_as_it_is(tmp_path):
    """Reading F32/F16 costs what reading a cache would: nothing is cached."""
    path = write_gguf(tmp_path / "m.gguf", blocks=False)
    files = load_model_files(path, tmp_path / "cache")
    weights = files.dense_weights(torch.bfloat16)
    assert weights is files.weights
    assert cached_files(files.cache_entry) == []


def test_the_serve_process_reads_no_weight(tmp_path, monkeypatch):
    """prepare_model writes the entry (tokenizer, facts) without dequantizing anything,
    then reads nothing but the entry."""
    path = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    monkeypatch.setattr(gguf_file.GGUFWeights, "_read", forbid_weights)
    config, tokenizer_dir = model_source.prepare_model(path, cache)
    assert tokenizer_dir == cache_entry(path, cache) and (tokenizer_dir / "complete").is_file()
    assert cached_files(tokenizer_dir) == []

    forbid_reading_gguf(monkeypatch)
    monkeypatch.setattr(safetensors_file, "read_safetensors", forbid_weights)
    monkeypatch.setattr(gguf_file, "tensor_index", forbid_weights)
    assert model_source.prepare_model(path, cache) == (config, tokenizer_dir)


def forbid_weights(*args, **kwargs):
    raise AssertionError("weights were read although only the config was asked for")


def test_a_waiting_worker_maps_the_cache_another_wrote(tmp_path, monkeypatch):
    """One process writes a dtype's cache at a time; one that waited for it maps it."""
    path = write_gguf(tmp_path / "m.gguf")
    files = load_model_files(path, tmp_path / "cache")
    target = files.cache_entry / "weights-float32.safetensors"
    result: list[Mapping[str, torch.Tensor]] = []
    asked = threading.Event()  # the waiter has come to the lock (not a fixed wait for it)
    lock = gguf_dense_cache.exclusive
    monkeypatch.setattr(gguf_dense_cache, "exclusive", lambda at: asked.set() or lock(at))
    with lock(target.with_name(target.name + ".lock")):
        waiter = threading.Thread(target=lambda: result.append(files.dense_weights(torch.float32)))
        waiter.start()
        assert asked.wait(30)
        waiter.join(0.2)
        assert waiter.is_alive() and not target.exists()  # waiting for the lock
        other = load_model_files(path, tmp_path / "cache").weights
        layout = {n: gguf_dense_cache.cached_layout(other.shape(n), torch.float32) for n in other}
        safetensors_file.write_safetensors(target, layout, other.pieces(layout))
        written = target.stat().st_mtime_ns
    waiter.join(30)
    assert not waiter.is_alive()
    assert target.stat().st_mtime_ns == written  # not written again
    assert_same_weights(result[0], read_directly(path))


def test_a_cache_that_cannot_be_written_leaves_nothing_and_reads_the_file(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf")
    files = load_model_files(path, tmp_path / "cache")
    pieces = files.weights.pieces

    def disk_full(*args, **kwargs):
        for name, piece in pieces(*args, **kwargs):
            if name.endswith("mlp.down_proj.weight"):
                raise OSError(28, "No space left on device")
            yield name, piece

    monkeypatch.setattr(files.weights, "pieces", disk_full)
    assert files.dense_weights(torch.float32) is files.weights
    assert cached_files(files.cache_entry) == ["weights-float32.safetensors.lock"]


@pytest.mark.parametrize(
    ("pieces", "why"),
    [
        ([("a", torch.ones(2, 3)), ("b", torch.ones(3))], "pieces of b do not fill its 16 bytes"),
        ([("a", torch.ones(1, 3)), ("b", torch.ones(4))], "pieces of a do not fill its 24 bytes"),
        ([("b", torch.ones(4))], "pieces of b come out of the layout's order"),
        ([("a", torch.ones(2, 3))], "do not fill the file"),
    ],
    ids=["short", "early", "order", "missing"],
)
def test_pieces_that_do_not_fill_the_layout_leave_no_file(tmp_path, pieces, why):
    target = tmp_path / "w.safetensors"
    layout = {"a": ((2, 3), torch.float32), "b": ((4,), torch.float32)}
    with pytest.raises(ValueError, match=why):
        safetensors_file.write_safetensors(target, layout, pieces)
    assert list(tmp_path.iterdir()) == []


def test_written_pieces_make_a_file_safetensors_reads(tmp_path):
    layout = {
        "a": ((2, 3), torch.bfloat16),
        "empty": ((0, 3), torch.float32),
        "b": ((4,), torch.float32),
    }
    a, b = torch.randn(2, 3), torch.randn(4)
    safetensors_file.write_safetensors(
        tmp_path / "w.safetensors", layout, [("a", a[:1]), ("a", a[1:]), ("b", b)]
    )
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as opened:
        assert torch.equal(opened.get_tensor("a"), a.to(torch.bfloat16))
        assert opened.get_tensor("empty").shape == (0, 3)
        assert torch.equal(opened.get_tensor("b"), b)


def test_released_tensors_read_the_file_again(tmp_path):
    big = torch.arange(3 * 4096, dtype=torch.float32)  # spans whole pages
    save_file({"small": torch.ones(3), "big": big}, tmp_path / "t.safetensors")
    mapped = safetensors_file.read_safetensors(tmp_path / "t.safetensors")
    assert torch.equal(mapped["big"], big)
    mapped.release("big")
    mapped.release("small")  # within a page: nothing to give back
    assert torch.equal(mapped["big"], big) and torch.equal(mapped["small"], torch.ones(3))


def test_cached_tokenizer_is_usable(tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "m.gguf")
    files = load_model_files(path, tmp_path / "cache")
    tokenizer = AutoTokenizer.from_pretrained(str(files.tokenizer_dir))
    assert tokenizer.convert_ids_to_tokens(tokenizer("abcd")["input_ids"]) == ["ab", "cd"]


def test_touched_gguf_gets_a_new_cache_entry_and_the_old_one_goes(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    load_model_files(path, cache).dense_weights(torch.float32)
    old_entry = cache_entry(path, cache)
    other = write_gguf(tmp_path / "other.gguf")
    load_model_files(other, cache)

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    new_entry = cache_entry(path, cache)
    assert new_entry != old_entry
    assert not new_entry.exists()

    files = load_model_files(path, cache)
    assert files.tokenizer_dir == new_entry
    assert (new_entry / "complete").is_file()
    assert_same_weights(files.dense_weights(torch.float32), read_directly(path))
    assert not old_entry.exists()  # stale: no start reads it again
    assert (cache_entry(other, cache) / "complete").is_file()  # another file's stays


def test_an_older_cache_format_is_removed(tmp_path, monkeypatch):
    """A v4 entry held the whole model as float32: the first v5 start deletes it."""
    path = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    monkeypatch.setattr(gguf_cache, "CACHE_FORMAT", "v4")
    old = cache_entry(path, cache)
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"float32 weights")
    monkeypatch.undo()
    assert gguf_cache.CACHE_FORMAT == "v9"
    load_model_files(path, cache)
    assert [p.name for p in cache.iterdir()] == [cache_entry(path, cache).name]


def test_a_newer_cache_format_of_the_same_file_stays(tmp_path, monkeypatch):
    """Two appliance versions sharing one cache (an upgrade in another venv) must not
    delete each other's entries of an unchanged file, or each start would rewrite it;
    the newer version's entry of the file as it was before a change goes."""
    path = write_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    monkeypatch.setattr(gguf_cache, "CACHE_FORMAT", "v99")
    newer = cache_entry(path, cache)
    newer.mkdir(parents=True)
    (newer / "complete").write_text(str(path))
    stray = cache / (newer.name.rsplit("-", 3)[0] + "-notes")  # not an entry: left alone
    stray.mkdir()
    monkeypatch.undo()
    load_model_files(path, cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [cache_entry(path, cache).name, newer.name, stray.name]
    )

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    load_model_files(path, cache)  # the file changed: every entry of it as it was goes
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [cache_entry(path, cache).name, stray.name]
    )


def test_rewritten_gguf_is_not_served_stale_weights(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", seed=1)
    cache = tmp_path / "cache"
    load_model_files(path, cache).dense_weights(torch.float32)
    before = path.stat()
    write_gguf(path, seed=2)  # same size, new contents
    # Coarse file-system clocks may give the rewrite the same mtime; make it differ.
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_size == before.st_size
    files = load_model_files(path, cache)
    assert_same_weights(files.dense_weights(torch.float32), read_directly(path))


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
    load_model_files(one, cache).dense_weights(torch.float32)
    files = load_model_files(two, cache)
    assert_same_weights(files.dense_weights(torch.float32), read_directly(two))
    assert (cache_entry(one, cache) / "complete").is_file()


def test_entries_of_deleted_ggufs_are_removed_when_a_new_entry_is_written(tmp_path):
    """Each venv or clone a model is served from keys its own entry (hundreds of MB): the
    entry of a folder since deleted is removed by the next file's first start; the entry
    of a file still there stays."""
    cache = tmp_path / "cache"
    for clone in ("clone-a", "clone-b", "clone-c"):
        (tmp_path / clone).mkdir()
    gone = write_gguf(tmp_path / "clone-a" / "m.gguf")
    kept = write_gguf(tmp_path / "clone-b" / "m.gguf")
    load_model_files(gone, cache).dense_weights(torch.float32)
    load_model_files(kept, cache)
    gone_entry, kept_entry = cache_entry(gone, cache), cache_entry(kept, cache)
    gone.unlink()
    assert gone_entry.exists()  # nothing sweeps while no entry is written

    newcomer = write_gguf(tmp_path / "clone-c" / "m.gguf")
    load_model_files(newcomer, cache)
    assert not gone_entry.exists()
    assert (kept_entry / "complete").is_file()
    assert (cache_entry(newcomer, cache) / "complete").is_file()
