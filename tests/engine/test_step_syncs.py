"""Where a step reads the device: once, for the sampled token ids, and nowhere else.

On a GPU every read of a device tensor from the host (`.tolist()`, `.item()`, `int(t)`,
`.cpu()`, a boolean mask, `nonzero`) waits for all the work queued before it, so a step
that reads per row or per tensor stalls the GPU that many times. On the CPU nothing waits,
but the same calls happen: a torch function mode counts them while the model runner and
the sampler run a step, which makes the sync points explicit and testable here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.model_runner import (
    DecodeGraphs,
    ModelRunner,
    StepInputs,
    forward,
    map_tensors,
    move_to,
    pack_to,
)
from appliance.engine.sampling.sampler import Sampler, SampleRow
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.model.layers.paged_attention import AttentionBatch, DecodeGroup, PrefillSegment

# Tensor calls that hand a value to the host (on CUDA: wait for the device).
READS = {
    "tolist",
    "item",
    "__int__",
    "__float__",
    "__bool__",
    "__index__",
    "cpu",
    "numpy",
    "nonzero",
    "masked_select",
    "unique",
}


class HostReads(TorchFunctionMode):
    """Records every torch call that reads a tensor's values on the host, by name; a
    boolean-mask index (a hidden nonzero) counts as `mask_index`."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads.append(name)
        elif name in ("__getitem__", "__setitem__") and _has_bool_index(args[1]):
            self.reads.append("mask_index")
        return func(*args, **(kwargs or {}))


