"""oneDNN-packed projections on the CPU: the same numbers as F.linear, used where they run.

The packing is checked on a tiny tied llama GGUF (tests/helpers/tiny_gguf.py) read through
the same loader as the embedded model; the bfloat16 answer check runs on the embedded
model too, in the slow lane (it loads and runs the whole model)."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from tiny_gguf import write_gguf

from appliance.engine.shard_loading import build_model
from appliance.model import packed_linear
from appliance.model.families.llama import LlamaForCausalLM as CausalLM
from appliance.model.loader import ModelFiles, load_model_files
from appliance.model.model_source import default_model_path
from appliance.model.packed_linear import PackedLinear, pack_linears, packs_linears
from appliance.settings.config import load_settings

CPU = torch.device("cpu")


PACKS = packs_linears(CPU, torch.bfloat16)  # needs AVX512BW/VL/DQ or AVX-NE-CONVERT


def test_packing_is_for_bfloat16_on_the_cpu_only() -> None:
    if PACKS:
        assert torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not packs_linears(CPU, torch.float32)  # another summation order than transformers
    assert not packs_linears(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_is_bit_identical_to_f_linear(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator).to(torch.bfloat16)
    b = torch.randn(96, generator=generator).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 64, generator=generator).to(torch.bfloat16)
    if not PACKS:  # this CPU lacks the path: it is refused, and the model keeps F.linear
        with pytest.raises(ValueError, match="oneDNN cannot pack"):
            PackedLinear(weight, b)
        return
    assert torch.equal(PackedLinear(weight, b)(x), F.linear(x, weight, b))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    """A tiny tied llama (2 layers, Q8_0 blocks) through the loader and its GGUF cache:
    the packing's counts and head rules hold for any llama, so its checks need no more."""
    folder = tmp_path_factory.mktemp("packed")
    return load_model_files(write_gguf(folder / "tiny.gguf"), folder / "cache")


@pytest.fixture(scope="module")
def embedded() -> ModelFiles:
    return load_model_files(default_model_path(), load_settings().cache_dir)


@pytest.mark.parametrize("model", ["files", pytest.param("embedded", marks=pytest.mark.process)])
def test_the_bfloat16_model_is_packed_and_answers_as_before(
    model: str, request: pytest.FixtureRequest
) -> None:
    files: ModelFiles = request.getfixturevalue(model)
    packed = build_model(files, torch.bfloat16, CPU, 256)
    with torch.device("meta"):
        plain = CausalLM(files.config, torch.bfloat16, CPU, 256)
    plain.load_weights(files.weights, "test")
    linears = [m for m in packed.modules() if isinstance(m, torch.nn.Linear)]
    packs = packs_linears(CPU, torch.bfloat16)  # a CPU without oneDNN bf16 keeps F.linear
    assert (linears == []) == packs
    assert isinstance(packed.lm_head, PackedLinear) == packs  # the tied head too
    assert plain.lm_head is None
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314]) % files.config.vocab_size
    assert torch.equal(prefill_logits(packed, ids), prefill_logits(plain, ids))


def test_a_follower_shard_packs_no_head(files: ModelFiles) -> None:
    with torch.device("meta"):
        model = CausalLM(files.config, torch.bfloat16, CPU, 64)
    model.load_weights(files.weights, "test")
    if not PACKS:
        with pytest.raises(ValueError, match=r"packs no torch\.bfloat16"):
            pack_linears(model, head=False)
        return
    assert pack_linears(model, head=False) == 4 * files.config.num_layers
    assert model.lm_head is None  # it computes no logits: no packed copy of the embedding


def test_packing_frees_each_plain_weight_as_it_goes(
    files: ModelFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed copies replace the plain weights one at a time: while the last one is
    packed, the others are gone (not a second model's worth of memory at once)."""
    with torch.device("meta"):
        model = CausalLM(files.config, torch.bfloat16, CPU, 64)
    model.load_weights(files.weights, "test")
    plain = [weakref.ref(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    alive_at_each_pack: list[int] = []
    if not PACKS:  # this CPU lacks the path: refused before any weight is touched
        with pytest.raises(ValueError, match=r"packs no torch\.bfloat16"):
            pack_linears(model, head=False)
        assert all(ref() is not None for ref in plain)
        return

    class Counting(PackedLinear):
        def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
            alive_at_each_pack.append(sum(ref() is not None for ref in plain))
            super().__init__(weight, bias)

    monkeypatch.setattr(packed_linear, "PackedLinear", Counting)
    assert pack_linears(model, head=False) == len(plain)
    assert alive_at_each_pack[0] == len(plain)
    assert alive_at_each_pack[-1] <= 2  # the one being packed (and the one just replaced)
    assert sum(ref() is not None for ref in plain) <= 1


def test_packing_an_untied_head_packs_that_head(files: ModelFiles) -> None:
    with torch.device("meta"):
        model = CausalLM(files.config, torch.bfloat16, CPU, 64)
    model.load_weights(files.weights, "test")
    hidden_size = files.config.hidden_size
    model.lm_head = torch.nn.Linear(hidden_size, 10, bias=False, dtype=torch.bfloat16)
    head = model.lm_head.weight
    if not PACKS:
        with pytest.raises(ValueError, match=r"packs no torch\.bfloat16"):
            pack_linears(model)
        return
    count = pack_linears(model)
    hidden = torch.randn(3, hidden_size).to(torch.bfloat16)
    assert count == 4 * files.config.num_layers + 1
    assert torch.equal(model.logits(hidden), F.linear(hidden, head).float())


def prefill_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    from appliance.model.layers.paged_attention import AttentionBatch, PrefillSegment

    cfg = model.config
    kv = torch.zeros(cfg.num_layers, 2, 1, 16, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    n = len(ids)
    batch = AttentionBatch(torch.arange(n), [PrefillSegment(0, n, n, torch.tensor([0]))], n, [])
    return model.logits(model(ids, torch.arange(n), batch, kv))
