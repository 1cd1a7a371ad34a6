"""The GPU check: 1P+1D on one GPU (two worker processes, the prefill pool shared through
a CUDA IPC handle), greedy parity with the CPU engine, and the handoff copy against a plain
device-to-device copy of the same bytes.

Run on a machine with an NVIDIA GPU (a few minutes at most):
    .venv/bin/python benchmarks/gpu_check.py
Without CUDA it says so and exits 0: CPU-only machines skip it.
Exit status 1 when parity fails or blocks stay allocated.
"""

from __future__ import annotations

import asyncio
import sys
import time

import torch

from appliance.appliance import Appliance
from appliance.config import load_settings
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.kv.cache import KVCache, KVLayout
from appliance.kv.handoff import copy_blocks, peer_access
from appliance.topology import Device, Topology

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What do bees make?",
    "Name a planet.",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
]
GREEDY = SamplingParams(max_tokens=24)


def one_gpu_as_two_devices() -> Topology:
    """Devices 0 and 1 of the appliance, both on the GPU torch calls cuda:0."""
    props = torch.cuda.get_device_properties(0)
    memory = props.total_memory
    gpus = [Device("cuda", i, props.name, memory, memory, ordinal=0) for i in (0, 1)]
    return Topology.without_links(gpus)


async def gpu_run(prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    settings = load_settings(
        dtype="float32",
        device="cuda",
        mode="disaggregated",
        prefill_devices="0",
        decode_devices="1",
        kv={"memory_mb": 1024},
    )
    async with Appliance(settings, one_gpu_as_two_devices()) as app:

        async def one(ids: list[int]) -> list[int]:
            return [t async for c in app.generate(ids, params=GREEDY) for t in c.token_ids]

        outputs = list(await asyncio.gather(*(one(p) for p in prompts)))
        await asyncio.sleep(0.5)  # the last block counts arrive with the workers' reports
        return outputs, app.supervisor.block_counts()


def cuda_seconds(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def handoff_table() -> list[str]:
    device = torch.device("cuda", 0)
    layout = KVLayout(30, 16, 3, 64, torch.bfloat16)
    src, dst = KVCache(layout, 2048, device), KVCache(layout, 2048, device)
    rows = [
        f"peer access cuda:0 -> cuda:0: {peer_access(device, device)}",
        "| prompt tokens | bytes | handoff (ms) | plain d2d (ms) | handoff / plain bandwidth |",
        "|---:|---:|---:|---:|---:|",
    ]
    for length in (128, 1024, 4096):
        n = blocks_for_tokens(length, layout.block_size)
        src_ids, dst_ids = src.allocator.allocate(n), dst.allocator.allocate(n)
        nbytes = n * layout.bytes_per_block()
        a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
        b = torch.empty_like(a)
        handoff = cuda_seconds(
            lambda s=src_ids, d=dst_ids: copy_blocks(src.tensor, s, dst.tensor, d)
        )
        plain = cuda_seconds(lambda a=a, b=b: b.copy_(a))
        rows.append(
            f"| {length} | {nbytes} | {handoff * 1e3:.3f} | {plain * 1e3:.3f} | "
            f"{plain / handoff:.0%} |"
        )
        src.allocator.free(src_ids)
        dst.allocator.free(dst_ids)
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU check has nothing to run here")
        return 0
    cpu = LLMEngine.from_settings(load_settings(dtype="float32", device="cpu"))
    prompts = [
        cpu.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS
    ]
    expected = [c.token_ids for c in cpu.generate(prompts, GREEDY)]
    got, counts = asyncio.run(gpu_run(prompts))
    same = sum(g == e for g, e in zip(got, expected, strict=True))
    print(f"# GPU check on {torch.cuda.get_device_name(0)}\n")
    print(f"greedy parity with the CPU engine (float32): {same}/{len(prompts)} prompts identical")
    print(f"KV blocks after the run (free, total) per worker: {counts}")
    print("\n".join(handoff_table()))
    all_free = all(free == total for free, total in counts.values())
    return 0 if same == len(prompts) and all_free else 1


if __name__ == "__main__":
    sys.exit(main())
