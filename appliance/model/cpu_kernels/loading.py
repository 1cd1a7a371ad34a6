"""Which compiled kernel module serves this process: loading the build of each
instruction-set level (setup.py builds `appliance.model._cpu_kernels_<level>`), choosing
the highest one this CPU runs, and the facts every call passes along (element type codes,
thread count).

Every kernel call looks the module up through compiled() at call time, never keeping its
own reference: select() can change it, and tests and benchmarks/llama_cpp_bench.py
replace `_cpu_kernels` here (with None, a spy or a timing wrapper) and expect every call
to see the replacement.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

import torch

ABI = 9  # module.c's ABI: the argument lists these calls pass
LEVELS = ("generic", "avx2", "avx512")  # lowest first; setup.py builds each
# The CPU features each level's build was compiled for (setup.py's flags).
_NEEDS = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"}
    ),
}
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # element types, as csrc/vec.h numbers them
OUT_DTYPES = {**DTYPES, torch.float64: 2}
GEMM_TYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int16": torch.int16}


class _Kernels(Protocol):
    """A compiled module's calls (csrc/module.c at ABI 9): tensors go as their addresses,
    each call returns None or raises."""

    ABI: int
    LEVEL: str

    def cpu_features(self) -> list[str]: ...

    def paged_decode(
        self, q: int, k: int, v: int, tables: int, lens: int, out: int, n: int, heads: int,
        kv_heads: int, head_dim: int, blocks: int, block_size: int, table_width: int,
        q_row_stride: int, window: int, scale: float, dtype: int, threads: int, /,
    ) -> None: ...  # fmt: skip

    def add_rms_norm(
        self, x: int, weight: int, residual: int, out: int, rows: int, dim: int, eps: float,
        dtype: int, threads: int, /,
    ) -> None: ...  # fmt: skip

    def rope_store(
        self, qkv: int, cos: int, sin: int, slots: int, k: int, v: int, tokens: int,
        heads: int, kv_heads: int, head_dim: int, cache_slots: int, dtype: int, threads: int, /,
    ) -> None: ...  # fmt: skip

    def silu_mul(
        self, gate_up: int, rows: int, intermediate: int, dtype: int, threads: int, /
    ) -> None: ...

    def quant_matmul(
        self, x: int, w: int, bias: int, out: int, m: int, n: int, k: int, row_bytes: int,
        x_row_stride: int, out_row_stride: int, span: int, format: int, dtype: int,
        out_dtype: int, threads: int, precise: int, /,
    ) -> None: ...  # fmt: skip

    def quant_gemm(
        self, x: int, w: int, bias: int, out: int, m: int, n: int, k: int, row_bytes: int,
        x_row_stride: int, out_row_stride: int, format: int, threads: int, /,
    ) -> None: ...  # fmt: skip

    def quant_rows(
        self, w: int, rows: int, out: int, count: int, total_rows: int, k: int,
        row_bytes: int, format: int, dtype: int, threads: int, /,
    ) -> None: ...  # fmt: skip

    def decode_step(
        self, layers: int, num_layers: int, residual: int, out: int, kv: int, final_norm: int,
        cos: int, sin: int, slots: int, tables: int, lens: int, n: int, hidden: int,
        heads: int, kv_heads: int, head_dim: int, intermediate: int, blocks: int,
        block_size: int, table_width: int, window: int, eps: float, scale: float,
        dtype: int, threads: int, precise: int, /,
    ) -> None: ...  # fmt: skip


def _import(level: str) -> _Kernels | None:
    """The compiled module of `level`, or None when it was not built from these sources
    (no C compiler, another architecture, or ./install.sh not re-run after a pull)."""
    try:
        module = importlib.import_module(f"appliance.model._cpu_kernels_{level}")
    except ImportError:
        return None
    # A module of this ABI has _Kernels' calls (ModuleType passes as one: no stubs check it).
    return module if getattr(module, "ABI", None) == ABI else None


def cpu_levels() -> list[str]:
    """The built levels this CPU can run, lowest first (the generic build finds out which:
    it runs everywhere)."""
    generic = _import("generic")
    if generic is None:
        return []
    features = set(generic.cpu_features())
    return [level for level in LEVELS if _NEEDS[level] <= features and _import(level)]


def select(cap: str = "auto") -> str | None:
    """Load the highest built level this CPU runs, at most `cap` ('auto': no cap); returns
    it, or None when no kernels are built (the torch ops then serve)."""
    global _cpu_kernels  # one choice per process: see the package doc
    if cap != "auto" and cap not in LEVELS:
        raise ValueError(f"cpu_isa {cap!r} is not one of auto, {', '.join(LEVELS)}")
    runnable = cpu_levels()
    if cap != "auto":
        runnable = [lv for lv in runnable if LEVELS.index(lv) <= LEVELS.index(cap)]
    _cpu_kernels = _import(runnable[-1]) if runnable else None
    return runnable[-1] if runnable else None


def compiled() -> _Kernels | None:
    """The module serving now, or None when no kernels are loaded: the one place every
    call reads it from (see the module doc)."""
    return _cpu_kernels


def level() -> str | None:
    """The level serving now, or None when no kernels are loaded."""
    kernels = compiled()
    return None if kernels is None else kernels.LEVEL


def prefill_gemm_dtype(choice: str = "auto") -> torch.dtype:
    """The type a prompt's product run as a GEMM (prefill_gemm_rows()) multiplies in (the
    `prefill_gemm` setting; torch.int16: the integer GEMM, csrc/quant_gemm.c). 'auto'
    takes the fastest this CPU runs natively: bfloat16 where the avx512 kernels serve and
    the CPU has AVX512-BF16 (torch's bfloat16 GEMM ran 4.5x its float32 one on a Zen 4),
    int16 at the avx2 and avx512 levels otherwise (1.45-1.7x float32's GEMM on AVX2),
    float32 at the generic level or without kernels."""
    if choice in GEMM_TYPES:
        return GEMM_TYPES[choice]
    if choice != "auto":
        raise ValueError(f"prefill_gemm {choice!r} is not one of auto, {', '.join(GEMM_TYPES)}")
    kernels = compiled()
    if kernels is None or kernels.LEVEL == "generic":
        return torch.float32
    if kernels.LEVEL == "avx512" and "avx512bf16" in kernels.cpu_features():
        return torch.bfloat16
    if threads() < torch.get_num_threads():
        return torch.float32  # the int16 GEMM on one thread would lose to torch's on all
    return torch.int16


# From how many prompt rows a quantized product runs as a GEMM (quant_products.GEMM_ROWS),
# per kernel level and GEMM type: the fewest rows from which the GEMM, dequantizing
# included, was faster than the integer kernel (benchmarks/gemm_rows_bench.py: one thread,
# SmolLM2-135M's gate/up shape in Q4_0, and whole prefills of the embedded model; medians).
# A table, not a timing at start: a worker's numbers must not depend on how busy the box
# was when it started. Measured on an Intel Xeon with AMX and AVX512-BF16 (2 cores, under
# load; each level by capping cpu_isa there): at avx512 the bfloat16 GEMM was even at 40
# rows and 1.2x ahead at 48 (whole prefills: 0.9x at 32, 1.2x at 48), int16 even at 32,
# float32 ahead from 48 (a Zen 4's float32: about 64). At avx2 int16 was even at 16, 1.3x
# ahead at 24; float32 even at 40. bfloat16 at avx2 (only when asked: auto takes int16
# there) ran on this CPU's AMX; an AVX2-only CPU emulates it, and would switch later. The
# generic level's integer kernel is plain C: the GEMM was even at 1-4 rows, 1.8x ahead at 6.
GEMM_ROWS_BY_LEVEL: Mapping[tuple[str, torch.dtype], int] = MappingProxyType(
    {
        ("avx512", torch.bfloat16): 48,
        ("avx512", torch.int16): 32,
        ("avx512", torch.float32): 48,
        ("avx2", torch.bfloat16): 40,
        ("avx2", torch.int16): 24,
        ("avx2", torch.float32): 40,
        ("generic", torch.float32): 6,
        ("generic", torch.bfloat16): 6,
        ("generic", torch.int16): 6,  # the generic level's int16 choice runs float32's GEMM
    }
)
DEFAULT_GEMM_ROWS = 128  # a level or type the table lacks: the count used before it


def prefill_gemm_rows(choice: int | str = "auto", dtype: torch.dtype | None = None) -> int:
    """From how many prompt rows a step's quantized products run as a GEMM (the
    `prefill_gemm_rows` setting): a count as given, or 'auto': GEMM_ROWS_BY_LEVEL's entry
    for the level serving now and `dtype`, the GEMM's type (default: prefill_gemm_dtype()'s
    auto choice)."""
    if isinstance(choice, int) and not isinstance(choice, bool):
        if choice < 1:
            raise ValueError(f"prefill_gemm_rows {choice} must be at least 1")
        return choice
    if choice != "auto":
        raise ValueError(f"prefill_gemm_rows {choice!r} is not auto or a row count")
    serving = level()
    gemm = prefill_gemm_dtype() if dtype is None else dtype
    if serving is None:
        return DEFAULT_GEMM_ROWS  # no kernels: no quantized products to switch
    return GEMM_ROWS_BY_LEVEL.get((serving, gemm), DEFAULT_GEMM_ROWS)


def available() -> bool:
    """Whether the kernels were built, from these sources, for this install."""
    return compiled() is not None


_cpu_kernels: _Kernels | None = None
select()


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            return {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return set()


# The kernels are linked to libgomp.so.1 and find torch's, already loaded under that
# name. A torch build whose runtime is renamed would give them a second thread pool
# competing with torch's for the same cores: then they keep to one thread.
_SHARES_TORCHS_THREADS = _cpu_kernels is None or len(_openmp_runtimes()) <= 1


def threads() -> int:
    """The thread count a kernel call passes: torch's, where they share one pool."""
    return torch.get_num_threads() if _SHARES_TORCHS_THREADS else 1
