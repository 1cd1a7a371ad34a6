"""Models by name (appliance/model/hub.py): `org/name[:QUANT]` found in a local Hugging
Face cache laid out as huggingface_hub lays it out (checked with its own scan_cache_dir
and try_to_load_from_cache), `appliance pull` refusing clearly without a network, and
truncated weight files refused with one line that says the sizes."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import gguf
import httpx
import pytest
import torch
from gguf_builder import tiny_gguf_metadata
from huggingface_hub import constants, scan_cache_dir, try_to_load_from_cache
from random_models import random_model, save_folder, tiny_llama_config, write_gguf
from server_process import ServerProcess

from appliance.model import hub
from appliance.model.errors import ModelLoadError
from appliance.model.hub import ModelNotFound, list_local, resolve_model
from appliance.model.loader import load_model_files
from appliance.model.model_source import model_name

COMMIT = "a" * 40
GGUF_COMMIT = "b" * 40
APPLIANCE = [sys.executable, "-m", "appliance.cli"]


def cache_repo(
    hub_dir: Path, repo_id: str, files: Mapping[str, Path], commit: str, ref: str = "main"
) -> Path:
    """`files` (name in the repo -> local file) as huggingface_hub caches a repo: each in
    blobs/<sha256>, linked from snapshots/<commit>/<name>, refs/<ref> naming the commit."""
    repo = hub_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, source in files.items():
        blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face home whose cache holds: test/tiny-llama (a safetensors folder),
    test/tiny-gguf (F32 and Q8_0 GGUFs of one model), test/no-weights (a README and a
    config) and test/truncated-gguf (a Q8_0 GGUF cut short)."""
    home = tmp_path_factory.mktemp("hf_home")
    hub_dir = home / "hub"
    work = tmp_path_factory.mktemp("models")
    folder = save_folder(random_model(tiny_llama_config(49152)), work / "folder")
    cache_repo(
        hub_dir, "test/tiny-llama", {p.name: p for p in folder.iterdir() if p.is_file()}, COMMIT
    )
    from random_models import TOY_TOKENS

    small = random_model(tiny_llama_config(len(TOY_TOKENS)))
    meta = tiny_gguf_metadata(small.config)
    f32 = write_gguf(small, work / "tiny-F32.gguf", gguf.MODEL_ARCH.LLAMA, meta)
    q8 = write_gguf(small, work / "tiny-Q8_0.gguf", gguf.MODEL_ARCH.LLAMA, meta, quantize=True)
    readme = work / "README.md"
    readme.write_text("# tiny\n")
    cache_repo(
        hub_dir,
        "test/tiny-gguf",
        {"tiny-F32.gguf": f32, "tiny-Q8_0.gguf": q8, "README.md": readme},
        GGUF_COMMIT,
    )
    cache_repo(
        hub_dir,
        "test/no-weights",
        {"README.md": readme, "config.json": folder / "config.json"},
        "c" * 40,
    )
    cut = work / "cut-Q8_0.gguf"
    cut.write_bytes(q8.read_bytes()[: q8.stat().st_size - 1000])
    cache_repo(hub_dir, "test/truncated-gguf", {"tiny-Q8_0.gguf": cut}, "d" * 40)
    return home


