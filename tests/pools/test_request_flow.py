"""The request flow's count of prompts sent to a prefill worker that no decode worker has
taken yet: a move may not take the last decode worker away while any wait (pool_moves).
Hand-made table transitions, no processes."""

from __future__ import annotations

from typing import Any, cast

from table_messages import BLOCKS, DECODE, PREFILL, PROMPT, tokens

from appliance.core.request_table import RequestTable
from appliance.engine.sequence import SamplingParams
from appliance.pools.request_flow import RequestFlow
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
