"""KV transfer between boxes: a request's KV blocks read through NIXL (kv/remote.py) against
a plain TCP socket moving the same bytes over the same link, and what the read costs of a
prefill's time to first token.

Run from the repository root:

    .venv/bin/python benchmarks/kv_transfer_bench.py [--tokens 1024 8192] [--repeat 5]
        [--timeout 120] [--out PATH]

1. transfer: two processes ("boxes") each hold a KV pool of the default model's shape
   (SmolLM2-135M: 30 layers, 3 KV heads of 64, float32, 16-token blocks; the shape is
   read from the GGUF's metadata, no weights are loaded). The owner fills its pool with a
   known pattern (element i of the pool holds the int32 i) and registers it; the reader
   registers its own and reads a prompt's blocks (tokens / 16) into it:
   - scattered: source blocks 0, 2, 4, ... into destination blocks 1, 3, 5, ... (no two
     ids neighbours on either side, so no byte range merges: the worst case an allocator
     after churn approaches), and consecutive: blocks 0..n-1 into 0..n-1;
   - NIXL: `start_read(...).wait()`, the read list (copy_ranges) included, with UCX held
     to TCP on the loopback interface (ClusterSettings(transports="tcp", interface="lo"));
   - socket: the reader computes the same read list, sends a 1-byte request over a TCP
     connection on 127.0.0.1, and recv_into's every range into its pool; the owner
     sendall's each range of its pool's bytes. Timed from request to last byte.
   Each is one warm-up, then best and median of --repeat; the destination blocks are
   zeroed before and compared with the pattern after every read.
2. share of TTFT: the real engine (float32, dense weights, prefix caching off, default
   batching: 512-token chunks) prefills one prompt of each length in this process, timed
   from add_request(prefill_only=True) to the output carrying its handoff blocks, after one
   warm-up prefill. Share = read time / (prefill time + read time), with the scattered
   read's median. The prompt and its first token must stay under the model's context
   (8192), or the request finishes at its length limit instead of handing off: a longer
   prompt is cut to context - 2 tokens (8192 -> 8190, the same 512 blocks; table says so).

A box that does not answer within --timeout seconds is killed and the script exits 1.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from appliance.engine.llm_engine import LLMEngine, RequestOutput
from appliance.engine.sequence import SamplingParams
from appliance.kv.byte_ranges import ByteRange, PoolShape, copy_ranges
from appliance.kv.handoff import KVShard
from appliance.kv.remote import KVTransfer, pool_shape
from appliance.kv.remote_pool import RemotePool, nixl_available
from appliance.model.model_source import model_name, prepare_model
from appliance.settings.cluster import ClusterSettings
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name

BLOCK_SIZE = 16
LOOPBACK = ClusterSettings(transports="tcp", interface="lo")
REQUEST = b"r"  # the socket reader's "send me the blocks"
TEXT = (
    "A lighthouse keeper kept a log of every ship that passed, the weather, the tides "
    "and the birds, and after forty years the log filled a whole shelf of the tower. "
)


@dataclass(frozen=True)
class PoolSpec:
    """A KV pool's shape, sent to the boxes (each makes its own pool from it)."""

    layers: int
    blocks: int
    heads: int
    head_dim: int

    def zeros(self) -> torch.Tensor:
        size = (self.layers, 2, self.blocks, BLOCK_SIZE, self.heads, self.head_dim)
        return torch.zeros(size, dtype=torch.float32)


@dataclass(frozen=True)
class Case:
    """One read: a prompt's blocks, from src_ids of the owner's pool to dst_ids of ours."""

    tokens: int
    layout: str  # "scattered" or "consecutive"
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]


@dataclass(frozen=True)
class Measured:
    case: Case
    nbytes: int
    ranges: int
    nixl_s: list[float]
    socket_s: list[float]


# ---- the boxes (child processes) ------------------------------------------------------


