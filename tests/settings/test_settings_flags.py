"""Every setting is a flag, a variable and a file key, in that order of precedence; a
config file works for every command, before or after the subcommand, and for `serve`'s
worker processes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import httpx
import pytest
from server_process import ServerProcess

from appliance.bench.compare import free_port
from appliance.cli import build_parser, settings_of
from appliance.settings.config import Settings, SettingsError
from appliance.settings.flags import ALIASES, Flag, settings_flags


def parsed(*argv: str, parser: argparse.ArgumentParser | None = None) -> Settings:
    """`serve argv`'s settings; `parser`: one already built (a new one when None)."""
    return settings_of((parser or build_parser()).parse_args(["serve", *argv]))


def current(settings: Settings, path: tuple[str, ...]) -> Any:
    value: Any = settings
    for part in path:
        value = getattr(value, part)
    return value


def other_value(flag: Flag, default: Any, folder: Path) -> list[str]:
    """The command line that gives a setting a valid value other than its default."""
    secret = folder / "secret"
    secret.write_text("s\n")
    model = folder / "m.gguf"
    model.write_bytes(b"GGUF")
    needs = {  # settings valid only with another one beside them
        ("cluster", "listen"): ["--cluster.secret-file", str(secret)],
        ("cluster", "head"): ["--cluster.secret-file", str(secret)],
        ("colocated_devices",): ["--cpu-devices", "2"],
    }
    chosen = {
        ("model",): str(model),
        ("host",): "localhost",
        ("cpu_devices",): "2",
        ("prefill_devices",): "0",
        ("decode_devices",): "1",
        ("colocated_devices",): "1",
        ("prefill_tp",): "2",
        ("decode_tp",): "2",
        ("cluster", "listen"): "127.0.0.1:7401",
        ("cluster", "head"): "127.0.0.1:7402",
        ("cluster", "secret_file"): str(secret),
        ("chat_template",): "{{ messages[0].content }}",
        ("generation_config",): "vllm",  # auto, vllm or a folder with a generation_config.json
        ("override_generation_config",): '{"temperature": 0.5}',  # JSON of known keys
        ("prefill_gemm_rows",): "32",  # auto or a row count
        ("cluster", "heartbeat_timeout_s"): "9.5",  # at least twice the beat's interval
        ("kv_store", "shm_dir"): str(folder),  # an absolute folder
        ("server", "allowed_origins"): "https://chat.example.com",
        ("tracing", "otlp_traces_endpoint"): "http://127.0.0.1:4318/v1/traces",  # http(s) only
        ("speculative", "draft_device"): "cuda:1",  # a device's name (checked at start)
    }
    if isinstance(default, bool):
        return [flag.option if not default else "--no-" + flag.option.removeprefix("--")]
    if flag.path in chosen:
        text = chosen[flag.path]
    elif flag.field.annotation is not None and get_origin(flag.field.annotation) is Literal:
        text = next(str(c) for c in get_args(flag.field.annotation) if c != default)
    elif default is None:  # an optional setting: a value of the type it takes
        kinds = [k for k in get_args(flag.field.annotation) if k is not type(None)]
        text = {int: "64", float: "1.5", Path: str(folder)}.get(kinds[0], "x")
    elif isinstance(default, float):
        text = "0.5" if default != 0.5 else "0.75"
    elif isinstance(default, int):
        text = str(default + 1)
    else:
        text = "x"
    return [flag.option, text, *needs.get(flag.path, [])]


def test_every_setting_has_a_flag_that_reaches_it(tmp_path: Path) -> None:
    defaults = Settings()
    checked = set()
    parser = build_parser()  # one for every flag: building it costs ~15 times a parse
    for flag in settings_flags(Settings):
        if flag.path == ("config",):
            continue  # the command's own --config: its tests below
        default = current(defaults, flag.path)
        settings = parsed(*other_value(flag, default, tmp_path), parser=parser)
        assert current(settings, flag.path) != default, f"{flag.option} left {flag.key}"
        checked.add(flag.path[0])
    sections = {"server", "kv", "batch", "planner", "cluster", "admin", "recovery"}
    assert sections <= checked and len(list(settings_flags(Settings))) > 70


def test_the_names_vllm_users_reach_for_are_flags() -> None:
    settings = parsed(
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.5",
        "--tensor-parallel-size",
        "2",
        "--served-model-name",
        "m",
        "--api-key",
        "k",
        "--host",
        "localhost",
        "--port",
        "9",
    )
    assert settings.batch.max_model_len == 1024
    assert settings.kv.gpu_memory_utilization == 0.5
    assert (settings.prefill_tp, settings.decode_tp) == (2, 2)
    assert settings.served_model_name == "m"
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "k"
    assert (settings.host, settings.port) == ("localhost", 9)
    assert set(ALIASES) <= {flag.key for flag in settings_flags(Settings)}


