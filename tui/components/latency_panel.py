"""LatencyPanel: TTFT and TPOT percentiles over the last snapshots, and throughput."""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

from appliance.admin.schema import Latency, Snapshot
from tui.format import ms

HISTORY = 60
"""How many snapshots the sparklines span (half a minute at two a second)."""

# (key, label) per sparkline; the key names the widgets: spark-<key>, value-<key>
SERIES = (
    ("ttft-p50", "TTFT p50"),
    ("ttft-p99", "TTFT p99"),
    ("tpot-p50", "TPOT p50"),
    ("tpot-p99", "TPOT p99"),
)


def series_values(latency: Latency) -> dict[str, float | None]:
    """The current value of each series, by key."""
    return {
        "ttft-p50": latency.ttft_ms.p50,
        "ttft-p99": latency.ttft_ms.p99,
        "tpot-p50": latency.tpot_ms.p50,
        "tpot-p99": latency.tpot_ms.p99,
    }


class LatencyPanel(Vertical):
    """Sparklines of TTFT/TPOT p50 and p99 with their current values, and the window's
    requests/s, output tokens/s and finished count; id `latency`.

    The history lives here: one point per distinct snapshot, the last HISTORY of them.
    A percentile the window has no requests for counts as 0 (and reads "—"), so the four
    lines stay aligned in time.
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Latency"
        self.history: dict[str, deque[float]] = {key: deque(maxlen=HISTORY) for key, _ in SERIES}
        self._last_at: float | None = None

    def compose(self) -> ComposeResult:
        """A row per series, then the throughput line."""
        for key, label in SERIES:
            with Horizontal(classes="series"):
                yield Label(label, classes="series-name")
                yield Sparkline([], id=f"spark-{key}")
                yield Label("—", id=f"value-{key}", classes="series-value")
        yield Static("", id="throughput")

    def show(self, snapshot: Snapshot) -> None:
        """Add `snapshot`'s latencies to the history (once per snapshot) and show them."""
        values = series_values(snapshot.latency)
        if snapshot.at != self._last_at:
            self._last_at = snapshot.at
            for key, value in values.items():
                self.history[key].append(value or 0.0)
        if not self.query(f"#spark-{SERIES[0][0]}"):  # not composed yet: shown next time
            return
        for key, value in values.items():
            self.query_one(f"#spark-{key}", Sparkline).data = list(self.history[key])
            self.query_one(f"#value-{key}", Label).update(ms(value))
        self.query_one("#throughput", Static).update(self._throughput(snapshot.latency))

    @staticmethod
    def _throughput(latency: Latency) -> str:
        return (
            f"[b]{latency.requests_per_s:.1f}[/] req/s   "
            f"[b]{latency.output_tokens_per_s:.1f}[/] output tok/s   "
            f"[b]{latency.finished}[/] finished in {latency.window_s:g} s"
        )
