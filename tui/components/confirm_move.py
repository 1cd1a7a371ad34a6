"""ConfirmMove: asks before a pool move, with a button per answer (which pool, or yes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from appliance.admin.schema import DeviceInfo, PlannerView, Role, Snapshot
from tui.components.planner_panel import goodput

ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated")

# (value it dismisses with, button label, key that picks it)
Choice = tuple[str, str, str]
APPLY: Choice = ("apply", "Apply (y)", "y")


def move_targets(role: Role) -> tuple[Role, ...]:
    """The pools a device of `role` can move to: the two others."""
    return tuple(target for target in ROLES if target != role)


def role_choices(targets: Sequence[Role]) -> list[Choice]:
    """A button per target pool, picked by its initial: 'Prefill (p)'."""
    return [(role, f"{role.capitalize()} ({role[0]})", role[0]) for role in targets]


def device_name(snapshot: Snapshot | None, index: int) -> str:
    """The device's name, as the snapshot gives it."""
    devices = snapshot.devices if snapshot is not None else []
    return next((d.name for d in devices if d.index == index), f"device {index}")


def drain_note(device: DeviceInfo | None) -> str:
    """What a move does to the device's worker first."""
    worker = device.worker if device is not None else None
    requests = worker.waiting + worker.running if worker is not None else 0
    return f"Its worker drains first ({requests} request{'s' * (requests != 1)})"


def move_question(device: DeviceInfo, targets: Sequence[str]) -> str:
    """The question the move key asks."""
    return (
        f"Move {device.name} from {device.pool} to {' or '.join(targets)}? "
        f"{drain_note(device)}, then a worker of the pool you pick starts on it."
    )


def apply_question(snapshot: Snapshot, planner: PlannerView, index: int, to: Role) -> str:
    """The question the apply key asks about the planner's move of device `index`."""
    device = next((d for d in snapshot.devices if d.index == index), None)
    return (
        f"Apply the planner's recommendation: move {device_name(snapshot, index)} from "
        f"{device.pool if device is not None else 'no pool'} to {to}? Predicted goodput "
        f"{goodput(planner.predicted_current)} → {goodput(planner.predicted_recommended)}. "
        f"{drain_note(device)}."
    )


class ConfirmMove(ModalScreen[str | None]):
    """A question and a button per choice (ids `choice-<value>`, the first focused);
    dismisses with the chosen value, or None on Cancel (`choice-cancel`).

    A choice's key (its button says which) picks it; n or escape cancels.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("n", "cancel", "Cancel"),
        Binding("escape", "cancel", "Cancel", show=False),
    ]

    def __init__(self, question: str, choices: Sequence[Choice]) -> None:
        super().__init__()
        self.question = question
        self.choices = list(choices)

    def compose(self) -> ComposeResult:
        """The question and the buttons."""
        with Vertical(id="confirm-dialog", classes="dialog"):
            yield Static(self.question, id="confirm-question", markup=False)
            with Horizontal(classes="buttons"):
                for index, (value, label, _) in enumerate(self.choices):
                    yield Button(
                        label,
                        variant="primary" if index == 0 else "default",
                        id=f"choice-{value}",
                        name=value,
                    )
                yield Button("Cancel (n)", id="choice-cancel")

    def on_mount(self) -> None:
        """Start on the first choice, so enter picks it."""
        self.query(Button).first().focus()

    def on_key(self, event: events.Key) -> None:
        """A choice's key picks it."""
        for value, _, key in self.choices:
            if event.key == key:
                event.stop()
                self.dismiss(value)
                return

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """A button answers."""
        self.dismiss(event.button.name)

    def action_cancel(self) -> None:
        """Close without moving anything."""
        self.dismiss(None)
