"""Timing and memory on the scale's device: a sync (CUDA runs asynchronously), the best or
the median of repeated timed calls after warm-ups, peak device memory above a starting
level (none on the CPU), and letting go of what earlier steps held."""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn, after one untimed warm-up call."""
    fn()
    sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The median of `repeats` timed calls of fn, after two untimed warm-up calls."""
    for _ in range(2):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def free_memory() -> None:
    """Let go of what earlier steps of a section held (dropped references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_tracker(device: torch.device) -> Callable[[], float | None]:
    """Start tracking peak device memory; the returned call gives the MiB allocated above
    the starting level since (None on the CPU, where torch does not track it)."""
    if device.type != "cuda":
        return lambda: None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    return lambda: round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)
