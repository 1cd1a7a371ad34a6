"""The console (tui/) without a server: a screenshot of it fed a replay of snapshots, the
help screen, and a move with no client."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from appliance.admin.schema import Percentiles, Snapshot
from tui.app import ConsoleApp
from tui.components.help_screen import HelpScreen
from tui.messages import ConnectionChanged, SnapshotArrived

STATE = Path(__file__).parent / "data" / "console_state.json"
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


def test_console_screenshot(snap_compare: Any, utc: None) -> None:
    """Pools (cpu0 prefill; cpu1, cpu2 decode), latency sparklines over 20 snapshots, the
    requests table and the events, cpu0's card focused."""

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
