"""The GEMM a prefill-sized quantized product runs (cpu_kernels.QuantMatrix, GEMM_ROWS rows
or more): float32, bfloat16 or the int16 GEMM, as the `prefill_gemm` setting says (auto:
bfloat16 on CPUs with AVX512-BF16 at the avx512 level, int16 at the avx2 and avx512
levels otherwise). The int16 GEMM's own tests: test_quant_gemm.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.model import cpu_kernels
from appliance.model.cpu_kernels import loading
from appliance.model.cpu_kernels.loading import GEMM_ROWS_BY_LEVEL, compiled
from appliance.model.quant import PrefillGemm, QuantLinear, QuantWeight, quantize
from appliance.settings.config import SettingsError, load_settings

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


@pytest.mark.process  # the slow lane: the whole embedded model
def test_a_loaded_model_multiplies_its_prefills_as_the_setting_says() -> None:
    cases: list[tuple[str, torch.dtype, int | str]] = [
        ("int16", torch.int16, 24),
        ("auto", cpu_kernels.prefill_gemm_dtype(), "auto"),
    ]
    for choice, dtype, rows in cases:
        settings = load_settings(
            device="cpu",
            weights="quantized",
            prefill_gemm=choice,
            prefill_gemm_rows=rows,
            kv={"num_blocks": 16},
        )
        model = LLMEngine.from_settings(settings).model
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert linears and {m.gemm_dtype for m in linears} == {dtype}, choice
        # One PrefillGemm for the model and every projection: the step's rows reach all.
        assert model.prefill_gemm is not None
        assert all(m.prefill is model.prefill_gemm for m in linears)
        assert model.prefill_gemm.rows == cpu_kernels.prefill_gemm_rows(rows, dtype)


# ---------------------------------------------------------------- where the switch is


def test_a_product_switches_at_the_rows_it_is_given() -> None:
    weight = q4_0(40, 256, seed=7)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(8))
    kernel = matrix(weight)(x, gemm_rows=None)
    gemm = matrix(weight)(x, gemm_rows=1)
    assert not torch.equal(kernel, gemm)  # the activations' rounding tells them apart
    assert torch.equal(matrix(weight)(x, gemm_rows=40), gemm)
    assert torch.equal(matrix(weight)(x, gemm_rows=41), kernel)
    assert torch.equal(matrix(weight)(x), kernel)  # the default: GEMM_ROWS
    assert torch.equal(matrix(weight)(x[:31], gemm_rows=32), kernel[:31])


def test_the_row_count_is_a_setting_or_the_table_for_this_cpu(at_level) -> None:
    assert cpu_kernels.prefill_gemm_rows(24) == 24
    with pytest.raises(ValueError, match="at least 1"):
        cpu_kernels.prefill_gemm_rows(0)
    with pytest.raises(ValueError, match="'fast' is not auto"):
        cpu_kernels.prefill_gemm_rows("fast")
    for level in LEVELS:
        at_level(level)
        for dtype in (torch.float32, torch.bfloat16, torch.int16):
            want = GEMM_ROWS_BY_LEVEL[(level, dtype)]  # every level and type has its row
            assert cpu_kernels.prefill_gemm_rows("auto", dtype) == want
        auto = cpu_kernels.prefill_gemm_dtype()
        assert cpu_kernels.prefill_gemm_rows() == GEMM_ROWS_BY_LEVEL[(level, auto)]
    for bad in (0, "many"):
        with pytest.raises(SettingsError, match=r"prefill_gemm_rows .* row count of 1 or more"):
            load_settings(prefill_gemm_rows=bad)
    assert load_settings(prefill_gemm_rows="40").prefill_gemm_rows == 40  # as a flag gives it


def linear(weight: QuantWeight, rows: int) -> QuantLinear:
    projection = QuantLinear([weight], None)
    projection.prefill = PrefillGemm(torch.float32, rows)
    return projection


def test_a_projection_switches_on_its_steps_prompt_rows_only() -> None:
    """A decode-only step of more rows than the switch stays on the integer kernel, and
    each of its rows is what that row alone gives; prompt rows from the count on switch
    the step (its decode rows ride along), fewer do not."""
    weight = q4_0(48, 256, seed=9)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(10))
    kernel = matrix(weight)(x, gemm_rows=None)
    gemm = matrix(weight)(x, gemm_rows=1)
    projection = linear(weight, rows=8)
    projection.prefill.step_rows = 0  # decode-only: 20 sequences
    assert torch.equal(projection(x), kernel)
    for row in (0, 7, 19):
        assert torch.equal(projection(x[row : row + 1])[0], kernel[row])
    projection.prefill.step_rows = 5  # 5 prompt rows beside 15 decodes: below the count
    assert torch.equal(projection(x), kernel)
    projection.prefill.step_rows = 12  # 12 prompt rows and 8 decodes
    assert torch.equal(projection(x), gemm)
    projection.prefill.step_rows = None  # outside a model's step: its own rows decide
    assert torch.equal(projection(x), gemm)
    assert torch.equal(projection(x[:7]), kernel[:7])


def count_dequantizations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that each dequantization of a whole weight (a GEMM's, not an embedding
    lookup's rows) appends to, while `monkeypatch` holds the kernels' spy."""
    built = compiled()
    assert built is not None
    dequantized: list[int] = []

    class Spy:
        """The built kernels, with each dequantization of a whole weight counted."""

        def __getattr__(self, name: str) -> object:
            return getattr(built, name)

        def quant_rows(self, *args: int) -> None:
            count, total = args[3], args[4]
            if count == total:
                dequantized.append(count)
            self.__getattr__("quant_rows")(*args)  # type: ignore[operator]

    monkeypatch.setattr(loading, "_cpu_kernels", Spy())
    return dequantized


