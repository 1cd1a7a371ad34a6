"""A GGUF's block weights on the GPU path, under Triton's interpreter: the embedding
lookup (triton_quant.quant_rows, the table kept in blocks) against the CPU kernels'
lookup, bit for bit, and a whole tiny quantized model's forward with every QuantLinear
and its QuantEmbedding on the Triton kernels against the same model on the CPU kernels.

There is no GPU here: the child forces the modules' kernel choice (quant.runs_triton, as
test_triton_quant.py reaches QuantLinear's GPU path) while the tensors stay on the CPU,
so attention and the norms run their CPU code and only the quantized products and the
lookup change path. The models are tests/helpers/tiny_gguf.py's tied llama (2 layers,
hidden 64): its matrices in Q8_0, and the float file quantized to Q4_0 at load; and two
tensor-parallel shards of the Q8_0 one against the whole.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
import torch
from interpreter_child import child_results, run_jobs

# The interpreter runs in a child process: the slow lane's kind of test.
pytestmark = pytest.mark.process

FORMATS = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
LOOKUP_DTYPES = ("float32", "bfloat16", "float16")
# Rows looked up: repeats, the first and last rows, an odd count (a partial row tile).
IDS = [69, 0, 5, 5, 33, 68, 1]
MODELS = ("q8_0_file", "q4_0_at_load")
TOKENS = (5, 12)  # the GEMV's rows, the GEMM's (triton_quant.GEMM_TOKENS is 8)
# Over the largest |logit|: bfloat16's half-ulp. The Triton products sum float32 values
# of the exact weights; the CPU kernels carry activations as two int8 parts (~2e-5).
LOGIT_TOLERANCE = 2**-8
DENSE_TOLERANCE = 1e-5
# Two shards against the whole model: float32 sums of each half of a row-parallel
# product's inputs, added in float64, against one float32 sum; the tiny model's N(0, 1)
# weights grow its activations layer by layer (measured: 2.5e-5). A wrong cut is O(1).
TP_TOLERANCE = 1e-4


@contextmanager
def _triton_path() -> Iterator[None]:
    """QuantLinear and QuantEmbedding take their CUDA branch (the Triton kernels) for CPU
    tensors while this runs."""
    from appliance.model import quant

    chooser = quant.runs_triton
    quant.runs_triton = lambda device: True  # type: ignore[assignment]
    try:
        yield
    finally:
        quant.runs_triton = chooser


def _lookup_differs(name: str, dtype: str) -> int:
    """How many looked-up values the Triton lookup gives other bits than the CPU
    kernels' (float16: their float32 rounded to float16, which they do not write)."""
    from test_triton_quant import _weight

    from appliance.model import cpu_kernels
    from appliance.model.layers import triton_quant

    in_features = 512 if name.endswith("_K") else 9 * 32
    blocks, _ = _weight(name, 70, in_features)
    ids = torch.tensor(IDS)
    wanted = getattr(torch, dtype)
    out = triton_quant.quant_rows(blocks, FORMATS[name], in_features, ids, wanted)
    cpu_dtype = torch.float32 if wanted == torch.float16 else wanted
    cpu = cpu_kernels.quant_rows(blocks, FORMATS[name], in_features, ids, cpu_dtype).to(wanted)
    assert out.dtype == wanted and out.shape == cpu.shape
    bits = torch.int32 if wanted == torch.float32 else torch.int16
    return int((out.view(bits) != cpu.view(bits)).sum())


def _embedding_differs() -> int:
    """QuantEmbedding's lookup on its GPU branch against its CPU one (bfloat16 rows)."""
    from appliance.model import quant

    table = quant.quantize(torch.randn(50, 96), "Q4_0")
    embedding = quant.QuantEmbedding(table, torch.bfloat16)
    ids = torch.tensor([3, 49, 0, 3])
    cpu = embedding(ids)
    with _triton_path():
        gpu_path = embedding(ids)
    return int((gpu_path.view(torch.int16) != cpu.view(torch.int16)).sum())


