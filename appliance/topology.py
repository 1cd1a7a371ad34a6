"""What devices the box has, how they are linked, and how they split into prefill/decode pools.

Discovery reads NVIDIA GPUs through NVML (the `pynvml` module of nvidia-ml-py, passed in as
an argument so tests can hand in a fake) or, without GPUs, splits the usable CPU cores into
CPU devices. Partitioning is pure: it only looks at a `Topology`.

A GPU device sits at its position in `Topology.devices` (the number pools, settings and the
console use) and carries the torch ordinal its worker passes to `torch.cuda.set_device`.
Discovery maps NVML's GPUs to those ordinals the way CUDA numbers them under
`CUDA_DEVICE_ORDER=PCI_BUS_ID` (which workers set before CUDA starts) and the process's
`CUDA_VISIBLE_DEVICES`; NVML's own index stays on the device for its statistics.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from types import ModuleType
from typing import Any, Literal

PREFILL_SETTING = "APPLIANCE_PREFILL_DEVICES"
DECODE_SETTING = "APPLIANCE_DECODE_DEVICES"

# Exhaustive search over prefill sets is exact and cheap up to a 16-device box
# (C(16, 6) = 8008 sets); beyond that a greedy pick keeps start-up fast.
_MAX_CANDIDATES = 10_000


# Paths that show NVIDIA hardware or its driver on a host, whatever NVML says.
NVIDIA_SIGNS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version")


class DeviceError(ValueError):
    """The box's devices cannot serve as configured; the message says which and why.

    A ValueError, so `appliance serve` prints it as one line and exits (see cli.py)."""


class NvmlFailed(DeviceError):
    """NVML could not be used: no library, no driver, a driver/library mismatch, a lost
    GPU, no permission."""


@dataclass(frozen=True)
class Device:
    """One worker's device: a GPU, or a set of CPU cores.

    `index` is the device's position in its `Topology`. A GPU device also has `ordinal`,
    the torch/CUDA device number its worker runs on (two devices may share one GPU), and
    NVML's `nvml_index` and `uuid` for reading its statistics. Memory is in bytes. A CPU
    device reports an even share of the host's RAM, since all CPU workers draw on the same
    memory. `utilization` is the GPU's busy percentage, None where NVML cannot tell (and
    for CPU devices).
    """

    kind: Literal["cuda", "cpu"]
    index: int
    name: str
    total_memory: int
    free_memory: int
    utilization: int | None = None
    cores: tuple[int, ...] = ()
    pci_bus_id: str | None = None
    ordinal: int | None = None
    nvml_index: int | None = None
    uuid: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "cuda" and (self.ordinal is None or self.ordinal < 0):
            raise ValueError(
                f"GPU device {self.index} ({self.name}) needs a torch ordinal >= 0, "
                f"got {self.ordinal}"
            )


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU as NVML lists it: the recorded data the CUDA numbering is worked out from."""

    index: int  # NVML's index, as nvidia-smi shows it
    pci_bus_id: str  # as `_bus_id` writes it
    uuid: str  # "GPU-..."
    name: str
    mig: bool = False  # MIG mode is on
    mig_uuids: tuple[str, ...] = ()  # "MIG-..." of its MIG devices

    def describe(self) -> str:
        return f"GPU {self.index} ({self.name} {self.pci_bus_id})"


@dataclass(frozen=True)
class HostFacts:
    """What GPU discovery needs from the host besides NVML (see `read_host`)."""

    cuda_visible_devices: str | None = None  # as this process got it; None when unset
    nvidia_signs: tuple[str, ...] = ()  # those of NVIDIA_SIGNS that exist


@dataclass(frozen=True)
class TorchFacts:
    """What the installed torch can do with CUDA (see `read_torch`)."""

    version: str
    cuda: str | None  # the CUDA version torch was built for; None for a CPU-only build
    available: bool  # torch.cuda.is_available()
    device_count: int  # torch.cuda.device_count()


