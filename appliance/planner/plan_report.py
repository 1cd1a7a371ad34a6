"""A plan's output: a markdown table, a JSON payload and a plot of goodput against rate
(bench.report's `plot_sweep`, the plot a measured sweep gets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance.bench import report
from appliance.planner.plan import LayoutPlan, Plan

COLUMNS = (
    "rank",
    "layout",
    "atoms",
    "goodput req/s",
    "SLO met",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TPOT p50 ms",
    "TPOT p90 ms",
    "max rate req/s",
    "gain",
)


def table(plan: Plan) -> str:
    """One row per layout, best first. `max rate`: the highest rate at which it keeps
    the attainment target ('>=' where the search's top rate still met it); `gain`: that
    rate over the best colocated layout's."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for rank, lp in enumerate(plan.ranked, 1):
        s = lp.at_rate.summary
        cells = [
            str(rank),
            lp.label,
            f"{lp.layout.atoms}/{plan.atoms}",
            f"{s.goodput:.3f}",
            f"{lp.at_rate.attainment:.0%}",
            report.ms(s.ttft.median),
            report.ms(s.ttft.p90),
            report.ms(s.tpot.median),
            report.ms(s.tpot.p90),
            _max_rate(lp),
            "-" if lp.gain is None else f"{lp.gain:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def heading(plan: Plan) -> str:
    """What the table was computed for, in one paragraph."""
    spec, slo = plan.spec, plan.spec.slo
    limits = [
        f"{name} {value * 1000:g} ms"
        for name, value in (("TTFT", slo.ttft), ("TPOT", slo.tpot), ("e2e", slo.latency))
        if value is not None
    ]
    kind = "analytic (from datasheets, not measured)" if plan.analytic else "measured"
    skipped = (
        f"; {plan.skipped} layouts leaving atoms idle were not simulated" if plan.skipped else ""
    )
    return (
        f"Plan for {plan.key.model} on {plan.key.device_kind} ({kind} profile): "
        f"{plan.workload} workload, {plan.num_requests} requests at {spec.rate:g} req/s, "
        f"SLO {', '.join(limits)}. Max rate: the highest rate with >= "
        f"{spec.attainment:.0%} of requests within the SLO; gain: max rate over the best "
        f"colocated layout's. Ranked: layouts meeting that share at {spec.rate:g} req/s by "
        f"max rate, then the rest by the share they meet{skipped}."
    )


def _max_rate(lp: LayoutPlan) -> str:
    if lp.max_rate <= 0:
        return "none"
    return (">=" if lp.capped else "") + f"{lp.max_rate:.2f}"


def payload(plan: Plan) -> dict[str, Any]:
    """The plan as plain JSON data (NaN, where nothing completed, as null)."""
    return report.plain(
        {
            "profile": {
                **plan.key.model_dump(),
                "analytic": plan.analytic,
                "atoms": plan.atoms,
            },
            "workload": plan.workload,
            "num_requests": plan.num_requests,
            "rate": plan.spec.rate,
            "slo": plan.spec.slo,
            "attainment_target": plan.spec.attainment,
            "skipped_partial_layouts": plan.skipped,
            "layouts": [_layout_payload(rank, lp) for rank, lp in enumerate(plan.ranked, 1)],
        }
    )


def _layout_payload(rank: int, lp: LayoutPlan) -> dict[str, Any]:
    return {
        "rank": rank,
        "label": lp.label,
        "layout": lp.layout.model_dump(),
        "settings": lp.layout.settings(),
        "atoms": lp.layout.atoms,
        "goodput": lp.at_rate.summary.goodput,
        "attainment": lp.at_rate.attainment,
        "summary": lp.at_rate.summary,
        "max_rate": lp.max_rate,
        "max_rate_capped": lp.capped,
        "gain": lp.gain,
        "sweep": [
            {"rate": p.rate, "goodput": p.summary.goodput, "attainment": p.attainment}
            for p in lp.points
        ],
    }


def plot(plan: Plan, path: Path) -> None:
    """Goodput (and TPOT p99) against rate for the layouts the plan swept."""
    sweep = {lp.label: [(p.rate, p.summary) for p in lp.points] for lp in plan.ranked if lp.points}
    title = f"{plan.key.model} on {plan.key.device_kind}: {plan.workload} (predicted)"
    report.plot_sweep(path, sweep, title)


def write(plan: Plan, out: Path) -> list[Path]:
    """plan.json, plan.md and goodput_vs_rate.png in `out`; returns their paths."""
    paths = [out / "plan.json", out / "plan.md", out / "goodput_vs_rate.png"]
    report.write_json(paths[0], payload(plan))
    paths[1].write_text(f"{heading(plan)}\n\n{table(plan)}\n")
    plot(plan, paths[2])
    return paths
