"""KV handoff cost: bytes moved, copy time and bandwidth against a plain tensor copy of the
same size, and the end-to-end handoff inside a running 1P+1D appliance against its TTFT.

Run from the repository root: .venv/bin/python benchmarks/handoff_bench.py [--dtype D]

1. copy: `copy_blocks` from a shared-memory pool (as a prefill worker's is) into another
   pool, for the blocks of a 128 / 1k / 4k-token prompt (SmolLM2's layout), best of N,
   beside `dst.copy_(src)` of one contiguous tensor with the same number of bytes; with
   fresh pools, with pools after random request churn (the block ids the allocator then
   hands out), and in the worst case (every source block apart from its neighbours).
2. end to end: one request at a time through a real 1P+1D appliance; handoff = from the
   supervisor seeing the first token to the decode worker reporting the blocks copied
   (messages both ways included), TTFT = arrival to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import random

import torch
from timing import best_seconds

from appliance.api import Appliance
from appliance.engine.sequence import SamplingParams
from appliance.kv.block_allocator import BlockAllocator, blocks_for_tokens
from appliance.kv.cache import KVCache, KVLayout
from appliance.kv.handoff import copy_blocks
from appliance.settings.config import load_settings

LENGTHS = (128, 1024, 4096)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def copy_table(dtype: torch.dtype) -> list[str]:
    layout = KVLayout(30, 16, 3, 64, dtype)  # SmolLM2-135M
    src = KVCache(layout, 600, torch.device("cpu"), shared=True)
    dst = KVCache(layout, 600, torch.device("cpu"))
    rows = [
        "| prompt tokens | pools | blocks | bytes | handoff copy (ms) | plain copy (ms) | "
        "handoff GB/s | plain GB/s | handoff / plain bandwidth |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length in LENGTHS:
        n = blocks_for_tokens(length, layout.block_size)
        nbytes = n * layout.bytes_per_block()
        a = torch.empty(nbytes // 4, dtype=torch.float32).share_memory_()
        b = torch.empty_like(a)
        plain = best_seconds(lambda a=a, b=b: b.copy_(a))
        for order in ("fresh pools", "busy pools", "worst case"):
            # busy: three quarters of each pool held by requests that came and went
            keep_free = max(n, kv_free_quarter(src))
            busy = [churn(kv.allocator, random.Random(1), keep_free) for kv in (src, dst)]
            if order != "busy pools":
                for kv, live in zip((src, dst), busy, strict=True):
                    kv.allocator.free([b for ids in live for b in ids])
                busy = [[], []]
            src_ids = src.allocator.allocate(n)
            dst_ids = dst.allocator.allocate(n)
            if order == "worst case":  # no two source blocks neighbours
                src_ids = src_ids[::-1]
            handoff = best_seconds(
                lambda s=src_ids, d=dst_ids: copy_blocks(src.tensor, s, dst.tensor, d)
            )
            rows.append(
                f"| {length} | {order} | {n} | {nbytes} | {handoff * 1e3:.2f} | "
                f"{plain * 1e3:.2f} | {nbytes / handoff / 1e9:.1f} | "
                f"{nbytes / plain / 1e9:.1f} | {plain / handoff:.0%} |"
            )
            src.allocator.free(src_ids)
            dst.allocator.free(dst_ids)
            for kv, live in zip((src, dst), busy, strict=True):
                kv.allocator.free([b for ids in live for b in ids])
    return rows


def kv_free_quarter(kv: KVCache) -> int:
    return kv.num_blocks // 4


def churn(allocator: BlockAllocator, rng: random.Random, keep_free: int) -> list[list[int]]:
    """Requests of 1-40 blocks come and go at random until the pool is well mixed; returns
    the ones still holding blocks (at least keep_free blocks stay free)."""
    live: list[list[int]] = []
    for _ in range(2000):
        size = rng.randrange(1, 40)
        if live and (rng.random() < 0.5 or allocator.num_free - size < keep_free):
            allocator.free(live.pop(rng.randrange(len(live))))
        elif allocator.num_free - size >= keep_free:
            live.append(allocator.allocate(size))
    return live


async def end_to_end(dtype: str) -> list[str]:
    settings = load_settings(
        dtype=dtype,
        device="cpu",
        mode="disaggregated",
        batch={"chunk_size": 4096, "max_num_batched_tokens": 4096},
    )
    rows = [
        "| prompt tokens | TTFT (ms) | handoff (ms) | handoff / TTFT |",
        "|---:|---:|---:|---:|",
    ]
    async with Appliance(settings) as app:
        for length in LENGTHS:
            ids = [1000 + (i * 7) % 30000 for i in range(length)]
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            await drain(app, ids, params)  # warm-up
            timing = await drain(app, ids, params)
            ttft = timing["first_token"] - timing["arrival"]
            handoff = timing["handoff"] - timing["first_token"]
            rows.append(
                f"| {length} | {ttft * 1e3:.0f} | {handoff * 1e3:.1f} | {handoff / ttft:.1%} |"
            )
    return rows


async def drain(app: Appliance, ids: list[int], params: SamplingParams) -> dict[str, float]:
    stream = app.generate(ids, params=params)
    request = None
    async for _ in stream:
        request = request or next(iter(app.supervisor.requests.values()))
    return request.timing.as_dict()  # the public names: "handoff" is when the KV was taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    args = parser.parse_args()
    print(f"# KV handoff ({args.dtype}, CPU, torch threads {torch.get_num_threads()})\n")
    print("\n".join(copy_table(DTYPES[args.dtype])))
    print()
    print("\n".join(asyncio.run(end_to_end(args.dtype))))


if __name__ == "__main__":
    main()
