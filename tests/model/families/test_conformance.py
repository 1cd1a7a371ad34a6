"""Every family in the registry, alike, then what each has of its own.

Over the registry: each architecture name a family claims maps back to it; a
config.json of each architecture builds its model, whose parameters take exactly the
weights transformers saves; unknown architectures are refused naming the known ones.

Over the cases (family_cases.py: Qwen3 and Mistral for llama, Phi-3 and Phi-4-mini for
phi3, Gemma 3, Mixtral and Qwen3-MoE for mixtral, gpt-oss), on small random float32
models against transformers: a Hugging Face folder (one file, sharded) and a GGUF
(llama.cpp's names and metadata) answer as transformers does (prefill logits within
LOGIT_TOLERANCE, greedy tokens equal); the GGUF's config and weights read as the
folder's; two tensor-parallel shards; `appliance serve` in both pool layouts; chunked
prefill over cached blocks; a quantized GGUF close to the same file dequantized; the
family's own feature (window, layer kinds, sinks) changes the answer, so the checks
mean something; what a family does not run is refused in one line.

Then the checks that are one family's: Gemma 3's softcapping and config layouts,
Phi-4-mini's two LongRoPE factor sets, a mixture's expert routing and stacked experts,
gpt-oss's prefix hits and MXFP4 experts, Mistral's window in the compiled decode step."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from family_cases import (
    CASES,
    EXPERTS,
    GEMMA3_HEAD_DIM,
    GEMMA3_WINDOW,
    GPT_OSS_LIMIT,
    LAYER_TYPES,
    LONGROPE_ORIGINAL,
    PARTIAL,
    PHI3_HEADS,
    QWEN3_HEAD_DIM,
    TOP_K,
    TOY_VOCAB,
    VOCAB,
    WINDOW,
    YARN,
    gemma3_config,
    gemma3_model,
    gpt_oss_config,
    gpt_oss_gguf,
    gpt_oss_gguf_tensors,
    gpt_oss_model,
    long_only,
    mistral_config,
    phi3_config,
    qwen3_moe_config,
)
from random_models import (
    assert_matches,
    assert_shards_match,
    greedy,
    our_engine,
    random_model,
    save_folder,
    served_completions,
    sharded_prefill_logits,
    token_prompts,
)
from reference import our_prefill_logits

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.scheduler import SchedulerLimits
from appliance.engine.sequence import SamplingParams
from appliance.kv.cache import KVCache, KVLayout
from appliance.model import cpu_kernels, registry
from appliance.model.causal_lm import CausalLM
from appliance.model.decode_step import compiled_problem
from appliance.model.errors import ModelLoadError
from appliance.model.families.gemma3 import gguf_facts
from appliance.model.families.mixtral import MoEWeights
from appliance.model.families.phi3 import Phi3Weights, rotary_row_order
from appliance.model.formats import gguf_file
from appliance.model.layers import moe
from appliance.model.model_config import ModelConfig
from appliance.model.quant import QuantLinear
from appliance.model.registry import FAMILIES, family_of, from_hf_config, model_class
from appliance.model.tensor_parallel import Shard, shard_plan

# The slow lane (conftest.py): a test that runs a whole model or starts a server.
process = pytest.mark.process

ModelsOf = Callable[..., torch.nn.Module]
FolderOf = Callable[[str, str], Path]

# Every product of a quantized model in its blocks (the integer kernel), however many prompt
# rows a step has: what the quantized-vs-dequantized comparisons here measure. From
# prefill_gemm_rows' auto count (48 rows on AVX512-BF16) a step's products run as a GEMM in
# bfloat16, whose own error test_prefill_gemm.py bounds.
IN_BLOCKS = {"prefill_gemm_rows": 1 << 20}


@pytest.fixture(scope="module")
def models() -> ModelsOf:
    """A case's reference (`toy`: over the toy tokenizer, for its GGUF), made once;
    "phi4mini_long" is Phi-4-mini with LongRoPE's long factors at every length."""
    made: dict[tuple[str, bool], torch.nn.Module] = {}

    def get(name: str, toy: bool = False) -> torch.nn.Module:
        if (name, toy) not in made:
            if name == "phi4mini_long":
                made[name, toy] = long_only(get("phi4mini", toy), TOY_VOCAB if toy else VOCAB)
            else:
                made[name, toy] = CASES[name].toy() if toy else CASES[name].reference()
        return made[name, toy]

    return get


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, models: ModelsOf) -> FolderOf:
    """A case's reference saved once as a folder: "one-file", or "sharded" (safetensors
    files of 1 MB with model.safetensors.index.json)."""
    made: dict[tuple[str, str], Path] = {}

    def get(name: str, layout: str) -> Path:
        if (name, layout) not in made:
            shard_size = "1MB" if layout == "sharded" else None
            folder = tmp_path_factory.mktemp(f"{name}-{layout}")
            made[name, layout] = save_folder(models(name), folder, shard_size=shard_size)
        return made[name, layout]

    return get


def reference_for(models: ModelsOf, name: str, prompt: list[int]) -> torch.nn.Module:
    """The transformers model our engine's answer to `prompt` is checked against. Our
    Phi-4-mini runs LongRoPE's long factors (its max_model_len 256 passes the pretraining
    length); transformers takes them only past that length, so within it the reference
    is the long-only twin."""
    if name == "phi4mini" and len(prompt) <= LONGROPE_ORIGINAL:
        return models("phi4mini_long")
    return models(name)


def row_ids(rows: list[Any]) -> list[str]:
    """A parametrized row's id: its string values (case, layout), joined."""
    values = [getattr(row, "values", row) for row in rows]
    return ["-".join(v for v in row if isinstance(v, str)) for row in values]


