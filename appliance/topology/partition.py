"""How a box's devices split into prefill and decode pools, which prefill device each decode
device pulls KV from, and how a pool's devices group for tensor parallelism.

Pure: it only looks at a `Topology` and the device lists the settings give (see
`config.parse_devices`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Literal

from appliance.topology.devices import Topology, format_indices

PREFILL_SETTING = "APPLIANCE_PREFILL_DEVICES"
DECODE_SETTING = "APPLIANCE_DECODE_DEVICES"
COLOCATED_SETTING = "APPLIANCE_COLOCATED_DEVICES"

# Exhaustive search over prefill sets is exact and cheap up to a 16-device box
# (C(16, 6) = 8008 sets); beyond that a greedy pick keeps start-up fast.
_MAX_CANDIDATES = 10_000


@dataclass(frozen=True)
class Partition:
    """Which devices prefill, which decode, and where each decode device pulls KV from.

    In colocated mode every used device is in both pools and `pairs` is empty: no KV
    changes device. In disaggregated mode `colocated` names devices whose workers do both
    beside the two pools (then either pool may be empty, see `mixed_pools`).
    """

    mode: Literal["disaggregated", "colocated"]
    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    # decode device -> prefill device; a dict can't be hashed, so hashing skips it
    pairs: dict[int, int] = field(default_factory=dict, hash=False)
    colocated: tuple[int, ...] = ()


def prefill_count(num_devices: int) -> int:
    """How many of `num_devices` prefill in automatic disaggregated mode: ceil(n/3).

    Prefill is compute-bound and bursty: one forward pass over a whole prompt, then the
    device is free. Decode holds every running sequence's KV cache for its whole
    generation and runs memory-bound steps, so it needs more devices (memory capacity and
    bandwidth); about one prefill device keeps two decode devices fed. ceil(n/3) gives
    1 of 2, 1 of 3, 2 of 4, 3 of 8, 6 of 16, and leaves both pools non-empty for n >= 2.
    """
    return math.ceil(num_devices / 3)


def partition(
    topology: Topology,
    mode: str,
    prefill: tuple[int, ...] | None = None,
    decode: tuple[int, ...] | None = None,
    colocated: tuple[int, ...] | None = None,
    boxes: bool = False,
) -> Partition:
    """Split the topology's devices into prefill and decode pools (and, given
    `colocated`, colocated workers beside them).

    `prefill`/`decode` are the device lists of APPLIANCE_PREFILL_DEVICES /
    APPLIANCE_DECODE_DEVICES as the settings read them (sorted, each device once; None
    when unset); one given alone takes its devices and leaves the rest to the other pool,
    none given splits automatically (see `prefill_count` and `_auto_prefill`). Every
    decode device is paired with the prefill device it pulls KV from (see `pair_decode`).
    With `boxes` (other boxes may join: cluster.listen), decode given as none (()) leaves
    every device (or those of `prefill`) to prefill: decode workers come from agents.
    """
    n = len(topology.devices)
    # The settings check a list's syntax; only here is it known how many devices there are.
    _check_known(prefill, PREFILL_SETTING, n)
    _check_known(decode, DECODE_SETTING, n)
    _check_known(colocated, COLOCATED_SETTING, n)
    if mode == "disaggregated" and colocated:
        pools = mixed_pools(n, prefill, decode, colocated)
        pairs = pair_decode(topology, *pools) if pools[0] else {}
        return Partition("disaggregated", *pools, pairs, colocated)
    if mode == "colocated":
        return _colocated(n, prefill, decode)
    if mode != "disaggregated":
        raise ValueError(f"APPLIANCE_MODE={mode!r}: expected disaggregated or colocated")
    if decode == () and boxes:
        return Partition("disaggregated", prefill or tuple(range(n)), ())
    if n < 2:
        raise ValueError(
            f"disaggregated mode needs at least 2 devices (one prefill, one decode) but this "
            f"box has {n}; set APPLIANCE_MODE=colocated"
        )
    if prefill is None and decode is None:
        prefill = _auto_prefill(topology)
    pools = _explicit_pools(n, prefill, decode)
    return Partition("disaggregated", *pools, pair_decode(topology, *pools))


def _check_known(indices: tuple[int, ...] | None, setting: str, n: int) -> None:
    unknown = [i for i in indices or () if i >= n]
    if unknown:
        raise ValueError(
            f"{setting}={_written(indices or ())!r} names device {unknown[0]}, but this "
            f"box has {n} device(s): {format_indices(range(n)) or 'none'}"
        )


def _written(indices: Sequence[int]) -> str:
    # The settings keep indices, not the text; listing each one shows exactly what was read.
    return ",".join(map(str, indices))


def _colocated(
    n: int, prefill: tuple[int, ...] | None, decode: tuple[int, ...] | None
) -> Partition:
    # Colocated workers do both jobs, so device lists only choose which devices to use.
    used = tuple(sorted(set(prefill or ()) | set(decode or ()))) or tuple(range(n))
    if not used:
        raise ValueError("no devices found to run on")
    return Partition("colocated", used, used, {})


def _explicit_pools(
    n: int,
    prefill: tuple[int, ...] | None,
    decode: tuple[int, ...] | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    prefill = prefill if prefill is not None else _rest(n, decode)
    decode = decode if decode is not None else _rest(n, prefill)
    _apart(prefill, PREFILL_SETTING, decode, DECODE_SETTING)
    _require_devices(prefill, PREFILL_SETTING, DECODE_SETTING, n)
    _require_devices(decode, DECODE_SETTING, PREFILL_SETTING, n)
    return prefill, decode


def mixed_pools(
    n: int,
    prefill: tuple[int, ...] | None,
    decode: tuple[int, ...] | None,
    colocated: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The prefill and decode pools beside colocated workers: a list given takes its
    devices, an unset one the rest; neither set gives the rest to decode when one device
    is left, else splits it as the automatic split does (lowest devices prefill).
    Something must decode, and prefill workers need a decode worker to hand off to."""
    rest = tuple(i for i in range(n) if i not in colocated)
    if prefill is None and decode is None:
        k = prefill_count(len(rest)) if len(rest) >= 2 else 0
        prefill, decode = rest[:k], rest[k:]
    prefill = prefill if prefill is not None else _rest_of(rest, decode)
    decode = decode if decode is not None else _rest_of(rest, prefill)
    _apart(prefill, PREFILL_SETTING, colocated, COLOCATED_SETTING)
    _apart(decode, DECODE_SETTING, colocated, COLOCATED_SETTING)
    _apart(prefill, PREFILL_SETTING, decode, DECODE_SETTING)
    if prefill and not decode:
        raise ValueError(
            f"{PREFILL_SETTING}={_written(prefill)!r} has no decode pool to hand off to: "
            f"give {DECODE_SETTING} a device or make those devices colocated"
        )
    return prefill, decode


