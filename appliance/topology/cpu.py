"""CPU devices: the usable cores split into core sets, and a worker pinned to its set."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable

from appliance.topology.devices import Device, format_indices


def cpu_devices(
    num_devices: int, cores: Iterable[int] | None = None, share_cores: bool = False
) -> tuple[Device, ...]:
    """Split the usable cores (this process's affinity unless `cores` is given) into
    `num_devices` disjoint, contiguous core sets, sizes differing by at most one.

    Contiguous runs keep a worker's threads on neighbouring cores, which usually share
    caches and a NUMA node. Larger sets come first: the automatic split breaks ties toward
    low indices, so prefill (compute-bound) tends to get the extra cores.

    More devices than cores is an error unless `share_cores`: then each device gets one
    core, in turn, and devices on the same core compete for it.
    """
    usable = sorted(os.sched_getaffinity(0) if cores is None else set(cores))
    if num_devices < 1:
        raise ValueError(f"need at least 1 CPU device, got {num_devices}")
    total, free = _host_memory()
    share = (total // num_devices, free // num_devices)
    if num_devices > len(usable):
        if not share_cores:
            raise ValueError(
                f"asked for {num_devices} CPU devices but only {len(usable)} usable cores "
                f"({format_indices(usable)}); each CPU device needs at least one core unless "
                "cpu_share_cores is set"
            )
        return tuple(
            Device("cpu", i, f"cpu{i} (core {c}, shared)", *share, cores=(c,))
            for i, c in ((i, usable[i % len(usable)]) for i in range(num_devices))
        )
    size, extra = divmod(len(usable), num_devices)
    starts = [i * size + min(i, extra) for i in range(num_devices + 1)]
    sets = [tuple(usable[starts[i] : starts[i + 1]]) for i in range(num_devices)]
    return tuple(
        Device("cpu", i, f"cpu{i} (cores {format_indices(s)})", *share, cores=s)
        for i, s in enumerate(sets)
    )


def _host_memory() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def pin_to_cores(cores: Iterable[int]) -> None:
    """Confine this CPU worker process to `cores`, with one torch thread per core.

    Linux keeps affinity per thread, so every thread already running is pinned, and
    threads started later (torch's pools) inherit it.
    """
    import torch  # only worker processes pay for the import

    cores = set(cores)
    if not cores:
        raise ValueError("pin_to_cores needs at least one core")
    os.sched_setaffinity(0, cores)
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cores)
    torch.set_num_threads(len(cores))


def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else what `platform` knows), which
    every speed figure names beside itself."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
