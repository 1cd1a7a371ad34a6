"""What to do about a worker that has work and has reported no step for too long: plain
decisions on plain data (the process manager's `_watch` carries them out, every 200 ms).

Each step is taken once per stall. On this box the worker is killed (its exit then re-runs
its requests). On another box the kill is a message its agent carries out, so it is asked
for once; a box whose agent has frozen is found by the heartbeat, but an agent that keeps
answering while its worker still does not die (or report) `grace_s` after the kill was
asked for cannot be trusted with it: then the box is marked lost (its workers' requests
run again elsewhere, as when its link ends), once. Losing the box at once would take every
worker there down, and its agent with them, for one hung process.
"""

from __future__ import annotations

from enum import Enum


class StallAction(Enum):
    """What `_watch` does about one worker at one look."""

    NONE = "none"  # not stalled, or nothing more to do yet
    KILL = "kill"  # here: SIGKILL its process; on another box: ask its agent to, once
    LOSE_BOX = "lose_box"  # on another box, its kill asked for and not done: lose the box


def stall_action(
    stalled_s: float, timeout_s: float, remote: bool, done: StallAction, grace_s: float
) -> StallAction:
    """The action for a worker silent for `stalled_s` with work to do (0 when idle), with
    `timeout_s` the stall limit; `remote`: it runs on another box; `done`: the last action
    already taken about this stall (NONE: none yet); `grace_s`: how long past the limit a
    remote worker's asked-for kill may take before its box is lost."""
    if stalled_s <= timeout_s:
        return StallAction.NONE
    if done is StallAction.NONE:
        return StallAction.KILL
    if remote and done is StallAction.KILL and stalled_s > timeout_s + grace_s:
        return StallAction.LOSE_BOX
    return StallAction.NONE
