"""A draft's weight bytes (speculative/draft_loading.weight_bytes, what a GPU draft's
weights take from the target's pool): a draft kept in GGUF blocks counts its blocks,
which are no parameters, and the table its tied head shares with the embedding once."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
from tiny_gguf import write_gguf

from appliance.engine.speculative.draft_loading import build_draft, weight_bytes
from appliance.model.loader import load_model_files
from appliance.model.quant import QuantEmbedding, QuantLinear
from appliance.settings.config import load_settings


def test_a_block_draft_counts_its_files_tensors_once(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "draft.gguf")  # tied, its matrices in Q8_0 blocks
    files = load_model_files(path, tmp_path / "cache")
    settings = load_settings(dtype="float32", device="cpu", weights="auto")
    model = build_draft(settings, files, torch.device("cpu"), 64)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert isinstance(model.lm_head, QuantLinear)  # the embedding's blocks, not a copy
    # Every tensor of the file, in the bytes it is stored in (blocks, float32 norms).
    stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert weight_bytes(model) == stored + buffers
