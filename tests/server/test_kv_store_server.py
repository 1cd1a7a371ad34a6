"""The box's KV store with real workers (issue 41): a prefix one worker computed is served
from the store to the other, in both layouts (only the new part is computed, the greedy
output as when everything is computed); after `appliance serve` restarts, a repeated
prompt is served from the disk tier, a corrupted block file is refused and its part
recomputed; a worker whose KV dtype differs never reads the store. What each request
computed is read as a user does: the usage's cached tokens, /metrics and the admin
snapshot."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from admin_calls import admin_headers, snapshot
from server_process import ServerProcess

from appliance.kv.prefix_cache import prefix_keys

pytestmark = pytest.mark.process

API_KEY = "kv-store-test-key"
BLOCK = 16
DOC_BLOCKS = 24  # the shared document: 384 tokens
NAME = "SmolLM2-135M-Instruct"


def tokens(seed: int, n: int) -> list[int]:
    """`n` ordinary token ids (no special ones), the same for a seed in every run."""
    rng = random.Random(seed)
    return [rng.randrange(300, 40000) for _ in range(n)]


DOC = tokens(1, DOC_BLOCKS * BLOCK)
QUESTION_1 = tokens(2, 11)
QUESTION_2 = tokens(3, 13)


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def complete(server: ServerProcess, prompt: list[int], **extra: object) -> Answer:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=600)
    reply = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return Answer(
        reply.choices[0].text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0
    )


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    """A sample of /metrics (0 where absent)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The store's shared-memory folder (its own, so a test sees only its arenas), disk
    folder and the admin token's folder, for every server of this module."""
    shm = Path("/dev/shm") / f"kvstore-test-{uuid.uuid4().hex}"
    shm.mkdir()
    base = tmp_path_factory.mktemp("kvstore")
    yield {"shm": shm, "disk": base / "disk", "admin": base}
    shutil.rmtree(shm, ignore_errors=True)


def store_server(folders: dict[str, Path], disk: Path, **more: str) -> ServerProcess:
    """A server with the store on (host tier and disk tier at `disk`; blocks enter as
    their request finishes), float32 dense weights (the same numbers however a prompt is
    chunked), small KV pools."""
    token_file = folders["admin"] / "admin.token"
    env = {
        "APPLIANCE_API_KEY": API_KEY,
        "APPLIANCE_DTYPE": "float32",
        "APPLIANCE_WEIGHTS": "dense",
        "APPLIANCE_CPU_SHARE_CORES": "true",
        "APPLIANCE_KV__MEMORY_MB": "64",
        "APPLIANCE_KV_STORE__ENABLED": "true",
        "APPLIANCE_KV_STORE__HOST_MEMORY_MB": "64",
        "APPLIANCE_KV_STORE__SHM_DIR": str(folders["shm"]),
        "APPLIANCE_KV_STORE__DISK_PATH": str(disk),
        "APPLIANCE_KV_STORE__WRITE_POLICY": "finish",
        "APPLIANCE_ADMIN__TOKEN_FILE": str(token_file),
        **more,
    }
    return ServerProcess(env, admin_token_file=token_file)