def _has_bool_index(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def counted(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """fn()'s result and the host reads it made."""
    with HostReads() as mode:
        result = fn()
    return result, mode.reads


def gpu_sampler(device: torch.device) -> Sampler:
    """A sampler that cuts top-p as it does on a GPU (a sort of each row): the reads
    counted here are the GPU's. On a CPU top-p's cut is found from each row's largest
    probabilities, sized by reading the device (free there; the random-rows test shows it)."""
    sampler = Sampler(device)
    sampler.sort_top_p = True
    return sampler


@pytest.fixture
def runner(make_engine: Callable[..., LLMEngine]) -> ModelRunner:
    """A model runner over the real model (float32, CPU) with its own pool and sampler."""
    engine = make_engine(block_size=16, num_blocks=64)
    return ModelRunner(engine.model, engine.kv, gpu_sampler(engine.model.device))


def step_of(
    prefills: list[tuple[int, int, SamplingParams]],
    decodes: list[tuple[int, SamplingParams]],
    block_size: int = 16,
) -> SchedulerOutput:
    """A hand-made step: prefill chunks (prompt length, chunk length, params: the chunk
    completes the prompt when both lengths agree) and decodes (context length, params),
    each sequence with blocks of its own."""
    out = SchedulerOutput()
    free = iter(range(1000))
    for index, (prompt_len, chunk_len, params) in enumerate(prefills):
        seq = Sequence(index, [(index * 7 + i) % 500 + 10 for i in range(prompt_len)], params)
        out.prefills.append(ScheduledChunk(seq, chunk_len))
    for index, (context, params) in enumerate(decodes):
        tokens = [(index * 11 + i) % 500 + 10 for i in range(context + 1)]
        seq = Sequence(100 + index, tokens, params, num_computed_tokens=context)
        out.decodes.append(ScheduledChunk(seq, 1))
    for chunk in out.chunks:
        needed = blocks_for_tokens(chunk.start + chunk.num_tokens, block_size)
        chunk.seq.block_table = [next(free) for _ in range(needed)]
    return out


MIXED = step_of(
    prefills=[
        (20, 20, SamplingParams(temperature=0.8, top_p=0.9, seed=5)),  # completes
        (40, 16, SamplingParams(temperature=1.0)),  # first chunk of a longer prompt
    ],
    decodes=[
        (17, SamplingParams()),  # greedy
        (33, SamplingParams(temperature=1.2)),  # unseeded
        (5, SamplingParams(temperature=0.9, top_k=8, seed=11)),
        (48, SamplingParams(temperature=0.7, top_k=20, top_p=0.8)),
    ],
)


def test_a_mixed_step_reads_the_device_once(runner: ModelRunner) -> None:
    tokens, reads = counted(lambda: runner.run(MIXED))
    assert reads == ["tolist"]  # the sampled ids, all rows at once
    # Every completed chunk got a token: the one prefill that completes and each decode.
    assert sorted(tokens) == [0, 100, 101, 102, 103]
    assert all(isinstance(t, int) for t in tokens.values())


def test_a_greedy_decode_step_reads_the_device_once(runner: ModelRunner) -> None:
    out = step_of([], [(n, SamplingParams()) for n in (3, 16, 17, 40)])
    tokens, reads = counted(lambda: runner.run(out))
    assert reads == ["tolist"]
    assert len(tokens) == 4


def test_a_step_that_samples_nothing_reads_nothing(runner: ModelRunner) -> None:
    out = step_of([(40, 16, SamplingParams(temperature=1.0, seed=1))], [])
    tokens, reads = counted(lambda: runner.run(out))
    assert tokens == {}
    assert reads == []


def test_sampling_reads_once_however_many_random_rows() -> None:
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    requests = [
        SampleRow(
            i, SamplingParams(temperature=0.5 + i / 10, top_k=i % 5, top_p=0.5 + i / 40, seed=i)
        )
        for i in range(16)
    ]
    sampled, reads = counted(lambda: gpu_sampler(torch.device("cpu")).sample(logits, requests))
    tokens = sampled.token_ids
    assert reads == ["tolist"]
    assert len(tokens) == 16
    # The CPU's own way reads the device to size top-p's search and to see a cut through
    # equal probabilities, then gives every row the same tokens.
    cpu = Sampler(torch.device("cpu"))
    assert not cpu.sort_top_p
    on_cpu, cpu_reads = counted(lambda: cpu.sample(logits, requests))
    assert cpu_reads[-1] == "tolist" and set(cpu_reads[:-1]) == {"__bool__"}
    assert on_cpu.token_ids == tokens


def test_processing_and_logprobs_still_read_once() -> None:
    # Penalties, logit_bias, min_tokens, min_p and logprobs (raw and processed) in one
    # batch with plain rows: still one read, the tokens and logprobs packed together.
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    ids = [3, 9, 9, 12, 3, 40]  # a prompt of 2, then 4 outputs
    rows = [
        SampleRow(0, SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), ids, 2),
        SampleRow(1, SamplingParams(logit_bias=((7, 3.0),), logprobs=5, seed=1, temperature=1)),
        SampleRow(2, SamplingParams(min_tokens=9, logprobs=2, processed_logprobs=True), ids, 2),
        SampleRow(3, SamplingParams(temperature=0.8, min_p=0.1, presence_penalty=1), ids, 2),
        SampleRow(4, SamplingParams()),
    ]
    sampled, reads = counted(lambda: Sampler(torch.device("cpu")).sample(logits, rows))
    assert reads == ["tolist"]
    assert len(sampled.token_ids) == 5
    assert [lp is not None for lp in sampled.logprobs] == [False, True, True, False, False]


def test_the_counter_sees_per_row_reads() -> None:
    # What the sampler did before: one read per random row. The counter must see each,
    # or the tests above could not fail.
    logits = torch.randn(4, 8)

    def per_row() -> list[int]:
        return [int(torch.multinomial(row.softmax(-1), 1)) for row in logits]

    _, reads = counted(per_row)
    assert reads == ["__int__"] * 4
    _, reads = counted(lambda: logits[logits > 0])
    assert reads == ["mask_index"]


# Moving step inputs: the CPU keeps them as they are; CUDA gets one packed copy per dtype.


def host_inputs(runner: ModelRunner) -> StepInputs:
    return runner.prepare(MIXED)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors inside step inputs, in order."""
    found: list[torch.Tensor] = []
    map_tensors(value, found.append)
    return found


def test_move_to_the_cpu_keeps_the_very_same_tensors(runner: ModelRunner) -> None:
    inputs = host_inputs(runner)
    moved = move_to(inputs, torch.device("cpu"))
    assert all(a is b for a, b in zip(tensors_of(inputs), tensors_of(moved), strict=True))


def test_packing_keeps_every_value_shape_and_dtype(runner: ModelRunner) -> None:
    inputs = host_inputs(runner)
    packed = pack_to(inputs, torch.device("cpu"), pin=False)
    before, after = tensors_of(inputs), tensors_of(packed)
    assert len(before) == len(after) > 5
    for a, b in zip(before, after, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    assert packed.sample_requests == inputs.sample_requests
    assert isinstance(packed.attention, AttentionBatch)
    assert isinstance(packed.attention.prefills[0], PrefillSegment)
    assert isinstance(packed.attention.decode_groups[0], DecodeGroup)
    # One buffer per dtype: every int64 input is a view of the same storage.
    storages = {t.untyped_storage().data_ptr() for t in after if t.dtype == torch.int64}
    assert len(storages) == 1


def test_packing_leaves_tensors_already_there() -> None:
    @dataclass
    class Pair:
        here: torch.Tensor
        there: list[torch.Tensor]

    meta = torch.empty(3, device="meta")
    pair = pack_to(Pair(meta, [torch.arange(4)]), torch.device("meta"), pin=False)
    assert pair.here is meta
    assert pair.there[0].device.type == "meta" and pair.there[0].shape == (4,)


def test_a_packed_step_runs_like_the_host_one(make_engine: Callable[..., LLMEngine]) -> None:
    # The model reads views of one buffer per dtype as it reads separate tensors.
    def run(pack: bool) -> torch.Tensor:
        engine = make_engine(block_size=16, num_blocks=64)
        runner = ModelRunner(engine.model, engine.kv, Sampler(engine.model.device))
        inputs = runner.prepare(MIXED)
        if pack:
            inputs = pack_to(inputs, engine.model.device, pin=False)
        hidden = forward(engine.model, inputs, engine.kv.tensor)
        return engine.model.logits(hidden[inputs.sample_rows])

    assert torch.equal(run(pack=True), run(pack=False))


# Decode graphs: on the CPU the static buffers and the padding run eagerly (capture False);
# what the graphs replay on a GPU is exactly this.


class CountedGraphs(DecodeGraphs):
    """DecodeGraphs that count the steps they ran, by padded size."""

    def __init__(self, engine: LLMEngine, sizes: tuple[int, ...], max_len: int) -> None:
        super().__init__(engine.model, engine.kv, sizes, max_len, capture=False)
        self.ran: list[int] = []
        for size, step in list(self._steps.items()):
            self._steps[size] = self._counting(size, step)

    def _counting(self, size: int, step: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        def run() -> torch.Tensor:
            self.ran.append(size)
            return step()

        return run


GREEDY = SamplingParams(max_tokens=12)


def prompts_for(engine: LLMEngine, lengths: tuple[int, ...]) -> list[list[int]]:
    text = "Graphs replay a whole decode step in one launch; padding rows copy the last."
    ids = engine.tokenizer.encode(text * 6)
    return [ids[:n] for n in lengths]


@pytest.mark.parametrize("lengths", [(9,), (5, 17, 30), (3, 8, 16, 21, 33)])
def test_graph_steps_give_the_eager_tokens(
    make_engine: Callable[..., LLMEngine], lengths: tuple[int, ...]
) -> None:
    eager, graphed = make_engine(), make_engine()
    graphs = CountedGraphs(graphed, (1, 2, 4, 8), max_len=128)
    graphed.runner.decode_graphs = graphs
    prompts = prompts_for(eager, lengths)
    expected = [c.token_ids for c in eager.generate(prompts, GREEDY)]
    assert [c.token_ids for c in graphed.generate(prompts, GREEDY)] == expected
    # Every decode step went through a graph, padded to the next captured size.
    padded = {1: 1, 3: 4, 5: 8}[len(lengths)]
    assert graphs.ran == [padded] * (GREEDY.max_tokens - 1)
    assert graphed.num_free_blocks == graphed.kv.num_blocks


def test_graph_step_reads_the_device_once(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    graphs = CountedGraphs(engine, (4,), max_len=128)
    engine.runner.decode_graphs = graphs
    out = step_of([], [(n, SamplingParams(temperature=1.0, seed=n)) for n in (3, 16, 40)])
    tokens, reads = counted(lambda: engine.runner.run(out))
    assert graphs.ran == [4]
    assert reads == ["tolist"]
    assert sorted(tokens) == [100, 101, 102]


def test_steps_graphs_cannot_take_run_eagerly(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    graphs = CountedGraphs(engine, (2,), max_len=32)
    engine.runner.decode_graphs = graphs
    runner = engine.runner
    assert not graphs.takes(runner.prepare(MIXED))  # prefills in the step
    too_many = step_of([], [(4, SamplingParams())] * 3)
    too_long = step_of([], [(40, SamplingParams())])  # 3 blocks of 16 > 32 tokens
    assert not graphs.takes(runner.prepare(too_many))
    assert not graphs.takes(runner.prepare(too_long))
    assert graphs.takes(runner.prepare(step_of([], [(20, SamplingParams())] * 2)))
    runner.run(too_long)
    assert graphs.ran == []


def test_decode_graphs_need_cuda(make_engine: Callable[..., LLMEngine]) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        make_engine().runner.enable_decode_graphs((1, 2), max_len=64)
