"""Tensor parallelism: the split of heads and MLP columns, shards that add up to the whole
model, KV handed between pools of different degrees, and real shard processes over gloo
giving the same greedy outputs as one process.

The e2e tests run on this 2-core machine with CPU devices sharing cores.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest
import torch
from random_models import sharded_prefill
from runtime_runs import QUESTIONS, cpu_topology, run_all, wait_all_free

from appliance.api import Appliance
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.kv.handoff import KVShard, copy_between_shards
from appliance.model.quant import quantize
from appliance.model.tensor_parallel import (
    Shard,
    kv_head_ranges,
    row_parallel_spans,
    shard_plan,
    split_evenly,
)
from appliance.ops.pool_moves import MoveError
from appliance.settings.config import load_settings

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

GREEDY = SamplingParams(max_tokens=16)
# The KV pool of each engine this module makes and of each worker (and shard) it starts:
# 64 MiB holds the 8 questions' blocks several times over, where the 512 MiB default made
# every process zero (and a shared pool copy into shared memory) 512 MiB at each start.
SMALL_POOL = {"memory_mb": 64}


# --- the split, on plain data ----------------------------------------------------------


def test_uneven_splits_are_contiguous_and_larger_first() -> None:
    assert split_evenly(3, 2) == [range(0, 2), range(2, 3)]
    assert split_evenly(1536, 2) == [range(0, 768), range(768, 1536)]
    assert split_evenly(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]


def test_query_heads_follow_their_kv_heads(engine: LLMEngine) -> None:
    cfg = engine.model.config  # SmolLM2: 9 query heads over 3 KV heads
    first, second = (shard_plan(cfg, Shard(r, 2)) for r in range(2))
    assert (first.kv_heads, first.q_heads) == (range(0, 2), range(0, 6))
    assert (second.kv_heads, second.q_heads) == (range(2, 3), range(6, 9))
    assert (first.mlp_columns, second.mlp_columns) == (range(0, 768), range(768, 1536))


def test_more_shards_than_kv_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="degree 4 is more than the model's 3 KV heads"):
        kv_head_ranges(3, 4)
    with pytest.raises(ValueError, match="rank 2 of a group of 2"):
        Shard(2, 2)


# --- shards add up to the whole model --------------------------------------------------


def shard_hidden_states(
    size: int, prompts: list[list[int]], engine: LLMEngine, weights: str, gemm: str = "auto"
) -> torch.Tensor:
    """Hidden states of one batched prefill, computed by `size` shards in lockstep."""
    settings = load_settings(
        dtype="float32",
        device="cpu",
        weights=weights,
        kv={"num_blocks": 32},
        prefill_tp=size,
        prefill_gemm=gemm,
    )
    results, _ = sharded_prefill(settings, engine, prompts, size)
    assert all(torch.equal(results[0], r) for r in results[1:])  # replicated after reduce
    return results[0]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("weights", ["dense", "quantized"])
def test_shards_add_up_to_the_whole_model(size: int, weights: str, engine: LLMEngine) -> None:
    # Dense shards' partial sums meet in another float order than one process's sums:
    # close, not equal. Quantized products of an appliance with groups of `size` sum each
    # span a split falls on by itself and add the spans in float64, so shards give one
    # process's states (on the same settings) bit for bit. Past GEMM_ROWS that holds for
    # our int16 GEMM; torch's bfloat16 GEMM (auto on AVX512-BF16 CPUs) may sum a shard's
    # narrower weight in another order (it does on an Intel Xeon with AMX).
    gemm = "int16"
    if weights == "quantized":
        settings = load_settings(
            device="cpu", weights="quantized", prefill_tp=size, prefill_gemm=gemm, kv=SMALL_POOL
        )
        engine = LLMEngine.from_settings(settings)
    # the last prompt alone takes a quantized product past GEMM_ROWS, to the `gemm` GEMM
    long = " ".join(f"{n} bees visit {n + 1} flowers." for n in range(40))
    texts = ["The capital of France is", "Bees make honey and", long]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    seqs = [Sequence(i, list(p), SamplingParams()) for i, p in enumerate(prompts)]
    for seq in seqs:
        seq.block_table = engine.kv.allocator.allocate(blocks_for_tokens(len(seq), 16))
    try:
        inputs = engine.runner.prepare(
            SchedulerOutput(prefills=[ScheduledChunk(s, len(s)) for s in seqs])
        )
        whole = engine.model(inputs.input_ids, inputs.positions, inputs.attention, engine.kv.tensor)
    finally:
        for seq in seqs:
            engine.kv.allocator.free(seq.block_table)
    sharded = shard_hidden_states(size, prompts, engine, weights, gemm)
    if weights == "quantized":
        assert torch.equal(sharded, whole)
    else:
        assert (sharded - whole).abs().max().item() < 1e-6 * whole.abs().max().item() + 1e-4


# --- the KV handoff between degrees ----------------------------------------------------


def split_pool(pool: torch.Tensor, size: int) -> list[KVShard]:
    """A full-heads pool [layers, 2, blocks, block_size, heads, dim] cut by KV head."""
    return [
        KVShard(r.start, pool[..., r.start : r.stop, :].clone())
        for r in kv_head_ranges(pool.shape[-2], size)
    ]


def join_shards(shards: list[KVShard]) -> torch.Tensor:
    return torch.cat([s.tensor for s in shards], dim=-2)


@pytest.mark.parametrize(("src_size", "dst_size"), [(2, 1), (1, 2), (2, 3), (3, 2), (1, 1)])
def test_handoff_gathers_or_splits_kv_heads(src_size: int, dst_size: int) -> None:
    pool = torch.randn(2, 2, 6, 4, 3, 8)  # [layers, 2, blocks, block_size, 3 heads, dim]
    src = split_pool(pool, src_size)
    dst = split_pool(torch.zeros(2, 2, 5, 4, 3, 8), dst_size)
    moved = copy_between_shards(src, [4, 1, 2], dst, [0, 3, 4])
    got = join_shards(dst)
    assert torch.equal(got[:, :, [0, 3, 4]], pool[:, :, [4, 1, 2]])
    assert got[:, :, [1, 2]].abs().sum() == 0  # nothing else written
    assert moved == 3 * pool[:, :, 0].numel() * pool.element_size()  # every head once


def test_handoff_refuses_shards_that_miss_heads() -> None:
    pool = torch.randn(2, 2, 6, 4, 3, 8)
    src = split_pool(pool, 2)[:1]  # heads 0-1 only
    dst = split_pool(torch.zeros(2, 2, 6, 4, 3, 8), 1)
    with pytest.raises(ValueError, match=r"hold heads \[0, 1\], the destination wants"):
        copy_between_shards(src, [0], dst, [0])


def test_row_parallel_products_sum_apart_only_what_a_configured_split_cuts(
    engine: LLMEngine,
) -> None:
    cfg = engine.model.config  # SmolLM2: 3 KV heads of 3 query heads of 64; MLP 1536
    assert row_parallel_spans(cfg, (1, 1)) == {}  # nothing split: whole rows, fastest
    assert row_parallel_spans(cfg, (2, 1)) == {"self_attn.o_proj": 192, "mlp.down_proj": 768}
    assert row_parallel_spans(cfg, (3,))["mlp.down_proj"] == 512
    # groups of 2 and of 3 in one appliance: every split of either
    assert row_parallel_spans(cfg, (2, 3))["mlp.down_proj"] == 256
    for size in (2, 3):  # the MLP splits on whole 256-column units (K-quant blocks)
        assert all(
            shard_plan(cfg, Shard(r, size)).mlp_columns.start % 256 == 0 for r in range(size)
        )


def test_quantized_shards_refuse_a_split_inside_a_block() -> None:
    weight = quantize(torch.randn(8, 64), "Q4_0")
    assert weight.column_slice(slice(32, 64)).in_features == 32
    with pytest.raises(ValueError, match="split Q4_0 blocks of 32 values"):
        weight.column_slice(slice(0, 48))


# --- real shard processes --------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_prompts(engine: LLMEngine) -> list[list[int]]:
    return [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in QUESTIONS[:8]
    ]


@pytest.fixture(scope="module")
def expected(engine: LLMEngine, chat_prompts: list[list[int]]) -> list[list[int]]:
    """What one process answers with dense float32 weights, as the groups below run."""
    return [c.token_ids for c in engine.generate(chat_prompts, GREEDY)]


@pytest.fixture(scope="module")
def expected_quantized(chat_prompts: list[list[int]]) -> list[list[int]]:
    """What one process answers on the quantized path (its decode steps compiled), set up
    for an appliance with groups of 2 (row_parallel_spans). Its prefill GEMMs in float32,
    as the groups': a bfloat16 GEMM's rounding would follow how each step is batched."""
    one = LLMEngine.from_settings(
        load_settings(
            device="cpu", weights="quantized", prefill_tp=2, prefill_gemm="float32", kv=SMALL_POOL
        )
    )
    return [c.token_ids for c in one.generate(chat_prompts, GREEDY)]


# The suite runs a dense colocated group and a quantized TP2 decode pool fed by a handoff
# (heads split); the TP2 prefill to TP1 decode gather is served in the suite by the family
# conformance tests (gemma3); the other rows are the extended lane's.
@pytest.mark.parametrize(
    ("weights", "mode", "layout", "groups"),
    [
        ("dense", "colocated", {"prefill_tp": 2}, [("colocated", (0, 1))]),
        pytest.param(
            "dense",
            "disaggregated",
            {"prefill_tp": 2, "prefill_devices": "0,1", "decode_devices": "2"},
            [("prefill", (0, 1)), ("decode", (2,))],
            marks=pytest.mark.extended,
        ),
        pytest.param(
            "dense",
            "disaggregated",
            {"decode_tp": 2, "prefill_devices": "2", "decode_devices": "0,1"},
            [("prefill", (2,)), ("decode", (0, 1))],
            marks=pytest.mark.extended,
        ),
        pytest.param(
            "quantized",
            "colocated",
            {"prefill_tp": 2},
            [("colocated", (0, 1))],
            marks=pytest.mark.extended,
        ),
        (
            "quantized",
            "disaggregated",
            {"decode_tp": 2, "prefill_devices": "2", "decode_devices": "0,1"},
            [("prefill", (2,)), ("decode", (0, 1))],
        ),
    ],
    ids=[
        "colocated-TP2",
        "TP2-prefill-to-TP1-decode",
        "TP1-prefill-to-TP2-decode",
        "quantized-colocated-TP2",
        "quantized-TP1-prefill-to-TP2-decode",
    ],
)
def test_tensor_parallel_greedy_outputs_equal_one_process(
    weights: str,
    mode: str,
    layout: dict,
    groups: list,
    chat_prompts: list[list[int]],
    request: pytest.FixtureRequest,
) -> None:
    """Quantized shards give one process's answers token for token too: their products
    sum the spans a split falls on by themselves (see cpu_kernels.QuantMatrix)."""
    expected = request.getfixturevalue("expected" if weights == "dense" else "expected_quantized")
    dtype = "float32" if weights == "dense" else "auto"
    settings = load_settings(
        dtype=dtype,
        device="cpu",
        weights=weights,
        mode=mode,
        prefill_gemm="float32",
        kv=SMALL_POOL,
        **layout,
    )
    cores = [(0,), (1,)] if mode == "colocated" else [(0,), (1,), (0,)]

    async def main() -> tuple[list, list[list[int]], dict]:
        async with Appliance(settings, cpu_topology(*cores)) as app:
            workers = app.supervisor.workers.values()
            seen = [(w.role, w.devices) for w in workers]
            followers = [child_pids(w.process.pid) for w in workers]
            for view, pids in zip(app.supervisor.views(), followers, strict=True):
                # the console samples each device's load from the process computing on it
                assert sorted(view.shard_pids) == sorted(pids)
                assert [view.pid_on(d) for d in view.devices] == [view.pid, *view.shard_pids]
            if mode == "disaggregated":  # a group's devices do not change pools one by one
                with pytest.raises(MoveError, match="one at a time"):
                    app.pools.start(groups[0][1][0], "decode")
            got = await run_all(app, chat_prompts)
            counts = await wait_all_free(app.supervisor)
        return seen, followers, got, counts

    seen, followers, got, counts = asyncio.run(main())
    assert seen == groups
    assert [len(f) for f in followers] == [len(g) - 1 for _, g in groups]  # one per shard
    assert got == expected
    assert all(free == total for free, total in counts.values()), counts
    assert not any(alive(pid) for pids in followers for pid in pids)  # all stopped


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_idle_group_outlives_its_collective_timeout_and_a_dead_shard_restarts_it(
    chat_prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """Followers wait for their next step without a deadline: a group idle for longer
    than the collectives' timeout still serves, without a restart. Then killing one
    follower breaks its leader's next step: the supervisor sees the worker crash, retries
    the requests, and restarts the whole group. (One appliance for both, a start less:
    after the idle part's requests the group is idle again, as the kill wants it.)"""
    settings = load_settings(
        dtype="float32",
        device="cpu",
        weights="dense",
        mode="colocated",
        prefill_tp=2,
        kv=SMALL_POOL,
        recovery={"stall_timeout_s": 3},  # also how long an all-reduce may wait
    )

    async def main() -> tuple[list[list[int]], int, list[list[int]], int, list[int], list[int]]:
        async with Appliance(settings, cpu_topology((0,), (1,))) as app:
            await asyncio.sleep(6)
            after_idle = await run_all(app, chat_prompts[:2])
            (worker,) = app.supervisor.workers.values()
            idle_restarts = worker.restarts
            (follower,) = child_pids(worker.process.pid)
            os.kill(follower, signal.SIGKILL)
            got = await run_all(app, chat_prompts[:4])
            (now,) = app.supervisor.workers.values()
            return (
                after_idle,
                idle_restarts,
                got,
                now.restarts,
                child_pids(now.process.pid),
                [follower],
            )

    after_idle, idle_restarts, got, restarts, new_followers, old = asyncio.run(main())
    assert after_idle == expected[:2]
    assert idle_restarts == 0
    assert got == expected[:4]
    assert restarts == 1
    assert len(new_followers) == 1 and new_followers != old
