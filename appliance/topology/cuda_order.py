"""Which GPU each torch ordinal is, and whether the installed torch agrees.

NVML's list of GPUs (as `NvmlGpu` records) is mapped to the order CUDA numbers them under
`CUDA_DEVICE_ORDER=PCI_BUS_ID` (which workers set before CUDA starts) and the process's
`CUDA_VISIBLE_DEVICES`, read the way CUDA reads it. All of it is pure but `read_torch`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from appliance.topology.devices import Device, DeviceError


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU as NVML lists it: the recorded data the CUDA numbering is worked out from."""

    index: int  # NVML's index, as nvidia-smi shows it
    pci_bus_id: str  # as nvml.py's `_bus_id` writes it
    uuid: str  # "GPU-..."
    name: str
    mig: bool = False  # MIG mode is on
    mig_uuids: tuple[str, ...] = ()  # "MIG-..." of its MIG devices

    def describe(self) -> str:
        """How messages name it: 'GPU 3 (NVIDIA H100 80GB HBM3 00000000:5d:00.0)'."""
        return f"GPU {self.index} ({self.name} {self.pci_bus_id})"


@dataclass(frozen=True)
class TorchFacts:
    """What the installed torch can do with CUDA (see `read_torch`)."""

    version: str
    cuda: str | None  # the CUDA version torch was built for; None for a CPU-only build
    available: bool  # torch.cuda.is_available()
    device_count: int  # torch.cuda.device_count()


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


def gpu_summary(names: Iterable[str]) -> str:
    """'2x NVIDIA H100 80GB HBM3, 1x NVIDIA GeForce RTX 4090'."""
    return ", ".join(f"{count}x {name}" for name, count in Counter(names).items())


def check_torch(gpus: Sequence[Device], facts: TorchFacts, visible: str | None) -> None:
    """Raise DeviceError unless torch (as `facts` describe it) can run on exactly the GPUs
    discovery mapped (`visible` is the CUDA_VISIBLE_DEVICES they were mapped under)."""
    found = f"{len(gpus)} GPU(s) NVML found ({gpu_summary(d.name for d in gpus)})"
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


def read_torch() -> TorchFacts:
    """What the installed torch can do with CUDA. Counting devices starts CUDA's driver in
    this process but makes no context; workers fork from a fork server, a fresh interpreter
    that never starts CUDA (workers/fork_server.py), so they start CUDA afresh."""
    import torch

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    return TorchFacts(torch.__version__, torch.version.cuda, available, count)
