"""Settings: defaults, APPLIANCE_* env vars, TOML file, priorities and error messages."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from appliance.settings.config import Settings, SettingsError, load_settings, parse_devices


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No APPLIANCE_* variable from the outside world leaks into a test."""
    for name in list(os.environ):
        if name.upper().startswith("APPLIANCE_"):
            monkeypatch.delenv(name)


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "appliance.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load_settings()
    assert isinstance(s, Settings)
    assert s.model is None
    assert s.dtype == "auto"
    assert s.device == "auto"
    assert s.mode == "disaggregated"
    assert s.cache_dir == Path.home() / ".cache" / "appliance"
    assert s.prefill_devices is None and s.decode_devices is None
    assert s.host == "127.0.0.1"
    assert s.port == 8000
    assert (s.kv.block_size, s.kv.memory_mb, s.kv.num_blocks) == (16, 512, None)
    assert s.kv.gpu_memory_utilization == 0.9
    assert not s.kv.memory_mb_given  # a GPU sizes its pool by the fraction
    assert s.batch.max_num_seqs == 64
    assert s.batch.max_num_batched_tokens == 2048
    assert s.batch.chunk_size == 512
    assert s.batch.max_model_len is None


def test_env_vars(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("APPLIANCE_DTYPE", "bfloat16")
    monkeypatch.setenv("APPLIANCE_PORT", "9001")
    monkeypatch.setenv("APPLIANCE_MODE", "colocated")
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("APPLIANCE_KV__BLOCK_SIZE", "32")
    monkeypatch.setenv("APPLIANCE_BATCH__MAX_MODEL_LEN", "4096")
    s = load_settings()
    assert s.dtype == "bfloat16"
    assert s.port == 9001
    assert s.mode == "colocated"
    assert s.cache_dir == tmp_path
    assert s.kv.block_size == 32
    assert s.kv.memory_mb == 512  # the rest of the section keeps its defaults
    assert s.batch.max_model_len == 4096
    assert s.batch.chunk_size == 512


def test_env_model_pointing_to_an_existing_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("APPLIANCE_MODEL", str(model))
    assert load_settings().model == model


def test_env_model_pointing_to_a_missing_path_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "nope.gguf"
    monkeypatch.setenv("APPLIANCE_MODEL", str(missing))
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert "APPLIANCE_MODEL" in message
    assert str(missing) in message


def test_missing_model_via_keyword_raises(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="model"):
        load_settings(model=tmp_path / "absent")


def test_empty_model_means_the_embedded_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # The field's documented contract: "empty means the embedded SmolLM2".
    assert load_settings(model="").model is None
    monkeypatch.setenv("APPLIANCE_MODEL", "")
    assert load_settings().model is None


def test_toml_file(tmp_path: Path) -> None:
    config = write_toml(
        tmp_path,
        """
dtype = "float16"
port = 1234
host = "0.0.0.0"
allow_remote = true

[kv]
block_size = 8
num_blocks = 100

[batch]
chunk_size = 64
max_num_seqs = 3
""",
    )
    s = load_settings(config)
    assert s.dtype == "float16"
    assert s.port == 1234
    assert s.host == "0.0.0.0"
    assert s.kv.block_size == 8
    assert s.kv.num_blocks == 100
    assert s.kv.memory_mb == 512
    assert s.batch.chunk_size == 64
    assert s.batch.max_num_seqs == 3
    assert s.batch.max_num_batched_tokens == 2048


def test_toml_is_only_read_when_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_toml(tmp_path, "port = 4321\n")
    monkeypatch.chdir(tmp_path)
    assert load_settings().port == 8000


def test_priority_kwargs_over_env_over_toml(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = write_toml(
        tmp_path, 'port = 1111\ndtype = "float16"\nhost = "10.0.0.1"\nallow_remote = true\n'
    )
    assert load_settings(config).port == 1111

    monkeypatch.setenv("APPLIANCE_PORT", "2222")
    monkeypatch.setenv("APPLIANCE_DTYPE", "float32")
    s = load_settings(config)
    assert (s.port, s.dtype, s.host) == (2222, "float32", "10.0.0.1")

    s = load_settings(config, port=3333)
    assert (s.port, s.dtype, s.host) == (3333, "float32", "10.0.0.1")


def test_priority_inside_a_section(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[kv]\nblock_size = 8\nmemory_mb = 100\nnum_blocks = 50\n")
    monkeypatch.setenv("APPLIANCE_KV__BLOCK_SIZE", "32")
    monkeypatch.setenv("APPLIANCE_KV__MEMORY_MB", "200")
    s = load_settings(config, kv={"memory_mb": 300})
    assert s.kv.block_size == 32  # env over TOML
    assert s.kv.memory_mb == 300  # keyword over env
    assert s.kv.num_blocks == 50  # only in TOML


def test_memory_mb_counts_as_given_from_any_source(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a GPU a given kv.memory_mb overrides kv.gpu_memory_utilization, even at the
    default's value; other kv settings leave it ungiven."""
    assert not load_settings(
        kv={"block_size": 32, "gpu_memory_utilization": 0.5}
    ).kv.memory_mb_given
    assert load_settings(kv={"memory_mb": 512}).kv.memory_mb_given
    assert load_settings(write_toml(tmp_path, "[kv]\nmemory_mb = 512\n")).kv.memory_mb_given
    monkeypatch.setenv("APPLIANCE_KV__BLOCK_SIZE", "32")
    assert not load_settings().kv.memory_mb_given
    monkeypatch.setenv("APPLIANCE_KV__MEMORY_MB", "512")
    s = load_settings()
    assert s.kv.memory_mb_given
    # A worker gets a copy bound to its device, pickled into its process.
    worker = pickle.loads(pickle.dumps(s.model_copy(update={"device": "cuda"})))
    assert worker.kv.memory_mb_given and worker.kv.block_size == 32


def test_gpu_memory_utilization_is_a_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_KV__GPU_MEMORY_UTILIZATION", "0.45")
    assert load_settings().kv.gpu_memory_utilization == 0.45
    assert load_settings(kv={"gpu_memory_utilization": 1}).kv.gpu_memory_utilization == 1.0


def test_none_keywords_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_PORT", "2222")
    s = load_settings(port=None, dtype=None)
    assert s.port == 2222
    assert s.dtype == "auto"


def test_settings_error_is_a_value_error() -> None:
    assert issubclass(SettingsError, ValueError)


@pytest.mark.parametrize(
    ("env_name", "value", "setting"),
    [
        ("APPLIANCE_DTYPE", "fp8", "dtype"),
        ("APPLIANCE_DEVICE", "tpu", "device"),
        ("APPLIANCE_MODE", "split", "mode"),
        ("APPLIANCE_PORT", "70000", "port"),
        ("APPLIANCE_PORT", "eighty", "port"),
        ("APPLIANCE_KV__BLOCK_SIZE", "0", "kv.block_size"),
        ("APPLIANCE_KV__BLOCK_SIZE", "many", "kv.block_size"),
        ("APPLIANCE_KV__NUM_BLOCKS", "0", "kv.num_blocks"),
        ("APPLIANCE_KV__GPU_MEMORY_UTILIZATION", "0", "kv.gpu_memory_utilization"),
        ("APPLIANCE_KV__GPU_MEMORY_UTILIZATION", "1.5", "kv.gpu_memory_utilization"),
        ("APPLIANCE_KV__GPU_MEMORY_UTILIZATION", "most", "kv.gpu_memory_utilization"),
        ("APPLIANCE_BATCH__CHUNK_SIZE", "8", "batch.chunk_size"),
        ("APPLIANCE_BATCH__MAX_NUM_SEQS", "0", "batch.max_num_seqs"),
        ("APPLIANCE_PREFILL_TP", "0", "prefill_tp"),
        ("APPLIANCE_DECODE_TP", "two", "decode_tp"),
        ("APPLIANCE_PREFILL_DEVICES", "0,x", "prefill_devices"),
        ("APPLIANCE_DECODE_DEVICES", "3-1", "decode_devices"),
    ],
)
def test_bad_env_value_names_setting_and_env_var(
    monkeypatch: pytest.MonkeyPatch, env_name: str, value: str, setting: str
) -> None:
    monkeypatch.setenv(env_name, value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert setting in message
    assert env_name in message
    assert value in message


def test_bad_toml_value_names_setting_and_env_var(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[kv]\nblock_size = 0\n")
    with pytest.raises(SettingsError) as info:
        load_settings(config)
    assert "kv.block_size" in str(info.value)
    assert "APPLIANCE_KV__BLOCK_SIZE" in str(info.value)


def test_bad_keyword_value_raises() -> None:
    with pytest.raises(SettingsError, match="APPLIANCE_DTYPE"):
        load_settings(dtype="int4")


def test_every_bad_setting_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_DTYPE", "fp8")
    monkeypatch.setenv("APPLIANCE_PORT", "-1")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "APPLIANCE_DTYPE" in str(info.value)
    assert "APPLIANCE_PORT" in str(info.value)


def test_unknown_top_level_key_in_toml_raises(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "prot = 80\n")
    with pytest.raises(SettingsError, match="prot"):
        load_settings(config)


def test_unknown_key_in_toml_section_raises(tmp_path: Path) -> None:
    # A typo inside a section must not be silently ignored either.
    config = write_toml(tmp_path, "[kv]\nblock_sise = 8\n")
    with pytest.raises(SettingsError, match="block_sise"):
        load_settings(config)


def test_malformed_toml_raises(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[kv\nblock_size = 8\n")
    with pytest.raises(SettingsError):
        load_settings(config)


def test_missing_config_file_raises(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    with pytest.raises(SettingsError) as info:
        load_settings(missing)
    assert str(missing) in str(info.value)


def test_config_file_that_is_a_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(SettingsError):
        load_settings(tmp_path)


def test_a_remote_host_needs_allow_remote() -> None:
    with pytest.raises(SettingsError, match="APPLIANCE_ALLOW_REMOTE"):
        load_settings(host="192.168.1.5")
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert load_settings(host=host).host == host
    assert load_settings(host="0.0.0.0", allow_remote=True).allow_remote


def test_api_key_is_secret_and_server_limits_validate() -> None:
    s = load_settings(api_key="s3cr3t-key")
    assert s.api_key.get_secret_value() == "s3cr3t-key" and "s3cr3t" not in repr(s)
    with pytest.raises(SettingsError, match=r"server\.max_concurrent_requests"):
        load_settings(server={"max_concurrent_requests": 0})


# --- device lists ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0,1", (0, 1)), ("0-3", (0, 1, 2, 3)), (" 0-1, 3 ", (0, 1, 3)), ("2,2", (2,))],
)
def test_parse_devices(text: str, expected: tuple[int, ...]) -> None:
    assert parse_devices(text) == expected


@pytest.mark.parametrize("text", [None, "", "  "])
def test_blank_device_list_means_automatic(text: str | None) -> None:
    assert parse_devices(text) is None


@pytest.mark.parametrize(("text", "message"), [("a", "like '0,1' or '0-3'"), ("3-1", "backwards")])
def test_unreadable_device_list_names_the_setting(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"APPLIANCE_DECODE_DEVICES='{text}'.*{message}"):
        load_settings(decode_devices=text)


def test_device_lists_are_read_from_env_toml_and_keywords(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # '0-1, 3' is not JSON: the env value must reach the parser as text.
    monkeypatch.setenv("APPLIANCE_PREFILL_DEVICES", "0-1, 3")
    monkeypatch.setenv("APPLIANCE_DECODE_DEVICES", "")
    s = load_settings()
    assert s.prefill_devices == (0, 1, 3) and s.decode_devices is None
    monkeypatch.delenv("APPLIANCE_PREFILL_DEVICES")
    monkeypatch.delenv("APPLIANCE_DECODE_DEVICES")
    config = write_toml(tmp_path, 'prefill_devices = "2-3"\ndecode_devices = [1, 0, 1]\n')
    s = load_settings(config)
    assert s.prefill_devices == (2, 3) and s.decode_devices == (0, 1)
    # an empty list is no device of this box ('none'), not the automatic split (None)
    assert load_settings(decode_devices=()).decode_devices == ()
    assert load_settings(decode_devices="none").decode_devices == ()


def test_a_bad_device_list_stops_the_start_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("APPLIANCE_PREFILL_DEVICES", "0;1")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(info.value) == (
        "invalid setting prefill_devices (APPLIANCE_PREFILL_DEVICES='0;1'): "
        "Value error, write device indices like '0,1' or '0-3'"
    )
    with pytest.raises(SettingsError, match=r"decode_devices\.1 .*greater than or equal to 0"):
        load_settings(decode_devices=[1, -2])
