"""What devices this box serves on, for the `device` setting: its GPUs (read through NVML
and checked against torch) or, without GPUs, its usable CPU cores split into core sets.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from appliance.topology.cpu import cpu_devices
from appliance.topology.cuda_order import TorchFacts, check_torch, read_torch
from appliance.topology.devices import DeviceError, NvmlFailed, Topology
from appliance.topology.nvml import discover_gpus, import_nvml

# Paths that show NVIDIA hardware or its driver on a host, whatever NVML says.
NVIDIA_SIGNS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version")


@dataclass(frozen=True)
class HostFacts:
    """What GPU discovery needs from the host besides NVML (see `read_host`)."""

    cuda_visible_devices: str | None = None  # as this process got it; None when unset
    nvidia_signs: tuple[str, ...] = ()  # those of NVIDIA_SIGNS that exist


def discover_box(device: str, cpu_devices: int | None, share_cores: bool) -> Topology:
    """The devices the settings ask for (`device`, `cpu_devices`, `cpu_share_cores`);
    without accelerators, one CPU "device" per usable core unless told otherwise."""
    count = cpu_devices or len(os.sched_getaffinity(0))
    return discover(device, num_cpu_devices=count, share_cores=share_cores)


def discover(
    device_setting: str,
    num_cpu_devices: int,
    nvml: ModuleType | Any | None = None,
    share_cores: bool = False,
    host: HostFacts | None = None,
    torch_facts: TorchFacts | None = None,
) -> Topology:
    """The box's devices for the `device` setting: "cpu", "cuda", or "auto" (GPUs if NVML
    finds any, else CPU).

    "auto" never means the CPU on a host that shows NVIDIA hardware: if NVML fails there,
    it raises what failed. GPUs torch cannot use (a CPU-only build, a driver too old, a
    different count) raise too. `nvml` defaults to the installed pynvml module, `host` to
    `read_host()`, `torch_facts` to `read_torch()` (read only once GPUs are found).
    """
    if device_setting not in ("auto", "cpu", "cuda"):
        raise ValueError(f"APPLIANCE_DEVICE={device_setting!r}: expected auto, cpu or cuda")
    if device_setting == "cpu":
        return Topology.without_links(cpu_devices(num_cpu_devices, share_cores=share_cores))
    host = host or read_host()
    gpus, reason = _gpus_or_reason(nvml or import_nvml(), host.cuda_visible_devices)
    if gpus is None:
        if device_setting == "cuda" or host.nvidia_signs:
            raise DeviceError(_no_gpu_message(device_setting, reason, host.nvidia_signs))
        return Topology.without_links(cpu_devices(num_cpu_devices, share_cores=share_cores))
    check_torch(gpus.devices, torch_facts or read_torch(), host.cuda_visible_devices)
    return gpus


def _gpus_or_reason(nvml: ModuleType | Any, visible: str | None) -> tuple[Topology | None, str]:
    try:
        return discover_gpus(nvml, visible), "NVML lists no GPU"
    except NvmlFailed as exc:
        return None, str(exc)


def _no_gpu_message(device_setting: str, reason: str, signs: Sequence[str]) -> str:
    if device_setting == "cuda":
        return (
            f"APPLIANCE_DEVICE=cuda but NVML found no NVIDIA GPU ({reason}); check the "
            "driver with nvidia-smi, or use APPLIANCE_DEVICE=cpu or auto"
        )
    return (
        f"APPLIANCE_DEVICE=auto: this host shows NVIDIA hardware ({', '.join(signs)}) but "
        f"NVML found no usable GPU ({reason}); not falling back to the CPU: fix the driver "
        "until nvidia-smi lists the GPUs, or set APPLIANCE_DEVICE=cpu"
    )


def read_host() -> HostFacts:
    """This host's facts for GPU discovery.

    CUDA_VISIBLE_DEVICES is CUDA's own variable, not this appliance's configuration (which
    lives in config.Settings, the only reader of APPLIANCE_* variables): it is read here, at
    the one place discovery starts, and handed on as data. Workers inherit it unchanged.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return HostFacts(visible, tuple(p for p in NVIDIA_SIGNS if os.path.exists(p)))
