"""Sliding windows in the attention kernels: the compiled CPU decode kernel and the Triton
kernel (under Triton's interpreter) read only each query's last `window` keys, itself
included, as SDPA masked the same way does. (Mistral's, Gemma 3's and gpt-oss's windows
end to end: tests/model/families/test_conformance.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from appliance.model import cpu_kernels
from appliance.model.layers.paged_attention import DecodeGroup, sdpa_decode


def _windowed_problem(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Caches in shuffled blocks of 16 and one query per sequence, viewed out of a wider
    row as the model's q is."""
    gen = torch.Generator().manual_seed(len(lens) + head_dim)
    width = max(-(-n // 16) for n in lens)
    blocks = len(lens) * width + 3
    k_cache = torch.randn(blocks, 16, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, 16, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen).to(dtype)
    return qk[:, :heads], k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built")
@pytest.mark.parametrize("window", [1, 5, 16, 24, 33, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_reads_only_the_window(window: int, dtype: torch.dtype) -> None:
    """The compiled decode attention at every level this CPU runs, against SDPA masked to
    the window, with contexts around block edges and the window's."""
    problems = [
        _windowed_problem([1, 15, 16, 17, 24, 25, 33, 100], 9, 3, 64, dtype),
        _windowed_problem([64, 130, 5], 32, 8, 128, dtype),
    ]
    before = cpu_kernels.level()
    try:
        for level in cpu_kernels.cpu_levels():
            cpu_kernels.select(level)
            for q, k_cache, v_cache, tables, lens in problems:
                keys = torch.arange(tables.shape[1] * 16)
                visible = (keys[None, :] < lens[:, None])[:, None, None, :]
                group = DecodeGroup(None, tables, visible, lens)
                want = sdpa_decode(q.contiguous(), k_cache, v_cache, group, 0.125, window)
                got = cpu_kernels.paged_decode(
                    q, k_cache, v_cache, tables, lens, 0.125, window=window
                )
                tolerance = 1e-5 if dtype == torch.float32 else 8e-3
                torch.testing.assert_close(
                    got.float(), want.float(), atol=tolerance, rtol=tolerance
                )
    finally:
        cpu_kernels.select(before or "auto")


# Run by a child Python with TRITON_INTERPRET=1 (set before triton is imported: see
# tests/model/layers/test_triton_attention.py): the Triton kernel with a window against float64 SDPA
# masked the same way; prints each case's largest error over 1 + |reference|.
_TRITON_CHILD = r"""
import json
import torch
from appliance.model.layers.triton_attention import paged_attention

def case(runs, window, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, bs = 6, 2, 64, 16
    lens = [cached + new for cached, new in runs]
    width = max(-(-n // bs) for n in lens)
    blocks = len(runs) * width + 2
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: len(runs) * width].view(len(runs), width)
    news = [new for _, new in runs]
    q = torch.randn(sum(news), heads, dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
    got = paged_attention(
        q, k_cache, v_cache, tables, torch.tensor(lens), 0.125, query_len=max(news),
        query_starts=starts, window=window,
    )
    worst = 0.0
    for i, (cached, new) in enumerate(runs):
        keys = lambda c: c.index_select(0, tables[i]).flatten(0, 1)[: lens[i]].double()
        k, v = keys(k_cache), keys(v_cache)  # [len, kv_heads, dim]
        rows = q[starts[i] : starts[i + 1]].double()  # [new, heads, dim]
        q_pos = torch.arange(cached, cached + new)[:, None]
        k_pos = torch.arange(lens[i])[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        want = torch.nn.functional.scaled_dot_product_attention(
            rows.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            scale=0.125, enable_gqa=True,
        ).transpose(0, 1)
        error = (got[starts[i] : starts[i + 1]].double() - want).abs() / (1 + want.abs())
        worst = max(worst, error.nan_to_num(nan=float("inf")).max().item())  # NaN: a failure
    return worst

decodes = [(0, 1), (15, 1), (16, 1), (23, 1), (24, 1), (69, 1), (138, 1)]
chunks = [(0, 33), (37, 20), (64, 5), (3, 90), (130, 1)]
out = {}
for window in (1, 5, 24, 64, 100):
    out[f"decode_w{window}"] = case(decodes, window, torch.float32, window)
    out[f"chunks_w{window}"] = case(chunks, window, torch.float32, window + 1)
out["decode_w24_bf16"] = case(decodes, 24, torch.bfloat16, 7)
print(json.dumps(out))
"""


@pytest.mark.process  # a child Python under Triton's interpreter
def test_the_triton_kernel_reads_only_the_window() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"the interpreter child failed:\n{proc.stderr[-4000:]}"
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, error in errors.items():
        assert error < (1e-2 if "bf16" in name else 1e-5), (name, error)