def assert_config(config: ModelConfig, expected: dict[str, Any]) -> None:
    assert {key: getattr(config, key) for key in expected} == expected


# ------------------------------------------------------------------ the registry


def test_every_family_has_a_conformance_case() -> None:
    assert {case.family for case in CASES.values()} == {family.name for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_name_a_family_claims_maps_back_to_it(family: registry.Family) -> None:
    module = family.module()
    assert issubclass(module.MODEL, CausalLM) and callable(module.from_hf)
    for model_type, cls in family.model_types.items():
        assert registry.hf_family({"model_type": model_type}, "x") == family
        assert registry.hf_family({"architectures": [cls]}, "x") == family
    for arch in family.gguf:
        assert registry.gguf_family(arch, "x") == family


def test_every_architecture_is_one_familys() -> None:
    names = [n for family in FAMILIES for n in family.model_types]
    assert len(names) == len(set(names))
    gguf_names = [n for family in FAMILIES for n in family.gguf]
    assert len(gguf_names) == len(set(gguf_names))


@pytest.mark.parametrize(
    ("read", "arch"),
    [
        (lambda a: registry.hf_family({"model_type": a}, "m"), "mamba"),
        (lambda a: registry.gguf_family(a, "m"), "mamba"),
    ],
    ids=["config.json", "gguf"],
)
def test_an_unknown_architecture_is_refused_naming_the_known_ones(read: Any, arch: str) -> None:
    with pytest.raises(ModelLoadError, match=r"unknown architecture 'mamba' \(supported: .*llama"):
        read(arch)


SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
# (family, transformers config class, its fields beyond SMALL) per architecture.
ARCHITECTURES = [
    ("llama", "LlamaConfig", {}),
    ("llama", "MistralConfig", {"sliding_window": 16}),
    ("llama", "Qwen2Config", {}),
    ("llama", "Qwen3Config", {"head_dim": 16}),
    ("phi3", "Phi3Config", {"pad_token_id": 0}),
    ("gemma3", "Gemma3TextConfig", {"head_dim": 16, "sliding_window": 16}),
    ("mixtral", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    (
        "mixtral",
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    ),
    ("gpt_oss", "GptOssConfig", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
]


@pytest.mark.parametrize(
    ("family", "config_class", "fields"), ARCHITECTURES, ids=[a[1] for a in ARCHITECTURES]
)
def test_a_family_builds_the_model_its_weights_fit(
    family: str, config_class: str, fields: dict[str, Any]
) -> None:
    import transformers

    hf = getattr(transformers, config_class)(**SMALL, **fields)
    config = from_hf_config(hf.to_dict(), "m")
    assert family_of(config).name == family
    with torch.device("meta"):
        model = model_class(config)(config, torch.float32, torch.device("cpu"), 64)
    assert type(model) is family_of(config).module().MODEL
    weights = registry.loaded_weights(random_model(hf).state_dict(), config)
    model._check_names(model._load_plan(), weights, "m")  # raises where they do not fit


# ------------------------------------------------------------------ from a folder

CHAT_HI = [{"role": "user", "content": "Hi!"}]
# What a folder's config reads as, per case.
FOLDER_CONFIG: dict[str, dict[str, Any]] = {
    "qwen3": {
        "architecture": "qwen3",
        "qk_norm": True,
        "attention_bias": False,
        "head_dim": QWEN3_HEAD_DIM,
        "sliding_window": None,
    },
    "mistral": {"sliding_window": WINDOW},
    "phi3": {"architecture": "phi3", "rotary_dim": None, "rope_scaling": None},
    "gemma3": {
        "architecture": "gemma3",
        "qk_norm": True,
        "tie_word_embeddings": True,
        "sliding_window": GEMMA3_WINDOW,
        "layer_types": tuple(LAYER_TYPES),
        "rope_theta": 1e6,
        "local_rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    "mixtral": {
        "architecture": "llama",
        "num_experts": 8,
        "experts_per_token": 2,
        "dense_layers": (),
        "norm_topk_prob": True,
    },
    "qwen3_moe": {
        "architecture": "qwen3",
        "qk_norm": True,
        "dense_layers": (1,),
        "expert_intermediate_size": 64,
        "intermediate_size": 128,
    },
    "gpt_oss": {
        "architecture": "gpt_oss",
        "attention_sinks": True,
        "attention_bias": True,
        "layer_types": tuple(LAYER_TYPES),
        "sliding_window": GEMMA3_WINDOW,
        "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"} | {"truncate": False},
        "rope_theta": 10000.0,
        "num_experts": 8,
        "experts_per_token": 2,
        "swiglu_limit": GPT_OSS_LIMIT,
    },
}
# Why the compiled CPU decode step refuses a case's model (the Python layers run).
COMPILED_REFUSED = {"gemma3": "", "mixtral": "", "gpt_oss": "sinks"}


FOLDER_ROWS = [
    ("qwen3", "one-file", [5, 17, 40, 3, 64], 0, CHAT_HI, 32),
    ("qwen3", "sharded", [5, 17, 40, 3, 64], 0, CHAT_HI, 32),
    # Shorter than, as long as, and longer than the window; 32 new tokens pass it for all.
    (
        "mistral",
        "sharded",
        [5, 20, 24, 25, 40, 90],
        0,
        [{"role": "user", "content": "Hi " * 30}],
        32,
    ),
    ("phi3", "sharded", [5, 17, 40, 3, 64], 0, CHAT_HI, 32),
    (
        "gemma3",
        "sharded",
        [5, 11, 12, 13, 40, 90],
        0,
        [{"role": "user", "content": "Hi " * 9}],
        32,
    ),
    ("gemma3", "one-file", [7, 30], 4, None, 16),
    ("mixtral", "sharded", [5, 17, 40, 3, 64], 0, None, 32),
    ("qwen3_moe", "sharded", [5, 17, 40, 3, 64], 0, None, 32),
    ("gpt_oss", "sharded", [5, 12, 13, 40, 90], 0, None, 32),
    ("gpt_oss", "one-file", [7, 30], 4, None, 16),
]


@process
@pytest.mark.parametrize(
    ("name", "layout", "lengths", "seed", "chat", "tokens"),
    FOLDER_ROWS,
    ids=row_ids(FOLDER_ROWS),
)
def test_a_folder_answers_as_transformers(
    models: ModelsOf,
    folders: FolderOf,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    layout: str,
    lengths: list[int],
    seed: int,
    chat: list[dict[str, str]] | None,
    tokens: int,
) -> None:
    """Prefill logits and greedy tokens; a model with attention sinks never calls the
    compiled CPU decode kernel (it has none): its decode runs attend_with_sinks."""
    folder = folders(name, layout)
    if layout == "sharded":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 1
    ours = our_engine(folder)
    assert_config(ours.model.config, FOLDER_CONFIG[name])
    if name in COMPILED_REFUSED:
        assert ours.model.decode_step is None
        assert COMPILED_REFUSED[name] in compiled_problem(ours.model)
    if ours.model.config.attention_sinks:

        def no_kernel(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("the compiled decode kernel has no sinks")

        monkeypatch.setattr(cpu_kernels, "paged_decode", no_kernel)
    prompts = token_prompts(VOCAB, lengths, seed=seed)
    if chat is not None:
        prompts.append(ours.tokenizer.apply_chat_template(chat))
    worst = assert_matches(ours, models(name), prompts, tokens=tokens)
    print(f"largest prefill logit error {worst:.2e}")


# ------------------------------------------------------------------ from a GGUF


def _qwen3_weights(weights: Mapping[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert set(weights) == set(expected)
    checked = (
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.self_attn.q_proj.weight",  # rows as Hugging Face has them
        "model.layers.1.self_attn.k_proj.weight",
    )
    for name in checked:
        torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=0)


def _phi4mini_weights(weights: Mapping[str, torch.Tensor], model: torch.nn.Module) -> None:
    """attn_qkv and ffn_up (gate and up) cut into the projections at Hugging Face's rows,
    Q/K rows reordered for the partial RoPE; LongRoPE's factors from the file's tensors."""
    hidden, kv_heads = model.config.hidden_size, model.config.num_key_value_heads
    head_dim = hidden // PHI3_HEADS
    rotary = int(head_dim * PARTIAL)
    state = model.state_dict()
    q, kv, ff = PHI3_HEADS * head_dim, kv_heads * head_dim, 2 * hidden
    order = rotary_row_order(head_dim, rotary)
    layer = "model.layers.1."
    qkv = state[layer + "self_attn.qkv_proj.weight"]
    gate_up = state[layer + "mlp.gate_up_proj.weight"]
    expected = {
        "self_attn.q_proj.weight": qkv[:q].view(PHI3_HEADS, head_dim, -1)[:, order].reshape(q, -1),
        "self_attn.k_proj.weight": qkv[q : q + kv].view(kv_heads, head_dim, -1)[:, order],
        "self_attn.v_proj.weight": qkv[q + kv :],
        "mlp.gate_proj.weight": gate_up[:ff],
        "mlp.up_proj.weight": gate_up[ff:],
    }
    for name, tensor in expected.items():
        torch.testing.assert_close(
            weights[layer + name], tensor.reshape(-1, hidden), rtol=0, atol=0
        )
    assert "lm_head.weight" not in weights and not any("rope_factors" in n for n in weights)


def _gemma3_weights(weights: Mapping[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(weights) == set(expected)
    for name in expected:  # norms back from 1 + weight, to float32's rounding of the sum
        torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=1e-6)


def _gpt_oss_weights(weights: Mapping[str, torch.Tensor], model: torch.nn.Module) -> None:
    wanted = {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.experts.up_proj.bias"}
    assert wanted <= set(weights)


def _moe_weights(weights: Mapping[str, torch.Tensor], model: torch.nn.Module) -> None:
    """(The answers test the experts' weights.)"""


# What a case's GGUF config reads as, and the check of its weights as the model loads them.
GGUF_CONFIG: dict[str, tuple[dict[str, Any], Callable[..., None]]] = {
    "qwen3": (
        {
            "architecture": "qwen3",
            "qk_norm": True,
            "attention_bias": False,
            "head_dim": QWEN3_HEAD_DIM,
            "num_heads": 4,
            "hidden_size": 64,
        },
        _qwen3_weights,
    ),
    "phi4mini": (
        {
            "architecture": "phi3",
            "head_dim": 64 // PHI3_HEADS,
            "rotary_dim": int(64 // PHI3_HEADS * PARTIAL),
            "sliding_window": None,
            "tie_word_embeddings": True,
        },
        _phi4mini_weights,
    ),
    "gemma3": (
        {
            "architecture": "gemma3",
            "qk_norm": True,
            "tie_word_embeddings": True,
            "layer_types": tuple(LAYER_TYPES),
            "sliding_window": GEMMA3_WINDOW,
            "rope_theta": 1e6,
            "local_rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "query_pre_attn_scalar": GEMMA3_HEAD_DIM,
        },
        _gemma3_weights,
    ),
    "mixtral": (
        {"architecture": "llama", "num_experts": 8, "experts_per_token": 2, "dense_layers": ()},
        _moe_weights,
    ),
    "qwen3_moe": (
        {"architecture": "qwen3", "num_experts": 8, "experts_per_token": 2, "dense_layers": ()},
        _moe_weights,
    ),
    "gpt_oss": (
        {
            "architecture": "gpt_oss",
            "attention_sinks": True,
            "num_experts": EXPERTS,
            "layer_types": tuple(LAYER_TYPES),
            "sliding_window": GEMMA3_WINDOW,
        },
        _gpt_oss_weights,
    ),
}


@process
@pytest.mark.parametrize("name", list(GGUF_CONFIG))
def test_a_gguf_reads_as_the_folder(tmp_path: Path, models: ModelsOf, name: str) -> None:
    """llama.cpp's names and metadata read as the Hugging Face config and weights."""
    model = models(name, toy=True)
    path = CASES[name].gguf(model, tmp_path / "m.gguf", False)
    config = gguf_file.read_model_config(gguf_file.open_gguf(path), path)
    expected, check_weights = GGUF_CONFIG[name]
    assert_config(config, expected)
    if name == "phi4mini":  # LongRoPE from the file's tensors and metadata
        rope = model.config.rope_parameters
        assert config.rope_scaling is not None
        assert config.rope_scaling["original_max_position_embeddings"] == LONGROPE_ORIGINAL
        for key in ("short_factor", "long_factor"):
            np.testing.assert_allclose(config.rope_scaling[key], rope[key], rtol=1e-6)
    if name == "gpt_oss":  # YaRN truncated, as llama.cpp computes it
        assert config.rope_scaling is not None and config.rope_scaling["truncate"]
    weights = gguf_file.read_weights(path, config)
    if name == "phi4mini":
        weights = Phi3Weights(weights, config)
    check_weights(weights, model)


GGUF_ROWS = [
    ("qwen3", [5, 17, 40, 3, 64], 0),
    ("phi3", [5, 17, 40, 3, 64], 0),
    ("gemma3", [5, 13, 40], 7),
    ("mixtral", [5, 17, 40, 3], 0),
    ("qwen3_moe", [5, 17, 40, 3], 0),
    ("gpt_oss", [5, 13, 40], 7),
]


@process
@pytest.mark.parametrize(
    ("name", "lengths", "seed"),
    GGUF_ROWS,
    ids=row_ids(GGUF_ROWS),
)
def test_a_gguf_answers_as_transformers(
    tmp_path: Path, models: ModelsOf, name: str, lengths: list[int], seed: int
) -> None:
    """Float32 weights (a Mixtral as a "llama" with stacked experts)."""
    reference = models(name, toy=True)
    path = CASES[name].gguf(reference, tmp_path / "m.gguf", False)
    ours = our_engine(path, cache_dir=tmp_path / "cache", weights="dense")
    assert_matches(ours, reference, token_prompts(TOY_VOCAB, lengths, seed=seed))


QUANTIZED_ROWS = [
    ("qwen3", [5, 17, 40], 0, 0.02, True),
    pytest.param(
        "phi4mini",
        [5, 17, 70],
        0,
        0.02,
        True,
        marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels"),
    ),
    ("gemma3", [20, 50], 8, 0.08, False),
]


@process
@pytest.mark.parametrize(
    ("name", "lengths", "seed", "tolerance", "compiled"),
    QUANTIZED_ROWS,
    ids=row_ids(QUANTIZED_ROWS),
)
def test_a_quantized_gguf_stays_close_to_it_dequantized(
    tmp_path: Path,
    models: ModelsOf,
    name: str,
    lengths: list[int],
    seed: int,
    tolerance: float,
    compiled: bool,
) -> None:
    """Q8_0 blocks multiplied in place (Phi-4-mini's cut from attn_qkv and ffn_up, head
    size 64): the compiled decode step runs Qwen3's q/k head norms and Phi-4-mini's RoPE
    tables (partial and scaled) as they are, and answers as the Python layers do; Gemma 3
    runs the layers (Q8_0 errs by 5% of the largest logit; SiLU in GeGLU's place would
    by 17%). Prefill logits within `tolerance` of the largest."""
    model = CASES[name].toy(hidden=256) if name == "phi4mini" else models(name, toy=True)
    path = CASES[name].gguf(model, tmp_path / "q8.gguf", True)
    cache = tmp_path / "cache"
    quantized = our_engine(path, cache_dir=cache, weights="quantized", **IN_BLOCKS)
    dense = our_engine(path, cache_dir=cache, weights="dense")
    if compiled:
        assert quantized.model.decode_step is not None or not cpu_kernels.available()
    else:
        assert quantized.model.decode_step is None
    prompts = token_prompts(TOY_VOCAB, lengths, seed=seed)
    for ours, theirs in zip(
        our_prefill_logits(quantized, prompts), our_prefill_logits(dense, prompts), strict=True
    ):
        assert (ours - theirs).abs().max().item() < tolerance * theirs.abs().max().item()
    if not compiled:
        return
    layers = our_engine(path, cache_dir=cache, weights="quantized", **IN_BLOCKS)
    layers.model.decode_step = None
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = [c.token_ids for c in quantized.generate(prompts, params)]
    assert got == [c.token_ids for c in layers.generate(prompts, params)]
    if name == "qwen3":
        assert got == [c.token_ids for c in dense.generate(prompts, params)]


# ------------------------------------------------------------------ shards and serving


SHARD_ROWS = [
    # Q/K norms per head: each shard keeps them whole.
    ("qwen3", "one-file", [7, 30, 50], 0),
    ("mistral", "sharded", [10, 30, 75], 2),
    # Cut from the fused qkv_proj and gate_up_proj; long factors (max_model_len 256).
    ("phi4mini", "sharded", [70, 90, 7, 30], 3),
    # The norms after attention and the MLP see the summed partials.
    ("gemma3", "sharded", [10, 30, 75], 2),
    # Every expert split by column (Mixtral's 96 columns go 64 + 32).
    ("mixtral", "one-file", [7, 30, 50], 0),
    ("qwen3_moe", "one-file", [7, 30, 50], 0),
    # Heads with their sinks; experts by column; the o and down biases added once.
    ("gpt_oss", "sharded", [10, 30, 75], 2),
]


@process
@pytest.mark.parametrize(
    ("name", "layout", "lengths", "seed"),
    SHARD_ROWS,
    ids=row_ids(SHARD_ROWS),
)
def test_tensor_parallel_shards_answer_as_transformers(
    models: ModelsOf, folders: FolderOf, name: str, layout: str, lengths: list[int], seed: int
) -> None:
    """Two shards, a KV head (and its query heads) each."""
    prompts = token_prompts(VOCAB, lengths, seed=seed)
    references = [reference_for(models, name, p) for p in prompts]
    assert_shards_match(folders(name, layout), prompts, references)


# A TP=2 prefill pool on CPU devices 0 and 1 hands its cache to a TP=1 decode pool on 2.
TP2_PREFILL = {
    "APPLIANCE_PREFILL_TP": "2",
    "APPLIANCE_CPU_DEVICES": "3",
    "APPLIANCE_PREFILL_DEVICES": "0,1",
    "APPLIANCE_DECODE_DEVICES": "2",
    "APPLIANCE_CPU_SHARE_CORES": "true",  # this machine may have fewer cores
}
LAYOUTS = {"disaggregated": {}, "colocated": {}, "TP2-prefill-to-TP1-decode": TP2_PREFILL}
SERVED = [
    # Prompts longer than the window.
    ("mistral", [30, 60], 3, ["disaggregated", "colocated"]),
    # Keys reordered for the partial RoPE mean the same in every worker.
    ("phi4mini", [70, 20], 4, ["disaggregated", "colocated"]),
    ("gemma3", [30, 60], 3, list(LAYOUTS)),
    ("mixtral", [40, 12], 4, ["disaggregated", "colocated"]),
    ("gpt_oss", [30, 60], 3, ["disaggregated", "colocated"]),
]


# Every family in every layout is the full matrix (the extended lane); the suite serves each
# family in one layout, the layouts taking turns, gemma3 also in the TP2 to TP1 handoff.
IN_THE_SUITE = {
    ("mistral", "disaggregated"),
    ("phi4mini", "colocated"),
    ("gemma3", "disaggregated"),
    ("gemma3", "TP2-prefill-to-TP1-decode"),
    ("mixtral", "colocated"),
    ("gpt_oss", "disaggregated"),
}
SERVE_ROWS = [
    pytest.param(
        name,
        lengths,
        seed,
        layout,
        marks=() if (name, layout) in IN_THE_SUITE else pytest.mark.extended,
    )
    for name, lengths, seed, layouts in SERVED
    for layout in layouts
]


@process
@pytest.mark.parametrize(
    ("name", "lengths", "seed", "layout"),
    SERVE_ROWS,
    ids=row_ids(SERVE_ROWS),
)
def test_appliance_serve_answers_as_transformers(
    models: ModelsOf, folders: FolderOf, name: str, lengths: list[int], seed: int, layout: str
) -> None:
    """`appliance serve` (prefill and decode pools, the KV cache handed between them, or
    colocated workers; pools of one or two tensor-parallel shards) answers as
    transformers does."""
    from transformers import AutoTokenizer

    folder = folders(name, "sharded")
    prompts = token_prompts(VOCAB, lengths, seed=seed)
    mode = "colocated" if layout == "colocated" else "disaggregated"
    texts = served_completions(folder, {"APPLIANCE_MODE": mode} | LAYOUTS[layout], prompts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = [tokenizer.decode(greedy(reference_for(models, name, p), p, 24)) for p in prompts]
    assert texts == expected


# ------------------------------------------------------------------ windows, kinds, sinks


@process
@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_chunked_prefill_over_cached_blocks_keeps_the_windows(
    models: ModelsOf, folders: FolderOf, name: str
) -> None:
    ours = our_engine(
        folders(name, "sharded"), batch={"chunk_size": 16, "max_num_batched_tokens": 64}
    )
    prompts = token_prompts(VOCAB, [70, 33], seed=1)
    completions = ours.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == greedy(models(name), prompt, 24)


def _unwindowed() -> Iterator[torch.nn.Module]:
    yield random_model(mistral_config(VOCAB, window=None))


def _other_layer_kinds() -> Iterator[torch.nn.Module]:
    """Every layer full (no window, one RoPE base), or the window on every layer."""
    for types in (["full_attention"] * 3, ["sliding_attention"] * 3):
        yield gemma3_model(gemma3_config(VOCAB, layer_types=types))


def _no_sinks_or_no_clamp() -> Iterator[torch.nn.Module]:
    no_sinks = gpt_oss_model(gpt_oss_config(VOCAB))
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    yield no_sinks
    yield gpt_oss_model(gpt_oss_config(VOCAB, swiglu_limit=1e4))


@process
@pytest.mark.parametrize(
    ("name", "length", "others"),
    [
        ("mistral", 60, _unwindowed),
        ("gemma3", 60, _other_layer_kinds),
        ("gpt_oss", 40, _no_sinks_or_no_clamp),
    ],
    ids=["mistral-window", "gemma3-layer-kinds", "gpt_oss-sinks-and-clamp"],
)
def test_the_familys_feature_changes_the_answer(
    models: ModelsOf, name: str, length: int, others: Callable[[], Iterator[torch.nn.Module]]
) -> None:
    """The checks mean something: without the window, the layer kinds, the sinks or the
    clamp, the same weights answer otherwise."""
    prompt = token_prompts(VOCAB, [length])[0]
    expected = greedy(models(name), prompt, 16)
    for other in others():
        assert greedy(other, prompt, 16) != expected


# ------------------------------------------------------------------ refusals

REFUSAL_BASES: dict[str, Callable[[], dict[str, Any]]] = {
    "mistral": lambda: mistral_config(100).to_dict(),
    "qwen2": lambda: _qwen2_sliding(),
    "phi3": lambda: phi3_config(100, "phi3").to_dict(),
    "gemma3": lambda: gemma3_config(100, num_hidden_layers=4, layer_types=None).to_dict(),
    "qwen3_moe": lambda: qwen3_moe_config(100).to_dict(),
    "gpt_oss": lambda: gpt_oss_config(100).to_dict(),
}


def _qwen2_sliding() -> dict[str, Any]:
    from transformers import Qwen2Config

    cfg = Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=1)
    return dict(cfg.to_dict())


REFUSALS = [
    ("mistral", {"sliding_window": 0}, "sliding_window"),
    ("mistral", {"sliding_window": "24"}, "sliding_window"),
    # Qwen2's sliding layers are refused, not ignored.
    ("qwen2", {}, "use_sliding_window"),
    ("phi3", {"model_type": "phi3small"}, "unknown architecture 'phi3small'"),
    ("phi3", {"model_type": "phimoe"}, "supported: llama, mistral, qwen2, qwen3, phi3"),
    ("phi3", {"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ("phi3", {"partial_rotary_factor": 0.1}, "gives 1 of 16 head dimensions"),
    ("phi3", {"rope_scaling": {"type": "yarn", "factor": 2.0}}, "unsupported RoPE scaling"),
    (
        "phi3",
        {"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [1.0]}},
        "longrope short_factor must list 8 numbers",
    ),
    ("gemma3", {"model_type": "gemma3"}, "vision"),
    ("gemma3", {"model_type": "gemma2"}, "unknown architecture 'gemma2'"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("gemma3", {"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
    ("gemma3", {"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ("gemma3", {"sliding_window": 0}, "sliding_window"),
    ("qwen3_moe", {"model_type": "qwen2_moe"}, "unknown architecture 'qwen2_moe'"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 of 8 experts"),
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config 'mxfp4'"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention", "x"]}, "layer_types"),
    ("gpt_oss", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 of 8 experts"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ("gpt_oss", {"sliding_window": 0}, "sliding_window"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "needs original_max"),
]


@pytest.mark.parametrize(
    ("base", "fields", "words"),
    REFUSALS,
    ids=[f"{base}-{words}" for base, _, words in REFUSALS],
)
def test_what_is_not_run_is_refused_in_one_line(base: str, fields: dict, words: str) -> None:
    cfg = REFUSAL_BASES[base]() | fields
    with pytest.raises(ModelLoadError) as excinfo:
        from_hf_config(cfg, "m")
    assert words in str(excinfo.value) and "\n" not in str(excinfo.value)


# ------------------------------------------------------------------ Gemma 3's own


@process
def test_gemma3_final_logit_softcapping_matches_transformers(tmp_path: Path) -> None:
    reference = gemma3_model(gemma3_config(VOCAB, final_logit_softcapping=3.0))
    ours = our_engine(save_folder(reference, tmp_path))
    assert ours.model.config.final_logit_softcapping == 3.0
    assert_matches(ours, reference, token_prompts(VOCAB, [9, 25], seed=5), tokens=16)


@process
def test_gemma3_quantized_at_load_runs_geglu_in_the_python_layers(folders: FolderOf) -> None:
    """Float weights quantized to Q8_0: the compiled step (Llama's layers, SiLU) is
    refused; the layers' prefill logits stay close to the dense model's."""
    folder = folders("gemma3", "sharded")
    dense = our_engine(folder)
    quantized = our_engine(folder, weights="quantized", quantize="q8_0")
    assert quantized.model.decode_step is None
    assert "Gemma" in compiled_problem(quantized.model)
    prompts = token_prompts(VOCAB, [20, 50], seed=6)
    for ours, theirs in zip(
        our_prefill_logits(quantized, prompts), our_prefill_logits(dense, prompts), strict=True
    ):
        scale = theirs.abs().max().item()
        # Q8_0 errs by 5% of the largest logit here; SiLU in GeGLU's place by 17%.
        assert (ours - theirs).abs().max().item() < 0.08 * scale


def test_a_gemma3_transformers_4_config_reads_alike() -> None:
    """rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern (the
    older layout, as Gemma 3's published configs have it)."""
    cfg = {
        "model_type": "gemma3_text",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
    }
    config = from_hf_config(cfg, "g")
    assert config.layer_types == ("sliding_attention",) * 5 + (
        "full_attention",
        "sliding_attention",
    )
    assert [config.layer_window(i) for i in (0, 5, 6)] == [512, None, 512]
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.tie_word_embeddings and config.query_pre_attn_scalar == 256


def test_llama_cpp_defaults_for_what_a_gemma3_gguf_does_not_say() -> None:
    """Every sixth layer full; without a window every layer full at the global base; the
    62-layer model (27B) scales scores by (hidden / heads) ** -0.5."""
    config = gemma3_config(100, num_hidden_layers=7, layer_types=None)
    base = from_hf_config(config.to_dict(), "g")
    assert base.layer_types[4:] == ("sliding_attention", "full_attention", "sliding_attention")
    plain = replace(base, architecture="llama", qk_norm=False, layer_types=())
    facts = gguf_facts(plain, {}, None, "g")
    assert facts.layer_types == base.layer_types and facts.local_rope_theta == 10000.0
    unwindowed = gguf_facts(replace(plain, sliding_window=None), {}, None, "g")
    assert unwindowed.layer_types == () and unwindowed.local_rope_theta == unwindowed.rope_theta
    big = replace(plain, num_layers=62, hidden_size=5376, num_heads=32, head_dim=128)
    assert gguf_facts(big, {}, None, "g").query_pre_attn_scalar == 168
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        gguf_facts(plain, {"gemma3.attn_logit_softcapping": 50.0}, None, "g")


# ------------------------------------------------------------------ Phi-4-mini's LongRoPE
# The engine takes LongRoPE's long factors when its max_model_len passes the pretraining
# length, else the short ones (rope.longrope_factors); transformers switches per call by
# sequence length, so each set is checked where transformers uses it too, and on short
# prompts the long set against transformers with its short factors replaced by the long.


@process
def test_longrope_short_factors_within_the_pretraining_length(
    models: ModelsOf, folders: FolderOf
) -> None:
    """max_model_len = the pretraining length: the short factors, as transformers uses
    them for every sequence that stays within it."""
    ours = our_engine(folders("phi4mini", "sharded"), batch={"max_model_len": LONGROPE_ORIGINAL})
    config = ours.model.config
    assert config.rotary_dim == int(64 // PHI3_HEADS * PARTIAL) and config.tie_word_embeddings
    assert config.rope_scaling is not None
    assert config.rope_scaling["original_max_position_embeddings"] == LONGROPE_ORIGINAL
    assert_matches(ours, models("phi4mini"), token_prompts(VOCAB, [5, 17, 30, 3]))


@process
def test_longrope_long_factors_past_the_pretraining_length(
    models: ModelsOf, folders: FolderOf
) -> None:
    """max_model_len past the pretraining length: the long factors, for prompts past it
    (as transformers) and within it (as transformers with only long factors)."""
    phi4mini, phi4mini_long = models("phi4mini"), models("phi4mini_long")
    short_prompt = token_prompts(VOCAB, [20], seed=5)[0]
    # The check means something: the two factor sets answer differently.
    assert greedy(phi4mini, short_prompt, 16) != greedy(phi4mini_long, short_prompt, 16)
    ours = our_engine(folders("phi4mini", "sharded"))
    assert_matches(ours, phi4mini, token_prompts(VOCAB, [65, 90, 70], seed=1))
    assert_matches(ours, phi4mini_long, [short_prompt, *token_prompts(VOCAB, [5, 40], seed=2)])


@process
def test_a_phi4mini_gguf_takes_each_longrope_factor_set(tmp_path: Path, models: ModelsOf) -> None:
    reference = models("phi4mini", toy=True)
    path = CASES["phi4mini"].gguf(reference, tmp_path / "p.gguf", False)
    cache = tmp_path / "cache"
    short = our_engine(
        path, cache_dir=cache, weights="dense", batch={"max_model_len": LONGROPE_ORIGINAL}
    )
    assert_matches(short, reference, token_prompts(TOY_VOCAB, [5, 17, 30]))
    ours = our_engine(path, cache_dir=cache, weights="dense")
    assert_matches(ours, reference, token_prompts(TOY_VOCAB, [65, 80], seed=1))
    long = models("phi4mini_long", toy=True)
    assert_matches(ours, long, token_prompts(TOY_VOCAB, [5, 30], seed=2))


# ------------------------------------------------------------------ Mistral's own


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built")
@process
def test_the_compiled_decode_step_keeps_mistrals_window(tmp_path: Path, models: ModelsOf) -> None:
    """A block-quantized GGUF (llama layout, as llama.cpp writes Mistral) whose metadata
    has the window: the compiled step runs decodes until the window cuts a context, then
    the layers, and answers as the layers alone do."""
    path = CASES["mistral"].gguf(models("mistral", toy=True), tmp_path / "m.gguf", True)
    compiled = our_engine(path, cache_dir=tmp_path / "cache", weights="quantized")
    assert compiled.model.config.sliding_window == WINDOW
    assert compiled.model.decode_step is not None
    layers = our_engine(path, cache_dir=tmp_path / "cache", weights="quantized")
    layers.model.decode_step = None
    prompts = token_prompts(TOY_VOCAB, [4, 10, 30])
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    got = [c.token_ids for c in compiled.generate(prompts, params)]
    assert got == [c.token_ids for c in layers.generate(prompts, params)]


# ------------------------------------------------------------------ a mixture's own


@process
def test_fused_expert_tensors_are_cut_per_expert(tmp_path: Path, models: ModelsOf) -> None:
    """A folder whose experts are stacked 3-D tensors (transformers' in-memory layout:
    experts.gate_up_proj [experts, 2 * columns, hidden], experts.down_proj) loads as the
    per-expert one does."""
    from safetensors.torch import save_file

    mixtral = models("mixtral")
    folder = save_folder(mixtral, tmp_path)
    state = {n: t.contiguous() for n, t in mixtral.state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)  # this version's layout
    for path in folder.glob("*.safetensors"):
        path.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert_matches(our_engine(folder), mixtral, token_prompts(VOCAB, [9, 33]), tokens=8)


def _config_fields() -> dict[str, Any]:
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


@process
def test_decode_steps_run_top_k_experts_per_layer(
    folders: FolderOf, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-token prompt: every step (prefill and decode) is one token, and each layer
    groups it to exactly top_k experts, each run once."""
    ours = our_engine(folders("mixtral", "sharded"))
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


@process
def test_quantized_moe_gguf_keeps_experts_in_blocks(tmp_path: Path, models: ModelsOf) -> None:
    """Q8_0 experts multiplied in their blocks (the compiled step refuses MoE: the Python
    layers run), close to the same file dequantized, greedy tokens equal; and two
    shards of the quantized model answer as one."""
    path = CASES["mixtral"].gguf(models("mixtral", toy=True), tmp_path / "q8.gguf", True)
    quant = our_engine(path, cache_dir=tmp_path / "cache", weights="quantized", **IN_BLOCKS)
    dense = our_engine(path, cache_dir=tmp_path / "cache", weights="dense")
    expert = quant.model.layers[1].mlp.experts[5]
    assert isinstance(expert.gate_up_proj, QuantLinear) and isinstance(
        expert.down_proj, QuantLinear
    )
    assert quant.model.decode_step is None
    prompts = token_prompts(TOY_VOCAB, [5, 17, 40])
    for ours, theirs in zip(
        our_prefill_logits(quant, prompts), our_prefill_logits(dense, prompts), strict=True
    ):
        assert (ours - theirs).abs().max().item() < 0.02 * theirs.abs().max().item()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = [c.token_ids for c in quant.generate(prompts, params)]
    assert got == [c.token_ids for c in dense.generate(prompts, params)]
    # One process of an appliance with groups of two sums as a shard does (spans).
    whole = our_engine(
        path, cache_dir=tmp_path / "cache", weights="quantized", prefill_tp=2, **IN_BLOCKS
    )
    expected = our_prefill_logits(whole, prompts)
    shards = sharded_prefill_logits(
        path, whole, prompts, 2, cache_dir=tmp_path / "cache", **IN_BLOCKS
    )
    for ours, theirs in zip(shards, expected, strict=True):
        assert (ours - theirs).abs().max().item() < 1e-5


# ------------------------------------------------------------------ gpt-oss's own


@process
def test_chunked_prefill_and_prefix_hits_keep_sinks_and_windows(
    models: ModelsOf, folders: FolderOf
) -> None:
    """Prompts prefilled 16 tokens a step over their cached chunks; then a prompt whose
    first 32 tokens are cached from another (a prefix hit) answers as transformers."""
    engine = our_engine(folders("gpt_oss", "sharded"))
    cfg = engine.model.config
    layout = KVLayout(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    kv = KVCache(layout, 64, engine.model.device)
    limits = SchedulerLimits(8, 64, 16, 512)
    chunked = LLMEngine(engine.model, engine.tokenizer, kv, limits, True)
    first, second = token_prompts(VOCAB, [70, 33], seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in (first, first[:32] + second):
        cached = 0
        tokens: list[int] = []
        for out in chunked.stream(prompt, params):
            tokens += out.token_ids
            cached = max(cached, out.cached_tokens)
        assert tokens == greedy(models("gpt_oss"), prompt, 24)
    assert cached == 32


@process
def test_mxfp4_expert_blocks_in_a_folder_are_refused(tmp_path: Path, folders: FolderOf) -> None:
    from safetensors.torch import save_file

    for path in folders("gpt_oss", "sharded").iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    blocks = torch.zeros(EXPERTS, 192, 2, 16, dtype=torch.uint8)
    save_file(
        {"model.layers.0.mlp.experts.gate_up_proj_blocks": blocks}, tmp_path / "m.safetensors"
    )
    with pytest.raises(ModelLoadError, match="MXFP4"):
        our_engine(tmp_path)


@process
def test_mxfp4_experts_in_a_gguf_are_dequantized(tmp_path: Path, models: ModelsOf) -> None:
    """Experts stored as MXFP4 blocks (as llama.cpp ships gpt-oss) answer as transformers
    does with the same weights rounded to MXFP4."""
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    toy_reference = models("gpt_oss", toy=True)
    tensors = gpt_oss_gguf_tensors(toy_reference)
    rounded = copy.deepcopy(toy_reference)
    state = rounded.state_dict()
    for name, tensor in list(tensors.items()):
        if name.endswith("_proj.weight") and ".experts." in name:
            blocks = gguf.quants.quantize(tensor.numpy(), mxfp4)
            tensors[name] = torch.from_numpy(gguf.quants.dequantize(blocks, mxfp4).copy())
    with torch.no_grad():
        for layer in range(len(LAYER_TYPES)):
            experts = f"model.layers.{layer}.mlp.experts."
            gate, up = tensors[experts + "gate_proj.weight"], tensors[experts + "up_proj.weight"]
            # [experts, columns, 2, hidden] -> rows g0, u0, g1, ...: [experts, hidden, 2 * cols]
            fused = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2)
            state[experts + "gate_up_proj"].copy_(fused)
            down = tensors[experts + "down_proj.weight"].transpose(1, 2)
            state[experts + "down_proj"].copy_(down)
    types = {n: mxfp4 for n in tensors if n.endswith("_proj.weight") and ".experts." in n}
    path = gpt_oss_gguf(rounded, tmp_path / "mx.gguf", tensors=tensors, types=types)
    ours = our_engine(path, cache_dir=tmp_path / "cache")
    assert_matches(ours, rounded, token_prompts(TOY_VOCAB, [9, 33], seed=8), tokens=16)


@process
def test_the_quantized_path_keeps_the_expert_biases(folders: FolderOf) -> None:
    """Float weights quantized to Q8_0 at load: experts and o keep their biases, and the
    prefill logits stay close to the dense model's at most positions (Q8_0 errs by 2-5%
    of a position's largest logit here; where it flips a token's top-2 experts, by ~20%)."""
    folder = folders("gpt_oss", "sharded")
    engine = our_engine(folder)
    quantized = our_engine(folder, weights="quantized", quantize="q8_0", **IN_BLOCKS)
    assert quantized.model.decode_step is None
    layer = quantized.model.layers[0]
    linears = (layer.mlp.experts[0].gate_up_proj, layer.mlp.experts[0].down_proj)
    assert all(isinstance(x, QuantLinear) and x.bias is not None for x in linears)
    assert layer.self_attn.o_proj.bias is not None
    prompts = token_prompts(VOCAB, [20, 50], seed=6)
    for ours, theirs in zip(
        our_prefill_logits(quantized, prompts), our_prefill_logits(engine, prompts), strict=True
    ):
        errors = (ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)  # [positions]
        assert errors.median().item() < 0.06 and errors.max().item() < 0.3
