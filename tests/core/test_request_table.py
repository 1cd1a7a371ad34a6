"""The request table and the recovery decisions on hand-made messages: no processes.

Workers in these tests: 0 is a prefill (or colocated) worker, 1 and 2 are decode workers.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from table_messages import BLOCKS, DECODE, OTHER_DECODE, PREFILL, PROMPT, tokens

from appliance.core.recovery import Action, Recovery, after_worker_lost, retry_action
from appliance.core.request_table import (
    TRANSITIONS,
    InvalidTransition,
    ParkedKV,
    Phase,
    Request,
    RequestTable,
    Timing,
)
from appliance.engine.sequence import SamplingParams
from appliance.workers.messages import HandoffResult, LeaseExpired

MAX_RETRIES = 2

# ---------------------------------------------------------------- reaching each phase


def waiting(table: RequestTable) -> Request:
    return table.add(PROMPT, SamplingParams(max_tokens=8), now=10.0)


def queued(table: RequestTable) -> Request:
    request = waiting(table)
    table.submit(request.request_id, PREFILL)
    return request


def prefilling(table: RequestTable) -> Request:
    request = queued(table)
    table.on_started([request.wire_id], step_started_at=11.0)
    return request


def parked(table: RequestTable) -> Request:
    request = prefilling(table)
    table.on_output(PREFILL, tokens(request.wire_id, [7], blocks=BLOCKS), 12.0, 11.0)
    return request


def handing_off(table: RequestTable) -> Request:
    request = parked(table)
    table.send_handoff(request.request_id, DECODE, now=13.0)
    return request


def decoding(table: RequestTable) -> Request:
    request = handing_off(table)
    table.on_handoff_result(HandoffResult(DECODE, request.wire_id, True, 4096), now=14.0)
    return request


def colocated_decoding(table: RequestTable) -> Request:
    request = prefilling(table)
    table.on_output(PREFILL, tokens(request.wire_id, [7]), 12.0, 11.0)
    return request


def finished(table: RequestTable) -> Request:
    request = decoding(table)
    table.on_output(DECODE, tokens(request.wire_id, [8], finished=True), 15.0, 14.5)
    return request


REACH: dict[Phase, Callable[[RequestTable], Request]] = {
    Phase.WAITING: waiting,
    Phase.QUEUED: queued,
    Phase.PREFILLING: prefilling,
    Phase.PARKED: parked,
    Phase.HANDING_OFF: handing_off,
    Phase.DECODING: decoding,
}


def index(table: RequestTable) -> dict[int, list[int]]:
    """Worker -> the ids of the requests it holds, for every worker of these tests."""
    workers = (PREFILL, DECODE, OTHER_DECODE)
    return {w: [r.request_id for r in table.held_by(w)] for w in workers}


# ---------------------------------------------------------------- every allowed transition


def _output_to(target: Phase) -> Callable[[RequestTable, Request], None]:
    def move(table: RequestTable, request: Request) -> None:
        worker = PREFILL if request.decode_worker is None else request.decode_worker
        blocks = BLOCKS if target is Phase.PARKED else None
        out = tokens(request.wire_id, [9], target is Phase.FINISHED, blocks)
        assert table.on_output(worker, out, 20.0, 19.0) is request

    return move


def _answer(accepted: bool) -> Callable[[RequestTable, Request], None]:
    def move(table: RequestTable, request: Request) -> None:
        result = HandoffResult(request.decode_worker, request.wire_id, accepted, 1)
        assert table.on_handoff_result(result, now=20.0) is request

    return move


MOVES: dict[tuple[Phase, Phase], Callable[[RequestTable, Request], None]] = {
    (Phase.WAITING, Phase.QUEUED): lambda t, r: t.submit(r.request_id, PREFILL),
    (Phase.QUEUED, Phase.PREFILLING): lambda t, r: t.on_started([r.wire_id], 20.0),
    (Phase.PREFILLING, Phase.PARKED): _output_to(Phase.PARKED),
    (Phase.PREFILLING, Phase.DECODING): _output_to(Phase.DECODING),
    (Phase.PREFILLING, Phase.FINISHED): _output_to(Phase.FINISHED),
    (Phase.PARKED, Phase.HANDING_OFF): lambda t, r: t.send_handoff(r.request_id, DECODE, 20.0),
    (Phase.HANDING_OFF, Phase.DECODING): _answer(accepted=True),
    (Phase.HANDING_OFF, Phase.PARKED): _answer(accepted=False),
    (Phase.DECODING, Phase.FINISHED): _output_to(Phase.FINISHED),
}
for _phase in REACH:
    if _phase is not Phase.WAITING:
        MOVES[(_phase, Phase.WAITING)] = lambda t, r: t.rerun(r.request_id)
    MOVES[(_phase, Phase.FAILED)] = lambda t, r: t.fail(r.request_id)
    MOVES[(_phase, Phase.CANCELLED)] = lambda t, r: t.forget(r.request_id)


def test_the_moves_cover_every_allowed_transition() -> None:
    allowed = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert set(MOVES) == allowed


@pytest.mark.parametrize(("start", "end"), sorted(MOVES, key=lambda m: (m[0].name, m[1].name)))
def test_each_allowed_transition(start: Phase, end: Phase) -> None:
    table = RequestTable()
    request = REACH[start](table)
    assert request.phase is start
    MOVES[(start, end)](table, request)
    assert request.phase is end
    assert request.previous is start


# ---------------------------------------------------------------- invalid transitions


def test_submitting_twice_raises() -> None:
    table = RequestTable()
    request = queued(table)
    with pytest.raises(InvalidTransition, match="from QUEUED to QUEUED"):
        table.submit(request.request_id, PREFILL)


def test_a_handoff_before_the_prefill_raises() -> None:
    table = RequestTable()
    request = prefilling(table)
    with pytest.raises(InvalidTransition, match="from PREFILLING to HANDING_OFF"):
        table.send_handoff(request.request_id, DECODE, 13.0)


def test_taking_back_a_handoff_never_sent_raises() -> None:
    table = RequestTable()
    request = parked(table)
    with pytest.raises(InvalidTransition):
        table.take_back_handoff(request.request_id)


def test_an_ended_request_cannot_fail_or_run_again() -> None:
    table = RequestTable()
    request = finished(table)
    with pytest.raises(InvalidTransition):
        table.fail(request.request_id)
    with pytest.raises(InvalidTransition):
        table.rerun(request.request_id)


def test_tokens_while_parked_raise_and_change_nothing() -> None:
    table = RequestTable()
    request = parked(table)
    before = index(table)
    with pytest.raises(InvalidTransition, match="from PARKED to DECODING"):
        table.on_output(PREFILL, tokens(request.wire_id, [9]), 20.0, 19.0)
    assert request.output_ids == [7] and request.phase is Phase.PARKED
    assert index(table) == before


def test_a_waiting_request_cannot_be_cancelled_twice_or_prefill() -> None:
    table = RequestTable()
    request = waiting(table)
    with pytest.raises(InvalidTransition):
        table.send_handoff(request.request_id, DECODE, 1.0)
    assert table.forget(request.request_id) is True
    assert table.forget(request.request_id) is False  # gone already


# ---------------------------------------------------------------- prefill to decode


def test_a_new_request_waits_with_its_arrival_and_no_worker() -> None:
    table = RequestTable()
    request = waiting(table)
    assert request.phase is Phase.WAITING
    assert request.timing == Timing(arrival=10.0)
    assert (request.prefill_worker, request.decode_worker, request.wire_id) == (None, None, None)
    assert index(table) == {PREFILL: [], DECODE: [], OTHER_DECODE: []}


def test_submit_queues_it_at_its_prefill_worker() -> None:
    table = RequestTable()
    request = queued(table)
    assert request.wire_id != request.request_id
    assert table.by_wire(request.wire_id) is request
    assert request.submitted_len == len(PROMPT)
    assert index(table)[PREFILL] == [request.request_id]
    assert table.waiting_at(PREFILL) == 1 and table.owes_answer(PREFILL)


def test_its_first_step_starts_the_prefill_once() -> None:
    table = RequestTable()
    request = prefilling(table)
    table.on_started([request.wire_id], step_started_at=99.0)  # a repeat changes nothing
    assert request.phase is Phase.PREFILLING and request.timing.prefill_start == 11.0
    assert table.waiting_at(PREFILL) == 0 and table.owes_answer(PREFILL)


def test_the_first_token_parks_the_kv_at_the_prefill_worker() -> None:
    table = RequestTable()
    request = parked(table)
    assert request.output_ids == [7] and request.timing.first_token == 12.0
    assert request.parked == ParkedKV(request.wire_id, PREFILL, BLOCKS)
    assert index(table)[PREFILL] == [request.request_id]
    assert not table.owes_answer(PREFILL)


def test_started_and_answered_in_one_report() -> None:
    table = RequestTable()
    request = queued(table)
    out = tokens(request.wire_id, [7], blocks=BLOCKS)
    table.on_output(PREFILL, out, now=12.0, step_started_at=11.5)
    assert request.phase is Phase.PARKED and request.previous is Phase.PREFILLING
    assert (request.timing.prefill_start, request.timing.first_token) == (11.5, 12.0)


def test_a_sent_handoff_is_held_by_both_workers() -> None:
    table = RequestTable()
    request = handing_off(table)
    rid = request.request_id
    assert request.decode_worker == DECODE and request.timing.handoff_sent == 13.0
    assert index(table) == {PREFILL: [rid], DECODE: [rid], OTHER_DECODE: []}
    assert table.handoffs_to(DECODE) == [request] and table.waiting_at(DECODE) == 1
    assert table.owes_answer(DECODE) and not table.owes_answer(PREFILL)


def test_an_accepted_handoff_leaves_the_prefill_worker() -> None:
    table = RequestTable()
    request = decoding(table)
    rid = request.request_id
    assert request.timing.handoff_taken == 14.0 and request.handoff_bytes == 4096
    assert request.parked is None and request.prefill_worker == PREFILL  # shown, not held
    assert index(table) == {PREFILL: [], DECODE: [rid], OTHER_DECODE: []}
    assert table.waiting_at(DECODE) == 0 and not table.owes_answer(DECODE)


def test_a_refused_handoff_is_parked_again_then_sent_elsewhere() -> None:
    table = RequestTable()
    request = handing_off(table)
    rid = request.request_id
    table.on_handoff_result(HandoffResult(DECODE, request.wire_id, False), now=14.0)
    assert request.phase is Phase.PARKED and request.decode_worker is None
    assert index(table) == {PREFILL: [rid], DECODE: [], OTHER_DECODE: []}
    table.send_handoff(request.request_id, OTHER_DECODE, now=15.0)
    assert request.timing.handoff_sent == 15.0  # the accepted send's round trip counts
    assert index(table) == {PREFILL: [rid], DECODE: [], OTHER_DECODE: [rid]}


def test_decoding_to_the_end_records_every_moment_in_order() -> None:
    table = RequestTable()
    request = finished(table)
    assert request.output_ids == [7, 8] and table.requests[request.request_id] is request
    moments = request.timing.as_dict()
    order = ["arrival", "prefill_start", "first_token", "handoff_sent", "handoff", "finished"]
    assert list(moments) == order
    assert [moments[k] for k in order] == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    assert index(table) == {PREFILL: [], DECODE: [], OTHER_DECODE: []}
    assert table.by_wire(request.wire_id) is None  # later messages are stale


def test_a_colocated_worker_prefills_and_decodes() -> None:
    table = RequestTable()
    request = colocated_decoding(table)
    assert request.phase is Phase.DECODING and request.decode_worker is None
    assert index(table)[PREFILL] == [request.request_id]
    table.on_output(PREFILL, tokens(request.wire_id, [8]), 13.0, 12.5)
    table.on_output(PREFILL, tokens(request.wire_id, [9], finished=True), 14.0, 13.5)
    assert request.phase is Phase.FINISHED and request.output_ids == [7, 8, 9]
    assert "handoff" not in request.timing.as_dict()


def test_a_request_can_finish_at_its_first_token() -> None:
    table = RequestTable()
    request = prefilling(table)
    table.on_output(PREFILL, tokens(request.wire_id, [7], finished=True), 12.0, 11.0)
    assert request.phase is Phase.FINISHED and request.previous is Phase.PREFILLING
    assert request.timing.first_token == request.timing.finished == 12.0


# ---------------------------------------------------------------- stale messages


def test_output_from_a_worker_not_running_it_is_stale() -> None:
    table = RequestTable()
    request = decoding(table)
    assert table.on_output(OTHER_DECODE, tokens(request.wire_id, [9]), 20.0, 19.0) is None
    assert table.on_output(PREFILL, tokens(12345, [9]), 20.0, 19.0) is None
    assert request.output_ids == [7]


def test_handoff_answers_nobody_waits_for_are_stale() -> None:
    table = RequestTable()
    request = handing_off(table)
    assert table.on_handoff_result(HandoffResult(OTHER_DECODE, request.wire_id, True), 1) is None
    assert table.on_handoff_result(HandoffResult(DECODE, 12345, True), 1) is None
    assert request.phase is Phase.HANDING_OFF
    other = parked(table)
    assert table.on_handoff_result(HandoffResult(DECODE, other.wire_id, True), 1) is None


def test_an_earlier_attempts_messages_are_stale_after_a_rerun() -> None:
    table = RequestTable()
    request = parked(table)
    old_wire = request.wire_id
    table.rerun(request.request_id)
    table.submit(request.request_id, PREFILL)
    assert request.wire_id != old_wire and table.by_wire(old_wire) is None
    assert table.on_output(PREFILL, tokens(old_wire, [9]), 20.0, 19.0) is None


# ---------------------------------------------------------------- cancel in each phase


@pytest.mark.parametrize("phase", list(REACH), ids=lambda p: p.name)
def test_cancel_in_each_phase(phase: Phase) -> None:
    table = RequestTable()
    request = REACH[phase](table)
    wire_id = request.wire_id
    assert table.forget(request.request_id) is True  # workers may still run it: abort
    assert request.phase is Phase.CANCELLED and request.previous is phase
    assert table.requests == {} and index(table) == {PREFILL: [], DECODE: [], OTHER_DECODE: []}
    assert wire_id is None or table.by_wire(wire_id) is None


def test_forgetting_a_finished_request_cancels_nothing() -> None:
    table = RequestTable()
    request = finished(table)
    assert table.forget(request.request_id) is False
    assert request.phase is Phase.FINISHED and table.requests == {}


def test_forgetting_a_failed_request_keeps_it_failed() -> None:
    table = RequestTable()
    request = queued(table)
    table.fail(request.request_id)
    assert index(table)[PREFILL] == [] and table.by_wire(request.wire_id) is None
    assert table.forget(request.request_id) is True  # its workers are told to abort
    assert request.phase is Phase.FAILED and request.prefill_worker == PREFILL


# ---------------------------------------------------------------- a worker's death


DEATHS = [
    # (phase reached, worker that dies, what the table says to do)
    (Phase.QUEUED, PREFILL, [Action.RERUN]),
    (Phase.PREFILLING, PREFILL, [Action.RERUN]),
    (Phase.PARKED, PREFILL, [Action.RERUN]),  # the parked KV died with it
    (Phase.HANDING_OFF, DECODE, [Action.REROUTE]),  # the KV is still parked: send it on
    (Phase.HANDING_OFF, PREFILL, []),  # the decode worker's answer decides
    (Phase.DECODING, DECODE, [Action.RERUN]),
    (Phase.DECODING, PREFILL, []),  # its KV was copied already
    (Phase.WAITING, PREFILL, []),
    (Phase.PARKED, DECODE, []),
]


@pytest.mark.parametrize(("phase", "dead", "actions"), DEATHS, ids=lambda x: str(x))
def test_a_worker_dies_in_each_phase(phase: Phase, dead: int, actions: list[Action]) -> None:
    table = RequestTable()
    request = REACH[phase](table)
    plan = after_worker_lost(table.held_by(dead), dead, MAX_RETRIES)
    assert plan == [Recovery(request.request_id, a) for a in actions]


def test_a_colocated_worker_dies_while_decoding() -> None:
    table = RequestTable()
    request = colocated_decoding(table)
    plan = after_worker_lost(table.held_by(PREFILL), PREFILL, MAX_RETRIES)
    assert plan == [Recovery(request.request_id, Action.RERUN)]


def test_a_finished_request_is_nobodys_to_recover() -> None:
    table = RequestTable()
    finished(table)
    assert after_worker_lost(table.held_by(DECODE), DECODE, MAX_RETRIES) == []


def test_retries_exhausted_fail_the_request() -> None:
    table = RequestTable()
    request = decoding(table)
    for _ in range(MAX_RETRIES):
        assert retry_action(request, MAX_RETRIES) is Action.RERUN
        table.rerun(request.request_id)
        table.submit(request.request_id, PREFILL)
    assert request.retries == MAX_RETRIES
    plan = after_worker_lost(table.held_by(PREFILL), PREFILL, MAX_RETRIES)
    assert plan == [Recovery(request.request_id, Action.FAIL)]
    table.fail(request.request_id)
    assert request.phase is Phase.FAILED and index(table)[PREFILL] == []


def test_a_rerun_continues_from_the_streamed_tokens() -> None:
    table = RequestTable()
    request = decoding(table)
    table.on_output(DECODE, tokens(request.wire_id, [8, 9]), 15.0, 14.5)
    table.rerun(request.request_id)
    assert request.phase is Phase.WAITING and request.retries == 1
    assert request.tokens == [*PROMPT, 7, 8, 9]
    assert request.attempt_params.max_tokens == 8 - 3 and request.params.max_tokens == 8
    assert (request.prefill_worker, request.decode_worker, request.parked) == (None, None, None)
    timing = request.timing  # TTFT and queue time stay the client's; the handoff is anew
    assert (timing.prefill_start, timing.first_token) == (11.0, 12.0)
    assert (timing.handoff_sent, timing.handoff_taken) == (None, None)
    assert index(table) == {PREFILL: [], DECODE: [], OTHER_DECODE: []}
    table.submit(request.request_id, PREFILL)
    assert request.submitted_len == len(PROMPT) + 3


def test_a_rerun_asks_for_at_least_one_token() -> None:
    table = RequestTable()
    request = table.add(PROMPT, SamplingParams(max_tokens=1), now=0.0)
    table.submit(request.request_id, PREFILL)
    request.output_ids.append(5)  # as if its one token had been streamed
    table.rerun(request.request_id)
    assert request.attempt_params.max_tokens == 1


def test_a_rerouted_handoff_goes_to_another_decode_worker() -> None:
    table = RequestTable()
    request = handing_off(table)
    rid = request.request_id
    kv = table.take_back_handoff(request.request_id)
    assert kv == ParkedKV(request.wire_id, PREFILL, BLOCKS) and table.handoffs_to(DECODE) == []
    table.send_handoff(request.request_id, OTHER_DECODE, now=16.0)
    assert index(table) == {PREFILL: [rid], DECODE: [], OTHER_DECODE: [rid]}


# ---------------------------------------------------------------- leases


@pytest.mark.parametrize("phase", [Phase.PARKED, Phase.HANDING_OFF], ids=lambda p: p.name)
def test_an_expired_lease_names_the_request_waiting_for_those_blocks(phase: Phase) -> None:
    table = RequestTable()
    request = REACH[phase](table)
    assert table.on_lease_expired(LeaseExpired(PREFILL, request.wire_id)) is request
    assert table.on_lease_expired(LeaseExpired(DECODE, request.wire_id)) is None


def test_an_expired_lease_after_the_copy_is_nobodys() -> None:
    table = RequestTable()
    request = decoding(table)
    assert table.on_lease_expired(LeaseExpired(PREFILL, request.wire_id)) is None
    assert table.on_lease_expired(LeaseExpired(PREFILL, 12345)) is None


# ---------------------------------------------------------------- the worker index


def test_the_index_follows_many_requests_over_their_moves() -> None:
    table = RequestTable()
    a, b, c = queued(table), handing_off(table), colocated_decoding(table)
    assert index(table) == {
        PREFILL: [a.request_id, b.request_id, c.request_id],
        DECODE: [b.request_id],
        OTHER_DECODE: [],
    }
    assert table.waiting_at(PREFILL) == 1 and table.waiting_at(DECODE) == 1
    table.on_handoff_result(HandoffResult(DECODE, b.wire_id, True, 1), now=20.0)
    table.fail(a.request_id)
    assert index(table) == {PREFILL: [c.request_id], DECODE: [b.request_id], OTHER_DECODE: []}
    assert [r.request_id for r in table.in_phase(Phase.DECODING)] == [b.request_id, c.request_id]


# ---------------------------------------------------------------- timing


def test_timing_keeps_its_public_names_both_ways() -> None:
    timing = Timing(arrival=1.0, prefill_start=2.0, handoff_sent=3.0, handoff_taken=3.5)
    assert timing.as_dict() == {
        "arrival": 1.0,
        "prefill_start": 2.0,
        "handoff_sent": 3.0,
        "handoff": 3.5,
    }
    assert Timing.from_dict(timing.as_dict()) == timing


def test_timing_derives_queue_time_and_handoff_latency() -> None:
    assert Timing(arrival=5.0, prefill_start=4.0).queue_time == 0.0  # clocks of two processes
    assert Timing(arrival=1.0, prefill_start=1.5).queue_time == 0.5
    assert Timing(arrival=1.0).queue_time is None
    assert Timing(handoff_sent=2.0, handoff_taken=2.25).handoff_latency == 0.25
    assert Timing(handoff_sent=2.0).handoff_latency is None


def test_timing_once_sets_a_moment_only_the_first_time() -> None:
    timing = Timing()
    timing.once("first_token", 3.0)
    timing.once("first_token", 4.0)
    assert timing.first_token == 3.0


def test_terminal_phases_have_no_way_out() -> None:
    assert {p for p in Phase if p.terminal} == {Phase.FINISHED, Phase.FAILED, Phase.CANCELLED}
    assert {p for p in Phase if p.awaiting_first} == {Phase.QUEUED, Phase.PREFILLING}


def test_time_to_first_token_counts_the_wait_until_there_is_one() -> None:
    assert Timing(arrival=1.0).time_to_first_token(now=3.0) == 2.0
    assert Timing(arrival=1.0, first_token=1.5).time_to_first_token(now=3.0) == 0.5


def test_a_rerun_says_how_much_of_its_prompt_is_output() -> None:
    # The first token was streamed: the new attempt's prompt ends with it, and the
    # penalties and min_tokens must still count it as output.
    table = RequestTable()
    request = parked(table)
    assert request.output_ids == [7] and request.attempt_params.emitted == 0
    table.rerun(request.request_id)
    assert request.attempt_params.emitted == 1
    assert request.attempt_params.max_tokens == request.params.max_tokens - 1
