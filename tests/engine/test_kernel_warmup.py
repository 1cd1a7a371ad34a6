"""A CUDA worker's Triton kernels run once before Ready (engine/kernel_warmup.py), and a
CPU worker's warm-up runs nothing. No GPU here: CUDA's choice (runs_triton, the handoff's
copy kernel) is switched on, the model's steps run on the CPU path of the real default
model, and the KV copy's launches are recorded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from appliance.engine import kernel_warmup
from appliance.engine.llm_engine import LLMEngine
from appliance.kv import handoff
from appliance.model.layers import triton_attention, triton_kv_copy
from appliance.model.layers.triton_splits import H100_SMS

STEPS = [f"prefill {kernel_warmup.WARM_PROMPT}", "decode", "decode split"]


def test_a_cpu_worker_runs_no_warm_up(make_engine: Callable[..., LLMEngine], monkeypatch) -> None:
    engine = make_engine(num_blocks=64)
    before = engine.kv.tensor.clone()

    def refuse(*args: Any) -> list[str]:
        raise AssertionError("a warm-up step ran on a CPU worker")

    monkeypatch.setattr(kernel_warmup, "warm_model", refuse)
    monkeypatch.setattr(kernel_warmup, "warm_kv_copy", refuse)
    assert kernel_warmup.warm_up(engine, decodes=True, tensor_parallel=False) == []
    assert torch.equal(engine.kv.tensor, before)


@pytest.fixture
def as_cuda(monkeypatch) -> tuple[list[tuple], list[Any]]:
    """CUDA's choices switched on: (the KV copy's recorded calls, the model's steps' batches)."""
    copies: list[tuple] = []
    batches: list[Any] = []
    monkeypatch.setattr(kernel_warmup, "runs_triton", lambda device: True)
    monkeypatch.setattr(handoff, "_TRITON_INSTALLED", True)
    monkeypatch.setattr(handoff, "_gpu", lambda device: 0)  # both pools on GPU 0
    monkeypatch.setattr(triton_kv_copy, "copy_blocks", lambda *args: copies.append(args))
    step = kernel_warmup._step

    def recorded(model: Any, pool: torch.Tensor, inputs: tuple) -> None:
        batches.append(inputs[1])
        step(model, pool, inputs)  # the real model, on its CPU path

    monkeypatch.setattr(kernel_warmup, "_step", recorded)
    return copies, batches


def test_a_decoding_cuda_worker_runs_each_kernel_once_before_ready(
    make_engine: Callable[..., LLMEngine], as_cuda: tuple[list[tuple], list[Any]]
) -> None:
    copies, batches = as_cuda
    engine = make_engine(num_blocks=64)
    assert kernel_warmup.warm_up(engine, decodes=True, tensor_parallel=False) == [
        *STEPS,
        "kv copy",
    ]
    # The copy once, for the worker's pool (its one dtype and layout): block 0 onto itself.
    ((src, src_ids, dst, dst_ids),) = copies
    assert src is engine.kv.tensor and dst is engine.kv.tensor
    assert src_ids == dst_ids == [0]
    # One prompt chunk (the prefill tiles), then two decodes: the plain kernel, and one
    # the flash-decoding rule splits (the split kernel and its reduce), for this model.
    prefill, plain, split = batches
    assert [len(s := prefill.prefills), prefill.decode_start] == [1, kernel_warmup.WARM_PROMPT]
    assert s[0].length == kernel_warmup.WARM_PROMPT
    cfg = engine.model.config
    q = torch.empty(1, cfg.num_heads, cfg.head_dim)  # one decode token
    k_cache = engine.kv.tensor[0, 0]
    splits = [
        triton_attention.choose_splits(q, k_cache, b.decode_groups[0].block_tables, 1, H100_SMS)
        for b in (plain, split)
    ]
    assert splits[0] == 1 and splits[1] > 1, splits


def test_a_prefill_worker_prefills_only_and_a_group_runs_no_step(
    make_engine: Callable[..., LLMEngine], as_cuda: tuple[list[tuple], list[Any]]
) -> None:
    copies, batches = as_cuda
    engine = make_engine(num_blocks=64)
    # A prefill worker neither decodes nor takes handoffs: its prompt step only.
    assert kernel_warmup.warm_up(engine, decodes=False, tensor_parallel=False) == STEPS[:1]
    assert copies == [] and len(batches) == 1
    # A tensor-parallel leader's followers would wait on its step: only its copy runs.
    assert kernel_warmup.warm_up(engine, decodes=True, tensor_parallel=True) == ["kv copy"]
    assert len(batches) == 1 and len(copies) == 1
