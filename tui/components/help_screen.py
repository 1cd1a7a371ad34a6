"""HelpScreen: the keys, and what each panel shows."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]Keys[/]
  [b]tab[/] / [b]shift+tab[/]   move between device cards (and the requests table)
  [b]arrows[/]            move between cards: up/down in a pool, left/right across pools
  [b]m[/]                 move the selected device to another pool (asks which)
  [b]a[/]                 apply the planner's recommended move (asks first; with autopilot
                    on the planner applies its moves itself, so the key does nothing)
  [b]t[/]                 tuning: prefill token budget, chunk size, decode seqs, routing
  [b]p[/]                 pause or resume admission of new requests
  [b]?[/]                 this help          [b]q[/]  quit

[b]Pools[/] (top)
  A column per pool that has a device (Prefill, Decode, Colocated, in any mix) and a
  card per device: worker phase and pid, utilization, memory (a CPU worker's RSS, or
  the GPU's memory), KV blocks used of total, waiting and running requests, tokens/s.
  A device whose worker is being replaced sits in the pool it is moving to, with the
  move's phase on its bottom edge. The highlighted card is the selected device.

[b]Latency[/] (middle left)
  TTFT and TPOT p50/p99 over the last minute or so of snapshots, with the current
  values, over requests that finished in the appliance's window; then requests/s,
  output tokens/s and how many finished in the window. "—" means none finished.

[b]Requests[/] (middle right)
  The requests in flight, oldest first: state, prompt and output tokens, time to
  first token (or waited so far), and the prefill and decode workers serving them.

[b]Events[/] (bottom left)
  The running pool move (phase, requests its worker has left to drain), then the
  appliance's recent events: moves, tuning changes, workers starting and exiting.

[b]Planner[/] (bottom right)
  Whether autopilot is on (title), what the planner is doing, the layout now and the
  best one a move away (P/D/C devices per pool) with the goodput, requests/s within the
  SLO, the simulator predicts for each; then its latest decisions: time, the move or
  hold, predicted goodput before → after, the share of the window's requests measured
  within the SLO, "applied" when a move started from it, and why.

When the connection drops the console keeps the last data, dimmed, and reconnects.
[dim]escape, ? or q closes this help.[/]"""


class HelpScreen(ModalScreen[None]):
    """The keys and the panels, explained; escape, ? or q closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close"),
        Binding("question_mark", "close", "Close", show=False),
        Binding("q", "close", "Close", show=False),
    ]

    def compose(self) -> ComposeResult:
        """The help text, scrollable on small terminals."""
        with VerticalScroll(id="help-dialog", classes="dialog"):
            yield Static(HELP, id="help-text")

    def action_close(self) -> None:
        """Back to the console."""
        self.dismiss()
