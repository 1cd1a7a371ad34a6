"""The compiled CPU kernels (csrc/): matrix products with block-quantized weights read in
place, decode attention read in place from the paged cache, the residual add fused with
the RMSNorm after it, the rotary embedding fused with storing the step's keys and
values, and a whole decode step's layers in one call (decode_step()).

Each replaces torch ops that either read far more bytes (dense float weights) or whose
fixed costs dominate on the CPU at decode sizes: SDPA spends microseconds of set-up per
(sequence, KV head) on top of a gather of the padded context; an add and a norm, or a
rotation and two cache writes, are half a dozen passes and dispatches per layer
(benchmarks/cpu_kernels_bench.py, benchmarks/engine_bench.py). `pip install` builds them
(setup.py) once per instruction-set level; `select()` loads the best level this CPU runs,
capped by the `cpu_isa` setting. Where they were not built, or for other devices, dtypes
and shapes, the model runs torch ops instead: `*_takes()` says which.

Which compiled module serves is one choice per process, like torch's thread count: the
worker makes it once at start (`select(settings.cpu_isa)`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

ABI = 8  # module.c's ABI: the argument lists these calls pass
LEVELS = ("generic", "avx2", "avx512")  # lowest first; setup.py builds each
# The CPU features each level's build was compiled for (setup.py's flags).
_NEEDS = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"}
    ),
}


class _Kernels(Protocol):
    """A compiled module's calls (csrc/module.c at ABI 8): tensors go as their addresses,
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
    global _cpu_kernels  # one choice per process: see the module doc
    if cap != "auto" and cap not in LEVELS:
        raise ValueError(f"cpu_isa {cap!r} is not one of auto, {', '.join(LEVELS)}")
    runnable = cpu_levels()
    if cap != "auto":
        runnable = [lv for lv in runnable if LEVELS.index(lv) <= LEVELS.index(cap)]
    _cpu_kernels = _import(runnable[-1]) if runnable else None
    return runnable[-1] if runnable else None


def level() -> str | None:
    """The level serving now, or None when no kernels are loaded."""
    return None if _cpu_kernels is None else _cpu_kernels.LEVEL


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


def available() -> bool:
    """Whether the kernels were built, from these sources, for this install."""
    return _cpu_kernels is not None


def _threads() -> int:
    return torch.get_num_threads() if _SHARES_TORCHS_THREADS else 1


_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_OUT_DTYPES = {**_DTYPES, torch.float64: 2}
HEAD_SIZES = (64, 128)  # decode attention is compiled for these (unrolled into registers)
MAX_GROUP = 64  # query heads per KV head that decode attention takes (paged_decode.c)


def decodes_ragged(device: torch.device, dtype: torch.dtype, head_dim: int, group: int = 1) -> bool:
    """Whether decode attention on this device, dtype, head size and number of query
    heads per KV head runs on the kernel, which takes sequences of any mix of context
    lengths in one call (SDPA pads them all to the longest, so the model runner first
    groups them by length)."""
    return (
        _cpu_kernels is not None
        and device.type == "cpu"
        and dtype in _DTYPES
        and head_dim in HEAD_SIZES
        and 1 <= group <= MAX_GROUP
    )


