"""Recorded boxes (HGX H100, PCIe A100s, consumer and mixed GPUs, MIG) and `FakeNvml`, which
answers pynvml's calls from a box description: shared by the topology, router and GPU
check tests."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pynvml

from appliance.topology.cpu import cpu_devices
from appliance.topology.cuda_order import TorchFacts
from appliance.topology.devices import Topology
from appliance.topology.discovery import HostFacts
from appliance.topology.nvml import discover_gpus

MIB = 1 << 20

# --- recorded boxes --------------------------------------------------------------------

# HGX H100 baseboard: each GPU's 18 NVLinks go 5/4/4/5 to four NVSwitch chips, so NVML
# reports switch bus ids, not GPUs, at the far end of every link.
_SWITCHES = ("00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0")
_H100_PORTS = [_SWITCHES[0]] * 5 + [_SWITCHES[1]] * 4 + [_SWITCHES[2]] * 4 + [_SWITCHES[3]] * 5

H100_NVSWITCH = {
    "gpus": [
        {
            "name": "NVIDIA H100 80GB HBM3",
            "bus": f"00000000:{bus}:00.0",
            "total": 81559 * MIB,
            "free": 81004 * MIB,
            "util": util,
            "nvlinks": _H100_PORTS,
        }
        for bus, util in zip(
            ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db"),
            (0, 0, 7, 0, 0, 100, 0, 0),
            strict=True,
        )
    ],
    "p2p": True,
}

# Four PCIe A100s with NVLink bridges (3 bridges = 12 links) joining 0-1 and 2-3; one of
# the 2-3 links is down. P2P over PCIe works between all pairs.
_A100 = {"name": "NVIDIA A100 80GB PCIe", "total": 81920 * MIB, "free": 81038 * MIB, "util": 3}
PCIE_4GPU = {
    "gpus": [
        {**_A100, "bus": "00000000:17:00.0", "nvlinks": ["00000000:31:00.0"] * 12},
        {**_A100, "bus": "00000000:31:00.0", "nvlinks": ["00000000:17:00.0"] * 12},
        {**_A100, "bus": "00000000:b1:00.0", "nvlinks": ["00000000:ca:00.0"] * 12},
        {**_A100, "bus": "00000000:ca:00.0", "nvlinks": ["00000000:b1:00.0"] * 11 + [None]},
    ],
    "p2p": True,
}

# Two consumer GPUs: no NVLink (NVML answers NOT_SUPPORTED) and P2P disabled by the driver;
# the second one does not report utilization.
_RTX = {"name": "NVIDIA GeForce RTX 4090", "total": 24564 * MIB, "free": 24212 * MIB}
TWO_GPU_NO_P2P = {
    "gpus": [
        {**_RTX, "bus": "00000000:01:00.0", "util": 12, "nvlinks": None},
        {**_RTX, "bus": "00000000:41:00.0", "util": None, "nvlinks": None},
    ],
    "p2p": False,
}

NO_GPUS = {"gpus": [], "p2p": False}

# A workstation of mixed GPUs. By PCI bus: RTX 4090, H100, RTX 4090, H100; CUDA's default
# FASTEST_FIRST order would put both H100s first. One NVLink bridge joins the two H100s.
# NVML lists them by bus, as it does on real boxes ("uuid": their nvidia-smi -L UUIDs).
_H100_PCIE = {"name": "NVIDIA H100 PCIe", "total": 81559 * MIB, "free": 80000 * MIB, "util": 0}
MIXED = {
    "gpus": [
        {**_RTX, "bus": "00000000:01:00.0", "util": 5, "nvlinks": None, "uuid": "GPU-4090a"},
        {**_H100_PCIE, "bus": "00000000:21:00.0", "nvlinks": ["00000000:81:00.0"] * 12},
        {**_RTX, "bus": "00000000:41:00.0", "util": 7, "nvlinks": None, "uuid": "GPU-4090b"},
        {**_H100_PCIE, "bus": "00000000:81:00.0", "nvlinks": ["00000000:21:00.0"] * 12},
    ],
    "p2p": True,
}

# An A100 box whose GPU 3 is in MIG mode with two MIG devices; GPU 1 could use MIG but
# does not ("mig": None). A GPU without a "mig" key does not support MIG.
MIG_UUIDS = ["MIG-8fe5b8a4-9b0e-5b4c-a0b2-5c1bdb5d0d31", "MIG-1dc3ec24-8a73-5e2c-9c1a-3a6e"]
MIG_BOX = {
    "gpus": [
        {**_A100, "bus": "00000000:17:00.0", "nvlinks": None},
        {**_A100, "bus": "00000000:31:00.0", "nvlinks": None, "mig": None},
        {**_A100, "bus": "00000000:b1:00.0", "nvlinks": None},
        {**_A100, "bus": "00000000:41:00.0", "nvlinks": None, "mig": MIG_UUIDS, "util": None},
    ],
    "p2p": True,
}


@dataclass(frozen=True)
class _Handle:
    index: int


@dataclass(frozen=True)
class _MigHandle:
    gpu: _Handle
    slot: int


def _uuid(gpu: dict[str, Any]) -> str:
    return gpu.get("uuid", f"GPU-{_pci(gpu['bus']).bus:08x}-5b4c-a0b2-5c1bdb5d0d31")


def _pci(bus_id: str) -> SimpleNamespace:
    domain, bus, rest = bus_id.split(":")
    device = rest.split(".")[0]
    return SimpleNamespace(
        busId=bus_id, domain=int(domain, 16), bus=int(bus, 16), device=int(device, 16)
    )


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeNvml:
    """The part of pynvml that discovery calls, answering from a box description."""

    NVMLError = pynvml.NVMLError
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_P2P_CAPS_INDEX_READ = pynvml.NVML_P2P_CAPS_INDEX_READ  # really `(0,)` in pynvml
    NVML_P2P_STATUS_OK = pynvml.NVML_P2P_STATUS_OK
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND

    def __init__(self, box: dict[str, Any], init_error: int | None = None) -> None:
        self.box = box
        self.init_error = init_error
        self.open = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise _error(self.init_error)
        self.open = True

    def nvmlShutdown(self) -> None:
        self.open = False

    def _gpu(self, handle: _Handle) -> dict[str, Any]:
        assert self.open, "NVML called before nvmlInit or after nvmlShutdown"
        gpu = self.box["gpus"][handle.index]
        if gpu.get("lost"):
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def nvmlDeviceGetCount(self) -> int:
        assert self.open
        return len(self.box["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._gpu(handle)["name"]

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:
        gpu = self._gpu(handle)
        return SimpleNamespace(
            total=gpu["total"], free=gpu["free"], used=gpu["total"] - gpu["free"]
        )

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        util = self._gpu(handle)["util"]
        if util is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=util, memory=0)

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:
        return _pci(self._gpu(handle)["bus"])

    def nvmlDeviceGetUUID(self, handle: _Handle | _MigHandle) -> str:
        if isinstance(handle, _MigHandle):
            return self._gpu(handle.gpu)["mig"][handle.slot]
        return _uuid(self._gpu(handle))

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        gpu = self._gpu(handle)
        if "mig" not in gpu:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        on = pynvml.NVML_DEVICE_MIG_ENABLE if gpu["mig"] else pynvml.NVML_DEVICE_MIG_DISABLE
        return [on, on]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        return 7 if "mig" in self._gpu(handle) else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, slot: int) -> _MigHandle:
        if slot >= len(self._gpu(handle)["mig"] or []):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return _MigHandle(handle, slot)

    def _remote(self, handle: _Handle, link: int) -> str | None:
        links = self._gpu(handle)["nvlinks"]
        if links is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= len(links):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return links[link]

    def nvmlDeviceGetNvLinkState(self, handle: _Handle, link: int) -> int:
        up = self._remote(handle, link) is not None
        return pynvml.NVML_FEATURE_ENABLED if up else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: _Handle, link: int) -> SimpleNamespace:
        remote = self._remote(handle, link)
        if remote is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _pci(remote)

    def nvmlDeviceGetP2PStatus(self, a: _Handle, b: _Handle, index: int) -> int:
        if not isinstance(index, int):  # what ctypes does with pynvml's tuple constant
            raise ctypes.ArgumentError("argument 3: Don't know how to convert parameter 3")
        self._gpu(a)
        self._gpu(b)
        ok = self.box["p2p"] and index == 0
        return pynvml.NVML_P2P_STATUS_OK if ok else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED


def gpus(box: dict[str, Any], visible: str | None = None) -> Topology:
    topology = discover_gpus(FakeNvml(box), visible)
    assert topology is not None
    return topology


NO_SIGNS = HostFacts()  # a host without NVIDIA hardware, CUDA_VISIBLE_DEVICES unset
SIGNS = HostFacts(nvidia_signs=("/dev/nvidia0", "/proc/driver/nvidia/version"))


def cuda_torch(count: int) -> TorchFacts:
    """A CUDA build of torch that sees `count` GPUs."""
    return TorchFacts("2.6.0+cu124", "12.4", True, count)


def cpu_box(cores: int, devices: int) -> Topology:
    return Topology.without_links(cpu_devices(devices, cores=range(cores)))