def _models(kind: str, folder: Path) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """A tiny quantized llama built as a worker builds it (float32 activations), and for
    the Q8_0 file the dense float32 model of the same (dequantized) weights."""
    from tiny_gguf import write_gguf

    from appliance.engine.shard_loading import build_model
    from appliance.model.loader import load_model_files

    path = write_gguf(folder / f"{kind}.gguf", blocks=kind == "q8_0_file")
    files = load_model_files(path, folder / f"{kind}-cache")
    cpu = torch.device("cpu")
    quantize_to = "q4_0" if kind == "q4_0_at_load" else "none"
    model = build_model(files, torch.float32, cpu, 64, True, quantize_to=quantize_to)
    dense = build_model(files, torch.float32, cpu, 64) if kind == "q8_0_file" else None
    return model, dense


def _prefill_logits(model: torch.nn.Module, ids: torch.Tensor, logits: bool = True) -> torch.Tensor:
    """A prompt's logits [n, vocab] in one prefill step (or the hidden states [n, hidden])."""
    from appliance.model.layers.paged_attention import AttentionBatch, PrefillSegment
    from appliance.model.tensor_parallel import kv_head_ranges

    cfg = model.config
    kv_heads = len(kv_head_ranges(cfg.num_kv_heads, model.shard.size)[model.shard.rank])
    kv = torch.zeros(cfg.num_layers, 2, 1, 16, kv_heads, cfg.head_dim)
    n = len(ids)
    batch = AttentionBatch(torch.arange(n), [PrefillSegment(0, n, n, torch.tensor([0]))], n, [])
    hidden = model(ids, torch.arange(n), batch, kv)
    return model.logits(hidden) if logits else hidden


def _model_error(kind: str, tokens: int) -> dict[str, float]:
    """The whole model's prefill logits on the Triton path against the CPU kernels' (and
    the dense float32 model's, where built), over the largest |logit|; and how many of
    its projections are block-quantized."""
    from appliance.model import quant

    with tempfile.TemporaryDirectory() as folder:
        model, dense = _models(kind, Path(folder))
    quantized = sum(isinstance(m, quant.QuantLinear) for m in model.modules())
    embedded = isinstance(model.embed_tokens, quant.QuantEmbedding)
    ids = torch.arange(tokens) * 7 % model.config.vocab_size
    cpu = _prefill_logits(model, ids)
    with _triton_path():
        gpu_path = _prefill_logits(model, ids)
    scale = cpu.abs().max().item()
    found = {"cpu": (gpu_path - cpu).abs().max().item() / scale}
    if dense is not None:
        found["dense"] = (gpu_path - _prefill_logits(dense, ids)).abs().max().item() / scale
    return {**found, "quantized": quantized, "embedding": float(embedded)}


def _tp_error(tokens: int) -> dict[str, float]:
    """Two tensor-parallel shards of the Q8_0 model (lockstep threads summing their
    float64 partials; the Triton launches taken one at a time, as the interpreter patches
    triton.language while it runs one) on the Triton path, against the whole model on it:
    over the largest |logit|; and the partials' dtype."""
    import threading

    from random_models import LockstepSum
    from tiny_gguf import write_gguf

    from appliance.engine.shard_loading import build_model
    from appliance.model import quant
    from appliance.model.layers import triton_quant
    from appliance.model.loader import load_model_files
    from appliance.model.tensor_parallel import Shard

    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as folder:
        files = load_model_files(write_gguf(Path(folder) / "m.gguf"), Path(folder) / "cache")
        whole = build_model(files, torch.float32, cpu, 64, True)
        summed = LockstepSum(2)
        shards = [
            build_model(
                files, torch.float32, cpu, 64, True, Shard(r, 2), summed.for_rank(r), "none", (2,)
            )
            for r in range(2)
        ]
    ids = torch.arange(tokens) * 5 % whole.config.vocab_size
    one_at_a_time = threading.Lock()
    launches = {name: getattr(triton_quant, name) for name in ("quant_matmul", "quant_rows")}

    def locked(run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object) -> torch.Tensor:
            with one_at_a_time:
                return run(*args)

        return call

    hidden: list[torch.Tensor | None] = [None, None]
    partials: list[torch.dtype] = []

    def run(rank: int) -> None:
        hidden[rank] = _prefill_logits(shards[rank], ids, logits=False)

    with _triton_path():
        want = _prefill_logits(whole, ids)
        for name, launch in launches.items():
            setattr(triton_quant, name, locked(launch))
        try:
            threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            o_proj = shards[0].layers[0].self_attn.o_proj
            assert isinstance(o_proj, quant.QuantLinear)
            partials.append(o_proj(torch.randn(2, o_proj.in_features)).dtype)
        finally:
            for name, launch in launches.items():
                setattr(triton_quant, name, launch)
    first = hidden[0]
    assert first is not None, "a shard computed nothing (see the thread's traceback)"
    got = shards[0].logits(first)
    error = (got - want).abs().max().item() / want.abs().max().item()
    return {"error": error, "float64_partials": float(partials == [torch.float64])}


