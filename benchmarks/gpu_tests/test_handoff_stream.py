"""CUDA-only checks of the handoff copy (appliance/kv/handoff.py), run on a GPU machine by
benchmarks/gpu_check.py (section "cuda_tests"); the CPU half is tests/kv/test_handoff_stream.py.

The copy runs on side streams of the decode process, behind the prefill worker's
interprocess event, and says when it has landed without blocking anyone:

    .venv/bin/python -m pytest -q benchmarks/gpu_tests/test_handoff_stream.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.kv.handoff import CopyStreams, KVShard, start_copy
from appliance.settings.config import load_settings
from appliance.workers.shard_group import open_pools, pickle_pool

if not torch.cuda.is_available():
    pytest.fail("these checks need a CUDA device", pytrace=False)

SPIN_CYCLES = 2_000_000_000  # about a second of one spinning kernel at ~2 GHz
SHAPE = (4, 2, 32, 16, 3, 64)  # [layers, 2, blocks, block_size, kv_heads, head_dim]
SRC_IDS, DST_IDS = [3, 4, 5, 9, 30], [0, 1, 2, 17, 6]
GREEDY = SamplingParams(max_tokens=12)


def test_the_copy_waits_for_the_ready_event_and_leaves_the_default_stream_free() -> None:
    src = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
    dst = torch.zeros_like(src)
    want = torch.randn(SHAPE, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    producer, ready = torch.cuda.Stream(), torch.cuda.Event(interprocess=True)
    with torch.cuda.stream(producer):  # a prefill step still writing its blocks
        torch.cuda._sleep(SPIN_CYCLES)
        src.copy_(want)
        ready.record(producer)
    copy = start_copy([KVShard(0, src, ready)], SRC_IDS, [KVShard(0, dst)], DST_IDS, CopyStreams())
    assert not copy.done()  # behind the producer's write
    marker = torch.ones(1, device="cuda").add_(1)  # the decode loop's own stream
    torch.cuda.current_stream().synchronize()
    assert marker.item() == 2.0 and not copy.done()  # it ran while the copy still waits
    copy.wait()
    assert copy.done()
    assert torch.equal(dst[:, :, DST_IDS], want[:, :, SRC_IDS])


def pattern() -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), device="cuda").reshape(SHAPE).bfloat16()


def produce(to_consumer: Any, from_consumer: Any) -> None:
    """A prefill worker's part, in a process of its own: its pool and event shared once
    at start (torch's own sharing syncs only then), then a slow step writes the blocks and
    records the event, and they are announced before that step has finished."""
    torch.cuda.set_device(0)
    pool = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
    ready = torch.cuda.Event(interprocess=True)
    torch.cuda.synchronize()
    to_consumer.put([pickle_pool(0, pool, ready)])
    assert from_consumer.get(timeout=120) == "opened"
    torch.cuda._sleep(SPIN_CYCLES)
    pool.copy_(pattern())
    ready.record()
    to_consumer.put("written")
    from_consumer.get(timeout=120)  # keep the pool and the event until the copy is done


def test_a_copy_from_another_process_waits_for_its_ipc_event() -> None:
    context = mp.get_context("spawn")
    to_consumer, from_consumer = context.Queue(), context.Queue()
    producer = context.Process(target=produce, args=(to_consumer, from_consumer), daemon=True)
    producer.start()
    try:
        [source] = open_pools(to_consumer.get(timeout=120))
        assert source.ready is not None
        dst = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        from_consumer.put("opened")
        assert to_consumer.get(timeout=120) == "written"
        copy = start_copy([source], SRC_IDS, [KVShard(0, dst)], DST_IDS, CopyStreams())
        copy.wait()
        # Without the event the copy would have read the zeros the pool held before.
        assert torch.equal(dst[:, :, DST_IDS], pattern()[:, :, SRC_IDS])
        del source, copy
    finally:
        from_consumer.put("done")
        producer.join(timeout=60)
    assert producer.exitcode == 0


def test_a_handoff_between_two_engines_gives_one_engines_tokens() -> None:
    settings = load_settings(
        device="cuda", dtype="bfloat16", weights="dense", kv={"memory_mb": 512}
    )
    prefill, decode = LLMEngine.from_settings(settings), LLMEngine.from_settings(settings)
    text = "The copy runs beside the decode steps and joins the batch once it has landed."
    ids = prefill.tokenizer.encode(text * 4)
    prompts = [ids[:n] for n in (5, 17, 40, 90)]
    expected = [c.token_ids for c in prefill.generate(prompts, GREEDY)]
    assert prefill.handoff_ready is not None
    source = [KVShard(0, prefill.kv.tensor, prefill.handoff_ready)]
    origin: dict[int, int] = {}  # decode id -> prompt index
    tokens: list[list[int]] = [[] for _ in prompts]
    for index, prompt in enumerate(prompts):
        seq_id = prefill.add_request(prompt, GREEDY, prefill_only=True)
        [out] = prefill.step()
        assert out.seq_id == seq_id and out.handoff_blocks is not None
        tokens[index] += out.token_ids
        pulled = decode.add_prefilled(
            prompt + out.token_ids, len(prompt), GREEDY, source, out.handoff_blocks
        )
        assert pulled is not None
        origin[pulled[0]] = index
        parked = seq_id
        while pulled[0] not in decode.pop_landed():  # released only once it has landed
            decode.admit_copied()
        prefill.release(parked)
    while decode.has_unfinished():
        for out in decode.step():
            tokens[origin[out.seq_id]] += out.token_ids
    assert tokens == expected
    assert decode.num_free_blocks == decode.kv.num_blocks
    assert prefill.num_free_blocks == prefill.kv.num_blocks
