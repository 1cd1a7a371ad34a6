"""Paths of one or two moves from a set of device roles, for the rebalancer
(rebalance.py): the valid moves, the best layout one move away, and the best layout two
moves away with the path to it.

A move changes one device's worker to another role; every layout on a path, the one in
the middle included, must be able to serve (`roles_problem`), since the appliance serves
on it between the two moves. Goodput comes from the caller's `score`, which should
remember what it computed (a layout is reached by several paths). Between layouts of
equal goodput, the path with more moves in `kept` (moves that keep the device's worker:
no drain, no reload) wins. A layout `barred` says no to (held off, measured worse:
rebalance.py) is never a path's target, though a two-move path may pass through one. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from appliance.core.roles import ROLES
from appliance.planner.layout import roles_problem

Roles = tuple[str | None, ...]
Move = tuple[int, str]
Score = Callable[[Roles], float]  # predicted goodput (req/s) of a set of roles
Barred = Callable[[Roles], bool]  # whether a set of roles may not be a target


def _free(roles: Roles) -> bool:
    return False


@dataclass(frozen=True)
class Path:
    """The moves from the current roles to `target`, in order, and its predictions."""

    moves: tuple[Move, ...]  # one or two
    target: Roles
    goodput: float  # the target's predicted goodput
    via: float | None = None  # the layout in the middle's (two moves), else None


def moves_from(roles: Sequence[str | None]) -> list[Move]:
    """Every (device, to_role) that changes one device's worker to another role and
    leaves roles that can serve; by device, then role."""
    candidates = [
        (device, to)
        for device, role in enumerate(roles)
        if role is not None
        for to in ROLES
        if to != role
    ]
    return [move for move in candidates if roles_problem(moved(roles, move)) is None]


def moved(roles: Sequence[str | None], move: Move) -> Roles:
    """The roles after `move`."""
    device, to = move
    return tuple(to if index == device else role for index, role in enumerate(roles))


def move_between(start: Roles, end: Roles) -> Move | None:
    """The one valid move that turns `start` into `end`; None if there is none (they
    differ in no device or in more than one, or the move is not valid)."""
    if len(start) != len(end):
        return None
    changed = [device for device, (a, b) in enumerate(zip(start, end, strict=True)) if a != b]
    if len(changed) != 1:
        return None
    move = (changed[0], end[changed[0]])
    return move if move in moves_from(start) else None


def path_between(start: Roles, end: Roles, kept: frozenset[Move] = frozenset()) -> Path | None:
    """The moves (one, or two through a layout that can serve, preferring moves in `kept`)
    that turn `start` into `end`; None when there are none such (more than two devices
    differ, or no order of the two moves keeps every layout able to serve). Its goodput
    is not known here: 0."""
    one = move_between(start, end)
    if one is not None:
        return Path((one,), end, 0.0)
    if len(start) != len(end):
        return None
    changed = [device for device, (a, b) in enumerate(zip(start, end, strict=True)) if a != b]
    if len(changed) != 2:
        return None
    routes: list[tuple[Move, Move]] = []
    for a, b in (changed, changed[::-1]):
        to_a, to_b = end[a], end[b]
        if to_a is None or to_b is None:
            return None  # no move leaves a device without a worker
        first, second = (a, to_a), (b, to_b)
        if first in moves_from(start) and second in moves_from(moved(start, first)):
            routes.append((first, second))
    if not routes:
        return None
    moves = max(routes, key=lambda route: _kept(route, kept))  # ties: the first found
    return Path(moves, end, 0.0)


def nearest(
    current: Roles, wanted: Barred, kept: frozenset[Move] = frozenset(), two: bool = True
) -> Path | None:
    """The path of fewest moves (one, else two when `two`) to a layout `wanted` says yes
    to; between several, the one with more moves in `kept`, then the first found. None:
    none within reach. Its goodput is not known here: 0."""
    paths = [Path((m,), moved(current, m), 0.0) for m in moves_from(current)]
    ones = [path for path in paths if wanted(path.target)]
    if ones or not two:
        return max(ones, key=lambda path: _kept(path.moves, kept), default=None)
    twos = []
    for first in moves_from(current):
        middle = moved(current, first)
        for second in moves_from(middle):
            target = moved(middle, second)
            if second[0] != first[0] and wanted(target):
                twos.append(Path((first, second), target, 0.0))
    return max(twos, key=lambda path: _kept(path.moves, kept), default=None)


def best_one(
    current: Roles,
    score: Score,
    floor: float,
    kept: frozenset[Move] = frozenset(),
    barred: Barred = _free,
) -> Path | None:
    """The layout one move away, not `barred`, with the highest goodput above `floor`
    (ties: a move in `kept`, then the first in `moves_from` order); None when none beats
    it. Barred layouts are scored all the same (a decision shows what each would do)."""
    best: Path | None = None
    for move in moves_from(current):
        target = moved(current, move)
        path = Path((move,), target, score(target))
        if not barred(target) and _better(path, best, floor, kept):
            best = path
    return best


def best_two(
    current: Roles,
    score: Score,
    floor: float,
    kept: frozenset[Move] = frozenset(),
    barred: Barred = _free,
) -> Path | None:
    """The layout exactly two moves away (two different devices), not `barred`, with
    the highest goodput above `floor`, reached through the layout in the middle with the highest
    goodput (ties: more moves in `kept`, then the lowest first device); None when none
    beats `floor`.

    Cost: every first move (at most 2n on n devices) and every second move from it, so
    O((2n)^2) paths, each distinct layout scored once."""
    best: Path | None = None
    for first, second, via in _routes(current, score, kept).values():
        target = moved(moved(current, first), second)
        path = Path((first, second), target, score(target), via)
        if not barred(target) and _better(path, best, floor, kept):
            best = path
    return best


def _better(path: Path, best: Path | None, floor: float, kept: frozenset[Move]) -> bool:
    """Whether `path` beats the best so far (or, for the first, `floor`)."""
    if best is None:
        return path.goodput > floor
    if path.goodput != best.goodput:
        return path.goodput > best.goodput
    return _kept(path.moves, kept) > _kept(best.moves, kept)


def _kept(moves: tuple[Move, ...], kept: frozenset[Move]) -> int:
    return sum(move in kept for move in moves)


def _routes(
    current: Roles, score: Score, kept: frozenset[Move]
) -> dict[Roles, tuple[Move, Move, float]]:
    """Each layout two moves away: its best path (first, second move) and the goodput of
    the layout in the middle (ties: more moves in `kept`); in order of first, then
    second move."""
    routes: dict[Roles, tuple[Move, Move, float]] = {}
    for first in moves_from(current):
        middle = moved(current, first)
        via = score(middle)
        for second in moves_from(middle):
            if second[0] == first[0]:
                continue  # the same device twice is one move (or none)
            target = moved(middle, second)
            known = routes.get(target)
            rank = (via, _kept((first, second), kept))
            if known is None or rank > (known[2], _kept(known[:2], kept)):
                routes[target] = (first, second, via)
    return routes
