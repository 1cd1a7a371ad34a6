"""The console (tui/) without a server: a screenshot of it fed a replay of snapshots, the
help screen, the planner panel, and the move and apply keys against a client that records
its calls."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tests_root import DATA
from textual.content import Content
from textual.pilot import Pilot

from appliance.admin.schema import Move, Percentiles, PlannerView, Snapshot
from tui.app import ConsoleApp
from tui.client import AdminClient
from tui.components.confirm_move import ConfirmMove
from tui.components.help_screen import HelpScreen
from tui.components.planner_panel import AUTOPILOT_APPLIES, NO_PLANNER, PlannerPanel
from tui.components.pools_view import pool_columns
from tui.messages import ConnectionChanged, SnapshotArrived

STATE = DATA / "console_state.json"
SIZE = (140, 44)
STEPS = 20


@pytest.fixture
def utc() -> Iterator[None]:
    """Event times render in local time: pin it so the screenshot is the same anywhere."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def base_state() -> Snapshot:
    """The recorded snapshot the replay ends on."""
    return Snapshot.model_validate_json(STATE.read_text())


def replay(base: Snapshot, steps: int = STEPS) -> list[Snapshot]:
    """`steps` snapshots half a second apart ending on `base`, k steps before the end
    varying by fixed waves (so the sparklines have shape) and with k fewer tokens out."""
    return [_earlier(base, k) for k in range(steps - 1, -1, -1)]


def _earlier(base: Snapshot, k: int) -> Snapshot:
    def wave(value: float | None, amplitude: float, period: float) -> float | None:
        return None if value is None else round(value * (1 + amplitude * math.sin(k / period)), 1)

    latency = base.latency.model_copy(
        update={
            "ttft_ms": Percentiles(
                p50=wave(base.latency.ttft_ms.p50, 0.35, 2.0),
                p99=wave(base.latency.ttft_ms.p99, 0.5, 3.3),
            ),
            "tpot_ms": Percentiles(
                p50=wave(base.latency.tpot_ms.p50, 0.2, 1.4),
                p99=wave(base.latency.tpot_ms.p99, 0.3, 2.6),
            ),
            "requests_per_s": wave(base.latency.requests_per_s, 0.25, 2.0),
        }
    )
    devices = [
        d.model_copy(update={"worker": _slower(d.worker, k)}) if d.worker else d
        for d in base.devices
    ]
    requests = [
        r.model_copy(update={"output_tokens": max(r.output_tokens - k, min(r.output_tokens, 1))})
        for r in base.requests
    ]
    update: dict[str, Any] = {
        "at": base.at - 0.5 * k,
        "latency": latency,
        "devices": devices,
        "requests": requests,
    }
    return base.model_copy(update=update)


def _slower(worker: Any, k: int) -> Any:
    rate = round(worker.tokens_per_s * (1 + 0.1 * math.sin(k)), 1)
    return worker.model_copy(update={"tokens_per_s": rate})


async def feed(pilot: Pilot[Any], snapshots: list[Snapshot]) -> None:
    """Post the snapshots one at a time, letting each be drawn (back to back they would
    collapse into the last: SnapshotArrived replaces a pending one)."""
    pilot.app.post_message(ConnectionChanged(True, "connected"))
    for snapshot in snapshots:
        pilot.app.post_message(SnapshotArrived(snapshot))
        await pilot.pause()


def test_state_file_is_a_snapshot() -> None:
    snapshot = base_state()
    assert [d.pool for d in snapshot.devices] == ["prefill", "decode", "decode"]
    assert {r.state for r in snapshot.requests} == {"queued", "prefill", "handoff", "decode"}
    planner = snapshot.planner
    assert planner is not None and not planner.auto_rebalance
    assert planner.current == [d.pool for d in snapshot.devices]
    assert planner.recommended == ["prefill", "decode", "colocated"]
    assert [d.move_device for d in planner.decisions] == [2, None, 2]


def test_console_screenshot(snap_compare: Any, utc: None) -> None:
    """Pools (cpu0 prefill; cpu1, cpu2 decode), latency sparklines over 20 snapshots, the
    requests table, the events and the planner panel, cpu0's card focused."""

    async def run_before(pilot: Pilot[Any]) -> None:
        await feed(pilot, replay(base_state()))
        await pilot.pause()

    assert snap_compare(ConsoleApp(None, watch=False), terminal_size=SIZE, run_before=run_before)


def test_help_opens_and_closes() -> None:
    async def scenario() -> None:
        app = ConsoleApp(None, watch=False)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)

    asyncio.run(scenario())


