"""The Triton kernels (paged attention, the quantized GEMV and GEMM, the handoff's KV
block copy) compiled for GPUs that are not here: every specialization the default
configurations launch, for sm_90a (Hopper), sm_80 (A100),
sm_86 (RTX 30xx, A10) and sm_89 (RTX 40xx, L4), on the CPU, no GPU or CUDA driver
needed. Prints a markdown table, variants x architectures: registers per thread, shared
memory per program, and ptxas's spill stores and loads (bytes per thread).

    .venv/bin/python benchmarks/triton_compile_table.py            # the full matrix
    .venv/bin/python benchmarks/triton_compile_table.py --quick    # the CI test's subset
    .venv/bin/python benchmarks/triton_compile_table.py --triton36 # under Triton 3.6

A variant is what the launch depends on: dtype, head size (padded to a power of two),
GQA group, decode or prefill, window, sinks; the block size is the default 16. Its
launch comes from triton_attention.kernel_launches on small CPU tensors of the family's
shape, so the constexprs, num_warps and num_stages are those paged_attention passes, and
Triton's own binder turns the arguments into the signature and the divisibility
attributes a launch on the GPU gets (strides that are multiples of 16, aligned pointers).
Registers and spills come from ptxas's -v log of that compile (Triton compiles anew:
a cached kernel runs no ptxas), shared memory from the kernel's metadata.

--triton36 runs this under Triton 3.6, the GPU image's version, with its own ptxas: the
wheel goes into ~/.cache/appliance-triton36 (pip --target, no dependencies, once), which
is put ahead of the venv's site-packages on PYTHONPATH; the venv is never touched. The
same overlay runs the CI test under 3.6:

    PYTHONPATH=~/.cache/appliance-triton36 .venv/bin/python -m pytest \\
        tests/model/layers/test_triton_compile.py
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from appliance.model import quant  # noqa: E402
from appliance.model.layers import triton_attention, triton_kv_copy, triton_quant  # noqa: E402
from appliance.model.layers.triton_splits import H100_SMS, decode_splits  # noqa: E402

ARCHES = {"sm_90a": 90, "sm_80": 80, "sm_86": 86, "sm_89": 89}  # 90 compiles as sm_90a
# Spill bytes a thread allowed: none. Every variant compiles without spills on all four
# architectures under Triton 3.6's and 3.9's ptxas (the table in docs/gpu.md); the
# defects this guards against spilled 8 B to 75 KB (float32 prefill, head 256, head 128
# on Ampere at the 255-register ceiling). A spill of a few words costs little, but any
# spill says the tiles sit at the register limit, where the next change spills more.
SPILL_BUDGET = 0
# Shared memory a block may take (the opt-in maximum, CUDA programming guide, compute
# capabilities table): 227 KiB on sm_90, 163 KiB on sm_80, 99 KiB on sm_86 and sm_89.
SHARED_LIMIT = {"sm_90a": 232448, "sm_80": 166912, "sm_86": 101376, "sm_89": 101376}
BLOCK_SIZE = 16  # the default [kv] block_size
TRITON36 = "3.6.0"  # the GPU image's Triton
TRITON36_DIR = Path.home() / ".cache" / "appliance-triton36"


@dataclass(frozen=True)
class Variant:
    """One specialization of the kernel, named for the configurations that launch it."""

    name: str
    dtype: str  # "bfloat16", "float16", "float32"
    heads: int
    kv_heads: int
    head_dim: int
    prefill: bool  # a chunk of query tokens (else one decode token per sequence)
    window: int | None = None
    sinks: bool = False
    # The decode side's other launches: a verify step (5 query tokens a sequence, varlen,
    # on the decode tiles), a decode split over the context (batch 1 at 8k keys: the
    # rule's 16 parts on an H100), or that split's reduce kernel.
    launch: str = "plain"  # "plain", "verify", "split", "reduce", "gemv", "gemm", "kv_copy"
    # gemv / gemm: the quantized GEMV (one token row) or prefill GEMM (128 rows) of
    # triton_quant over a [heads * head_dim]-square weight in this GGML format ("Q8_0",
    # "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"), x in `dtype`.
    # kv_copy: the handoff's block copy (triton_kv_copy) of pools of this shape.
    quant: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


def _both(
    name: str,
    dtype: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int | None = None,
    sinks: bool = False,
) -> list[Variant]:
    """The decode and the prefill variant of one shape."""
    shape = (dtype, heads, kv_heads, head_dim)
    return [
        Variant(f"{name} {phase}", *shape, phase == "prefill", window, sinks)
        for phase in ("decode", "prefill")
    ]


def _decode_side(
    name: str,
    dtype: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int | None = None,
    sinks: bool = False,
) -> list[Variant]:
    """The verify, split-decode and reduce variants of one shape."""
    shape = (dtype, heads, kv_heads, head_dim, False, window, sinks)
    return [
        Variant(f"{name} {launch}", *shape, launch=launch)
        for launch in ("verify", "split", "reduce")
    ]


def _quantized(launch: str, formats: tuple[str, ...]) -> list[Variant]:
    """The quantized product `launch` ("gemv" or "gemm") at Llama 3 8B's width (4096)
    for each format, in every dtype."""
    dtypes = (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32"))
    return [
        Variant(
            f"llama3-8b {fmt} {launch} {short}", dtype, 32, 32, 128, False, launch=launch, quant=fmt
        )
        for fmt in formats
        for dtype, short in dtypes
    ]


# bfloat16 is what dtype=auto picks on every architecture here (all have bf16); float16
# and float32 launch only when asked for (dtype=float16/float32: gpu_check's appliance
# section runs float32). Shapes that launch the same specialization appear once: Llama 3
# 8B stands for Mistral 7B v0.2+, Mixtral and Qwen3 8B (32/8 heads of 128).
VARIANTS: tuple[Variant, ...] = tuple(
    _both("smollm2-135m bf16", "bfloat16", 9, 3, 64)  # the embedded default: GQA 3
    + _both("llama3-8b bf16", "bfloat16", 32, 8, 128)  # GQA 4
    + _both("qwen2.5-7b bf16", "bfloat16", 28, 4, 128)  # GQA 7
    + _both("qwen3-0.6b bf16", "bfloat16", 16, 8, 128)  # GQA 2
    + _both("mistral-7b-v0.1 window bf16", "bfloat16", 32, 8, 128, window=4096)
    + _both("gemma3-4b global bf16", "bfloat16", 8, 4, 256)  # head 256, GQA 2
    + _both("gemma3-4b local bf16", "bfloat16", 8, 4, 256, window=1024)
    + _both("gemma3-1b local bf16", "bfloat16", 4, 1, 256, window=512)  # GQA 4
    + _both("phi3-mini bf16", "bfloat16", 32, 32, 96)  # head 96 padded to 128, MHA
    + _both("gpt-oss-20b full bf16", "bfloat16", 64, 8, 64, sinks=True)  # GQA 8
    + _both("gpt-oss-20b sliding bf16", "bfloat16", 64, 8, 64, window=128, sinks=True)
    + _both("llama3-8b fp16", "float16", 32, 8, 128)
    + _both("smollm2-135m fp32", "float32", 9, 3, 64)
    + _both("llama3-8b fp32", "float32", 32, 8, 128)
    + _both("gemma3-4b local fp32", "float32", 8, 4, 256, window=1024)
    + _decode_side("smollm2-135m bf16", "bfloat16", 9, 3, 64)
    + _decode_side("llama3-8b bf16", "bfloat16", 32, 8, 128)
    + _decode_side("qwen2.5-7b bf16", "bfloat16", 28, 4, 128)
    + _decode_side("gemma3-4b local bf16", "bfloat16", 8, 4, 256, window=1024)
    + _decode_side("gpt-oss-20b sliding bf16", "bfloat16", 64, 8, 64, window=128, sinks=True)
    + _decode_side("llama3-8b fp16", "float16", 32, 8, 128)
    + _decode_side("llama3-8b fp32", "float32", 32, 8, 128)
    + _quantized("gemv", ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"))
    + _quantized("gemm", ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"))
    + [
        # The handoff's copy moves bytes as integers of the dtype's width: bf16 and fp16
        # compile the same kernel, float32 another; head 64 (the default model's) and 128.
        Variant("smollm2-135m kv_copy bf16", "bfloat16", 9, 3, 64, False, launch="kv_copy"),
        Variant("llama3-8b kv_copy bf16", "bfloat16", 32, 8, 128, False, launch="kv_copy"),
        Variant("llama3-8b kv_copy fp32", "float32", 32, 8, 128, False, launch="kv_copy"),
    ]
)
# The CI test's quick subset, on sm_90a: the default model, the common 8B shape, the
# largest head (256), sinks with a window, and float32's widest tiles.
QUICK = (
    "smollm2-135m bf16 decode",
    "smollm2-135m bf16 prefill",
    "llama3-8b bf16 prefill",
    "gemma3-4b local bf16 prefill",
    "gpt-oss-20b sliding bf16 prefill",
    "llama3-8b fp32 prefill",
    "llama3-8b bf16 verify",
    "llama3-8b bf16 split",
    "llama3-8b bf16 reduce",
    "llama3-8b Q8_0 gemv bf16",
    "llama3-8b Q4_0 gemv bf16",
    "llama3-8b Q4_1 gemv bf16",
    "llama3-8b Q4_K gemv bf16",
    "llama3-8b Q5_K gemv bf16",
    "llama3-8b Q6_K gemv bf16",
    "llama3-8b Q4_0 gemm bf16",
    "llama3-8b Q6_K gemm bf16",
    "llama3-8b kv_copy bf16",
)


@dataclass(frozen=True)
class Compiled:
    """What ptxas and Triton report for one variant on one architecture."""

    variant: Variant
    arch: str
    registers: int  # per thread
    spill_stores: int  # bytes per thread
    spill_loads: int
    shared: int  # bytes of shared memory per program (Triton's dynamic allocation)
    num_warps: int
    num_stages: int
    seconds: float  # the compile's wall time


def variant(name: str) -> Variant:
    """The variant of that name."""
    for candidate in VARIANTS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no variant {name!r}")


def launch_for(
    v: Variant, tiles: triton_attention.Tiles | None = None
) -> triton_attention.KernelLaunch | triton_quant.QuantLaunch | triton_kv_copy.CopyLaunch:
    """The launch attend() (quant_gemv, quant_gemm, the KV copy) makes for this variant
    on a GPU, built from small CPU tensors of the variant's shape (only their dtypes,
    strides and alignment count); `tiles` replaces the launch's own (to measure others)."""
    dtype = v.torch_dtype
    if v.quant is not None:
        return _quant_launch(v)
    if v.launch == "kv_copy":
        return _kv_copy_launch(v)
    # Prefill and verify: segment_runs' varlen metadata (int64 slices of one upload) for
    # a step of three chunks; decode: a group's padded int64 tables and lengths. 37
    # blocks: a stride no multiple of 16.
    lengths = {"plain": [77] if v.prefill else [1] * 5, "verify": [5, 5, 5]}.get(v.launch, [1])
    tokens = sum(lengths)
    # As the model makes them: q a view of the fused [tokens, heads + 2 * kv_heads,
    # head_dim] projection (rotate_and_store), out a fresh tensor.
    qkv = torch.zeros(tokens, v.heads + 2 * v.kv_heads, v.head_dim, dtype=dtype)
    q = qkv[:, : v.heads]
    out = torch.empty(tokens, v.heads, v.head_dim, dtype=dtype)
    k_cache = torch.zeros(4, BLOCK_SIZE, v.kv_heads, v.head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    query_starts = None
    if v.prefill or v.launch == "verify":
        run = _segment_run(lengths, verify=v.launch == "verify")
        block_tables, context_lens, query_starts = (
            run.block_tables,
            run.context_lens,
            run.query_starts,
        )
    else:
        block_tables = torch.zeros(len(lengths), 37, dtype=torch.int64)
        context_lens = torch.zeros(len(lengths), dtype=torch.int64)
    launches = triton_attention.kernel_launches(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        v.head_dim**-0.5,
        out,
        query_len=max(lengths),
        query_starts=query_starts,
        window=v.window,
        sinks=torch.zeros(v.heads) if v.sinks else None,
        interpreted=False,
        # 8 KV heads at 8k keys: the rule's parts on an H100 (one wave)
        splits=decode_splits(v.kv_heads, 8192, H100_SMS) if v.launch in ("split", "reduce") else 1,
    )
    launch = launches[-1] if v.launch == "reduce" else launches[0]
    if tiles is None:
        return launch
    options = launch.options | {
        "ROWS": tiles.rows,
        "BLOCK_N": tiles.block_n,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }
    return replace(launch, options=options)


def _quant_launch(v: Variant) -> triton_quant.QuantLaunch:
    """quant_gemv's launch for one token row (quant_gemm's for 128 rows) times a square
    weight of the model's width."""
    width = v.heads * v.head_dim
    fmt = quant.FORMATS[str(v.quant)]
    tokens = 128 if v.launch == "gemm" else 1
    blocks = torch.zeros(width, width // fmt.values * fmt.bytes, dtype=torch.uint8)
    x = torch.zeros(tokens, width, dtype=v.torch_dtype)
    out = torch.empty(tokens, width, dtype=v.torch_dtype)
    make = triton_quant.gemm_launch if v.launch == "gemm" else triton_quant.gemv_launch
    return make(x, blocks, fmt.ggml_id, width, out)


def _kv_copy_launch(v: Variant) -> triton_kv_copy.CopyLaunch:
    """The handoff copy's launch for 256 blocks (a 4k-token prompt) between two pools of
    the model's KV shape (32 layers); ids as the kernel gets them, int64 on the device."""
    shape = (32, 2, 300, BLOCK_SIZE, v.kv_heads, v.head_dim)
    src = torch.zeros(shape, dtype=v.torch_dtype)
    ids = torch.arange(256, dtype=torch.int64)
    return triton_kv_copy.copy_launch(src, ids, torch.zeros_like(src), ids)


def _segment_run(lengths: list[int], verify: bool) -> triton_attention.SegmentRun:
    """segment_runs' one run for chunks of these lengths (prompts, or verify chunks)."""
    from appliance.model.layers.paged_attention import AttentionBatch, PrefillSegment

    segments, row = [], 0
    for length in lengths:
        table = torch.arange(37, dtype=torch.int64)
        segments.append(PrefillSegment(row, length, 100 + length, table))
        row += length
    slots = torch.zeros(row, dtype=torch.int64)
    batch = AttentionBatch(slots, segments, row, [], 0 if verify else None)
    (run,) = triton_attention.segment_runs(batch, torch.device("cpu"))
    return run


def compile_variant(v: Variant, arch: str, tiles: triton_attention.Tiles | None = None) -> Compiled:
    """Compile the variant for `arch` (a key of ARCHES) as a launch would (with other
    `tiles`, when given); raises triton's error on a compile failure."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    launch = launch_for(v, tiles)
    kernel = launch.kernel
    target = GPUTarget("cuda", ARCHES[arch], 32)
    backend = make_backend(target)
    # What JITFunction.run does before it compiles (triton 3.6 to 3.9): bind the
    # arguments, specialize them (ints of 1 become constexprs, multiples of 16 and
    # aligned pointers get divisibility attributes), then pack the options.
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.options)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, dict(launch.options), bound, specialization, options
    )
    log = io.StringIO()
    start = time.perf_counter()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # printed to stdout, caught here
        knobs.compilation.always_compile = True  # a cache hit would run no ptxas
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
        )
    seconds = time.perf_counter() - start
    registers, stores, loads = parse_ptxas(log.getvalue())
    meta = compiled.metadata
    return Compiled(
        v, arch, registers, stores, loads, meta.shared, meta.num_warps, meta.num_stages, seconds
    )


def parse_ptxas(log: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ptxas -v's log of one kernel."""
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if used is None or spills is None:
        raise ValueError(f"no register or spill line in ptxas's log:\n{log}")
    return int(used.group(1)), int(spills.group(1)), int(spills.group(2))


def markdown(results: list[Compiled]) -> str:
    """The table, variants x architectures: each cell registers a thread, shared memory a
    program, and spill stores / loads in bytes a thread."""
    arches = list(dict.fromkeys(r.arch for r in results))
    cells: dict[Variant, dict[str, Compiled]] = {}
    for r in results:
        cells.setdefault(r.variant, {})[r.arch] = r
    lines = [
        "| variant | head | group | window/sinks | warps/stages | "
        + " | ".join(f"{arch}: regs, smem, spills" for arch in arches)
        + " |",
        "|---" * (5 + len(arches)) + "|",
    ]
    for v, by_arch in cells.items():
        first = next(iter(by_arch.values()))
        row = [
            v.name,
            "-" if v.quant else str(v.head_dim),
            "-" if v.quant else str(v.heads // v.kv_heads),
            f"{v.window or '-'}/{'yes' if v.sinks else '-'}",
            f"{first.num_warps}/{first.num_stages}",
        ]
        for arch in arches:
            cell = by_arch.get(arch)
            row.append(
                ""
                if cell is None
                else f"{cell.registers}, {cell.shared / 1024:.0f} KiB, "
                f"{cell.spill_stores}/{cell.spill_loads}"
            )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def ensure_triton36() -> Path:
    """~/.cache/appliance-triton36 holding the Triton 3.6 wheel (installed there once)."""
    if not (TRITON36_DIR / f"triton-{TRITON36}.dist-info").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
        subprocess.run([*pip, "--target", str(TRITON36_DIR), f"triton=={TRITON36}"], check=True)
    return TRITON36_DIR


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the CI test's subset, sm_90a")
    parser.add_argument("--arch", action="append", choices=sorted(ARCHES), help="repeatable")
    parser.add_argument("--only", action="append", help="a variant's name (repeatable)")
    parser.add_argument("--triton36", action="store_true", help="run under Triton 3.6")
    args = parser.parse_args(argv)
    if args.triton36:
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--triton36"]
        paths = [str(ensure_triton36()), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        return subprocess.run([sys.executable, __file__, *rest], env=env).returncode
    import triton

    names = args.only or (list(QUICK) if args.quick else [v.name for v in VARIANTS])
    arches = args.arch or (["sm_90a"] if args.quick else list(ARCHES))
    results = []
    for name in names:
        for arch in arches:
            results.append(compile_variant(variant(name), arch))
            print(f"compiled {name} for {arch} in {results[-1].seconds:.1f} s", file=sys.stderr)
    print(f"Triton {triton.__version__}, block size {BLOCK_SIZE}\n")
    print(markdown(results))
    over = [r for r in results if problem(r)]
    for result in over:
        print(f"FAILS: {result.variant.name} on {result.arch}: {problem(result)}", file=sys.stderr)
    return 1 if over else 0


def problem(result: Compiled) -> str | None:
    """What is wrong with a compiled variant (a spill, or more shared memory than its
    architecture gives a block); None when nothing is."""
    if max(result.spill_stores, result.spill_loads) > SPILL_BUDGET:
        return f"spills {result.spill_stores}/{result.spill_loads} B a thread"
    if result.shared > SHARED_LIMIT[result.arch]:
        return f"{result.shared} B shared, over {SHARED_LIMIT[result.arch]}"
    return None


if __name__ == "__main__":
    sys.exit(main())
