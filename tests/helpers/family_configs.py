"""The small transformers configs the model and server tests build random models from:
one shape for all (TINY), and each test's family and changes to it, so that a config
reads as what it changes (a window, a head size, tied embeddings)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

# Two layers of 4 heads over a hidden size of 64: small enough for a test to build and
# run in a moment, large enough for grouped KV heads and a tensor-parallel split by 2.
TINY = MappingProxyType(
    {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
)


def tiny_config(kind: str, vocab: int, **fields: Any) -> Any:
    """transformers' config class `kind` (e.g. "Qwen3Config") of the TINY shape over a
    vocabulary of `vocab`, `fields` changing or adding to it."""
    import transformers  # here: importing this module stays cheap for the quick lane

    return getattr(transformers, kind)(**({"vocab_size": vocab} | dict(TINY) | fields))
