"""The cluster tests' certificates: one cluster's CA with the head's and boxes b, c and
stranger's certificates (`appliance certs`' own code), and another cluster's CA with a box
b of its own, made once per session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.cluster.certs import make_certs

BOXES = ["b", "c", "stranger"]


@dataclass(frozen=True)
class Certs:
    """A folder `appliance certs` wrote: the CA's certificate and each box's two files."""

    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    def settings(self, box: str) -> dict[str, str]:
        """The cluster settings naming `box`'s files (as keys of ClusterSettings)."""
        return {
            "ca_file": str(self.ca),
            "cert_file": str(self.folder / f"{box}.crt"),
            "key_file": str(self.folder / f"{box}.key"),
        }

    def env(self, box: str) -> dict[str, str]:
        """The same as APPLIANCE_CLUSTER__* variables."""
        return {f"APPLIANCE_CLUSTER__{k.upper()}": v for k, v in self.settings(box).items()}

    def flags(self, box: str) -> list[str]:
        """The same as `appliance agent` flags."""
        flags = []
        for key, value in self.settings(box).items():
            flags += [f"--cluster.{key.replace('_', '-')}", value]
        return flags


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    folder = tmp_path_factory.mktemp("certs")
    make_certs(folder, BOXES)
    return Certs(folder)


@pytest.fixture(scope="session")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """Another cluster's: its CA signs a box b and a head too."""
    folder = tmp_path_factory.mktemp("other-certs")
    make_certs(folder, ["b"])
    return Certs(folder)
