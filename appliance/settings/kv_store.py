"""The kv_store section of the settings model (appliance/settings/config.py): the box-wide
KV store below the workers' pools (appliance/kv_store/, issue 41). Names follow vLLM's
offloading connector and LMCache where they have one (LMCache: local_cpu,
max_local_cpu_size, local_disk, max_local_disk_size).

The supervisor opens the store when the first worker loads (appliance/pools/
kv_store_owner.py); each worker of one device writes and reads it
(appliance/workers/store_client.py). A tensor-parallel worker does not use it yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class KVStoreSettings(BaseModel):
    """The box-wide KV store: full KV blocks in host shared memory and on disk, shared by
    every worker of the box and (its disk tier) kept across restarts."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        False,
        description="Keep full KV blocks below the workers' pools, keyed by their tokens and "
        "everything that changes their bytes (model, weights, KV dtype, block size, "
        "tensor-parallel shard, prefill kernel), so a prefix computed by one worker, or "
        "before a restart (disk tier), is read, not computed. Needs kv.prefix_caching; "
        "workers over several devices (tensor parallel) do not use it yet.",
    )
    host_memory_mb: int = Field(
        1024,
        ge=1,
        description="Host memory tier: MiB of shared memory (one file under shm_dir) "
        "holding blocks, least recently used pushed out first (to the disk tier when there "
        "is one). Taken from the box's RAM beside the workers' own KV pools.",
    )
    shm_dir: Path = Field(
        Path("/dev/shm"),
        description="Where the host tier's shared-memory file is made (a tmpfs); it is the "
        "service user's only and is removed when the appliance stops.",
    )
    disk_path: Path | None = Field(
        None,
        description="Disk tier: a directory on a fast local disk for blocks pushed out of "
        "host memory, one checksummed file per block, readable by the service user only "
        "(they hold what prompts said); kept across restarts. Unset: no disk tier.",
    )
    disk_mb: int = Field(
        10240,
        ge=1,
        description="Disk tier: MiB of block files under disk_path, least recently used "
        "deleted first. A full disk stops writes to the tier, never the serving.",
    )
    write_policy: Literal["evict", "finish"] = Field(
        "evict",
        description="When a worker's blocks enter the store: evict (when the worker's own "
        "pool evicts them: no copy while they are still in the pool) or finish (when the "
        "request finishes: other workers see them at once, at the cost of a copy per "
        "request).",
    )

    @model_validator(mode="after")
    def _folders(self) -> KVStoreSettings:
        if not self.shm_dir.is_absolute():
            raise ValueError(f"kv_store.shm_dir must be absolute, not {self.shm_dir}")
        if self.disk_path is not None:
            if not self.disk_path.is_absolute():
                raise ValueError(f"kv_store.disk_path must be absolute, not {self.disk_path}")
            if self.disk_path.exists() and not self.disk_path.is_dir():
                raise ValueError(f"kv_store.disk_path {self.disk_path} is not a directory")
        return self
