"""Two boxes in two network namespaces joined by a veth pair the test makes (as root, as
CI runs; it removes them after): the head in this namespace at 10.213.0.1, box b's agent
in its own at 10.213.0.2, so each box has its own interface and nothing is shared through
loopback. Prompts prefill on the head and their KV crosses the veth through NIXL to box
b's decode worker: greedy outputs equal the single engine's. Every port the boxes listen
on is on its own box's interface (the head's HTTP server on loopback): none on a wildcard.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from conftest import Certs
from server_process import API_KEY, ServerProcess, cluster_head, wait_until

from appliance.bench.compare import free_port
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams

PROMPTS = [
    "The lighthouse keeper wrote in his log that the ship",
    "Three things every garden needs are",
    "In the winter market the baker sold",
]
MAX_TOKENS = 16
HEAD_IP, BOX_IP = "10.213.0.1", "10.213.0.2"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="network namespaces and veth pairs need root (CI runs as root)"
)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def remove_stale_namespaces() -> None:
    """Namespaces a killed run left (their test process gone): their veth ends hold this
    test's addresses, so this run's would not route."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        tag = name.removeprefix("appliance-b")
        if tag != name and tag.isdigit() and not psutil.pid_exists(int(tag)):
            subprocess.run(["ip", "link", "del", f"aph{tag}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    """Box b's namespace, joined to this one by a veth pair (head end vhN, box end vbN)."""
    remove_stale_namespaces()
    tag = os.getpid()  # interface names stay within 15 characters: aph + 7 digits
    name, head_end, box_end = f"appliance-b{tag}", f"aph{tag}", f"apb{tag}"
    ip("netns", "add", name)
    try:
        ip("link", "add", head_end, "type", "veth", "peer", "name", box_end)
        ip("link", "set", box_end, "netns", name)
        ip("addr", "add", f"{HEAD_IP}/24", "dev", head_end)
        ip("link", "set", head_end, "up")
        ip("-n", name, "addr", "add", f"{BOX_IP}/24", "dev", box_end)
        ip("-n", name, "link", "set", box_end, "up")
        ip("-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        subprocess.run(["ip", "link", "del", head_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture(scope="module")
def boxes(
    namespace: str, tmp_path_factory: pytest.TempPathFactory, certs: Certs
) -> Iterator[tuple]:
    folder = tmp_path_factory.mktemp("netns")
    listen = f"{HEAD_IP}:{free_port()}"  # its interface: the veth's head end
    head, secret = cluster_head(folder, listen, **certs.env("head"))
    head.start()
    command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "appliance.cli"]
    command += ["agent", "--head", listen, "--box", "b", "--pool", "decode"]
    command += ["--cpu-devices", "1", "--secret-file", str(secret), *certs.flags("b")]
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield head, agent
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(30)
        head.stop()


def workers(head: ServerProcess) -> list[dict]:
    health = httpx.get(head.url + "/health", timeout=10).json()
    return [w for pool in health["pools"].values() for w in pool if w["alive"]]


def complete(head: ServerProcess, prompt: str) -> str:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(head.url + "/v1/completions", json=body, headers=headers, timeout=300)
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


def listening(root: int) -> set[str]:
    """The addresses a process of this namespace and its descendants listen on (TCP)."""
    top = psutil.Process(root)
    found = set()
    for process in [top, *top.children(recursive=True)]:
        try:
            sockets = process.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        found |= {s.laddr.ip for s in sockets if s.status == psutil.CONN_LISTEN}
    return found


def test_prefill_on_the_head_decode_in_another_namespace(
    boxes: tuple[ServerProcess, subprocess.Popen], engine: LLMEngine
) -> None:
    head, _ = boxes
    remote = lambda: [w for w in workers(head) if w["device"].startswith("b/")]  # noqa: E731
    wait_until(lambda: any(w["ready"] for w in remote()), 120, "box b's worker")
    assert head.admin_token_file is not None
    token = head.admin_token_file.read_text().strip()
    move = httpx.post(
        head.url + "/admin/pools",
        json={"device": 1, "to": "prefill"},  # only box b decodes: every handoff crosses
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert move.status_code == 202, move.text
    wait_until(lambda: [w["role"] for w in workers(head)].count("decode") == 1, 60, "one decoder")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = [
        c.text for c in engine.generate([engine.tokenizer.encode(p) for p in PROMPTS], params)
    ]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: complete(head, p), PROMPTS))
    assert got == expected
    [worker] = remote()
    assert worker["tokens_out"] >= len(PROMPTS) * (MAX_TOKENS - 1)
    assert f"box 'b' joins from {BOX_IP}" in "".join(head.output)


def test_every_port_is_on_its_own_boxes_interface(
    boxes: tuple[ServerProcess, subprocess.Popen], namespace: str
) -> None:
    head, agent = boxes
    assert head.process is not None
    # The head: its HTTP server on loopback; the cluster port and its workers' KV
    # transfer (registered with NIXL by now) on the veth's head end.
    assert listening(head.process.pid) == {"127.0.0.1", HEAD_IP}
    # Box b's namespace holds only its processes: its decode worker's KV transfer
    # listens on the box's own end, and nothing listens anywhere else.
    ss = ["ip", "netns", "exec", namespace, "ss", "-ltnH"]
    lines = subprocess.run(ss, check=True, capture_output=True, text=True).stdout.splitlines()
    addresses = {line.split()[3].rsplit(":", 1)[0] for line in lines}
    assert addresses == {BOX_IP}, lines
    assert agent.poll() is None  # the agent still serves
