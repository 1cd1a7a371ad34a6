"""Two boxes of the same kind: serve them as two independent boxes (each the best
one-box layout, half the traffic each) or as one cross-box split (every device of one box
prefills, every device of the other decodes, and each request's KV crosses the network
link between them)? Pure: a profile with a network link (`Profile.network`), a
workload's requests, an SLO and the simulator.

Both ways serve the same requests, so they are compared on the share of them kept within
the SLO; goodput here is that share times the offered rate (requests within the SLO per
second offered; the two boxes' summed, each at half the rate). The bench's goodput
divides by the run's length instead, which the last long answer sets (see plan._rank):
too noisy to call a winner between two ways that both keep up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.bench import report
from appliance.core.goodput import SLO, Distribution, RequestResult
from appliance.planner.layout import Layout, Pool
from appliance.planner.plan import Simulate, at_rate, feasible_layouts, parse_unit
from appliance.planner.profile import Profile
from appliance.planner.simulator import Policy, SimRequest, simulate

TWO_BOXES, CROSS_BOX, TIE = "two boxes", "cross-box split", "tie"


@dataclass(frozen=True)
class Side:
    """One way to run the two boxes at one rate: its layout (for two independent boxes,
    each box's) and how the requests fared."""

    layout: Layout
    rate: float  # offered to both boxes together, req/s
    requests: int
    met: int  # requests within the SLO
    ttft_p90: float  # seconds, over completed requests (NaN: none completed)
    tpot_p90: float

    @property
    def attainment(self) -> float:
        return self.met / self.requests

    @property
    def goodput(self) -> float:
        """Requests within the SLO per second offered."""
        return self.rate * self.attainment


@dataclass(frozen=True)
class TwoBoxes:
    """Both ways at one rate, and which wins."""

    two_boxes: Side
    cross_box: Side

    @property
    def winner(self) -> str:
        """TWO_BOXES, CROSS_BOX, or TIE where both keep the same requests within the SLO."""
        if self.cross_box.met == self.two_boxes.met:
            return TIE
        return CROSS_BOX if self.cross_box.met > self.two_boxes.met else TWO_BOXES

    @property
    def margin(self) -> float:
        """The winner's goodput over the loser's (1.0 for a tie; inf where the loser keeps
        no request within the SLO)."""
        sides = sorted((self.two_boxes.goodput, self.cross_box.goodput))
        return sides[1] / sides[0] if sides[0] > 0 else math.inf


def cross_box_layouts(profile: Profile) -> list[Layout]:
    """Every cross-box split of two of the profile's boxes: all of one box's devices in
    the prefill pool, all of the other's in the decode pool, each pool of one TP degree
    the profile has (workers of a TP degree that does not divide the box leave the rest
    idle)."""
    units = sorted({parse_unit(unit) for unit in profile.workers})
    layouts = []
    for size, p_tp in units:
        devices = profile.atoms // size
        for d_size, d_tp in units:
            if d_size != size or devices < max(p_tp, d_tp):
                continue
            layouts.append(
                Layout(
                    mode="disaggregated",
                    device_size=size,
                    prefill=Pool(workers=devices // p_tp, tp=p_tp),
                    decode=Pool(workers=devices // d_tp, tp=d_tp),
                    cross_box=True,
                )
            )
    return layouts


def alternate(requests: Sequence[SimRequest]) -> tuple[list[SimRequest], list[SimRequest]]:
    """Each box's half of the requests: arrivals taken in turn (as a round-robin load
    balancer in front of two boxes sends them)."""
    return list(requests[0::2]), list(requests[1::2])


def compare_two_boxes(
    profile: Profile,
    requests: Sequence[SimRequest],
    rate: float,
    slo: SLO,
    policy: Policy | None = None,
    simulate_fn: Simulate = simulate,
) -> TwoBoxes:
    """Two boxes of `profile`'s kind serving `requests` (arriving at `rate` req/s): (a) as
    two independent boxes, the one-box layout (of those using the whole box, as `appliance
    plan` ranks) that keeps most requests within the SLO when each box takes every other
    arrival; (b) as the cross-box split (`cross_box_layouts`) that keeps most of all the
    requests within it. Ties go to the higher goodput, then the layout found first.
    ValueError for a profile without a network link, fewer than two requests or a rate
    that is not positive."""
    if profile.network is None:
        raise ValueError(
            "comparing two boxes needs the network link between them (Profile.network; "
            "an analytic plan takes --link-gbps, e.g. 400)"
        )
    if len(requests) < 2:
        raise ValueError(f"two boxes need at least two requests (one each), got {len(requests)}")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"the comparison needs a finite positive request rate, got {rate}")
    policy = policy or Policy()
    halves = alternate(requests)
    singles = feasible_layouts(profile, full_only=True)
    if not singles:
        raise ValueError(f"no layout of {profile.atoms} atoms fits the profile's workers")
    two = []
    for layout in singles:  # the same layout on both boxes, each with its half
        results = [r for half in halves for r in simulate_fn(profile, layout, half, policy)]
        two.append(_side(layout, rate, slo, results))
    cross = [
        _side(layout, rate, slo, simulate_fn(profile, layout, requests, policy))
        for layout in cross_box_layouts(profile)
    ]
    return TwoBoxes(_best(two), _best(cross))


def compare_at_rates(
    profile: Profile,
    requests: Sequence[SimRequest],
    base_rate: float,
    rates: Sequence[float],
    slo: SLO,
    policy: Policy | None = None,
) -> list[TwoBoxes]:
    """`compare_two_boxes` at each rate, on the same requests drawn at `base_rate` (their
    arrivals scaled, see plan.at_rate)."""
    return [
        compare_two_boxes(profile, at_rate(requests, base_rate, rate), rate, slo, policy)
        for rate in rates
    ]


def _side(layout: Layout, rate: float, slo: SLO, results: list[RequestResult]) -> Side:
    done = [r for r in results if r.ok]
    tpots = [t for r in done if (t := r.tpot) is not None]
    return Side(
        layout,
        rate,
        len(results),
        sum(slo.met_by(r) for r in results),
        Distribution.of([r.ttft for r in done]).p90,
        Distribution.of(tpots).p90,
    )


def _best(sides: list[Side]) -> Side:
    return max(sides, key=lambda side: (side.met, side.goodput))


COLUMNS = (
    "workload",
    "rate req/s",
    "two boxes: layout (each)",
    "goodput",
    "SLO met",
    "cross-box split",
    "goodput",
    "SLO met",
    "TTFT p90 ms (two / split)",
    "TPOT p90 ms (two / split)",
    "winner",
)


def heading(profile: Profile, num_requests: int, slo: SLO) -> str:
    """What the table compares, in one paragraph."""
    network = profile.network
    link = "no link" if network is None else _link(network.per_byte_s, network.base_s)
    limits = [
        f"{name} {value * 1000:g} ms"
        for name, value in (("TTFT", slo.ttft), ("TPOT", slo.tpot), ("e2e", slo.latency))
        if value is not None
    ]
    kind = "analytic (from datasheets, not measured)" if profile.analytic else "measured"
    return (
        f"Two boxes of {profile.atoms} devices each ({profile.key.device_kind}), model "
        f"{profile.key.model}, {kind} profile; {link}; {num_requests} requests per "
        f"workload, the same draws at every rate; SLO {', '.join(limits)}. Two boxes: "
        "the one-box layout keeping most requests within the SLO, each box taking every "
        "other arrival. Cross-box split: [prefill box]+[decode box], every handoff over "
        "the link (one link, handoffs queue on it). Goodput: the rate times the share of "
        "requests within the SLO; winner: the one keeping more of them, by its goodput "
        "over the other's."
    )


def _link(per_byte_s: float, base_s: float) -> str:
    if per_byte_s <= 0:
        return f"a network link of unbounded bandwidth and {base_s * 1000:g} ms per handoff"
    return (
        f"a network link of {1 / per_byte_s / 1e9:.1f} GB/s effective and "
        f"{base_s * 1000:g} ms per handoff"
    )


def table(rows: Sequence[tuple[str, TwoBoxes]]) -> str:
    """A markdown table, one row per (workload, comparison)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for workload, both in rows:
        two, cross = both.two_boxes, both.cross_box
        winner = both.winner if both.winner == TIE else f"{both.winner} ({_times(both.margin)})"
        cells = [
            workload,
            f"{two.rate:g}",
            two.layout.label,
            f"{two.goodput:.1f}",
            f"{two.attainment:.1%}",
            cross.layout.label,
            f"{cross.goodput:.1f}",
            f"{cross.attainment:.1%}",
            f"{report.ms(two.ttft_p90)} / {report.ms(cross.ttft_p90)}",
            f"{report.ms(two.tpot_p90)} / {report.ms(cross.tpot_p90)}",
            winner,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _times(margin: float) -> str:
    if math.isinf(margin):
        return "the other keeps none"
    return f"{margin:.3f}x" if margin < 1.1 else f"{margin:.2f}x"  # a near tie shows as one
