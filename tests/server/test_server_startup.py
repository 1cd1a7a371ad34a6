"""`appliance serve`'s start-up as a user sees it: progress lines while it loads, then one
`ready:` line with the URL to use, the console command and the admin token's path; and
the serve process itself runs no model, so it never loads torch (its workers do)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import psutil
import pytest
from server_process import fork_servers, maps_torch, wait_until

from appliance.settings.config import load_settings

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model


def test_a_port_0_server_says_what_it_loads_and_the_port_it_got() -> None:
    env = {**os.environ, "APPLIANCE_KV__MEMORY_MB": "64"}
    env.pop("APPLIANCE_PORT", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli", "serve", "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        lines.extend(process.stdout)

    threading.Thread(target=read, daemon=True).start()

    def ready() -> str | None:
        if process.poll() is not None:
            raise RuntimeError("appliance serve exited:\n" + "".join(lines))
        return next((line for line in lines if " ready: " in line), None)

    try:
        line = wait_until(ready, 180, "the ready line")
        port = int(re.search(r"API: http://127\.0\.0\.1:(\d+)/v1;", line).group(1))
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        token = load_settings(port=port).admin_token_path()
        assert token.is_file()  # under the port it got: where the console looks
        assert f"console: appliance console --url {url}; admin token: {token}" in line
        assert " ready: SmolLM2-135M-Instruct (" in line
        assert_only_the_workers_load_torch(process.pid)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)
    text = "".join(lines)
    said = [
        "loading the tokenizer of SmolLM2-135M-Instruct...",
        "tokenizer loaded in ",
        "starting the workers",
        " ready: ",
    ]
    assert [text.find(words) >= 0 for words in said] == [True] * len(said), text
    assert sorted(said, key=text.index) == said
    # Each worker says what it loads, whatever the layout (its role and device).
    loading = re.findall(r"worker \d+ \((\w+)\) on (cpu\d+ \([^)]*\)): loading the model", text)
    assert loading, text
    assert all(f"{role} worker on {device}" in line for role, device in loading)
    assert not token.exists()  # removed on the way out


def assert_only_the_workers_load_torch(pid: int) -> None:
    """The serve process `pid` has no torch library mapped, and each of its workers has:
    before, the serve process imported torch for nothing (about a second of every start,
    ~200 MB of its memory, and a slower exit). The workers are forked by the serve
    process's fork server (its child, which imported torch for them)."""
    [fork_server] = fork_servers(pid)
    workers = fork_server.children()
    assert workers
    for worker in [fork_server, *workers]:
        assert maps_torch(worker), worker.cmdline()
    assert not maps_torch(psutil.Process(pid))
