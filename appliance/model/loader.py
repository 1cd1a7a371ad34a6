"""Finding a model's files and turning them into (config, weights read on demand, tokenizer folder).

No float32 copy of a model is ever made: weights come as mappings that read (and, for a
GGUF, dequantize) one tensor when asked for it, and the model copies each into its own
parameter (CausalLM.load_weights). A folder's safetensors files are mapped
(model/safetensors_file.py); a GGUF's tokenizer, facts and dense weights come from its
cache entry (model/gguf_cache.py). The quantized path (model/quant.py) reads a GGUF's
blocks from the file itself and no cache of weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.model import registry
from appliance.model.errors import ModelLoadError
from appliance.model.formats import gguf_file, safetensors_file
from appliance.model.gguf_cache import cached_config, gguf_entry
from appliance.model.gguf_dense_cache import cached_weights
from appliance.model.model_config import ModelConfig
from appliance.model.model_source import default_model_path, folder_config
from appliance.model.quant import QuantWeight


@dataclass
class ModelFiles:
    """A model ready to build: its facts, its weights by HF name, where its tokenizer lies."""

    source: Path
    config: ModelConfig
    # Each tensor read when asked for (a GGUF's dequantized to float32, a folder's views of
    # its mapped files): copy what you keep, and do not hold them all at once. Named as
    # the files name them; named_weights() gives them as the model loads them.
    weights: Mapping[str, torch.Tensor]
    tokenizer_dir: Path
    cache_entry: Path | None = None  # a GGUF's (see gguf_cache.cache_entry)

    def quant_names(self) -> list[str]:
        """The Hugging Face names of the weights the file keeps in block formats."""
        if not self.source.is_file():
            return []
        names = gguf_file.quant_names(self.source, self.config.architecture)
        return registry.loaded_names(names, self.config)

    def quant_weights(self) -> dict[str, QuantWeight]:
        """The weights the file keeps in block formats (a GGUF's; none for a folder),
        under the names the model loads (each expert's rows of the stacked tensors)."""
        if not self.source.is_file():
            return {}
        quant = gguf_file.read_quant_weights(self.source, self.config)
        return registry.split_quant(quant, self.config)

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """`weights` under the names and row orders the model loads (the family's:
        Phi-3's fused projections cut apart, experts one by one), read a tensor at a time."""
        return self._as_loaded(self.weights)

    def _as_loaded(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return registry.loaded_weights(weights, self.config)

    def dense_weights(self, dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
        """The weights a dense model of `dtype` loads, read a tensor at a time: a GGUF's
        from its cache for `dtype` when it has block-quantized ones (dequantized and
        written there in small pieces the first time), all others as the files hold
        them (the model casts each as it copies it)."""
        weights = self.weights
        if not isinstance(weights, gguf_file.GGUFWeights) or self.cache_entry is None:
            return self._as_loaded(weights)
        if not weights.block_quantized():  # F32/F16/BF16: a read costs what the cache's would
            return self._as_loaded(weights)
        return self._as_loaded(cached_weights(weights, self.cache_entry, dtype))


def load_model_files(path: Path | None, cache_dir: Path) -> ModelFiles:
    """Load a GGUF file or a Hugging Face folder; None means the embedded default model."""
    path = Path(path) if path is not None else default_model_path()
    if path.is_dir():
        return _load_hf_folder(path)
    if not path.exists():
        raise ModelLoadError(path, "no such file or folder")
    return _load_gguf(path, cache_dir)


def _load_hf_folder(path: Path) -> ModelFiles:
    config = folder_config(path)
    shards = sorted(path.glob("*.safetensors"))
    return ModelFiles(path, config, safetensors_file.read_safetensors(*shards), path)


def _load_gguf(path: Path, cache_dir: Path) -> ModelFiles:
    entry = gguf_entry(path, cache_dir)
    config = cached_config(entry)
    return ModelFiles(path, config, gguf_file.read_weights(path, config), entry, entry)


class Selected(Mapping[str, torch.Tensor]):
    """A weight mapping cut to some names (those it has): nothing is read until asked for."""

    def __init__(self, weights: Mapping[str, torch.Tensor], names: Iterable[str]) -> None:
        self._weights = weights
        self._names = dict.fromkeys(n for n in names if n in weights)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def release(self, name: str) -> None:
        release = getattr(self._weights, "release", None)
        if release is not None:
            release(name)
