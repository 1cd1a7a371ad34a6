"""Turns a SchedulerOutput into tensors, runs the model over the paged cache, samples."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, Protocol

import torch

from appliance.engine.decode_groups import decode_groups
from appliance.engine.pooling import PromptPooling
from appliance.engine.sampling.logprobs import TokenLogprobs
from appliance.engine.sampling.sampler import Sampler, SampleRow, table_entry, token_table
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams
from appliance.kv.cache import KVCache
from appliance.model import cpu_kernels
from appliance.model.causal_lm import CausalLM
from appliance.model.layers.paged_attention import (
    AttentionBatch,
    DecodeGroup,
    PrefillSegment,
    runs_triton,
)


@dataclass
class StepInputs:
    """A step's flat token batch and the rows whose logits pick next tokens.

    prepare() makes them on the host; run() moves them to the model's device, and each
    tensor-parallel follower to its own."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    attention: AttentionBatch
    sample_rows: torch.Tensor  # [samples] int64, last row of each completing chunk,
    # every row of a verify chunk (one request per row in sample_requests)
    sample_requests: list[tuple[int, SamplingParams]]


def move_to(value: Any, device: torch.device) -> Any:
    """The same step inputs (tensors, lists and dataclasses of them) on another device.

    To CUDA they go packed: one pinned host buffer and one non-blocking copy per dtype,
    so the step queues behind the previous one instead of waiting for it (a copy from
    pageable memory blocks the host until the device has run everything before it)."""
    if device.type == "cuda":
        return pack_to(value, device, pin=True)
    return map_tensors(value, lambda tensor: tensor.to(device))


def pack_to(value: Any, device: torch.device, *, pin: bool) -> Any:
    """move_to's CUDA path: `value`'s host (CPU) tensors as views of one `device` buffer
    per dtype, copied from one host buffer per dtype (pinned if `pin`) without blocking.
    Other tensors go to `device` on their own (there are none in a step's inputs). With
    `device` the CPU and pin False the packing runs the same: that is its test."""
    leaves: list[torch.Tensor] = []
    map_tensors(value, leaves.append)
    moved: dict[int, torch.Tensor] = {}  # leaf index -> its tensor on the device
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(leaves):
        if tensor.device.type == "cpu":
            by_dtype.setdefault(tensor.dtype, []).append(index)
        else:
            moved[index] = tensor.to(device, non_blocking=True)
    for dtype, members in by_dtype.items():
        sizes = [leaves[i].numel() for i in members]
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=pin)
        torch.cat([leaves[i].reshape(-1) for i in members], out=host)
        # The caching host allocator keeps `host` from reuse until this copy has run.
        pieces = host.to(device, non_blocking=True).split(sizes)
        for i, piece in zip(members, pieces, strict=True):
            moved[i] = piece.view(leaves[i].shape)
    order = iter(range(len(leaves)))
    return map_tensors(value, lambda _: moved[next(order)])


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with each tensor inside it (in lists and dataclass fields, depth first, in
    order) replaced by fn(tensor)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        return replace(
            value, **{f.name: map_tensors(getattr(value, f.name), fn) for f in fields(value)}
        )
    return value


def forward(model: CausalLM, inputs: StepInputs, kv_tensor: torch.Tensor) -> torch.Tensor:
    """The model over one step's tokens: hidden states [tokens, hidden]. Every shard of a
    tensor-parallel group runs this with its own weights and pool."""
    return model(inputs.input_ids, inputs.positions, inputs.attention, kv_tensor)


class StepFollowers(Protocol):
    """Other shards of this worker's model, handed every step before it runs here."""

    def run_step(self, inputs: StepInputs) -> None: ...


