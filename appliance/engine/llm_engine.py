"""An in-process engine: requests in, text deltas out, one model step at a time."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from appliance.config import BatchSettings, Settings
from appliance.engine.model_runner import ModelRunner, StepInputs, forward, move_to
from appliance.engine.sampler import Sampler
from appliance.engine.scheduler import ScheduledChunk, Scheduler, SchedulerLimits, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence, SequenceStatus
from appliance.engine.stop_strings import StopStringMatcher
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.kv.cache import KVCache, KVLayout
from appliance.kv.handoff import CopyStreams, KVShard, PendingCopies, start_copy
from appliance.kv.sizing import (
    DeviceMemory,
    StepShape,
    describe_gpu_pool,
    gpu_kv_blocks,
    profile_step_shape,
)
from appliance.model import cpu_kernels
from appliance.model.decode_step import CompiledDecode, compiled_problem
from appliance.model.llama import CausalLM
from appliance.model.loader import ModelFiles, Selected, load_model_files
from appliance.model.packed_linear import pack_linears, packs_linears
from appliance.model.quant import attach_quant, quantizable, quantize_weights
from appliance.model.tensor_parallel import (
    WHOLE_MODEL,
    AllReduce,
    Shard,
    kv_head_ranges,
    no_reduce,
    row_parallel_spans,
    shard_quant,
    shard_state,
)
from appliance.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("appliance.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' takes the first CUDA device when there is one, else the CPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but torch sees no CUDA device")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 where the hardware computes it natively (CUDA with bf16, CPUs with
    AVX512-BF16 or AMX), else float16 on CUDA and float32 on the CPU.

    bfloat16 keeps float32's range (the dtype these models are trained in) at half the
    bytes; decode is memory-bound, so halving the bytes read per token is the main lever.
    benchmarks/engine_bench.py measures both dtypes side by side.
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions torch's kernels use."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


def use_quant(settings: Settings, files: ModelFiles, device: torch.device) -> bool:
    """Whether to multiply weights in their block formats (model/quant.py): on the CPU with
    the kernels built, where the file has such weights or `quantize` asks for them.
    'auto' takes that path wherever it applies (it reads 4-7x fewer bytes a step than
    dense float32 and keeps each worker's memory near the file's size); 'dense'
    dequantizes everything, as before."""
    if settings.weights == "dense":
        return False
    has_blocks = settings.quantize != "none" or any(
        quantizable(name) for name in files.quant_names()
    )
    problem = ""
    if device.type != "cpu":
        problem = "block-quantized weights are multiplied by the CPU kernels only"
    elif not cpu_kernels.available():
        problem = "the CPU kernels are not built (install a C compiler, re-run ./install.sh)"
    elif settings.dtype == "float16":
        problem = "the kernels take float32 or bfloat16 activations, not float16"
    elif not has_blocks:
        problem = f"{files.source} has no weights in block formats (set quantize to make some)"
    if problem and settings.weights == "quantized":
        raise ValueError(f"weights=quantized: {problem}")
    return not problem


def build_model(
    files: ModelFiles,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantized: bool = False,
    shard: Shard = WHOLE_MODEL,
    all_reduce: AllReduce = no_reduce,
    quantize_to: str = "none",
    tp_degrees: tuple[int, ...] = (1,),
) -> CausalLM:
    """The model (or `shard` of it) on `device`; `quantized` keeps the file's block-format
    weights in their blocks (and quantizes float ones to `quantize_to` unless 'none').
    `tp_degrees`: those of the appliance's groups, whose splits its quantized products
    sum apart (row_parallel_spans), so every worker answers alike."""
    with torch.device("meta"):  # parameters are allocated as their weights are read
        model = CausalLM(files.config, dtype, device, max_positions, shard, all_reduce)
    # Weight mappings read a tensor when asked for it: nothing here holds them all.
    dense = files.weights if quantized else files.dense_weights(dtype)
    if quantized:
        quant = files.quant_weights()
        if quantize_to != "none":
            floats = Selected(dense, [name for name in dense if name not in quant])
            quant = quantize_weights(floats, quant, quantize_to.upper())
        quant = shard_quant(quant, files.config, shard)
        spans = row_parallel_spans(files.config, tp_degrees)
        biases = {name: dense[name] for name in dense if name.endswith(".bias")}
        served = attach_quant(model, quant, shard_state(biases, files.config, shard), spans)
        dense = Selected(dense, [name for name in dense if name not in served])
    model.load_weights(dense, str(files.source))
    if quantized and not compiled_problem(model):
        model.decode_step = CompiledDecode(model)
    if packs_linears(device, dtype):
        pack_linears(model, head=shard.rank == 0)  # followers compute no logits
    model.eval()
    return model


class ShardGroup(Protocol):
    """The other shards of a tensor-parallel group, which run each step in lockstep with
    this one (rank 0, which schedules and samples). See workers/shard_group.py."""

    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def run_step(self, inputs: StepInputs) -> None: ...

    def kv_shards(self) -> list[KVShard]: ...


@dataclass
class ShardParts:
    """What one shard of a worker loads: its part of the model and its KV pool."""

    files: ModelFiles
    model: CausalLM
    kv: KVCache
    max_len: int


def load_shard(
    settings: Settings,
    shard: Shard = WHOLE_MODEL,
    all_reduce: AllReduce = no_reduce,
    shared_kv: bool = False,
) -> ShardParts:
    """Load the configured model's `shard` (cached after the first start) and size its KV
    pool; shared_kv puts a CPU pool in shared memory so other processes can map it.

    Every shard of a group gets the same number of blocks: the budget buys blocks of the
    largest shard (the first, when KV heads do not split evenly)."""
    device = resolve_device(settings.device)
    cpu_kernels.select(settings.cpu_isa)
    files = load_model_files(settings.model, settings.cache_dir)
    quantized = use_quant(settings, files, device)
    # The quantized kernels take float32 activations (and bfloat16, converted as read):
    # 'auto' keeps float32 there, its accuracy at no cost in bytes read.
    dtype = (
        torch.float32
        if quantized and settings.dtype == "auto"
        else resolve_dtype(settings.dtype, device)
    )
    cfg = files.config
    max_len = min(
        settings.batch.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
    )
    kv_heads = kv_head_ranges(cfg.num_kv_heads, shard.size)
    degrees = (settings.prefill_tp, settings.decode_tp)
    model = build_model(
        files, dtype, device, max_len, quantized, shard, all_reduce, settings.quantize, degrees
    )
    largest = KVLayout(
        cfg.num_layers, settings.kv.block_size, len(kv_heads[0]), cfg.head_dim, dtype
    )
    own = replace(largest, num_kv_heads=len(kv_heads[shard.rank]))
    num_blocks = pool_blocks(settings, model, largest, own, max_len, shard, all_reduce)
    kv = KVCache(own, num_blocks, device, shared=shared_kv)
    return ShardParts(files, model, kv, max_len)


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


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    seq_id: int
    text: str  # the new text since the last output (may be empty)
    token_ids: list[int]  # the new token ids
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    handoff_blocks: list[int] | None = None  # a parked prefill's blocks, to pull then release
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


@dataclass
class Completion:
    """A whole finished request."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int


