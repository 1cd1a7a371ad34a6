"""KV pool sizing on a GPU (kv/sizing.py) on plain numbers, its wiring in load_shard's
pool_blocks (engine/kv_pool_sizing.py), the profiled dummy step (run here on the CPU), and
the start-up report.

The device numbers are representative of the cards named, not recordings: torch reports
79.35 GiB for an 80 GB A100 and 23.65 GiB for a 24 GB RTX 4090."""

from __future__ import annotations

import asyncio
import os
import types
from collections.abc import Callable

import pytest
import torch

from appliance.engine import kv_pool_sizing
from appliance.engine.kv_pool_sizing import fewest_blocks, pool_blocks, profile_step
from appliance.engine.llm_engine import LLMEngine
from appliance.kv.cache import KVCache, KVLayout
from appliance.kv.sizing import (
    GIB,
    MIB,
    DeviceMemory,
    StepShape,
    bytes_per_block,
    describe_gpu_pool,
    gpu_kv_blocks,
    profile_step_shape,
)
from appliance.model.tensor_parallel import Shard, kv_head_ranges
from appliance.pools.supervisor import Supervisor
from appliance.pools.worker_handle import WorkerHandle
from appliance.settings.config import BatchSettings, load_settings
from appliance.workers.messages import Ready

A100_80GB = 85_198_045_184
RTX4090_24GB = 25_393_692_672
CUDA_CONTEXT = 500 * MIB  # what the driver holds besides torch's tensors

