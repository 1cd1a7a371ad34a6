"""Hand-made worker messages for the request table's tests and the request flow's: the
workers (0 prefill or colocated, 1 and 2 decode), a prompt, its KV blocks, and an Output."""

from __future__ import annotations

from appliance.workers.messages import Output

PREFILL, DECODE, OTHER_DECODE = 0, 1, 2
PROMPT = [11, 12, 13]
BLOCKS = [4, 5]


def tokens(wire_id: int, ids: list[int], finished: bool = False, blocks=None) -> Output:
    """A worker's Output for `wire_id`: `ids` as tokens, `blocks` its parked KV."""
    return Output(wire_id, ids, "x" * len(ids), finished, "length" if finished else None, blocks)
