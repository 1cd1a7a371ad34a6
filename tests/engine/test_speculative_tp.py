"""Speculative decoding in a tensor-parallel decode pool: a TP=1 prefill worker hands off
to a TP=2 decode group whose leader drafts (by prompt lookup, or with a draft model it
runs whole, unsharded) and verifies the drafts in steps its follower runs in lockstep;
greedy answers equal one process's plain decoding, token for token, drafts were kept,
and every KV block is free after. With a draft model the follower's pool shrinks to the
leader's block count. (No shared fixture serves a TP=2 pool: this module starts its own
processes, as tests/model/test_tensor_parallel.py does.) A colocated TP=2 worker of the
GGUF's quantized weights drafts with the embedded model too."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from copying_prompt import copying_prompt
from runtime_runs import cpu_topology, wait_all_free

from appliance.api import Appliance
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.model.model_source import default_model_path
from appliance.model.tensor_parallel import kv_head_ranges
from appliance.pools.worker_handle import WorkerView
from appliance.settings.config import Settings, load_settings

pytestmark = pytest.mark.process  # worker processes and a whole model

GREEDY = SamplingParams(max_tokens=32)


def prompts_of(engine: LLMEngine) -> list[list[int]]:
    """A prompt that continues by copying (drafts are kept) and a chat question."""
    tokenizer = engine.tokenizer
    copying = copying_prompt(tokenizer)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a planet."}])
    return [copying, chat]


def tp2_settings(speculative: dict[str, Any], **fields: Any) -> Settings:
    """A TP=1 prefill worker on core 2 (of the cores there are), a TP=2 decode group on 0, 1."""
    return load_settings(
        dtype="float32",
        device="cpu",
        weights="dense",
        mode="disaggregated",
        prefill_gemm="float32",
        decode_tp=2,
        prefill_devices="2",
        decode_devices="0,1",
        speculative=speculative,
        **fields,
    )


@dataclass
class Served:
    """What a TP=2 decode pool answered, and its workers after."""

    answers: list[list[int]]
    counts: dict  # worker -> (free, total) blocks
    views: list[WorkerView]
    shared: dict[int, int]  # follower pid -> bytes of torch shared memory it maps


def served(
    settings: Settings,
    prompts: list[list[int]],
    cores: tuple[tuple[int, ...], ...] = ((0,), (1,), (0,)),
) -> Served:
    """Each prompt's greedy answer from an appliance of `settings` on CPU devices of
    `cores`, and its workers."""

    async def main() -> Served:
        async with Appliance(settings, cpu_topology(*cores)) as app:

            async def one(ids: list[int]) -> list[int]:
                return [
                    t async for chunk in app.generate(ids, params=GREEDY) for t in chunk.token_ids
                ]

            got = list(await asyncio.gather(*(one(p) for p in prompts)))
            counts = await wait_all_free(app.supervisor)
            views = app.supervisor.views()
            maps = {pid: shared_bytes(pid) for v in views for pid in v.shard_pids}
        return Served(got, counts, views, maps)

    return asyncio.run(main())


def shared_bytes(pid: int) -> int:
    """Bytes of torch shared-memory storage `pid` maps (a follower: its KV pool)."""
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/dev/shm/torch_" in line:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            total += end - start
    return total


def decode_view(views: list[WorkerView], role: str = "decode") -> WorkerView:
    [decode] = [v for v in views if v.role == role]
    assert len(decode.devices) == 2
    return decode


def head_block_bytes(engine: LLMEngine, settings: Settings) -> int:
    """Bytes of one KV head's part of a block (float32 KV)."""
    cfg = engine.model.config
    return cfg.num_layers * 2 * settings.kv.block_size * cfg.head_dim * 4


def leader_blocks(engine: LLMEngine, settings: Settings) -> int:
    """A TP=2 leader's blocks beside a draft of the target's shape: its budget of blocks
    of its share of the heads, given up for as many of its share and of the whole
    draft's heads (draft_kv.split_pool)."""
    heads = len(kv_head_ranges(engine.model.config.num_kv_heads, 2)[0])
    block = head_block_bytes(engine, settings)
    budget = settings.kv.memory_mb * 2**20
    leader = budget // (block * heads) * block * heads
    return leader // (block * (heads + engine.model.config.num_kv_heads))


