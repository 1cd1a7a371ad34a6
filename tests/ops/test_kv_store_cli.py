"""`appliance kv-store` with no appliance running (issue 41): `show` counts the disk
tier's block files and `clear --force` deletes them, from the folder the settings name;
files not the tier's stay. Without --force, or where something takes the connection but
does not answer, nothing is deleted and the command fails with one line. (With a server:
tests/server/test_kv_store_server.py.)"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.kv_store.disk_tier import DiskTier
from appliance.kv_store.namespace import StoreNamespace
from appliance.ops import kv_store_cli

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
    assert f"no appliance listens at {url}" in out.err
    assert f"disk tier at {disk}: 3 blocks" in out.out
    assert main(["kv-store", "clear", "--url", url, "--force"]) == 0
    assert f"cleared the disk tier at {disk}: 3 blocks deleted" in capsys.readouterr().out
    assert list(disk.glob("*/*.kv")) == []
    assert (disk / "notes.txt").exists()


def test_with_no_server_and_no_disk_tier_there_is_nothing_to_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("APPLIANCE_KV_STORE__DISK_PATH", raising=False)
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    url = f"http://127.0.0.1:{closed_port()}"
    assert main(["kv-store", "clear", "--url", url, "--force"]) == 0
    assert "nothing to clear" in capsys.readouterr().out


def test_with_no_server_clear_deletes_nothing_unless_forced(
    disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An appliance still starting, or one at another address with the same disk_path,
    is not seen at this one: its files stay unless the user says none uses them."""
    url = f"http://127.0.0.1:{closed_port()}"
    assert main(["kv-store", "clear", "--url", url]) == 1
    err = capsys.readouterr().err
    assert f"no appliance listens at {url}" in err and "--force" in err
    assert len(err.strip().splitlines()) == 1
    assert len(list(disk.glob("*/*.kv"))) == 3


@pytest.fixture
def silent() -> Iterator[str]:
    """A loopback address that takes connections and never answers (a server busy
    starting, say): the kernel accepts them into the backlog."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("action", ["show", "clear"])
def test_an_address_that_does_not_answer_is_an_error_not_no_appliance(
    action: str,
    disk: Path,
    silent: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(kv_store_cli, "TIMEOUT_S", 0.5)  # not 30 s of a test's time
    assert main(["kv-store", action, "--url", silent, "--force"]) == 1
    out = capsys.readouterr()
    assert out.err.strip() == f"appliance at {silent} did not answer: ReadTimeout: timed out"
    assert out.out == ""
    assert len(list(disk.glob("*/*.kv"))) == 3
