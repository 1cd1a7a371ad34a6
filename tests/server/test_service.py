"""`appliance serve` as a systemd service: the notify datagrams read from a real unix
datagram socket passed as NOTIFY_SOCKET, a SIGTERM that drains (running streams finish,
new requests get 503, exit 0), and the unit file checked by systemd-analyze."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess, wait_until
from tests_root import ROOT as ROOT_DIR

from appliance.model.model_source import model_name

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

UNIT = ROOT_DIR / "systemd" / "appliance.service"
AGENT_UNIT = UNIT.with_name("appliance-agent.service")


class NotifySocket:
    """A bound unix datagram socket, as systemd holds, recording what arrives."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="notify-", dir="/tmp")  # paths <= 108 bytes
        self.path = f"{self.folder}/notify"
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(self.path)
        self.socket.settimeout(0.2)
        self.datagrams: list[tuple[float, str]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._done.is_set():
            try:
                data = self.socket.recv(4096)
            except TimeoutError:
                continue
            self.datagrams.append((time.monotonic(), data.decode()))

    def lines(self) -> list[str]:
        return [line for _, text in self.datagrams for line in text.split("\n")]

    def close(self) -> None:
        self._done.set()
        self._thread.join()
        self.socket.close()
        shutil.rmtree(self.folder)


@pytest.fixture(scope="module")
def notify() -> Iterator[NotifySocket]:
    sock = NotifySocket()
    yield sock
    sock.close()


@pytest.fixture(scope="module")
def service(notify: NotifySocket) -> Iterator[ServerProcess]:
    """`appliance serve` as systemd runs it: NOTIFY_SOCKET and a 0.4 s WATCHDOG_USEC; its
    requests have a 3 s deadline. The last test of this module stops it."""
    server = ServerProcess(
        {
            "NOTIFY_SOCKET": notify.path,
            "WATCHDOG_USEC": "400000",
            "APPLIANCE_SERVER__REQUEST_TIMEOUT_S": "3",
        }
    )
    server.start()
    yield server
    server.stop()


def test_notify_ready_once_the_workers_are_then_watchdog_and_status(
    service: ServerProcess, notify: NotifySocket
) -> None:
    wait_until(lambda: "READY=1" in notify.lines(), 30, "READY=1", every_s=0.05)
    ready_at = next(t for t, text in notify.datagrams if "READY=1" in text)
    assert httpx.get(service.url + "/health").json()["status"] == "ok"
    # No READY before the workers were: /health was never 200 before READY arrived.
    assert all(status != 200 for status, _ in service.health_seen[:-1])
    count = len(notify.datagrams)
    time.sleep(1.2)  # a 0.4 s watchdog: a ping every 0.2 s
    pings = [t for t, text in notify.datagrams[count:] if "WATCHDOG=1" in text]
    assert len(pings) >= 4 and pings[0] > ready_at
    statuses = [line for line in notify.lines() if line.startswith("STATUS=")]
    assert "STATUS=serving: workers ready prefill 1/1, decode 1/1; 0 generations in flight" in (
        statuses
    )
    assert any(s.startswith("STATUS=starting: 2 workers loading") for s in statuses)


def test_a_request_past_its_deadline_ends_with_an_error_event(service: ServerProcess) -> None:
    body = {
        "model": model_name(None),
        "prompt": "Once upon a time",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    lines = []
    with httpx.stream("POST", service.url + "/v1/completions", json=body, timeout=60) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert "past its deadline of 3 s" in error["message"]
    assert len(lines) > 10  # it streamed until the deadline
    assert httpx.get(service.url + "/health").json()["generations_admitted"] == 0

    def idle() -> bool:  # the aborted request has left both pools and their blocks
        health = httpx.get(service.url + "/health").json()
        workers = [w for pool in health["pools"].values() for w in pool]
        return all(w["running"] == 0 and w["num_free_blocks"] == w["num_blocks"] for w in workers)

    wait_until(idle, 10, "workers idle after the deadline", every_s=0.05)


def test_sigterm_stops_it_with_stopping_and_exit_0(
    service: ServerProcess, notify: NotifySocket
) -> None:
    assert service.stop(sig=signal.SIGTERM) == 0
    lines = notify.lines()
    assert lines.index("READY=1") < lines.index("STOPPING=1")


def stream(url: str, max_tokens: int) -> tuple[str | None, bool]:
    """A streamed chat; (its last finish_reason, whether [DONE] came)."""
    body = {
        "model": model_name(None),
        "messages": [{"role": "user", "content": "Count slowly."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    reason, done = None, False
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choices = json.loads(line.removeprefix("data: "))["choices"]
                reason = choices[0]["finish_reason"] if choices else reason
    return reason, done


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm", "ctrl-c"])
def test_sigterm_lets_running_streams_finish_and_refuses_new_ones(ctrl_c: bool) -> None:
    """SIGTERM to the server (systemd's stop), or SIGINT to its whole process group (Ctrl-C
    in a terminal: the workers get it too, and leave the stopping to the supervisor; they
    died of it, were restarted as crashed, and their requests run again)."""
    server = ServerProcess({"APPLIANCE_SERVER__SHUTDOWN_TIMEOUT_S": "60"}, own_group=ctrl_c)
    server.start()
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, server.url, 48) for _ in range(4)]
        wait_until(
            lambda: httpx.get(server.url + "/health").json()["generations_admitted"] == 4,
            30,
            "4 streams admitted",
            every_s=0.05,
        )
        signalled = time.monotonic()
        if ctrl_c:
            os.killpg(server.process.pid, signal.SIGINT)
        else:
            server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(
            server.url + "/v1/completions",
            json={"model": model_name(None), "prompt": "Hi", "max_tokens": 2},
        )
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert late.headers["Retry-After"]
        results = [s.result(timeout=120) for s in streams]
    assert results == [("length", True)] * 4  # every running stream finished whole
    code = server.process.wait(timeout=60)
    assert code == 0 and time.monotonic() - signalled < 60
    time.sleep(0.2)  # the reader's last lines
    output = "".join(server.output)
    assert "draining 4 generations" in output, output
    assert "exited with" not in output and "Traceback" not in output, output


@pytest.mark.parametrize("presses", [2, 3])
def test_ctrl_c_again_stops_it_at_once_and_still_cleans_up(presses: int) -> None:
    """Ctrl-C twice (or three times), as a user does who will not wait for a long stream:
    the drain ends at once, and the workers still stop, with no traceback. Twice: the
    generations cut off ended the drain, which counted as a third Ctrl-C now and then;
    a third makes uvicorn skip the app's shutdown, which stops the workers."""
    server = ServerProcess({"APPLIANCE_SERVER__SHUTDOWN_TIMEOUT_S": "120"}, own_group=True)
    server.start()
    pools = httpx.get(server.url + "/health").json()["pools"]
    pids = [w["pid"] for workers in pools.values() for w in workers]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream, server.url, 4000)
        wait_until(
            lambda: httpx.get(server.url + "/health").json()["generations_admitted"] == 1,
            30,
            "the stream admitted",
            every_s=0.05,
        )
        os.killpg(server.process.pid, signal.SIGINT)
        wait_until(lambda: "draining 1 generation" in "".join(server.output), 10, "draining")
        time.sleep(0.5)
        assert not running.done()  # the first Ctrl-C waits for the stream
        again = time.monotonic()
        for _ in range(presses - 1):
            os.killpg(server.process.pid, signal.SIGINT)
        code = server.process.wait(timeout=60)
        stopped_s = time.monotonic() - again
        try:
            done = running.result(timeout=30)[1]
        except httpx.HTTPError:  # the connection closed mid-body
            done = False
        assert not done  # cut off, not finished
    assert code == 0 and stopped_s < 20, (code, stopped_s)
    wait_until(lambda: not any(alive(pid) for pid in pids), 10, "its workers gone")
    time.sleep(0.2)  # the reader's last lines
    output = "".join(server.output)
    for sign in ("Traceback", "CancelledError", "KeyboardInterrupt", "exited with"):
        assert sign not in output, output


def test_ctrl_c_while_the_workers_start_stops_it_cleanly() -> None:
    """Ctrl-C (SIGINT to the whole group) as soon as the server answers, its workers still
    starting: the new interpreters hold it off until they ignore it, so none dies of it
    mid-import and nothing is reported as a failed start."""
    server = ServerProcess({}, split_unless_named=False, own_group=True)
    server.launch()
    wait_until(server.starting, 60, "the server answering, not yet ready", every_s=0.02)
    os.killpg(server.process.pid, signal.SIGINT)
    assert server.process.wait(timeout=120) == 0, "".join(server.output)
    time.sleep(0.2)  # the reader's last lines
    output = "".join(server.output)
    assert "signal SIGINT" in output, output
    for sign in ("Traceback", "KeyboardInterrupt", "exited with", "could not start"):
        assert sign not in output, output


def test_a_supervisor_killed_outright_takes_its_workers_with_it() -> None:
    server = ServerProcess({"APPLIANCE_MODE": "colocated", "APPLIANCE_CPU_DEVICES": "2"})
    server.start()
    pools = httpx.get(server.url + "/health").json()["pools"]
    pids = [w["pid"] for workers in pools.values() for w in workers]
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    server.stop(sig=signal.SIGKILL)  # no shutdown: nothing of its own stops the workers
    wait_until(lambda: not any(alive(pid) for pid in pids), 30, "its workers gone")


def alive(pid: int) -> bool:
    """Running (a zombie, dead and not yet reaped by init, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def verify_root(tmp_path: Path, unit_text: str, name: str = "appliance.service") -> Path:
    """A scratch root where the unit is installed as install.sh --system would place it:
    systemd-analyze checks that its ExecStart program exists there."""
    root = tmp_path / "root"
    program = root / "opt/appliance/venv/bin/appliance"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    (units / name).write_text(unit_text)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    return root


def analyze(root: Path, name: str = "appliance.service") -> subprocess.CompletedProcess:
    analyzer = shutil.which("systemd-analyze")
    assert analyzer, "systemd-analyze is missing: apt-get install systemd (.ci/run does)"
    return subprocess.run(
        [analyzer, "verify", f"--root={root}", "--man=no", name],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("unit", [UNIT, AGENT_UNIT], ids=lambda u: u.name)
def test_the_unit_files_verify_clean(tmp_path: Path, unit: Path) -> None:
    result = analyze(verify_root(tmp_path, unit.read_text(), unit.name), unit.name)
    assert result.returncode == 0 and result.stderr == "" and result.stdout == ""


def test_the_agent_unit_restarts_and_runs_the_agent() -> None:
    text = AGENT_UNIT.read_text()
    for line in ("Restart=always", "ExecStart=/opt/appliance/venv/bin/appliance agent"):
        assert line in text.splitlines()
    assert "EnvironmentFile=/etc/appliance/agent.env" in text


def test_the_unit_check_catches_a_broken_unit(tmp_path: Path) -> None:
    broken = UNIT.read_text().replace("ProtectHome=true", "ProtectHom=true")
    result = analyze(verify_root(tmp_path, broken))
    assert "Unknown key 'ProtectHom'" in result.stderr


def test_the_unit_runs_as_a_notify_service_with_watchdog_and_hardening() -> None:
    text = UNIT.read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=30",
        "Restart=on-failure",
        "User=appliance",
        "NoNewPrivileges=true",
        "ProtectSystem=strict",
        "ProtectHome=true",
        "PrivateTmp=true",
        "EnvironmentFile=/etc/appliance/appliance.env",
        "DevicePolicy=closed",
    ):
        assert f"\n{line}\n" in text, line


def unit_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_the_unit_reaches_nvidia_devices_by_group_once_their_modules_are_loaded() -> None:
    lines = unit_lines(UNIT.read_text())
    # nvidia_uvm loaded before the unit starts, when systemd resolves the char-* groups below
    # from /proc/devices (an `-` would be an escaped `/` in modprobe@'s instance name).
    assert "Wants=modprobe@nvidia_uvm.service" in lines
    assert "After=modprobe@nvidia_uvm.service" in lines
    assert Path("/usr/lib/systemd/system/modprobe@.service").exists()  # systemd >= 245
    # Its device nodes made as root, outside the sandbox; no NVIDIA driver does not fail it.
    assert "ExecStartPre=-+/usr/bin/nvidia-modprobe -u -c=0" in lines
    # NVIDIA's device groups, nothing by /dev path (looked up once, skipped while missing).
    assert [line for line in lines if line.startswith("DeviceAllow=")] == [
        "DeviceAllow=char-nvidia-frontend rw",
        "DeviceAllow=char-nvidia rw",
        "DeviceAllow=char-nvidiactl rw",
        "DeviceAllow=char-nvidia-uvm rwm",
        "DeviceAllow=char-nvidia-caps rw",
    ]
    # After persistence mode and the NVSwitch fabric, without pulling either in.
    assert "After=nvidia-persistenced.service nvidia-fabricmanager.service" in lines
    pulls = [line for line in lines if line.startswith(("Wants=", "Requires=", "Requisite="))]
    assert not any("nvidia-persistenced" in line or "fabricmanager" in line for line in pulls)


def test_a_box_without_nvidia_modprobe_verifies_only_thanks_to_the_dash(tmp_path: Path) -> None:
    """verify checks that the ExecStartPre program exists (the scratch root has no NVIDIA
    tools) unless `-` makes its failure harmless."""
    text = UNIT.read_text()
    assert "ExecStartPre=-+/usr/bin/nvidia-modprobe" in text
    strict = text.replace("ExecStartPre=-+/usr/bin/", "ExecStartPre=+/usr/bin/")
    result = analyze(verify_root(tmp_path / "strict", strict))
    assert "Command /usr/bin/nvidia-modprobe is not executable" in result.stderr
    assert result.returncode != 0
    assert analyze(verify_root(tmp_path / "as-is", text)).returncode == 0
