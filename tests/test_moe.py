"""Mixture-of-experts families (Mixtral, Qwen3-MoE) against transformers on small random
models: from a folder (one file, sharded), at TP=2 and served in both layouts; and a
decode step that runs only the routed experts."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from random_models import (
    TOY_TOKENS,
    assert_matches,
    assert_shards_match,
    greedy,
    our_engine,
    random_model,
    save_folder,
    served_completions,
    sharded_prefill_logits,
    token_prompts,
    write_gguf,
)
from reference import our_prefill_logits

from appliance.engine.sequence import SamplingParams
from appliance.model.errors import ModelLoadError
from appliance.model.families.mixtral import MoEWeights
from appliance.model.formats import gguf_file
from appliance.model.layers import moe
from appliance.model.model_config import ModelConfig
from appliance.model.quant import QuantLinear
from appliance.model.registry import from_hf_config
from appliance.model.tensor_parallel import Shard, shard_plan

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

VOCAB = 49152  # the embedded model's tokenizer, which save_folder copies
EXPERTS, TOP_K = 8, 2


def mixtral_config(vocab: int = VOCAB):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


def qwen3_moe_config(
    vocab: int = VOCAB, norm_topk_prob: bool = False, mlp_only_layers: tuple[int, ...] = (1,)
):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,  # the dense layer's
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,  # False: Mixtral tests the renormalized weights
        mlp_only_layers=list(mlp_only_layers),  # (1,): a dense MLP between routed layers
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


def _with_random_norms(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def mixtral() -> torch.nn.Module:
    return random_model(mixtral_config())


@pytest.fixture(scope="module")
def qwen3_moe() -> torch.nn.Module:
    return _with_random_norms(random_model(qwen3_moe_config()))


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory: pytest.TempPathFactory, mixtral: torch.nn.Module) -> Path:
    folder = save_folder(mixtral, tmp_path_factory.mktemp("mixtral"), shard_size="1MB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def test_mixtral_folder_matches_transformers(
    mixtral_folder: Path, mixtral: torch.nn.Module
) -> None:
    """Sharded safetensors under Mixtral's own names (block_sparse_moe, w1/w2/w3)."""
    folder = mixtral_folder
    ours = our_engine(folder)
    config = ours.model.config
    assert (config.architecture, config.num_experts, config.experts_per_token) == ("llama", 8, 2)
    assert config.dense_layers == () and config.norm_topk_prob
    assert ours.model.decode_step is None
    assert_matches(ours, mixtral, token_prompts(VOCAB, [5, 17, 40, 3, 64]))


def test_qwen3_moe_folder_matches_transformers(tmp_path: Path, qwen3_moe: torch.nn.Module) -> None:
    folder = save_folder(qwen3_moe, tmp_path, shard_size="1MB")
    assert (folder / "model.safetensors.index.json").is_file()
    ours = our_engine(folder)
    config = ours.model.config
    assert (config.architecture, config.qk_norm, config.dense_layers) == ("qwen3", True, (1,))
    assert config.expert_intermediate_size == 64 and config.intermediate_size == 128
    assert_matches(ours, qwen3_moe, token_prompts(VOCAB, [5, 17, 40, 3, 64]))


def test_fused_expert_tensors_are_cut_per_expert(tmp_path: Path, mixtral: torch.nn.Module) -> None:
    """A folder whose experts are stacked 3-D tensors (transformers' in-memory layout:
    experts.gate_up_proj [experts, 2 * columns, hidden], experts.down_proj) loads as the
    per-expert one does."""
    from safetensors.torch import save_file

    folder = save_folder(mixtral, tmp_path)
    state = {n: t.contiguous() for n, t in mixtral.state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)  # this version's layout
    for path in folder.glob("*.safetensors"):
        path.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert_matches(our_engine(folder), mixtral, token_prompts(VOCAB, [9, 33]), tokens=8)


