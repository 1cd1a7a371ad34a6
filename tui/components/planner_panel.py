"""PlannerPanel: the rebalancer's view: autopilot, the layout now and the one it
recommends with the goodput the simulator predicts for each, and its latest decisions."""

from __future__ import annotations

from collections.abc import Sequence

from textual.content import Content
from textual.widget import Widget

from appliance.admin.schema import Decision, PlannerView, Role, Snapshot
from tui.format import clock

DECISIONS_SHOWN = 6
"""The most decisions the panel lists (fewer where its height has no room for them)."""

NO_PLANNER = "This appliance has no planner."
AUTOPILOT_APPLIES = "Autopilot is on: the planner applies its moves itself."
_LETTERS = {"prefill": "P", "decode": "D", "colocated": "C"}


def layout_label(roles: Sequence[Role | None]) -> str:
    """How many devices each role has: '1P+2D', '1C+1D'; a device with none is 'idle'."""
    parts = [
        f"{count}{letter}"
        for role, letter in _LETTERS.items()
        if (count := sum(1 for r in roles if r == role))
    ]
    idle = sum(1 for r in roles if r is None)
    if idle:
        parts.append(f"{idle} idle")
    return "+".join(parts) or "no devices"


def devices_label(roles: Sequence[Role | None]) -> str:
    """Each device's role by index: '0:prefill 1:decode'."""
    return " ".join(f"{index}:{role or '—'}" for index, role in enumerate(roles))


def goodput(value: float | None) -> str:
    """Predicted requests/s within the SLO, or '—' when unknown."""
    return "—" if value is None else f"{value:.2f} req/s"


def recommended_move(planner: PlannerView) -> tuple[int, Role] | None:
    """The device the planner would move first toward its recommended layout and its new
    role; None when it recommends nothing, or the layout there is."""
    return planner.next_move


def plan_to_apply(planner: PlannerView) -> tuple[int, Role] | str:
    """The move the apply key would start, as (device, role); else why there is none."""
    if planner.auto_rebalance:
        return AUTOPILOT_APPLIES
    move = recommended_move(planner)
    if move is None:
        return f"Nothing to apply: {planner.status}"
    return move


def decision_line(decision: Decision) -> Content:
    """One decision: time, move or hold, predicted goodput before → after, the measured
    share within the SLO, 'applied' when a move started from it, and the reason after the
    rule that decided it in brackets ('[margin] …'; none from an appliance that sends
    none)."""
    if decision.move_device is None or decision.move_to is None:
        what = Content.styled("hold", "$text-muted")
    else:
        what = Content(f"move device {decision.move_device} → {decision.move_to}")
    attainment = "—" if decision.attainment is None else f"{decision.attainment:.0%}"
    ruled = f"[{decision.rule}] " if decision.rule else ""
    return Content.assemble(
        (clock(decision.at), "$text-muted"),
        "  ",
        what,
        f"  {decision.predicted_current:.2f} → {decision.predicted_recommended:.2f}",
        f"  SLO {attainment}",
        ("  applied", "bold $text-success") if decision.acted else "",
        (f"  {ruled}{decision.reason}", "$text-muted"),
    )


def planner_lines(planner: PlannerView | None, decisions: int = DECISIONS_SHOWN) -> list[Content]:
    """The panel's lines: status, now, recommended, then the latest `decisions` decisions."""
    if planner is None:
        return [Content.styled(NO_PLANNER, "$text-muted")]
    move = recommended_move(planner)
    if planner.recommended is None:
        plan = Content.styled("none", "$text-muted")
    elif move is None:
        plan = Content.styled("the current layout: hold", "$text-muted")
    else:
        plan = Content(f"{layout_label(planner.recommended)}  move device {move[0]} → {move[1]}")
    lines = [
        Content(planner.status),
        Content.assemble(
            ("now          ", "$text-muted"),
            (f"{goodput(planner.predicted_current):<11}", "bold"),
            f"  {layout_label(planner.current)}  {devices_label(planner.current)}",
        ),
        Content.assemble(
            ("recommended  ", "$text-muted"),
            (f"{goodput(planner.predicted_recommended):<11}", "bold"),
            "  ",
            plan,
        ),
    ]
    if not planner.decisions:
        lines.append(Content.styled("No decisions yet.", "$text-muted"))
    lines.extend(decision_line(decision) for decision in planner.decisions[-decisions:])
    return lines


class PlannerPanel(Widget):
    """The planner's state from the last snapshot; id `planner`. Its border title says
    whether autopilot is on; lines too long for the panel end in an ellipsis."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.planner: PlannerView | None = None
        self._shown = False
        self.border_title = "Planner"

    def show(self, snapshot: Snapshot) -> None:
        """Show `snapshot.planner` (a repaint only when it changed)."""
        planner = snapshot.planner
        if self._shown and planner == self.planner:
            return
        self.planner, self._shown = planner, True
        if planner is None:
            self.border_title = "Planner"
        else:
            state = "[b $success]on[/]" if planner.auto_rebalance else "off"
            self.border_title = f"Planner · autopilot {state}"
        self.refresh()

    def render(self) -> Content:
        """The lines, or a placeholder until the first snapshot."""
        if not self._shown:
            return Content.styled("Waiting for the appliance's first snapshot…", "$text-muted")
        room = self.content_size.height - 3  # under status, now and recommended
        shown = min(max(room, 1), DECISIONS_SHOWN)
        return Content("\n").join(planner_lines(self.planner, shown))
