"""How busy each device is: the GPU's utilization and memory through NVML, or on a CPU
device the worker process's CPU share of its cores and its resident memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil

from appliance.topology.devices import Device

MIN_INTERVAL_S = 1.0  # shorter CPU-share windows are mostly noise


@dataclass(frozen=True)
class DeviceLoad:
    utilization: float | None  # percent
    memory_used: int | None  # bytes
    memory_total: int | None


@dataclass
class _CpuSample:
    process: psutil.Process
    taken_at: float
    percent: float = 0.0


class DeviceStats:
    """Samples devices; many callers may ask often, CPU shares are measured over >= 1 s."""

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml = nvml  # the pynvml module on a GPU box, None on CPU-only boxes
        self._nvml_ready = False
        self._cpu: dict[int, _CpuSample] = {}  # pid -> its last CPU sample

    def sample(self, device: Device, pid: int | None, now: float) -> DeviceLoad:
        """The device's load at monotonic time `now`; None fields where it cannot be read
        (on another box: its pid and GPU numbers are that box's, not this one's)."""
        if device.box:
            return DeviceLoad(None, None, device.total_memory)
        if device.kind == "cuda":
            return self._gpu(device)
        if pid is None:
            return DeviceLoad(None, None, device.total_memory)
        return self._cpu_load(device, pid, now)

    def _cpu_load(self, device: Device, pid: int, now: float) -> DeviceLoad:
        try:
            sample = self._cpu.get(pid)
            if sample is None:
                process = psutil.Process(pid)
                process.cpu_percent(None)  # starts psutil's measuring window
                sample = self._cpu[pid] = _CpuSample(process, now)
            elif now - sample.taken_at >= MIN_INTERVAL_S:
                sample.percent = sample.process.cpu_percent(None) / max(1, len(device.cores))
                sample.taken_at = now
            rss = sample.process.memory_info().rss
        except psutil.Error:  # the process has exited
            self._cpu.pop(pid, None)
            return DeviceLoad(None, None, device.total_memory)
        return DeviceLoad(sample.percent, rss, device.total_memory)

    def _gpu(self, device: Device) -> DeviceLoad:
        nvml = self._nvml
        if nvml is None:
            return DeviceLoad(None, None, device.total_memory)
        try:
            if not self._nvml_ready:
                nvml.nvmlInit()
                self._nvml_ready = True
            handle = nvml.nvmlDeviceGetHandleByIndex(_nvml_index(device))
            busy = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError:
            return DeviceLoad(None, None, device.total_memory)
        return DeviceLoad(float(busy), int(memory.used), int(memory.total))

    def forget_exited(self, live_pids: set[int]) -> None:
        """Drop samples of processes that are gone (workers replaced by moves)."""
        for pid in set(self._cpu) - live_pids:
            del self._cpu[pid]


def _nvml_index(device: Device) -> int:
    """NVML's number for the GPU: discovery records it (it differs from the device's
    position and its CUDA ordinal under CUDA_VISIBLE_DEVICES); a device made by hand
    without it is taken to be NVML's GPU of its ordinal."""
    if device.nvml_index is not None:
        return device.nvml_index
    return device.ordinal if device.ordinal is not None else device.index
