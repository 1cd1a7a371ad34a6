"""The console driven by Pilot against a real appliance (3 CPU devices: 1 prefill +
2 decode): it shows the real workers, its move key moves a device from decode to prefill
while requests keep completing, and its tuning form changes a knob the appliance reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
from server_process import API_KEY, ServerProcess
from textual.pilot import Pilot
from traffic import Traffic

from appliance.admin.schema import Snapshot
from appliance.bench.compare import free_port
from tui.app import ConsoleApp
from tui.client import AdminClient
from tui.components.device_card import DeviceCard
from tui.components.tuning_form import TuningForm

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

SIZE = (140, 44)
MOVE_BOUND_S = 240.0


async def until(pilot: Pilot, check: Callable[[], object], bound_s: float, what: str) -> None:
    deadline = time.monotonic() + bound_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {bound_s:.0f} s: {what}")
        await pilot.pause(0.2)


async def state(server: ServerProcess, token: str) -> Snapshot:
    """What /admin/state says, read beside the console (not through it)."""
    async with httpx.AsyncClient() as client:
        reply = await client.get(
            server.url + "/admin/state", headers={"Authorization": f"Bearer {token}"}
        )
    return Snapshot.model_validate(reply.json())


async def open_tuning_form(app: ConsoleApp, pilot: Pilot) -> None:
    await pilot.press("t")
    await until(pilot, lambda: isinstance(app.screen, TuningForm), 5, "tuning form")


def pool_of(snapshot: Snapshot, index: int) -> str | None:
    return snapshot.devices[index].pool


async def move_with_keys(
    app: ConsoleApp, pilot: Pilot, server: ServerProcess, token: str, device: int, to: str
) -> None:
    """Select the device's card, press m, pick the pool by its key (p, d or c); wait for
    /admin/state to agree."""
    app.query_one(f"#device-{device}").focus()
    await pilot.pause()
    assert app.selected_device == device
    await pilot.press("m")
    await pilot.pause()
    await pilot.press(to[0])
    latest: list[Snapshot] = []

    async def settled() -> bool:
        snap = await state(server, token)
        latest[:] = [snap]
        moves = snap.moves
        return pool_of(snap, device) == to and bool(moves) and moves[-1].phase == "done"

    deadline = time.monotonic() + MOVE_BOUND_S
    while not await settled():
        assert time.monotonic() < deadline, f"device {device} did not reach {to}"
        await pilot.pause(0.3)
    assert latest[0].devices[device].worker.phase == "ready"
    # the console redraws the card in its new column from the event stream
    await until(
        pilot, lambda: app.query(f"#pool-{to} #device-{device}"), 20, f"card in {to} column"
    )


def test_console_shows_moves_and_tunes_a_real_appliance(pool_server: ServerProcess) -> None:
    asyncio.run(moves_and_tunes(pool_server))


async def moves_and_tunes(pool_server: ServerProcess) -> None:
    token = pool_server.admin_token_file.read_text()
    app = ConsoleApp(AdminClient(pool_server.url, token))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.connected and app.snapshot, 30, "first snapshot")
        truth = await state(pool_server, token)
        cards = {card.id: card for card in app.query(DeviceCard)}
        assert set(cards) == {"device-0", "device-1", "device-2"}
        assert app.query("#pool-prefill #device-0") and app.query("#pool-decode #device-2")
        for device in truth.devices:
            text = str(cards[f"device-{device.index}"].render())
            assert str(device.worker.pid) in text  # the real worker processes

        with Traffic(pool_server.url, API_KEY, concurrency=3) as traffic:
            traffic.wait_completed(3)
            await move_with_keys(app, pilot, pool_server, token, 2, "prefill")
            served = traffic.completed
            await asyncio.to_thread(traffic.wait_completed, served + 3)
            await move_with_keys(app, pilot, pool_server, token, 2, "decode")
            await asyncio.to_thread(traffic.wait_completed, traffic.completed + 3)
        assert traffic.errors == []

        before = (await state(pool_server, token)).tuning.decode_max_seqs
        await open_tuning_form(app, pilot)
        field = app.screen.query_one("#decode_max_seqs")
        field.value = "7"
        await pilot.click("#tuning-apply")
        for _ in range(50):
            if (await state(pool_server, token)).tuning.decode_max_seqs == 7:
                break
            await pilot.pause(0.1)
        assert (await state(pool_server, token)).tuning.decode_max_seqs == 7
        await until(pilot, lambda: app.snapshot.tuning.decode_max_seqs == 7, 10, "console sees 7")

        await app.client.tune(decode_max_seqs=before)


def test_a_bad_knob_in_the_form_is_shown_and_not_sent(pool_server: ServerProcess) -> None:
    asyncio.run(bad_knob(pool_server))


async def bad_knob(pool_server: ServerProcess) -> None:
    token = pool_server.admin_token_file.read_text()
    app = ConsoleApp(AdminClient(pool_server.url, token))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot, 30, "first snapshot")
        before = (await state(pool_server, token)).tuning
        await open_tuning_form(app, pilot)
        app.screen.query_one("#chunk_size").value = str(before.prefill_token_budget * 2)
        await pilot.click("#tuning-apply")
        await pilot.pause(0.5)
        assert isinstance(app.screen, TuningForm)  # still open, saying why
        error = str(app.screen.query_one("#tuning-error").render())
        assert "must not exceed prefill_token_budget" in error
        assert (await state(pool_server, token)).tuning == before


def test_the_console_says_disconnected_and_keeps_running() -> None:
    asyncio.run(disconnected())


async def disconnected() -> None:
    app = ConsoleApp(AdminClient(f"http://127.0.0.1:{free_port()}", "token"))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "disconnected" in app.connection_detail, 10, "disconnected")
        assert not app.connected and app.is_running
