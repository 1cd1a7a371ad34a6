"""Benchmark output: a markdown table (with ratios against a baseline), a JSON file, and
PNG plots of latency CDFs and of goodput against request rate."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from appliance.core.goodput import PhaseSummary, RequestResult, Summary

COLUMNS = (
    "config",
    "done",
    "failed",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "TPOT p50 ms",
    "TPOT p99 ms",
    "ITL p99 ms",
    "goodput req/s",
    "req/s",
    "out tok/s",
)


def table(rows: list[tuple[str, Summary]], baseline: str | None = None) -> str:
    """One line per configuration; with a baseline, goodput and TPOT p99 as ratios to it."""
    base = dict(rows).get(baseline) if baseline else None
    header = list(COLUMNS)
    if base is not None:
        header += [f"goodput / {baseline}", f"TPOT p99 / {baseline}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, s in rows:
        cells = [
            label,
            str(s.completed),
            str(s.failed),
            ms(s.ttft.median),
            ms(s.ttft.p99),
            ms(s.tpot.median),
            ms(s.tpot.p99),
            ms(s.itl.p99),
            f"{s.goodput:.3f}",
            f"{s.request_throughput:.3f}",
            f"{s.output_throughput:.1f}",
        ]
        if base is not None:
            cells += [_ratio(s.goodput, base.goodput), _ratio(s.tpot.p99, base.tpot.p99)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PHASE_COLUMNS = (
    "phase",
    "requests",
    "failed",
    "goodput req/s",
    "attainment",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TPOT p50 ms",
    "TPOT p90 ms",
)


def phase_table(phases: list[PhaseSummary], total: PhaseSummary) -> str:
    """A shift run phase by phase, then the whole run ('all')."""
    lines = ["| " + " | ".join(PHASE_COLUMNS) + " |", "|" + "---|" * len(PHASE_COLUMNS)]
    for p in [*phases, total]:
        cells = [p.label, str(p.requests), str(p.failed), f"{p.goodput:.3f}"]
        cells += [_share(p.attainment), ms(p.ttft_p50), ms(p.ttft_p90)]
        cells += [ms(p.tpot_p50), ms(p.tpot_p90)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def phase_compare_table(rows: list[tuple[str, list[PhaseSummary], PhaseSummary]]) -> str:
    """Goodput req/s (and attainment) per phase and overall, one line per configuration."""
    phases = rows[0][1] if rows else []
    header = ["config", *(f"{p.label} goodput" for p in phases), "all goodput"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, summaries, total in rows:
        cells = [f"{p.goodput:.3f} ({_share(p.attainment)})" for p in [*summaries, total]]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines)


def _share(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction:.0%}"


def ms(seconds: float) -> str:
    """Seconds as whole milliseconds for a table; '-' where nothing completed (NaN)."""
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def _ratio(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or base == 0:
        return "-"
    return f"{value / base:.2f}x"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Dataclasses as objects; NaN (no completed request) as null, which JSON has."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(plain(payload), indent=2, allow_nan=False)
    path.write_text(text + "\n")


def plain(value: Any) -> Any:
    """`value` as JSON can hold it: dataclasses as objects, NaN (no completed request) as
    null, an infinity as its text."""
    if hasattr(value, "__dataclass_fields__"):
        value = asdict(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


def plot_cdfs(path: Path, runs: dict[str, list[RequestResult]], title: str) -> None:
    """TTFT and TPOT cumulative distributions, one line per configuration."""
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, results in runs.items():
        done = [r for r in results if r.ok]
        _cdf(left, [r.ttft * 1000 for r in done], label)
        _cdf(right, [t * 1000 for r in done if (t := r.tpot) is not None], label)
    left.set(
        xlabel="TTFT (ms)", ylabel="share of requests", xscale="log", title="Time to first token"
    )
    right.set(xlabel="TPOT (ms)", xscale="log", title="Time per output token")
    for axes in (left, right):
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title)
    _save(figure, path)


def _cdf(axes: Any, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
    axes.step(ordered, shares, where="post", label=label)


def plot_sweep(path: Path, sweep: dict[str, list[tuple[float, Summary]]], title: str) -> None:
    """Goodput and TPOT p99 against the request rate, one line per configuration."""
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in sweep.items():
        rates = [rate for rate, _ in points]
        left.plot(rates, [s.goodput for _, s in points], marker="o", label=label)
        right.plot(rates, [s.tpot.p99 * 1000 for _, s in points], marker="o", label=label)
    left.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="Goodput")
    right.set(xlabel="request rate (req/s)", ylabel="TPOT p99 (ms)", yscale="log", title="TPOT p99")
    for axes in (left, right):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title)
    _save(figure, path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    _pyplot().close(figure)
