"""The one KV tensor of a worker and how many blocks a memory budget buys."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from appliance.kv.block_allocator import BlockAllocator

# kv_cache_dtype's explicit choices (settings/config.py); "auto" is the activations' dtype.
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_kv_dtype(name: str, activations: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a worker's KV pool keeps K/V in, for the kv_cache_dtype setting `name`:
    'auto' is the activations' dtype. Elsewhere than the CPU only that one is taken: the
    Triton attention reads K/V in the queries' dtype (ValueError naming the setting)."""
    if name == "auto":
        return activations
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of auto, {', '.join(KV_DTYPES)}")
    dtype = KV_DTYPES[name]
    if device.type != "cpu" and dtype != activations:
        raise ValueError(
            f"kv_cache_dtype={name}: on {device.type} the KV cache is kept in the "
            f"activations' dtype ({str(activations).removeprefix('torch.')}); use auto"
        )
    return dtype


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV pool: everything but the number of blocks."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_for_budget(self, memory_bytes: int) -> int:
        blocks = memory_bytes // self.bytes_per_block()
        if blocks < 1:
            raise ValueError(
                f"KV memory budget of {memory_bytes} bytes holds no block of "
                f"{self.bytes_per_block()} bytes; raise kv.memory_mb"
            )
        return int(blocks)


class KVCache:
    """A worker's paged KV pool: the tensor and the allocator of its blocks."""

    def __init__(
        self, layout: KVLayout, num_blocks: int, device: torch.device, shared: bool = False
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        # [layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]
        shape = (
            layout.num_layers,
            2,
            num_blocks,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        self.tensor = zeroed(shape, layout.dtype, device, shared)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each [num_blocks, block_size, kv_heads, head_dim]."""
        return self.tensor[index, 0], self.tensor[index, 1]


def zeroed(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, shared: bool
) -> torch.Tensor:
    """A tensor of zeros. On a CPU its pages are new mappings the kernel fills with zeros
    when first touched, never written here: a worker's 512 MiB pool costs ~0.1 s to make
    instead of ~0.7 s (torch.zeros, then share_memory_'s copy), and its resident memory
    is the blocks used. shared: in shared memory, which other processes map (the KV
    handoff); otherwise an anonymous private mapping (no /dev/shm, which a container may
    keep small)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if shared:
        # What share_memory_ allocates, without the copy (torch.multiprocessing uses it).
        storage = torch.UntypedStorage._new_shared(nbytes)
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)  # [nbytes]
    else:
        # The tensor holds the mapping: it is unmapped when the last view goes.
        flat = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # [nbytes]
    return flat.view(dtype).view(shape)
