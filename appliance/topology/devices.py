"""The box as plain data: its devices, the links between them, and the errors that say
the box cannot serve as configured.

A GPU device sits at its position in `Topology.devices` (the number pools, settings and the
console use) and carries the torch ordinal its worker passes to `torch.cuda.set_device`;
NVML's own index stays on the device for its statistics (see cuda_order.py for how the
two are matched).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal


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
    box: str = ""  # the box it is on: "" for the head's own, else the agent's box name

    def __post_init__(self) -> None:
        if self.kind == "cuda" and (self.ordinal is None or self.ordinal < 0):
            raise ValueError(
                f"GPU device {self.index} ({self.name}) needs a torch ordinal >= 0, "
                f"got {self.ordinal}"
            )


@dataclass(frozen=True)
class Link:
    """How two GPUs exchange data: over `nvlinks` NVLink links, PCIe peer-to-peer, or neither.

    "none" means copies bounce through host memory; CPU devices are always "none" to each
    other (they share RAM, so all pairs are equally good). "network": the devices are on
    different boxes; KV crosses the network (kv/remote.py).
    """

    kind: Literal["nvlink", "p2p-pcie", "none", "network"]
    nvlinks: int = 0

    @property
    def rank(self) -> int:
        """Bandwidth rank, higher is faster: NVLink by link count > PCIe P2P > none >
        another box (so handoffs stay in a box where they can)."""
        return {"network": -1, "none": 0, "p2p-pcie": 1}.get(self.kind, 1 + self.nvlinks)


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

    def with_box(self, box: str, devices: Sequence[Device]) -> Topology:
        """This topology and another box's devices after it (renumbered from here on, each
        marked with `box`): no fast link to any device of another box."""
        if any(d.box == box for d in self.devices):
            raise ValueError(f"box {box!r} is in the topology already")
        start = len(self.devices)
        added = [replace(d, index=start + i, box=box) for i, d in enumerate(devices)]
        every = (*self.devices, *added)
        links = tuple(
            tuple(
                self._link(a, b) if a.index < start and b.index < start else _between(a, b)
                for b in every
            )
            for a in every
        )
        return Topology(every, links)

    def _link(self, a: Device, b: Device) -> Link:
        return self.links[a.index][b.index]

    def bandwidth_rank(self, a: int, b: int) -> int:
        """How fast devices a and b exchange KV blocks; only comparisons are meaningful."""
        return self.links[a][b].rank


def _between(a: Device, b: Device) -> Link:
    """The link between two devices one of which just joined: none within its box (its
    own links are not known to the head), the network between boxes."""
    return Link("none") if a.box == b.box else Link("network")


def format_indices(indices: Sequence[int]) -> str:
    """'0-5' for a contiguous run, '0,2,4' otherwise: how messages and CPU device names
    write device and core lists (a form the device-list settings read back)."""
    if len(indices) > 1 and list(indices) == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}-{indices[-1]}"
    return ",".join(map(str, indices))
