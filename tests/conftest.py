"""Shared fixtures: the embedded model is loaded once per test session.

The `process` mark: tests that start processes (a server, workers, the command) or run a
whole model: those using a fixture that does (marked here), and those that start their own
(marked in their module). The quick lane, the pure and light in-process tests, is
`pytest -m "not process"`. The `extended` mark: cases `pytest -q` leaves out (below) and
`pytest -m extended` runs; CI runs both."""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# pytest rewrites every test module's asserts at import and keeps the result as bytecode
# in __pycache__, unless writing bytecode is off (PYTHONDONTWRITEBYTECODE, set on some
# machines and images): then all ~400 test modules are parsed and rewritten again at every
# run, about half the collection time. Cached, a run only rewrites the files changed since.
# The same switch has this process write the project's bytecode as collection imports it
# (234 of appliance's 241 modules): the servers, agents and workers the tests start inherit
# PYTHONDONTWRITEBYTECODE and write none, but they read these (uncached, a worker's imports
# took 2.36 s of CPU, not 2.13 s: AMD EPYC, 5 runs each).
sys.dont_write_bytecode = False

# The shared helpers (tests/helpers) assert too: rewritten as test modules are, a failed
# assert there says what it compared. Registered before any of them is imported.
pytest.register_assert_rewrite(
    *sorted(path.stem for path in (Path(__file__).parent / "helpers").glob("*.py"))
)

import torch
from server_process import API_KEY, ServerProcess

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.scheduler import SchedulerLimits
from appliance.kv.cache import KVCache, KVLayout
from appliance.model import cpu_kernels
from appliance.model.model_source import default_model_path
from appliance.settings.config import load_settings

# The ~200k objects the imports above made (torch's and ours) live as long as the run. Frozen
# (after one collection, so no garbage is kept), every full collection skips them: Python's
# own during the run and the five pytest makes at its end, each scanning the whole heap.
gc.collect()
gc.freeze()

# Fixtures that start an `appliance serve` or other boxes, or load the embedded model or
# transformers' reference: a test using one is in the slow lane.
PROCESS_FIXTURES = frozenset(
    {
        "server",
        "colocated_server",
        "layout_server",
        "pool_server",
        "autopilot_server",
        "fault_server",
        "service",
        "cluster",
        "boxes",
    }
    | {"engine", "quant_engine", "make_engine", "hf_reference"}
)


# The shared servers build the n-gram drafter, but only requests that send
# speculative.n_max > 0 speculate (tests/server/test_speculative_serving.py): every other
# test's requests decode as without it.
OPT_IN_SPECULATION = {
    "APPLIANCE_SPECULATIVE__METHOD": "ngram",
    "APPLIANCE_SPECULATIVE__OPT_IN": "true",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)
    _leave_out_the_extended_lane(config, items)