LAYOUTS = {
    # Two prefill workers (the prefix goes from one to the other) and a decode worker.
    "split": {
        "APPLIANCE_CPU_DEVICES": "3",
        "APPLIANCE_PREFILL_DEVICES": "0,1",
        "APPLIANCE_DECODE_DEVICES": "2",
    },
    "colocated": {"APPLIANCE_CPU_DEVICES": "2", "APPLIANCE_MODE": "colocated"},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_prefix_computed_on_one_worker_is_served_to_the_other(
    folders: dict[str, Path], layout: str
) -> None:
    server = store_server(folders, folders["disk"] / layout, **LAYOUTS[layout])
    server.start(timeout=600)
    try:
        # In turn: the second prompt goes to the worker that never saw the first.
        reply = httpx.patch(
            server.url + "/admin/tuning",
            json={"routing": "round_robin"},
            headers=admin_headers(server),
            timeout=10,
        )
        assert reply.status_code == 200, reply.text
        first = complete(server, DOC + QUESTION_1)
        assert first.cached_tokens == 0
        second = complete(server, DOC + QUESTION_2)
        # The document's blocks came from the store: only the question was computed.
        assert second.cached_tokens == DOC_BLOCKS * BLOCK
        assert second.computed == len(QUESTION_2)
        assert metric(server, "appliance_kv_store_hits_total", '{tier="host"}') == DOC_BLOCKS
        # Everything computed (prompt logprobs need every position: no cache, no store).
        whole = complete(server, DOC + QUESTION_2, prompt_logprobs=0)
        assert whole.cached_tokens == 0
        assert second.text == whole.text
        computed = metric(server, "appliance_prompt_tokens_computed_total")
        assert computed == first.prompt_tokens + second.computed + whole.prompt_tokens
        view = snapshot(server).kv_store
        assert view is not None and view.hits["host"] == DOC_BLOCKS
        assert view.blocks["host"] > 0
    finally:
        assert server.stop() == 0
    assert list(folders["shm"].iterdir()) == []  # the arena went with its owner


@pytest.fixture(scope="module")
def stored(folders: dict[str, Path]) -> tuple[Path, dict[str, Answer]]:
    """A colocated server that answered two long prompts, then stopped: their blocks
    went to the disk tier as the store closed. The answers, by prompt."""
    disk = folders["disk"] / "restart"
    server = store_server(folders, disk, APPLIANCE_MODE="colocated", APPLIANCE_CPU_DEVICES="1")
    server.start(timeout=600)
    try:
        answers = {
            "doc": complete(server, DOC + QUESTION_1),
            "other": complete(server, tokens(4, DOC_BLOCKS * BLOCK) + QUESTION_1),
        }
    finally:
        assert server.stop() == 0
    return disk, answers


def test_after_a_restart_the_disk_tier_serves_and_a_corrupt_block_is_recomputed(
    folders: dict[str, Path], stored: tuple[Path, dict[str, Answer]]
) -> None:
    disk, before = stored
    folders_found = [p for p in disk.iterdir() if p.is_dir()]
    assert len(folders_found) == 1  # one namespace: one model, one KV dtype
    namespace_dir = folders_found[0]
    other = tokens(4, DOC_BLOCKS * BLOCK) + QUESTION_1
    for prompt in (DOC + QUESTION_1, other):  # every full block of both, kept on disk
        for key in prefix_keys(prompt, BLOCK):
            assert (namespace_dir / f"{key:016x}.kv").is_file()
    broken = prefix_keys(other, BLOCK)[5]  # its sixth block: five are served, then computed
    path = namespace_dir / f"{broken:016x}.kv"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # a flipped byte in the payload: the checksum no longer matches
    path.write_bytes(bytes(data))

    server = store_server(folders, disk, APPLIANCE_MODE="colocated", APPLIANCE_CPU_DEVICES="1")
    server.start(timeout=600)
    try:
        doc = complete(server, DOC + QUESTION_1)
        assert doc.cached_tokens == DOC_BLOCKS * BLOCK  # all from disk
        assert doc.text == before["doc"].text
        assert metric(server, "appliance_kv_store_hits_total", '{tier="disk"}') == DOC_BLOCKS
        again = complete(server, other)
        assert again.cached_tokens == 5 * BLOCK  # up to the corrupt block, the rest computed
        assert again.text == before["other"].text
        assert metric(server, "appliance_kv_store_refused_total") == 1
    finally:
        assert server.stop() == 0


def test_a_worker_with_another_kv_dtype_never_reads_the_store(
    folders: dict[str, Path], stored: tuple[Path, dict[str, Answer]]
) -> None:
    disk, _ = stored
    server = store_server(
        folders,
        disk,
        APPLIANCE_MODE="colocated",
        APPLIANCE_CPU_DEVICES="1",
        APPLIANCE_KV_CACHE_DTYPE="bfloat16",
    )
    server.start(timeout=600)
    try:
        answer = complete(server, DOC + QUESTION_1)
        assert answer.cached_tokens == 0
        assert metric(server, "appliance_kv_store_hits_total", '{tier="disk"}') == 0
        assert metric(server, "appliance_kv_store_lookups_total") == 1
    finally:
        assert server.stop() == 0


def test_blocks_a_small_pool_evicts_are_read_back_from_the_store(
    folders: dict[str, Path],
) -> None:
    """The default write policy: a block enters the store as the worker's pool evicts it
    (or, idle, as it is next in line), written by the worker straight into arena slots
    reserved for it: no block's bytes cross its pipe. The pool holds 11 blocks: a second
    prompt evicts most of the first's, whose repeat then finds every block again (the
    evicted ones loaded from the store). The worker killed: its reserved slots come back
    (its successor holds one share, not two), and its successor's cold pool loads the
    prompt from the store, answering as before."""
    server = store_server(
        folders,
        folders["disk"] / "evict",
        APPLIANCE_MODE="colocated",
        APPLIANCE_CPU_DEVICES="1",
        APPLIANCE_KV__MEMORY_MB="8",
        APPLIANCE_KV_STORE__WRITE_POLICY="evict",
    )
    server.start(timeout=600)
    try:
        first = tokens(5, 8 * BLOCK + 5)
        before = complete(server, first)
        complete(server, tokens(6, 8 * BLOCK + 5))  # needs the room the first's blocks hold
        again = complete(server, first)
        assert again.cached_tokens == 8 * BLOCK
        assert metric(server, "appliance_kv_store_hits_total", '{tier="host"}') >= 1
        assert again.text == before.text
        assert metric(server, "appliance_kv_store_put_piped_bytes_total") == 0
        in_place = metric(server, "appliance_kv_store_put_in_place_bytes_total")
        assert in_place >= 8 * F32_BLOCK_BYTES and in_place % F32_BLOCK_BYTES == 0
        share = metric(server, "appliance_kv_store_reserved_slots")
        assert share >= 1

        worker = snapshot(server).devices[0].worker
        assert worker is not None and worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        wait_for(lambda: successor_ready(server, worker.pid), "the worker came back")
        wait_for(lambda: metric(server, "appliance_kv_store_reserved_slots") == share, "slots")
        third = complete(server, first)
        assert third.cached_tokens == 8 * BLOCK  # a cold pool: every block from the store
        assert third.text == before.text
    finally:
        assert server.stop() == 0


F32_BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 4  # SmolLM2-135M: layers, K and V, heads, dims


def successor_ready(server: ServerProcess, old_pid: int) -> bool:
    worker = snapshot(server).devices[0].worker
    return worker is not None and worker.pid != old_pid and worker.phase == "ready"


def wait_for(check: Callable[[], bool], what: str, bound_s: float = 300.0) -> None:
    deadline = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < deadline, f"not within {bound_s:.0f} s: {what}"
        time.sleep(0.2)


def chat(
    server: ServerProcess, messages: list[dict[str, str]], max_tokens: int = 48, **extra: object
) -> Answer:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=600)
    reply = client.chat.completions.create(
        model=NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra,
    )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    text = reply.choices[0].message.content or ""
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return Answer(text, usage.prompt_tokens, cached, usage.completion_tokens)


