"""Decode attention kernels on this machine: three ways to attend one query token per
sequence over its gathered K/V.

- SDPA, query heads as heads: q [decodes, heads, 1, head_dim] with `enable_gqa`.
- SDPA, query heads grouped: q [decodes, kv_heads, heads / kv_heads, head_dim], the query
  heads that share a KV head taken as that head's query rows (no mask between them), so
  the kernel sees plain multi-head attention with a few query rows.
- Two batched matmuls with a float32 softmax between them.

K/V are gathered as the decode path gathers them: whole blocks by index_select out of a
paged pool, then viewed [decodes, kv_heads, ctx, head_dim] (not contiguous). Prints the
microseconds of one layer, per batch size, context and dtype, and each against the
grouped SDPA, the kernel appliance/model/attention.py uses.

Run from the repository root: .venv/bin/python benchmarks/attention_bench.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timing import best_seconds

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
BLOCK = 16


def case(decodes: int, ctx: int, dtype: torch.dtype) -> tuple[float, float, float]:
    blocks = ctx // BLOCK
    pool = torch.randn(decodes * blocks + 8, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    tables = torch.randperm(pool.shape[0])[: decodes * blocks].view(decodes, blocks)
    q = torch.randn(decodes, HEADS, HEAD_DIM, dtype=dtype)
    lengths = torch.randint(ctx // 2, ctx + 1, (decodes,))
    padding = (torch.arange(ctx)[None, :] >= lengths[:, None])[:, None, None, :]

    def gathered() -> tuple[torch.Tensor, torch.Tensor]:
        k = pool.index_select(0, tables.flatten()).view(decodes, ctx, KV_HEADS, HEAD_DIM)
        v = pool.index_select(0, tables.flatten()).view(decodes, ctx, KV_HEADS, HEAD_DIM)
        return k.transpose(1, 2), v.transpose(1, 2)

    def sdpa_heads() -> torch.Tensor:
        k, v = gathered()
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=~padding, enable_gqa=True
        )

    def sdpa_grouped() -> torch.Tensor:
        k, v = gathered()
        grouped = q.view(decodes, KV_HEADS, -1, HEAD_DIM)
        return F.scaled_dot_product_attention(grouped, k, v, attn_mask=~padding)

    def matmuls() -> torch.Tensor:
        k, v = gathered()
        grouped = q.view(decodes, KV_HEADS, -1, HEAD_DIM)
        scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * HEAD_DIM**-0.5
        scores = scores.masked_fill(padding, float("-inf"))
        return torch.matmul(scores.softmax(-1).to(dtype), v)

    return tuple(best_seconds(f) * 1e6 for f in (sdpa_grouped, sdpa_heads, matmuls))


def main() -> None:
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(
        "| decodes | ctx | dtype | SDPA grouped (us) | SDPA heads (us) | matmuls (us) "
        "| heads / grouped | matmuls / grouped |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for decodes, ctx in [(1, 64), (1, 1024), (8, 256), (32, 64), (32, 1024)]:
        for dtype in (torch.float32, torch.bfloat16):
            grouped, heads, mm = case(decodes, ctx, dtype)
            name = str(dtype).removeprefix("torch.")
            print(
                f"| {decodes} | {ctx} | {name} | {grouped:.0f} | {heads:.0f} | {mm:.0f} "
                f"| {heads / grouped:.2f}x | {mm / grouped:.2f}x |"
            )


if __name__ == "__main__":
    main()
