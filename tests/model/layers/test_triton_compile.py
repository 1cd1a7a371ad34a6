"""The Triton kernels (paged attention, quantized products, the KV copy) compiled for
GPUs that CI does not have: sm_90a (H100/H200), sm_80 (A100), sm_86 and sm_89 (RTX
30xx/40xx, A10, L4), on the CPU with Triton's bundled ptxas, no GPU or driver. Each
variant is a specialization the default configurations launch (triton_attention's
kernel_launches, triton_quant's and triton_kv_copy's launches, on tensors of the family's
shape: the same constexprs, warps and stages as on the GPU), compiled by
benchmarks/triton_compile_table.py's own functions, so its table and these tests count
the same thing. A test fails on a compile error, on ptxas spilling more than the
benchmark's SPILL_BUDGET bytes a thread, or on more shared memory than the architecture
gives a block (the launch would fail there with OutOfResources).

The quick lane compiles the default configurations' launches (QUICK: decode, prefill,
a verify step, a decode split over the context and its reduce, the quantized GEMV of each
format and a GEMM, the handoff's KV block copy) for sm_90a (a few
seconds on a quiet machine), the slow lane (`process`) the same for sm_80, sm_86 and
sm_89; the full matrix, every variant for every architecture (a few minutes), is the
benchmark's: `benchmarks/triton_compile_table.py` exits 1 on any cell that fails.
Under Triton 3.6, the GPU image's version:
`PYTHONPATH=~/.cache/appliance-triton36 .venv/bin/python -m pytest <this file>` after
`benchmarks/triton_compile_table.py --triton36` made that overlay (docs/gpu.md).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from appliance.model.layers.triton_attention import Tiles

ROOT = Path(__file__).resolve().parents[3]


def bench_module() -> ModuleType:
    path = ROOT / "benchmarks/triton_compile_table.py"
    spec = importlib.util.spec_from_file_location("triton_compile_table", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


BENCH = bench_module()


def check(result: Any) -> None:
    """Fail with the figures of a compiled variant (the bench's Compiled) if it spills
    or takes more shared memory than its architecture has."""
    figures = (
        f"{result.variant.name} on {result.arch}: {result.registers} registers, "
        f"{result.spill_stores} B spill stores, {result.shared} B shared"
    )
    assert result.spill_stores <= BENCH.SPILL_BUDGET, figures
    assert result.spill_loads <= BENCH.SPILL_BUDGET, figures
    assert result.shared <= BENCH.SHARED_LIMIT[result.arch], figures
    assert 0 < result.registers <= 255, figures


@pytest.mark.parametrize("name", BENCH.QUICK)
def test_quick_subset_compiles_for_hopper_without_spills(name: str) -> None:
    check(BENCH.compile_variant(BENCH.variant(name), "sm_90a"))


@pytest.mark.process  # the slow lane: one compile that spills, ~5 s of ptxas
def test_the_check_fails_on_the_old_float32_prefill_tiles() -> None:
    # The tiles float32 prefill had before (64 rows, 64 keys, 4 warps, 3 stages): ptxas
    # spilled ~29 KB a thread at head 128 on sm_90a. The same check must refuse them.
    old = Tiles(rows=64, block_n=64, num_warps=4, num_stages=3)
    result = BENCH.compile_variant(BENCH.variant("llama3-8b fp32 prefill"), "sm_90a", old)
    assert result.spill_stores > 1000
    with pytest.raises(AssertionError, match="spill stores"):
        check(result)


def test_variants_cover_every_launch_rule() -> None:
    # Every (dtype, phase) the tile rule tells apart, every padded head size a family
    # has, windows and sinks: the matrix below compiles each.
    variants = BENCH.VARIANTS
    assert {(v.dtype, v.prefill) for v in variants} == {
        (dtype, prefill)
        for dtype in ("bfloat16", "float16", "float32")
        for prefill in (False, True)
    }
    assert {v.head_dim for v in variants} >= {64, 96, 128, 256}
    assert any(v.window and v.sinks for v in variants)
    assert set(BENCH.QUICK) <= {v.name for v in variants}
    # The decode side's other launches (a verify step, a split decode and its reduce),
    # in every dtype, and in the quick lane.
    assert {(v.dtype, v.launch) for v in variants} >= {
        (dtype, launch)
        for dtype in ("bfloat16", "float16", "float32")
        for launch in ("verify", "split", "reduce")
    }
    assert {BENCH.variant(name).launch for name in BENCH.QUICK} == {
        "plain",
        "verify",
        "split",
        "reduce",
        "gemv",
        "gemm",
        "kv_copy",
    }
    # The quantized GEMV and GEMM over every block format they take, in every dtype;
    # the GEMV of each format in the quick lane.
    dtypes = ("bfloat16", "float16", "float32")
    gemv_formats = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
    assert {(v.quant, v.dtype) for v in variants if v.launch == "gemv"} == {
        (fmt, dtype) for fmt in gemv_formats for dtype in dtypes
    }
    assert {(v.quant, v.dtype) for v in variants if v.launch == "gemm"} == {
        (fmt, dtype) for fmt in gemv_formats for dtype in dtypes
    }
    assert {BENCH.variant(n).quant for n in BENCH.QUICK if "gemv" in n} == set(gemv_formats)
    # The handoff's copy in both element widths it compiles for (2 and 4 bytes).
    assert {v.dtype for v in variants if v.launch == "kv_copy"} >= {"bfloat16", "float32"}


def test_a_split_launch_is_the_kernel_and_its_reduce() -> None:
    # What the table compiles for a split decode is what attend() launches: the attention
    # kernel writing parts, then the reduce over them.
    split = BENCH.launch_for(BENCH.variant("llama3-8b bf16 split"))
    reduce = BENCH.launch_for(BENCH.variant("llama3-8b bf16 reduce"))
    assert split.options["SPLIT"] and split.grid == (1, 8, 16)
    assert reduce.kernel is not split.kernel and reduce.grid == (32,)
    verify = BENCH.launch_for(BENCH.variant("llama3-8b bf16 verify"))
    assert verify.options["VARLEN"] and not verify.options["SPLIT"]


@pytest.mark.process
@pytest.mark.extended  # the default configurations' launches, every arch (the quick subset
# compiles for Hopper in the suite)
@pytest.mark.parametrize("arch", sorted(set(BENCH.SHARED_LIMIT) - {"sm_90a"}))
@pytest.mark.parametrize("name", BENCH.QUICK)
def test_the_default_launches_compile_for_every_arch_without_spills(name: str, arch: str) -> None:
    check(BENCH.compile_variant(BENCH.variant(name), arch))
