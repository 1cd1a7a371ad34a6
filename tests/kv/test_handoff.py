"""Prefill in one KV pool, decode in another: the pull handoff inside one process.

The worker processes of the disaggregated runtime build on exactly these engine calls:
a prefill-only request parks its blocks, the decode side copies them into its own pool
(`add_prefilled`) and the prefill side releases them, or a lease frees them.
"""

from __future__ import annotations

import pytest
import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.kv.handoff import copy_blocks

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

TEXT = (
    "A lighthouse keeper kept a log of every ship that passed, the weather, the tides "
    "and the birds, and after forty years the log filled a whole shelf of the tower."
)


def all_free(*engines: LLMEngine) -> bool:
    return all(e.num_free_blocks == e.kv.num_blocks for e in engines)


def test_copy_blocks_moves_exactly_the_named_blocks() -> None:
    src = torch.arange(2 * 2 * 6 * 4 * 1 * 2, dtype=torch.float32).view(2, 2, 6, 4, 1, 2)
    dst = torch.zeros(2, 2, 5, 4, 1, 2)
    moved = copy_blocks(src, [4, 1], dst, [0, 3])
    assert torch.equal(dst[:, :, 0], src[:, :, 4]) and torch.equal(dst[:, :, 3], src[:, :, 1])
    assert dst[:, :, [1, 2, 4]].abs().sum() == 0
    assert moved == 2 * src[:, :, 0].numel() * 4


def test_copy_blocks_refuses_mismatched_pools() -> None:
    with pytest.raises(ValueError, match="layout"):
        copy_blocks(torch.zeros(2, 2, 4, 4, 1, 2), [0], torch.zeros(2, 2, 4, 8, 1, 2), [0])
    with pytest.raises(ValueError, match="blocks"):
        copy_blocks(torch.zeros(2, 2, 4, 4, 1, 2), [0, 1], torch.zeros(2, 2, 4, 4, 1, 2), [0])


def run_disaggregated(
    prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Drive both pools until every request ends; returns each request's output tokens."""
    tokens: dict[int, list[int]] = {}
    origin: dict[int, int] = {}  # decode-side id -> prefill-side id
    pending = []  # parked prefills the decode pool had no room for yet
    ids = [prefill.add_request(p, params, prefill_only=True) for p in prompts]
    for seq_id in ids:
        tokens[seq_id] = []
    while prefill.has_unfinished() or decode.has_unfinished() or pending:
        for out in prefill.step():
            tokens[out.seq_id] += out.token_ids
            if out.handoff_blocks is not None:
                pending.append((out.seq_id, out.handoff_blocks))
        still_pending = []
        for seq_id, blocks in pending:
            prompt = prompts[ids.index(seq_id)]
            pulled = decode.add_prefilled(
                prompt + tokens[seq_id], len(prompt), params, prefill.kv_shards, blocks
            )
            if pulled is None:
                still_pending.append((seq_id, blocks))
                continue
            new_id, moved = pulled
            copied = blocks_for_tokens(len(prompt), decode.kv.block_size)  # no prefix cache
            assert moved == copied * decode.kv.layout.bytes_per_block()
            origin[new_id] = seq_id
            prefill.release(seq_id)
        pending = still_pending
        for out in decode.step():
            tokens[origin[out.seq_id]] += out.token_ids
    return [tokens[i] for i in ids]


def prompts_for(engine: LLMEngine, count: int) -> list[list[int]]:
    ids = engine.tokenizer.encode(TEXT * 3)
    return [ids[: 5 + 7 * i] for i in range(count)]


def test_disaggregated_greedy_equals_one_engine(engine: LLMEngine, make_engine) -> None:
    params = SamplingParams(max_tokens=24)
    prompts = prompts_for(engine, 16)
    expected = [c.token_ids for c in engine.generate(prompts, params)]
    prefill = make_engine(block_size=16, num_blocks=200)
    decode = make_engine(block_size=16, num_blocks=300)
    assert run_disaggregated(prefill, decode, prompts, params) == expected
    assert all_free(prefill, decode) and not prefill.scheduler.parked


def test_a_full_decode_pool_leaves_prefills_parked_until_room(
    engine: LLMEngine, make_engine
) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = prompts_for(engine, 6)
    expected = [c.token_ids for c in engine.generate(prompts, params)]
    prefill = make_engine(block_size=16, num_blocks=100)
    decode = make_engine(block_size=16, num_blocks=100, max_num_seqs=2)
    assert run_disaggregated(prefill, decode, prompts, params) == expected
    assert all_free(prefill, decode)


def test_a_first_token_that_ends_the_request_needs_no_handoff(make_engine) -> None:
    prefill = make_engine()
    prompt = prefill.tokenizer.encode(TEXT)
    seq_id = prefill.add_request(prompt, SamplingParams(max_tokens=1), prefill_only=True)
    [out] = prefill.step()
    assert out.seq_id == seq_id and out.finished and out.finish_reason == "length"
    assert out.handoff_blocks is None and all_free(prefill)


def test_an_unpulled_prefill_is_freed_when_its_lease_expires(make_engine) -> None:
    prefill = make_engine()
    prompt = prefill.tokenizer.encode(TEXT)
    seq_id = prefill.add_request(prompt, SamplingParams(max_tokens=8), prefill_only=True)
    [out] = prefill.step()
    assert out.handoff_blocks and not out.finished
    assert prefill.kv.allocator.num_used == len(out.handoff_blocks)
    assert prefill.expire_leases(lease_seconds=30.0) == []  # still within its lease
    assert prefill.expire_leases(lease_seconds=30.0, now=out_time(prefill, seq_id) + 31) == [seq_id]
    assert all_free(prefill) and not prefill.scheduler.parked


def out_time(engine: LLMEngine, seq_id: int) -> float:
    return engine.scheduler.parked[seq_id].parked_at


def test_abort_of_a_parked_prefill_frees_its_blocks(make_engine) -> None:
    prefill = make_engine()
    seq_id = prefill.add_request(
        prefill.tokenizer.encode(TEXT), SamplingParams(max_tokens=8), prefill_only=True
    )
    prefill.step()
    assert prefill.kv.allocator.num_used > 0
    prefill.abort(seq_id)
    assert all_free(prefill) and not prefill.scheduler.parked
    with pytest.raises(KeyError):
        prefill.release(seq_id)