@dataclass(frozen=True)
class Link:
    """How two GPUs exchange data: over `nvlinks` NVLink links, PCIe peer-to-peer, or neither.

    "none" means copies bounce through host memory; CPU devices are always "none" to each
    other (they share RAM, so all pairs are equally good).
    """

    kind: Literal["nvlink", "p2p-pcie", "none"]
    nvlinks: int = 0

    @property
    def rank(self) -> int:
        """Bandwidth rank, higher is faster: NVLink by link count > PCIe P2P > none."""
        return {"none": 0, "p2p-pcie": 1}.get(self.kind, 1 + self.nvlinks)


@dataclass(frozen=True)
class Topology:
    """The box's devices (device i at position i) and the symmetric link matrix between them."""

    devices: tuple[Device, ...]
    links: tuple[tuple[Link, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.devices)
        if [d.index for d in self.devices] != list(range(n)):
            raise ValueError("device i must sit at position i of Topology.devices")
        if len(self.links) != n or any(len(row) != n for row in self.links):
            raise ValueError(f"link matrix must be {n}x{n}")

    @classmethod
    def without_links(cls, devices: Sequence[Device]) -> Topology:
        """A topology whose devices have no fast links (CPU devices)."""
        n = len(devices)
        return cls(tuple(devices), tuple((Link("none"),) * n for _ in range(n)))

    def bandwidth_rank(self, a: int, b: int) -> int:
        """How fast devices a and b exchange KV blocks; only comparisons are meaningful."""
        return self.links[a][b].rank


@dataclass(frozen=True)
class Partition:
    """Which devices prefill, which decode, and where each decode device pulls KV from.

    In colocated mode every used device is in both pools and `pairs` is empty: no KV
    changes device.
    """

    mode: Literal["disaggregated", "colocated"]
    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    # decode device -> prefill device; a dict can't be hashed, so hashing skips it
    pairs: dict[int, int] = field(default_factory=dict, hash=False)


# --- discovery -------------------------------------------------------------------------


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
            f"({_summary(g.name for g in listed)}): unset it to serve on them, or set "
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


# --- CUDA numbering --------------------------------------------------------------------


def cuda_order(gpus: Sequence[NvmlGpu], visible: str | None) -> tuple[NvmlGpu, ...]:
    """The GPUs a CUDA process sees under CUDA_DEVICE_ORDER=PCI_BUS_ID and
    CUDA_VISIBLE_DEVICES=`visible` (None: unset), in order: element i is torch's cuda:i.

    Pure: `gpus` is NVML's list, in whatever order NVML gave it. A visible GPU in MIG mode
    is refused by name (CUDA shows it as its MIG devices, which this appliance does not run
    on yet); a hidden one is fine.
    """
    by_bus = sorted(gpus, key=lambda g: _bus_key(g.pci_bus_id))
    chosen = tuple(by_bus) if visible is None else _visible_gpus(by_bus, visible)
    for gpu in chosen:
        if gpu.mig:
            raise DeviceError(
                f"{gpu.describe()} is in MIG mode; MIG instances are not supported yet: "
                f"disable MIG (nvidia-smi -i {gpu.index} -mig 0) or hide it with "
                "CUDA_VISIBLE_DEVICES"
            )
    return chosen


def _bus_key(bus_id: str) -> tuple[int, ...]:
    domain, bus, rest = bus_id.split(":")
    device, function = rest.split(".")
    return tuple(int(part, 16) for part in (domain, bus, device, function))


def _visible_gpus(by_bus: Sequence[NvmlGpu], visible: str) -> tuple[NvmlGpu, ...]:
    """CUDA's reading of CUDA_VISIBLE_DEVICES: comma-separated entries, each an index into
    the bus order (read like C's strtoul, so '4-7' is 4 and '-1' names nothing), a
    GPU-UUID or a MIG-UUID (any unique prefix). The first entry that names no device hides
    itself and everything after it; naming one device twice hides all (as torch.cuda's own
    model of the variable has it)."""
    seen: list[str] = []
    chosen: list[NvmlGpu] = []
    for entry in visible.split(","):
        found = _lookup(by_bus, entry.strip())
        if found is None:
            break
        key, gpu = found
        if key in seen:
            return ()
        seen.append(key)
        chosen.append(gpu)
    return tuple(chosen)


def _lookup(by_bus: Sequence[NvmlGpu], entry: str) -> tuple[str, NvmlGpu] | None:
    """(what the entry names, the GPU it is or belongs to), or None if it names nothing."""
    if entry.startswith("MIG-"):
        return _mig_owner(by_bus, entry)
    if entry.startswith("GPU-"):
        gpu = _only([g for g in by_bus if g.uuid.startswith(entry)])
        return None if gpu is None else (gpu.uuid, gpu)
    number = re.match(r"\+?(\d+)", entry)
    if number is None or int(number[1]) >= len(by_bus):
        return None
    gpu = by_bus[int(number[1])]
    return gpu.uuid, gpu


def _mig_owner(by_bus: Sequence[NvmlGpu], entry: str) -> tuple[str, NvmlGpu] | None:
    """The GPU whose MIG device `entry` names: MIG-<uuid>, or the older form
    MIG-GPU-<uuid>/<gpu instance>/<compute instance>."""
    older = re.fullmatch(r"MIG-(GPU-[^/]+)/\d+/\d+", entry)
    if older:
        gpu = _only([g for g in by_bus if g.mig and g.uuid.startswith(older[1])])
        return None if gpu is None else (entry, gpu)
    owners = [(uuid, g) for g in by_bus for uuid in g.mig_uuids if uuid.startswith(entry)]
    return owners[0] if len(owners) == 1 else None


def _only(gpus: list[NvmlGpu]) -> NvmlGpu | None:
    return gpus[0] if len(gpus) == 1 else None


def _summary(names: Iterable[str]) -> str:
    """'2x NVIDIA H100 80GB HBM3, 1x NVIDIA GeForce RTX 4090'."""
    return ", ".join(f"{count}x {name}" for name, count in Counter(names).items())


def check_torch(gpus: Sequence[Device], facts: TorchFacts, visible: str | None) -> None:
    """Raise DeviceError unless torch (as `facts` describe it) can run on exactly the GPUs
    discovery mapped (`visible` is the CUDA_VISIBLE_DEVICES they were mapped under)."""
    found = f"{len(gpus)} GPU(s) NVML found ({_summary(d.name for d in gpus)})"
    if facts.cuda is None:
        raise DeviceError(
            f"torch {facts.version} is a CPU-only build but this box has the {found}: "
            "install torch built for CUDA (install.sh picks it on a GPU box), or set "
            "APPLIANCE_DEVICE=cpu"
        )
    if not facts.available:
        raise DeviceError(
            f"torch {facts.version} (built for CUDA {facts.cuda}) cannot use the {found}: "
            f"torch.cuda.is_available() is False, most often because the driver is older "
            f"than CUDA {facts.cuda} needs (nvidia-smi shows the newest CUDA it supports): "
            "update the driver or install torch built for an older CUDA"
        )
    if facts.device_count != len(gpus):
        shown = "unset" if visible is None else repr(visible)
        raise DeviceError(
            f"torch sees {facts.device_count} CUDA device(s) but expects the {found} "
            f"with CUDA_VISIBLE_DEVICES {shown}: name the GPUs to use by UUID "
            "(nvidia-smi -L) in CUDA_VISIBLE_DEVICES, or set APPLIANCE_DEVICE=cpu"
        )


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
                f"({_core_list(usable)}); each CPU device needs at least one core unless "
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
        Device("cpu", i, f"cpu{i} (cores {_core_list(s)})", *share, cores=s)
        for i, s in enumerate(sets)
    )


