"""PoolsView: a column per pool, each device a card in its pool's column."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from appliance.admin.schema import DeviceInfo, Move, Snapshot
from tui.components.device_card import DeviceCard

# A layout: (pool, device indices in it) per column, left to right.
Columns = tuple[tuple[str, tuple[int, ...]], ...]

RUNNING_PHASES = ("draining", "stopping", "starting")
_TITLES = {
    "prefill": "Prefill",
    "decode": "Decode",
    "colocated": "Colocated",
    "unassigned": "No pool",
}


def running_moves(snapshot: Snapshot) -> dict[int, Move]:
    """The moves still under way, by device index."""
    return {move.device: move for move in snapshot.moves if move.phase in RUNNING_PHASES}


def pool_columns(snapshot: Snapshot) -> Columns:
    """Which column each device's card goes in: a column per pool that has a device, in
    the order prefill, decode, colocated (any mix: how the appliance started, `mode`,
    does not limit them).

    A device between workers (pool None) shows in the pool its running move takes it to;
    one with neither (a failed move left it empty) goes in a "No pool" column, last.
    In a column, the head's devices come first, then each other box's together.
    """
    columns: dict[str, list[int]] = {}
    moves = running_moves(snapshot)
    for device in sorted(snapshot.devices, key=lambda d: (d.box, d.index)):
        role: str
        if device.pool is not None:
            role = device.pool
        else:
            role = moves[device.index].to_role if device.index in moves else "unassigned"
        columns.setdefault(role, []).append(device.index)
    return tuple((role, tuple(columns[role])) for role in _TITLES if role in columns)


class PoolsView(Horizontal):
    """The pools side by side, with a card per device; id `pools`, columns `pool-<role>`.

    Arrow keys move the focus between cards (up/down in a column, left/right across);
    the focused card is the selected device, `selected`.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "step(0, -1)", "Previous device", show=False),
        Binding("down", "step(0, 1)", "Next device", show=False),
        Binding("left", "step(-1, 0)", "Pool to the left", show=False),
        Binding("right", "step(1, 0)", "Pool to the right", show=False),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._columns: Columns | None = None  # None: no snapshot shown yet
        self._cards: dict[int, DeviceCard] = {}
        self.selected: int | None = None
        """The index of the selected device (the last focused card), None before any."""

    def compose(self) -> ComposeResult:
        """A placeholder until the first snapshot."""
        yield Static("Waiting for the appliance's first snapshot…", id="pools-empty")

    @property
    def cards(self) -> dict[int, DeviceCard]:
        """The cards by device index."""
        return dict(self._cards)

    async def show(self, snapshot: Snapshot) -> None:
        """Show `snapshot`: cards update in place; the columns are rebuilt only when a
        device changed column or the set of devices changed."""
        columns = pool_columns(snapshot)
        devices = {device.index: device for device in snapshot.devices}
        moves = running_moves(snapshot)
        if columns != self._columns:
            await self._rebuild(columns, devices, moves)
            return
        for index, card in self._cards.items():
            card.show(devices[index], moves.get(index))

    def on_device_card_selected(self, message: DeviceCard.Selected) -> None:
        """Remember the focused card as the selected device; the message goes on to the app."""
        self._mark_selected(message.index)

    def action_step(self, dx: int, dy: int) -> None:
        """Focus the card next to the focused one: dy within the column, dx across."""
        grid = [indices for _, indices in self._columns or () if indices]
        if not grid:
            return
        column, row = self._position(grid)
        column = min(max(column + dx, 0), len(grid) - 1)
        row = min(max(row + dy, 0), len(grid[column]) - 1)
        self._cards[grid[column][row]].focus()

    def _position(self, grid: list[tuple[int, ...]]) -> tuple[int, int]:
        """(column, row) of the selected card in `grid`; the first card's if none."""
        for column, indices in enumerate(grid):
            if self.selected in indices:
                return column, indices.index(self.selected)
        return 0, 0

    async def _rebuild(
        self, columns: Columns, devices: dict[int, DeviceInfo], moves: dict[int, Move]
    ) -> None:
        focused = self.screen.focused
        # keep the keyboard on the cards if it was there (or nowhere yet)
        refocus = focused is None or isinstance(focused, DeviceCard)
        await self.remove_children()
        self._cards = {
            index: DeviceCard(devices[index], moves.get(index))
            for _, indices in columns
            for index in indices
        }
        await self.mount_all(self._column(role, indices) for role, indices in columns)
        if not columns:
            await self.mount(Static("The appliance reports no devices.", id="pools-empty"))
        self._columns = columns
        if self.selected not in self._cards:
            self.selected = next(iter(self._cards), None)
        self._mark_selected(self.selected)
        if refocus and self.selected is not None:
            self._cards[self.selected].focus()

    def _column(self, role: str, indices: tuple[int, ...]) -> Vertical:
        column = Vertical(
            *(self._cards[index] for index in indices), id=f"pool-{role}", classes="pool"
        )
        count = len(indices)
        column.border_title = f"{_TITLES.get(role, role)} · {count} device{'s' * (count != 1)}"
        return column

    def _mark_selected(self, index: int | None) -> None:
        self.selected = index
        for card_index, card in self._cards.items():
            card.set_class(card_index == index, "-selected")
