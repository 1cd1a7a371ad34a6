"""Decode attention kernels on this machine: SDPA against two batched matmuls.

Why appliance/model/attention.py's decode path uses matmuls: prints, per batch size,
context length and dtype, the microseconds of one layer's decode attention (the same
[decodes, kv_heads, ctx, head_dim] gathered K/V, one query token each) and the ratio.

Run from the repository root: .venv/bin/python benchmarks/attention_bench.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timing import best_seconds

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def case(decodes: int, ctx: int, dtype: torch.dtype) -> tuple[float, float]:
    q = torch.randn(decodes, HEADS, HEAD_DIM, dtype=dtype)
    k = torch.randn(decodes, ctx, KV_HEADS, HEAD_DIM, dtype=dtype).transpose(1, 2)
    v = torch.randn(decodes, ctx, KV_HEADS, HEAD_DIM, dtype=dtype).transpose(1, 2)
    lengths = torch.randint(ctx // 2, ctx + 1, (decodes,))
    padding = (torch.arange(ctx)[None, :] >= lengths[:, None])[:, None, None, :]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=~padding, enable_gqa=True
        )

    def matmuls() -> torch.Tensor:
        grouped = q.view(decodes, KV_HEADS, -1, HEAD_DIM)
        scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * HEAD_DIM**-0.5
        scores = scores.masked_fill(padding, float("-inf"))
        return torch.matmul(scores.softmax(-1).to(dtype), v)

    return best_seconds(sdpa) * 1e6, best_seconds(matmuls) * 1e6


def main() -> None:
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| decodes | ctx | dtype | SDPA (us) | matmuls (us) | SDPA / matmuls |")
    print("|---:|---:|---|---:|---:|---:|")
    for decodes, ctx in [(1, 64), (1, 1024), (32, 64), (32, 1024)]:
        for dtype in (torch.float32, torch.bfloat16):
            sdpa, mm = case(decodes, ctx, dtype)
            name = str(dtype).removeprefix("torch.")
            print(f"| {decodes} | {ctx} | {name} | {sdpa:.0f} | {mm:.0f} | {sdpa / mm:.2f}x |")


if __name__ == "__main__":
    main()
