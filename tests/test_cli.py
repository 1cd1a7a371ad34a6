"""The `appliance` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

APPLIANCE = [sys.executable, "-m", "appliance.cli"]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*APPLIANCE, *args], capture_output=True, text=True, timeout=300, env=env)


def test_generate_answers_paris() -> None:
    result = run("generate", "What is the capital of France?", "--max-tokens", "32")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_missing_model_file_is_one_clear_line(tmp_path: Path) -> None:
    result = run("generate", "x", "--model", str(tmp_path / "nope.gguf"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "nope.gguf" in result.stderr and "Traceback" not in result.stderr


def test_corrupt_model_file_is_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    result = run("generate", "x", "--model", str(bad))
    assert result.returncode == 2
    assert "bad.gguf" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_bad_setting_names_the_variable() -> None:
    import os

    env = {**os.environ, "APPLIANCE_DTYPE": "float8"}
    result = run("generate", "x", env=env)
    assert result.returncode == 2
    assert "APPLIANCE_DTYPE" in result.stderr and "Traceback" not in result.stderr


def test_serve_refuses_a_remote_host_without_consent() -> None:
    result = run("serve", "--host", "0.0.0.0")
    assert result.returncode == 2
    assert "APPLIANCE_ALLOW_REMOTE" in result.stderr and "Traceback" not in result.stderr


def test_serve_with_a_corrupt_model_fails_before_listening(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    result = run("serve", "--model", str(bad), "--port", "1")
    assert result.returncode == 2
    assert "bad.gguf" in result.stderr and "Traceback" not in result.stderr


def test_serve_exits_when_its_workers_cannot_start() -> None:
    import os

    # Quantized weights take float32 or bfloat16 activations: every worker fails loading.
    env = {**os.environ, "APPLIANCE_WEIGHTS": "quantized", "APPLIANCE_PORT": "0"}
    result = run("serve", "--dtype", "float16", env=env)
    assert result.returncode == 1
    assert "the workers could not start" in result.stderr


def test_console_without_a_running_server_says_where_it_looked(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "APPLIANCE_CACHE_DIR": str(tmp_path)}
    result = run("console", "--url", "http://127.0.0.1:8765", env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(tmp_path / "admin" / "8765.token") in result.stderr
    assert "is the appliance running" in result.stderr


def test_serve_refuses_tensor_parallel_degrees_that_do_not_fit() -> None:
    import os

    pool = {**os.environ, "APPLIANCE_PREFILL_TP": "2", "APPLIANCE_PORT": "0"}
    result = run("serve", "--mode", "disaggregated", env=pool)  # 2 cores: 1 prefill device
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "prefill_tp=2 does not divide the pool's 1 device" in result.stderr
    heads = {
        **os.environ,
        "APPLIANCE_DECODE_TP": "4",
        "APPLIANCE_CPU_DEVICES": "8",
        "APPLIANCE_CPU_SHARE_CORES": "true",
        "APPLIANCE_PREFILL_DEVICES": "0,1,2,3",
        "APPLIANCE_DECODE_DEVICES": "4,5,6,7",
        "APPLIANCE_PORT": "0",
    }
    result = run("serve", "--mode", "disaggregated", env=heads)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "decode_tp=4: the model has 3 KV heads" in result.stderr
