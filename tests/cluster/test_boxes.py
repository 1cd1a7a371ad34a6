"""Two boxes on this machine: a head (`appliance serve`, prefill on its devices) and an
agent (`appliance agent`, box "b", decode), joined over loopback with a shared secret,
each box at its own address (the head listens on 127.0.0.2, box b connects from 127.0.0.3).
Prompts prefill on the head; their KV crosses to box b through NIXL over TCP; greedy
outputs equal the single engine's. Killing the agent mid-load loses no request (the head's
own decode worker takes them over); the box rejoins and takes work again; a third box
(c, from 127.0.0.4) joining while requests stream takes work; a wrong secret is refused,
as is a box whose certificate is another cluster's, and a known box offering other
devices than before. Each box has its certificate of the cluster's CA (conftest.py).
Runs in file order: each test leaves the cluster as the next expects."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import Certs
from server_process import API_KEY, ServerProcess, cluster_head, greedy_text, wait_until

from appliance.bench.compare import free_port
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.kv.remote_pool import nixl_available

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

PROMPTS = [
    "The lighthouse keeper wrote in his log that the ship",
    "Three things every garden needs are",
    "The river ran past the old mill and",
    "In the winter market the baker sold",
    "A letter arrived from the island, and it said",
    "The mountain village had one bridge, which",
]
MAX_TOKENS = 24
BOX_ADDRESS = "127.0.0.3"  # box b's own address (the head's is 127.0.0.2)
THIRD_ADDRESS = "127.0.0.4"  # box c's


class Cluster:
    """The head and the agents started against it."""

    def __init__(self, head: ServerProcess, address: str, secret: Path, certs: Certs) -> None:
        self.head, self.address, self.secret, self.certs = head, address, secret, certs
        self.agents: list[subprocess.Popen] = []

    def agent(
        self,
        box: str,
        secret: Path | None = None,
        address: str = BOX_ADDRESS,
        cpu_devices: str = "1",
        certs: Certs | None = None,
    ) -> subprocess.Popen:
        command = [sys.executable, "-m", "appliance.cli", "agent", "--head", self.address]
        command += ["--box", box, "--pool", "decode", "--cpu-devices", cpu_devices]
        command += ["--address", address]
        command += ["--secret-file", str(secret or self.secret)]
        command += (certs or self.certs).flags(box)
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.agents.append(process)
        return process

    def health(self) -> dict:
        return httpx.get(self.head.url + "/health", timeout=10).json()

    def workers(self) -> list[dict]:
        return [w for pool in self.health()["pools"].values() for w in pool]

    def on_box(self, box: str) -> list[dict]:
        return [w for w in self.workers() if w["device"].startswith(f"{box}/") and w["alive"]]

    def admin(self, path: str, body: dict) -> httpx.Response:
        assert self.head.admin_token_file is not None
        token = self.head.admin_token_file.read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.post(self.head.url + path, json=body, headers=headers, timeout=30)

    def complete(self, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        """A greedy completion's text (compared with the engine's own)."""
        return greedy_text(self.head.url, prompt, max_tokens, timeout=300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[Cluster]:
    assert nixl_available(), "NIXL is missing: ./install.sh --dev installs it"
    folder = tmp_path_factory.mktemp("cluster")
    address = f"127.0.0.2:{free_port()}"  # the head box's own address
    more = {"APPLIANCE_CLUSTER__INTERFACE": "lo", **certs.env("head")}
    head, secret = cluster_head(folder, address, **more)
    head.start()
    running = Cluster(head, address, secret, certs)
    yield running
    for agent in running.agents:
        if agent.poll() is None:
            agent.kill()
        agent.wait(30)
    head.stop()
    (folder / "head.log").write_text("".join(head.output))  # to read after a failure


@pytest.fixture(scope="module")
def expected(engine: LLMEngine) -> dict[str, str]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    done = engine.generate([engine.tokenizer.encode(p) for p in PROMPTS], params)
    return {p: c.text for p, c in zip(PROMPTS, done, strict=True)}


def decoders(cluster: Cluster) -> int:
    """Decode workers alive now."""
    return sum(w["alive"] for w in cluster.health()["pools"].get("decode", []))


def all_blocks_free(cluster: Cluster) -> bool:
    return all(w["num_free_blocks"] == w["num_blocks"] for w in cluster.workers() if w["alive"])


def test_a_wrong_secret_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    """Box stranger has its certificate of this cluster, but not the secret."""
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-secret-of-these-boxes\n")
    agent = cluster.agent("stranger", wrong)
    output, _ = agent.communicate(timeout=60)
    assert agent.returncode == 78, output  # a refusal: the unit does not restart it
    assert b"refused this box: its cluster secret differs" in output, output
    assert not cluster.on_box("stranger")


def test_a_box_with_another_clusters_certificate_is_refused(
    cluster: Cluster, other_certs: Certs
) -> None:
    agent = cluster.agent("b", certs=other_certs)  # the secret is right
    output, _ = agent.communicate(timeout=60)
    assert agent.returncode == 78, output
    assert b"no TLS link with the head" in output and b"certificate verify failed" in output
    assert b"refused a connection to the cluster port" in "".join(cluster.head.output).encode()
    assert not cluster.on_box("b")


def test_prefill_on_the_head_decode_on_box_b_equals_one_engine(
    cluster: Cluster, expected: dict[str, str]
) -> None:
    cluster.agent("b")
    wait_until(lambda: any(w["ready"] for w in cluster.on_box("b")), 120, "box b's worker")
    # Only box b decodes: every handoff crosses between the boxes.
    move = cluster.admin("/admin/pools", {"device": 1, "to": "prefill"})
    assert move.status_code == 202, move.text
    wait_until(lambda: decoders(cluster) == 1, 60, "one decoder")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = dict(zip(PROMPTS, pool.map(cluster.complete, PROMPTS), strict=True))
    assert got == expected
    [remote] = cluster.on_box("b")
    assert remote["role"] == "decode" and remote["tokens_out"] >= len(PROMPTS) * (MAX_TOKENS - 1)
    assert f"box 'b' joins from {BOX_ADDRESS}" in "".join(cluster.head.output)
    wait_until(lambda: all_blocks_free(cluster), 20, "every KV block free")


def test_200_concurrent_requests_across_the_boxes_all_complete(cluster: Cluster) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "prompt": f"{PROMPTS[i % len(PROMPTS)]} ({i})",
            "max_tokens": 8,
            "ignore_eos": True,
        }
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return await client.post(cluster.head.url + "/v1/completions", json=body, headers=headers)

    before = cluster.on_box("b")[0]["tokens_out"]
    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * 200
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in replies)
    # every answer's tokens after the first came from box b, the only decode worker
    assert cluster.on_box("b")[0]["tokens_out"] - before == 200 * 7
    wait_until(lambda: all_blocks_free(cluster), 20, "every KV block free")


def test_losing_box_b_mid_load_loses_no_request(cluster: Cluster, expected: dict[str, str]) -> None:
    prompts = PROMPTS * 2
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(cluster.complete, p, 96) for p in prompts]
        # The precondition: box b (the only decoder) holds running requests when it is lost.
        wait_until(lambda: any(w["running"] for w in cluster.on_box("b")), 120, "b decoding")
        # The head decodes again beside box b (in place, at once: the same worker), so the
        # requests have somewhere to go.
        move = cluster.admin("/admin/pools", {"device": 1, "to": "decode"})
        assert move.status_code == 202, move.text
        wait_until(lambda: decoders(cluster) == 2, 60, "two decoders")
        agent = cluster.agents[-1]
        agent.send_signal(signal.SIGKILL)
        agent.wait(30)
        texts = [f.result(timeout=300) for f in futures]
    assert all(len(t) > 0 for t in texts)
    for prompt, text in zip(prompts, texts, strict=True):
        assert text.startswith(expected[prompt])  # 96 tokens: the first 24 as before
    wait_until(lambda: not cluster.on_box("b"), 30, "box b's worker gone")
    wait_until(lambda: all_blocks_free(cluster), 20, "every KV block free")


def test_box_b_rejoins_and_takes_work(cluster: Cluster, expected: dict[str, str]) -> None:
    cluster.agent("b")
    wait_until(lambda: any(w["ready"] for w in cluster.on_box("b")), 120, "box b back")
    move = cluster.admin("/admin/pools", {"device": 1, "to": "prefill"})
    assert move.status_code == 202, move.text
    wait_until(lambda: decoders(cluster) == 1, 60, "one decoder")
    assert cluster.complete(PROMPTS[0]) == expected[PROMPTS[0]]
    [remote] = cluster.on_box("b")
    assert remote["tokens_out"] > 0
    # The worker lost with the box gave way to its successor: every pool whole again.
    assert all(w["alive"] for w in cluster.workers()), cluster.workers()
    assert cluster.health()["status"] == "ok"


def test_a_box_that_joins_again_replaces_its_stale_link(cluster: Cluster) -> None:
    first = cluster.agents[-1]
    [before] = cluster.on_box("b")
    cluster.agent("b")  # as if its agent restarted before the head saw the old link end
    assert first.wait(60) == 0  # the head ended the old link: that agent stops
    wait_until(
        lambda: any(
            w["ready"] and w["worker_id"] != before["worker_id"] for w in cluster.on_box("b")
        ),
        120,
        "box b's new worker",
    )


def test_a_third_box_joining_mid_run_takes_work(cluster: Cluster, expected: dict[str, str]) -> None:
    stop = threading.Event()

    def client(i: int) -> list[tuple[str, str]]:
        """Greedy completions one after another until told to stop: (prompt, text)."""
        done = []
        while not stop.is_set():
            prompt = PROMPTS[(i + len(done)) % len(PROMPTS)]
            done.append((prompt, cluster.complete(prompt)))
        return done

    with ThreadPoolExecutor(8) as pool:
        clients = [pool.submit(client, i) for i in range(8)]
        # The precondition: the load runs (box b decodes) before box c joins.
        wait_until(lambda: any(w["running"] for w in cluster.on_box("b")), 120, "b decoding")
        cluster.agent("c", address=THIRD_ADDRESS)
        wait_until(lambda: any(w["tokens_out"] for w in cluster.on_box("c")), 180, "c decoding")
        assert not any(c.done() for c in clients)  # it joined mid-run: the load still runs
        stop.set()
        answers = [answer for c in clients for answer in c.result(timeout=300)]
    assert all(text == expected[prompt] for prompt, text in answers)
    assert {w["device"].split("/")[0] for w in cluster.on_box("b") + cluster.on_box("c")} == {
        "b",
        "c",
    }
    assert f"box 'c' joins from {THIRD_ADDRESS}" in "".join(cluster.head.output)
    wait_until(lambda: all_blocks_free(cluster), 20, "every KV block free")


def test_a_known_box_offering_other_devices_is_refused(
    cluster: Cluster, expected: dict[str, str]
) -> None:
    first = cluster.agents[-1]  # box c's
    agent = cluster.agent("c", address=THIRD_ADDRESS, cpu_devices="2")
    output, _ = agent.communicate(timeout=60)
    assert agent.returncode == 78, output  # a refusal: the unit does not restart it
    assert b"the head refused box 'c': it joined before with cpu0" in output, output
    # Turned away before it replaced anything: box c's agent and worker serve on.
    assert first.poll() is None and any(w["ready"] for w in cluster.on_box("c"))
    assert cluster.on_box("b")
    assert cluster.complete(PROMPTS[1]) == expected[PROMPTS[1]]
