"""The cluster's section of the settings model (appliance/settings/config.py, which re-exports it):
the head that agents on other boxes join, and how KV blocks cross between boxes (NIXL over
UCX: TCP here, RDMA where the NICs have it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ClusterSettings(BaseModel):
    """Boxes beyond the first. The head (`appliance serve`) listens for agents
    (`appliance agent` on each other box) over TLS with the cluster's own certificates;
    every connection must prove it holds the shared secret. Inside a box the KV handoff
    stays shared memory / CUDA IPC."""

    model_config = ConfigDict(extra="forbid")

    listen: str = Field(
        "",
        description="On the head: host:port where agents and their workers connect (bind "
        "it to the interface the boxes share, e.g. 10.0.0.1:7400); empty: no other boxes.",
    )
    head: str = Field("", description="On an agent: the head's host:port to join.")
    secret_file: Path | None = Field(
        None,
        description="A file holding the shared secret every box proves it has (HMAC "
        "challenge); required with listen or head. Make one with `head -c 32 /dev/urandom "
        "| base64 > secret` and copy it to each box.",
    )
    ca_file: Path | None = Field(
        None,
        description="The cluster CA's certificate (`appliance certs` makes it): the link "
        "between boxes is TLS, and a peer's certificate must be signed by this CA and no "
        "other; required with listen or head.",
    )
    cert_file: Path | None = Field(
        None,
        description="This box's certificate from `appliance certs` (the head's on the head, "
        "the box's own on an agent: it names the box); required with listen or head.",
    )
    key_file: Path | None = Field(
        None, description="The private key of cert_file (keep it mode 0600 on its box)."
    )
    box: str = Field(
        "",
        description="On an agent: this box's name (default: the host name); it must be the "
        "name its certificate carries.",
    )
    address: str = Field(
        "",
        description="On an agent: the local address it and its workers connect to the head "
        "from (this box's own); empty: the system's choice.",
    )
    pool: Literal["prefill", "decode", "colocated"] = Field(
        "decode", description="On an agent: the role its devices' workers take."
    )

    @model_validator(mode="after")
    def _secret_with_boxes(self) -> ClusterSettings:
        if (self.listen or self.head) and self.secret_file is None:
            raise ValueError(
                "cluster.listen and cluster.head need cluster.secret_file: every box proves "
                "it holds the same secret (make one with `head -c 32 /dev/urandom | base64 "
                "> secret` and copy it to each box)"
            )
        return self

    @field_validator("listen", "head")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value:
            host_port(value)  # raises with what is wrong
        return value

    transports: str = Field(
        "",
        description="UCX transports for KV between boxes (UCX_TLS), e.g. 'tcp' or 'rc,tcp'; "
        "empty lets UCX pick the fastest it finds (shared memory between processes of one "
        "machine, RDMA where there is a NIC for it).",
    )
    interface: str = Field(
        "",
        description="Network interfaces the KV transfer uses and listens on (UCX_NET_DEVICES), "
        "e.g. 'eth0' or 'lo'; empty: every interface UCX finds.",
    )
    transfer_ports: str = Field(
        "",
        description="TCP ports the KV transfer listens on (UCX_TCP_PORT_RANGE), e.g. "
        "'40000-40100'; empty: any free port.",
    )
    transfer_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A KV read from another box that has not finished in this long fails (a "
        "frozen or cut-off peer never answers, and the transfer engine would wait for good).",
    )
    heartbeat_interval_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="On the head: how often it pings each box's agent, which answers from its "
        "own loop (TCP keepalive does not find a frozen box: its kernel still answers).",
    )
    heartbeat_timeout_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="On the head: a box whose agent has said nothing (no answer to a ping) "
        "for this long is marked lost, its workers' requests run again elsewhere; a frozen "
        "box is found within heartbeat_timeout_s + heartbeat_interval_s. At least twice "
        "heartbeat_interval_s (a box is lost only after several missed beats).",
    )

    @model_validator(mode="after")
    def _beats_missed_before_lost(self) -> ClusterSettings:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"cluster.heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be at least "
                f"twice cluster.heartbeat_interval_s ({self.heartbeat_interval_s}): one late "
                "beat must not lose a box"
            )
        return self


def host_port(text: str) -> tuple[str, int]:
    """('10.0.0.1', 7400) from '10.0.0.1:7400'; ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port (e.g. 10.0.0.1:7400), got {text!r}")
    return host.strip("[]"), int(port)
