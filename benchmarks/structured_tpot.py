"""What constrained decoding costs a decode step: TPOT p50 with a json_schema against
without, at batch 1 and 16, on this CPU, in one engine (the default model and settings,
as a colocated worker runs it).

Both sides decode the same number of tokens: free text with ignore_eos, and a schema
(an array of at least 64 records) that cannot finish within max_tokens. The runs
alternate (free, json, json without the mask thread, ...) so the box's noise falls on
all. Each request's TPOT is (last token time - first token time) / (tokens - 1); the
table gives the p50 over requests and rounds. Alongside: the mask work per step (filling
the bitmasks, on the thread or inline) and the time the sampler waits for it.

    .venv/bin/python benchmarks/structured_tpot.py [--rounds 3] [--max-tokens 96]
    .venv/bin/python benchmarks/structured_tpot.py --llama-bin .bench/llama.cpp/bin

With --llama-bin (a build of benchmarks/build_llama_cpp.sh, about 12 minutes on 2 cores)
llama-server runs the same comparison afterwards: the same GGUF, `-np 16` slots, the
same thread count as ours (-t, as llama_cpp_serving.sh names it), the same prompt tokens,
temperature 1 with its other samplers off (top_k 0, top_p 1, min_p 0: ours samples the
whole vocabulary), free text with ignore_eos against its `json_schema` field (turned into
a GBNF grammar by the server), streamed from /completion. Its TPOT per request is
(last token's chunk - first token's chunk) / (tokens between them), from the chunks'
tokens_predicted; every constrained output must have decoded max_tokens tokens and be the
start of a JSON array whose complete records fit the record schema. Without the flag
the llama-server rows are left out, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams, StructuredOutput
from appliance.engine.structured.masks import GrammarMasks
from appliance.model.model_source import default_model_path
from appliance.settings.config import load_settings

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "tags"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 64}
PROMPT = "List people as JSON records with name, age, email and tags."


@dataclass
class Timed:
    """Mask work seen during a run: seconds per call of each part."""

    compute: list[float] = field(default_factory=list)  # filling the step's bitmasks
    wait: list[float] = field(default_factory=list)  # the sampler's apply, waiting included


def timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    return wrapper


def run(
    engine: LLMEngine, batch: int, params: SamplingParams, prompt: list[int]
) -> tuple[list[float], int]:
    """Per-request TPOT (s) of one batch decoded to max_tokens; and how many were cut by
    length (all of them, or the comparison is off)."""
    ids = [engine.add_request(list(prompt), params) for _ in range(batch)]
    times: dict[int, list[float]] = {i: [] for i in ids}
    reasons: dict[int, str | None] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.seq_id] += [now] * len(out.token_ids)
            if out.finished:
                reasons[out.seq_id] = out.finish_reason
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return tpots, sum(r == "length" for r in reasons.values())


def ours(
    args: argparse.Namespace, batches: list[int]
) -> tuple[dict[tuple[int, str], float], list[int]]:
    """Our engine's table (printed as it goes); the TPOT p50 of each (batch, side), and the
    prompt's tokens for llama-server."""
    engine = LLMEngine.from_settings(load_settings(device="cpu"))
    masks: GrammarMasks = engine.grammar
    timing = Timed()
    masks.banned = timed(masks.banned, timing.compute)  # type: ignore[method-assign]
    masks.apply = timed(masks.apply, timing.wait)  # type: ignore[method-assign]
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, structured=spec)
    sides = {
        "free text": (free, True),
        "json_schema": (constrained, True),
        "json_schema, masks inline": (constrained, False),
    }
    run(engine, 1, constrained, prompt)  # warm: the grammar vocabulary, compiled paths
    threads = os.environ.get("OMP_NUM_THREADS", "torch default")
    print(f"# {args.rounds} rounds, max_tokens {args.max_tokens}, temperature 1, threads {threads}")
    print()
    print("| batch | side | TPOT p50 | vs free | mask fill / step | sampler apply / step | cut |")
    print("|---|---|---|---|---|---|---|")
    medians: dict[tuple[int, str], float] = {}
    for batch in batches:
        tpots: dict[str, list[float]] = {name: [] for name in sides}
        fills: dict[str, list[float]] = {name: [] for name in sides}
        applies: dict[str, list[float]] = {name: [] for name in sides}
        cut: dict[str, int] = dict.fromkeys(sides, 0)
        for _ in range(args.rounds):
            for name, (params, background) in sides.items():
                masks.background = background
                timing.compute.clear()
                timing.wait.clear()
                values, lengths = run(engine, batch, params, prompt)
                tpots[name] += values
                cut[name] += lengths
                fills[name] += timing.compute
                applies[name] += timing.wait
        base = statistics.median(tpots["free text"])
        for name in sides:
            p50 = medians[batch, name] = statistics.median(tpots[name])
            fill = statistics.median(fills[name]) * 1e3 if fills[name] else 0.0
            apply = statistics.median(applies[name]) * 1e3 if applies[name] else 0.0
            print(
                f"| {batch} | {name} | {p50 * 1e3:.1f} ms | {p50 / base - 1:+.1%} "
                f"| {fill:.2f} ms | {apply:.2f} ms | {cut[name]}/{batch * args.rounds} |",
                flush=True,
            )
    masks.close()
    return medians, list(prompt)