def owner_box(conn: Connection, spec: PoolSpec, timeout_s: float) -> None:
    """The pool others read. Sends ('ready', (RemotePool, port)); then per ('serve', case,
    reads) answers `reads` socket requests of one connection and replies; ('stop',)."""
    try:
        run_owner(conn, spec, timeout_s)
    except Exception:  # the parent reports it: a child's traceback is lost otherwise
        conn.send(("error", traceback.format_exc()))


def run_owner(conn: Connection, spec: PoolSpec, timeout_s: float) -> None:
    pool = spec.zeros()
    fill_pattern(pool)
    transfer = KVTransfer("kv-bench-owner", LOOPBACK)
    remote = transfer.register(pool)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(timeout_s)  # a reader that never connects must not hang us
        conn.send(("ready", (remote, listener.getsockname()[1])))
        while True:
            command, *args = conn.recv()
            if command == "stop":
                break
            conn.send(("ok", serve_socket(listener, pool, *args)))
    transfer.close()


def serve_socket(listener: socket.socket, pool: torch.Tensor, case: Case, reads: int) -> int:
    """Accept one reader and send it the case's ranges `reads` times, one per request."""
    shape = pool_shape(pool)
    ranges = copy_ranges(shape, case.src_ids, shape, case.dst_ids)
    source = pool_bytes(pool)
    peer, _ = listener.accept()
    with peer:
        peer.settimeout(listener.gettimeout())
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(reads):
            if peer.recv(1) != REQUEST:
                raise ConnectionError("the socket reader hung up mid-benchmark")
            for r in ranges:
                peer.sendall(source[r.src : r.src + r.length])
    return reads


def reader_box(conn: Connection, spec: PoolSpec, timeout_s: float) -> None:
    """The pool blocks land in. Sends ('ready', None); ('nixl', RemotePool, case, repeat)
    -> (seconds per read, bytes, ranges); ('socket', port, source shape, case, repeat) ->
    seconds per read; ('stop',)."""
    try:
        run_reader(conn, spec, timeout_s)
    except Exception:
        conn.send(("error", traceback.format_exc()))


def run_reader(conn: Connection, spec: PoolSpec, timeout_s: float) -> None:
    pool = spec.zeros()
    transfer = KVTransfer("kv-bench-reader", LOOPBACK)
    transfer.register(pool)  # a read's destination must be registered memory
    conn.send(("ready", None))
    while True:
        command, *args = conn.recv()
        if command == "nixl":
            conn.send(("ok", nixl_reads(transfer, pool, *args)))
        elif command == "socket":
            conn.send(("ok", socket_reads(pool, *args, timeout_s=timeout_s)))
        else:
            break
    transfer.close()


def nixl_reads(
    transfer: KVTransfer, pool: torch.Tensor, remote: RemotePool, case: Case, repeat: int
) -> tuple[list[float], int, int]:
    """Read the case's blocks through NIXL 1 + repeat times; the warm-up's time dropped."""
    shard = KVShard(0, pool)
    src, dst = list(case.src_ids), list(case.dst_ids)
    times, nbytes = [], 0
    for _ in range(repeat + 1):
        clear_blocks(pool, case.dst_ids)
        start = time.perf_counter()
        copy = transfer.start_read(remote, src, shard, dst)
        copy.wait()
        times.append(time.perf_counter() - start)
        check_landed(pool, case, remote.shape)
        nbytes = copy.nbytes
    ranges = len(copy_ranges(remote.shape, src, pool_shape(pool), dst))
    return times[1:], nbytes, ranges


def socket_reads(
    pool: torch.Tensor, port: int, source: PoolShape, case: Case, repeat: int, timeout_s: float
) -> list[float]:
    """Read the case's ranges over one TCP connection 1 + repeat times; warm-up dropped."""
    landing = pool_bytes(pool)
    times = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the 1-byte request
        for _ in range(repeat + 1):
            clear_blocks(pool, case.dst_ids)
            start = time.perf_counter()
            # The read list counts here as it does inside NIXL's start_read.
            ranges = copy_ranges(source, case.src_ids, pool_shape(pool), case.dst_ids)
            sock.sendall(REQUEST)
            for r in ranges:
                receive_range(sock, landing, r)
            times.append(time.perf_counter() - start)
            check_landed(pool, case, source)
    return times[1:]


