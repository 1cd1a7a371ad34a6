"""The handoff copy as the decode loop sees it: started, polled, admitted once landed.

On the CPU a copy has landed when start_copy returns and no event exists; on CUDA it
runs on side streams behind the prefill worker's IPC event (benchmarks/gpu_tests/
test_handoff_stream.py). Here the "has it landed" predicate is injected, so the
admission logic runs on plain data and on the CPU engine and worker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from appliance.engine import llm_engine
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.kv.cache import KVCache, KVLayout
from appliance.kv.handoff import HandoffCopy, KVShard, PendingCopies, start_copy
from appliance.workers.messages import Abort, Handoff, HandoffResult, TokenBatch
from appliance.workers.shard_group import open_pools, pickle_pool, unpickle_pool
from appliance.workers.worker import WorkerState, report, send_landed, take_handoff

TEXT = "The tide came in over the flats twice a day, and the birds followed it each time."
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


# ---------------------------------------------------------------- PendingCopies, plain data


def test_pending_copies_leave_in_arrival_order_once_done() -> None:
    done = {1: False, 2: True, 3: False}
    pending: PendingCopies[str] = PendingCopies()
    for key in done:
        pending.add(key, f"request {key}", lambda key=key: done[key])
    assert pending.landed() == ["request 2"]
    assert len(pending) == 2 and 1 in pending and 2 not in pending
    assert pending.landed() == []  # nothing new: polled again, nothing moves
    done[3] = done[1] = True
    assert pending.landed() == ["request 1", "request 3"]
    assert len(pending) == 0


# ---------------------------------------------------------------- CPU copies


def random_pool(blocks: int, heads: int) -> torch.Tensor:
    # [layers, 2, blocks, block_size, kv_heads, head_dim]
    return torch.randn(3, 2, blocks, 4, heads, 8, dtype=torch.bfloat16)


def test_a_cpu_copy_has_landed_on_return_without_events() -> None:
    src, dst = random_pool(8, 3), torch.zeros(3, 2, 6, 4, 3, 8, dtype=torch.bfloat16)
    copy = start_copy([KVShard(0, src)], [5, 1, 2], [KVShard(0, dst)], [0, 3, 4])
    assert copy.landed == [] and copy.done()
    copy.wait()  # nothing to wait for
    assert torch.equal(dst[:, :, [0, 3, 4]], src[:, :, [5, 1, 2]])  # bit for bit
    assert dst[:, :, [1, 2, 5]].abs().sum() == 0
    assert copy.nbytes == 3 * src[:, :, 0].numel() * src.element_size()


def test_a_cpu_copy_between_head_splits_is_bitwise() -> None:
    whole = random_pool(8, 3)
    src = [KVShard(0, whole[..., :2, :].clone()), KVShard(2, whole[..., 2:, :].clone())]
    dst = [KVShard(0, torch.zeros(3, 2, 4, 4, 1, 8, dtype=torch.bfloat16)),
           KVShard(1, torch.zeros(3, 2, 4, 4, 2, 8, dtype=torch.bfloat16))]  # fmt: skip
    copy = start_copy(src, [7, 0], dst, [1, 2])
    assert copy.done()
    gathered = torch.cat([dst[0].tensor, dst[1].tensor], dim=-2)
    assert torch.equal(gathered[:, :, [1, 2]], whole[:, :, [7, 0]])
    assert copy.nbytes == 2 * whole[:, :, 0].numel() * whole.element_size()


# ---------------------------------------------------------------- the pool's pickle


@dataclass
class StubEvent:
    """Stands in for torch.cuda.Event(interprocess=True) on a machine without CUDA."""

    handle: bytes

    def ipc_handle(self) -> bytes:
        return self.handle


def shared_pool() -> torch.Tensor:
    return KVCache(KVLayout(2, 4, 1, 8, torch.float32), 3, torch.device("cpu"), True).tensor


def test_a_pool_travels_with_its_handoff_event_handle() -> None:
    pool = shared_pool()
    head, data = pickle_pool(1, pool, StubEvent(b"\x01ipc-handle"))  # type: ignore[arg-type]
    tensor, handle = unpickle_pool(data)
    assert head == 1 and handle == b"\x01ipc-handle"
    pool.fill_(3.0)  # the same shared memory, not a copy
    assert torch.equal(tensor, pool)


def test_a_cpu_pool_has_no_event_and_opens_without_one() -> None:
    pool = shared_pool()
    assert unpickle_pool(pickle_pool(0, pool)[1])[1] is None
    [shard] = open_pools([pickle_pool(0, pool)])  # each pickle opens once
    assert shard.head_start == 0 and shard.ready is None
    pool.fill_(2.0)
    assert torch.equal(shard.tensor, pool)


# ---------------------------------------------------------------- the engine, copies gated


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, bool]]:
    """The engine's copies really copy (on the CPU, at once) but say they have landed
    only once gate["open"] is set, as a CUDA copy still running would."""
    state = {"open": False}

    def gated(*args: Any, **kwargs: Any) -> HandoffCopy:
        copy = start_copy(*args, **kwargs)
        return GatedCopy(copy.nbytes, lambda: state["open"])

    monkeypatch.setattr(llm_engine, "start_copy", gated)
    yield state


@dataclass
class GatedCopy:
    nbytes: int
    done: Callable[[], bool]


def prefilled(make_engine: Callable[..., LLMEngine]) -> tuple[LLMEngine, list[int], Any]:
    """A prefill engine with one parked prompt: (engine, prompt + first token, output)."""
    prefill = make_engine(num_blocks=64)
    prompt = prefill.tokenizer.encode(TEXT)
    seq_id = prefill.add_request(prompt, PARAMS, prefill_only=True)
    [out] = prefill.step()
    assert out.seq_id == seq_id and out.handoff_blocks
    return prefill, prompt + out.token_ids, out


def test_a_copy_in_flight_keeps_its_request_out_of_the_batch(
    engine: LLMEngine, make_engine: Callable[..., LLMEngine], gate: dict[str, bool]
) -> None:
    expected = engine.generate([engine.tokenizer.encode(TEXT)], PARAMS)[0].token_ids
    prefill, tokens, out = prefilled(make_engine)
    decode = make_engine(num_blocks=64)
    seq_id, moved = decode.add_prefilled(
        tokens, len(tokens) - 1, PARAMS, prefill.kv_shards, out.handoff_blocks
    ) or (None, 0)
    assert seq_id is not None and moved > 0
    assert decode.copies_in_flight == 1 and decode.has_unfinished()
    assert not decode.scheduler.running and decode.pop_landed() == []
    assert decode.step() == [] and decode.step() == []  # polled, not admitted, no token
    gate["open"] = True
    first = decode.step()  # admits it, then runs it
    assert decode.pop_landed() == [seq_id] and decode.copies_in_flight == 0
    assert [o.seq_id for o in first] == [seq_id]
    tokens_out = out.token_ids + first[0].token_ids
    while decode.has_unfinished():
        tokens_out += [t for o in decode.step() for t in o.token_ids]
    assert tokens_out == expected


def test_a_request_aborted_mid_copy_frees_its_blocks_once_landed(
    make_engine: Callable[..., LLMEngine], gate: dict[str, bool]
) -> None:
    prefill, tokens, out = prefilled(make_engine)
    decode = make_engine(num_blocks=64)
    pulled = decode.add_prefilled(
        tokens, len(tokens) - 1, PARAMS, prefill.kv_shards, out.handoff_blocks
    )
    assert pulled is not None
    decode.abort(pulled[0])
    held = decode.kv.allocator.num_used
    assert held > 0  # the copy may still write them: not yet free
    gate["open"] = True
    assert decode.step() == []
    assert decode.pop_landed() == [] and decode.kv.allocator.num_used == 0
    assert not decode.has_unfinished()


def test_pending_copies_count_against_max_num_seqs(
    make_engine: Callable[..., LLMEngine], gate: dict[str, bool]
) -> None:
    prefill, tokens, out = prefilled(make_engine)
    decode = make_engine(num_blocks=64, max_num_seqs=1)
    args = (tokens, len(tokens) - 1, PARAMS, prefill.kv_shards, out.handoff_blocks)
    assert decode.add_prefilled(*args) is not None
    assert decode.add_prefilled(*args) is None  # the first still copies: no room


# ---------------------------------------------------------------- the worker's answers


class Outbox:
    def __init__(self) -> None:
        self.messages: list[Any] = []

    def put(self, message: Any) -> None:
        self.messages.append(message)


def handoff_to(
    state: WorkerState, prefill: LLMEngine, tokens: list[int], blocks: list[int]
) -> None:
    state.peers[7] = prefill.kv_shards
    take_handoff(state, Handoff(42, tokens, len(tokens) - 1, PARAMS, 7, blocks))


def test_the_worker_answers_a_handoff_once_its_blocks_land(
    make_engine: Callable[..., LLMEngine], gate: dict[str, bool]
) -> None:
    prefill, tokens, out = prefilled(make_engine)
    state = WorkerState(3, make_engine(num_blocks=64), Outbox())
    handoff_to(state, prefill, tokens, out.handoff_blocks)
    assert state.outbox.messages == []  # no answer yet: its source blocks stay held
    assert send_landed(state) == 0
    gate["open"] = True
    report(state, state.engine.step(), 0.0)
    result, batch = state.outbox.messages
    # The answer (which releases the source blocks) comes before the tokens it made.
    assert isinstance(result, HandoffResult) and result.accepted and result.request_id == 42
    assert result.bytes_moved > 0
    assert isinstance(batch, TokenBatch) and [o.request_id for o in batch.outputs] == [42]
    assert batch.started == [42]


def test_a_worker_on_the_cpu_answers_at_once(make_engine: Callable[..., LLMEngine]) -> None:
    prefill, tokens, out = prefilled(make_engine)
    state = WorkerState(3, make_engine(num_blocks=64), Outbox())
    handoff_to(state, prefill, tokens, out.handoff_blocks)
    [result] = state.outbox.messages
    assert isinstance(result, HandoffResult) and result.accepted and result.bytes_moved > 0
    assert state.copying == {}


def test_an_abort_mid_copy_gets_no_answer(
    make_engine: Callable[..., LLMEngine], gate: dict[str, bool]
) -> None:
    from appliance.workers.worker import handle

    prefill, tokens, out = prefilled(make_engine)
    state = WorkerState(3, make_engine(num_blocks=64), Outbox())
    handoff_to(state, prefill, tokens, out.handoff_blocks)
    handle(state, Abort(42))
    gate["open"] = True
    assert send_landed(state) == 0 and state.outbox.messages == []
    assert state.engine.kv.allocator.num_used == 0 and not state.copying


def test_the_inbox_wait_polls_copies_in_flight(
    make_engine: Callable[..., LLMEngine], gate: dict[str, bool]
) -> None:
    from appliance.workers.worker import COPY_POLL_S, IDLE_WAIT_S, inbox_wait

    prefill, tokens, out = prefilled(make_engine)
    state = WorkerState(3, make_engine(num_blocks=64), Outbox())
    assert inbox_wait(state.engine) == IDLE_WAIT_S
    handoff_to(state, prefill, tokens, out.handoff_blocks)
    assert inbox_wait(state.engine) == COPY_POLL_S
    gate["open"] = True
    send_landed(state)
    assert inbox_wait(state.engine) == 0.0  # it runs now
