"""The decode mask (DecodeGroup.visible) is built only for the backends that read it.

The Triton kernel bounds each sequence's keys by context_lens and never reads the
[n, 1, 1, keys] boolean mask, so on the Triton path (CUDA) the model runner builds none,
neither on the host each eager step nor inside a captured decode graph; the CPU path
(the compiled kernel, SDPA) builds it as before. There is no GPU here: the Triton path is
chosen through model_runner.runs_triton, the one switch the runner asks. sdpa_decode,
the fallback that reads a mask, derives it from context_lens where a group has none.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from appliance.engine import model_runner
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.model_runner import DecodeGraphs, ModelRunner
from appliance.engine.sampling.sampler import Sampler
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.model.layers.paged_attention import DecodeGroup, sdpa_decode

BLOCK_SIZE = 16
CONTEXTS = (5, 17, 40)  # decodes of 1, 2 and 3 blocks: the table is padded


def _decode_step() -> SchedulerOutput:
    """Three decodes with blocks of their own (ids from 0 up)."""
    out, free = SchedulerOutput(), iter(range(100))
    for index, context in enumerate(CONTEXTS):
        tokens = [(index * 11 + i) % 500 + 10 for i in range(context + 1)]
        seq = Sequence(index, tokens, SamplingParams(), num_computed_tokens=context)
        seq.block_table = [next(free) for _ in range(-(-(context + 1) // BLOCK_SIZE))]
        out.decodes.append(ScheduledChunk(seq, 1))
    return out


@pytest.fixture
def runner(make_engine: Callable[..., LLMEngine]) -> ModelRunner:
    engine = make_engine(block_size=BLOCK_SIZE, num_blocks=64)
    return ModelRunner(engine.model, engine.kv, Sampler(engine.model.device))


def test_the_cpu_path_still_builds_the_mask(runner: ModelRunner) -> None:
    (group,) = runner.prepare(_decode_step()).attention.decode_groups
    assert group.visible is not None
    keys = torch.arange(group.block_tables.shape[1] * BLOCK_SIZE)
    want = keys[None, :] < torch.tensor(CONTEXTS)[:, None] + 1
    assert torch.equal(group.visible[:, 0, 0], want)


def test_the_triton_paths_batch_carries_no_mask(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = runner.prepare(_decode_step()).attention.decode_groups[0]
    monkeypatch.setattr(model_runner, "runs_triton", lambda device: True)
    (group,) = runner.prepare(_decode_step()).attention.decode_groups
    assert group.visible is None
    # What the kernel does read is unchanged.
    assert torch.equal(group.block_tables, cpu.block_tables)
    assert torch.equal(group.context_lens, cpu.context_lens)


def test_a_decode_graph_on_the_triton_path_builds_no_mask(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    graphs = DecodeGraphs(runner.model, runner.kv, (1, 2), 64, capture=False)
    assert graphs._step_inputs(2).attention.decode_groups[0].visible is not None
    monkeypatch.setattr(model_runner, "runs_triton", lambda device: True)
    assert graphs._step_inputs(2).attention.decode_groups[0].visible is None


def test_sdpa_decode_derives_a_missing_mask_from_the_context() -> None:
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16)
    tables = torch.tensor([[1, 2, 0], [3, 4, 5]])  # [2, 3]: the first padded
    lens = torch.tensor([6, 11])
    keys = torch.arange(12)
    visible = (keys[None, :] < lens[:, None])[:, None, None, :]
    q = torch.randn(2, 4, 16)
    for window in (None, 4):
        built = sdpa_decode(
            q, k_cache, v_cache, DecodeGroup(None, tables, visible, lens), 0.25, window
        )
        derived = sdpa_decode(
            q, k_cache, v_cache, DecodeGroup(None, tables, None, lens), 0.25, window
        )
        assert torch.equal(built, derived)
