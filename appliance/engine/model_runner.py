"""Turns a SchedulerOutput into tensors, runs the model over the paged cache, samples."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, Protocol

import torch

from appliance.engine.decode_groups import decode_groups
from appliance.engine.sampler import Sampler
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams
from appliance.kv.cache import KVCache
from appliance.model import cpu_kernels
from appliance.model.attention import AttentionBatch, DecodeGroup, PrefillSegment, runs_triton
from appliance.model.llama import CausalLM


@dataclass
class StepInputs:
    """A step's flat token batch and the rows whose logits pick next tokens.

    prepare() makes them on the host; run() moves them to the model's device, and each
    tensor-parallel follower to its own."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    attention: AttentionBatch
    sample_rows: torch.Tensor  # [samples] int64, last row of each completing chunk
    sample_requests: list[tuple[int, SamplingParams]]


def move_to(value: Any, device: torch.device) -> Any:
    """The same step inputs (tensors, lists and dataclasses of them) on another device."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [move_to(v, device) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        return replace(
            value, **{f.name: move_to(getattr(value, f.name), device) for f in fields(value)}
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

    def run(self, out: SchedulerOutput) -> dict[int, int]:
        """Compute the step; return {seq_id: next token} for sequences whose chunk completed."""
        inputs = self.prepare(out)  # built on the host: followers are sent these
        if self.followers is not None:
            self.followers.run_step(inputs)
        if self.device.type != "cpu":
            inputs = move_to(inputs, self.device)
        hidden = forward(self.model, inputs, self.kv.tensor)
        if not inputs.sample_requests:
            return {}
        logits = self.model.logits(hidden[inputs.sample_rows])
        tokens = self.sampler.sample(logits, inputs.sample_requests)
        return {
            seq_id: tok for (seq_id, _), tok in zip(inputs.sample_requests, tokens, strict=True)
        }

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's flat token batch as host (CPU) tensors."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        segments: list[PrefillSegment] = []
        sample_rows: list[int] = []
        requests: list[tuple[int, SamplingParams]] = []
        num_prefills = len(out.prefills)
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
            if chunk.completes:
                sample_rows.append(len(ids) - 1)
                requests.append((chunk.seq.seq_id, chunk.seq.params))
        decode_start = len(ids) - len(out.decodes)
        groups = self._decode_groups(out.decodes)
        return StepInputs(
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            attention=AttentionBatch(self._tensor(slots), segments, decode_start, groups),
            sample_rows=self._tensor(sample_rows),
            sample_requests=requests,
        )

    def _add_tokens(
        self, chunk: ScheduledChunk, ids: list[int], positions: list[int], slots: list[int]
    ) -> None:
        seq, bs = chunk.seq, self.kv.block_size
        span = range(chunk.start, chunk.start + chunk.num_tokens)
        ids.extend(seq.token_ids[span.start : span.stop])
        positions.extend(span)
        slots.extend(seq.block_table[p // bs] * bs + p % bs for p in span)

    def _decode_groups(self, decodes: list[ScheduledChunk]) -> list[DecodeGroup]:
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
        keys = torch.arange(width * self.kv.block_size)
        visible = (keys[None, :] < context[:, None])[:, None, None, :]  # [n, 1, 1, keys]
        return DecodeGroup(rows, self._tensor(tables), visible, context)

    def _tensor(self, values: list) -> torch.Tensor:
        # On the host: one copy per tensor to the device later, none back for followers.
        return torch.tensor(values, dtype=torch.int64)
