"""The on-disk cache of what a GGUF file converts to, one entry per file keyed by its
path, size and mtime: its converted tokenizer and facts, so the serve process reads no
weight at all (and imports no torch: the weight reader is imported only to check a file
seen for the first time); the entry also holds the dense weights gguf_dense_cache.py
writes."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from appliance.model.errors import ModelLoadError
from appliance.model.model_config import ModelConfig
from appliance.model.sampling_defaults import gguf_generation_config

log = logging.getLogger("appliance.model")

# Bump when what a cache entry holds changes. v5: tokenizer and facts, and weights per
# dtype (v4 held every weight as float32). v6: the facts hold q/k norms and the sliding
# window (a v5 entry would read them as absent: a windowed model served without its window).
# v7: the stop ids include the GGUF's end-of-turn and end-of-message tokens.
# v8: the facts hold Gemma 3's layer kinds, local RoPE base, score scale and logit cap.
# v9: the file's recommended sampling (general.sampling.*) as a generation_config.json.
CACHE_FORMAT = "v9"


def cache_entry(path: Path, cache_dir: Path) -> Path:
    """The cache folder for one GGUF file, keyed by its path, size and mtime."""
    stat = path.stat()
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    return cache_dir / f"{path.stem}-{where}-{stat.st_size}-{stat.st_mtime_ns}-{CACHE_FORMAT}"


def gguf_entry(path: Path, cache_dir: Path) -> Path:
    """The GGUF's cache entry (its facts and converted tokenizer), written if missing."""
    entry = cache_entry(path, cache_dir)
    if not (entry / "complete").is_file():
        log.info(
            "first start with %s: checking its tensors and converting its tokenizer "
            "(about 15 s; later starts read the result from %s)...",
            path.name,
            entry.parent,
        )
        _write_entry(path, entry)
    return entry


def cached_config(entry: Path) -> ModelConfig:
    """The model's facts, as the entry holds them."""
    return ModelConfig.from_dict(json.loads((entry / "model_config.json").read_text()))


def _write_entry(path: Path, entry: Path) -> None:
    """Check the file (metadata, every tensor's name, type and extent), convert its
    tokenizer and write its facts: into a folder beside the entry, then renamed, so a
    crash never leaves half an entry. Older entries of the same file go."""
    from appliance.model.formats import gguf_file  # the weight reader, torch with it

    reader = gguf_file.open_gguf(path)
    config = gguf_file.read_model_config(reader, path)
    gguf_file.read_weights(path, config)  # refuses a tensor it could not read, now
    staging = entry.with_name(entry.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        convert_gguf_tokenizer(path, staging)
        (staging / "model_config.json").write_text(json.dumps(config.to_dict()))
        sampling = gguf_generation_config(gguf_file.metadata(reader))
        if sampling:  # read as a folder's is (sampling_defaults.py)
            (staging / "generation_config.json").write_text(json.dumps(sampling))
        (staging / "complete").write_text(str(path.resolve()))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if entry.exists() and not (entry / "complete").is_file():
        shutil.rmtree(entry, ignore_errors=True)
    try:
        staging.rename(entry)
    except OSError:  # another process wrote it first
        shutil.rmtree(staging, ignore_errors=True)
        if not (entry / "complete").is_file():
            raise
    _remove_stale_entries(entry)
    _remove_orphaned_entries(entry.parent)


def _remove_orphaned_entries(cache_dir: Path) -> None:
    """Delete the entries whose GGUF file is gone: each venv, clone or temporary folder
    a model was served from keys its own entry (hundreds of MB of cached weights), and
    nothing else would ever remove the entry of a folder since deleted. Swept only when
    a new entry is written, so a start that finds its entry pays nothing."""
    for other in cache_dir.iterdir():
        marker = other / "complete"
        if ".tmp" in other.name or not marker.is_file():
            continue
        try:
            source = Path(marker.read_text())
        except OSError:  # removed by another process meanwhile
            continue
        if source.is_absolute() and not source.exists():
            shutil.rmtree(other, ignore_errors=True)


def _remove_stale_entries(entry: Path) -> None:
    """Delete the entries of the same file at another size or mtime, and those of an
    older cache format: no start reads them again (a v4 entry held the whole model as
    float32). An entry of a newer format stays: a newer appliance sharing this cache
    (another venv, an upgrade tried and rolled back) reads it, and deleting it would
    have the two versions rewrite the file's entry at each other's every start."""
    key, stat, _ = _entry_name_parts(entry.name)
    for other in entry.parent.glob(glob.escape(key) + "-*"):
        if other == entry or ".tmp" in other.name:
            continue
        other_key, other_stat, other_format = _entry_name_parts(other.name)
        if other_key != key:
            continue
        if other_stat == stat and _format_number(other_format) > _format_number(CACHE_FORMAT):
            continue
        shutil.rmtree(other, ignore_errors=True)


def _entry_name_parts(name: str) -> tuple[str, tuple[str, ...], str]:
    """A cache_entry name's "<stem>-<path hash>", its (size, mtime) and its format; a
    name of another form (fewer parts) has a key no entry has."""
    parts = name.rsplit("-", 3)
    if len(parts) < 4:
        return name, (), ""
    return parts[0], (parts[1], parts[2]), parts[3]


def _format_number(name: str) -> int:
    """The number of a cache format's name ("v9" -> 9); 0 for a name not of that form."""
    return int(name[1:]) if name[:1] == "v" and name[1:].isdigit() else 0


def convert_gguf_tokenizer(path: Path, out_dir: Path) -> None:
    """Turn the GGUF's tokenizer metadata and chat template into tokenizer.json files."""
    from transformers import AutoTokenizer

    from appliance.model.formats import gguf_file

    source, scratch = path, out_dir / "metadata-only"
    if gguf_file.metadata(gguf_file.open_gguf(path)).get("general.architecture") == "gpt-oss":
        # transformers (5.25) reads each gpt-oss.rope.scaling.* value as its key's length
        # and fails under numpy 2: the tokenizer converts from a copy of the metadata
        # without them (no tensor: a few MB).
        scratch.mkdir()
        source = scratch / path.name
        copy_metadata(path, source, drop=".rope.scaling.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as exc:  # transformers raises several kinds for unknown tokenizers
        raise ModelLoadError(path, f"cannot convert its tokenizer ({exc})") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tokenizer.save_pretrained(str(out_dir))


def copy_metadata(path: Path, target: Path, drop: str) -> None:
    """A GGUF of `path`'s metadata, less the keys holding `drop`, and no tensor."""
    from gguf import GGUFValueType, GGUFWriter

    from appliance.model.formats import gguf_file

    reader = gguf_file.open_gguf(path)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)  # writes general.architecture itself
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or drop in key:
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
