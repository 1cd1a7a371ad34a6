"""The dense weights of a block-quantized GGUF, per dtype a dense model loads them in
(matrices in that dtype, vectors in float32): written into the file's cache entry
(gguf_cache.py) in small pieces by the first worker that needs them, so later starts
only map that file."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from filelock import FileLock

from appliance.model.formats import gguf_file, safetensors_file

log = logging.getLogger("appliance.model")


def cached_weights(
    weights: gguf_file.GGUFWeights, entry: Path, dtype: torch.dtype
) -> Mapping[str, torch.Tensor]:
    """The GGUF's weights for a dense model of `dtype`, mapped from the entry's file for
    that dtype: written the first time (by one process at a time; others wait for it,
    then map it). Where the cache cannot be written, `weights` themselves (dequantized
    again at every start)."""
    target = entry / f"weights-{str(dtype).removeprefix('torch.')}.safetensors"
    try:
        if not target.is_file():
            with exclusive(target.with_name(target.name + ".lock")):
                if not target.is_file():
                    _write_dense(weights, target, dtype)
    except OSError as exc:
        log.warning(
            "cannot cache %s in %s (%s): it is read from the file", weights.path, entry, exc
        )
        return weights
    return safetensors_file.read_safetensors(target)


def _write_dense(weights: gguf_file.GGUFWeights, target: Path, dtype: torch.dtype) -> None:
    """Dequantize every weight into `target`, saying so: a large model takes minutes."""
    name = str(dtype).removeprefix("torch.")
    log.info(
        "converting %s to dense %s weights, once (later starts map %s)...",
        weights.path.name,
        name,
        target,
    )
    began = time.monotonic()
    layout = {n: cached_layout(weights.shape(n), dtype) for n in weights}
    pieces = weights.pieces(layout, _threads())
    safetensors_file.write_safetensors(target, layout, pieces)
    size = target.stat().st_size / 2**30
    log.info("dense %s weights written in %.1f s (%.2f GiB)", name, time.monotonic() - began, size)


def cached_layout(
    shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype]:
    """How the cache stores a tensor: matrices in the model's dtype, vectors (norms,
    biases, RoPE factors: a few KB) in float32, as exact as the file."""
    return shape, dtype if len(shape) >= 2 else torch.float32


def _threads() -> int:
    """Threads to dequantize with: this process's cores, up to 8 (each keeps a few pieces
    of heap when done: glibc's arenas)."""
    return min(8, len(os.sched_getaffinity(0)))


def exclusive(lock: Path) -> FileLock:
    """Held by one process at a time, used as `with exclusive(path):` (filelock's lock on
    `lock`: flock where the filesystem has it, else a marker file; the others wait for it,
    with no timeout). Raises OSError where `lock` cannot be created."""
    return FileLock(lock)
