"""The int16 GEMM for prefill-sized products (csrc/quant_gemm.c; QuantMatrix with
gemm_dtype=torch.int16): activations quantized per 32 values to int16 times the weights'
small integers, for Q4_0, Q4_1 and Q8_0 weights.

Checked against a float64 product of the weights gguf-py dequantizes from random blocks,
relative to sum(|w| |x|) of each output: int16 activations (about 16 bits) cost about
1e-5 of it, 1e-4 is the bound; and every level this CPU runs gives the same numbers
within 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from quant_blocks import random_blocks

from appliance.model import cpu_kernels
from appliance.model.cpu_kernels.loading import compiled, threads
from appliance.model.quant import FORMATS, QuantWeight, quantize

NAMES = ["Q4_0", "Q4_1", "Q8_0"]
LEVELS = cpu_kernels.cpu_levels()
ROWS = cpu_kernels.GEMM_ROWS + 3


def weight_of(name: str, n: int, k: int, seed: int) -> tuple[QuantWeight, np.ndarray]:
    """Random blocks of format `name` [n, k] and the float64 weights they hold."""
    raw = random_blocks(name, n, k, seed)
    w = dequantize(raw, GGMLQuantizationType[name]).reshape(n, k).astype(np.float64)
    return QuantWeight(FORMATS[name], torch.from_numpy(raw), k), w


def int16_gemm(
    x: torch.Tensor,
    weight: QuantWeight,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    format_id: int | None = None,
    row_bytes: int | None = None,
) -> torch.Tensor:
    """The kernel called directly (any rows), into `out`; format and row bytes overridable
    to make bad problems."""
    kernels = compiled()
    assert kernels is not None
    kernels.quant_gemm(
        x.data_ptr(),
        weight.blocks.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        out.shape[1],
        x.shape[1],
        weight.blocks.shape[1] if row_bytes is None else row_bytes,
        x.stride(0),
        out.stride(0),
        weight.format.ggml_id if format_id is None else format_id,
        threads(),
    )
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("m", "n", "k"), [(131, 37, 96), (200, 129, 512), (7, 16, 64), (13, 20, 1056)]
)
def test_each_format_matches_a_float64_product_at_every_level(name, m, n, k, at_level) -> None:
    """Odd shapes (rows not a multiple of the microkernel's, features not of a panel's,
    inputs over several passes of KC_BLOCKS blocks), with a bias, into a column slice of
    a wider output."""
    weight, w = weight_of(name, n, k, seed=m + n)
    gen = torch.Generator().manual_seed(k)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    exact = x.double().numpy() @ w.T + bias.double().numpy()
    size = np.abs(x.double().numpy()) @ np.abs(w).T + np.abs(bias.double().numpy())
    results = {}
    for level in LEVELS:
        at_level(level)
        wide = torch.zeros(m, n + 9)
        got = int16_gemm(x, weight, wide[:, 5 : 5 + n], bias).double().numpy()
        assert wide[:, :5].abs().sum() == 0 and wide[:, 5 + n :].abs().sum() == 0, level
        assert np.max(np.abs(got - exact) / size) < 1e-4, level
        results[level] = got
    for level, got in results.items():  # every level gives the same numbers
        assert np.max(np.abs(got - results["generic"]) / size) < 1e-5, level


@pytest.mark.parametrize("name", NAMES)
def test_a_rows_result_does_not_depend_on_its_batch(name) -> None:
    """Each row is quantized on its own and its sums run in one order whatever the rows
    around it (tiles, padding) or the threads: bit for bit the same."""
    weight, _ = weight_of(name, 40, 128, seed=8)
    x = torch.randn(13, 128, generator=torch.Generator().manual_seed(8))
    whole = int16_gemm(x, weight, torch.empty(13, 40))
    for i in (0, 5, 12):
        assert torch.equal(int16_gemm(x[i : i + 1], weight, torch.empty(1, 40)), whole[i : i + 1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(int16_gemm(x, weight, torch.empty(13, 40)), whole)
    finally:
        torch.set_num_threads(before)


def test_rows_apart_by_a_stride() -> None:
    weight, _ = weight_of("Q8_0", 24, 64, seed=3)
    wide = torch.randn(9, 100)
    x = wide[:, 20:84]  # rows 100 apart
    got = int16_gemm(x, weight, torch.empty(9, 24))
    want = int16_gemm(x.contiguous(), weight, torch.empty(9, 24))
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", NAMES)
def test_quant_matrix_takes_it_for_int16(name) -> None:
    """QuantMatrix runs the kernel for a prefill-sized product in int16 (bias and output
    slice passed through), and the integer kernel below GEMM_ROWS rows."""
    weight, _ = weight_of(name, 40, 256, seed=5)
    x, bias = torch.randn(ROWS, 256), torch.randn(40)
    matrix = cpu_kernels.QuantMatrix(weight.blocks, weight.format.ggml_id, 256, bias)
    out = torch.zeros(ROWS, 48)
    got = matrix(x, out[:, 4:44], gemm_dtype=torch.int16)
    assert got.data_ptr() == out[:, 4:].data_ptr()
    assert torch.equal(got, int16_gemm(x, weight, torch.empty(ROWS, 40), bias))
    assert not torch.equal(got, matrix(x))  # not float32's GEMM
    few = x[: cpu_kernels.GEMM_ROWS - 1]
    assert torch.equal(matrix(few, gemm_dtype=torch.int16), matrix(few))


def test_what_it_does_not_take_runs_float32s_gemm() -> None:
    """Another format, a span shorter than the row or a partial product: float32's GEMM."""
    x = torch.randn(ROWS, 512)
    q4_k, _ = weight_of("Q4_K", 24, 512, seed=9)
    plain = cpu_kernels.QuantMatrix(q4_k.blocks, q4_k.format.ggml_id, 512)
    assert torch.equal(plain(x, gemm_dtype=torch.int16), plain(x))
    q8_0 = quantize(torch.randn(24, 512), "Q8_0")
    for kwargs in ({"span": 256}, {"partial": True}):
        matrix = cpu_kernels.QuantMatrix(q8_0.blocks, q8_0.format.ggml_id, 512, **kwargs)
        assert torch.equal(matrix(x, gemm_dtype=torch.int16), matrix(x))


