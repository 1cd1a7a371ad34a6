"""Every family in the registry, alike: each architecture name it claims maps back to it,
a config.json of each architecture (a tiny transformers config's own) is read by it and
builds its model, whose parameters take exactly the weights transformers saves (renamed
and cut by the family); unknown architectures are refused naming the known ones.

Parity against transformers (folder, GGUF, tensor parallel, both pool layouts) is checked
per family in tests/test_{qwen3,mistral_window,phi3,gemma3,moe,gpt_oss}.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from appliance.model import registry
from appliance.model.causal_lm import CausalLM
from appliance.model.errors import ModelLoadError
from appliance.model.registry import FAMILIES, family_of, from_hf_config, model_class

SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def _configs() -> list[tuple[str, str, dict[str, Any]]]:
    """(family, transformers config class, its fields beyond SMALL) per architecture."""
    return [
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
        (
            "gpt_oss",
            "GptOssConfig",
            {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
        ),
    ]


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
    gguf = [n for family in FAMILIES for n in family.gguf]
    assert len(gguf) == len(set(gguf))


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


@pytest.mark.parametrize(
    ("family", "config_class", "fields"), _configs(), ids=[c[1] for c in _configs()]
)
def test_a_family_builds_the_model_its_weights_fit(
    family: str, config_class: str, fields: dict[str, Any]
) -> None:
    import transformers
    from random_models import random_model

    hf = getattr(transformers, config_class)(**SMALL, **fields)
    config = from_hf_config(hf.to_dict(), "m")
    assert family_of(config).name == family
    with torch.device("meta"):
        model = model_class(config)(config, torch.float32, torch.device("cpu"), 64)
    assert type(model) is family_of(config).module().MODEL
    weights = registry.loaded_weights(random_model(hf).state_dict(), config)
    model._check_names(model._load_plan(), weights, "m")  # raises where they do not fit
