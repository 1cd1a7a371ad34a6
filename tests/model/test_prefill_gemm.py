"""The GEMM a prefill-sized quantized product runs (cpu_kernels.QuantMatrix, GEMM_ROWS rows
or more): float32, bfloat16 or the int16 GEMM, as the `prefill_gemm` setting says (auto:
bfloat16 on CPUs with AVX512-BF16 at the avx512 level, int16 at the avx2 and avx512
levels otherwise). The int16 GEMM's own tests: test_quant_gemm.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.model import cpu_kernels
from appliance.model.cpu_kernels.loading import compiled
from appliance.model.quant import QuantLinear, QuantWeight, quantize
from appliance.settings.config import load_settings

ROWS = cpu_kernels.GEMM_ROWS + 3
LEVELS = cpu_kernels.cpu_levels()


def q4_0(n: int, k: int, seed: int) -> QuantWeight:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize(weight, "Q4_0")


def matrix(weight: QuantWeight, **kwargs: object) -> cpu_kernels.QuantMatrix:
    return cpu_kernels.QuantMatrix(
        weight.blocks, weight.format.ggml_id, weight.in_features, **kwargs
    )


def test_a_bfloat16_gemm_rounds_each_product_to_bfloat16_and_no_further() -> None:
    weight = q4_0(48, 256, seed=1)
    x = torch.randn(ROWS, 256, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ weight.dequantize().double().t()
    size = x.abs().double() @ weight.dequantize().abs().double().t()
    got = matrix(weight)(x, gemm_dtype=torch.bfloat16)
    assert got.dtype == torch.float32
    assert torch.equal(got, got.bfloat16().float())  # bfloat16's products, nothing finer
    assert ((got.double() - exact).abs() / size).max() < 2**-7  # inputs and product rounded
    float32 = matrix(weight)(x)
    assert not torch.equal(float32, float32.bfloat16().float())
    assert ((float32.double() - exact).abs() / size).max() < 1e-6


def test_below_gemm_rows_the_integer_kernel_serves_whatever_the_gemm_type() -> None:
    weight = q4_0(40, 256, seed=3)
    x = torch.randn(cpu_kernels.GEMM_ROWS - 1, 256, generator=torch.Generator().manual_seed(4))
    assert torch.equal(
        matrix(weight)(x, gemm_dtype=torch.bfloat16), matrix(weight)(x, gemm_dtype=torch.float32)
    )


def test_a_bias_is_added_in_float32_after_the_bfloat16_product() -> None:
    weight, bias = q4_0(32, 128, seed=5), torch.randn(32)
    x = torch.randn(ROWS, 128, generator=torch.Generator().manual_seed(6))
    out = torch.zeros(ROWS, 40)
    got = matrix(weight, bias=bias)(x, out[:, 4:36], gemm_dtype=torch.bfloat16)
    assert got.data_ptr() == out[:, 4:].data_ptr()
    assert torch.equal(got, matrix(weight)(x, gemm_dtype=torch.bfloat16) + bias)
    assert out[:, :4].abs().sum() == 0 and out[:, 36:].abs().sum() == 0


def test_bfloat16_shards_of_whole_spans_sum_to_the_whole_product_bit_for_bit() -> None:
    """A row-parallel projection's shards give the whole product's result in bfloat16
    too: each span is the same GEMM in both."""
    span, k = 96, 3 * 96
    weight = q4_0(40, k, seed=7)
    x = torch.randn(ROWS, k, generator=torch.Generator().manual_seed(8))
    whole = matrix(weight, span=span)(x, gemm_dtype=torch.bfloat16)
    partials = []
    for start, stop in itertools.pairwise((0, 2 * span, k)):
        part = weight.column_slice(slice(start, stop))
        shard = cpu_kernels.QuantMatrix(
            part.blocks, part.format.ggml_id, stop - start, span=span, partial=True
        )
        partials.append(shard(x[:, start:stop].contiguous(), gemm_dtype=torch.bfloat16))
    assert torch.equal((partials[0] + partials[1]).float(), whole)


def test_the_setting_names_the_gemm_type_and_auto_follows_the_cpu(at_level) -> None:
    assert cpu_kernels.prefill_gemm_dtype("float32") == torch.float32
    assert cpu_kernels.prefill_gemm_dtype("bfloat16") == torch.bfloat16
    assert cpu_kernels.prefill_gemm_dtype("int16") == torch.int16
    with pytest.raises(ValueError, match="prefill_gemm 'fp8'"):
        cpu_kernels.prefill_gemm_dtype("fp8")
    at_level("generic")  # its int16 GEMM is plain C: slower than torch's float32
    assert cpu_kernels.prefill_gemm_dtype("auto") == torch.float32
    if "avx2" in LEVELS:
        at_level("avx2")  # bfloat16 is emulated below AVX-512: the int16 GEMM
        assert cpu_kernels.prefill_gemm_dtype("auto") == torch.int16
    at_level("auto")
    kernels = compiled()
    assert kernels is not None
    if kernels.LEVEL == "avx512":
        bf16 = "avx512bf16" in kernels.cpu_features()
        assert cpu_kernels.prefill_gemm_dtype("auto") == (torch.bfloat16 if bf16 else torch.int16)


def test_a_loaded_model_multiplies_its_prefills_as_the_setting_says() -> None:
    for choice, dtype in [("int16", torch.int16), ("auto", cpu_kernels.prefill_gemm_dtype())]:
        settings = load_settings(
            device="cpu", weights="quantized", prefill_gemm=choice, kv={"num_blocks": 16}
        )
        model = LLMEngine.from_settings(settings).model
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert linears and {m.gemm_dtype for m in linears} == {dtype}, choice
