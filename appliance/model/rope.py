"""Rotary position embeddings (rotate-half layout), with linear and llama3 frequency scaling."""

from __future__ import annotations

import math

import torch

from appliance.model.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after any scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    if freq_factors is not None:  # GGUF's rope_freqs tensor carries llama3 scaling precomputed
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    # Between the two wavelength bounds, blend scaled and unscaled frequencies.
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """Cos/sin tables for every position up to max_positions, applied to Q and K together."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        inv_freq = inverse_frequencies(config, freq_factors)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        self.cos = freqs.cos().to(dtype=dtype, device=device)
        self.sin = freqs.sin().to(dtype=dtype, device=device)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos and sin for these positions, each [tokens, 1, head_dim // 2]: looked up once
        per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by its tokens' cos/sin (rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)  # written half by half: no temporaries, no cat
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out
