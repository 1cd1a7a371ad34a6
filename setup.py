"""The one compiled part: CPU kernels for decode attention, the residual add + RMSNorm and
the rotary embedding + KV store (appliance/model/csrc/). Everything else is in pyproject.toml.

The kernels are optional: where they do not build (no C compiler), the model runs the
same steps with torch ops instead (appliance/model/cpu_kernels.py says which).
"""

from setuptools import Extension, setup

SOURCES = ["module.c", "paged_decode.c", "add_rms_norm.c", "rope_store.c"]

setup(
    ext_modules=[
        Extension(
            "appliance.model._cpu_kernels",
            [f"appliance/model/csrc/{name}" for name in SOURCES],
            depends=["appliance/model/csrc/kernels.h", "appliance/model/csrc/vec.h"],
            # Built on the machine that runs it (install.sh): its own vector width (a venv
            # copied to a CPU with fewer vector instructions must re-run install.sh). Fused
            # multiply-adds are off by default in ISO C mode. OpenMP: the kernels run on
            # torch's threads (its libgomp, loaded before the extension, is the one used).
            extra_compile_args=[
                "-O3",
                "-march=native",
                "-std=c11",
                "-ffp-contract=fast",
                "-fopenmp",
            ],
            extra_link_args=["-fopenmp"],
            libraries=["m"],
            optional=True,
        )
    ]
)