class _NotesConsole(ConsoleApp):
    """The console without a client, recording what it notifies."""

    def __init__(self) -> None:
        super().__init__(None, watch=False)
        self.notes: list[str] = []

    def notify(self, message: str, **kwargs: Any) -> None:
        self.notes.append(message)
        super().notify(message, **kwargs)


def test_move_without_client_says_not_connected() -> None:
    async def scenario() -> None:
        app = _NotesConsole()
        async with app.run_test(size=SIZE) as pilot:
            await feed(pilot, replay(base_state(), steps=1))
            assert app.snapshot is not None and app.selected_device == 0
            assert app.focused is app.query_one("#device-0")
            await pilot.press("m")
            await pilot.pause()
            assert app.notes == ["not connected"]
            assert app.screen is app.screen_stack[0]  # no dialog opened
            assert app.is_running

    asyncio.run(scenario())


def test_pools_are_the_roles_the_devices_have_not_the_mode() -> None:
    base = base_state()
    assert [role for role, _ in pool_columns(base)] == ["prefill", "decode"]
    mixed = with_roles(base, ["colocated", "decode", "decode"])
    assert mixed.mode == "disaggregated"
    assert pool_columns(mixed) == (("decode", (1, 2)), ("colocated", (0,)))


def test_a_pool_shows_the_heads_devices_then_each_other_boxes() -> None:
    base = with_roles(base_state(), ["decode", "prefill", "decode"])
    boxes = ["b", "", ""]
    devices = [
        d.model_copy(update={"box": box}) for d, box in zip(base.devices, boxes, strict=True)
    ]
    spread = base.model_copy(update={"devices": devices})
    assert pool_columns(spread) == (("prefill", (1,)), ("decode", (2, 0)))

    async def scenario() -> None:
        app = _NotesConsole()
        async with app.run_test(size=SIZE) as pilot:
            await feed(pilot, [spread])
            assert app.query_one("#device-0").border_title == "b: " + devices[0].name

    asyncio.run(scenario())


def with_roles(base: Snapshot, roles: list[Any]) -> Snapshot:
    """`base` with each device (and its worker) in the pool `roles` gives it."""
    devices = [
        d.model_copy(
            update={"pool": role, "worker": d.worker and d.worker.model_copy(update={"role": role})}
        )
        for d, role in zip(base.devices, roles, strict=True)
    ]
    return base.model_copy(update={"devices": devices})


def with_planner(base: Snapshot, **changes: Any) -> Snapshot:
    """`base` with its planner's fields changed."""
    assert base.planner is not None
    planner: PlannerView = base.planner.model_copy(update=changes)
    return base.model_copy(update={"planner": planner})


def panel_text(app: ConsoleApp) -> str:
    return str(app.query_one("#planner", PlannerPanel).render())


def panel_title(app: ConsoleApp) -> str:
    return Content.from_markup(str(app.query_one("#planner", PlannerPanel).border_title)).plain


def test_planner_panel_shows_the_plan_and_decisions(utc: None) -> None:
    async def scenario() -> None:
        app = ConsoleApp(None, watch=False)
        async with app.run_test(size=SIZE) as pilot:
            await feed(pilot, replay(base_state(), steps=1))
            assert panel_title(app) == "Planner · autopilot off"
            lines = panel_text(app).splitlines()
            assert lines[0] == "recommends moving device 2 to colocated: +0.14 req/s predicted"
            now = "now 1.38 req/s 1P+2D 0:prefill 1:decode 2:decode"
            assert lines[1].split() == now.split()
            plan = "recommended 1.52 req/s 1P+1D+1C move device 2 → colocated"
            assert lines[2].split() == plan.split()
            assert lines[3].startswith("11:58:20  move device 2 → decode  0.95 → 1.32  SLO 71%")
            assert "applied  TPOT p99 over the SLO" in lines[3]
            assert lines[4].startswith("11:59:30  hold  1.38 → 1.38  SLO 93%  the current")
            assert "applied" not in lines[5] and "SLO 88%" in lines[5]
            assert "[" not in lines[4]  # a decision without its rule (an older appliance)

            # The rule that decided shows in brackets before the reason.
            base = base_state()
            assert base.planner is not None
            ruled = [d.model_copy(update={"rule": "margin"}) for d in base.planner.decisions]
            await feed(pilot, [with_planner(base, decisions=ruled)])
            lines = panel_text(app).splitlines()
            assert "  [margin] the current layout is the best one move away" in lines[4]

            await feed(pilot, [with_planner(base_state(), auto_rebalance=True)])
            assert panel_title(app) == "Planner · autopilot on"

    asyncio.run(scenario())


