"""The one timing rule the CPU benchmark scripts share: one warm-up, then the best of N."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeats: int = 30) -> float:
    """Fastest of `repeats` timed calls after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