class ModelRunner:
    """One worker's model and KV pool; `run` executes a scheduled step."""

    def __init__(
        self, model: CausalLM, kv: KVCache, sampler: Sampler, followers: StepFollowers | None = None
    ) -> None:
        self.model = model
        self.kv = kv
        self.sampler = sampler
        self.device = model.device
        self.followers = followers
        # The CPU kernel and the Triton one (CUDA) attend any mix of context lengths at
        # once: no grouping needed, one decode group a step.
        cfg = model.config
        self.ragged_decode = cpu_kernels.decodes_ragged(
            model.device, model.dtype, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
        ) or runs_triton(model.device)
        # Verify chunks as decode rows on the CPU's ragged kernel: the compiled decode step
        # (or the layers' decode kernel) runs them at its per-row numbers and cost, not
        # the prefill path's (benchmarks/spec_step_bench.py: 5 rows 2.4x a 1-row step
        # instead of 3.35x on 2 EPYC cores).
        self.verify_as_decode = self.ragged_decode and model.device.type == "cpu"
        # Off unless enable_decode_graphs() is called (CUDA only, not yet run on a GPU).
        self.decode_graphs: DecodeGraphs | None = None
        # The last run's logprobs, of the sequences that asked for them; and of the prompt
        # tokens its chunks computed, {seq_id: [(position, logprobs)]}, where asked.
        self.logprobs: dict[int, list[TokenLogprobs]] = {}  # a token's, a verify run's each
        self.prompt_logprobs: dict[int, list[tuple[int, TokenLogprobs]]] = {}
        # The last run's verify chunks: {seq_id: accepted drafts + one token}.
        self.verified: dict[int, list[int]] = {}
        # The embeddings of the prompts the last run completed, of those that asked.
        self.pooling = PromptPooling()
        self.embeddings: dict[int, list[float]] = {}

    def enable_decode_graphs(self, batch_sizes: tuple[int, ...], max_len: int) -> None:
        """Capture CUDA graphs of decode-only steps of these batch sizes, for sequences of
        up to max_len tokens; other steps still run eagerly. Call before serving: capture
        runs the model on dummy rows, which write K/V into the pool's slot 0.

        Experimental and off by default: no GPU has run it yet (the CPU tests replay the
        same static buffers eagerly)."""
        if not runs_triton(self.device):
            raise ValueError(f"decode graphs need CUDA with triton, not {self.device}")
        if self.followers is not None:
            raise ValueError("decode graphs do not capture tensor-parallel steps")
        if self.model.config.num_experts:
            raise ValueError("decode graphs do not capture mixture-of-experts steps")
        self.decode_graphs = DecodeGraphs(self.model, self.kv, batch_sizes, max_len, True)

    def use_decode_graphs(self, max_num_seqs: int, max_len: int) -> bool:
        """What batch.cuda_graphs asks for: on CUDA, graphs of decode_graph_sizes(max_num_seqs)
        (enable_decode_graphs, which raises where it cannot capture); elsewhere a warning
        that they apply to CUDA only, and eager steps. Returns whether graphs are on."""
        if self.device.type != "cuda":
            logging.getLogger("appliance.engine").warning(
                "batch.cuda_graphs is on, but this worker runs on %s: CUDA graphs apply to "
                "CUDA devices only, its decode steps run eagerly",
                self.device,
            )
            return False
        self.enable_decode_graphs(decode_graph_sizes(max_num_seqs), max_len)
        return True

    def run(self, out: SchedulerOutput) -> dict[int, int]:
        """Compute the step; return {seq_id: next token} for sequences whose chunk completed.
        The logprobs of those that asked for them are in `self.logprobs` until the next run."""
        self.logprobs, self.prompt_logprobs, self.verified = {}, {}, {}
        self.embeddings = {}
        inputs = self.prepare(out)  # built on the host: followers are sent these
        if self.followers is not None:
            self.followers.run_step(inputs)
        embeds = any(chunk.seq.params.embed for chunk in out.chunks)  # (hidden rows needed)
        if self.decode_graphs is not None and not embeds and self.decode_graphs.takes(inputs):
            logits = self.decode_graphs.run(inputs)  # every decode row is sampled
        else:
            if self.device.type != "cpu":
                inputs = move_to(inputs, self.device)
            hidden = forward(self.model, inputs, self.kv.tensor)
            self.prompt_logprobs = self._prompt_logprobs(out, hidden)
            if embeds:
                self.embeddings = self.pooling.add(out, hidden)
            if not inputs.sample_requests:
                return {}
            logits = self.model.logits(hidden[inputs.sample_rows])
        # The sampler's rows carry the token lists its processors read: built here, not
        # in StepInputs (which followers are sent), in prepare's order.
        rows = [SampleRow.of(chunk.seq) for chunk in out.chunks if chunk.completes]
        if out.verifies:
            return self._sample_with_verifies(out, logits, rows)
        # The step's one read from the device: the sampled ids (and logprobs), all rows.
        sampled = self.sampler.sample(logits, rows)
        self.logprobs = {
            row.seq_id: [lp]
            for row, lp in zip(rows, sampled.logprobs, strict=True)
            if lp is not None
        }
        return {row.seq_id: tok for row, tok in zip(rows, sampled.token_ids, strict=True)}

    def _sample_with_verifies(
        self, out: SchedulerOutput, logits: torch.Tensor, rows: list[SampleRow]
    ) -> dict[int, int]:
        """run()'s sampling for a step with verify chunks: each verify chunk's rows
        (logits [1 + k, vocab]) judge its drafts into `self.verified`; the other completing
        chunks' rows are sampled together as in a plain step. Reads the device once per
        verify chunk more (twice where it samples)."""
        plain: list[int] = []  # their rows in `logits`
        plain_rows: list[SampleRow] = []
        start = 0
        completing = [chunk for chunk in out.chunks if chunk.completes]
        for chunk, row in zip(completing, rows, strict=True):
            if chunk.drafts:
                span = logits[start : start + chunk.num_tokens]
                judged = self.sampler.verify(span, row, chunk.drafts)
                self.verified[row.seq_id] = judged.token_ids
                if row.params.logprobs is not None:
                    self.logprobs[row.seq_id] = [lp for lp in judged.logprobs if lp is not None]
                start += chunk.num_tokens
            else:
                plain.append(start)
                plain_rows.append(row)
                start += 1
        if not plain:
            return {}
        sampled = self.sampler.sample(logits[self._tensor(plain).to(logits.device)], plain_rows)
        self.logprobs.update(
            (row.seq_id, [lp])
            for row, lp in zip(plain_rows, sampled.logprobs, strict=True)
            if lp is not None
        )
        return {row.seq_id: tok for row, tok in zip(plain_rows, sampled.token_ids, strict=True)}

    def _prompt_logprobs(
        self, out: SchedulerOutput, hidden: torch.Tensor
    ) -> dict[int, list[tuple[int, TokenLogprobs]]]:
        """Each asking sequence's prompt tokens this step's chunks predict: the token at
        position p + 1 from the row of position p. Reads the device once more, on the
        steps that have any (vLLM's prompt_logprobs)."""
        rows: list[int] = []  # flat batch rows, in prepare's order
        targets: list[int] = []
        owners: list[tuple[int, int, int]] = []  # (seq_id, position, k)
        start = 0
        for chunk in out.chunks:
            seq, k = chunk.seq, chunk.seq.params.prompt_logprobs
            for p in range(chunk.start, chunk.start + chunk.num_tokens):
                if k is not None and p + 1 < seq.num_prompt_tokens:
                    rows.append(start + p - chunk.start)
                    targets.append(seq.token_ids[p + 1])
                    owners.append((seq.seq_id, p + 1, k))
            start += chunk.num_tokens
        if not rows:
            return {}
        device = hidden.device
        logits = self.model.logits(hidden[self._tensor(rows).to(device)])  # [n, vocab]
        top = max(k for _, _, k in owners)
        table = token_table(logits.float().log_softmax(-1), self._tensor(targets).to(device), top)
        found: dict[int, list[tuple[int, TokenLogprobs]]] = {}
        for values, (seq_id, position, k) in zip(table.tolist(), owners, strict=True):
            found.setdefault(seq_id, []).append((position, table_entry(values, k)))
        return found

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's flat token batch as host (CPU) tensors."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        segments: list[PrefillSegment] = []
        sample_rows: list[int] = []
        requests: list[tuple[int, SamplingParams]] = []
        # Verify chunks attend as segments, or on the CPU's ragged decode kernel as decode
        # rows (see _verify_rows): then a step of decodes and verifies stays decode-only.
        as_rows = self.verify_as_decode and bool(out.verifies)  # a plain step: as before
        num_prefills = len(out.prefills) + (0 if as_rows else len(out.verifies))
        for index, chunk in enumerate(out.chunks):
            row = len(ids)
            self._add_tokens(chunk, ids, positions, slots)
            if index < num_prefills:
                segments.append(
                    PrefillSegment(
                        row,
                        chunk.num_tokens,
                        chunk.start + chunk.num_tokens,
                        self._tensor(chunk.seq.block_table),
                    )
                )
            if chunk.drafts:  # a verify chunk: every row's logits judge a draft
                sample_rows.extend(range(row, len(ids)))
                requests.extend([(chunk.seq.seq_id, chunk.seq.params)] * chunk.num_tokens)
            elif chunk.completes:
                sample_rows.append(len(ids) - 1)
                requests.append((chunk.seq.seq_id, chunk.seq.params))
        prompt_rows = sum(c.num_tokens for c in out.prefills)  # the rows before the verifies'
        if as_rows:
            decode_start = prompt_rows
            groups = self._decode_groups(out.verifies + out.decodes, verify_rows=True)
        else:
            decode_start = len(ids) - len(out.decodes)
            groups = self._decode_groups(out.decodes)
        batch = AttentionBatch(self._tensor(slots), segments, decode_start, groups, prompt_rows)
        return StepInputs(
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            attention=batch,
            sample_rows=self._tensor(sample_rows),
            sample_requests=requests,
        )

    def _add_tokens(
        self, chunk: ScheduledChunk, ids: list[int], positions: list[int], slots: list[int]
    ) -> None:
        seq, bs = chunk.seq, self.kv.block_size
        span = range(chunk.start, chunk.start + chunk.num_tokens)
        ids.extend(seq.token_ids[span.start : span.stop - len(chunk.drafts)])
        ids.extend(chunk.drafts)  # a verify chunk's drafts follow its one real token
        positions.extend(span)
        slots.extend(seq.block_table[p // bs] * bs + p % bs for p in span)

    def _decode_groups(
        self, decodes: list[ScheduledChunk], verify_rows: bool = False
    ) -> list[DecodeGroup]:
        if verify_rows:  # only where ragged (verify_as_decode)
            return [self._verify_group(decodes)] if decodes else []
        if self.ragged_decode:
            return [self._decode_group(decodes, None)] if decodes else []
        groups = decode_groups([len(c.seq.block_table) for c in decodes])
        if len(groups) == 1:  # all of them, in their row order
            return [self._decode_group(decodes, None)]
        return [self._decode_group([decodes[i] for i in g], self._tensor(g)) for g in groups]

    def _decode_group(
        self, decodes: list[ScheduledChunk], rows: torch.Tensor | None
    ) -> DecodeGroup:
        width = max(len(c.seq.block_table) for c in decodes)
        tables = [c.seq.block_table + [0] * (width - len(c.seq.block_table)) for c in decodes]
        context = self._tensor([c.start + 1 for c in decodes])
        visible: torch.Tensor | None = None  # the Triton kernel reads context, no mask
        if not runs_triton(self.device):
            keys = torch.arange(width * self.kv.block_size)
            visible = (keys[None, :] < context[:, None])[:, None, None, :]  # [n, 1, 1, keys]
        return DecodeGroup(rows, self._tensor(tables), visible, context)

    def _verify_group(self, chunks: list[ScheduledChunk]) -> DecodeGroup:
        """One ragged decode group of every row of `chunks` (verify chunks, then decodes):
        a verify chunk's row i is a decode row of its sequence whose context ends at its own
        position, start + i + 1. The step stores every row's K/V before any row attends,
        so each row sees its earlier drafts' keys and none after: the segment's causal
        mask, computed by the decode kernel row by row as plain decoding computes it."""
        tables: list[list[int]] = []
        context: list[int] = []
        for chunk in chunks:
            tables.extend([chunk.seq.block_table] * chunk.num_tokens)
            context.extend(range(chunk.start + 1, chunk.start + chunk.num_tokens + 1))
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]  # [rows, width]
        lens = self._tensor(context)
        keys = torch.arange(width * self.kv.block_size)
        visible = (keys[None, :] < lens[:, None])[:, None, None, :]  # [rows, 1, 1, keys]
        return DecodeGroup(None, self._tensor(padded), visible, lens)

    def _tensor(self, values: list) -> torch.Tensor:
        # On the host: one copy per tensor to the device later, none back for followers.
        return torch.tensor(values, dtype=torch.int64)


def decode_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture decode graphs for: the powers of two below max_num_seqs, and
    max_num_seqs itself, so every batch the scheduler allows pads to at most twice its rows."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, not {max_num_seqs}")
    powers = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return (*powers, max_num_seqs)