@dataclass
class Streamed:
    """One streamed llama-server completion."""

    tpot: float  # seconds a token after the first, from the chunks' arrival
    tokens: int  # tokens_predicted of the final chunk
    stop_type: str  # "limit" when it ended at n_predict
    text: str
    server_tpot: float  # the server's own predicted_per_token_ms, in seconds


def json_prefix_items(text: str) -> list[Any] | None:
    """The complete items of the JSON array that `text` begins, or None when `text` is not
    the start of some JSON array still open (a character no JSON document has there)."""
    stack: list[str] = []  # open containers, "[" or "{"
    # what may come next: value, key, colon, after (a value ended: "," or a close);
    # "value0"/"key0" just after an opening, where the close may come too
    expect = "value"
    i, last_item_end = 0, -1
    text = text.lstrip()
    if not text.startswith("["):
        return None
    while i < len(text):
        c = text[i]
        if c in " \t\n\r":
            i += 1
        elif expect == "colon":
            if c != ":":
                return None
            expect, i = "value", i + 1
        elif c == '"' and expect in ("value", "value0", "key", "key0"):
            end = _string_end(text, i)
            if end is None:
                return _complete(text, last_item_end)
            i, expect = end, "colon" if expect.startswith("key") else "after"
        elif c in "[{" and expect in ("value", "value0"):
            stack.append(c)
            expect, i = ("key0" if c == "{" else "value0"), i + 1
        elif c in "]}" and stack and stack[-1] == "[{"[c == "}"]:
            if expect not in ("after", "key0", "value0"):
                return None
            stack.pop()
            expect, i = "after", i + 1
            if len(stack) == 1:
                last_item_end = i
            if not stack:
                return None  # the whole array closed: 64 records cannot fit
        elif c == "," and expect == "after" and stack:
            expect, i = ("key" if stack[-1] == "{" else "value"), i + 1
        elif expect in ("value", "value0"):
            end = _scalar_end(text, i)
            if end is None:
                return None
            i, expect = end, "after"
        else:
            return None
    return _complete(text, last_item_end)


def _complete(text: str, last_item_end: int) -> list[Any]:
    """The array's items up to the last one closed."""
    items: list[Any] = json.loads(text[:last_item_end] + "]") if last_item_end > 0 else []
    return items


