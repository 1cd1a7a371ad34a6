"""Rotary position embeddings (rotate-half layout), with linear, llama3, LongRoPE and
YaRN frequency scaling, over whole heads or their first `rotary_dim` dimensions."""

from __future__ import annotations

import math

import torch

from appliance.model.model_config import ModelConfig


def inverse_frequencies(
    config: ModelConfig, freq_factors: torch.Tensor | None, max_positions: int = 0
) -> torch.Tensor:
    """[rotary dims // 2] float32 inverse frequencies after any scaling (LongRoPE's for
    a model run up to `max_positions`: see longrope_factors)."""
    dim = config.rotary_dim or config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "longrope":  # as transformers' _compute_longrope_parameters computes them
        factors = torch.tensor(longrope_factors(scaling, max_positions), dtype=torch.float32)
        return 1.0 / (factors * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if kind == "yarn":
        return _yarn(inv_freq, scaling, dim, config.rope_theta)
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


def _yarn(inv_freq: torch.Tensor, scaling: dict, dim: int, base: float) -> torch.Tensor:
    """YaRN's frequencies, as transformers' _compute_yarn_parameters computes them: each
    pair's blend of the unscaled frequency (fast-turning pairs, past beta_fast turns over
    the pretraining length) and the one divided by `factor` (slow ones, under beta_slow),
    a linear ramp between; `truncate` (default true) widens the ramp to whole pairs."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def pair(turns: float) -> float:  # the pair that turns `turns` times over `original`
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = (
        pair(float(scaling.get("beta_fast") or 32)),
        pair(float(scaling.get("beta_slow") or 1)),
    )
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero, as transformers
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # [dim // 2]: 1 keeps a pair's own frequency
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def longrope_factors(scaling: dict, max_positions: int) -> list[float]:
    """LongRoPE's long factors where the engine runs the model past the length it was
    pretrained at (`max_positions`, its max_model_len, above original_max_position_embeddings),
    else its short ones; as vLLM and llama.cpp (by context size) choose.

    transformers chooses per forward call instead (long once the sequence passes the
    pretraining length, short before), so a sequence that grows past it there has keys
    cached under the short factors and queries under the long. A paged cache shared by
    sequences of every length cannot: one choice for the whole engine keeps every cached
    key consistent. Both answer alike wherever transformers stays on one side: any
    sequence within the pretraining length on an engine whose max_model_len is within it
    too, and any prompt already past it on an engine whose max_model_len is past it."""
    long = max_positions > int(scaling["original_max_position_embeddings"])
    return [float(f) for f in scaling["long_factor" if long else "short_factor"]]


def attention_factor(config: ModelConfig) -> float:
    """The factor LongRoPE and YaRN multiply cos and sin by (so q.k by its square): the
    scaling's `attention_factor` (a GGUF's rope.scaling.attn_factor); else for LongRoPE
    sqrt(1 + ln(s) / ln(original length)) for s = max_position_embeddings / original
    length (or its `factor`), 1 where s <= 1; for YaRN 0.1 ln(factor) + 1 (or mscale's
    ratio, as transformers' yarn_get_mscale), 1 where factor <= 1; 1 for every other kind."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "yarn":
        return _yarn_attention_factor(scaling)
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or config.max_position_embeddings / original)
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0


def _yarn_attention_factor(scaling: dict) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float) -> float:
        return 0.1 * scale * math.log(factor) + 1.0 if factor > 1 else 1.0

    top, bottom = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(float(top)) / mscale(float(bottom)) if top and bottom else mscale(1.0)


class RotaryEmbedding:
    """Cos/sin tables for every position up to max_positions, applied to Q and K together.

    A model that turns only `rotary_dim` of each head's dimensions (partial RoPE) has its
    Q/K rows reordered at load (families/phi3.py) so that the turned ones pair as a whole
    head's would; the pairs left are given cos 1, sin 0, which leave them as they are."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        inv_freq = inverse_frequencies(config, freq_factors, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary dims // 2]
        scale = attention_factor(config)
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        unturned = config.head_dim // 2 - inv_freq.shape[0]
        if unturned:  # partial RoPE: the pairs past the turned ones stay as they are
            cos = torch.cat([cos, torch.ones(max_positions, unturned)], dim=1)
            sin = torch.cat([sin, torch.zeros(max_positions, unturned)], dim=1)
        self.cos = cos.to(dtype=dtype, device=device)  # [max_positions, head_dim // 2]
        self.sin = sin.to(dtype=dtype, device=device)

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