def _decode_problem(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """Why paged_decode() cannot take these tensors, or "" when it can."""
    if q.dim() != 3 or k_cache.dim() != 4:
        return "q must be [n, heads, head_dim] and the caches [blocks, block, kv_heads, dim]"
    if not decodes_ragged(q.device, q.dtype, q.shape[2]):
        return "the kernel runs float32 or bfloat16 CPU tensors of head size 64 or 128"
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    grouped = kv_heads >= 1 and heads % kv_heads == 0 and 1 <= heads // kv_heads <= MAX_GROUP
    if k_cache.shape[3] != head_dim or not grouped:
        return (
            f"{heads} query heads of {head_dim} do not fit a cache of {kv_heads} KV heads "
            f"of {k_cache.shape[3]}"
        )
    if any(
        c.shape != k_cache.shape or c.dtype != q.dtype or c.device != q.device
        for c in (k_cache, v_cache)
    ):
        return "the key and value caches must match each other and the queries' dtype"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "the caches must be contiguous"
    if q.stride(1) != head_dim or q.stride(2) != 1:
        return "each query row's heads must be contiguous"
    return ""


def decode_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether paged_decode() can run this decode: CPU tensors of one dtype and head size
    it knows, the caches contiguous and each query row's heads contiguous."""
    return not _decode_problem(q, k_cache, v_cache)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    checked: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """q [n, heads, head_dim] (one token per sequence); caches [blocks, block_size,
    kv_heads, head_dim]; block_tables [n, width] and context_lens [n] int64 -> [n, heads,
    head_dim]. Each query attends to its sequence's first context_lens[i] cached tokens,
    or the last `window` of them (a sliding window).
    The kernel checks each context and block id it reads through against the cache.
    `checked`: decode_takes() said yes to q and the caches."""
    problem = "" if checked else _decode_problem(q, k_cache, v_cache)
    if problem:
        raise ValueError(problem)
    n, heads, head_dim = q.shape
    blocks, block_size, kv_heads, _ = k_cache.shape
    for name, t, dims in (("block tables", block_tables, 2), ("context lengths", context_lens, 1)):
        if t.dtype != torch.int64 or t.device.type != "cpu" or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D int64 CPU tensor")
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    if tables.shape[0] != n or lens.shape[0] != n:
        raise ValueError(f"{n} queries need {n} block tables and context lengths")
    out = torch.empty(n, heads, head_dim, dtype=q.dtype, device=q.device)
    assert _cpu_kernels is not None  # decode_takes() found them loaded
    _cpu_kernels.paged_decode(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        n,
        heads,
        kv_heads,
        head_dim,
        blocks,
        block_size,
        tables.shape[1],
        q.stride(0),
        window or 0,
        scale,
        _DTYPES[q.dtype],
        _threads(),
    )
    return out


def _norm_problem(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor) -> str:
    """Why add_rms_norm() cannot take these tensors, or "" when it can."""
    if _cpu_kernels is None or residual.device.type != "cpu" or residual.dtype not in _DTYPES:
        return "the kernel runs float32 or bfloat16 CPU tensors"
    if residual.dim() != 2 or residual.shape[1] == 0 or residual.shape[1] % 16:
        return f"rows {tuple(residual.shape)} are not [rows, a multiple of 16]"
    if not residual.is_contiguous():
        return "the residual must be contiguous: it is updated in place"
    if weight.shape != residual.shape[1:] or weight.dtype != residual.dtype:
        return f"norm weight {tuple(weight.shape)} does not fit rows of {residual.shape[1]}"
    if x is not None and (x.shape != residual.shape or x.dtype != residual.dtype):
        return f"cannot add {tuple(x.shape)} to a residual {tuple(residual.shape)}"
    if any(t is not None and t.device != residual.device for t in (x, weight)):
        return "the addend and the weight must be on the residual's device"
    return ""


def norm_takes(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether add_rms_norm() can run on these."""
    return not _norm_problem(x, residual, weight)


def add_rms_norm(
    x: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    checked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place; x None adds nothing), then (rms_norm(residual) * weight,
    residual). Both [rows, dim], weight [dim], one dtype. `checked`: norm_takes() said
    yes to these tensors, so they are not checked again (a decode step's hot path)."""
    problem = "" if checked else _norm_problem(x, residual, weight)
    if problem:
        raise ValueError(problem)
    x = None if x is None else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(residual)
    assert _cpu_kernels is not None  # norm_takes() found them loaded
    _cpu_kernels.add_rms_norm(
        0 if x is None else x.data_ptr(),
        weight.data_ptr(),
        residual.data_ptr(),
        out.data_ptr(),
        residual.shape[0],
        residual.shape[1],
        eps,
        _DTYPES[residual.dtype],
        _threads(),
    )
    return out, residual


def _rope_problem(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> str:
    """Why rope_store() cannot take these tensors, or "" when it can."""
    if _cpu_kernels is None or qkv.device.type != "cpu" or qkv.dtype not in _DTYPES:
        return "the kernel runs float32 or bfloat16 CPU tensors"
    if qkv.dim() != 3 or k_cache.dim() != 4 or qkv.shape[2] % 32:
        return "qkv must be [tokens, heads, head_dim], head_dim a multiple of 32"
    tokens, _, head_dim = qkv.shape
    if k_cache.shape[3] != head_dim or qkv.shape[1] < 2 * k_cache.shape[2]:
        return f"qkv {tuple(qkv.shape)} does not fit a cache of {tuple(k_cache.shape)}"
    tensors = (qkv, cos, sin, k_cache, v_cache)
    if any(
        t.dtype != qkv.dtype or t.device != qkv.device or not t.is_contiguous() for t in tensors
    ):
        return "qkv, cos, sin and the caches must be contiguous, of one dtype and device"
    if v_cache.shape != k_cache.shape or cos.shape != sin.shape:
        return "the caches, and cos and sin, must match each other"
    if cos.numel() != tokens * head_dim // 2:
        return f"cos and sin {tuple(cos.shape)} are not [tokens, head_dim / 2]"
    if slots.dtype != torch.int64 or slots.device.type != "cpu" or slots.shape != (tokens,):
        return "slots must be [tokens] int64 on the CPU"
    return ""


def rope_store_takes(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """Whether rope_store() can run on these."""
    return not _rope_problem(qkv, cos, sin, slots, k_cache, v_cache)


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    checked: bool = False,
) -> None:
    """Rotates the `heads` query heads and the key heads of qkv [tokens, heads + 2 *
    kv_heads, head_dim] in place (rotate-half layout, cos/sin [tokens, ..., head_dim /
    2]), then stores each token's key and value heads in cache slot slots[t] (block *
    block_size + offset) of the caches [blocks, block_size, kv_heads, head_dim]. The
    kernel checks every slot against the cache. `checked`: rope_store_takes() said yes."""
    problem = "" if checked else _rope_problem(qkv, cos, sin, slots, k_cache, v_cache)
    if problem:
        raise ValueError(problem)
    kv_heads = k_cache.shape[2]
    if qkv.shape[1] != heads + 2 * kv_heads:
        raise ValueError(f"qkv has {qkv.shape[1]} heads, not {heads} + 2 x {kv_heads}")
    assert _cpu_kernels is not None  # rope_store_takes() found them loaded
    _cpu_kernels.rope_store(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        qkv.shape[0],
        heads,
        kv_heads,
        qkv.shape[2],
        k_cache.shape[0] * k_cache.shape[1],
        _DTYPES[qkv.dtype],
        _threads(),
    )


def silu_takes(gate_up: torch.Tensor) -> bool:
    """Whether silu_mul() can take `gate_up`: contiguous float32 or bfloat16 CPU rows
    whose halves are a multiple of 16 wide."""
    return (
        _cpu_kernels is not None
        and gate_up.device.type == "cpu"
        and gate_up.dtype in _DTYPES
        and gate_up.dim() == 2
        and gate_up.is_contiguous()
        and gate_up.shape[1] % 32 == 0
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * inter] -> silu(gate) * up [rows, inter], computed in place into
    its first half (returned as a view; csrc/silu_mul.c), as the compiled step does."""
    if not silu_takes(gate_up):
        raise ValueError("gate_up must be contiguous [rows, 2 * inter] float32 or bfloat16 "
                         "CPU rows, inter a multiple of 16")  # fmt: skip
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert _cpu_kernels is not None  # silu_takes() found them loaded
    _cpu_kernels.silu_mul(gate_up.data_ptr(), rows, inter, _DTYPES[gate_up.dtype], _threads())
    return gate_up[:, :inter]


def quant_takes(x: torch.Tensor) -> bool:
    """Whether quant_matmul() can take activations `x` [rows, in]: float32 or bfloat16 CPU
    rows whose values are contiguous."""
    return (
        _cpu_kernels is not None
        and x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() == 2
        and x.stride(1) == 1
    )


GEMM_ROWS = 128
"""From this many float32 activation rows (a prefill chunk) a product dequantizes the
weight and runs torch's GEMM: the integer kernel's work grows with the rows, a float GEMM
blocked for the caches overtakes it, dequantizing included, at about 64 rows (1.5x at 512
on a Zen 4). Below it, and for every decode step, the integer kernel reads the blocks in
place, and a row's result does not depend on what it is batched with."""


class QuantMatrix:
    """A block-quantized weight W [out_features, in] (`blocks` [out_features, row bytes]
    uint8 in GGML format `format_id`, one row of blocks per output feature) and its
    optional float32 `bias`, checked once: a product then checks only its activations,
    which a decode step multiplies a hundred times.

    A product sums each output over `span` inputs at a time in float32 (default: all of
    them) and those sums in float64. A row-parallel projection takes the span its
    tensor-parallel splits fall on: a shard then computes the same span sums, and with
    `partial` returns their float64 total for the group's all-reduce, which rounds to what
    the whole product gives (float32 totals of a few float32 sums are exact in float64)."""

    def __init__(
        self,
        blocks: torch.Tensor,
        format_id: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        span: int | None = None,
        partial: bool = False,
    ) -> None:
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
            raise ValueError("the weight's blocks must be a contiguous 2-D uint8 tensor")
        n = blocks.shape[0]
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)):
            raise ValueError(f"bias must be [{n}] float32")
        span = in_features if span is None else span
        if span < 1 or in_features % span:
            raise ValueError(f"span {span} does not divide the {in_features} inputs")
        if partial and bias is not None:
            raise ValueError("a partial product (a row-parallel shard's) takes no bias")
        self.blocks = blocks
        self.bias = None if bias is None else bias.contiguous()
        self.format_id = format_id
        self.in_features = in_features
        self.out_features = n
        self.span = span
        self.partial = partial

    def __call__(
        self, x: torch.Tensor, out: torch.Tensor | None = None, precise: bool = True
    ) -> torch.Tensor:
        """x [rows, in] @ W.T (+ bias) -> [rows, out_features] in x's dtype (float64 when
        `partial`). `out` may be a column slice of a wider tensor (rows apart by its
        stride). `precise` carries the activations as two int8 parts (about 16 bits; see
        csrc/quant_matmul.c), else one (llama.cpp's 8). The kernel checks the format,
        sizes, span and strides."""
        if not quant_takes(x):
            raise ValueError("x must be [rows, in] float32 or bfloat16 on the CPU, rows contiguous")
        if x.shape[1] != self.in_features:
            raise ValueError(f"x has {x.shape[1]} features, the weight takes {self.in_features}")
        rows, n = x.shape[0], self.out_features
        out_dtype = torch.float64 if self.partial else x.dtype
        if out is not None and (
            out.shape != (rows, n) or out.dtype != out_dtype or out.stride(1) != 1
        ):
            raise ValueError(f"out must be [{rows}, {n}] {out_dtype}, rows contiguous")
        if rows >= GEMM_ROWS and x.dtype == torch.float32:
            return self._by_gemm(x, out)
        if out is None:
            out = torch.empty(rows, n, dtype=out_dtype)
        assert _cpu_kernels is not None  # quant_takes() found them loaded
        _cpu_kernels.quant_matmul(
            x.data_ptr(),
            self.blocks.data_ptr(),
            0 if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            self.in_features,
            self.blocks.shape[1],
            x.stride(0),
            out.stride(0),
            self.span,
            self.format_id,
            _DTYPES[x.dtype],
            _OUT_DTYPES[out_dtype],
            _threads(),
            int(precise),
        )
        return out

    def _by_gemm(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The product as torch's float32 GEMM with the weight dequantized for it, a GEMM
        a span (each span's inputs contiguous, as a shard's are)."""
        every_row = torch.arange(self.out_features)
        weight = quant_rows(self.blocks, self.format_id, self.in_features, every_row)
        if self.span == self.in_features and not self.partial:
            if self.bias is None:
                result = torch.mm(x, weight.t())
            else:
                result = torch.addmm(self.bias, x, weight.t())
            return result if out is None else out.copy_(result)
        total = torch.zeros(x.shape[0], self.out_features, dtype=torch.float64)
        for start in range(0, self.in_features, self.span):
            part = slice(start, start + self.span)
            total += torch.mm(x[:, part].contiguous(), weight[:, part].contiguous().t())
        if not self.partial:
            total = total.float()
            if self.bias is not None:
                total += self.bias
        return total if out is None else out.copy_(total)


def quant_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    format_id: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    precise: bool = True,
    span: int | None = None,
    partial: bool = False,
) -> torch.Tensor:
    """One product by a weight not kept (QuantMatrix's __init__ and __call__ in one)."""
    return QuantMatrix(blocks, format_id, in_features, bias, span, partial)(x, out, precise)


def quant_rows(
    blocks: torch.Tensor,
    format_id: int,
    in_features: int,
    rows: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows `rows` (int64 ids) of a block-quantized weight, dequantized: [len(rows), in]."""
    if _cpu_kernels is None or dtype not in _DTYPES:
        raise ValueError("dequantizing rows needs the kernels and float32 or bfloat16")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError("the weight's blocks must be a contiguous 2-D uint8 tensor")
    rows = rows.to(torch.int64).contiguous().view(-1)
    out = torch.empty(rows.shape[0], in_features, dtype=dtype)
    _cpu_kernels.quant_rows(
        blocks.data_ptr(),
        rows.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        blocks.shape[0],
        in_features,
        blocks.shape[1],
        format_id,
        _DTYPES[dtype],
        _threads(),
    )
    return out


LAYER_FIELDS = 28  # kernels.h's DECODE_LAYER_FIELDS


@dataclass
class StepShape:
    """The sizes of a model that decode_step() runs: per layer `heads` query heads and
    `kv_heads` KV heads of `head_dim`, an MLP of `intermediate` columns; attention within
    the last `window` tokens (0: all)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float
    window: int = 0


def decode_step(
    layers: torch.Tensor,
    shape: StepShape,
    residual: torch.Tensor,
    final_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    kv_cache: torch.Tensor,
    precise: bool = True,
) -> torch.Tensor:
    """A decode step's decoder layers and final norm in one call (csrc/decode_step.c):
    residual [n, hidden] (the embeddings; left holding the residual stream) -> the final
    norm [n, hidden]. `layers` [num_layers, 28] int64 addresses and sizes of each layer's
    norms and block-quantized projections (kernels.h says which); cos, sin [n, 1,
    head_dim / 2]; slots [n], tables [n, width], lens [n] int64; kv_cache [layers, 2,
    blocks, block_size, kv_heads, head_dim]. The kernel checks sizes, slots, block ids
    and the projections' formats; the caller keeps what `layers` points to alive."""
    dtype, n = residual.dtype, residual.shape[0]
    if _cpu_kernels is None or dtype not in _DTYPES or residual.device.type != "cpu":
        raise ValueError("the decode step runs float32 or bfloat16 CPU tensors, compiled")
    if (
        layers.dtype != torch.int64
        or layers.dim() != 2
        or not layers.is_contiguous()
        or (layers.shape[1] != LAYER_FIELDS)
    ):
        raise ValueError(f"layers must be a contiguous [layers, {LAYER_FIELDS}] int64 tensor")
    if residual.shape != (n, shape.hidden) or final_norm.shape != (shape.hidden,):
        raise ValueError(
            f"residual must be [n, {shape.hidden}] and the final norm [{shape.hidden}]"
        )
    blocks, block_size = kv_cache.shape[2:4] if kv_cache.dim() == 6 else (0, 0)
    cache = (len(layers), 2, blocks, block_size, shape.kv_heads, shape.head_dim)
    if tuple(kv_cache.shape) != cache:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not fit the model's layers")
    floats = (residual, final_norm, cos, sin, kv_cache)
    if any(t.dtype != dtype or not t.is_contiguous() for t in floats):
        raise ValueError("residual, norms, cos, sin and the cache must be contiguous, one dtype")
    if cos.numel() != n * shape.head_dim // 2 or sin.shape != cos.shape:
        raise ValueError("cos and sin must be [n, 1, head_dim / 2]")
    ints = (slots, tables, lens)
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in ints):
        raise ValueError("slots, tables and lens must be contiguous int64")
    if slots.shape != (n,) or lens.shape != (n,) or tables.dim() != 2 or tables.shape[0] != n:
        raise ValueError("slots and lens must be [n], tables [n, width]")
    out = torch.empty_like(residual)
    _cpu_kernels.decode_step(
        layers.data_ptr(),
        len(layers),
        residual.data_ptr(),
        out.data_ptr(),
        kv_cache.data_ptr(),
        final_norm.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        n,
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.intermediate,
        blocks,
        block_size,
        tables.shape[1],
        shape.window,
        shape.eps,
        shape.scale,
        _DTYPES[dtype],
        _threads(),
        int(precise),
    )
    return out
