"""The one compiled part: CPU kernels (appliance/model/csrc/): block-quantized matrix
products, decode attention, the residual add + RMSNorm, the rotary embedding + KV store, and
a decode step's layers in one call.
Everything else is in pyproject.toml.

The same sources are built once per instruction-set level of the build machine's
architecture, none for this machine alone (no -march=native): on x86-64 a generic build
(SSE2, every x86-64 CPU), an AVX2 + FMA + F16C build and an AVX-512 (F/BW/VL/DQ + VNNI)
build; elsewhere (ARM: NEON is part of its baseline) the generic build only. At run time
appliance/model/cpu_kernels/loading.py loads the highest level the CPU has, capped by the
`cpu_isa` setting, so one install runs on every CPU of its architecture.

The kernels are optional: where they do not build (no C compiler), the model runs the
same steps with torch ops instead (appliance/model/cpu_kernels/ says which).
"""

import platform

from setuptools import Extension, setup

SOURCES = [
    "module.c",
    "paged_decode.c",
    "add_rms_norm.c",
    "silu_mul.c",
    "rope_store.c",
    "quant_matmul.c",
    "quant_gemm.c",
    "decode_step.c",
]
X86_LEVELS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": [
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512vnni",
        # Wide registers where the compiler vectorizes on its own; the intrinsics are 256-bit.
        "-mprefer-vector-width=512",
    ],
}


def levels() -> dict[str, list[str]]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        return X86_LEVELS
    return {"generic": []}


def kernels(level: str, flags: list[str]) -> Extension:
    return Extension(
        f"appliance.model._cpu_kernels_{level}",
        [f"appliance/model/csrc/{name}" for name in SOURCES],
        depends=["appliance/model/csrc/kernels.h", "appliance/model/csrc/vec.h"],
        # Fused multiply-adds are off by default in ISO C mode. OpenMP: the kernels run on
        # torch's threads (its libgomp, loaded before the extension, is the one used).
        extra_compile_args=[
            "-O3",
            "-std=c11",
            "-ffp-contract=fast",
            # lrintf and friends set no errno: inlined to one instruction, vectorizable.
            "-fno-math-errno",
            "-fopenmp",
            f"-DKERNELS_LEVEL={level}",
            *flags,
        ],
        extra_link_args=["-fopenmp"],
        libraries=["m"],
        optional=True,
    )


setup(ext_modules=[kernels(level, flags) for level, flags in levels().items()])
