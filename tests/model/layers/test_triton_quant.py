"""The Triton GEMV and the prefill GEMM over GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
Q6_K; appliance/model/layers/triton_quant.py) under Triton's interpreter, against
quant.py's dequantizer and the CPU kernels' product.

Q8_0 and Q4_0 weights come from quant.quantize (llama.cpp's rounding) of random floats;
the other formats are random bytes with float16 scales of a sane size (every quant bit
pattern, the K-quants' packed scales and Q5_K's fifth bits too). Row counts leave a
partial row tile (70; the bit tests take one GEMV tile, BITS_ROWS), block counts a
partial step (9 blocks: steps of 8 in the GEMV, of 2 in the 16-bit GEMM), and 20 GEMM
rows a partial row tile; the K-quants' GEMM steps through a super-block 64 (32 in
float32) values at a time. The child process runs the
interpreter (TRITON_INTERPRET must be set before triton is imported; see
test_triton_attention.py) and reports JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import partial

import pytest
import torch
from interpreter_child import child_results, run_jobs

# Each test runs the Triton interpreter in a child process: the slow lane's kind of test.
pytestmark = pytest.mark.process

# GGML type ids of the formats the kernels (the GEMV and the GEMM) take.
FORMATS = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
GEMM_FORMATS = tuple(FORMATS)
ROWS, TOKENS, GEMM_TOKENS = 70, 3, 20
# The bit tests' rows: one GEMV row tile (16 rows), a partial GEMM tile (32 float32). x is
# the identity, one token a column, so the GEMV runs (row tiles x in_features) programs,
# each dequantizing its whole tile to keep one column: 70 rows (5 tiles) cost 5x as much
# (~50 of the child's ~68 CPU s) for no other code. The bits depend on each block's own
# bytes, not on its row: every row runs the same per-block code. Over 16 rows every bit
# of every byte position of a block (quants, packed scales, fifth bits) still takes both
# values, as over 70 (measured at seed 0: only the float16 scales' top bits stay fixed,
# in both). The partial GEMV tile's masking is the product tests' (70 rows, every format
# and dtype).
BITS_ROWS = 16
# Input widths: 9 blocks of 32 (a partial GEMV step of 8 blocks, a partial GEMM step of
# 64 values), or two 256-value super-blocks.
IN_FEATURES = {
    "Q8_0": 9 * 32,
    "Q4_0": 9 * 32,
    "Q4_1": 9 * 32,
    "Q4_K": 512,
    "Q5_K": 512,
    "Q6_K": 512,
}
# Where each format keeps its float16 scales in a block (byte offsets), and the block's
# bytes; the rest of a random block is random quants.
SCALES = {
    "Q4_1": ((0, 2), 20),
    "Q4_K": ((0, 2), 144),
    "Q5_K": ((0, 2), 176),
    "Q6_K": ((208,), 210),
}


def _random_blocks(name: str, rows: int, in_features: int) -> torch.Tensor:
    """Random blocks of a format quant.quantize does not write: every quant bit pattern
    (the K-quants' packed 6-bit scales and mins too), with float16 scales of ~0.01 so the
    products stay in range."""
    offsets, size = SCALES[name]
    count = in_features // (256 if name.endswith("_K") else 32)
    blocks = torch.randint(0, 256, (rows, count, size), dtype=torch.uint8)
    for offset in offsets:
        scale = (torch.rand(rows, count) * 0.02 - 0.01).to(torch.float16)  # signed: Q4_1's m
        if name != "Q4_1" or offset == 0:
            scale = scale.abs()
        blocks[:, :, offset : offset + 2] = scale.view(torch.uint8).view(rows, count, 2)
    return blocks.view(rows, count * size)


def _weight(name: str, rows: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized random weight: (its blocks, the dequantizer's float32 [rows, in])."""
    from appliance.model import quant

    if name in ("Q8_0", "Q4_0"):  # llama.cpp's rounding of random floats
        weight = quant.quantize(torch.randn(rows, in_features), name)
    else:
        blocks = _random_blocks(name, rows, in_features)
        weight = quant.QuantWeight(quant.FORMATS[name], blocks, in_features, True)
    return weight.blocks, weight.dequantize()


def _same_bits(name: str, product: str) -> int:
    """How many weights the kernel (`product`: quant_gemv or quant_gemm, float32) gives
    other bits than the dequantizer: x the identity, so out[t, r] = 1.0 * W[r, t] plus
    zeros, exactly."""
    from appliance.model.layers import triton_quant

    in_features = 256 if name.endswith("_K") else 3 * 32  # one super-block, or 3 blocks
    blocks, dense = _weight(name, BITS_ROWS, in_features)
    run = getattr(triton_quant, product)
    out = run(torch.eye(in_features), blocks, FORMATS[name], in_features)
    return int((out.T.contiguous().view(torch.int32) != dense.view(torch.int32)).sum())


def _product_errors(name: str, dtype: str, product: str) -> dict[str, float]:
    """Relative errors of the kernel's product (x in `dtype`): against float64 over the
    dequantized weight, and against the CPU kernels' quant_matmul (float32)."""
    from appliance.model import cpu_kernels
    from appliance.model.layers import triton_quant

    in_features = IN_FEATURES[name]
    tokens = GEMM_TOKENS if product == "quant_gemm" else TOKENS
    blocks, dense = _weight(name, ROWS, in_features)
    x = torch.randn(tokens, in_features).to(getattr(torch, dtype))
    out = getattr(triton_quant, product)(x, blocks, FORMATS[name], in_features)
    assert out.dtype == x.dtype and out.shape == (tokens, ROWS)
    reference = x.double() @ dense.double().T  # [tokens, rows]
    scale = reference.abs().max().item()
    errors = {"reference": (out.double() - reference).abs().max().item() / scale}
    if dtype == "float32":
        cpu = cpu_kernels.quant_matmul(x, blocks, FORMATS[name], in_features, precise=True)
        errors["cpu_kernels"] = (out - cpu).abs().max().item() / scale
    return errors


def _linear_error(tokens: int) -> float:
    """QuantLinear (a Q8_0 part and a Q4_0 part, a bias) on its GPU path, the Triton
    kernels (runs_triton switched on: there is no GPU here), against its CPU path, over
    the largest |output|."""
    from appliance.model import quant

    parts = [
        quant.quantize(torch.randn(40, 96), "Q8_0"),
        quant.quantize(torch.randn(24, 96), "Q4_0"),
    ]
    layer = quant.QuantLinear(parts, torch.randn(64))
    x = torch.randn(tokens, 96)
    cpu = layer(x)
    chooser = quant.runs_triton
    quant.runs_triton = lambda device: True  # type: ignore[assignment]
    try:
        gpu_path = layer(x)
    finally:
        quant.runs_triton = chooser
    return (gpu_path - cpu).abs().max().item() / cpu.abs().max().item()


DTYPES = ("float32", "bfloat16", "float16")
CASES = [(name, dtype) for name in FORMATS for dtype in DTYPES]
GEMM_CASES = [(name, dtype) for name in GEMM_FORMATS for dtype in DTYPES]
# Over the largest |product|: float32 sums of 288-512 terms (~1e-7 each) in float32;
# 16-bit outputs round once at the end (2**-8 relative in bfloat16, 2**-11 in float16).
TOLERANCE = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 1e-3}
# The GEMM multiplies in x's dtype: the weight rounds to it too (2**-9 relative a weight
# in bfloat16, 2**-12 in float16), a random sum of such errors, then the output rounds.
GEMM_TOLERANCE = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}
# The CPU kernels carry the activations as two int8 parts (about 16 bits, precise=True):
# their own error against float64 is ~2e-5 of the largest product here (measured).
CPU_KERNELS_TOLERANCE = 5e-5


