"""The compiled CPU kernels (appliance/model/cpu_kernels/) against the torch ops they
replace, on this machine, at SmolLM2-135M's sizes:

- decode attention: one query token per sequence over a paged pool with shuffled block
  tables and ragged contexts, in one layer's pool (cached after the first call) and in
  30 layers' pools (as a model's step reads them: from memory). The kernel reads the
  pool in place; the torch path (`attention.sdpa_decode`, used on GPUs and where the
  kernel is not built) gathers each sequence's blocks, pads them and runs SDPA with the
  query heads that share a KV head as its query rows.
- the residual add and the RMSNorm after it, as each decoder layer runs them twice:
  the kernel in one pass against `residual + x` then `F.rms_norm`.
- the rotary embedding of a step's queries and keys and the store of its keys and
  values in their cache slots: the kernel in one pass against `rope.apply_rope` and
  `attention.write_kv`.
- the quantized products (csrc/quant_matmul.c) of one layer's projections (Q4_1, as the
  embedded model's file has them) and of the tied head (Q8_0), by activation rows: a
  decode step's 1, a verify step's 1 + k, a 16-stream batch's 16. The kernel unpacks each
  weight group once per tile of rows (6 on AVX-512, 4 on AVX2), so what a row beyond the
  first costs is the table's point: CPU time of this thread, the box may be loaded.

Prints microseconds per call (best of 30) and the largest difference between the two.
Run from the repository root: .venv/bin/python benchmarks/cpu_kernels_bench.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from timing import best_seconds

from appliance.model import cpu_kernels
from appliance.model.layers.paged_attention import DecodeGroup, sdpa_decode, write_kv
from appliance.model.layers.rotary import apply_rope
from appliance.model.quant import FORMATS

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 9, 3, 64, 576  # SmolLM2-135M
# (format, out, in) of one layer's projections and the head, SmolLM2-135M's file
PRODUCTS = {
    "qkv_proj": ("Q4_1", 960, 576),
    "o_proj": ("Q4_1", 576, 576),
    "gate_up_proj": ("Q4_1", 3072, 576),
    "down_proj": ("Q4_1", 576, 1536),
    "logits": ("Q8_0", 49152, 576),
}
PRODUCT_ROWS = (1, 2, 3, 4, 5, 8, 9, 16)
BLOCK = 16
EPS = 1e-5


def decode_case(
    decodes: int, ctx: int, layers: int, dtype: torch.dtype
) -> tuple[float, float, float]:
    """(kernel us, SDPA us, max abs difference) for `decodes` contexts of ctx/2..ctx, in
    each of `layers` pools: past a few layers the pools outgrow the caches, as a model's
    do, and the reads come from memory."""
    width = ctx // BLOCK
    pools = []
    for _ in range(layers):
        k_pool = torch.randn(decodes * width + 8, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
        pools.append((k_pool, torch.randn_like(k_pool)))
    tables = torch.randperm(pools[0][0].shape[0])[: decodes * width].view(decodes, width)
    lens = torch.randint(ctx // 2, ctx + 1, (decodes,))
    visible = (torch.arange(width * BLOCK)[None, :] < lens[:, None])[:, None, None, :]
    group = DecodeGroup(None, tables, visible, lens)
    q = torch.randn(decodes, HEADS, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM**-0.5

    def kernel() -> torch.Tensor:
        for k_pool, v_pool in pools:
            out = cpu_kernels.paged_decode(q, k_pool, v_pool, tables, lens, scale)
        return out

    def sdpa() -> torch.Tensor:
        for k_pool, v_pool in pools:
            out = sdpa_decode(q, k_pool, v_pool, group, scale)
        return out

    diff = (kernel().float() - sdpa().float()).abs().max().item()
    return best_seconds(kernel) * 1e6, best_seconds(sdpa) * 1e6, diff


def norm_case(rows: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """(kernel us, torch us, max abs difference) of one residual add + RMSNorm."""
    x = torch.randn(rows, HIDDEN, dtype=dtype)
    start = torch.randn(rows, HIDDEN, dtype=dtype)
    weight = torch.rand(HIDDEN, dtype=dtype) + 0.5

    def kernel() -> torch.Tensor:
        return cpu_kernels.add_rms_norm(x, start.clone(), weight, EPS)[0]

    def torch_ops() -> torch.Tensor:
        residual = start.clone() + x
        return F.rms_norm(residual, (HIDDEN,), weight, EPS)

    diff = (kernel().float() - torch_ops().float()).abs().max().item()
    return best_seconds(kernel) * 1e6, best_seconds(torch_ops) * 1e6, diff


def rope_case(tokens: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """(kernel us, torch us, max abs difference of the rotated q/k) of one layer's rotation
    and K/V store."""
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=dtype)
    angles = torch.rand(tokens, HEAD_DIM // 2) * 100
    cos, sin = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]
    k_cache = torch.zeros(tokens // BLOCK + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * BLOCK)[:tokens]
    qk = HEADS + KV_HEADS

    def kernel() -> torch.Tensor:
        rotated = qkv.clone()  # rotated in place: each call starts from the same values
        cpu_kernels.rope_store(rotated, cos, sin, slots, k_cache, v_cache, HEADS)
        return rotated[:, :qk]

    def torch_ops() -> torch.Tensor:
        rotated = apply_rope(qkv.clone()[:, :qk], cos, sin)
        write_kv(k_cache, v_cache, rotated[:, HEADS:], qkv[:, qk:], slots)
        return rotated

    diff = (kernel().float() - torch_ops().float()).abs().max().item()
    return best_seconds(kernel) * 1e6, best_seconds(torch_ops) * 1e6, diff


def random_blocks(name: str, rows: int, k: int) -> torch.Tensor:
    """`rows` rows of `k` values in Q4_1 or Q8_0 blocks: random values, small half-float
    scale d (and, Q4_1, offset m) at the front of each block."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, k // fmt.values, fmt.bytes), dtype=np.uint8)
    for offset in (0, 2) if name == "Q4_1" else (0,):
        halves = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        raw[:, :, offset : offset + 2] = halves[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))  # [rows, k / values * bytes]