def test_a_bad_flag_value_names_the_setting() -> None:
    with pytest.raises(SettingsError, match=r"kv\.block_size .*APPLIANCE_KV__BLOCK_SIZE"):
        parsed("--kv.block-size", "0")


def test_precedence_is_flag_then_env_then_file_then_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("port = 1001\nhost = 'localhost'\n[kv]\nblock_size = 8\nmemory_mb = 64\n")
    monkeypatch.setenv("APPLIANCE_PORT", "1002")
    monkeypatch.setenv("APPLIANCE_KV__BLOCK_SIZE", "32")
    settings = settings_of(
        build_parser().parse_args(["--config", str(config), "serve", "--kv.block-size", "64"])
    )
    assert settings.kv.block_size == 64  # flag over env over file
    assert settings.port == 1002  # env over file
    assert settings.host == "localhost"  # file over default
    assert settings.kv.memory_mb == 64 and settings.kv.memory_mb_given  # file, in a section
    assert settings.kv.num_blocks is None  # default
    monkeypatch.delenv("APPLIANCE_PORT")
    after = settings_of(build_parser().parse_args(["serve", "--config", str(config)]))
    assert after.port == 1001  # the file, named after the subcommand


def test_the_config_flag_after_the_subcommand_wins_over_the_one_before(tmp_path: Path) -> None:
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text("port = 1\n")
    second.write_text("port = 2\n")
    args = build_parser().parse_args(["--config", str(first), "serve", "--config", str(second)])
    assert settings_of(args).port == 2


def test_settings_from_a_file_travel_to_worker_processes(tmp_path: Path) -> None:
    """The settings are plain data: pickled for a spawned worker and back, unchanged."""
    import pickle

    config = tmp_path / "c.toml"
    config.write_text("port = 1234\n[batch]\nmax_num_seqs = 3\n")
    settings = settings_of(build_parser().parse_args(["serve", "--config", str(config)]))
    again = pickle.loads(pickle.dumps(settings))
    assert type(again) is Settings
    assert again == settings and again.batch.max_num_seqs == 3


@pytest.mark.process
def test_version_and_a_quick_help() -> None:
    version = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.startswith("appliance ")
    # --help loads no torch: the model's modules are imported only by the commands.
    probe = (
        "import sys, contextlib, io\n"
        "from appliance.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['serve', '--help'])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.process
def test_serve_reads_its_config_file_given_before_the_subcommand(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "appliance.toml"
    config.write_text(
        f'port = {port}\nmode = "colocated"\ncpu_devices = 1\n'
        f'[kv]\nmemory_mb = 32\n[admin]\ntoken_file = "{tmp_path / "admin.token"}"\n'
    )
    args = ("--config", str(config), "serve")
    server = ServerProcess({}, port=port, args=args, port_in_env=False, split_unless_named=False)
    server.start()
    try:
        models = httpx.get(server.url + "/v1/models", timeout=10)
        assert models.status_code == 200, models.text
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"model": models.json()["data"][0]["id"], "prompt": "1, 2, 3,", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0


def test_serve_runs_on_the_same_settings_with_its_config_file_after_the_subcommand(
    tmp_path: Path,
) -> None:
    """`serve` runs on `settings_of(args)` alone: the file's settings are the same where
    the --config stands, so the served run above shows the file after it too."""
    config = tmp_path / "appliance.toml"
    config.write_text('port = 1234\nmode = "colocated"\ncpu_devices = 1\n[kv]\nmemory_mb = 32\n')
    parser = build_parser()
    before = settings_of(parser.parse_args(["--config", str(config), "serve"]))
    after = settings_of(parser.parse_args(["serve", "--config", str(config)]))
    assert after == before
    assert (after.port, after.mode, after.cpu_devices, after.kv.memory_mb) == (
        1234,
        "colocated",
        1,
        32,
    )


def test_a_chat_template_is_read_from_its_file_once(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}!")
    assert parsed("--chat-template", str(template)).chat_template == "{{ messages[0].content }}!"
    with pytest.raises(SettingsError, match=r"chat_template .*no such chat template file"):
        parsed("--chat-template", str(tmp_path / "nope.jinja"))


@pytest.mark.process
def test_generate_renders_the_chat_template_given(tmp_path: Path) -> None:
    """The model's own template is replaced: this one refuses every conversation."""
    template = tmp_path / "t.jinja"
    template.write_text("{{ raise_exception('the custom template ran') }}")
    done = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "generate", "hi", "--chat-template", str(template)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "the custom template ran" in done.stderr, done.stderr
