"""The console's fault panel (Pilot, no server): hidden while the appliance reports no
fault; once it does, the counts by kind and the latest fault events with the worker, box,
cause and requests each touched, as the admin API gives them."""

from __future__ import annotations

import asyncio
import time

from tests_root import DATA
from textual.widgets import Static

from appliance.admin.schema import Event, Snapshot
from tui.app import ConsoleApp
from tui.components.fault_panel import FaultPanel
from tui.messages import ConnectionChanged, SnapshotArrived

SIZE = (140, 44)


def recorded() -> Snapshot:
    return Snapshot.model_validate_json((DATA / "console_state.json").read_text())


def with_faults(base: Snapshot) -> Snapshot:
    """Box b lost: its worker 4's exit, two requests run again."""
    at = time.time()
    events = [
        Event(seq=30, at=at, kind="box", message="lost box 'b'", fault="box_lost", box="b",
              cause="no answer to heartbeats for 5.3 s", requests=[7, 9]),
        Event(seq=31, at=at, kind="worker", message="worker 4 exited", fault="worker_exit",
              worker=4, box="b", cause="its box was lost", requests=[7, 9]),
        Event(seq=32, at=at, kind="worker", message="request 7 runs again", fault="rerun",
              cause="worker 4 exited", requests=list(range(1, 10))),
    ]  # fmt: skip
    faults = {"box_lost": 1, "worker_exit": 1, "rerun": 2, "stall": 0}
    return base.model_copy(update={"faults": faults, "fault_events": events})


def test_the_fault_panel_appears_with_the_first_fault_and_lists_what_it_touched() -> None:
    async def scenario() -> tuple[bool, bool, str, list[str]]:
        app = ConsoleApp(None, watch=False)
        async with app.run_test(size=SIZE) as pilot:
            app.post_message(ConnectionChanged(True, "connected"))
            app.post_message(SnapshotArrived(recorded()))
            await pilot.pause()
            panel = app.query_one("#faults", FaultPanel)
            before = panel.display
            app.post_message(SnapshotArrived(with_faults(recorded())))
            await pilot.pause()
            counts = str(app.query_one("#fault-counts", Static).render())
            lines = str(app.query_one("#fault-lines", Static).render()).splitlines()
            return before, panel.display and panel.region.width > 0, counts, lines

    before, shown, counts, lines = asyncio.run(scenario())
    assert not before and shown
    assert counts == "box_lost 1 · rerun 2 · worker_exit 1"  # a kind at 0 is left out
    assert len(lines) == 3
    assert "box_lost" in lines[0] and "box b: no answer to heartbeats for 5.3 s" in lines[0]
    assert lines[0].endswith("[requests 7, 9]")
    assert "worker 4 box b: its box was lost" in lines[1]
    assert lines[2].endswith("[requests 1, 2, 3, 4, 5, 6 +3]")


def test_a_box_joining_alone_leaves_the_fault_panel_hidden() -> None:
    """A join is not a fault: the first join of box b (its only event) shows no panel."""
    joined = Event(seq=3, at=time.time(), kind="box", message="box 'b' joined",
                   fault="box_joined", box="b", cause="its agent joined")  # fmt: skip
    faults = {"box_joined": 1, "box_lost": 0, "worker_exit": 0}
    snapshot = recorded().model_copy(update={"faults": faults, "fault_events": [joined]})

    async def scenario() -> bool:
        app = ConsoleApp(None, watch=False)
        async with app.run_test(size=SIZE) as pilot:
            app.post_message(ConnectionChanged(True, "connected"))
            app.post_message(SnapshotArrived(snapshot))
            await pilot.pause()
            return app.query_one("#faults", FaultPanel).display

    assert not asyncio.run(scenario())
