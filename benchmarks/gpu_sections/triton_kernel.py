"""Section 3, triton_kernel: the Triton paged-attention kernel against float64 attention
on random data in shuffled, NaN-padded pools (decode and varlen/chunked prefill, several
head shapes and dtypes), then a decode and a chunked-prefill launch timed; and the other
Triton kernels (triton_extras: the KV handoff copy, the quantized GEMV and GEMM). On cuda:0, or
under Triton's interpreter on the CPU in the dry run."""

from __future__ import annotations

import math
import os
import random
from typing import Any

import torch

from .common import Result, verdict
from .measure import best_seconds
from .scale import KernelCase, Scale
from .triton_extras import extra_cases


def section_triton_kernel(scale: Scale) -> Result:
    """The Triton paged-attention kernel on random data in shuffled, NaN-padded pools (a
    read outside a context would show as NaN) against dense float64 attention; then a
    decode and a chunked-prefill launch timed."""
    from appliance.model.layers import triton_attention

    torch.manual_seed(0)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    cases = {
        case.name: kernel_case(triton_attention, case, scale.device) for case in scale.kernel_cases
    }
    checks = {
        f"{name}: error {row['error']:.2e} <= {row['tolerance']:.2e}": row["ok"]
        for name, row in cases.items()
    }
    extras = extra_cases(scale)  # the KV copy and the quantized products
    checks.update({f"{name}: as its reference": row["ok"] for name, row in extras.items()})
    timing = kernel_timing(triton_attention, scale)
    worst = max(cases.values(), key=lambda r: r["error"] / r["tolerance"])
    return verdict(
        checks,
        summary=f"{len(cases)} cases, worst error/tolerance "
        f"{worst['error'] / worst['tolerance']:.2f}" + (" (interpreter)" if interpreted else ""),
        interpreted=interpreted,
        cases=cases,
        extras=extras,
        timing=timing,
    )


def kernel_case(kernels: Any, case: KernelCase, device: torch.device) -> dict[str, Any]:
    """One case's largest error over 1 + |reference| (NaN counts as a failure)."""
    dtype = getattr(torch, case.dtype)
    contexts = [cached + new for cached, new in case.runs]
    lengths = [new for _, new in case.runs]
    k_cache, v_cache, tables = random_pool(contexts, case, dtype, device)
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    width = case.heads + 2 * case.kv_heads  # q as the model makes it: a fused projection's view
    q = torch.randn(starts[-1], width, case.head_dim, device=device).to(dtype)[:, : case.heads]
    scale = case.head_dim**-0.5
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    if case.varlen:
        query_starts = torch.tensor(starts, dtype=torch.int32, device=device)
        out = kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            lens,
            scale,
            query_len=max(lengths),
            query_starts=query_starts,
        )
    else:
        out = kernels.paged_attention(
            q, k_cache, v_cache, tables, lens, scale, query_len=lengths[0]
        )
    runs = list(zip(starts[:-1], lengths, contexts, strict=True))
    ref = dense_attention(q, k_cache, v_cache, tables, runs, scale)
    error = float(((out.double() - ref).abs() / (1 + ref.abs())).max())
    tolerance = kernel_tolerance(dtype, float(v_cache.nan_to_num(0).abs().max()))
    ok = math.isfinite(error) and error <= tolerance
    return {"error": error, "tolerance": tolerance, "ok": ok, "contexts": contexts}


def kernel_tolerance(dtype: torch.dtype, v_max: float) -> float:
    """Float32 runs IEEE dots and a float32 softmax; 16-bit inputs round the probabilities
    to the input dtype before the second product and the output at the end: half an ulp
    of the output plus as much of the largest |V| (as
    tests/model/layers/test_triton_attention.py)."""
    if dtype == torch.float32:
        return 1e-5
    half_ulp = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12
    return half_ulp * (2 + v_max)


def random_pool(
    contexts: list[int], case: KernelCase, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN caches [blocks, block_size, kv_heads, head_dim] with random K/V in each
    sequence's first contexts[i] slots, through shuffled block ids; tables [seqs,
    max_blocks] padded with block 0, never written."""
    bs = case.block_size
    widths = [max(1, -(-n // bs)) for n in contexts]
    num_blocks = 1 + sum(widths) + 3
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    shape = (num_blocks, bs, case.kv_heads, case.head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    tables = torch.zeros(len(contexts), max(widths), dtype=torch.int64)
    for i, (n, width) in enumerate(zip(contexts, widths, strict=True)):
        tables[i, :width] = torch.tensor(ids[:width])
        ids = ids[width:]
        slots = (tables[i, :width, None] * bs + torch.arange(bs)).flatten()[:n].to(device)
        for cache in (k_cache, v_cache):
            values = torch.randn(n, case.kv_heads, case.head_dim, device=device)
            cache.view(-1, case.kv_heads, case.head_dim)[slots] = values.to(dtype)
    return k_cache, v_cache, tables.to(device)


def dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    runs: list[tuple[int, int, int]],
    scale: float,
) -> torch.Tensor:
    """Float64 causal attention; runs are (first row, query tokens, context tokens)."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i, (start, length, context) in enumerate(runs):
        pos = torch.arange(context, device=q.device)
        slots = tables[i, pos // block_size] * block_size + pos % block_size
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("lhd,chd->hlc", q[start : start + length].double(), k) * scale
        q_pos = torch.arange(context - length, context, device=q.device)
        hidden = pos[None, :] > q_pos[:, None]  # causal: later keys hidden
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[start : start + length] = torch.einsum("hlc,chd->lhd", probs, v)
    return out


def kernel_timing(kernels: Any, scale: Scale) -> dict[str, Any]:
    """A decode launch (8B-model heads, mixed contexts) and a 512-row chunk after a long
    prefix, timed (under the interpreter: tiny, and no measure of speed)."""
    device, dtype = scale.device, torch.bfloat16
    batch, longest, prefix, chunk = (64, 4096, 4096, 512) if scale.cuda else (2, 64, 32, 16)
    rng = random.Random(1)
    decode = KernelCase("t", "bfloat16", 32, 8, 128, 16, (), False)
    contexts = [rng.randint(1, longest) for _ in range(batch)]
    k_cache, v_cache, tables = random_pool(contexts, decode, dtype, device)
    q = torch.randn(batch, 32, 128, device=device, dtype=dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    repeats = scale.repeats if scale.cuda else 1
    seconds = best_seconds(
        lambda: kernels.paged_attention(q, k_cache, v_cache, tables, lens, 128**-0.5),
        device,
        repeats,
    )
    kv_bytes = sum(contexts) * 8 * 128 * 2 * 2  # K and V, bfloat16
    k2, v2, t2 = random_pool([prefix + chunk], decode, dtype, device)
    q2 = torch.randn(chunk, 32, 128, device=device, dtype=dtype)
    lens2 = torch.tensor([prefix + chunk], dtype=torch.int32, device=device)
    chunk_s = best_seconds(
        lambda: kernels.paged_attention(q2, k2, v2, t2, lens2, 128**-0.5, query_len=chunk),
        device,
        repeats,
    )
    flops = 4 * 32 * 128 * chunk * (prefix + chunk / 2)  # QK^T and PV, causal in the chunk
    return {
        "decode": {"batch": batch, "context_tokens": sum(contexts), "us": round(seconds * 1e6, 1),
                   "kv_gb_per_s": round(kv_bytes / seconds / 1e9, 1)},
        "chunk": {"queries": chunk, "prefix": prefix, "us": round(chunk_s * 1e6, 1),
                  "tflops": round(flops / chunk_s / 1e12, 2)},
    }  # fmt: skip