def switched_engine(**speculative: object) -> LLMEngine:
    """The embedded model's quantized layers (the compiled decode step off, as under
    tensor parallelism) with the GEMM switch at 4 prompt rows."""
    settings = load_settings(
        device="cpu",
        weights="quantized",
        prefill_gemm="float32",
        prefill_gemm_rows=4,
        kv={"num_blocks": 64, "prefix_caching": False},
        speculative=speculative or {"method": "off"},
    )
    engine = LLMEngine.from_settings(settings)
    engine.model.decode_step = None
    return engine


@pytest.mark.process  # the slow lane: the whole embedded model
def test_a_models_decode_steps_stay_on_the_integer_kernel_whatever_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the model's layers (the compiled decode step off, as under tensor parallelism),
    with the switch at 4 rows: the prompts' step dequantizes the weights for GEMMs; the
    decode-only steps of 6 sequences never do, and answer as each sequence alone does."""
    engine = switched_engine()
    dequantized = count_dequantizations(monkeypatch)
    prompts = [[(17 * i + 5 * j) % 900 + 10 for j in range(8)] for i in range(6)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    together: dict[int, list[int]] = {i: [] for i in ids}
    for output in engine.step():  # six prompts of 8 tokens: 48 prompt rows
        together[output.seq_id] += output.token_ids
    assert dequantized, "the prompts' step ran no GEMM"
    while engine.has_unfinished():
        dequantized.clear()
        for output in engine.step():
            together[output.seq_id] += output.token_ids
        assert not dequantized, "a decode-only step of 6 rows ran a GEMM"
    monkeypatch.undo()
    # Each prompt alone (its prefill on the GEMM too: 8 rows) decodes the same tokens.
    for prompt, seq_id in zip(prompts, ids, strict=True):
        [alone] = engine.generate([prompt], params)
        assert alone.token_ids == together[seq_id]


@pytest.mark.process  # the slow lane: the whole embedded model
def test_verify_steps_stay_on_the_integer_kernel_as_plain_decoding_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A verify chunk (one token and its drafts: 5 rows) attends as a segment but decodes:
    with the switch at 4 rows its products stay on the integer kernel, so speculation's
    greedy answer is plain decoding's token for token."""
    text = "The river wound past farms and mills to the old stone bridge by the town."
    engine = switched_engine(method="ngram", num_speculative_tokens=4, adaptive=False)
    prompt = engine.tokenizer.encode(text + "\n" + text + "\n" + text[:30])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    dequantized = count_dequantizations(monkeypatch)
    seq_id = engine.add_request(prompt, params)
    tokens: list[int] = []
    for output in engine.step():  # the prompt: a GEMM
        tokens += output.token_ids
    assert dequantized, "the prompt's step ran no GEMM"
    while engine.has_unfinished():
        dequantized.clear()
        for output in engine.step():
            assert output.seq_id == seq_id
            tokens += output.token_ids
        assert not dequantized, "a verify or decode step ran a GEMM"
    assert engine.scheduler.acceptance.drafted > 0, "no drafts were verified"
    monkeypatch.undo()
    engine.scheduler.drafter = None
    [plain] = engine.generate([prompt], params)
    assert plain.token_ids == tokens