def _host_memory() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def _core_list(cores: Sequence[int]) -> str:
    """'0-5' for a contiguous run, '0,2,4' otherwise."""
    if len(cores) > 1 and list(cores) == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


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


def read_torch() -> TorchFacts:
    """What the installed torch can do with CUDA. Counting devices starts CUDA's driver in
    this process but makes no context; workers are spawned, so they start CUDA afresh."""
    import torch

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    return TorchFacts(torch.__version__, torch.version.cuda, available, count)


def import_nvml() -> ModuleType | Any:
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


# --- partition -------------------------------------------------------------------------


def parse_devices(text: str | None, setting: str) -> tuple[int, ...] | None:
    """Device indices from '0,1', '0-3' or '0-1,3'; None when unset or blank (automatic)."""
    if text is None or not text.strip():
        return None
    indices: set[int] = set()
    for part in text.split(","):
        indices.update(_parse_part(part.strip(), text, setting))
    return tuple(sorted(indices))


def _parse_part(part: str, text: str, setting: str) -> range:
    match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
    if not match:
        raise ValueError(f"{setting}={text!r}: write device indices like '0,1' or '0-3'")
    low, high = int(match[1]), int(match[2] or match[1])
    if high < low:
        raise ValueError(f"{setting}={text!r}: range {part!r} runs backwards")
    return range(low, high + 1)


