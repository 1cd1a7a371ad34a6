"""The console shows each worker's speculative decoding figures as the admin API gives
them: a decode worker that verified drafts shows its acceptance rate and mean accepted
length on its card; a worker without them shows nothing of it (Pilot, no server)."""

from __future__ import annotations

import asyncio

from tests_root import DATA

from appliance.admin.schema import Snapshot
from tui.app import ConsoleApp
from tui.components.device_card import DeviceCard
from tui.messages import ConnectionChanged, SnapshotArrived

SIZE = (140, 44)


def with_speculation(base: Snapshot) -> Snapshot:
    """The recorded snapshot, its device 1's worker having kept 72% of its drafts."""
    devices = list(base.devices)
    worker = devices[1].worker
    assert worker is not None
    figures = {"spec_acceptance_rate": 0.72, "spec_mean_accepted_length": 2.94}
    devices[1] = devices[1].model_copy(update={"worker": worker.model_copy(update=figures)})
    return base.model_copy(update={"devices": devices})


def test_a_card_shows_its_workers_acceptance_rate_and_mean_accepted_length() -> None:
    snapshot = with_speculation(
        Snapshot.model_validate_json((DATA / "console_state.json").read_text())
    )

    async def scenario() -> tuple[str, str]:
        app = ConsoleApp(None, watch=False)
        async with app.run_test(size=SIZE) as pilot:
            app.post_message(ConnectionChanged(True, "connected"))
            app.post_message(SnapshotArrived(snapshot))
            await pilot.pause()
            cards = [app.query_one(f"#device-{i}", DeviceCard) for i in (0, 1)]
            return str(cards[0].render()), str(cards[1].render())

    plain, speculating = asyncio.run(scenario())
    assert "spec 72% ×2.9" in speculating
    assert "spec" not in plain
