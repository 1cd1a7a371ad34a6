"""What the watchdog does about a stalled worker (core/stall.py), on plain data: each step
once per stall; here a kill; on another box a kill asked of its agent, then, only if the
worker still has not died nor reported a grace later, its box marked lost."""

from __future__ import annotations

import pytest

from appliance.core.stall import StallAction, stall_action

TIMEOUT_S, GRACE_S, LOOK_S = 15.0, 5.0, 0.2
NONE, KILL, LOSE_BOX = StallAction.NONE, StallAction.KILL, StallAction.LOSE_BOX


@pytest.mark.parametrize("stalled_s", [0.0, 3.0, TIMEOUT_S])
@pytest.mark.parametrize("remote", [False, True])
def test_a_worker_within_the_limit_is_left_alone(stalled_s: float, remote: bool) -> None:
    assert stall_action(stalled_s, TIMEOUT_S, remote, NONE, GRACE_S) is NONE


@pytest.mark.parametrize("remote", [False, True])
def test_a_stalled_worker_is_killed_first_wherever_it_runs(remote: bool) -> None:
    assert stall_action(TIMEOUT_S + LOOK_S, TIMEOUT_S, remote, NONE, GRACE_S) is KILL


def looks(remote: bool, seconds: float) -> list[StallAction]:
    """The watchdog's looks at a worker silent throughout, with the process manager's
    bookkeeping (the last action taken is what was done)."""
    actions, done = [], NONE
    for look in range(int(seconds / LOOK_S)):
        action = stall_action(look * LOOK_S, TIMEOUT_S, remote, done, GRACE_S)
        done = action if action is not NONE else done
        actions.append(action)
    return actions


def test_a_stall_here_is_one_kill_over_the_watchdogs_looks() -> None:
    """The hidden probe's worker stayed silent 40 s: the old code asked for a kill at every
    look past the limit (30 in 6 s)."""
    actions = looks(remote=False, seconds=40)
    assert actions.count(KILL) == 1 and set(actions) == {NONE, KILL}
    assert actions.index(KILL) == int(TIMEOUT_S / LOOK_S) + 1


def test_a_remote_worker_that_does_not_die_loses_its_box_once_after_the_grace() -> None:
    actions = looks(remote=True, seconds=40)
    assert actions.count(KILL) == 1 and actions.count(LOSE_BOX) == 1
    kill_at, lost_at = actions.index(KILL) * LOOK_S, actions.index(LOSE_BOX) * LOOK_S
    assert kill_at == pytest.approx(TIMEOUT_S + LOOK_S)
    assert lost_at == pytest.approx(TIMEOUT_S + GRACE_S + LOOK_S)


def test_a_worker_here_never_loses_a_box() -> None:
    assert stall_action(TIMEOUT_S + GRACE_S + 10, TIMEOUT_S, False, KILL, GRACE_S) is NONE