def partial_served(server: ServerProcess) -> float:
    """Prompt tokens served from partial blocks, summed over the workers (/metrics)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    name = "appliance_worker_prompt_tokens_cached_partial_total"
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE))


CHAT_LAYOUTS = {
    # One prefill and one decode worker under the default write policy (evict).
    "split": {"APPLIANCE_PREFILL_DEVICES": "0", "APPLIANCE_DECODE_DEVICES": "1"},
    # One worker that prefills and decodes: the answer's blocks stay in its own pool.
    "colocated": {"APPLIANCE_CPU_DEVICES": "1", "APPLIANCE_MODE": "colocated"},
}


@pytest.mark.parametrize("layout", CHAT_LAYOUTS)
def test_a_chats_answer_is_served_to_the_next_turn_with_its_partial_last_block(
    folders: dict[str, Path], layout: str
) -> None:
    """Split: the answer a decode worker made reaches no prefill worker's pool, so the
    decode worker stores its decoded blocks as the request lets go, its last, partial
    block too (the last sampled token is never fed: no worker holds that block whole);
    the next turn, which re-sends that answer, loads them instead of computing them.
    Colocated: the worker kept them in its pool. Either way the next turn reuses every
    token the first turn computed, the partial block's rows included, and answers as
    when everything is computed."""
    env = {
        "APPLIANCE_CPU_DEVICES": "2",
        **CHAT_LAYOUTS[layout],
        "APPLIANCE_KV_STORE__WRITE_POLICY": "evict",
    }
    server = store_server(folders, folders["disk"] / f"chat-{layout}", **env)
    server.start(timeout=600)
    try:
        history = [
            {"role": "system", "content": "You are a helpful assistant who tells stories."},
            {"role": "user", "content": "Tell me a long story about a lighthouse keeper."},
        ]
        first = chat(server, history, max_tokens=40)  # its 33-token prompt: 72 computed
        assert metric(server, "appliance_kv_store_hits_total", '{tier="host"}') == 0
        assert partial_served(server) == 0  # nothing was left before it
        history += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "Give that story a title."},
        ]
        second = chat(server, history)
        computed = first.prompt_tokens + first.completion_tokens - 1  # the last never fed
        assert computed % BLOCK  # the first turn ended mid-block: a partial last block
        assert second.cached_tokens == computed
        # Of those, the partial block's rows, counted by the worker that served them
        # (split: the prefill worker, which loaded the block from the store).
        assert partial_served(server) == computed % BLOCK
        served = metric(server, "appliance_kv_store_hits_total", '{tier="host"}')
        if layout == "split":
            # The first turn's prompt from the prefill worker's pool, then the answer's
            # blocks (two full blocks from the prompt's last, and the partial one) from
            # the store: not computed again.
            assert served >= 3
            # Both workers wrote their blocks in place: none crossed a pipe.
            assert metric(server, "appliance_kv_store_put_in_place_bytes_total") > 0
            assert metric(server, "appliance_kv_store_put_piped_bytes_total") == 0
        else:
            assert served == 0  # its own pool had every block
        whole = chat(server, history, prompt_logprobs=0)  # every position computed
        assert whole.cached_tokens == 0
        assert second.text == whole.text
        assert partial_served(server) == computed % BLOCK  # (nothing cached: not moved)
    finally:
        assert server.stop() == 0


def kv_store_command(*args: str) -> subprocess.CompletedProcess[str]:
    """`appliance kv-store ...` as an operator runs it."""
    command = [sys.executable, "-m", "appliance.cli", "kv-store", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_the_kv_store_command_shows_and_clears_a_running_store(
    folders: dict[str, Path],
) -> None:
    """A small host tier (11 blocks): a 24-block prompt's blocks fill it and the rest go
    to disk. `appliance kv-store show` prints both tiers; `clear` empties both (the disk
    tier's files deleted) through the admin API; the store then serves nothing."""
    disk = folders["disk"] / "clear"
    server = store_server(
        folders,
        disk,
        APPLIANCE_MODE="colocated",
        APPLIANCE_CPU_DEVICES="1",
        APPLIANCE_KV_STORE__HOST_MEMORY_MB="8",
    )
    server.start(timeout=600)
    try:
        complete(server, DOC + QUESTION_1)
        view = snapshot(server).kv_store
        assert view is not None and view.blocks["host"] > 0 and view.blocks["disk"] > 0
        token = str(server.admin_token_file)
        shown = kv_store_command("show", "--url", server.url, "--token-file", token)
        assert shown.returncode == 0, shown.stderr
        rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[2:]}
        assert int(rows["host"][1]) == view.blocks["host"]
        assert int(rows["disk"][1]) == view.blocks["disk"]

        cleared = kv_store_command("clear", "--url", server.url, "--token-file", token)
        assert cleared.returncode == 0, cleared.stderr
        assert f"{view.blocks['host']} host, {view.blocks['disk']} disk" in cleared.stdout
        after = snapshot(server).kv_store
        assert after is not None and after.blocks == {"host": 0, "disk": 0}
        assert list(disk.glob("*/*.kv")) == []

        forged = folders["admin"] / "forged.token"
        forged.write_text("not-the-admin-token")
        wrong = kv_store_command("clear", "--url", server.url, "--token-file", str(forged))
        assert wrong.returncode == 1 and "401" in wrong.stderr
    finally:
        assert server.stop() == 0