def receive_range(sock: socket.socket, landing: memoryview, r: ByteRange) -> None:
    view = landing[r.dst : r.dst + r.length]
    got = 0
    while got < r.length:
        n = sock.recv_into(view[got:], r.length - got)
        if n == 0:
            raise ConnectionError("the socket owner hung up mid-range")
        got += n


# ---- pools: pattern, views, checks ------------------------------------------------------


def fill_pattern(pool: torch.Tensor) -> None:
    """Element i holds the int32 i: every block of every layer is unlike every other, and
    the reader can compute what any block should hold without a copy of the source."""
    flat = pool.view(-1).view(torch.int32)
    torch.arange(flat.numel(), dtype=torch.int32, out=flat)


def pool_bytes(pool: torch.Tensor) -> memoryview:
    """The pool's bytes, writable, without a copy (what a socket sends from / lands in)."""
    return memoryview(pool.view(-1).view(torch.uint8).numpy())


def clear_blocks(pool: torch.Tensor, ids: tuple[int, ...]) -> None:
    pool.index_fill_(2, torch.tensor(ids), 0.0)


def check_landed(pool: torch.Tensor, case: Case, source: PoolShape) -> None:
    """The destination blocks hold the source blocks' pattern, layer by layer, K and V."""
    got = pool.view(torch.int32)
    per_block = source.block_bytes // source.elem_size
    src = torch.tensor(case.src_ids, dtype=torch.int64)
    dst = torch.tensor(case.dst_ids, dtype=torch.int64)
    within = torch.arange(per_block, dtype=torch.int64)
    for layer in range(source.layers):
        for kv in (0, 1):
            first = ((layer * 2 + kv) * source.blocks + src) * per_block
            expected = (first[:, None] + within).to(torch.int32)
            landed = got[layer, kv].index_select(0, dst).reshape(len(dst), per_block)
            if not torch.equal(landed, expected):
                raise AssertionError(
                    f"{case.tokens} tokens {case.layout}: layer {layer} {'KV'[kv]} landed wrong"
                )


# ---- the parent: boxes under timeouts ---------------------------------------------------


class BoxError(RuntimeError):
    """A box timed out, died or failed: the benchmark cannot go on."""


class Box:
    """A box process and the parent's end of its pipe; every answer under a timeout."""

    def __init__(self, name: str, target: Any, spec: PoolSpec, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")  # a fresh process: UCX reads its settings at start
        self.name, self.timeout_s = name, timeout_s
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(theirs, spec, timeout_s), daemon=True)
        self.process.start()
        theirs.close()  # so a dead child reads as EOF here, not as silence

    def send(self, message: tuple) -> None:
        self.conn.send(message)

    def answer(self, what: str) -> Any:
        """The box's reply to `what`; BoxError (the box killed) if none in time."""
        if not self.conn.poll(self.timeout_s):
            self.kill()
            raise BoxError(
                f"the {self.name} box did not answer {what} within {self.timeout_s:.0f} s; "
                "killed it"
            )
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise BoxError(
                f"the {self.name} box died during {what} (exit code {self.process.exitcode})"
            ) from None
        if status == "error":
            raise BoxError(f"the {self.name} box failed during {what}:\n{value}")
        return value

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        """Ask the box to close its agent and leave; kill it if it does not."""
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:  # its end is gone already
                pass
            self.process.join(10)
        self.kill()