def cpu_best(fn: Callable[[], object], repeats: int) -> float:
    """The least CPU time of this thread over `repeats` calls after a warm-up: on a shared
    box it moves less than wall time."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def products_table() -> None:
    """Each product's CPU microseconds by rows (precise activations, as a model's), and
    its cost over one row's."""
    print(f"\nQuantized products by rows, level {cpu_kernels.level()} (us CPU; x: over 1 row)")
    print("| product | format | " + " | ".join(str(m) for m in PRODUCT_ROWS) + " |")
    print("|---|---|" + "---:|" * len(PRODUCT_ROWS))
    for name, (fmt, n, k) in PRODUCTS.items():
        matrix = cpu_kernels.QuantMatrix(random_blocks(fmt, n, k), FORMATS[fmt].ggml_id, k)
        times = []
        for m in PRODUCT_ROWS:
            x = torch.randn(m, k)
            times.append(cpu_best(lambda x=x, w=matrix: w(x, None, True), 30 if n < 10000 else 10))
        cells = " | ".join(f"{t * 1e6:.0f} ({t / times[0]:.2f}x)" for t in times)
        print(f"| {name} | {fmt} | {cells} |")


def table(
    title: str,
    size_names: tuple[str, ...],
    torch_ops: str,
    sizes: list[tuple[int, ...]],
    case: Callable[..., tuple[float, float, float]],
    digits: int,
) -> None:
    """One markdown table: `case(*size, dtype)` per size and dtype, kernel beside torch."""
    print(f"\n{title}")
    names = " | ".join(size_names)
    print(f"| {names} | dtype | kernel (us) | {torch_ops} (us) | speed-up | max diff |")
    print("|" + "---:|" * len(size_names) + "---|---:|---:|---:|---:|")
    for size in sizes:
        for dtype in (torch.float32, torch.bfloat16):
            ours, theirs, diff = case(*size, dtype)
            cells = " | ".join(str(n) for n in size)
            print(
                f"| {cells} | {str(dtype).removeprefix('torch.')} | {ours:.{digits}f} "
                f"| {theirs:.{digits}f} | {theirs / ours:.2f}x | {diff:.1e} |"
            )


def main() -> None:
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are not built: install a C compiler, re-run ./install.sh")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    products_table()
    table(
        "Decode attention: one layer, or 30 layers' pools (beyond the caches, as a model's)",
        ("decodes", "ctx", "layers"),
        "gather + SDPA",
        [(1, 64, 1), (1, 1024, 1), (8, 256, 1), (8, 320, 30), (32, 64, 1), (32, 1024, 1)],
        decode_case,
        0,
    )
    table(
        "Residual add + RMSNorm, one call (each layer makes two)",
        ("rows",),
        "add + F.rms_norm",
        [(1,), (32,), (1024,)],
        norm_case,
        1,
    )
    table(
        "Rotary embedding + K/V store, one layer (each call copies qkv first, both sides)",
        ("tokens",),
        "apply_rope + write_kv",
        [(1,), (32,), (1024,)],
        rope_case,
        1,
    )


if __name__ == "__main__":
    main()
