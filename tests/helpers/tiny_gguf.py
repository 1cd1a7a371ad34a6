"""A tiny tied llama GGUF written with gguf-py, and its weights read straight from the
file: shared by the model loader and GGUF cache lock tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import gguf_builder
import numpy as np
import torch
from gguf_builder import model_tensors, toy_tokenizer

from appliance.model.formats import gguf_file


def write_gguf(
    path: Path,
    *,
    seed: int = 0,
    tokenizer: bool = True,
    blocks: bool = True,
    general: dict[str, Any] | None = None,
) -> Path:
    """A tiny tied llama GGUF with a gpt2-style tokenizer that transformers can convert;
    its matrices in Q8_0 blocks (`blocks`) or float32; `general` keys as named."""
    tokenizer_keys = toy_tokenizer() if tokenizer else {}
    tensors: dict[str, Any] = dict(model_tensors(np.random.default_rng(seed), tied=True))
    if blocks:
        q8 = gguf.GGMLQuantizationType.Q8_0
        for name, array in tensors.items():
            if array.ndim == 2:
                tensors[name] = (gguf.quants.quantize(array, q8), q8)
    return gguf_builder.write_gguf(path, tensors, general=general or {}, **tokenizer_keys)


def read_directly(path: Path) -> dict[str, torch.Tensor]:
    """The file's weights as gguf_file reads them, bypassing the loader and its cache."""
    reader = gguf_file.open_gguf(path)
    config = gguf_file.read_model_config(reader, path)
    return dict(gguf_file.read_weights(path, config).items())