def _leave_out_the_extended_lane(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`pytest -q` is the suite: the `extended` cases (the rest of a matrix whose
    representative rows the suite runs, load tests, benchmarks' dry runs) are left out
    unless the run picks its tests itself: a `-m` expression (`-m extended`: that lane;
    `-m "extended or not extended"`: everything) or a test named by its id. CI runs both lanes."""
    named = any("::" in arg for arg in config.args)
    if config.option.markexpr or named:
        return
    extended = [item for item in items if item.get_closest_marker("extended")]
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if not item.get_closest_marker("extended")]


@pytest.fixture(scope="session")
def engine() -> LLMEngine:
    """The default model (SmolLM2-135M GGUF) dequantized to float32 on the CPU: the
    engine that must match transformers."""
    return LLMEngine.from_settings(load_settings(dtype="float32", device="cpu", weights="dense"))


@pytest.fixture(scope="session")
def quant_engine() -> LLMEngine:
    """The default model with its Q4_1/Q8_0 blocks multiplied in place (the CPU default),
    at the cpu_isa the settings give (APPLIANCE_CPU_ISA runs the suite at a lower level)."""
    return LLMEngine.from_settings(load_settings(device="cpu", weights="quantized"))


@pytest.fixture(scope="session")
def make_engine(engine: LLMEngine) -> Callable[..., LLMEngine]:
    """Engines sharing the loaded model but with their own KV pool and batching limits."""

    def make(
        block_size: int = 16,
        num_blocks: int = 256,
        chunk_size: int = 512,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        prefix_caching: bool = False,
    ) -> LLMEngine:
        cfg = engine.model.config
        layout = KVLayout(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        limits = SchedulerLimits(max_num_seqs, max_num_batched_tokens, chunk_size, 8192)
        kv = KVCache(layout, num_blocks, engine.model.device)
        return LLMEngine(engine.model, engine.tokenizer, kv, limits, prefix_caching)

    return make


@pytest.fixture(scope="session")
def hf_reference() -> torch.nn.Module:
    """transformers' own load of the same GGUF file, float32: the reference outputs."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One `appliance serve` (1 prefill + 1 decode worker, default model and dtype) shared
    by every server test; it needs the API key and admits at most 40 generations."""
    process = ServerProcess(
        {
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_SERVER__MAX_CONCURRENT_REQUESTS": "40",
            "APPLIANCE_KV__MEMORY_MB": "128",
            **OPT_IN_SPECULATION,
        }
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def colocated_server() -> Iterator[ServerProcess]:
    """One `appliance serve` in the colocated layout (each worker prefills and decodes its
    own requests), otherwise as `server`: the other layout of the request-field tests."""
    process = ServerProcess(
        {
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_SERVER__MAX_CONCURRENT_REQUESTS": "40",
            "APPLIANCE_KV__MEMORY_MB": "128",
            "APPLIANCE_MODE": "colocated",
            **OPT_IN_SPECULATION,
        }
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(params=["split", "colocated"])
def layout_server(
    request: pytest.FixtureRequest, server: ServerProcess, colocated_server: ServerProcess
) -> ServerProcess:
    """Each layout's shared server in turn: a test using it runs on both."""
    return server if request.param == "split" else colocated_server


@pytest.fixture(scope="session")
def configured_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`appliance serve` with settings other than the defaults: sampling defaults from a
    generation_config folder (greedy, 5 tokens) with override_generation_config on top
    (top_k 40), and requests' own chat templates trusted."""
    folder = tmp_path_factory.mktemp("generation")
    config = {"temperature": 0.0, "max_new_tokens": 5, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(config))
    process = ServerProcess(
        {
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_KV__MEMORY_MB": "64",
            "APPLIANCE_GENERATION_CONFIG": str(folder),
            "APPLIANCE_OVERRIDE_GENERATION_CONFIG": json.dumps({"top_k": 40}),
            "APPLIANCE_SERVER__TRUST_REQUEST_CHAT_TEMPLATE": "true",
        }
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def pool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`appliance serve` on 3 CPU devices that share the cores, one thread each: device 0
    prefill, devices 1 and 2 decode; its admin token in a temporary file. The admin and
    console tests move its devices between pools (and move them back)."""
    token_file = tmp_path_factory.mktemp("admin") / "admin.token"
    process = ServerProcess(
        {
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_CPU_DEVICES": "3",
            "APPLIANCE_CPU_SHARE_CORES": "true",
            "APPLIANCE_PREFILL_DEVICES": "0",
            "APPLIANCE_DECODE_DEVICES": "1,2",
            "APPLIANCE_KV__MEMORY_MB": "64",
            "APPLIANCE_ADMIN__TOKEN_FILE": str(token_file),
            "APPLIANCE_ADMIN__EVENTS_INTERVAL_S": "0.25",
        }
    )
    process.start()
    process.admin_token_file = token_file
    yield process
    process.stop()
    assert not token_file.exists(), "the server leaves no admin token behind"


@pytest.fixture
def at_level() -> Iterator[Callable[[str], str | None]]:
    """Switch the CPU kernels' level for one test (cpu_kernels.select), then back to the
    session's."""
    before = cpu_kernels.level()
    yield cpu_kernels.select
    cpu_kernels.select(before or "auto")