def check_follower_pool(
    engine: LLMEngine, settings: Settings, run: Served, view: WorkerView
) -> None:
    """The follower's pool was remade with the leader's block count (in whole pages)."""
    [follower] = view.shard_pids
    heads = len(kv_head_ranges(engine.model.config.num_kv_heads, 2)[1])
    pool = view.num_blocks * head_block_bytes(engine, settings) * heads
    assert pool <= run.shared[follower] < pool + 2 * 4096


def test_a_tp2_decode_pool_speculates_with_plain_decodings_answers(engine: LLMEngine) -> None:
    prompts = prompts_of(engine)
    expected = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    settings = tp2_settings({"method": "ngram", "num_speculative_tokens": 8})
    run = served(settings, prompts)
    assert run.answers == expected
    assert all(free == total for free, total in run.counts.values()), run.counts
    assert decode_view(run.views).speculation.accepted > 0  # the copying prompt's drafts held
    assert all(v.speculation.drafted == 0 for v in run.views if v.role == "prefill")


def test_a_tp2_decode_pool_drafts_with_a_whole_draft_model(engine: LLMEngine) -> None:
    """The draft: the embedded model itself, whole in the leader (its drafts are the
    target's own greedy tokens but for the shards' float sums: nearly all kept). The
    leader's pool and its follower's share the KV budget with the draft's pool: both
    hold the leader's (smaller) block count, the prefill worker the whole budget's."""
    prompts = prompts_of(engine)
    expected = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    spec = {"method": "draft", "draft_model": default_model_path(), "adaptive": False}
    settings = tp2_settings(spec, kv={"memory_mb": 32})
    run = served(settings, prompts)
    assert run.answers == expected
    assert all(free == total for free, total in run.counts.values()), run.counts
    decode = decode_view(run.views)
    drafts = decode.speculation
    assert drafts.drafted > 0 and drafts.accepted > 0.8 * drafts.drafted
    [prefill] = [v for v in run.views if v.role == "prefill"]
    assert prefill.speculation.drafted == 0
    # The prefill worker's pool: the budget in blocks of all heads; the leader's and its
    # follower's: the split with the draft's.
    heads = engine.model.config.num_kv_heads
    budget = settings.kv.memory_mb * 2**20
    assert prefill.num_blocks == budget // (head_block_bytes(engine, settings) * heads)
    assert decode.num_blocks == leader_blocks(engine, settings)
    check_follower_pool(engine, settings, run, decode)


def test_a_colocated_tp2_worker_of_quantized_weights_drafts_with_its_own_model(
    engine: LLMEngine,
) -> None:
    """The other layout and the GGUF's block-format weights (the target's shards and the
    draft multiply them in their blocks): a colocated TP=2 worker drafting with the
    embedded model answers as one quantized process decoding plainly."""
    fields: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "weights": "quantized",
        "prefill_gemm": "float32",
        "kv": {"memory_mb": 32},
    }
    prompts = prompts_of(engine)
    # One process set up for groups of 2 (row_parallel_spans: its quantized products sum
    # the spans a split falls on, as the shards' do), as test_tensor_parallel's.
    one = LLMEngine.from_settings(load_settings(prefill_tp=2, **fields))
    expected = [c.token_ids for c in one.generate(prompts, GREEDY)]
    spec = {"method": "draft", "draft_model": default_model_path(), "adaptive": False}
    settings = load_settings(mode="colocated", prefill_tp=2, speculative=spec, **fields)
    run = served(settings, prompts, cores=((0,), (1,)))
    assert run.answers == expected
    assert all(free == total for free, total in run.counts.values()), run.counts
    worker = decode_view(run.views, "colocated")
    drafts = worker.speculation
    assert drafts.drafted > 0 and drafts.accepted > 0.8 * drafts.drafted
    assert worker.num_blocks == leader_blocks(engine, settings)
    check_follower_pool(engine, settings, run, worker)