def _string_end(text: str, start: int) -> int | None:
    """Index after the JSON string opening at `start`, None when the text ends inside it."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _scalar_end(text: str, start: int) -> int | None:
    """Index after the number or literal at `start` (the text may end inside it), or None
    when none starts there."""
    i = start
    while i < len(text) and text[i] not in " \t\n\r,]}":
        i += 1
    word = text[start:i]
    if i == len(text):  # cut by max_tokens: a start of a scalar is enough
        ok = any(lit.startswith(word) for lit in ("true", "false", "null"))
        return i if ok or _is_number(word.rstrip("eE+-.")) or word == "-" else None
    if word in ("true", "false", "null") or _is_number(word):
        return i
    return None


def _is_number(word: str) -> bool:
    try:
        json.loads(word)
    except ValueError:
        return False
    return word[:1] in "-0123456789" and bool(word)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def llama_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = (out.stdout + out.stderr).splitlines()
    return "; ".join(line.strip() for line in lines if line.startswith(("version", "built")))


@contextmanager
def llama_server(binary: Path, threads: int, slots: int, flags: list[str]) -> Iterator[str]:
    """llama-server on the default GGUF on a free loopback port; yields its URL. Its log
    goes to /tmp/structured_tpot_llama_<port>.log."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(binary), "-m", str(default_model_path()), "-t", str(threads),
               "-np", str(slots), "-c", str(slots * 512), "--host", "127.0.0.1",
               "--port", str(port), *flags]  # fmt: skip
    with open(f"/tmp/structured_tpot_llama_{port}.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, server, log.name)
            yield url
        finally:
            server.terminate()
            server.wait(timeout=30)


def wait_healthy(url: str, server: subprocess.Popen[bytes], log: str) -> None:
    """Until /health answers 200 (the model loaded), at most 120 s."""
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"llama-server did not come up; see {log}")
        time.sleep(0.5)


def stream_one(url: str, body: dict[str, Any]) -> Streamed:
    """One /completion, streamed; times each chunk as it arrives."""
    seen: list[tuple[float, int]] = []  # (arrival, tokens_predicted) of each token chunk
    final: dict[str, Any] = {}
    text = ""
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: ") :])
            now = time.perf_counter()
            if chunk.get("stop"):
                final = chunk
            else:
                seen.append((now, int(chunk["tokens_predicted"])))
                text += chunk.get("content", "")
    (t0, n0), (t1, n1) = seen[0], seen[-1]
    return Streamed(
        tpot=(t1 - t0) / (n1 - n0) if n1 > n0 else float("nan"),
        tokens=int(final["tokens_predicted"]),
        stop_type=str(final["stop_type"]),
        text=text,
        server_tpot=float(final["timings"]["predicted_per_token_ms"]) / 1e3,
    )


def stream_batch(url: str, batch: int, body: dict[str, Any]) -> list[Streamed]:
    """`batch` requests at once (the server's slots decode them together)."""
    with ThreadPoolExecutor(batch) as pool:
        return list(pool.map(lambda _: stream_one(url, body), range(batch)))


def check_constrained(outputs: list[Streamed], max_tokens: int) -> tuple[int, int]:
    """Raises when a constrained output is not max_tokens long or not the start of a JSON
    array; returns (complete records, those valid against the record schema)."""
    records = valid = 0
    for out in outputs:
        if out.tokens != max_tokens or out.stop_type != "limit":
            raise RuntimeError(f"llama-server json_schema: {out.tokens} tokens ({out.stop_type})")
        items = json_prefix_items(out.text)
        if items is None:
            raise RuntimeError(f"llama-server json_schema output is not JSON: {out.text!r}")
        records += len(items)
        valid += sum(jsonschema.Draft202012Validator(RECORD).is_valid(item) for item in items)
    return records, valid


