"""The handoff's block copy as one Triton launch (appliance/model/layers/triton_kv_copy.py,
called by kv/handoff.copy_blocks) under Triton's interpreter, against torch indexing.

Pools of several layers with odd block counts, shuffled (non-contiguous) ids on both
sides, a head size that is not a power of two, a shard's slice of the heads (strided
views on both sides), in bfloat16, float16 and float32: the destination must equal
`dst[:, :, dst_ids] = src[:, :, src_ids]` bit for bit, every other block untouched. Then
the launches of a scattered 4k-token handoff, counted: the strided copies (one per run of
consecutive ids) against the Triton kernel's one launch. The child process runs the
interpreter (TRITON_INTERPRET must be set before triton is imported; see
test_triton_attention.py) and reports JSON.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from interpreter_child import child_results, run_jobs

# Each test runs the Triton interpreter in a child process: the slow lane's kind of test.
pytestmark = pytest.mark.process

sys.path.insert(0, str(Path(__file__).parent))  # the launch counter, run as a script too
from test_triton_launches import LaunchCounter  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")
# (layers, blocks in the source pool, in the destination, block size, heads, head_dim, copied)
SHAPES = {
    "odd": (3, 13, 11, 4, 2, 24, 7),
    "one_block": (2, 5, 3, 8, 1, 16, 1),
    "many_heads": (2, 9, 9, 2, 8, 8, 9),
}
# A scattered 4k-token handoff at 16-token blocks: 256 blocks, no two ids consecutive.
HANDOFF_BLOCKS, BLOCK_SIZE = 256, 16


def _pool(
    layers: int, blocks: int, block_size: int, heads: int, dim: int, dtype: str
) -> torch.Tensor:
    shape = (layers, 2, blocks, block_size, heads, dim)
    return torch.randn(shape).to(getattr(torch, dtype))


def _ids(count: int, among: int, generator: torch.Generator) -> list[int]:
    return torch.randperm(among, generator=generator)[:count].tolist()


def _mismatches(shape: str, dtype: str, shard: bool) -> int:
    """Elements where the kernel's destination differs from torch indexing's (bits). With
    `shard`, both pools are the middle heads of wider ones (strided views)."""
    from appliance.kv import handoff

    layers, src_blocks, dst_blocks, block_size, heads, dim, count = SHAPES[shape]
    wide = heads + 2 if shard else heads
    src = _pool(layers, src_blocks, block_size, wide, dim, dtype)
    dst = _pool(layers, dst_blocks, block_size, wide, dim, dtype)
    if shard:
        src, dst = src[..., 1 : 1 + heads, :], dst[..., 1 : 1 + heads, :]
    generator = torch.Generator().manual_seed(src_blocks * 31 + count)
    src_ids, dst_ids = _ids(count, src_blocks, generator), _ids(count, dst_blocks, generator)
    expected = dst.clone()
    expected[:, :, dst_ids] = src[:, :, src_ids]
    moved = handoff.copy_blocks(src, src_ids, dst, dst_ids, kernel="triton")
    assert moved == count * 2 * layers * block_size * heads * dim * src.element_size()
    bits = {2: torch.int16, 4: torch.int32}[src.element_size()]
    return int((dst.contiguous().view(bits) != expected.contiguous().view(bits)).sum())


def _handoff_launches(kernel: str) -> dict[str, int]:
    """Launches copying a scattered 4k-token handoff (ids 1, 3, 5, ... into 2, 4, 6, ...)."""
    from appliance.kv import handoff
    from appliance.model.layers import triton_kv_copy

    src = _pool(2, 2 * HANDOFF_BLOCKS + 1, BLOCK_SIZE, 1, 8, "bfloat16")
    dst = torch.zeros_like(src)
    src_ids = [2 * i + 1 for i in range(HANDOFF_BLOCKS)]
    dst_ids = [2 * i + 2 for i in range(HANDOFF_BLOCKS)]
    counter = LaunchCounter()
    name = "_kv_block_copy_kernel"
    kernel_fn = getattr(triton_kv_copy, name)
    setattr(triton_kv_copy, name, counter.wrap(f"triton.{name}", kernel_fn))
    try:
        with counter:
            handoff.copy_blocks(src, src_ids, dst, dst_ids, kernel=kernel)
    finally:
        setattr(triton_kv_copy, name, kernel_fn)
    if not torch.equal(dst[:, :, dst_ids], src[:, :, src_ids]):
        raise AssertionError(f"{kernel}: the blocks did not land")
    return dict(counter.launches)


CASES = [(shape, dtype) for shape in SHAPES for dtype in DTYPES]


def _child() -> dict[str, object]:
    torch.manual_seed(0)
    jobs: dict[str, Callable[[], object]] = {}
    for shape, dtype in CASES:
        jobs[f"{shape}_{dtype}"] = partial(_mismatches, shape, dtype, False)
    jobs["shard_bfloat16"] = partial(_mismatches, "odd", "bfloat16", True)
    jobs["launches_runs"] = partial(_handoff_launches, "runs")
    jobs["launches_triton"] = partial(_handoff_launches, "triton")
    return run_jobs(jobs)


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    return child_results(__file__)


@pytest.mark.parametrize(("shape", "dtype"), CASES, ids=[f"{s}-{d}" for s, d in CASES])
def test_blocks_land_as_torch_indexing_puts_them(results: dict, shape: str, dtype: str) -> None:
    assert results[f"{shape}_{dtype}"] == 0


def test_a_shards_slice_of_the_heads_copies_through_its_strides(results: dict) -> None:
    assert results["shard_bfloat16"] == 0


def test_a_scattered_4k_token_handoff_is_one_launch(results: dict) -> None:
    before, after = results["launches_runs"], results["launches_triton"]
    assert isinstance(before, dict) and isinstance(after, dict), (before, after)
    # Before: a strided copy_ per block (no two ids consecutive), all layers at once.
    assert before == {"torch.copy_": HANDOFF_BLOCKS}
    # After: the one kernel launch, the ids' upload at most besides.
    assert after.pop("triton._kv_block_copy_kernel") == 1
    assert sum(after.values()) <= 1, after


def test_the_cpu_keeps_its_strided_copies() -> None:
    from appliance.kv import handoff

    pool = torch.zeros(1, 2, 4, 2, 1, 8)
    assert handoff.copy_kernel(pool, pool.clone()) == "runs"


def test_pools_of_two_layouts_are_refused() -> None:
    from appliance.model.layers import triton_kv_copy

    src, dst = torch.zeros(1, 2, 4, 2, 1, 8), torch.zeros(1, 2, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="differ in layout"):
        triton_kv_copy.copy_blocks(src, [0], dst, [0])
    with pytest.raises(ValueError, match="into"):
        triton_kv_copy.copy_blocks(src, [0, 1], src.clone(), [0])


if __name__ == "__main__":
    # The child: TRITON_INTERPRET must be in the environment before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    print(json.dumps(_child()))
