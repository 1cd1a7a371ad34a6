"""How much work each section does: the GPU run's sizes (`GPU`) and the dry run's small
ones on the CPU (`DRY`), with the Triton kernel's cases."""

from __future__ import annotations

from typing import NamedTuple

import torch


class KernelCase(NamedTuple):
    """One launch of the Triton kernel on random data."""

    name: str
    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    runs: tuple[tuple[int, int], ...]  # per sequence: (cached tokens, query tokens now)
    varlen: bool  # query runs from query_starts; else one length for all


class Scale(NamedTuple):
    """How much work each section does: the GPU's sizes, or the dry run's small ones."""

    dry_run: bool
    # paged_bf16
    long_prompt: int
    chunk_size: int
    prefix_tokens: int  # a multiple of the block size (16)
    suffix_tokens: int
    short_prompts: tuple[int, ...]
    decode_tokens: int
    # triton_kernel
    kernel_cases: tuple[KernelCase, ...]
    # appliance
    answer_tokens: int
    burst_requests: int
    burst_prompt: tuple[int, int]
    burst_tokens: int
    # handoff
    handoff_tokens: tuple[int, ...]
    # throughput
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_steps: int
    prefill_lengths: tuple[int, ...]
    # bandwidth
    bandwidth_shape: tuple[int, ...]  # vocab, hidden, intermediate, layers, heads, kv, dim
    bandwidth_batches: tuple[int, ...]
    bandwidth_contexts: tuple[int, ...]
    bandwidth_prefills: tuple[int, ...]
    repeats: int
    model: str | None = None
    inject_fault: bool = False  # paged_bf16 corrupts its KV cache: the check must fail

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.dry_run else "cuda", None if self.dry_run else 0)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _decodes(*contexts: int) -> tuple[tuple[int, int], ...]:
    """Decode runs: one query token on top of each context."""
    return tuple((c, 1) for c in contexts)


GPU = Scale(
    dry_run=False,
    long_prompt=3000,
    chunk_size=512,
    prefix_tokens=2048,
    suffix_tokens=300,
    short_prompts=(1, 17, 100, 700),
    decode_tokens=16,
    kernel_cases=(
        KernelCase(
            "decode_smollm2_bf16", "bfloat16", 9, 3, 64, 16, _decodes(0, 15, 16, 511, 4000), False
        ),
        KernelCase(
            "decode_8b_bf16", "bfloat16", 32, 8, 128, 16, _decodes(0, 99, 1000, 4095, 8191), False
        ),
        KernelCase(
            "decode_8b_fp16", "float16", 32, 8, 128, 16, _decodes(0, 99, 1000, 4095, 8191), False
        ),
        KernelCase("decode_8b_fp32", "float32", 32, 8, 128, 16, _decodes(0, 777, 4095), False),
        KernelCase(
            "prefill_varlen_bf16",
            "bfloat16",
            32,
            8,
            128,
            16,
            ((0, 600), (1000, 512), (37, 20), (2048, 1)),
            True,
        ),
        KernelCase(
            "prefill_varlen_fp32", "float32", 9, 3, 64, 16, ((0, 300), (130, 77), (64, 1)), True
        ),
        KernelCase("chunk_prefix_hit_bf16", "bfloat16", 9, 3, 64, 16, ((2053, 512),), False),
        KernelCase("chunk_blocks32_fp16", "float16", 8, 2, 64, 32, ((45, 40),), False),
    ),
    answer_tokens=24,
    burst_requests=64,
    burst_prompt=(5, 1500),
    burst_tokens=32,
    handoff_tokens=(128, 1024, 4096),
    decode_batches=(1, 16, 64),
    decode_prompt=128,
    decode_steps=64,
    prefill_lengths=(512, 2048, 8000),
    bandwidth_shape=(128256, 4096, 14336, 32, 32, 8, 128),  # Llama-3-8B
    bandwidth_batches=(1, 8, 32, 64),
    bandwidth_contexts=(512, 2048, 8192),
    bandwidth_prefills=(8192, 32768),
    repeats=10,
)
DRY = Scale(
    dry_run=True,
    long_prompt=100,
    chunk_size=32,
    prefix_tokens=48,
    suffix_tokens=8,
    short_prompts=(1, 7, 20),
    decode_tokens=4,
    kernel_cases=(
        KernelCase("decode_gqa_bf16", "bfloat16", 6, 2, 64, 16, _decodes(0, 15, 16, 74), False),
        KernelCase(
            "prefill_varlen_fp32", "float32", 6, 2, 64, 16, ((0, 33), (37, 20), (3, 1)), True
        ),
        KernelCase("chunk_prefix_hit_bf16", "bfloat16", 8, 2, 64, 32, ((45, 40),), False),
    ),
    answer_tokens=6,
    burst_requests=8,
    burst_prompt=(5, 40),
    burst_tokens=3,
    handoff_tokens=(128, 1024),
    decode_batches=(1, 4),
    decode_prompt=8,
    decode_steps=2,
    prefill_lengths=(32, 96),
    bandwidth_shape=(512, 128, 256, 2, 4, 2, 32),
    bandwidth_batches=(1, 4),
    bandwidth_contexts=(32, 128),
    bandwidth_prefills=(256,),
    repeats=2,
)