def _rest_of(devices: tuple[int, ...], taken: tuple[int, ...] | None) -> tuple[int, ...]:
    return tuple(i for i in devices if i not in (taken or ()))


def _apart(a: tuple[int, ...], a_setting: str, b: tuple[int, ...], b_setting: str) -> None:
    shared = sorted(set(a) & set(b))
    if shared:
        raise ValueError(
            f"device {shared[0]} is in both {a_setting}={_written(a)!r} and "
            f"{b_setting}={_written(b)!r}; a device serves one pool"
        )


def _require_devices(pool: tuple[int, ...], setting: str, other: str, n: int) -> None:
    if not pool:
        raise ValueError(
            f"{setting} is empty: {other} takes all {n} devices; leave a device for "
            f"{setting} or set APPLIANCE_MODE=colocated"
        )


def _rest(n: int, taken: tuple[int, ...] | None) -> tuple[int, ...]:
    return tuple(i for i in range(n) if i not in (taken or ()))


def _auto_prefill(topology: Topology) -> tuple[int, ...]:
    """The prefill set with the best `_score`; exhaustive when small, else greedy.

    combinations() yields sets in lexicographic order and max() keeps the first best,
    so ties go to the lowest device indices.
    """
    n = len(topology.devices)
    k = prefill_count(n)
    if math.comb(n, k) > _MAX_CANDIDATES:
        return _greedy_prefill(topology, k)
    return max(combinations(range(n), k), key=lambda p: _score(topology, p))


def _greedy_prefill(topology: Topology, k: int) -> tuple[int, ...]:
    chosen: tuple[int, ...] = ()
    for _ in range(k):
        options = [tuple(sorted((*chosen, i))) for i in _rest(len(topology.devices), chosen)]
        chosen = max(options, key=lambda p: _score(topology, p))
    return chosen


def _score(topology: Topology, prefill: tuple[int, ...]) -> tuple[int, int, int]:
    """Higher is better: the worst decode device's link to its prefill device first (no
    decode device left on a slow link if avoidable), then the sum of those links, then an
    even load (fewest decode devices on the busiest prefill device)."""
    decode = _rest(len(topology.devices), prefill)
    pairs = pair_decode(topology, prefill, decode)
    ranks = [topology.bandwidth_rank(d, p) for d, p in pairs.items()]
    busiest = max(Counter(pairs.values()).values(), default=0)
    return min(ranks, default=0), sum(ranks), -busiest


def pair_decode(
    topology: Topology, prefill: Sequence[int], decode: Sequence[int]
) -> dict[int, int]:
    """For each decode device (in index order), the prefill device to pull KV from: the
    best-linked one; ties go to the prefill device with fewest decode devices so far, then
    to the lowest index."""
    load = dict.fromkeys(prefill, 0)
    pairs = {}
    for d in sorted(decode):
        pairs[d] = _best_prefill(topology, d, load)
        load[pairs[d]] += 1
    return pairs


def _best_prefill(topology: Topology, d: int, load: dict[int, int]) -> int:
    return max(load, key=lambda p: (topology.bandwidth_rank(d, p), -load[p], -p))


def tp_groups(
    topology: Topology, devices: Sequence[int], degree: int, setting: str
) -> list[tuple[int, ...]]:
    """Split a pool's devices into tensor-parallel groups of `degree` devices.

    Shards all-reduce twice per layer, so a group wants its slowest internal link fast:
    groups are picked one by one, each the remaining set whose slowest link ranks highest
    (then the most links in total, then the lowest device numbers)."""
    if len(devices) % degree:
        raise ValueError(
            f"{setting}={degree} does not divide the pool's {len(devices)} device(s) "
            f"({format_indices(devices)}): give the pool a multiple of {degree} devices"
        )
    left = sorted(devices)
    groups: list[tuple[int, ...]] = []
    while left:
        if math.comb(len(left), degree) > _MAX_CANDIDATES:  # too many to try: in order
            groups.append(tuple(left[:degree]))
            left = left[degree:]
            continue
        best = max(combinations(left, degree), key=lambda g: _group_score(topology, g))
        groups.append(best)
        left = [d for d in left if d not in best]
    return groups


def _group_score(topology: Topology, group: tuple[int, ...]) -> tuple[int, int, list[int]]:
    ranks = [topology.bandwidth_rank(a, b) for a, b in combinations(group, 2)]
    return (min(ranks, default=0), sum(ranks), [-d for d in group])
