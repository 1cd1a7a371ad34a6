"""The kv_store section of the settings: off by default, reached by flags, variables and
TOML like every section, and a bad value names the setting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.settings.config import SettingsError, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("APPLIANCE_"):
            monkeypatch.delenv(name)


def test_the_store_is_off_by_default() -> None:
    store = load_settings().kv_store
    assert store.enabled is False
    assert (store.host_memory_mb, store.disk_path, store.disk_mb) == (1024, None, 10240)
    assert store.write_policy == "evict" and store.shm_dir == Path("/dev/shm")


def test_variables_and_toml_reach_the_section(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("APPLIANCE_KV_STORE__ENABLED", "true")
    monkeypatch.setenv("APPLIANCE_KV_STORE__DISK_PATH", str(tmp_path))
    toml = tmp_path / "appliance.toml"
    toml.write_text('[kv_store]\nhost_memory_mb = 256\nwrite_policy = "finish"\n')
    store = load_settings(toml).kv_store
    assert store.enabled and store.disk_path == tmp_path
    assert (store.host_memory_mb, store.write_policy) == (256, "finish")


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("WRITE_POLICY", "always", "kv_store.write_policy"),
        ("HOST_MEMORY_MB", "0", "kv_store.host_memory_mb"),
        ("DISK_MB", "-5", "kv_store.disk_mb"),
        ("DISK_PATH", "relative/kv", "must be absolute"),
        ("SHM_DIR", "shm", "kv_store.shm_dir must be absolute"),
    ],
)
def test_a_bad_value_names_the_setting(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(f"APPLIANCE_KV_STORE__{variable}", value)
    with pytest.raises(SettingsError, match=message):
        load_settings()


def test_a_disk_path_that_is_a_file_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    afile = tmp_path / "kv"
    afile.write_text("")
    monkeypatch.setenv("APPLIANCE_KV_STORE__DISK_PATH", str(afile))
    with pytest.raises(SettingsError, match="not a directory"):
        load_settings()