def test_moe_weights_names() -> None:
    """Mixtral's per-expert names, Qwen3-MoE's, and stacked tensors, all under ours."""
    config = ModelConfig.from_dict(
        {**_config_fields(), "num_experts": 2, "expert_intermediate_size": 3}
    )
    gate_up = torch.arange(2 * 6 * 4, dtype=torch.float32).view(2, 6, 4)
    weights = {
        "model.layers.0.block_sparse_moe.gate.weight": torch.zeros(2, 4),
        "model.layers.0.block_sparse_moe.experts.1.w3.weight": torch.ones(3, 4),
        "model.layers.1.mlp.experts.0.down_proj.weight": torch.ones(4, 3),
        "model.layers.2.mlp.experts.gate_up_proj": gate_up,
    }
    loaded = MoEWeights(weights, config)
    assert sorted(loaded) == sorted(
        [
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.experts.1.up_proj.weight",
            "model.layers.1.mlp.experts.0.down_proj.weight",
        ]
        + [
            f"model.layers.2.mlp.experts.{e}.{p}_proj.weight"
            for e in (0, 1)
            for p in ("gate", "up")
        ]
    )
    assert torch.equal(loaded["model.layers.2.mlp.experts.1.up_proj.weight"], gate_up[1, 3:])
    assert torch.equal(loaded["model.layers.2.mlp.experts.0.gate_proj.weight"], gate_up[0, :3])


def _config_fields() -> dict:
    return {
        "architecture": "llama",
        "vocab_size": 10,
        "hidden_size": 4,
        "intermediate_size": 8,
        "num_layers": 3,
        "num_heads": 1,
        "num_kv_heads": 1,
        "head_dim": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "experts_per_token": 2,
    }


def test_a_step_runs_only_the_routed_experts() -> None:
    """On plain data: each expert with tokens runs once, over exactly its tokens, and no
    other expert runs; the sum equals every expert computed densely and weighted."""
    torch.manual_seed(0)
    fields = _config_fields() | {"hidden_size": 16, "num_experts": 8, "expert_intermediate_size": 8}
    config = ModelConfig.from_dict(fields)
    columns = len(shard_plan(config, Shard()).expert_columns)
    block = moe.SparseMoE(16, 8, 2, columns)
    block.requires_grad_(False)
    for param in block.parameters():
        param.normal_()
    calls: dict[int, int] = {}
    for index, expert in enumerate(block.experts):
        expert.register_forward_hook(
            lambda _m, args, _out, i=index: calls.__setitem__(i, args[0].shape[0])
        )
    for rows in (1, 3):
        calls.clear()
        x = torch.randn(rows, 16)
        weights, chosen = moe.route(block.gate(x), 2, True)
        got = block(x)
        expected_calls = {e: int((chosen == e).sum()) for e in chosen.unique().tolist()}
        assert calls == expected_calls and len(calls) <= 2 * rows
        dense = torch.stack([expert(x) for expert in block.experts], dim=1)  # [rows, 8, hidden]
        mixed = torch.zeros(rows, 8).scatter(1, chosen, weights)
        torch.testing.assert_close(got, (mixed[..., None] * dense).sum(1))


def test_decode_steps_run_top_k_experts_per_layer(
    mixtral_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-token prompt: every step (prefill and decode) is one token, and each layer
    groups it to exactly top_k experts, each run once."""
    ours = our_engine(mixtral_folder)
    groups: list[list[int]] = []
    real = moe.expert_groups

    def spy(experts: torch.Tensor, num_experts: int) -> list:
        out = real(experts, num_experts)
        groups.append([int(e) for e, tokens, _ in out for _ in tokens])
        return out

    monkeypatch.setattr(moe, "expert_groups", spy)
    ours.generate([[42]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(groups) == 4 * 2  # steps x layers
    assert all(len(g) == TOP_K == len(set(g)) for g in groups)


@pytest.mark.parametrize("which", ["mixtral", "qwen3_moe"])
def test_tensor_parallel_shards_match_transformers(
    tmp_path: Path, request: pytest.FixtureRequest, which: str
) -> None:
    """Two shards, every expert split by column (Mixtral's 96 columns go 64 + 32)."""
    reference = request.getfixturevalue(which)
    folder = save_folder(reference, tmp_path)
    prompts = token_prompts(VOCAB, [7, 30, 50])
    assert_shards_match(folder, prompts, [reference] * len(prompts))


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_appliance_serves_mixtral(
    mixtral_folder: Path, mixtral: torch.nn.Module, mode: str
) -> None:
    """`appliance serve` answers as transformers does in both pool layouts."""
    from transformers import AutoTokenizer

    prompts = token_prompts(VOCAB, [40, 12], seed=4)
    texts = served_completions(mixtral_folder, {"APPLIANCE_MODE": mode}, prompts)
    tokenizer = AutoTokenizer.from_pretrained(mixtral_folder)
    assert texts == [tokenizer.decode(greedy(mixtral, p, 24)) for p in prompts]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"model_type": "qwen2_moe"}, "unknown architecture 'qwen2_moe'"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 of 8 experts"),
    ],
)
def test_unsupported_variants_are_refused_in_one_line(fields: dict, words: str) -> None:
    cfg = qwen3_moe_config(100).to_dict() | fields
    with pytest.raises(ModelLoadError) as excinfo:
        from_hf_config(cfg, "m")
    assert words in str(excinfo.value) and "\n" not in str(excinfo.value)