def test_bad_problems_are_refused() -> None:
    weight = quantize(torch.randn(8, 64), "Q4_0")
    x, out = torch.randn(3, 64), torch.empty(3, 8)
    with pytest.raises(ValueError, match="Q4_0, Q4_1 or Q8_0 weights only"):
        int16_gemm(x, weight, out, format_id=99)
    with pytest.raises(ValueError, match="Q4_0, Q4_1 or Q8_0 weights only"):
        int16_gemm(x, weight, out, format_id=FORMATS["Q4_K"].ggml_id)
    with pytest.raises(ValueError, match="row_bytes does not fit k"):
        int16_gemm(x, weight, out, format_id=FORMATS["Q4_1"].ggml_id)  # 40-byte rows
    with pytest.raises(ValueError, match="positive multiple of 32"):
        int16_gemm(x[:, :48], weight, out, row_bytes=27)
    with pytest.raises(ValueError, match="row stride is too small"):
        int16_gemm(x, weight, torch.empty(8, 3).t())  # [3, 8] with rows 1 apart


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_among_the_activations_makes_its_rows_outputs_nan(name, at_level) -> None:
    """As in a float product: a NaN is no larger than anything, so it must not be lost
    in quantizing its block."""
    weight, _ = weight_of(name, 24, 96, seed=5)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(6))
    x[4, 40] = float("nan")
    for level in LEVELS:
        at_level(level)
        got = int16_gemm(x, weight, torch.zeros(9, 24))
        assert got[4].isnan().all(), level
        assert not got[torch.arange(9) != 4].isnan().any(), level
