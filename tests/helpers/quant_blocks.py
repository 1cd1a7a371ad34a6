"""Random GGUF quant blocks of each format, with sane half-float scales, for the quant
and quant GEMM tests."""

from __future__ import annotations

import numpy as np

from appliance.model.quant import FORMATS

# Where each format keeps its half-float scales (d, and dmin or m): random bytes there
# could be NaN or huge; everything else may be any byte.
HALF_FLOATS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def random_blocks(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """`rows` rows of `k` values in format `name`'s blocks: random bytes, small scales."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // fmt.values, fmt.bytes), dtype=np.uint8)
    for offset in HALF_FLOATS[name]:
        scales = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        raw[:, :, offset : offset + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(rows, -1)
