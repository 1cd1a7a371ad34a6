"""`appliance kv-store` with no appliance running (issue 41): `show` counts the disk
tier's block files and `clear` deletes them, from the folder the settings name; files
not the tier's stay. (With a server: tests/server/test_kv_store_server.py.)"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.kv_store.disk_tier import DiskTier
from appliance.kv_store.namespace import StoreNamespace

NAMESPACE = StoreNamespace("smollm2-135m", "q8_0:abc", "bfloat16", 16).digest()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A disk tier of three blocks under the settings' kv_store.disk_path."""
    folder = tmp_path / "kv-disk"
    tier = DiskTier(folder)
    for key in (1, 2, 3):
        assert tier.write((NAMESPACE, key), bytes([key]) * 4096)
    monkeypatch.setenv("APPLIANCE_KV_STORE__DISK_PATH", str(folder))
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    return folder


def test_with_no_server_show_counts_and_clear_deletes_the_disk_tiers_files(
    disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    (disk / "notes.txt").write_text("not the tier's")
    assert main(["kv-store", "show", "--url", url]) == 0
    out = capsys.readouterr()
    assert f"no appliance answers at {url}" in out.err
    assert f"disk tier at {disk}: 3 blocks" in out.out
    assert main(["kv-store", "clear", "--url", url]) == 0
    assert f"cleared the disk tier at {disk}: 3 blocks deleted" in capsys.readouterr().out
    assert list(disk.glob("*/*.kv")) == []
    assert (disk / "notes.txt").exists()


def test_with_no_server_and_no_disk_tier_there_is_nothing_to_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("APPLIANCE_KV_STORE__DISK_PATH", raising=False)
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    url = f"http://127.0.0.1:{closed_port()}"
    assert main(["kv-store", "clear", "--url", url]) == 0
    assert "nothing to clear" in capsys.readouterr().out