def _child() -> dict[str, object]:
    torch.manual_seed(0)
    jobs: dict[str, Callable[[], object]] = {
        f"lookup_{name}_{dtype}": partial(_lookup_differs, name, dtype)
        for name in FORMATS
        for dtype in LOOKUP_DTYPES
    }
    jobs["embedding"] = _embedding_differs
    for kind in MODELS:
        for tokens in TOKENS:
            jobs[f"model_{kind}_{tokens}"] = partial(_model_error, kind, tokens)
    for tokens in TOKENS:
        jobs[f"tp_{tokens}"] = partial(_tp_error, tokens)
    return run_jobs(jobs)


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    return child_results(__file__, timeout=900)


@pytest.mark.parametrize("dtype", LOOKUP_DTYPES)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_lookup_gives_the_cpu_lookups_bits(results: dict, name: str, dtype: str) -> None:
    assert results[f"lookup_{name}_{dtype}"] == 0


def test_the_embeddings_gpu_branch_gives_its_cpu_branchs_rows(results: dict) -> None:
    assert results["embedding"] == 0


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("kind", MODELS)
def test_a_whole_quantized_model_runs_on_the_triton_path(
    results: dict, kind: str, tokens: int
) -> None:
    found = results[f"model_{kind}_{tokens}"]
    assert isinstance(found, dict), found
    # 2 layers x 4 projections and the tied head, all in blocks; the embedding too
    assert found["quantized"] == 9 and found["embedding"] == 1.0
    assert found["cpu"] <= LOGIT_TOLERANCE, found
    # Against the dense float32 model of the same weights: float32 sums in another order.
    assert ("dense" in found) == (kind == "q8_0_file")
    assert found.get("dense", 0.0) <= DENSE_TOLERANCE, found


@pytest.mark.parametrize("tokens", TOKENS)
def test_tensor_parallel_shards_run_on_the_triton_path(results: dict, tokens: int) -> None:
    # Two shards of the Q8_0 model (their blocks cut by shard_quant, the row-parallel
    # products' float64 partials summed) give the whole model's logits: float32 sums of
    # halves of the rows in place of whole ones.
    found = results[f"tp_{tokens}"]
    assert isinstance(found, dict), found
    assert found["float64_partials"] == 1.0
    assert found["error"] <= TP_TOLERANCE, found


def test_the_lookup_refuses_what_it_cannot_write() -> None:
    from appliance.model.layers import triton_quant

    blocks = torch.zeros(2, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"not torch\.int32"):
        triton_quant.quant_rows(blocks, 8, 32, torch.tensor([0]), torch.int32)
    with pytest.raises(ValueError, match="GGML type 6"):  # Q5_0: no Triton kernel
        triton_quant.quant_rows(torch.zeros(1, 22, dtype=torch.uint8), 6, 32, torch.tensor([0]))


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).parents[2] / "helpers"))
    print(json.dumps(_child()))
