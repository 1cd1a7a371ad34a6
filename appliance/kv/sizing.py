"""How many KV blocks a worker's pool on a GPU gets: arithmetic over measured numbers.

Pure Python (no torch), so every case tests on plain data. The worker measures its GPU
after the weights have loaded and after one profiled model step (engine/kv_pool_sizing.py);
this module turns those numbers into a block count, the way vLLM's gpu_memory_utilization
does: the fraction is of the device's total memory that this worker may use for its
weights, a step's activations and its KV pool together.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.kv.block_allocator import blocks_for_tokens

GIB = 2**30
MIB = 2**20


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Bytes one KV block takes in a pool with `num_kv_heads` heads (this shard's): K and V
    of `block_size` tokens in every layer."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class StepShape:
    """The dummy step a worker profiles: prompt chunks (each its own prompt, from position
    0) and single-token decodes (each of a two-token sequence)."""

    prefill_chunks: tuple[int, ...]
    num_decodes: int

    @property
    def num_tokens(self) -> int:
        return sum(self.prefill_chunks) + self.num_decodes

    @property
    def num_seqs(self) -> int:
        return len(self.prefill_chunks) + self.num_decodes

    def num_blocks(self, block_size: int) -> int:
        """Blocks of the small pool the dummy step runs in."""
        prefill = sum(blocks_for_tokens(n, block_size) for n in self.prefill_chunks)
        return prefill + self.num_decodes * blocks_for_tokens(2, block_size)


def profile_step_shape(
    max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int, max_model_len: int
) -> StepShape:
    """The largest step the scheduler can form: as many tokens as the budget allows, in
    prompt chunks of the largest size it cuts (chunk_size, within the budget and the
    context), and beside them as many decodes as the sequence limit still leaves room for
    without shrinking the step."""
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("chunk_size", chunk_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
    budget = max_num_batched_tokens
    chunk = min(chunk_size, budget, max_model_len - 1)  # a prompt is shorter than the context
    decodes = 0
    if max_num_seqs * chunk > budget:
        # d decodes leave max_num_seqs - d prompts: the step stays `budget` tokens while
        # d + (max_num_seqs - d) * chunk >= budget.
        fits = (max_num_seqs * chunk - budget) // (chunk - 1) if chunk > 1 else max_num_seqs
        decodes = min(max_num_seqs - 1, budget - 1, fits)
    prompt_tokens = min(budget - decodes, (max_num_seqs - decodes) * chunk)
    full, rest = divmod(prompt_tokens, chunk)
    chunks = (chunk,) * full + ((rest,) if rest else ())
    return StepShape(chunks, decodes)


@dataclass(frozen=True)
class DeviceMemory:
    """What a worker measured on its GPU, in bytes."""

    total: int  # the device's memory (torch.cuda.mem_get_info()[1])
    free: int  # free on the device, all processes counted, after the weights loaded
    weights: int  # what this worker holds after loading (torch.cuda.memory_allocated)
    step_peak: int  # the profiled step's peak on top of that (max_memory_allocated - before)


def gpu_kv_blocks(memory: DeviceMemory, utilization: float, block_bytes: int) -> int:
    """KV blocks of `block_bytes` for a worker that may use `utilization` of its GPU's total
    memory: what is left of that share after its weights and a profiled step's peak, and
    never more than the device has free (other processes on it count). Raises ValueError
    naming the numbers when not one block fits."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if block_bytes < 1:
        raise ValueError(f"a KV block must take at least one byte, got {block_bytes}")
    share = int(memory.total * utilization) - memory.weights - memory.step_peak
    on_device = memory.free - memory.step_peak
    blocks = min(share, on_device) // block_bytes
    if blocks >= 1:
        return blocks
    block = f"one block takes {block_bytes / MIB:.2f} MiB"
    if share <= on_device:
        raise ValueError(
            f"the model's weights take {_gib(memory.weights)} of the GPU's "
            f"{_gib(memory.total)} and a profiled step {_gib(memory.step_peak)} more; with "
            f"gpu_memory_utilization={utilization} ({_gib(memory.total * utilization)} for "
            f"this worker) no room is left for the KV cache ({block}): raise "
            "kv.gpu_memory_utilization, split the model over more GPUs (prefill_tp, "
            "decode_tp), lower batch.max_num_batched_tokens, or serve a smaller model"
        )
    raise ValueError(
        f"only {_gib(memory.free)} of the GPU's {_gib(memory.total)} are free after the "
        f"model's weights ({_gib(memory.weights)}) loaded and a profiled step needs "
        f"{_gib(memory.step_peak)}: no room is left for the KV cache ({block}); other "
        "processes hold the rest of the GPU: stop them, or lower kv.gpu_memory_utilization "
        "where workers share it"
    )


def describe_gpu_pool(
    memory: DeviceMemory, utilization: float, num_blocks: int, block_bytes: int, block_size: int
) -> str:
    """One line on how a GPU pool was sized, for the worker's start-up log."""
    return (
        f"{num_blocks} KV blocks of {block_size} tokens = {num_blocks * block_size} tokens "
        f"({_gib(num_blocks * block_bytes)}): gpu_memory_utilization={utilization} of the "
        f"GPU's {_gib(memory.total)}, less the weights' {_gib(memory.weights)} and a "
        f"profiled step's {_gib(memory.step_peak)} ({_gib(memory.free)} free after loading)"
    )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"
