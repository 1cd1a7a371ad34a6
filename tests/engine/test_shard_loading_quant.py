"""Where a shard's weights stay in their GGUF block formats (shard_loading.quant_problem
and kept_formats), decided on plain data: the device's kind, the file's formats, the
settings. No GPU needed: CUDA's answer is a rule on the formats its Triton kernels take."""

from __future__ import annotations

import pytest
import torch

from appliance.engine.shard_loading import (
    GPU_BLOCK_FORMATS,
    QuantFacts,
    kept_formats,
    quant_problem,
)

ALL = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"})


@pytest.mark.parametrize("formats", [{"Q4_1"}, {"Q4_K", "Q6_K"}, {"Q8_0"}, {"Q4_0"}])
def test_cuda_keeps_the_formats_its_triton_kernels_take(formats: set[str]) -> None:
    facts = QuantFacts("cuda", frozenset(formats))
    assert quant_problem(facts) == ""
    assert kept_formats(facts) == formats


def test_cuda_keeps_a_q4_k_m_files_q5_k_weights_in_blocks_too() -> None:
    # A Q4_K_M file: Q4_K and Q6_K mostly, some Q5_K. All stay in blocks (Q5_K's Triton
    # kernels since issue 39; they loaded dense before).
    facts = QuantFacts("cuda", frozenset({"Q4_K", "Q5_K", "Q6_K"}))
    assert quant_problem(facts) == ""
    assert kept_formats(facts) == {"Q4_K", "Q5_K", "Q6_K"}
    assert kept_formats(QuantFacts("cuda", ALL)) == ALL == GPU_BLOCK_FORMATS


def test_the_cpu_keeps_every_block_format() -> None:
    facts = QuantFacts("cpu", ALL)
    assert quant_problem(facts) == ""
    assert kept_formats(facts) == ALL


def test_float_weights_quantized_at_load_count_as_blocks_on_both() -> None:
    for device in ("cpu", "cuda"):
        facts = QuantFacts(device, frozenset(), quantize="q4_0")
        assert quant_problem(facts) == ""
        assert kept_formats(facts) == {"Q4_0"}
    assert "no weights in block formats" in quant_problem(QuantFacts("cuda", frozenset()))


@pytest.mark.parametrize(
    ("facts", "reason"),
    [
        (QuantFacts("cpu", ALL, cpu_kernels=False), "CPU kernels are not built"),
        (QuantFacts("cpu", ALL, dtype="float16"), "not float16"),
        (QuantFacts("cuda", ALL, triton=False), "triton is not installed"),
        (QuantFacts("mps", ALL), "on mps"),
    ],
)
def test_each_reason_the_path_cannot_run_is_named(facts: QuantFacts, reason: str) -> None:
    assert reason in quant_problem(facts)
    if facts.device == "mps":
        assert kept_formats(facts) == frozenset()


def test_cuda_float16_is_fine_the_triton_kernels_take_it() -> None:
    # The CPU kernels refuse float16 activations; the Triton ones take all three dtypes.
    assert quant_problem(QuantFacts("cuda", ALL, dtype="float16")) == ""


def test_the_gpu_formats_are_the_triton_kernels() -> None:
    triton_quant = pytest.importorskip("appliance.model.layers.triton_quant")
    from appliance.model.quant import FORMATS

    by_id = {fmt.ggml_id: name for name, fmt in FORMATS.items()}
    assert {by_id[i] for i in triton_quant._FORMATS} == GPU_BLOCK_FORMATS


def test_place_quant_moves_every_block_and_a_tied_table_once(tmp_path) -> None:
    # The move build_model makes on CUDA, to the meta device here (no GPU): every
    # QuantLinear's parts and bias and the QuantEmbedding's table leave the CPU, and the
    # tied head keeps sharing the embedding's blocks rather than getting a second copy.
    import torch
    from tiny_gguf import write_gguf

    from appliance.engine.shard_loading import build_model
    from appliance.model import quant
    from appliance.model.loader import load_model_files

    files = load_model_files(write_gguf(tmp_path / "m.gguf"), tmp_path / "cache")
    model = build_model(files, torch.float32, torch.device("cpu"), 64, True)
    assert isinstance(model.embed_tokens, quant.QuantEmbedding)
    assert isinstance(model.lm_head, quant.QuantLinear)
    assert model.lm_head.parts[0].blocks is model.embed_tokens.weight_q.blocks  # tied
    meta = torch.device("meta")
    quant.place_quant(model, meta)
    linears = [m for m in model.modules() if isinstance(m, quant.QuantLinear)]
    assert len(linears) == 9  # 2 layers x 4 projections, the head
    assert all(p.blocks.device == meta for m in linears for p in m.parts)
    assert all(m.bias is None or m.bias.device == meta for m in linears)
    assert all(q.blocks.device == meta for m in linears for q in m._matrices)
    table = model.embed_tokens.weight_q
    assert table.blocks.device == meta
    assert model.lm_head.parts[0].blocks is table.blocks  # moved once, still shared
    quant.place_quant(model, torch.device("cpu"))  # the CPU's stay: nothing to move
    assert model.embed_tokens.weight_q is table


def test_a_quantized_model_computes_in_float32_on_the_cpu_and_as_resolved_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One rule for a target and its draft (draft_loading picked float32 for a quantized
    draft on CUDA too, where the Triton products take bfloat16)."""
    from appliance.engine import shard_loading

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert shard_loading.activation_dtype("auto", True, cpu) == torch.float32
    assert shard_loading.activation_dtype("bfloat16", True, cpu) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert shard_loading.activation_dtype("auto", True, cuda) == torch.bfloat16
    assert shard_loading.activation_dtype("auto", False, cuda) == torch.bfloat16
