"""The cluster's section of the settings model (appliance/config.py, which re-exports it):
how KV blocks cross between boxes (NIXL over UCX: TCP here, RDMA where the NICs have it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ClusterSettings(BaseModel):
    """KV transfer between boxes. Inside a box the handoff stays shared memory / CUDA IPC."""

    model_config = ConfigDict(extra="forbid")

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
