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

The parts: loading.py (which compiled module serves, and the one place calls read it
from), attention.py (decode attention, RoPE + KV store), norm_silu.py (add + RMSNorm,
SiLU-mul), quant_products.py (block-quantized products and rows), compiled_step.py (the
whole decode step). This package names what the rest of the appliance calls.
"""

from appliance.model.cpu_kernels.attention import (
    HEAD_SIZES,
    MAX_GROUP,
    decode_takes,
    decodes_ragged,
    paged_decode,
    rope_store,
    rope_store_takes,
)
from appliance.model.cpu_kernels.compiled_step import LAYER_FIELDS, StepShape, decode_step
from appliance.model.cpu_kernels.loading import (
    ABI,
    LEVELS,
    available,
    cpu_levels,
    level,
    prefill_gemm_dtype,
    prefill_gemm_rows,
    select,
)
from appliance.model.cpu_kernels.norm_silu import add_rms_norm, norm_takes, silu_mul, silu_takes
from appliance.model.cpu_kernels.quant_products import (
    GEMM_ROWS,
    QuantMatrix,
    quant_matmul,
    quant_rows,
    quant_takes,
)

__all__ = [
    "ABI",
    "GEMM_ROWS",
    "HEAD_SIZES",
    "LAYER_FIELDS",
    "LEVELS",
    "MAX_GROUP",
    "QuantMatrix",
    "StepShape",
    "add_rms_norm",
    "available",
    "cpu_levels",
    "decode_step",
    "decode_takes",
    "decodes_ragged",
    "level",
    "norm_takes",
    "paged_decode",
    "prefill_gemm_dtype",
    "prefill_gemm_rows",
    "quant_matmul",
    "quant_rows",
    "quant_takes",
    "rope_store",
    "rope_store_takes",
    "select",
    "silu_mul",
    "silu_takes",
]
