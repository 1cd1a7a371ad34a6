"""The event log (core/events.py): a bounded ring, and each fault or recovery a structured
event: its JSON line on `appliance.events` (time, kind, worker, box, cause, requests) and
its count by kind."""

from __future__ import annotations

import json
import logging

import pytest

from appliance.core.events import FAULT_KINDS, EventLog


def test_a_fault_event_is_one_json_line_with_what_it_touched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = EventLog()
    with caplog.at_level(logging.INFO, logger="appliance.events"):
        event = log.note(
            "worker",
            "worker 3 (decode, cpu1) exited with code -9",
            fault="worker_exit",
            worker=3,
            cause="exit code -9",
            requests=[12, 4],
        )
    [line] = [r.getMessage() for r in caplog.records if r.name == "appliance.events"]
    assert "\n" not in line
    record = json.loads(line)
    assert record == {
        "time": event.at,
        "seq": 1,
        "kind": "worker_exit",
        "event": "worker",
        "worker": 3,
        "box": None,
        "cause": "exit code -9",
        "requests": [4, 12],
        "message": "worker 3 (decode, cpu1) exited with code -9",
    }
    assert log.fault_counts == {"worker_exit": 1}


def test_other_events_write_no_json_line_and_count_no_fault(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = EventLog()
    with caplog.at_level(logging.INFO):
        event = log.note("tuning", "max_num_seqs=8")
    assert event.fault is None and event.requests == []
    assert not [r for r in caplog.records if r.name == "appliance.events"]
    assert [r.getMessage() for r in caplog.records] == ["max_num_seqs=8"]
    assert log.fault_counts == {}


def test_the_ring_keeps_the_last_events_and_the_counts_keep_them_all() -> None:
    log = EventLog(kept=5)
    for n in range(12):
        log.note("worker", f"request {n} runs again", fault="rerun", requests=[n])
    log.note("box", "lost box 'b'", fault="box_lost", box="b", cause="its link ended")
    assert [e.seq for e in log.events] == [9, 10, 11, 12, 13]
    assert log.fault_counts == {"rerun": 12, "box_lost": 1}
    assert set(log.fault_counts) <= set(FAULT_KINDS)


def test_fault_events_outlive_a_busy_log_of_other_events() -> None:
    log = EventLog(kept=10, faults_kept=3)
    log.note("worker", "worker 2 exited", fault="worker_exit", worker=2)
    for n in range(50):  # an autopilot and an operator busy for a while
        log.note("tuning", f"max_num_seqs={n}")
    assert all(e.fault is None for e in log.events)  # the fault left the common ring...
    assert [e.message for e in log.faults] == ["worker 2 exited"]  # ...not its own
    for n in range(4):
        log.note("worker", f"request {n} runs again", fault="rerun", requests=[n])
    assert [e.requests for e in log.faults] == [[1], [2], [3]]  # its own keeps the last