class DecodeGraphs:
    """Decode-only steps of a few batch sizes replayed from CUDA graphs: one launch for the
    whole model instead of hundreds, which at small batches costs more than the math.

    Graphs read fixed addresses, so each step's inputs are copied into static buffers
    sized for the largest batch and the longest sequence; a step of n rows runs the
    graph of the smallest captured size >= n, its padding rows repeating the last real
    row (same token, position and slot: their K/V writes store what that row stores, so
    no other sequence's cache is touched). Sampling stays outside the graph (per-request
    generators). With capture False (the CPU tests) the same buffers run eagerly."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        batch_sizes: tuple[int, ...],
        max_len: int,
        capture: bool,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1 or max_len < 1:
            raise ValueError(f"batch sizes {batch_sizes} and max_len {max_len} must be >= 1")
        self.model = model
        self.kv = kv
        self.sizes = sorted(set(batch_sizes))
        self.max_blocks = -(-max_len // kv.block_size)
        rows, device = self.sizes[-1], model.device
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.context = torch.ones(rows, dtype=torch.int64, device=device)
        self.tables = torch.zeros(rows, self.max_blocks, dtype=torch.int64, device=device)
        self.keys = torch.arange(self.max_blocks * kv.block_size, device=device)
        self._pool: Any = None  # one memory pool shared by every captured size
        # Largest first: the smaller graphs then fit in the memory the largest reserved.
        self._steps = {size: self._record(size, capture) for size in reversed(self.sizes)}

    def takes(self, inputs: StepInputs) -> bool:
        """Whether `inputs` (host tensors) are a decode-only step a graph can run: one
        group in row order, every row sampled, few and short enough."""
        batch = inputs.attention
        groups = batch.decode_groups
        if batch.prefills or len(groups) != 1 or groups[0].rows is not None:
            return False
        rows = int(inputs.input_ids.shape[0])
        return (
            batch.decode_start == 0
            and rows == len(inputs.sample_requests)
            and rows <= self.sizes[-1]
            and groups[0].block_tables.shape[1] <= self.max_blocks
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The step's logits [rows, vocab], from the graph of the smallest size that fits."""
        rows = int(inputs.input_ids.shape[0])
        size = next(s for s in self.sizes if s >= rows)
        group = inputs.attention.decode_groups[0]
        width = group.block_tables.shape[1]
        sources = [
            (self.input_ids[:size], inputs.input_ids),
            (self.positions[:size], inputs.positions),
            (self.slots[:size], inputs.attention.slot_mapping),
            (self.context[:size], group.context_lens),
            # Columns past `width` keep stale ids: the kernel reads none past the context.
            (self.tables[:size, :width], group.block_tables),
        ]
        host = [_pad_rows(source, size) for _, source in sources]
        pinned = self.model.device.type == "cuda"
        moved = pack_to(host, self.model.device, pin=pinned)
        for (target, _), piece in zip(sources, moved, strict=True):
            target.copy_(piece)  # on the device, queued behind the upload: no wait
        return self._steps[size]()[:rows]

    def _step_inputs(self, size: int) -> StepInputs:
        """The first `size` rows of the static buffers as a decode-only step."""
        context = self.context[:size]
        # Derived inside the step from the context lengths, so nothing this large is
        # copied per step, and a backend that reads it sees the right mask.
        visible: torch.Tensor | None = None  # none captured: the Triton kernel reads no mask
        if not runs_triton(self.model.device):
            visible = (self.keys[None, :] < context[:, None])[:, None, None, :]
        group = DecodeGroup(None, self.tables[:size], visible, context)
        return StepInputs(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            attention=AttentionBatch(self.slots[:size], [], 0, [group]),
            sample_rows=torch.arange(size, device=self.model.device),
            sample_requests=[],
        )

    def _logits(self, size: int) -> torch.Tensor:
        hidden = forward(self.model, self._step_inputs(size), self.kv.tensor)
        return self.model.logits(hidden)

    def _record(self, size: int, capture: bool) -> Callable[[], torch.Tensor]:
        """A call that runs the step of `size` rows over the static buffers: a graph's
        replay when capturing, the eager model otherwise."""
        if not capture:
            return lambda: self._logits(size)
        # Warm up on a side stream first: Triton compiles and cuBLAS picks its kernels
        # there, outside the capture (torch.cuda.graphs' recommended pattern).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._logits(size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._logits(size)
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits  # rewritten in place by every replay

        return replay


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with its last row repeated up to `rows` rows."""
    missing = rows - tensor.shape[0]
    if missing == 0:
        return tensor
    return torch.cat([tensor, tensor[-1:].expand(missing, *tensor.shape[1:])])
