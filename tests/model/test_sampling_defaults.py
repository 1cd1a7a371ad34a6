"""The model's recommended sampling, for the request fields a client leaves out: read from
a generation_config.json or a GGUF's general.sampling.* keys, overridden by the settings,
filled into request bodies (sampling_defaults.py; served in test_served_sampling_defaults)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tiny_gguf import write_gguf

from appliance.model import model_source
from appliance.model.sampling_defaults import SamplingDefaults, read_sampling_defaults
from appliance.settings.config import Settings, SettingsError, load_settings

# Qwen3's generation_config.json, as its repository has it.
QWEN3 = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}
CHAT = {
    "temperature": ("temperature",),
    "repetition_penalty": ("repetition_penalty", "repeat_penalty"),
}


def folder_with(tmp_path: Path, config: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_generation_config_gives_its_sampling_fields_and_nothing_else(tmp_path: Path) -> None:
    defaults = read_sampling_defaults("auto", folder_with(tmp_path, QWEN3), {})
    assert dict(defaults.values) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert isinstance(defaults.values["top_k"], int)
    assert defaults.max_tokens is None
    assert defaults.describe() == "temperature 0.6, top_p 0.95, top_k 20"
    many = SamplingDefaults({"max_new_tokens": 1234567, "temperature": 0.0})
    assert many.describe() == "max_new_tokens 1234567, temperature 0"  # not 1.23457e+06
    assert defaults.source == str(tmp_path / "generation_config.json")


def test_vllm_keeps_the_apis_own_defaults_and_a_folder_without_one_has_none(
    tmp_path: Path,
) -> None:
    assert not read_sampling_defaults("vllm", folder_with(tmp_path, QWEN3), {}).values
    assert not read_sampling_defaults("auto", tmp_path / "elsewhere", {}).values


def test_a_named_folder_or_file_is_read_in_place_of_the_models(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "mine").mkdir()
    model = folder_with(tmp_path / "model", QWEN3)
    mine = folder_with(tmp_path / "mine", {"temperature": 0.2, "max_new_tokens": 64})
    for setting in (mine, mine / "generation_config.json"):
        defaults = read_sampling_defaults(str(setting), model, {})
        assert dict(defaults.values) == {"temperature": 0.2, "max_new_tokens": 64}
        assert defaults.max_tokens == 64


def test_overrides_go_over_the_models_and_are_checked(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, QWEN3)
    defaults = read_sampling_defaults("auto", folder, {"temperature": 0.0, "min_p": 0.05})
    assert dict(defaults.values) == {"temperature": 0.0, "top_p": 0.95, "top_k": 20, "min_p": 0.05}
    assert defaults.source.startswith("override_generation_config over ")
    alone = read_sampling_defaults("vllm", folder, {"max_new_tokens": 8})
    assert (dict(alone.values), alone.source) == (
        {"max_new_tokens": 8},
        "override_generation_config",
    )
    with pytest.raises(ValueError, match="'temp' is not a sampling default; known: temperature"):
        read_sampling_defaults("auto", folder, {"temp": 0.5})
    with pytest.raises(ValueError, match=r"top_p must be in \[0.0, 1.0\], got 0"):
        read_sampling_defaults("auto", folder, {"top_p": 0})
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number"):
        read_sampling_defaults("auto", folder, {"max_new_tokens": 2.5})


def test_a_models_value_no_request_could_send_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = {"temperature": 5.0, "top_p": 0.9, "top_k": "many", "repetition_penalty": None}
    with caplog.at_level(logging.WARNING, logger="appliance.model"):
        defaults = read_sampling_defaults("auto", folder_with(tmp_path, config), {})
    assert dict(defaults.values) == {"top_p": 0.9}
    assert "temperature must be in [0.0, 2.0], got 5.0" in caplog.text
    assert "top_k must be a number, got 'many'" in caplog.text


def test_a_named_file_that_is_no_json_object_is_refused_the_models_own_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not usable"):
        read_sampling_defaults(str(tmp_path), tmp_path, {})
    with caplog.at_level(logging.WARNING, logger="appliance.model"):
        assert not read_sampling_defaults("auto", tmp_path, {}).values  # serves, warned
    assert "the API's own sampling defaults apply" in caplog.text
    folder_with(tmp_path, [1, 2])
    with pytest.raises(ValueError, match="does not hold a JSON object"):
        read_sampling_defaults(str(tmp_path), tmp_path, {})


def test_fill_sets_only_what_the_body_leaves_out() -> None:
    defaults = SamplingDefaults({"temperature": 0.6, "repetition_penalty": 1.1, "top_k": 20})
    body = {"model": "m", "messages": []}
    assert defaults.fill(body, CHAT) == body | {"temperature": 0.6, "repetition_penalty": 1.1}
    assert body == {"model": "m", "messages": []}  # not changed in place
    assert defaults.fill(body | {"temperature": 1.0}, CHAT)["temperature"] == 1.0
    assert defaults.fill(body | {"temperature": None}, CHAT)["temperature"] == 0.6  # null: unsaid
    # llama.cpp's name for the same setting counts as giving it
    said = defaults.fill(body | {"repeat_penalty": 1.3}, CHAT)
    assert (said["repeat_penalty"], "repetition_penalty" in said) == (1.3, False)


def test_a_ggufs_sampling_keys_are_its_defaults(tmp_path: Path) -> None:
    """llama.cpp's converter writes generation_config.json's values as general.sampling.*;
    the cache entry keeps them as a generation_config.json (float32s read back as written)."""
    general = {
        "general.sampling.temp": 0.6,
        "general.sampling.top_k": 20,
        "general.sampling.top_p": 0.95,
        "general.sampling.penalty_repeat": 1.05,
    }
    path = write_gguf(tmp_path / "m.gguf", general=general)
    _, entry = model_source.prepare_model(path, tmp_path / "cache")
    defaults = read_sampling_defaults("auto", entry, {})
    expected = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}
    assert dict(defaults.values) == expected
    plain = write_gguf(tmp_path / "plain.gguf")
    _, plain_entry = model_source.prepare_model(plain, tmp_path / "cache")
    assert not read_sampling_defaults("auto", plain_entry, {}).values


def test_the_settings_check_both_at_load(tmp_path: Path) -> None:
    settings = Settings(override_generation_config={"max_new_tokens": 12.0})
    assert settings.override_generation_config == {"max_new_tokens": 12}
    # a flag's text (--override-generation-config), a TOML file's table
    flag = load_settings(override_generation_config='{"top_k": 40}')
    assert flag.override_generation_config == {"top_k": 40}
    toml = tmp_path / "appliance.toml"
    toml.write_text("[override_generation_config]\ntemperature = 0.7\n")
    assert load_settings(toml).override_generation_config == {"temperature": 0.7}
    with pytest.raises(SettingsError, match="not a JSON object"):
        load_settings(override_generation_config="{top_k")
    assert Settings().generation_config == "auto"
    with pytest.raises(ValueError, match="neither auto, vllm, nor a folder"):
        Settings(generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="'temp' is not a sampling default"):
        Settings(override_generation_config={"temp": 0.5})
