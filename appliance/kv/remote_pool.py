"""What one box knows of another's KV pool (`RemotePool`, sent over the cluster's wire),
and whether this box can reach other boxes' pools at all (NIXL installed). No torch: the
serve process and the cluster agent check these before any worker starts; the transfers
themselves are remote.py's, in the workers."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from types import ModuleType

from appliance.kv.byte_ranges import PoolShape

# The NIXL wheels name their module after their CUDA build; any of them serves the CPU.
NIXL_MODULES = ("nixl._bindings", "nixl_cu12._bindings", "nixl_cu13._bindings")


@dataclass(frozen=True)
class RemotePool:
    """A KV pool as a process on another box reads it."""

    agent: str  # the owner's NIXL agent name
    metadata: bytes  # the owner agent's metadata (loaded once per reader)
    address: int  # the pool's first byte in its owner's memory
    shape: PoolShape
    device: int = 0  # the GPU the pool is on (0 for host memory)
    memory: str = "DRAM"  # "DRAM" or "VRAM"


def nixl_available() -> bool:
    """Whether a NIXL wheel is installed (the `cluster` extra)."""
    return find_nixl() is not None


class MissingNixl(ValueError):
    """This box cannot move KV to or from others: NIXL is not installed."""


def require_nixl() -> None:
    """MissingNixl, said before any worker starts, when this box cannot move KV to others."""
    if not nixl_available():
        raise MissingNixl(
            "boxes move KV through NIXL, which is not installed here: pip install "
            "'appliance[cluster]' (the nixl-cu12 wheel, which serves CPUs too)"
        )


def find_nixl() -> ModuleType | None:
    """The NIXL binding module of whichever NIXL wheel is installed, or None."""
    for name in NIXL_MODULES:
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    return None