@dataclass
class _Stream:
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    sent_tokens: int = 0


class LLMEngine:
    """Scheduler + model runner + detokenization for one pool of KV blocks."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        kv: KVCache,
        limits: SchedulerLimits,
        prefix_caching: bool = False,
        group: ShardGroup | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self._group = group
        self._kv_shards = None if group else [KVShard(0, kv.tensor)]
        self.scheduler = Scheduler(kv.allocator, kv.block_size, limits, prefix_caching)
        self.runner = ModelRunner(model, kv, Sampler(model.device), group)
        self._ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}
        self._streams: dict[int, _Stream] = {}
        # Handed-off requests whose blocks are being copied in (CUDA), held out of the batch.
        self._copies: PendingCopies[Sequence] = PendingCopies()
        self._copy_streams = CopyStreams()
        self._landed: list[int] = []  # their ids once in the batch, until pop_landed
        self._aborted: set[int] = set()  # of those in flight: freed once they land
        # Recorded after a step that parks blocks; decode workers' copies wait for it.
        self.handoff_ready = torch.cuda.Event(interprocess=True) if kv.tensor.is_cuda else None

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        shared_kv: bool = False,
        group: ShardGroup | None = None,
        decodes: bool = True,
    ) -> LLMEngine:
        """Load the configured model (cached after the first start) and size its KV pool;
        shared_kv puts a CPU pool in shared memory so other processes can map it. With a
        group this process is shard 0 of a tensor-parallel model whose other shards the
        group runs. `decodes` (not a prefill worker): batch.cuda_graphs applies."""
        if group is None:
            parts = load_shard(settings, shared_kv=shared_kv)
        else:
            shard = Shard(0, group.size)
            parts = load_shard(settings, shard, group.all_reduce, shared_kv=shared_kv)
        cfg = parts.files.config
        tokenizer = Tokenizer.load(parts.files.tokenizer_dir, cfg.eos_token_ids)
        limits = SchedulerLimits(
            max_num_seqs=settings.batch.max_num_seqs,
            max_num_batched_tokens=settings.batch.max_num_batched_tokens,
            chunk_size=settings.batch.chunk_size,
            max_model_len=parts.max_len,
        )
        engine = cls(parts.model, tokenizer, parts.kv, limits, settings.kv.prefix_caching, group)
        if decodes and settings.batch.cuda_graphs:
            engine.runner.use_decode_graphs(settings.batch.max_num_seqs, parts.max_len)
        return engine

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, prefill_only: bool = False
    ) -> int:
        """Queue a tokenized prompt; returns its id. Raises ValueError if it cannot fit.

        prefill_only: stop after the first token and park the prompt's blocks for a decode
        worker (the output carries `handoff_blocks`; call `release` once they are copied)."""
        bad = [t for t in prompt_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary")
        seq = self._new_sequence(list(prompt_ids), params)
        seq.prefill_only = prefill_only
        self.scheduler.add(seq)
        self._track(seq)
        return seq.seq_id

    def _new_sequence(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        stop_ids = frozenset() if params.ignore_eos else self.tokenizer.stop_token_ids
        return Sequence(next(self._ids), token_ids, params, stop_token_ids=stop_ids)

    def _track(self, seq: Sequence) -> None:
        self._seqs[seq.seq_id] = seq
        stream = _Stream(IncrementalDetokenizer(self.tokenizer), StopStringMatcher(seq.params.stop))
        self._streams[seq.seq_id] = stream

    def add_prefilled(
        self,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        source: list[KVShard],
        source_blocks: list[int],
    ) -> tuple[int, int] | None:
        """Continue a request another pool prefilled: pull its prompt K/V from `source`
        (that pool's KV tensors, one per shard) into this pool and decode from its first
        token.

        token_ids is the prompt plus the first token. Returns the new id and the bytes
        copied (blocks this pool's prefix cache held are not), or None when this pool has
        no room now (nothing is copied; retry or pick another worker).

        The request joins the batch once its blocks have landed: at once on the CPU, on
        CUDA at a later step (or admit_copied); pop_landed says which have. Release the
        source blocks only then."""
        if len(self.scheduler.running) + len(self._copies) >= self.scheduler.limits.max_num_seqs:
            return None
        seq = self._new_sequence(list(token_ids), params)
        seq.num_prompt_tokens = num_prompt_tokens
        seq.num_computed_tokens = num_prompt_tokens
        if not self.scheduler.admit_prefilled(seq):
            return None
        self.scheduler.running.remove(seq)  # until its blocks land: admit_copied
        needed = blocks_for_tokens(num_prompt_tokens, self.kv.block_size)
        have = seq.num_cached_tokens // self.kv.block_size  # cached here already
        copy = start_copy(
            source,
            source_blocks[have:needed],
            self.kv_shards,
            seq.block_table[have:needed],
            self._copy_streams,
        )
        self._track(seq)
        stream = self._streams[seq.seq_id]
        # The prefill side already streamed the first token: prime the text state only.
        stream.stops.feed(stream.detokenizer.add(token_ids[-1]))
        stream.sent_tokens = len(seq.output_ids)
        self._copies.add(seq.seq_id, seq, copy.done)
        self.admit_copied()
        return seq.seq_id, copy.nbytes

    def admit_copied(self) -> None:
        """Move handed-off requests whose blocks have landed into the running batch (an
        aborted one is freed instead); never waits for a copy."""
        for seq in self._copies.landed():
            self.scheduler.running.append(seq)
            if seq.seq_id in self._aborted:
                self._aborted.discard(seq.seq_id)
                self.scheduler.finish(seq, "abort")
                self._forget(seq.seq_id)
            else:
                self._landed.append(seq.seq_id)

    def pop_landed(self) -> list[int]:
        """Ids of handed-off requests that joined the batch since the last call."""
        landed, self._landed = self._landed, []
        return landed

    @property
    def copies_in_flight(self) -> int:
        """Handed-off requests whose blocks are still being copied in."""
        return len(self._copies)

    @property
    def kv_shards(self) -> list[KVShard]:
        """This worker's pools split over KV heads, where handed-off blocks are copied to.
        A tensor-parallel worker opens its followers' pools at its first handoff: only a
        decode worker ever needs them."""
        if self._kv_shards is None:
            assert self._group is not None  # only a worker with a group starts without them
            self._kv_shards = [KVShard(0, self.kv.tensor), *self._group.kv_shards()]
        return self._kv_shards

    @property
    def num_free_blocks(self) -> int:
        """KV blocks no running request holds (cached ones included: they are reclaimable)."""
        return self.scheduler.blocks.num_free

    def release(self, seq_id: int) -> None:
        """Free a parked prefill's blocks once a decode worker has copied them."""
        self.scheduler.release(seq_id)
        self._seqs.pop(seq_id, None)

    def expire_leases(self, lease_seconds: float, now: float | None = None) -> list[int]:
        """Free parked prefills no decode worker pulled in time; returns their ids."""
        now = time.monotonic() if now is None else now
        expired = self.scheduler.expire_leases(now, lease_seconds)
        for seq in expired:
            self._seqs.pop(seq.seq_id, None)
        return [seq.seq_id for seq in expired]

    def abort(self, seq_id: int) -> None:
        """Drop a request now and free its blocks."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None and seq_id in self._copies:
            self._aborted.add(seq_id)  # its copy still writes its blocks: free them after
        elif seq is not None:
            self.scheduler.finish(seq, "abort")
            self._forget(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._copies)

    def step(self) -> list[RequestOutput]:
        """Admit landed handoffs, run one model step; report every request that produced a
        token."""
        self.admit_copied()
        out = self.scheduler.schedule()
        if out.empty:
            return []
        sampled = self.runner.run(out)
        updated = self.scheduler.update_from_output(out, sampled, time.monotonic())
        if self.handoff_ready is not None and any(
            s.seq_id in self.scheduler.parked for s in updated
        ):
            # After the step that wrote the parked blocks, before they are announced.
            self.handoff_ready.record(torch.cuda.current_stream(self.kv.tensor.device))
        return [self._output(seq) for seq in updated]

    def _output(self, seq: Sequence) -> RequestOutput:
        stream = self._streams[seq.seq_id]
        new_ids = seq.output_ids[stream.sent_tokens :]
        stream.sent_tokens = len(seq.output_ids)
        text = "".join(stream.stops.feed(stream.detokenizer.add(t)) for t in new_ids)
        if stream.stops.stopped and not seq.finished:
            self.scheduler.finish(seq, "stop")
        if seq.finished:
            text += stream.stops.feed(stream.detokenizer.flush()) + stream.stops.flush()
            self._seqs.pop(seq.seq_id, None)
        parked = seq.status is SequenceStatus.PARKED
        if seq.finished or parked:
            self._forget(seq.seq_id)
        return RequestOutput(
            seq.seq_id,
            text,
            new_ids,
            seq.finished,
            seq.finish_reason,
            seq.num_prompt_tokens,
            len(seq.output_ids),
            list(seq.block_table) if parked else None,
            seq.num_cached_tokens,
        )

    def _forget(self, seq_id: int) -> None:
        self._streams.pop(seq_id, None)
        self.runner.sampler.forget(seq_id)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Run one request alone, yielding its outputs as they come."""
        seq_id = self.add_request(prompt_ids, params)
        try:
            while True:
                for output in self.step():
                    if output.seq_id == seq_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.abort(seq_id)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Run several prompts as one batch to the end."""
        order = [self.add_request(p, params) for p in prompts]
        texts: dict[int, list[str]] = {i: [] for i in order}
        tokens: dict[int, list[int]] = {i: [] for i in order}
        reasons: dict[int, str | None] = {}
        while self.has_unfinished():
            for output in self.step():
                texts[output.seq_id].append(output.text)
                tokens[output.seq_id].extend(output.token_ids)
                if output.finished:
                    reasons[output.seq_id] = output.finish_reason
        return [
            Completion("".join(texts[i]), tokens[i], reasons.get(i), len(prompt))
            for i, prompt in zip(order, prompts, strict=True)
        ]
