"""The request flow's count of prompts sent to a prefill worker that no decode worker has
taken yet: a move may not take the last decode worker away while any wait (pool_moves),
hand-made table transitions, no processes; and a consumer's wait for its next chunk."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from table_messages import BLOCKS, DECODE, PREFILL, PROMPT, tokens

from appliance.api import Chunk, RequestFailed
from appliance.core.request_table import RequestTable
from appliance.engine.sequence import SamplingParams
from appliance.pools.request_flow import RequestFlow, next_item
from appliance.settings.config import Settings
from appliance.workers.messages import HandoffResult


def flow_over(table: RequestTable) -> RequestFlow:
    unused = cast(Any, None)  # the count reads the table alone
    return RequestFlow(Settings(), table, unused, unused, unused, unused, unused, unused)


def test_prompts_sent_to_prefill_count_until_a_decode_worker_takes_them() -> None:
    table = RequestTable()
    flow = flow_over(table)
    split = table.add(PROMPT, SamplingParams(max_tokens=8), now=10.0)
    table.submit(split.request_id, PREFILL, prefill_only=True)
    colocated = table.add(PROMPT, SamplingParams(max_tokens=8), now=10.0)
    table.submit(colocated.request_id, PREFILL)  # a colocated worker decodes it itself
    assert flow.awaiting_handoff() == 1
    table.on_started([split.wire_id], step_started_at=11.0)
    table.on_output(PREFILL, tokens(split.wire_id, [7], blocks=BLOCKS), 12.0, 11.0)
    table.send_handoff(split.request_id, DECODE, now=13.0)
    assert flow.awaiting_handoff() == 1  # parked, then handing off: still waiting
    table.on_handoff_result(HandoffResult(DECODE, split.wire_id, True, 4096), now=14.0)
    assert flow.awaiting_handoff() == 0
    failed = table.add(PROMPT, SamplingParams(max_tokens=8), now=15.0)
    table.submit(failed.request_id, PREFILL, prefill_only=True)
    assert flow.awaiting_handoff() == 1
    table.fail(failed.request_id)
    assert flow.awaiting_handoff() == 0


def test_a_consumer_cancelled_as_its_chunk_arrives_is_cancelled() -> None:
    """The client leaves (its task is cancelled) in the loop turn its next chunk arrives.
    Python 3.11's asyncio.wait_for returned the chunk and dropped the cancellation: the
    request ran on to its max_tokens with nobody reading (CI's abandoned-answer test)."""

    async def main() -> tuple[asyncio.Task[Chunk | Exception], int]:
        stream: asyncio.Queue[Chunk | Exception] = asyncio.Queue()
        waiting = asyncio.create_task(next_item(stream, time.monotonic() + 60, 60))
        await asyncio.sleep(0)  # it waits on the empty queue now
        assert not waiting.done()
        stream.put_nowait(Chunk(token_ids=[7], text="x"))
        waiting.cancel()  # in the same turn, before the waiter runs again
        await asyncio.gather(waiting, return_exceptions=True)
        return waiting, stream.qsize()

    waiting, left = asyncio.run(main())
    assert waiting.cancelled()
    assert left == 1  # the chunk stays queued for nobody: the flow forgets the stream


def test_a_consumer_waiting_past_its_deadline_gets_the_error_that_ends_it() -> None:
    async def main() -> Chunk | Exception:
        stream: asyncio.Queue[Chunk | Exception] = asyncio.Queue()
        return await next_item(stream, time.monotonic() + 0.05, 3)

    item = asyncio.run(main())
    assert isinstance(item, RequestFailed)
    assert str(item) == "the request ran past its deadline of 3 s"
