"""How many KV blocks a worker's pool gets: the configured count or budget, or on a GPU
what is left after the loaded weights and one profiled step of the largest batch (the
arithmetic is in kv/sizing.py; this module runs the measurement it needs)."""

from __future__ import annotations

import logging

import torch

from appliance.engine.model_runner import ModelRunner, forward, move_to
from appliance.engine.sampling.sampler import Sampler
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.kv.cache import KVCache, KVLayout
from appliance.kv.sizing import (
    DeviceMemory,
    StepShape,
    describe_gpu_pool,
    gpu_kv_blocks,
    profile_step_shape,
)
from appliance.model.causal_lm import CausalLM
from appliance.model.tensor_parallel import WHOLE_MODEL, AllReduce, Shard, no_reduce
from appliance.settings.config import BatchSettings, Settings

# The engine's logger, as before the split: the start-up line is filtered and tested by it.
log = logging.getLogger("appliance.engine")


def pool_blocks(
    settings: Settings,
    model: CausalLM,
    largest: KVLayout,
    own: KVLayout,
    max_len: int,
    shard: Shard = WHOLE_MODEL,
    all_reduce: AllReduce = no_reduce,
) -> int:
    """How many KV blocks every shard's pool gets: kv.num_blocks when set; on a GPU, unless
    kv.memory_mb is set, what kv.gpu_memory_utilization leaves after the loaded weights
    and a profiled step (kv/sizing.py), the fewest any shard of the group can hold; else
    the blocks of the largest shard (`largest`) that kv.memory_mb buys."""
    kv = settings.kv
    if kv.num_blocks:
        return kv.num_blocks
    if model.device.type != "cuda" or kv.memory_mb_given:
        return largest.blocks_for_budget(kv.memory_mb * 2**20)
    memory = measure_gpu(model, own, settings.batch, max_len, head=shard.rank == 0)
    block_bytes = own.bytes_per_block()
    own_blocks = gpu_kv_blocks(memory, kv.gpu_memory_utilization, block_bytes)
    blocks = fewest_blocks(own_blocks, shard, all_reduce, model.device)
    where = f"{model.device}" + (f" (shard {shard.rank} of {shard.size})" if shard.size > 1 else "")
    line = describe_gpu_pool(memory, kv.gpu_memory_utilization, blocks, block_bytes, own.block_size)
    log.info("KV pool on %s: %s", where, line)
    return blocks


def measure_gpu(
    model: CausalLM, layout: KVLayout, batch: BatchSettings, max_len: int, head: bool
) -> DeviceMemory:
    """The GPU's memory after the weights loaded, and the peak one dummy step of the largest
    batch the scheduler allows adds (run in a pool just big enough for it). Every shard of
    a group calls this in lockstep: the step's all-reduces meet."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    shape = profile_step_shape(
        batch.max_num_seqs, batch.max_num_batched_tokens, batch.chunk_size, max_len
    )
    probe = KVCache(layout, shape.num_blocks(layout.block_size), device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile_step(model, probe, shape, head)
    torch.cuda.synchronize(device)
    step_peak = torch.cuda.max_memory_allocated(device) - before
    del probe
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, free=free, weights=weights, step_peak=step_peak)


def profile_step(model: CausalLM, kv: KVCache, shape: StepShape, head: bool) -> int:
    """Run the model once over a dummy step of `shape` in `kv` (which has
    shape.num_blocks(kv.block_size) blocks); `head` (shard 0) also computes the sampled
    rows' logits. Returns the number of tokens run."""
    params = SamplingParams()
    free_blocks = iter(range(kv.num_blocks))
    out = SchedulerOutput()
    for index, num_tokens in enumerate(shape.prefill_chunks):
        seq = Sequence(index, [0] * num_tokens, params)
        out.prefills.append(ScheduledChunk(seq, num_tokens))
    for index in range(shape.num_decodes):
        seq = Sequence(len(out.prefills) + index, [0, 0], params, num_computed_tokens=1)
        out.decodes.append(ScheduledChunk(seq, 1))
    for chunk in out.chunks:
        needed = blocks_for_tokens(len(chunk.seq), kv.block_size)
        chunk.seq.block_table = [next(free_blocks) for _ in range(needed)]
    runner = ModelRunner(model, kv, Sampler(model.device))
    inputs = move_to(runner.prepare(out), model.device)
    hidden = forward(model, inputs, kv.tensor)
    if head and inputs.sample_requests:
        model.logits(hidden[inputs.sample_rows])
    return int(hidden.shape[0])


def fewest_blocks(blocks: int, shard: Shard, all_reduce: AllReduce, device: torch.device) -> int:
    """The smallest block count of any shard in the group (each measured its own GPU), so
    that every shard's pool has the same blocks. all_reduce sums: each shard puts its
    count in its own slot, and every shard reads all of them."""
    if shard.size == 1:
        return blocks
    slots = torch.zeros(shard.size, dtype=torch.int64, device=device)
    slots[shard.rank] = blocks
    return int(all_reduce(slots).min())
