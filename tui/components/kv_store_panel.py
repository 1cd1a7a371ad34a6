"""KVStorePanel: the box's KV store (issue 41) as the admin snapshot reports it: per tier
the blocks held, the bytes against the tier's capacity and the blocks served from it;
then lookups, lookups that ended short of the prompt and disk blocks refused. Hidden
while the store is off (the snapshot's kv_store is null)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Static

from appliance.admin.schema import KVStoreView, Snapshot
from tui.format import bar, human_bytes

BAR_WIDTH = 10


def tier_line(view: KVStoreView, tier: str) -> Content:
    """'host ███░░ 12.0 MiB / 64.0 MiB  17 blocks  hits 784' for one tier."""
    used, capacity = view.used_bytes.get(tier, 0), view.capacity_bytes.get(tier, 0)
    return Content.assemble(
        (f"{tier:<5}", "bold"),
        (bar(used, capacity, BAR_WIDTH), "$accent"),
        f" {human_bytes(used)} / {human_bytes(capacity)}",
        f"  {view.blocks.get(tier, 0)} blocks",
        (f"  hits {view.hits.get(tier, 0)}", "$text-success"),
    )


def totals_line(view: KVStoreView) -> str:
    """'lookups 48 · short 3 · refused 0'."""
    return f"lookups {view.lookups} · short {view.misses} · refused {view.refused}"


class KVStorePanel(Vertical):
    """One line per tier (`#kv-store-tiers`) above the lookup counts (`#kv-store-totals`);
    id `kv-store`. Shown while the snapshot has a store (Snapshot.kv_store)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "KV store"
        self.display = False

    def compose(self) -> ComposeResult:
        yield Static("", id="kv-store-tiers")
        yield Static("", id="kv-store-totals")

    def show(self, snapshot: Snapshot) -> None:
        """Show the snapshot's store figures (hide the panel when it has none)."""
        view = snapshot.kv_store
        self.display = view is not None
        if view is None:
            return
        lines = [tier_line(view, tier) for tier in view.capacity_bytes]
        self.query_one("#kv-store-tiers", Static).update(Content("\n").join(lines))
        self.query_one("#kv-store-totals", Static).update(totals_line(view))