def _gguf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as a GGUF converter sees it: each projection's experts
    stacked apart ([experts, rows, in]; transformers keeps gate and up fused)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = tensor
        else:
            out[name] = tensor
    return out


def _gguf_metadata(config) -> dict[str, int | float]:
    moe_config = config.model_type == "qwen3_moe"
    return {
        "block_count": config.num_hidden_layers,
        "context_length": 512,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.key_length": config.head_dim or 16,
        "attention.value_length": config.head_dim or 16,
        "rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "vocab_size": config.vocab_size,
        "expert_count": EXPERTS,
        "expert_used_count": TOP_K,
        **({"expert_feed_forward_length": config.moe_intermediate_size} if moe_config else {}),
    }


def _toy(which: str) -> torch.nn.Module:
    """A model over the toy tokenizer's vocabulary; llama.cpp's Qwen3-MoE has no dense
    layers and always renormalizes the routed weights."""
    vocab = len(TOY_TOKENS)
    if which == "mixtral":
        return random_model(mixtral_config(vocab))
    config = qwen3_moe_config(vocab, norm_topk_prob=True, mlp_only_layers=())
    return _with_random_norms(random_model(config))


_ARCHS = {"mixtral": gguf.MODEL_ARCH.LLAMA, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}


def _write(model: torch.nn.Module, which: str, path: Path, quantize: bool = False) -> Path:
    metadata = _gguf_metadata(model.config)
    tensors = _gguf_tensors(model)
    return write_gguf(model, path, _ARCHS[which], metadata, quantize=quantize, tensors=tensors)


@pytest.mark.parametrize("which", ["mixtral", "qwen3_moe"])
def test_moe_gguf_matches_transformers(tmp_path: Path, which: str) -> None:
    """Float32 GGUF (a "llama" with stacked experts, or "qwen3moe")."""
    reference = _toy(which)
    path = _write(reference, which, tmp_path / "m.gguf")
    config = gguf_file.read_model_config(gguf_file.open_gguf(path), path)
    assert (config.num_experts, config.experts_per_token, config.dense_layers) == (8, 2, ())
    assert config.architecture == ("llama" if which == "mixtral" else "qwen3")
    ours = our_engine(path, cache_dir=tmp_path / "cache", weights="dense")
    assert_matches(ours, reference, token_prompts(len(TOY_TOKENS), [5, 17, 40, 3]))


def test_quantized_moe_gguf_keeps_experts_in_blocks(tmp_path: Path) -> None:
    """Q8_0 experts multiplied in their blocks (the compiled step refuses MoE: the Python
    layers run), close to the same file dequantized, greedy tokens equal; and two
    shards of the quantized model answer as one."""
    reference = _toy("mixtral")
    path = _write(reference, "mixtral", tmp_path / "q8.gguf", quantize=True)
    quant = our_engine(path, cache_dir=tmp_path / "cache", weights="quantized")
    dense = our_engine(path, cache_dir=tmp_path / "cache", weights="dense")
    expert = quant.model.layers[1].mlp.experts[5]
    assert isinstance(expert.gate_up_proj, QuantLinear) and isinstance(
        expert.down_proj, QuantLinear
    )
    assert quant.model.decode_step is None
    prompts = token_prompts(len(TOY_TOKENS), [5, 17, 40])
    for ours, theirs in zip(
        our_prefill_logits(quant, prompts), our_prefill_logits(dense, prompts), strict=True
    ):
        assert (ours - theirs).abs().max().item() < 0.02 * theirs.abs().max().item()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = [c.token_ids for c in quant.generate(prompts, params)]
    assert got == [c.token_ids for c in dense.generate(prompts, params)]
    # One process of an appliance with groups of two sums as a shard does (spans).
    whole = our_engine(path, cache_dir=tmp_path / "cache", weights="quantized", prefill_tp=2)
    expected = our_prefill_logits(whole, prompts)
    for ours, theirs in zip(sharded_prefill_logits(path, whole, prompts, 2), expected, strict=True):
        assert (ours - theirs).abs().max().item() < 1e-5
