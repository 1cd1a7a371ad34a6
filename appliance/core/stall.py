"""What to do about a worker that has work and has reported no step for too long: plain
decisions on plain data (the process manager's `_watch` carries them out, every 200 ms).

A stalled worker is acted on once. On this box, it is killed (its exit then re-runs its
requests). On another box, the kill is a message to that box's agent, which a frozen box
never reads: there the box is marked lost instead (its workers' requests run again
elsewhere, as when its link ends), once, rather than a kill asked for at every look.
"""

from __future__ import annotations

from enum import Enum


class StallAction(Enum):
    """What `_watch` does about one worker at one look."""

    NONE = "none"  # not stalled, or already acted on
    KILL = "kill"  # on this box: SIGKILL its process
    LOSE_BOX = "lose_box"  # on another box: mark its box lost (the kill cannot be delivered)


def stall_action(stalled_s: float, timeout_s: float, remote: bool, acted: bool) -> StallAction:
    """The action for a worker silent for `stalled_s` with work to do (0 when idle), with
    `timeout_s` the stall limit; `remote`: it runs on another box; `acted`: this stall was
    already acted on (the action is not repeated)."""
    if acted or stalled_s <= timeout_s:
        return StallAction.NONE
    return StallAction.LOSE_BOX if remote else StallAction.KILL