@pytest.fixture
def hf_cache(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """huggingface_hub in this process pointed at the test cache (its constants are read
    from HF_HOME once, at import)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield hf_home / "hub"


def test_the_cache_is_laid_out_as_huggingface_hub_lays_it_out(hf_cache: Path) -> None:
    info = scan_cache_dir(hf_cache)
    assert not info.warnings
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {"test/tiny-llama", "test/tiny-gguf", "test/no-weights",
                          "test/truncated-gguf"}  # fmt: skip
    assert {rev.commit_hash for rev in repos["test/tiny-gguf"].revisions} == {GGUF_COMMIT}
    found = try_to_load_from_cache("test/tiny-gguf", "tiny-Q8_0.gguf", cache_dir=hf_cache)
    assert isinstance(found, str)
    assert Path(found) == hf_cache / "models--test--tiny-gguf/snapshots" / GGUF_COMMIT / (
        "tiny-Q8_0.gguf"
    )


def test_a_folder_repo_resolves_to_its_snapshot(hf_cache: Path) -> None:
    resolved = resolve_model("test/tiny-llama")
    assert resolved.path == hf_cache / "models--test--tiny-llama" / "snapshots" / COMMIT
    assert resolved.name == "test/tiny-llama"
    assert resolve_model("test/tiny-llama", revision="main") == resolved
    assert resolve_model("test/tiny-llama", revision=COMMIT) == resolved


def test_a_quant_picks_its_gguf(hf_cache: Path) -> None:
    resolved = resolve_model("test/tiny-gguf:Q8_0")
    assert resolved.path.name == "tiny-Q8_0.gguf" and resolved.path.is_file()
    assert resolved.name == "test/tiny-gguf:Q8_0"
    assert resolve_model("test/tiny-gguf:q8_0").path == resolved.path  # any case
    assert resolve_model("test/tiny-gguf:F32").path.name == "tiny-F32.gguf"
    assert resolve_model("hf.co/test/tiny-gguf:Q8_0").path == resolved.path


def test_without_a_quant_q8_0_is_taken_over_f32(hf_cache: Path) -> None:
    resolved = resolve_model("test/tiny-gguf")
    assert resolved.path.name == "tiny-Q8_0.gguf"
    assert resolved.name == "test/tiny-gguf"


def test_several_quants_and_no_default_one_are_listed() -> None:
    with pytest.raises(ModelNotFound) as excinfo:
        hub._choose(hub._Spec("o/n", None), ["m-F16.gguf", "m-Q2_K.gguf"], "o/n")
    message = str(excinfo.value)
    assert "\n" not in message
    assert "several GGUF quants (F16, Q2_K)" in message and "o/n:F16" in message


def test_the_default_quant_is_q4_k_m_then_q8_0() -> None:
    spec = hub._Spec("o/n", None)
    names = ["m-Q2_K.gguf", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-F16.gguf"]
    assert hub._choose(spec, names, "o/n") == "m-Q4_K_M.gguf"
    assert hub._choose(spec, names[::2], "o/n") == "m-Q8_0.gguf"
    assert hub._choose(spec, ["m.Q4_1.gguf", "mmproj-m-F16.gguf"], "o/n") == "m.Q4_1.gguf"
    # Q4_K names its own file, not Q4_K_M's
    assert hub._choose(hub._Spec("o/n", "Q4_K"), ["m-Q4_K.gguf", "m-Q4_K_M.gguf"], "") == (
        "m-Q4_K.gguf"
    )
    assert hub._choose(hub._Spec("o/n", "q4_k_m"), names, "") == "m-Q4_K_M.gguf"


def test_a_split_gguf_is_refused_clearly() -> None:
    names = ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(ModelNotFound, match=r"split GGUF.*llama-gguf-split --merge"):
        hub._choose(hub._Spec("o/n", "Q8_0"), names, "o/n")


def test_an_unknown_quant_lists_the_quants(hf_cache: Path) -> None:
    with pytest.raises(ModelNotFound) as excinfo:
        resolve_model("test/tiny-gguf:Q4_K_M")
    message = str(excinfo.value)
    assert "\n" not in message
    assert "no GGUF of quant Q4_K_M" in message and "(it has: F32, Q8_0)" in message


def test_a_name_not_in_the_cache_says_how_to_pull_it(hf_cache: Path) -> None:
    with pytest.raises(ModelNotFound) as excinfo:
        resolve_model("test/absent")
    message = str(excinfo.value)
    assert "\n" not in message
    assert "`appliance pull test/absent`" in message and str(hf_cache) in message
    assert "HF_HOME" in message
    with pytest.raises(ModelNotFound, match=r"at revision v2 .*\(it holds main\)"):
        resolve_model("test/tiny-llama", revision="v2")


def test_a_repo_without_weights_says_what_it_has(hf_cache: Path) -> None:
    with pytest.raises(ModelNotFound) as excinfo:
        resolve_model("test/no-weights")
    message = str(excinfo.value)
    assert "\n" not in message
    assert "README.md, config.json" in message and "supported: a GGUF file" in message


def test_a_path_stays_a_path(tmp_path: Path, hf_cache: Path) -> None:
    model = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.write_bytes(b"")
    resolved = resolve_model(str(model))
    assert resolved == hub.ResolvedModel(model, model_name(model))
    assert resolved.name == "SmolLM2-135M-Instruct"
    assert resolve_model(str(tmp_path)).name == model_name(tmp_path)
    with pytest.raises(ModelNotFound, match=r"no such file or folder: /nope/m\.gguf"):
        resolve_model("/nope/m.gguf")
    with pytest.raises(ModelNotFound, match="revision"):
        resolve_model(str(model), revision="main")


def test_list_local_names_what_can_be_served(hf_cache: Path) -> None:
    found = {m.repo_id: m for m in list_local()}
    assert set(found) == {"test/tiny-llama", "test/tiny-gguf", "test/truncated-gguf"}
    assert found["test/tiny-llama"].kind == "safetensors"
    assert found["test/tiny-llama"].refs == ("main",)
    assert found["test/tiny-gguf"].kind == "gguf"
    assert found["test/tiny-gguf"].quants == ("F32", "Q8_0")
    assert found["test/tiny-gguf"].commit == GGUF_COMMIT
    assert found["test/tiny-gguf"].size > 0


def test_pull_refuses_offline_in_one_line(hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE"):
        hub.pull("test/absent")


def test_a_truncated_gguf_says_its_size_and_the_size_it_needs(hf_cache: Path) -> None:
    path = resolve_model("test/truncated-gguf:Q8_0").path
    with pytest.raises(ModelLoadError) as excinfo:
        load_model_files(path, hf_cache.parent / "appliance-cache")
    message = str(excinfo.value)
    assert "\n" not in message and str(path) in message
    assert f"has {path.stat().st_size} bytes" in message
    assert f"needs {path.stat().st_size + 1000}" in message


def test_a_truncated_safetensors_file_says_its_size(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    whole = tmp_path / "whole.safetensors"
    save_file({"w": torch.zeros(64, 64)}, str(whole))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole.read_bytes()[:-100])
    from appliance.model.formats.safetensors_file import read_safetensors

    with pytest.raises(ModelLoadError) as excinfo:
        read_safetensors(cut)
    message = str(excinfo.value)
    assert "\n" not in message and str(cut) in message
    assert f"has {cut.stat().st_size} bytes" in message
    assert f"needs {whole.stat().st_size}" in message


# The real command, as a user runs it, with the test cache as HF_HOME.


def appliance(hf_home: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {
        **os.environ,
        "HF_HOME": str(hf_home),
        "APPLIANCE_CACHE_DIR": str(tmp_path / "cache"),
        **env,
    }
    environ.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [*APPLIANCE, *args], capture_output=True, text=True, timeout=300, env=environ
    )


def assert_one_line_refusal(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("appliance: ")
    for word in words:
        assert word in result.stderr, f"{word!r} not in {result.stderr!r}"


@pytest.mark.process
@pytest.mark.parametrize("name", ["test/tiny-llama", "test/tiny-gguf:Q8_0"])
def test_generate_serves_a_model_by_name(hf_home: Path, tmp_path: Path, name: str) -> None:
    result = appliance(
        hf_home, tmp_path, "generate", "--model", name, "hi", "--max-tokens", "4", "--raw"
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.process
@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("test/absent", ("not in the local Hugging Face cache", "appliance pull test/absent")),
        ("test/no-weights", ("has no weights the appliance can load", "config.json")),
        ("test/truncated-gguf:Q8_0", ("tiny-Q8_0.gguf", "truncated", "bytes")),
    ],
)
def test_generate_refuses_a_bad_name_in_one_line(
    hf_home: Path, tmp_path: Path, name: str, words: tuple[str, ...]
) -> None:
    result = appliance(hf_home, tmp_path, "generate", "--model", name, "hi", "--max-tokens", "4")
    assert_one_line_refusal(result, *words)


@pytest.mark.process
@pytest.mark.parametrize("name", ["test/tiny-llama", "test/tiny-gguf:Q8_0"])
def test_serve_answers_as_the_model_it_was_named_by(
    hf_home: Path, tmp_path: Path, name: str
) -> None:
    server = ServerProcess(
        {
            "HF_HOME": str(hf_home),
            "APPLIANCE_CACHE_DIR": str(tmp_path / "cache"),
            "APPLIANCE_ADMIN__TOKEN_FILE": str(tmp_path / "admin.token"),
            "APPLIANCE_MODE": "colocated",
            "APPLIANCE_CPU_DEVICES": "1",
            "APPLIANCE_KV__MEMORY_MB": "16",
        },
        args=("serve", "--model", name),
    )
    server.start()
    try:
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [name]  # the served id is the name given
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"model": name, "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
    finally:
        assert server.stop() == 0


@pytest.mark.process
def test_serve_refuses_a_name_not_in_the_cache_in_one_line(hf_home: Path, tmp_path: Path) -> None:
    result = appliance(hf_home, tmp_path, "serve", "--model", "test/absent", "--port", "0")
    assert_one_line_refusal(result, "not in the local Hugging Face cache")


@pytest.mark.process
def test_pull_refuses_offline(hf_home: Path, tmp_path: Path) -> None:
    result = appliance(hf_home, tmp_path, "pull", "test/absent", HF_HUB_OFFLINE="1")
    assert_one_line_refusal(result, "HF_HUB_OFFLINE")


@pytest.mark.process
def test_pull_from_an_unreachable_hub_fails_fast(hf_home: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    result = appliance(hf_home, tmp_path, "pull", "test/absent", HF_ENDPOINT="http://127.0.0.1:9")
    assert_one_line_refusal(result, "not reachable", "http://127.0.0.1:9")
    assert time.monotonic() - start < 60


@pytest.mark.process
def test_models_lists_the_cache(hf_home: Path, tmp_path: Path) -> None:
    result = appliance(hf_home, tmp_path, "models")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any("test/tiny-gguf" in line and "F32, Q8_0" in line for line in lines)
    assert any("test/tiny-llama" in line and "safetensors" in line for line in lines)
    assert not any("test/no-weights" in line for line in lines)
