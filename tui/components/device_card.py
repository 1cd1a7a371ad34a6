"""DeviceCard: one device and its worker, as a focusable card in its pool's column."""

from __future__ import annotations

from textual.content import Content
from textual.message import Message
from textual.widget import Widget

from appliance.admin.schema import DeviceInfo, Move, WorkerInfo
from tui.format import bar, human_bytes, percent

# Theme variables for each worker phase: green when serving, amber on the way in or out.
_PHASE_STYLE = {
    "ready": "$success",
    "starting": "$warning",
    "draining": "$warning",
    "stopping": "$error",
    "exited": "$error",
}


class DeviceCard(Widget, can_focus=True):
    """A device's name, worker phase and pid, load, memory, KV blocks and throughput.

    Its id is `device-<index>`. Focusing it makes it the selected device (it posts
    `DeviceCard.Selected`); the app's move acts on that device.
    """

    class Selected(Message):
        """The user focused the card of device `index`."""

        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(self, device: DeviceInfo, move: Move | None = None) -> None:
        super().__init__(id=f"device-{device.index}")
        self.device = device
        self.move = move
        self._set_titles()

    @property
    def index(self) -> int:
        """The device's index."""
        return self.device.index

    def show(self, device: DeviceInfo, move: Move | None) -> None:
        """Show newer data for the device (and the running move it is part of, if any)."""
        if device == self.device and move == self.move:
            return  # nothing changed: skip the repaint
        self.device, self.move = device, move
        self._set_titles()
        self.refresh()

    def on_focus(self) -> None:
        """Tell the app this device is now the selected one."""
        self.post_message(self.Selected(self.device.index))

    def render(self) -> Content:
        """The card's four lines."""
        worker = self.device.worker
        return Content("\n").join(
            [
                self._worker_line(worker),
                self._load_line(),
                self._kv_line(worker),
                self._queue_line(worker),
            ]
        )

    def _set_titles(self) -> None:
        box = self.device.box
        self.border_title = f"{box}: {self.device.name}" if box else self.device.name
        move = self.move
        if move is None:
            self.border_subtitle = ""
            return
        left = f", {move.remaining} left" if move.phase == "draining" else ""
        self.border_subtitle = f"⇄ {move.from_role} → {move.to_role}: {move.phase}{left}"

    def _worker_line(self, worker: WorkerInfo | None) -> Content:
        if worker is None:
            return Content.from_markup("[$text-muted]no worker[/]")
        style = _PHASE_STYLE.get(worker.phase, "$text")
        return Content.from_markup(
            f"[{style}]● $phase[/]  pid $pid  [$text-muted]worker $wid · restarts $restarts[/]",
            phase=worker.phase,
            pid="—" if worker.pid is None else str(worker.pid),
            wid=str(worker.worker_id),
            restarts=str(worker.restarts),
        )

    def _load_line(self) -> Content:
        device = self.device
        memory = human_bytes(device.memory_used)
        if device.memory_total is not None:
            memory += f" / {human_bytes(device.memory_total)}"
        # a CPU worker's memory is its RSS; a GPU's is what NVML says the card holds
        label = "rss" if device.kind == "cpu" else "mem"
        return Content.from_markup(
            "util [b]$util[/]   $label [b]$memory[/]",
            util=percent(device.utilization),
            label=label,
            memory=memory,
        )

    def _kv_line(self, worker: WorkerInfo | None) -> Content:
        used, total = (worker.kv_blocks_used, worker.kv_blocks_total) if worker else (0, 0)
        counts = f" {used}/{total} blocks"
        width = self.content_size.width - len("KV ") - len(counts)
        return Content.from_markup(
            "KV [$primary]$bar[/]$counts", bar=bar(used, total, width), counts=counts
        )

    def _queue_line(self, worker: WorkerInfo | None) -> Content:
        if worker is None:
            return Content("")
        line = Content.from_markup(
            "waiting [b]$waiting[/]   running [b]$running[/]   [b]$rate[/] tok/s",
            waiting=str(worker.waiting),
            running=str(worker.running),
            rate=f"{worker.tokens_per_s:.1f}",
        )
        return line + self._speculation(worker)

    @staticmethod
    def _speculation(worker: WorkerInfo) -> Content:
        """Speculative decoding's acceptance rate and tokens per verify step, where the
        worker has verified drafts (the admin API says; nothing otherwise)."""
        rate, length = worker.spec_acceptance_rate, worker.spec_mean_accepted_length
        if rate is None or length is None:
            return Content("")
        return Content.from_markup(
            "   spec [b]$rate[/] ×[b]$length[/]",
            rate=percent(rate * 100),
            length=f"{length:.1f}",
        )
