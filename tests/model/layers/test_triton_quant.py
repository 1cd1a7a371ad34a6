"""The Triton GEMV over Q8_0 and Q4_0 blocks (appliance/model/layers/triton_quant.py)
under Triton's interpreter, against quant.py's dequantizer and the CPU kernels' product.

Weights come from quant.quantize (llama.cpp's rounding) of random floats, with row counts
that leave a partial row tile (70 of 64) and block counts that leave a partial step (9
blocks, steps of 4). The child process runs the interpreter (TRITON_INTERPRET must be set
before triton is imported; see test_triton_attention.py) and reports JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from functools import partial

import pytest
import torch

# Each test runs the Triton interpreter in a child process: the slow lane's kind of test.
pytestmark = pytest.mark.process

FORMATS = {"Q8_0": 8, "Q4_0": 2}
ROWS, IN_FEATURES, TOKENS = 70, 9 * 32, 3


def _weight(name: str, rows: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized random weight: (its blocks, the dequantizer's float32 [rows, in])."""
    from appliance.model import quant

    weight = quant.quantize(torch.randn(rows, in_features), name)
    return weight.blocks, weight.dequantize()


def _same_bits(name: str) -> int:
    """How many weights the kernel dequantizes to other bits than the dequantizer: x the
    identity, so out[t, r] = 1.0 * W[r, t] plus zeros, exactly."""
    from appliance.model.layers import triton_quant

    in_features = 3 * 32
    blocks, dense = _weight(name, ROWS, in_features)
    out = triton_quant.quant_gemv(torch.eye(in_features), blocks, FORMATS[name], in_features)
    return int((out.T.contiguous().view(torch.int32) != dense.view(torch.int32)).sum())


def _product_errors(name: str, dtype: str) -> dict[str, float]:
    """Relative errors of the kernel's product (x in `dtype`): against float64 over the
    dequantized weight, and against the CPU kernels' quant_matmul (float32)."""
    from appliance.model import cpu_kernels
    from appliance.model.layers import triton_quant

    blocks, dense = _weight(name, ROWS, IN_FEATURES)
    x = torch.randn(TOKENS, IN_FEATURES).to(getattr(torch, dtype))
    out = triton_quant.quant_gemv(x, blocks, FORMATS[name], IN_FEATURES)
    assert out.dtype == x.dtype and out.shape == (TOKENS, ROWS)
    reference = x.double() @ dense.double().T  # [tokens, rows]
    scale = reference.abs().max().item()
    errors = {"reference": (out.double() - reference).abs().max().item() / scale}
    if dtype == "float32":
        cpu = cpu_kernels.quant_matmul(x, blocks, FORMATS[name], IN_FEATURES, precise=True)
        errors["cpu_kernels"] = (out - cpu).abs().max().item() / scale
    return errors


CASES = [(name, dtype) for name in FORMATS for dtype in ("float32", "bfloat16", "float16")]
# Over the largest |product|: float32 sums of 288 terms (~1e-7 each) in float32; 16-bit
# outputs round once at the end (2**-8 relative in bfloat16, 2**-11 in float16).
TOLERANCE = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 1e-3}
# The CPU kernels carry the activations as two int8 parts (about 16 bits, precise=True):
# their own error against float64 is ~2e-5 of the largest product here (measured).
CPU_KERNELS_TOLERANCE = 5e-5


def _child() -> dict[str, object]:
    torch.manual_seed(0)
    results: dict[str, object] = {}
    jobs: dict[str, Callable[[], object]] = {
        f"bits_{name}": partial(_same_bits, name) for name in FORMATS
    }
    for name, dtype in CASES:
        jobs[f"{name}_{dtype}"] = partial(_product_errors, name, dtype)
    for key, job in jobs.items():
        try:
            results[key] = job()
        except Exception:
            results[key] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"the interpreter child failed:\n{proc.stderr[-4000:]}"
    found: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantized_in_registers_to_the_dequantizers_bits(results: dict, name: str) -> None:
    differing = results[f"bits_{name}"]
    assert differing == 0, differing


@pytest.mark.parametrize(("name", "dtype"), CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_product_matches_the_dequantized_weight_and_the_cpu_kernels(
    results: dict, name: str, dtype: str
) -> None:
    errors = results[f"{name}_{dtype}"]
    assert isinstance(errors, dict), errors
    for against, error in errors.items():
        bound = CPU_KERNELS_TOLERANCE if against == "cpu_kernels" else TOLERANCE[dtype]
        assert error <= bound, f"{name} {dtype} against {against}: {error}"
    assert ("cpu_kernels" in errors) == (dtype == "float32")


def test_other_formats_are_refused() -> None:
    from appliance.model.layers import triton_quant

    with pytest.raises(ValueError, match="GGML type 3"):
        triton_quant.quant_gemv(torch.zeros(1, 32), torch.zeros(1, 20, dtype=torch.uint8), 3, 32)
    with pytest.raises(ValueError, match="do not hold"):
        triton_quant.quant_gemv(torch.zeros(1, 64), torch.zeros(1, 34, dtype=torch.uint8), 8, 64)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    print(json.dumps(_child()))
