"""Block-quantized weights multiplied in place (model/quant.py, csrc/quant_matmul.c).

Each format's kernel is checked against a float64 product of the weights gguf-py
dequantizes from the same random blocks, at every instruction-set level this CPU runs.
Two tolerances, both relative to sum(|w| |x|) of each output (the size a rounding error
is measured against):
- 1e-5 against the product with the activations quantized per 32 as the kernel does
  (int8 and one scale each, and in the precise form a second int8 for the remainder):
  the integer dots are exact, only float sums round;
- against the product with the float activations themselves, what quantizing them
  costs: 1e-4 in the precise form (about 16 bits), 1e-2 with one int8 (llama.cpp's Q8
  activations cost the same).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from quant_blocks import random_blocks

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.scheduler import SchedulerLimits
from appliance.engine.sequence import SamplingParams
from appliance.engine.shard_loading import use_quant
from appliance.kv.cache import KVCache
from appliance.model import cpu_kernels
from appliance.model.loader import load_model_files
from appliance.model.quant import FORMATS, QuantEmbedding, QuantLinear, QuantWeight, quantize
from appliance.settings.config import load_settings

LEVELS = cpu_kernels.cpu_levels()


def quantized_activations(x: np.ndarray, precise: bool) -> np.ndarray:
    """x [m, k] as the kernel sees it: int8 per 32 with scale max|x| / 127 and, precise,
    the remainder as a second int8 in steps of scale / 256; as floats."""
    groups = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(groups).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(groups * inv)
    value = q.astype(np.float64) * d
    if precise:
        rest = np.clip(np.rint((groups - q * d) * inv * np.float32(256)), -127, 127)
        value = (q.astype(np.float64) * 256 + rest) * (d.astype(np.float64) / 256)
    return value.reshape(x.shape)


def test_the_kernels_run_at_a_level_of_this_cpu() -> None:
    assert LEVELS and LEVELS[0] == "generic", "no kernels built: re-run ./install.sh"
    assert cpu_kernels.level() in LEVELS


def test_cpu_isa_caps_the_level(at_level) -> None:
    assert at_level("generic") == "generic"
    assert at_level("auto") == LEVELS[-1]
    # A level above this CPU's is a cap, not a demand: it takes the best one below.
    assert at_level("avx512") == LEVELS[-1]
    with pytest.raises(ValueError, match="cpu_isa 'sse9'"):
        at_level("sse9")


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 512), (5, 64, 768), (17, 129, 256)])
@pytest.mark.parametrize("precise", [True, False])
def test_each_format_matches_a_float64_product(name, m, n, k, precise, at_level) -> None:
    raw = random_blocks(name, n, k, seed=m * 1000 + n)
    w = dequantize(raw, GGMLQuantizationType[name]).reshape(n, k).astype(np.float64)
    weight = QuantWeight(FORMATS[name], torch.from_numpy(raw), k)
    assert torch.equal(weight.dequantize(), torch.from_numpy(w).float())  # unpacking is exact
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    exact = x.double().numpy() @ w.T
    as_kernel = quantized_activations(x.numpy(), precise) @ w.T
    size = np.abs(x.double().numpy()) @ np.abs(w).T
    results = {}
    for level in LEVELS:
        at_level(level)
        got = cpu_kernels.quant_matmul(x, weight.blocks, weight.format.ggml_id, k, precise=precise)
        results[level] = got.double().numpy()
        assert np.max(np.abs(results[level] - as_kernel) / size) < 1e-5, level
        assert np.max(np.abs(results[level] - exact) / size) < (1e-4 if precise else 1e-2), level
    for level, got in results.items():  # every level gives the same numbers
        assert np.max(np.abs(got - results["generic"]) / size) < 1e-5, level


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("precise", [True, False])
def test_a_rows_result_does_not_depend_on_its_batch(name, precise, at_level) -> None:
    """Each row is quantized on its own and summed in one order whatever tile it falls in
    (up to 6 rows a pass over the weights on AVX-512, 4 on AVX2) and whatever rows are
    beside it: a verify chunk's rows give, bit for bit, what each gives alone or in a
    16-row decode batch, at every level. The block formats' 19 groups end in a part chunk."""
    n, k = 24, 768 if name.endswith("_K") else 608
    weight = QuantWeight(FORMATS[name], torch.from_numpy(random_blocks(name, n, k, seed=5)), k)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(5))
    fmt = weight.format.ggml_id
    for level in LEVELS:
        at_level(level)
        whole = cpu_kernels.quant_matmul(x, weight.blocks, fmt, k, precise=precise)
        for start, stop in [(0, 1), (16, 17), (3, 8), (4, 10), (2, 11), (0, 16), (1, 9)]:
            part = cpu_kernels.quant_matmul(x[start:stop], weight.blocks, fmt, k, precise=precise)
            assert torch.equal(part, whole[start:stop]), (level, start, stop)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_strided_rows_and_bfloat16(dtype: torch.dtype) -> None:
    weight = quantize(torch.randn(48, 96), "Q8_0")
    bias = torch.randn(48)
    wide = torch.randn(3, 200).to(dtype)
    x = wide[:, 50:146]  # rows 200 apart
    out = torch.zeros(3, 100, dtype=dtype)
    got = cpu_kernels.quant_matmul(x, weight.blocks, 8, 96, bias, out[:, 10:58])
    want = cpu_kernels.quant_matmul(x.contiguous().float(), weight.blocks, 8, 96, bias)
    assert got.data_ptr() == out[:, 10:58].data_ptr() and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, rtol=tolerance, atol=tolerance * 10)
    assert out[:, :10].abs().sum() == 0 and out[:, 58:].abs().sum() == 0


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_prefill_sized_product_is_the_dequantized_weights_gemm(name) -> None:
    """From GEMM_ROWS rows on, float32 products dequantize the weight and run torch's
    GEMM: the float product of the dequantized weights (no activation rounding), into a
    column slice of a wider output, bias added."""
    rows, n, k = cpu_kernels.GEMM_ROWS + 3, 40, 256
    raw = random_blocks(name, n, k, seed=7)
    weight = QuantWeight(FORMATS[name], torch.from_numpy(raw), k)
    w = dequantize(raw, GGMLQuantizationType[name]).reshape(n, k).astype(np.float64)
    x, bias = torch.randn(rows, k), torch.randn(n)
    out = torch.zeros(rows, n + 8)
    matrix = cpu_kernels.QuantMatrix(weight.blocks, weight.format.ggml_id, k, bias)
    got = matrix(x, out[:, 4 : 4 + n])
    exact = x.double().numpy() @ w.T + bias.double().numpy()
    size = np.abs(x.double().numpy()) @ np.abs(w).T + 1
    assert got.data_ptr() == out[:, 4:].data_ptr()
    assert np.max(np.abs(got.double().numpy() - exact) / size) < 1e-6
    assert out[:, :4].abs().sum() == 0 and out[:, 4 + n :].abs().sum() == 0
    # one row fewer: the integer kernel, the activations rounded to about 16 bits
    fewer = matrix(x[: cpu_kernels.GEMM_ROWS - 1]).double().numpy()
    below = cpu_kernels.GEMM_ROWS - 1
    assert np.max(np.abs(fewer - exact[:below]) / size[:below]) < 1e-4


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [3, cpu_kernels.GEMM_ROWS + 1])  # integer kernel, GEMM
def test_shards_of_whole_spans_sum_to_the_whole_product_bit_for_bit(name, rows, at_level) -> None:
    """A product summed span by span (a row-parallel projection's): shards holding whole
    spans give float64 partials whose sum rounds to the whole product's float32 result,
    at every level; and the spans only regroup the sums (close to the plain product)."""
    span = 256 if name.endswith("_K") else 96
    n, k = 40, 3 * 256
    raw = random_blocks(name, n, k, seed=11)
    weight = QuantWeight(FORMATS[name], torch.from_numpy(raw), k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    for level in LEVELS:
        at_level(level)
        whole = cpu_kernels.QuantMatrix(weight.blocks, weight.format.ggml_id, k, span=span)(x)
        cut = (0, 2 * span, k)  # uneven: two spans, then the rest
        partials = []
        for start, stop in itertools.pairwise(cut):
            part = weight.column_slice(slice(start, stop))
            shard = cpu_kernels.QuantMatrix(
                part.blocks, part.format.ggml_id, stop - start, span=span, partial=True
            )
            partials.append(shard(x[:, start:stop].contiguous()))
        assert partials[0].dtype == torch.float64
        assert torch.equal((partials[0] + partials[1]).float(), whole), level
        plain = cpu_kernels.quant_matmul(x, weight.blocks, weight.format.ggml_id, k)
        size = x.abs() @ weight.dequantize().abs().t()
        assert ((whole - plain).abs() / size).max() < 1e-5, level


def test_bad_problems_are_refused() -> None:
    weight = quantize(torch.randn(8, 64), "Q4_0")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x has 32 features"):
        cpu_kernels.quant_matmul(x[:, :32], weight.blocks, 2, 64)
    with pytest.raises(ValueError, match="row_bytes does not fit k"):
        cpu_kernels.quant_matmul(x, weight.blocks, 3, 64)  # Q4_1 rows are 40 bytes
    with pytest.raises(ValueError, match="unknown weight format"):
        cpu_kernels.quant_matmul(x, weight.blocks, 99, 64)
    with pytest.raises(ValueError, match="row index is out of range"):
        cpu_kernels.quant_rows(weight.blocks, 2, 64, torch.tensor([8]))
    with pytest.raises(ValueError, match="whole 256-value blocks"):
        QuantWeight(FORMATS["Q4_K"], torch.zeros(2, 144, dtype=torch.uint8), 200)
    with pytest.raises(ValueError, match="do not hold 64 Q4_0 values"):
        QuantWeight(FORMATS["Q4_0"], torch.zeros(2, 30, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="Q8_0 or Q4_0"):
        quantize(torch.randn(2, 64), "Q5_K")
    with pytest.raises(ValueError, match="span 48 does not divide"):
        cpu_kernels.QuantMatrix(weight.blocks, 2, 64, span=48)
    with pytest.raises(ValueError, match="multiple of the format's block size"):
        cpu_kernels.quant_matmul(x, weight.blocks, 2, 64, span=16)
    with pytest.raises(ValueError, match="takes no bias"):
        cpu_kernels.QuantMatrix(weight.blocks, 2, 64, torch.zeros(8), partial=True)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_quantizing_at_load_round_trips(name: str) -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    weight = quantize(w, name)
    reference = dequantize(weight.blocks.numpy(), GGMLQuantizationType[name]).reshape(16, 128)
    assert torch.equal(weight.dequantize(), torch.from_numpy(reference))
    step = w.abs().max(dim=1).values[:, None] / (127 if name == "Q8_0" else 7)
    assert ((weight.dequantize() - w).abs() <= step).all()


def test_a_fused_projection_of_mixed_formats_keeps_its_parts() -> None:
    q = quantize(torch.randn(64, 96), "Q8_0")
    k = QuantWeight(FORMATS["Q4_1"], torch.from_numpy(random_blocks("Q4_1", 32, 96, 3)), 96)
    bias = torch.randn(96)
    fused = QuantLinear([q, k], bias)
    assert len(fused.parts) == 2 and fused.out_features == 96
    x = torch.randn(4, 96)
    want = torch.cat([QuantLinear([q], bias[:64])(x), QuantLinear([k], bias[64:])(x)], dim=1)
    assert torch.equal(fused(x), want)


def test_embedding_rows_are_the_dequantized_rows() -> None:
    table = quantize(torch.randn(50, 64), "Q8_0")
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(QuantEmbedding(table, torch.float32)(ids), table.dequantize()[ids])


def test_the_quantized_model_keeps_its_blocks_and_its_memory_small(quant_engine) -> None:
    model = quant_engine.model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * model.config.num_layers + 1  # and the tied head
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert model.lm_head.parts[0] is model.embed_tokens.weight_q  # tied: one copy
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    stored = sum(m.weight_bytes() for m in linears[:-1]) + linears[-1].weight_bytes()
    file_size = quant_engine_source_size()
    assert stored < file_size  # the blocks as the file has them, nothing dequantized
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    assert floats < 0.01 * file_size  # only norms are float


def quant_engine_source_size() -> int:
    from appliance.model.model_source import default_model_path

    return default_model_path().stat().st_size


def test_the_quantized_engine_answers_and_prefix_caching_changes_nothing(quant_engine) -> None:
    tokenizer = quant_engine.tokenizer
    system = "You are a terse assistant. Answer in one sentence. " * 4
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}]
        )
        for q in ("Name a color.", "Name a fruit.", "Name a planet.")
    ]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    without = [quant_engine.generate([p], params)[0].token_ids for p in prompts]
    kv = KVCache(quant_engine.kv.layout, 64, torch.device("cpu"))
    limits = SchedulerLimits(8, 2048, 512, 2048)
    cached = LLMEngine(quant_engine.model, tokenizer, kv, limits, prefix_caching=True)
    with_cache = [cached.generate([p], params)[0].token_ids for p in prompts]
    assert with_cache == without
    assert all(len(t) == 24 for t in without)


def test_every_level_answers_alike(quant_engine, at_level) -> None:
    """The same greedy tokens at each level: the integer dots are exact, and float sums
    differ only in rounding."""
    ids = quant_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What do bees make?"}]
    )
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    answers = {}
    for level in LEVELS:
        at_level(level)
        answers[level] = quant_engine.generate([ids], params)[0].token_ids
    assert len({tuple(a) for a in answers.values()}) == 1, answers


def test_weights_quantized_says_why_it_cannot_run(tmp_path) -> None:
    files = load_model_files(None, load_settings().cache_dir)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="not float16"):
        use_quant(load_settings(weights="quantized", dtype="float16"), files, cpu)
    with pytest.raises(ValueError, match="no kernels multiply block-quantized weights on mps"):
        use_quant(load_settings(weights="quantized"), files, torch.device("mps"))
    assert not use_quant(load_settings(weights="auto"), files, torch.device("mps"))
    # CUDA's Triton kernels take the file's Q4_1 (tests/engine/test_shard_loading_quant.py)
    assert use_quant(load_settings(weights="auto"), files, torch.device("cuda"))
    assert not use_quant(load_settings(weights="dense"), files, cpu)
    assert use_quant(load_settings(weights="int4"), files, cpu)  # the older name