def llama(
    args: argparse.Namespace, batches: list[int], prompt: list[int]
) -> dict[tuple[int, str], float]:
    """llama-server's table (printed as it goes); the TPOT p50 of each (batch, side)."""
    binary = args.llama_bin / "llama-server"
    common = {"prompt": prompt, "n_predict": args.max_tokens, "temperature": 1.0, "top_k": 0,
              "top_p": 1.0, "min_p": 0.0, "stream": True}  # fmt: skip
    sides = {
        "free text": {**common, "ignore_eos": True},
        "json_schema": {**common, "json_schema": SCHEMA},
    }
    flags = args.llama_flags.split()
    print(
        f"\n# llama-server: {llama_version(binary)}; -t {args.threads} -np {max(batches)} "
        f"{' '.join(flags)}\n"
    )
    print("| batch | side | TPOT p50 | vs free | server's own ms/token p50 | cut | JSON records |")
    print("|---|---|---|---|---|---|---|")
    medians: dict[tuple[int, str], float] = {}
    samples: dict[int, str] = {}  # a constrained output of each batch, to read
    with llama_server(binary, args.threads, max(batches), flags) as url:
        stream_batch(url, 1, sides["json_schema"])  # warm
        for batch in batches:
            outs: dict[str, list[Streamed]] = {name: [] for name in sides}
            for _ in range(args.rounds):
                for name, body in sides.items():
                    outs[name] += stream_batch(url, batch, body)
            records, valid = check_constrained(outs["json_schema"], args.max_tokens)
            base = statistics.median(o.tpot for o in outs["free text"])
            for name, done in outs.items():
                p50 = medians[batch, name] = statistics.median(o.tpot for o in done)
                own = statistics.median(o.server_tpot for o in done) * 1e3
                cut = sum(o.tokens == args.max_tokens and o.stop_type == "limit" for o in done)
                json_ok = f"{valid}/{records} valid" if name == "json_schema" else "-"
                print(
                    f"| {batch} | {name} | {p50 * 1e3:.1f} ms | {p50 / base - 1:+.1%} "
                    f"| {own:.1f} ms | {cut}/{len(done)} | {json_ok} |",
                    flush=True,
                )
            samples[batch] = outs["json_schema"][0].text
    for batch, text in samples.items():
        print(f"\nbatch {batch}, a json_schema output: {text!r}")
    return medians


def side_by_side(
    batches: list[int],
    mine: dict[tuple[int, str], float],
    theirs: dict[tuple[int, str], float] | None,
) -> None:
    """One table: constrained against free TPOT p50, ours and llama-server's."""
    print("\n| batch | engine | free text | json_schema | json_schema / free |")
    print("|---|---|---|---|---|")
    for batch in batches:
        rows = [("ours, mask thread", mine, "json_schema"),
                ("ours, masks inline", mine, "json_schema, masks inline")]  # fmt: skip
        if theirs is not None:
            rows.append(("llama-server (GBNF)", theirs, "json_schema"))
        for label, table, side in rows:
            free, constrained = table[batch, "free text"], table[batch, side]
            print(
                f"| {batch} | {label} | {free * 1e3:.1f} ms | {constrained * 1e3:.1f} ms "
                f"| {constrained / free:.3f} |"
            )
    if theirs is None:
        print("\nllama-server rows left out: no --llama-bin given")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--llama-bin", type=Path, default=None, help="llama.cpp's bin folder")
    # llama-server -t: the cores this process may use, as nproc gives llama_cpp_serving.sh
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    # GGML_NATIVE on a CPU with AMX builds llama.cpp's AMX kernels, which die of SIGILL at
    # their first tile instruction on this VM (it lists amx_tile but grants no tile
    # state); --no-repack leaves out the extra buffer types, AMX's among them, so its
    # AVX-512 kernels run. "" where AMX works.
    parser.add_argument("--llama-flags", default="--no-repack", help="more llama-server flags")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    mine, prompt = ours(args, batches)
    theirs = llama(args, batches, prompt) if args.llama_bin is not None else None
    side_by_side(batches, mine, theirs)


if __name__ == "__main__":
    main()
