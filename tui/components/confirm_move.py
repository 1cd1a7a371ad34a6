"""ConfirmMove: asks before moving a device to the other pool."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


def move_question(name: str, from_role: str, to_role: str, requests: int) -> str:
    """The confirmation's question."""
    return (
        f"Move {name} from {from_role} to {to_role}? Its worker drains first "
        f"({requests} request{'s' * (requests != 1)}), then a {to_role} worker starts on it."
    )


class ConfirmMove(ModalScreen[bool]):
    """Yes/no on moving a device; dismisses with True to go ahead.

    y or enter confirms (#confirm-yes), n or escape cancels (#confirm-no).
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Move"),
        Binding("enter", "answer(True)", "Move", show=False),
        Binding("n", "answer(False)", "Cancel"),
        Binding("escape", "answer(False)", "Cancel", show=False),
    ]

    def __init__(self, name: str, from_role: str, to_role: str, requests: int) -> None:
        super().__init__()
        self.question = move_question(name, from_role, to_role, requests)

    def compose(self) -> ComposeResult:
        """The question and the two buttons."""
        with Vertical(id="confirm-dialog", classes="dialog"):
            yield Static(self.question, id="confirm-question", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Move (y)", variant="primary", id="confirm-yes")
                yield Button("Cancel (n)", id="confirm-no")

    def on_mount(self) -> None:
        """Start on the Move button, so enter confirms."""
        self.query_one("#confirm-yes", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """A button answers."""
        self.dismiss(event.button.id == "confirm-yes")

    def action_answer(self, go: bool) -> None:
        """Close with the answer."""
        self.dismiss(go)
