"""The GPUs and their links as NVML reports them.

`nvml` is the `pynvml` module of nvidia-ml-py, passed in as an argument so tests can hand
in a fake; `import_nvml` gives the installed one, or a stand-in whose init fails the NVML
way when the package is missing.
"""

from __future__ import annotations

import contextlib
from itertools import combinations
from types import ModuleType
from typing import Any

from appliance.topology.cuda_order import NvmlGpu, cuda_order, gpu_summary
from appliance.topology.devices import Device, DeviceError, Link, NvmlFailed, Topology


def discover_gpus(nvml: ModuleType | Any, visible: str | None = None) -> Topology | None:
    """Read the GPUs a CUDA process with CUDA_VISIBLE_DEVICES=`visible` (None: unset) sees,
    and their links, through `nvml` (the pynvml module); device i has torch ordinal i.

    Returns None when NVML lists no GPU. Raises NvmlFailed when NVML cannot be used, and
    DeviceError when `visible` hides every GPU or a visible GPU is in MIG mode.
    """
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NvmlFailed(f"NVML did not start: {_said(exc)}") from exc
    try:
        return _read_gpus(nvml, visible)
    except nvml.NVMLError as exc:
        raise NvmlFailed(f"NVML failed reading the GPUs: {_said(exc)}") from exc
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def _said(exc: Exception) -> str:
    # Some NVML messages end in a full stop, which would end our sentence early.
    return str(exc).rstrip(".")


def _read_gpus(nvml: Any, visible: str | None) -> Topology | None:
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    if not handles:
        return None
    listed = [_nvml_gpu(nvml, i, h) for i, h in enumerate(handles)]
    chosen = cuda_order(listed, visible)
    if not chosen:
        raise DeviceError(
            f"CUDA_VISIBLE_DEVICES={visible!r} hides all {len(listed)} GPU(s) NVML lists "
            f"({gpu_summary(g.name for g in listed)}): unset it to serve on them, or set "
            "APPLIANCE_DEVICE=cpu to serve on the CPU"
        )
    used = [handles[g.index] for g in chosen]
    devices = tuple(_gpu_device(nvml, i, g, used[i]) for i, g in enumerate(chosen))
    buses = [g.pci_bus_id for g in chosen]
    return Topology(devices, _gpu_links(nvml, used, buses, {g.pci_bus_id for g in listed}))


def _nvml_gpu(nvml: Any, index: int, handle: Any) -> NvmlGpu:
    bus = _bus_id(nvml.nvmlDeviceGetPciInfo(handle))
    uuid = _text(nvml.nvmlDeviceGetUUID(handle))
    name = _text(nvml.nvmlDeviceGetName(handle))
    mig = _mig_enabled(nvml, handle)
    return NvmlGpu(index, bus, uuid, name, mig, _mig_uuids(nvml, handle) if mig else ())


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError as exc:
        # A GPU without MIG says NOT_SUPPORTED; a driver older than MIG lacks the call.
        if exc.value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            return False
        raise
    return current == nvml.NVML_DEVICE_MIG_ENABLE


def _mig_uuids(nvml: Any, handle: Any) -> tuple[str, ...]:
    """Its MIG devices' uuids, as far as NVML tells: they only let a CUDA_VISIBLE_DEVICES
    entry name its GPU, which is refused either way."""
    uuids = []
    with contextlib.suppress(nvml.NVMLError):
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            with contextlib.suppress(nvml.NVMLError):  # NOT_FOUND: an empty slot
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                uuids.append(_text(nvml.nvmlDeviceGetUUID(mig)))
    return tuple(uuids)


def _gpu_device(nvml: Any, ordinal: int, gpu: NvmlGpu, handle: Any) -> Device:
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    util = _utilization(nvml, handle)
    return Device(
        "cuda",
        ordinal,
        gpu.name,
        memory.total,
        memory.free,
        util,
        pci_bus_id=gpu.pci_bus_id,
        ordinal=ordinal,
        nvml_index=gpu.index,
        uuid=gpu.uuid,
    )