def prefill_count(num_devices: int) -> int:
    """How many of `num_devices` prefill in automatic disaggregated mode: ceil(n/3).

    Prefill is compute-bound and bursty: one forward pass over a whole prompt, then the
    device is free. Decode holds every running sequence's KV cache for its whole
    generation and runs memory-bound steps, so it needs more devices (memory capacity and
    bandwidth); about one prefill device keeps two decode devices fed. ceil(n/3) gives
    1 of 2, 1 of 3, 2 of 4, 3 of 8, 6 of 16, and leaves both pools non-empty for n >= 2.
    """
    return math.ceil(num_devices / 3)


def tp_groups(
    topology: Topology, devices: Sequence[int], degree: int, setting: str
) -> list[tuple[int, ...]]:
    """Split a pool's devices into tensor-parallel groups of `degree` devices.

    Shards all-reduce twice per layer, so a group wants its slowest internal link fast:
    groups are picked one by one, each the remaining set whose slowest link ranks highest
    (then the most links in total, then the lowest device numbers)."""
    if len(devices) % degree:
        raise ValueError(
            f"{setting}={degree} does not divide the pool's {len(devices)} device(s) "
            f"({_core_list(devices)}): give the pool a multiple of {degree} devices"
        )
    left = sorted(devices)
    groups: list[tuple[int, ...]] = []
    while left:
        if math.comb(len(left), degree) > _MAX_CANDIDATES:  # too many to try: in order
            groups.append(tuple(left[:degree]))
            left = left[degree:]
            continue
        best = max(combinations(left, degree), key=lambda g: _group_score(topology, g))
        groups.append(best)
        left = [d for d in left if d not in best]
    return groups


def _group_score(topology: Topology, group: tuple[int, ...]) -> tuple[int, int, list[int]]:
    ranks = [topology.bandwidth_rank(a, b) for a, b in combinations(group, 2)]
    return (min(ranks, default=0), sum(ranks), [-d for d in group])


def partition(
    topology: Topology, mode: str, prefill: str | None = None, decode: str | None = None
) -> Partition:
    """Split the topology's devices into prefill and decode pools.

    `prefill`/`decode` are the APPLIANCE_PREFILL_DEVICES / APPLIANCE_DECODE_DEVICES
    strings; one given alone takes its devices and leaves the rest to the other pool, none
    given splits automatically (see `prefill_count` and `_auto_prefill`). Every decode device
    is paired with the prefill device it pulls KV from (see `pair_decode`).
    """
    n = len(topology.devices)
    want_prefill = _checked(parse_devices(prefill, PREFILL_SETTING), PREFILL_SETTING, prefill, n)
    want_decode = _checked(parse_devices(decode, DECODE_SETTING), DECODE_SETTING, decode, n)
    if mode == "colocated":
        return _colocated(n, want_prefill, want_decode)
    if mode != "disaggregated":
        raise ValueError(f"APPLIANCE_MODE={mode!r}: expected disaggregated or colocated")
    if n < 2:
        raise ValueError(
            f"disaggregated mode needs at least 2 devices (one prefill, one decode) but this "
            f"box has {n}; set APPLIANCE_MODE=colocated"
        )
    if want_prefill is None and want_decode is None:
        want_prefill = _auto_prefill(topology)
    pools = _explicit_pools(n, want_prefill, want_decode, (prefill, decode))
    return Partition("disaggregated", *pools, pair_decode(topology, *pools))