def test_planner_panel_without_a_planner() -> None:
    async def scenario() -> None:
        app = ConsoleApp(None, watch=False)
        async with app.run_test(size=SIZE) as pilot:
            await feed(pilot, [base_state().model_copy(update={"planner": None})])
            assert panel_text(app) == NO_PLANNER

    asyncio.run(scenario())


class _RecordingClient(AdminClient):
    """A client that records the admin calls instead of sending them."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9", "token")
        self.calls: list[tuple[Any, ...]] = []

    async def move(self, device: int, to: str) -> Move:
        self.calls.append(("move", device, to))
        return _move(device, to)

    async def apply_plan(self) -> Move:
        self.calls.append(("apply",))
        return _move(2, "colocated")


def _move(device: int, to: Any) -> Move:
    return Move(
        move_id=2,
        device=device,
        from_role="decode",
        to_role=to,
        phase="draining",
        remaining=2,
        started_at=0.0,
    )


class _ClientConsole(_NotesConsole):
    """The console with a recording client, noting what it notifies."""

    def __init__(self) -> None:
        super().__init__()
        self.recorder = _RecordingClient()
        self._client = self.recorder


async def settle(app: ConsoleApp, pilot: Pilot[Any]) -> None:
    """Let the admin call a dialog's answer started finish and notify."""
    await pilot.pause()
    await app.workers.wait_for_complete()
    await pilot.pause()


def test_apply_with_autopilot_on_only_says_so() -> None:
    async def scenario() -> None:
        app = _ClientConsole()
        async with app.run_test(size=SIZE) as pilot:
            await feed(pilot, [with_planner(base_state(), auto_rebalance=True)])
            await pilot.press("a")
            await pilot.pause()
            assert app.notes == [AUTOPILOT_APPLIES]
            assert app.screen is app.screen_stack[0]  # no dialog opened
            assert app.recorder.calls == []

    asyncio.run(scenario())


def test_apply_with_nothing_to_apply() -> None:
    async def scenario() -> None:
        app = _ClientConsole()
        async with app.run_test(size=SIZE) as pilot:
            layout = ["prefill", "decode", "decode"]
            hold = with_planner(base_state(), recommended=layout, next_move=None, status="holding")
            await feed(pilot, [hold])
            await pilot.press("a")
            await pilot.pause()
            assert app.notes == ["Nothing to apply: holding"]
            assert app.screen is app.screen_stack[0]
            assert app.recorder.calls == []

    asyncio.run(scenario())


def test_apply_asks_then_sends() -> None:
    async def scenario() -> None:
        app = _ClientConsole()
        async with app.run_test(size=SIZE) as pilot:
            await feed(pilot, [base_state()])
            await pilot.press("a")
            await pilot.pause()
            assert isinstance(app.screen, ConfirmMove)
            assert "move cpu2 (cores 0) from decode to colocated" in app.screen.question
            assert "1.38 req/s → 1.52 req/s" in app.screen.question
            await pilot.press("y")
            await settle(app, pilot)
            assert app.recorder.calls == [("apply",)]
            assert app.notes == ["Moving cpu2 (cores 0) to colocated: draining (move #2)."]

    asyncio.run(scenario())


def test_move_offers_a_colocated_device_the_two_other_roles() -> None:
    async def scenario() -> None:
        app = _ClientConsole()
        async with app.run_test(size=SIZE) as pilot:
            await feed(pilot, [with_roles(base_state(), ["colocated", "decode", "decode"])])
            assert app.query("#pool-colocated #device-0") and not app.query("#pool-prefill")
            app.query_one("#device-0").focus()
            await pilot.pause()
            await pilot.press("m")
            await pilot.pause()
            dialog = app.screen
            assert isinstance(dialog, ConfirmMove)
            buttons = [button.id for button in dialog.query("Button")]
            assert buttons == ["choice-prefill", "choice-decode", "choice-cancel"]
            assert "from colocated to prefill or decode" in dialog.question
            await pilot.press("n")  # cancel: nothing sent
            await settle(app, pilot)
            assert app.screen is app.screen_stack[0] and app.recorder.calls == []

            await pilot.press("m")
            await pilot.pause()
            await pilot.press("d")
            await settle(app, pilot)
            assert app.recorder.calls == [("move", 0, "decode")]
            assert app.notes == ["Moving cpu0 (cores 0) to decode: draining (move #2)."]

    asyncio.run(scenario())
