"""Timing hand-made model steps on a loaded engine: prompt chunks, decodes, and both mixed.

The steps are built as the scheduler builds them (a `SchedulerOutput` of chunks over
sequences holding KV blocks) and run by the engine's own `ModelRunner`, so a measured
step takes the path a worker's step takes (compiled CPU step, Triton, CUDA). The KV the
steps read is whatever the pool holds: attention costs the same on any values.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence, SequenceStatus
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.planner.profile import attended

# (start, tokens) of one prompt chunk; a decode of a sequence of `context` tokens.
Chunk = tuple[int, int]


@dataclass(frozen=True)
class StepShape:
    """A step to time: prompt chunks and the context lengths of its decodes."""

    chunks: tuple[Chunk, ...] = ()
    decodes: tuple[int, ...] = ()

    @property
    def kind(self) -> str:
        if self.chunks and self.decodes:
            return "mixed"
        return "prefill" if self.chunks else "decode"

    def features(self) -> dict[str, int]:
        """The StepCost features of this step (see planner/profile.py), and the prompt
        chunks' share of its tokens (what decides the kernel regime)."""
        prompt = sum(n for _, n in self.chunks)
        return {
            "tokens": prompt + len(self.decodes),
            "seqs": len(self.chunks) + len(self.decodes),
            "attended": sum(attended(start, n) for start, n in self.chunks),
            "context": sum(self.decodes),
            "prompt_tokens": prompt,
        }

    def blocks(self, block_size: int) -> int:
        """KV blocks the step's sequences hold."""
        prompts = sum(blocks_for_tokens(s + n, block_size) for s, n in self.chunks)
        return prompts + sum(blocks_for_tokens(c, block_size) for c in self.decodes)


@dataclass(frozen=True)
class Sample:
    """One timed step shape: its kind, features and median seconds."""

    kind: str
    tokens: int
    seqs: int
    attended: int
    context: int
    seconds: float
    prompt_tokens: int = 0
    gemm_rows: int | None = None  # the engine's prefill_gemm_rows (None: no switch)

    def as_dict(self) -> dict[str, float | int | str]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def default_shapes(max_tokens: int, chunk_size: int, block_size: int) -> list[StepShape]:
    """The shapes `appliance profile` times: prompt chunks of growing size and offset,
    decode batches of growing size and context, and chunks beside decodes; each within a
    pool of `max_tokens` tokens (in blocks of `block_size`) and chunks of at most
    `chunk_size`."""
    # Short prompts too: both sides of the quantized kernels' switch to a GEMM (16 to 64
    # prompt tokens by the auto table) need two sizes each for a line of their own.
    sizes = [n for n in (4, 8, 16, 32, 48, 64, 128, 256, 512, 1024) if n <= chunk_size]
    shapes = [StepShape(chunks=((0, n),)) for n in sizes]
    shapes += [StepShape(chunks=((s, sizes[-1]),)) for s in (sizes[-1], 3 * sizes[-1])]
    shapes += [StepShape(chunks=((0, 64),) * 4)]  # several short prompts in one step
    # Two long prompts' chunks in one step, as a prefill worker's budget lets them run.
    shapes += [StepShape(chunks=((0, sizes[-1]),) * 2)]
    for batch, context in itertools.product((1, 4, 16, 32, 64), (64, 256, 1024)):
        shapes.append(StepShape(decodes=(context,) * batch))
    for n, batch in ((64, 8), (256, 8), (sizes[-1], 16), (128, 32)):
        shapes.append(StepShape(chunks=((0, min(n, chunk_size)),), decodes=(256,) * batch))
    return [s for s in shapes if s.blocks(block_size) * block_size <= max_tokens]


class StepProbe:
    """Runs and times hand-made steps on one engine's model runner."""

    def __init__(self, engine: LLMEngine, repeats: int = 3) -> None:
        self.engine = engine
        self.repeats = repeats
        self._ids = itertools.count(1 << 40)  # never an id the engine itself hands out
        self._sync = _synchronizer(engine.kv.tensor.device)

    def time(self, shape: StepShape) -> Sample:
        """The median time of `repeats` runs of the step, after one untimed run."""
        out = self._build(shape)
        try:
            runs = [self._run_once(out) for _ in range(self.repeats + 1)][1:]
        finally:
            self._free(out)
        gemm = self.engine.model.prefill_gemm
        return Sample(
            shape.kind,
            **shape.features(),
            seconds=statistics.median(runs),
            gemm_rows=gemm.rows if gemm is not None else None,
        )

    def _run_once(self, out: SchedulerOutput) -> float:
        self._sync()
        began = time.perf_counter()
        self.engine.runner.run(out)
        self._sync()
        return time.perf_counter() - began

    def _build(self, shape: StepShape) -> SchedulerOutput:
        out = SchedulerOutput()
        for start, n in shape.chunks:
            out.prefills.append(ScheduledChunk(self._sequence(start + n, start), n))
        for context in shape.decodes:
            out.decodes.append(ScheduledChunk(self._sequence(context, context - 1), 1))
        return out

    def _sequence(self, length: int, computed: int) -> Sequence:
        """A running sequence of `length` tokens whose first `computed` are in the cache."""
        vocab = self.engine.model.config.vocab_size
        tokens = [(7 * i + 11) % vocab for i in range(length)]
        params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
        seq = Sequence(next(self._ids), tokens, params, status=SequenceStatus.RUNNING)
        seq.num_computed_tokens = computed
        blocks = blocks_for_tokens(length, self.engine.kv.block_size)
        seq.block_table = self.engine.kv.allocator.allocate(blocks)
        return seq

    def _free(self, out: SchedulerOutput) -> None:
        for chunk in out.chunks:
            self.engine.kv.allocator.free(chunk.seq.block_table)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits for queued device work, so a step's time is the device's, not the launch's."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_engine_steps(engine: LLMEngine, batch: int, steps: int) -> float:
    """Median seconds of `engine.step()` (scheduler, model, sampler, detokenizer) over a
    decode batch of `batch` short requests: with `StepProbe` timing the same model step
    alone, the difference is what a worker's loop adds per step."""
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(13 * i + j) % 1000 + 1 for j in range(16)], params)
    engine.step()  # the prompts
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)
