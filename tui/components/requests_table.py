"""RequestsTable: the requests in flight, a row each, updated in place."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from appliance.admin.schema import RequestRow, Snapshot
from tui.format import ms

# (column key, label); the keys address cells in update_cell
COLUMNS = (
    ("id", "id"),
    ("state", "state"),
    ("prompt", "prompt tok"),
    ("output", "output tok"),
    ("ttft", "TTFT"),
    ("prefill", "prefill w"),
    ("decode", "decode w"),
)


# numbers read best right-aligned
_RIGHT = frozenset({"id", "prompt", "output", "ttft"})


def row_cells(row: RequestRow) -> tuple[str, ...]:
    """The cells of a request's row, in COLUMNS order."""
    return (
        str(row.request_id),
        row.state,
        str(row.prompt_tokens),
        str(row.output_tokens),
        ms(row.ttft_ms),
        "—" if row.prefill_worker is None else str(row.prefill_worker),
        "—" if row.decode_worker is None else str(row.decode_worker),
    )


def _cell(column: str, value: str) -> Text:
    return Text(value, justify="right" if column in _RIGHT else "left")


class RequestsTable(DataTable[Text]):
    """The requests in flight, oldest first; id `requests`, row keys the request ids (str).

    Rows update in place: finished requests' rows go, new ones are added at the end.
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self.border_title = "Requests"
        self._cells: dict[str, tuple[str, ...]] = {}

    def on_mount(self) -> None:
        """Add the columns."""
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    def show(self, snapshot: Snapshot) -> None:
        """Make the rows match `snapshot.requests`."""
        rows = {str(row.request_id): row_cells(row) for row in snapshot.requests}
        for key in [key for key in self._cells if key not in rows]:
            self.remove_row(key)
            del self._cells[key]
        for key, cells in rows.items():
            self._show_row(key, cells)
        shown = len(rows)
        extra = f", showing {shown}" if shown < snapshot.requests_in_flight else ""
        self.border_title = f"Requests · {snapshot.requests_in_flight} in flight{extra}"

    def _show_row(self, key: str, cells: tuple[str, ...]) -> None:
        old = self._cells.get(key)
        if old is None:
            self.add_row(
                *(_cell(column, value) for (column, _), value in zip(COLUMNS, cells, strict=True)),
                key=key,
            )
        else:
            for (column, _), before, after in zip(COLUMNS, old, cells, strict=True):
                if before != after:
                    self.update_cell(key, column, _cell(column, after), update_width=True)
        self._cells[key] = cells
