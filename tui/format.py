"""Small text formatters the widgets share: units, times, bars."""

from __future__ import annotations

import time

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(size: int | None) -> str:
    """1536 -> '1.5 KiB'; None -> '—'."""
    if size is None:
        return "—"
    value, unit = float(size), 0
    while value >= 1024 and unit < len(_BYTE_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{size} B" if unit == 0 else f"{value:.1f} {_BYTE_UNITS[unit]}"


def ms(value: float | None) -> str:
    """Milliseconds for display: '—' when unknown, no decimals past 100 ms."""
    if value is None:
        return "—"
    return f"{value:.0f} ms" if value >= 100 else f"{value:.1f} ms"


def percent(value: float | None) -> str:
    """A percentage, or '—' when unknown."""
    return "—" if value is None else f"{value:.0f}%"


def clock(at: float) -> str:
    """Unix seconds as local HH:MM:SS."""
    return time.strftime("%H:%M:%S", time.localtime(at))


def bar(used: int, total: int, width: int) -> str:
    """A `width`-cell bar, filled in proportion to used/total."""
    width = max(width, 1)
    filled = 0 if total <= 0 else round(width * min(max(used / total, 0.0), 1.0))
    return "█" * filled + "░" * (width - filled)