def _utilization(nvml: Any, handle: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except nvml.NVMLError:  # e.g. NOT_SUPPORTED on some consumer GPUs
        return None


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes for char arrays.
    return value.decode() if isinstance(value, bytes) else value


def _bus_id(pci: Any) -> str:
    """Canonical bus id from the integer fields, which every NVML struct version fills the
    same way (the busId string has had 8- and 4-digit domain forms)."""
    return f"{pci.domain:08x}:{pci.bus:02x}:{pci.device:02x}.0"


def _gpu_links(
    nvml: Any, handles: list[Any], buses: list[str], gpu_buses: set[str]
) -> tuple[tuple[Link, ...], ...]:
    """The link matrix of the used GPUs (`handles`, at `buses`); `gpu_buses` holds every
    GPU NVML lists, hidden ones too, so a link to one of those is not taken for a switch."""
    remotes = [_nvlink_remotes(nvml, h) for h in handles]
    links = [[Link("none")] * len(handles) for _ in handles]
    for a, b in combinations(range(len(handles)), 2):
        nvlinks = _nvlink_count(remotes, buses, gpu_buses, a, b)
        link = _gpu_link(nvml, handles[a], handles[b], nvlinks)
        links[a][b] = links[b][a] = link
    return tuple(tuple(row) for row in links)


def _nvlink_remotes(nvml: Any, handle: Any) -> list[str]:
    """Bus ids at the far end of each active NVLink of one GPU (repeats = parallel links)."""
    remotes = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED:
                remotes.append(_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)))
        except nvml.NVMLError:  # this GPU has fewer links, or no NVLink at all
            continue
    return remotes


def _nvlink_count(
    remotes: list[list[str]], buses: list[str], gpu_buses: set[str], a: int, b: int
) -> int:
    """NVLinks usable between GPUs a and b.

    Direct links are counted from both ends (min, so a link down at either end is not
    counted). A far end that is not one of the box's GPUs is an NVSwitch port (HGX/DGX
    baseboards), which connects every pair of switch-attached GPUs at the narrower GPU's
    link count — what `nvidia-smi topo -m` shows as NV18 on an 8xH100 box.
    """
    direct = min(remotes[a].count(buses[b]), remotes[b].count(buses[a]))
    switched = min(_switch_links(remotes[a], gpu_buses), _switch_links(remotes[b], gpu_buses))
    return direct + switched


def _switch_links(remotes: list[str], gpu_buses: set[str]) -> int:
    return sum(remote not in gpu_buses for remote in remotes)


def _gpu_link(nvml: Any, a: Any, b: Any, nvlinks: int) -> Link:
    if nvlinks:
        return Link("nvlink", nvlinks)
    return Link("p2p-pcie") if _p2p_read_ok(nvml, a, b) else Link("none")


def _p2p_read_ok(nvml: Any, a: Any, b: Any) -> bool:
    index = nvml.NVML_P2P_CAPS_INDEX_READ
    # nvidia-ml-py defines this constant as `0,` (a tuple), which ctypes refuses to pass.
    index = index[0] if isinstance(index, tuple) else index
    try:
        return nvml.nvmlDeviceGetP2PStatus(a, b, index) == nvml.NVML_P2P_STATUS_OK
    except nvml.NVMLError:
        return False


def import_nvml() -> ModuleType | Any:
    """The installed pynvml module, or `_NoNvml` when nvidia-ml-py is missing."""
    try:
        import pynvml
    except ImportError:
        return _NoNvml  # behaves like an NVML whose init fails
    return pynvml


class _NoNvml:
    """Stand-in when nvidia-ml-py is not installed: init fails the NVML way."""

    class NVMLError(Exception):
        pass

    @staticmethod
    def nvmlInit() -> None:
        raise _NoNvml.NVMLError("nvidia-ml-py is not installed")