def _child() -> dict[str, object]:
    torch.manual_seed(0)
    jobs: dict[str, Callable[[], object]] = {
        f"bits_{name}": partial(_same_bits, name, "quant_gemv") for name in FORMATS
    }
    for name in GEMM_FORMATS:
        jobs[f"gemm_bits_{name}"] = partial(_same_bits, name, "quant_gemm")
    for name, dtype in CASES:
        jobs[f"{name}_{dtype}"] = partial(_product_errors, name, dtype, "quant_gemv")
    for name, dtype in GEMM_CASES:
        jobs[f"gemm_{name}_{dtype}"] = partial(_product_errors, name, dtype, "quant_gemm")
    for tokens in (3, 12):  # the GEMV's rows, the GEMM's
        jobs[f"linear_{tokens}"] = partial(_linear_error, tokens)
    return run_jobs(jobs)


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    return child_results(__file__)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantized_in_registers_to_the_dequantizers_bits(results: dict, name: str) -> None:
    differing = results[f"bits_{name}"]
    assert differing == 0, differing


@pytest.mark.parametrize("name", GEMM_FORMATS)
def test_the_gemm_dequantizes_to_the_dequantizers_bits(results: dict, name: str) -> None:
    differing = results[f"gemm_bits_{name}"]
    assert differing == 0, differing


def _check(errors: object, name: str, dtype: str, tolerance: dict[str, float]) -> None:
    assert isinstance(errors, dict), errors
    for against, error in errors.items():
        bound = CPU_KERNELS_TOLERANCE if against == "cpu_kernels" else tolerance[dtype]
        assert error <= bound, f"{name} {dtype} against {against}: {error}"
    assert ("cpu_kernels" in errors) == (dtype == "float32")


@pytest.mark.parametrize(("name", "dtype"), CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_product_matches_the_dequantized_weight_and_the_cpu_kernels(
    results: dict, name: str, dtype: str
) -> None:
    _check(results[f"{name}_{dtype}"], name, dtype, TOLERANCE)


@pytest.mark.parametrize(("name", "dtype"), GEMM_CASES, ids=[f"{n}-{d}" for n, d in GEMM_CASES])
def test_gemm_of_prefill_rows_matches_the_dequantized_weight(
    results: dict, name: str, dtype: str
) -> None:
    _check(results[f"gemm_{name}_{dtype}"], name, dtype, GEMM_TOLERANCE)


@pytest.mark.parametrize("tokens", [3, 12])
def test_the_linear_layers_gpu_path_gives_its_cpu_paths_product(results: dict, tokens: int) -> None:
    # Decode's 3 rows run the GEMV, 12 prefill rows the GEMM (GEMM_TOKENS is 8); both
    # parts land in their columns, the bias added once.
    error = results[f"linear_{tokens}"]
    assert isinstance(error, float), error
    assert error <= CPU_KERNELS_TOLERANCE


def test_other_formats_are_refused() -> None:
    from appliance.model.layers import triton_quant

    with pytest.raises(ValueError, match="GGML type 6"):  # Q5_0: no Triton kernel
        triton_quant.quant_gemv(torch.zeros(1, 32), torch.zeros(1, 22, dtype=torch.uint8), 6, 32)
    with pytest.raises(ValueError, match="GGML type 6"):
        triton_quant.quant_gemm(torch.zeros(1, 32), torch.zeros(1, 22, dtype=torch.uint8), 6, 32)
    with pytest.raises(ValueError, match="do not hold"):
        triton_quant.quant_gemv(torch.zeros(1, 64), torch.zeros(1, 34, dtype=torch.uint8), 8, 64)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    print(json.dumps(_child()))
