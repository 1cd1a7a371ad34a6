"""The console's KV store panel (Pilot, no server): hidden while the appliance reports no
store; with one, a line per tier (blocks, bytes against capacity, blocks served) and the
lookup counts, as the admin snapshot gives them, updated by the next snapshot."""

from __future__ import annotations

import asyncio

from tests_root import DATA
from textual.widgets import Static

from appliance.admin.schema import KVStoreView, Snapshot
from tui.app import ConsoleApp
from tui.components.kv_store_panel import KVStorePanel
from tui.messages import ConnectionChanged, SnapshotArrived

SIZE = (160, 44)
MIB = 1 << 20


def recorded() -> Snapshot:
    return Snapshot.model_validate_json((DATA / "console_state.json").read_text())


def with_store(base: Snapshot, host_hits: int) -> Snapshot:
    """A store of both tiers: 17 blocks in 6 of 64 MiB of shared memory, 408 on disk."""
    view = KVStoreView(
        hits={"host": host_hits, "disk": 408},
        misses=3,
        lookups=48,
        bytes_read={"host": host_hits * 360 * 1024, "disk": 0},
        bytes_written={"host": 0, "disk": 0},
        blocks={"host": 17, "disk": 408},
        used_bytes={"host": 6 * MIB, "disk": 144 * MIB},
        capacity_bytes={"host": 64 * MIB, "disk": 10240 * MIB},
        refused=1,
    )
    return base.model_copy(update={"kv_store": view})


def test_the_store_panel_shows_each_tier_and_follows_the_snapshots() -> None:
    async def scenario() -> tuple[bool, bool, list[str], str, list[str], bool]:
        app = ConsoleApp(None, watch=False)
        async with app.run_test(size=SIZE) as pilot:
            app.post_message(ConnectionChanged(True, "connected"))
            app.post_message(SnapshotArrived(recorded()))
            await pilot.pause()
            panel = app.query_one("#kv-store", KVStorePanel)
            hidden = not panel.display
            app.post_message(SnapshotArrived(with_store(recorded(), host_hits=784)))
            await pilot.pause()
            shown = panel.display and panel.region.width > 0
            tiers = str(app.query_one("#kv-store-tiers", Static).render()).splitlines()
            totals = str(app.query_one("#kv-store-totals", Static).render())
            app.post_message(SnapshotArrived(with_store(recorded(), host_hits=800)))
            await pilot.pause()
            later = str(app.query_one("#kv-store-tiers", Static).render()).splitlines()
            app.post_message(SnapshotArrived(recorded()))  # the store off again
            await pilot.pause()
            return hidden, shown, tiers, totals, later, not panel.display

    hidden, shown, tiers, totals, later, hidden_again = asyncio.run(scenario())
    assert hidden and shown and hidden_again
    assert len(tiers) == 2
    host, disk = tiers
    assert host.startswith("host") and "6.0 MiB / 64.0 MiB" in host
    assert "17 blocks" in host and host.endswith("hits 784")
    assert disk.startswith("disk") and "144.0 MiB / 10.0 GiB" in disk
    assert "408 blocks" in disk and disk.endswith("hits 408")
    assert totals == "lookups 48 · short 3 · refused 1"
    assert later[0].endswith("hits 800")