# Llama-3-8B: 32 layers, 8 KV heads of 128, bfloat16 weights of 8.03e9 parameters.
LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}
LLAMA3_8B_WEIGHTS = 16_060_522_496
# A 10.7e9-parameter model (SOLAR-10.7B's shape): 48 layers, 8 KV heads of 128, bfloat16.
SOLAR_11B = {"num_layers": 48, "num_kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}
SOLAR_11B_WEIGHTS = 21_400_000_000


@pytest.fixture(autouse=True)
def default_kv_and_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No APPLIANCE_KV__* or APPLIANCE_BATCH__* variable from outside changes the sizing."""
    for name in list(os.environ):
        if name.upper().startswith(("APPLIANCE_KV__", "APPLIANCE_BATCH__")):
            monkeypatch.delenv(name)


def block_bytes(model: dict, block_size: int = 16, num_kv_heads: int | None = None) -> int:
    heads = model["num_kv_heads"] if num_kv_heads is None else num_kv_heads
    return bytes_per_block(
        model["num_layers"], block_size, heads, model["head_dim"], model["dtype_bytes"]
    )


def alone_on(total: int, weights: int, step_peak: int) -> DeviceMemory:
    """A worker alone on its GPU: everything but the driver's context and its weights free."""
    return DeviceMemory(total, total - CUDA_CONTEXT - weights, weights, step_peak)


# ---------------------------------------------------------------- bytes per block


def test_a_block_holds_k_and_v_of_every_layer() -> None:
    assert block_bytes(LLAMA3_8B) == 2 * MIB  # 128 KiB per token
    assert block_bytes(LLAMA3_8B, block_size=32) == 4 * MIB
    assert block_bytes(LLAMA3_8B, num_kv_heads=3) == 3 * block_bytes(LLAMA3_8B, num_kv_heads=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_per_block_agrees_with_the_pool_tensor(dtype: torch.dtype) -> None:
    layout = KVLayout(30, 16, 3, 64, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    assert bytes_per_block(30, 16, 3, 64, size) == layout.bytes_per_block()
    pool = KVCache(layout, 4, torch.device("cpu"))
    assert pool.tensor.numel() * size == 4 * layout.bytes_per_block()


# ---------------------------------------------------------------- blocks for a GPU


def test_an_8b_model_on_an_80gb_card_gets_the_card_not_512_mib() -> None:
    memory = alone_on(A100_80GB, LLAMA3_8B_WEIGHTS, step_peak=int(1.3 * GIB))
    blocks = gpu_kv_blocks(memory, 0.9, block_bytes(LLAMA3_8B))
    # 0.9 x 79.35 GiB - 14.96 GiB weights - 1.30 GiB step = 55.15 GiB of 2 MiB blocks.
    assert blocks == 28_239
    assert blocks * 16 == 451_824  # tokens of context
    # What the fixed kv.memory_mb=512 bought before: 4,096 tokens.
    old = KVLayout(32, 16, 8, 128, torch.bfloat16).blocks_for_budget(512 * MIB)
    assert old * 16 == 4_096
    assert gpu_kv_blocks(memory, 0.5, block_bytes(LLAMA3_8B)) < blocks // 2


def test_a_model_too_large_for_its_share_of_a_24gb_card_says_why() -> None:
    memory = alone_on(RTX4090_24GB, SOLAR_11B_WEIGHTS, step_peak=int(1.5 * GIB))
    with pytest.raises(ValueError) as info:
        gpu_kv_blocks(memory, 0.9, block_bytes(SOLAR_11B))
    message = str(info.value)
    assert "weights take 19.93 GiB of the GPU's 23.65 GiB" in message
    assert "a profiled step 1.50 GiB" in message
    assert "gpu_memory_utilization=0.9 (21.28 GiB for this worker)" in message
    assert "no room is left for the KV cache" in message
    assert "raise kv.gpu_memory_utilization" in message
    # A larger share leaves room: 1.04 GiB of 3 MiB blocks.
    assert gpu_kv_blocks(memory, 0.95, block_bytes(SOLAR_11B)) == 353


def test_other_processes_on_the_gpu_cap_the_pool_at_what_is_free() -> None:
    weights, peak = LLAMA3_8B_WEIGHTS, int(1.3 * GIB)
    crowded = DeviceMemory(A100_80GB, free=10 * GIB, weights=weights, step_peak=peak)
    assert gpu_kv_blocks(crowded, 0.9, 2 * MIB) == (10 * GIB - peak) // (2 * MIB)
    full = DeviceMemory(A100_80GB, free=GIB, weights=weights, step_peak=peak)
    with pytest.raises(ValueError) as info:
        gpu_kv_blocks(full, 0.9, 2 * MIB)
    message = str(info.value)
    assert "only 1.00 GiB of the GPU's 79.35 GiB are free" in message
    assert "other processes" in message and "1.30 GiB" in message


def test_block_size_32_holds_the_same_context_in_half_the_blocks() -> None:
    memory = alone_on(A100_80GB, LLAMA3_8B_WEIGHTS, step_peak=int(1.3 * GIB))
    small = gpu_kv_blocks(memory, 0.9, block_bytes(LLAMA3_8B, block_size=16))
    large = gpu_kv_blocks(memory, 0.9, block_bytes(LLAMA3_8B, block_size=32))
    assert (small, large) == (28_239, 14_119)
    assert 0 <= small * 16 - large * 32 < 32  # the same bytes, cut in coarser pieces


def test_tp_shards_with_uneven_kv_heads_agree_on_the_fewest_blocks() -> None:
    # Llama-3-8B's 8 KV heads over 3 GPUs: 3, 3 and 2 heads; weights split about evenly.
    heads = [len(r) for r in kv_head_ranges(8, 3)]
    assert heads == [3, 3, 2]
    memory = alone_on(A100_80GB, LLAMA3_8B_WEIGHTS // 3, step_peak=int(0.6 * GIB))
    own = [gpu_kv_blocks(memory, 0.9, block_bytes(LLAMA3_8B, num_kv_heads=h)) for h in heads]
    assert own[2] > own[0] == own[1]  # fewer heads: smaller blocks, more of them
    agreed = [
        fewest_blocks(own[rank], Shard(rank, 3), sum_over(own, rank), torch.device("cpu"))
        for rank in range(3)
    ]
    assert agreed == [own[0]] * 3
    # A shard that measured less free memory (another process on its GPU) sets the count.
    own[2] = 1_000
    assert fewest_blocks(own[0], Shard(0, 3), sum_over(own, 0), torch.device("cpu")) == 1_000


def sum_over(counts: list[int], rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An all_reduce (sum) as shard `rank` of a group would see it, the others' slots
    holding their own counts."""

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        assert x.tolist() == [counts[rank] if i == rank else 0 for i in range(len(counts))]
        return x.copy_(torch.tensor(counts, dtype=x.dtype))

    return all_reduce


def test_a_whole_model_keeps_its_own_count_without_a_collective() -> None:
    def no_collective(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a one-shard worker has no group to ask")

    assert fewest_blocks(77, Shard(0, 1), no_collective, torch.device("cpu")) == 77


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_a_utilization_outside_zero_to_one_is_refused(utilization: float) -> None:
    memory = alone_on(A100_80GB, LLAMA3_8B_WEIGHTS, step_peak=GIB)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        gpu_kv_blocks(memory, utilization, 2 * MIB)


def test_the_start_up_line_names_blocks_tokens_and_the_numbers() -> None:
    memory = alone_on(A100_80GB, LLAMA3_8B_WEIGHTS, step_peak=int(1.3 * GIB))
    line = describe_gpu_pool(memory, 0.9, 28_239, 2 * MIB, 16)
    assert line.startswith("28239 KV blocks of 16 tokens = 451824 tokens (55.15 GiB)")
    assert "0.9 of the GPU's 79.35 GiB" in line and "weights' 14.96 GiB" in line


# ---------------------------------------------------------------- the profiled step's shape


def test_the_profiled_step_fills_the_budget_and_the_sequence_limit() -> None:
    shape = profile_step_shape(64, 2048, 512, 8192)  # the default batch settings
    assert shape == StepShape((512, 512, 512, 452), 60)
    assert (shape.num_tokens, shape.num_seqs) == (2048, 64)
    assert shape.num_blocks(16) == 3 * 32 + 29 + 60


@pytest.mark.parametrize("max_num_seqs", [1, 2, 4, 5, 64, 256, 5000])
@pytest.mark.parametrize("budget", [16, 100, 2048])
@pytest.mark.parametrize("chunk_size", [16, 512])
@pytest.mark.parametrize("max_model_len", [16, 100, 8192])
def test_the_profiled_step_is_one_the_scheduler_can_form(
    max_num_seqs: int, budget: int, chunk_size: int, max_model_len: int
) -> None:
    shape = profile_step_shape(max_num_seqs, budget, chunk_size, max_model_len)
    chunk = min(chunk_size, budget, max_model_len - 1)
    assert shape.num_tokens <= budget and shape.num_seqs <= max_num_seqs
    assert shape.prefill_chunks and all(0 < c <= chunk for c in shape.prefill_chunks)
    assert shape.num_tokens == min(budget, max_num_seqs * chunk)  # the most tokens a step has


def test_a_bad_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        profile_step_shape(0, 2048, 512, 8192)
    with pytest.raises(ValueError, match="max_model_len"):
        profile_step_shape(64, 2048, 512, 1)


def test_the_profiled_step_runs_the_model_over_its_pool(engine: LLMEngine) -> None:
    """On the CPU too, though load_shard runs it on a GPU only."""
    cfg = engine.model.config
    layout = KVLayout(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    shape = profile_step_shape(5, 64, 24, 8192)
    assert shape == StepShape((24, 24, 14), 2)
    probe = KVCache(layout, shape.num_blocks(16), engine.model.device)
    assert profile_step(engine.model, probe, shape, head=True) == 64
    # Every block the dummy sequences hold got keys: 2 + 2 + 1 prompt blocks, 2 decodes.
    written = probe.tensor[0, 0].abs().sum(dim=(1, 2, 3)) > 0
    assert written.tolist() == [True] * probe.num_blocks


# ---------------------------------------------------------------- pool_blocks: which rule sizes


def fake_model(device: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(device=torch.device(device))


LAYOUT = KVLayout(32, 16, 8, 128, torch.bfloat16)  # 2 MiB blocks


def test_the_cpu_keeps_memory_mb_whether_given_or_not() -> None:
    for settings in (load_settings(), load_settings(kv={"memory_mb": 512})):
        assert pool_blocks(settings, fake_model("cpu"), LAYOUT, LAYOUT, 8192) == 256
    settings = load_settings(kv={"memory_mb": 64})
    assert pool_blocks(settings, fake_model("cpu"), LAYOUT, LAYOUT, 8192) == 32


def test_memory_mb_given_or_num_blocks_override_the_fraction_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_measuring(*args: object, **kwargs: object) -> DeviceMemory:
        raise AssertionError("a given memory_mb or num_blocks needs no profiling")

    monkeypatch.setattr(kv_pool_sizing, "measure_gpu", no_measuring)
    gpu = fake_model("cuda")
    assert pool_blocks(load_settings(kv={"memory_mb": 512}), gpu, LAYOUT, LAYOUT, 8192) == 256
    settings = load_settings(kv={"num_blocks": 7, "memory_mb": 512})
    assert pool_blocks(settings, gpu, LAYOUT, LAYOUT, 8192) == 7


def test_a_gpu_sizes_by_the_fraction_after_profiling(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    measured = []

    def measure(
        model: object, layout: KVLayout, batch: BatchSettings, max_len: int, head: bool
    ) -> DeviceMemory:
        measured.append((layout, batch.max_num_batched_tokens, max_len, head))
        return alone_on(A100_80GB, LLAMA3_8B_WEIGHTS, step_peak=int(1.3 * GIB))

    monkeypatch.setattr(kv_pool_sizing, "measure_gpu", measure)
    settings = load_settings(kv={"gpu_memory_utilization": 0.9})
    with caplog.at_level("INFO", logger="appliance.engine"):
        assert pool_blocks(settings, fake_model("cuda"), LAYOUT, LAYOUT, 8192) == 28_239
    assert measured == [(LAYOUT, 2048, 8192, True)]
    assert "KV pool on cuda: 28239 KV blocks of 16 tokens = 451824 tokens" in caplog.text
    settings = load_settings(kv={"gpu_memory_utilization": 0.2})
    with pytest.raises(ValueError, match="no room is left for the KV cache"):
        pool_blocks(settings, fake_model("cuda"), LAYOUT, LAYOUT, 8192)


# ---------------------------------------------------------------- the report at start


def test_a_ready_worker_is_logged_with_the_context_its_pool_holds() -> None:
    supervisor = Supervisor(load_settings(device="cpu", cpu_devices=1, mode="colocated"))
    loop = asyncio.new_event_loop()
    try:
        supervisor.processes.all_ready = loop.create_future()
        supervisor.workers[0] = WorkerHandle(0, "colocated", 0, "cpu0", (0,), None, None)
        supervisor._dispatch(Ready(0, 182))
    finally:
        loop.close()
    assert supervisor.events[-1].kind == "worker"
    assert supervisor.events[-1].message == (
        "worker 0 (colocated) loaded on cpu0: its 182 KV blocks of 16 tokens hold 2912 "
        "tokens of context"
    )