def make_cases(tokens: list[int]) -> list[Case]:
    cases = []
    for count in tokens:
        n = -(-count // BLOCK_SIZE)
        scattered = (tuple(range(0, 2 * n, 2)), tuple(range(1, 2 * n, 2)))
        cases.append(Case(count, "scattered", *scattered))
        cases.append(Case(count, "consecutive", tuple(range(n)), tuple(range(n))))
    return cases


def default_pool_spec(blocks: int) -> PoolSpec:
    """The default model's KV shape from its GGUF metadata (no weights read)."""
    settings = load_settings()
    config, _ = prepare_model(settings.model, settings.cache_dir)
    return PoolSpec(config.num_layers, blocks, config.num_kv_heads, config.head_dim)


def measure_transfers(
    cases: list[Case], spec: PoolSpec, repeat: int, timeout_s: float
) -> list[Measured]:
    """Start both boxes, run every case through NIXL and the socket; always stop them."""
    boxes: list[Box] = []
    try:
        owner = Box("owner", owner_box, spec, timeout_s)
        boxes.append(owner)
        reader = Box("reader", reader_box, spec, timeout_s)
        boxes.append(reader)
        remote, port = owner.answer("start-up")
        reader.answer("start-up")
        return [measure_case(owner, reader, remote, port, case, repeat) for case in cases]
    finally:
        for box in boxes:
            box.stop()


def measure_case(
    owner: Box, reader: Box, remote: RemotePool, port: int, case: Case, repeat: int
) -> Measured:
    label = f"{case.tokens} tokens {case.layout}"
    reader.send(("nixl", remote, case, repeat))
    nixl_s, nbytes, ranges = reader.answer(f"the NIXL reads of {label}")
    owner.send(("serve", case, repeat + 1))  # it accepts once the reader connects
    reader.send(("socket", port, remote.shape, case, repeat))
    socket_s = reader.answer(f"the socket reads of {label}")
    owner.answer(f"the socket serving of {label}")
    return Measured(case, nbytes, ranges, nixl_s, socket_s)


# ---- the parent: prefill --------------------------------------------------------------


def prefill_seconds(tokens: list[int]) -> dict[int, tuple[int, float]]:
    """tokens -> (prompt tokens prefilled, seconds) with the real engine, one warm-up."""
    blocks = max(600, -(-max(tokens) // BLOCK_SIZE) + BLOCK_SIZE)
    settings = load_settings(
        device="cpu",
        dtype="float32",
        weights="dense",
        kv={"num_blocks": blocks, "prefix_caching": False},  # each run prefills it all
    )
    engine = LLMEngine.from_settings(settings)
    # Prompt + first token must stay under the context: at it the request finishes
    # ('length') instead of parking its blocks for a decode box.
    longest = engine.scheduler.max_model_len - 2
    ids = prompt_ids(engine, min(max(tokens), longest))
    prefill(engine, ids[: min(min(tokens), longest)])  # warm-up: first-call allocations
    out = {}
    for count in tokens:
        n = min(count, longest)
        out[count] = (n, prefill(engine, ids[:n]))
    return out


def prompt_ids(engine: LLMEngine, count: int) -> list[int]:
    repeats = 1
    while len(ids := engine.tokenizer.encode(TEXT * repeats)) < count:
        repeats *= 2
    return ids[:count]


def prefill(engine: LLMEngine, ids: list[int]) -> float:
    """Seconds from add_request to the output that hands the prompt's blocks off."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    start = time.perf_counter()
    seq_id = engine.add_request(ids, params, prefill_only=True)
    while not handed_off(engine.step(), seq_id):
        pass
    elapsed = time.perf_counter() - start
    engine.release(seq_id)
    return elapsed


def handed_off(outputs: list[RequestOutput], seq_id: int) -> bool:
    """Whether the request parked its blocks this step; an error if it ended instead (the
    engine would then step on with nothing to do, and the loop never end)."""
    for out in outputs:
        if out.seq_id == seq_id and out.handoff_blocks:
            return True
        if out.seq_id == seq_id and out.finished:
            raise RuntimeError(f"the prefill ended ({out.finish_reason}) without a handoff")
    return False


# ---- report ---------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def transfer_table(results: list[Measured]) -> list[str]:
    rows = [
        "| tokens | block ids | bytes | ranges | NIXL ms (best / median) | NIXL GB/s | "
        "socket ms (best / median) | socket GB/s | NIXL / socket speed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        nixl, sock = min(m.nixl_s), min(m.socket_s)
        rows.append(
            f"| {m.case.tokens} | {m.case.layout} | {m.nbytes} | {m.ranges} | "
            f"{ms(nixl)} / {ms(statistics.median(m.nixl_s))} | {m.nbytes / nixl / 1e9:.2f} | "
            f"{ms(sock)} / {ms(statistics.median(m.socket_s))} | "
            f"{m.nbytes / sock / 1e9:.2f} | {sock / nixl:.2f}x |"
        )
    return rows


def ttft_table(results: list[Measured], prefills: dict[int, tuple[int, float]]) -> list[str]:
    rows = [
        "| tokens | prefill ms | NIXL handoff ms | share of TTFT | socket handoff ms | share |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        if m.case.layout != "scattered":
            continue
        prefilled, seconds = prefills[m.case.tokens]
        nixl, sock = statistics.median(m.nixl_s), statistics.median(m.socket_s)
        label = f"{m.case.tokens}" + (
            f" ({prefilled} prefilled)" if prefilled != m.case.tokens else ""
        )
        rows.append(
            f"| {label} | {ms(seconds)} | {ms(nixl)} | {nixl / (seconds + nixl):.2%} | "
            f"{ms(sock)} | {sock / (seconds + sock):.2%} |"
        )
    return rows


def report(
    spec: PoolSpec, results: list[Measured], prefills: dict[int, tuple[int, float]], repeat: int
) -> str:
    block_bytes = 2 * spec.layers * BLOCK_SIZE * spec.heads * spec.head_dim * 4
    model = model_name(load_settings().model)
    lines = [
        f"# KV transfer between boxes: NIXL vs a plain socket ({model}, float32)",
        "",
        f"CPU: {cpu_model_name()}; loopback TCP, 2 processes on one machine "
        f"(UCX_TLS=tcp, UCX_NET_DEVICES=lo); torch threads {torch.get_num_threads()}.",
        f"Pools of {spec.blocks} blocks [{spec.layers} layers, K/V, {BLOCK_SIZE} tokens, "
        f"{spec.heads} heads, {spec.head_dim}]: {block_bytes} bytes a block over all layers. "
        "scattered: source blocks 0, 2, 4, ... into destination blocks 1, 3, 5, ...; "
        "consecutive: 0..n-1 into 0..n-1.",
        f"One warm-up, then best / median of {repeat}; GB/s from the best. Every read's "
        "blocks compared with the source's after it landed.",
        "",
        *transfer_table(results),
        "",
        "Share of TTFT: prefill in one process (default batching, 512-token chunks), "
        "handoff = the scattered read's median; share = handoff / (prefill + handoff).",
        "",
        *ttft_table(results, prefills),
    ]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[1024, 8192], help="prompt lengths"
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed reads after one warm-up")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds a box may take to answer"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = parser.parse_args()
    if min(args.tokens) < 1 or args.repeat < 1 or args.timeout <= 0:
        parser.error("--tokens, --repeat and --timeout must be positive")
    return args


def main() -> None:
    args = parse_args()
    if not nixl_available():
        sys.exit("error: NIXL is not installed (./install.sh --dev installs it)")
    tokens = sorted(set(args.tokens))
    cases = make_cases(tokens)
    spec = default_pool_spec(max(max(c.dst_ids) for c in cases) + 1)
    try:
        results = measure_transfers(cases, spec, args.repeat, args.timeout)
    except BoxError as error:
        sys.exit(f"error: {error}")
    text = report(spec, results, prefill_seconds(tokens), args.repeat)
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
