"""TuningForm: edit the live knobs; checked against the schema's Tuning before sending."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import httpx
from pydantic import ValidationError
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from appliance.admin.schema import Tuning
from tui.client import AdminError

# (field, label) of the integer knobs; each Input's id is its field's name
NUMBER_FIELDS = (
    ("prefill_token_budget", "Prefill token budget (tokens per prefill step)"),
    ("chunk_size", "Chunk size (longest piece of one prompt per step)"),
    ("decode_max_seqs", "Decode max seqs (sequences per decode worker)"),
)
ROUTING_OPTIONS = (
    ("least loaded (shortest wait for a first token)", "least_loaded"),
    ("round robin", "round_robin"),
)
# What the form edits; admission has its own key (p).
EDITED = (*(name for name, _ in NUMBER_FIELDS), "routing")


def validation_message(error: ValidationError) -> str:
    """pydantic's errors as one line: 'field: problem; ...'."""
    parts = []
    for item in error.errors():
        message = str(item["msg"]).removeprefix("Value error, ")
        where = ".".join(str(part) for part in item["loc"])
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def tuning_changes(current: Tuning, entered: dict[str, Any]) -> dict[str, Any]:
    """The fields of `entered` that differ from `current`, once the whole result passes
    Tuning's checks; raises ValidationError if it doesn't."""
    tuning = Tuning.model_validate({**current.model_dump(), **entered})
    return {
        name: getattr(tuning, name)
        for name in EDITED
        if getattr(tuning, name) != getattr(current, name)
    }


class TuningForm(ModalScreen[Tuning | None]):
    """Inputs for the integer knobs (ids `prefill_token_budget`, `chunk_size`,
    `decode_max_seqs`), a Select for `routing`, an error line (`tuning-error`).

    Enter in an input or the Apply button (`tuning-apply`) submits: a bad value shows its
    message in the form; good values go to `apply` (only the changed ones) and the form
    closes with the new Tuning, or shows the API's error. Escape or Cancel
    (`tuning-cancel`) closes it with None.
    """

    AUTO_FOCUS = "Input"  # the first input
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: Tuning, apply: Callable[..., Awaitable[Tuning]]) -> None:
        super().__init__()
        self.current = current
        self._apply = apply

    def compose(self) -> ComposeResult:
        """The inputs, the routing choice, the error line and the buttons."""
        with Vertical(id="tuning-dialog", classes="dialog") as dialog:
            dialog.border_title = "Tuning"
            for name, label in NUMBER_FIELDS:
                yield Label(label)
                yield Input(str(getattr(self.current, name)), id=name)
            yield Label("Routing (how a prompt picks its prefill worker)")
            yield Select(
                ROUTING_OPTIONS, value=self.current.routing, allow_blank=False, id="routing"
            )
            yield Static("", id="tuning-error", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Apply", variant="primary", id="tuning-apply")
                yield Button("Cancel", id="tuning-cancel")

    def entered(self) -> dict[str, Any]:
        """What the form holds now, as typed (pydantic parses the numbers)."""
        values: dict[str, Any] = {
            name: self.query_one(f"#{name}", Input).value.strip() for name, _ in NUMBER_FIELDS
        }
        values["routing"] = self.query_one("#routing", Select).value
        return values

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in any input submits the form."""
        event.stop()
        self.action_submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """Apply submits, Cancel closes."""
        if event.button.id == "tuning-apply":
            self.action_submit()
        else:
            self.action_cancel()

    def action_submit(self) -> None:
        """Check the values; send the changed ones, or say what is wrong."""
        try:
            changes = tuning_changes(self.current, self.entered())
        except ValidationError as error:
            self.show_error(validation_message(error))
            return
        if not changes:
            self.dismiss(None)
            return
        self.show_error("")
        self._send(changes)

    def action_cancel(self) -> None:
        """Close without changing anything."""
        self.dismiss(None)

    def show_error(self, message: str) -> None:
        """Show `message` under the inputs (empty clears it)."""
        self.query_one("#tuning-error", Static).update(message)

    @work(exclusive=True, group="tune")
    async def _send(self, changes: dict[str, Any]) -> None:
        apply_button = self.query_one("#tuning-apply", Button)
        apply_button.disabled = True  # one PATCH at a time
        try:
            tuning = await self._apply(**changes)
        except AdminError as error:
            self.show_error(error.message)
        except httpx.HTTPError as error:
            self.show_error(f"Cannot reach the appliance: {error or type(error).__name__}")
        else:
            self.dismiss(tuning)
        finally:
            apply_button.disabled = False