def _checked(
    indices: tuple[int, ...] | None, setting: str, text: str | None, n: int
) -> tuple[int, ...] | None:
    unknown = [i for i in indices or () if i >= n]
    if unknown:
        raise ValueError(
            f"{setting}={text!r} names device {unknown[0]}, but this box has "
            f"{n} device(s): {_core_list(range(n)) or 'none'}"
        )
    return indices


def _colocated(
    n: int, prefill: tuple[int, ...] | None, decode: tuple[int, ...] | None
) -> Partition:
    # Colocated workers do both jobs, so device lists only choose which devices to use.
    used = tuple(sorted(set(prefill or ()) | set(decode or ()))) or tuple(range(n))
    if not used:
        raise ValueError("no devices found to run on")
    return Partition("colocated", used, used, {})


def _explicit_pools(
    n: int,
    prefill: tuple[int, ...] | None,
    decode: tuple[int, ...] | None,
    texts: tuple[str | None, str | None],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    prefill = prefill if prefill is not None else _rest(n, decode)
    decode = decode if decode is not None else _rest(n, prefill)
    shared = sorted(set(prefill) & set(decode))
    if shared:
        raise ValueError(
            f"device {shared[0]} is in both {PREFILL_SETTING}={texts[0]!r} and "
            f"{DECODE_SETTING}={texts[1]!r}; a device serves one pool"
        )
    _require_devices(prefill, PREFILL_SETTING, DECODE_SETTING, n)
    _require_devices(decode, DECODE_SETTING, PREFILL_SETTING, n)
    return prefill, decode


def _require_devices(pool: tuple[int, ...], setting: str, other: str, n: int) -> None:
    if not pool:
        raise ValueError(
            f"{setting} is empty: {other} takes all {n} devices; leave a device for "
            f"{setting} or set APPLIANCE_MODE=colocated"
        )


def _rest(n: int, taken: tuple[int, ...] | None) -> tuple[int, ...]:
    return tuple(i for i in range(n) if i not in (taken or ()))


def _auto_prefill(topology: Topology) -> tuple[int, ...]:
    """The prefill set with the best `_score`; exhaustive when small, else greedy.

    combinations() yields sets in lexicographic order and max() keeps the first best,
    so ties go to the lowest device indices.
    """
    n = len(topology.devices)
    k = prefill_count(n)
    if math.comb(n, k) > _MAX_CANDIDATES:
        return _greedy_prefill(topology, k)
    return max(combinations(range(n), k), key=lambda p: _score(topology, p))


def _greedy_prefill(topology: Topology, k: int) -> tuple[int, ...]:
    chosen: tuple[int, ...] = ()
    for _ in range(k):
        options = [tuple(sorted((*chosen, i))) for i in _rest(len(topology.devices), chosen)]
        chosen = max(options, key=lambda p: _score(topology, p))
    return chosen


def _score(topology: Topology, prefill: tuple[int, ...]) -> tuple[int, int, int]:
    """Higher is better: the worst decode device's link to its prefill device first (no
    decode device left on a slow link if avoidable), then the sum of those links, then an
    even load (fewest decode devices on the busiest prefill device)."""
    decode = _rest(len(topology.devices), prefill)
    pairs = pair_decode(topology, prefill, decode)
    ranks = [topology.bandwidth_rank(d, p) for d, p in pairs.items()]
    busiest = max(Counter(pairs.values()).values(), default=0)
    return min(ranks, default=0), sum(ranks), -busiest


def pair_decode(
    topology: Topology, prefill: Sequence[int], decode: Sequence[int]
) -> dict[int, int]:
    """For each decode device (in index order), the prefill device to pull KV from: the
    best-linked one; ties go to the prefill device with fewest decode devices so far, then
    to the lowest index."""
    load = dict.fromkeys(prefill, 0)
    pairs = {}
    for d in sorted(decode):
        pairs[d] = _best_prefill(topology, d, load)
        load[pairs[d]] += 1
    return pairs


def _best_prefill(topology: Topology, d: int, load: dict[int, int]) -> int:
    return max(load, key=lambda p: (topology.bandwidth_rank(d, p), -load[p], -p))
