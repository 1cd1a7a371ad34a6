"""Which copy a handoff between two pools uses (kv/handoff.kernel_for), on plain data:
the Triton KV copy reads the source pool from a kernel on the destination's GPU, so it
is chosen only where that GPU may read it: the same GPU, or another whose peer access
this process enabled. That the GPUs could (can_device_access_peer) is not enough: a
kernel reading a peer's memory without it faults where copy_ goes through the host."""

from __future__ import annotations

import pytest
import torch

from appliance.kv.handoff import KVShard, copy_kernel, kernel_for, reading_from


def test_the_same_gpu_takes_the_triton_copy() -> None:
    assert kernel_for(0, 0, peer_enabled=False, triton_installed=True) == "triton"


def test_another_gpu_takes_it_only_with_peer_access_enabled() -> None:
    assert kernel_for(1, 0, peer_enabled=False, triton_installed=True) == "runs"
    assert kernel_for(1, 0, peer_enabled=True, triton_installed=True) == "triton"


@pytest.mark.parametrize(("src", "dst"), [(None, None), (0, None), (None, 0)])
def test_a_pool_off_the_gpus_takes_the_strided_runs(src: int | None, dst: int | None) -> None:
    assert kernel_for(src, dst, peer_enabled=True, triton_installed=True) == "runs"


def test_without_triton_every_copy_takes_the_strided_runs() -> None:
    assert kernel_for(0, 0, peer_enabled=True, triton_installed=False) == "runs"


def test_cpu_pools_read_as_they_are() -> None:
    """Pools on the CPU: nothing to enable, nothing marked, and the strided runs."""
    pool = torch.zeros(1, 2, 4, 2, 1, 8)
    shards = reading_from([KVShard(0, pool)], torch.device("cpu"))
    assert [s.peer_enabled for s in shards] == [False] and shards[0].tensor is pool
    assert copy_kernel(pool, pool.clone(), shards[0].peer_enabled) == "runs"
