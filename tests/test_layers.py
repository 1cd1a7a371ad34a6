"""Which part of the product may import which: the folders are layers, and imports point
down. Pure decisions (core/), the simulator and the serve process load no torch.

The graph is read from the source by benchmarks/import_structure.py (every import, those
inside functions and under TYPE_CHECKING too: a lazy import is still a dependency)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A part may import its own modules and those of the layers below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("appliance/model", "appliance/topology"),  # model files, kernels, forward; devices
    ("appliance/settings",),  # the one settings model (reads a model's name through model/)
    ("appliance/tracing",),  # OpenTelemetry spans, imported only where tracing is on
    ("appliance/kv",),  # block accounting, the KV tensor, handoff copies
    ("appliance/kv_store",),  # the box-wide KV store below the workers' pools
    ("appliance/engine",),  # scheduler, model runner, sampler of one worker
    ("appliance/core",),  # pure decisions: request table, router, recovery, tuning, roles
    ("appliance/chat",),  # chat turns: tools in the prompt, output read as calls/reasoning
    ("appliance/workers",),  # worker processes and their messages
    ("appliance/admin", "appliance/bench"),  # the admin wire schema; load and its report
    ("appliance/planner",),  # profile, simulate, plan, rebalance
    ("appliance/cluster",),  # other boxes: head, agent, their link
    ("appliance/pools",),  # the supervisor and its asyncio parts
    ("appliance/ops",),  # operator actions: moves, autopilot
    ("appliance/api.py",),  # the in-process facade
    ("appliance/server", "tui"),  # HTTP: OpenAI routes, admin, metrics; the console
    ("appliance/cli.py",),  # the command
)
# Narrower rules inside a layer's reach.
ONLY = {
    # The server reads the pools through the facade and the read-only pool state.
    "appliance/server": {"appliance.pools": {"appliance.pools.pool_state"}},
}
TUI_READS = {"appliance/admin"}  # the console knows the admin API's schema only
TORCH_FREE = (
    "appliance.core.request_table",
    "appliance.core.router",
    "appliance.core.prefill_cost",
    "appliance.core.recovery",
    "appliance.core.restart_policy",
    "appliance.core.tuning",
    "appliance.core.events",
    "appliance.core.goodput",
    "appliance.core.roles",
    "appliance.core.admission",
    "appliance.core.admission_queue",
    "appliance.planner.simulator",
    "appliance.planner.rebalance",
    "appliance.planner.online_profile",
    "appliance.planner.decode_fit",
    "appliance.planner.measured_acceptance",
    "appliance.planner.prefix_hits",
    "appliance.admin.schema",
    "appliance.chat.chat_output",
    "appliance.chat.tool_calls",
    "appliance.kv_store.tier_index",
    # speculative decoding's decisions, asked by the scheduler at every step
    "appliance.engine.speculative.adaptive",
    "appliance.engine.speculative.eligibility",
    "appliance.engine.speculative.proposer",
    # DRY's penalties: a pass over the context's token ids, run for every DRY row
    "appliance.engine.sampling.dry",
    # the serve process (HTTP, supervisor, planner) and the agent run no model: the workers
    # they spawn import torch, they do not (tests/server/test_server_startup.py: at run time)
    "appliance.cli",
    "appliance.server.serve",
    "appliance.cluster.agent",
    "appliance.model.model_source",
    "appliance.model.sampling_defaults",
    "appliance.kv.remote_pool",
)


def structure() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "import_structure", ROOT / "benchmarks" / "import_structure.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def modules() -> dict[str, set[str]]:
    return structure().graph()


def layer_of(folder: str) -> int:
    for index, layer in enumerate(LAYERS):
        if folder in layer:
            return index
    raise AssertionError(f"{folder} is in no layer of tests/test_layers.py: give it one")


def violations(modules: dict[str, set[str]]) -> list[str]:
    """Every import that points up, sideways within a layer, or past a narrower rule."""
    folder_of = structure().folder_of
    found = []
    for name, targets in sorted(modules.items()):
        source = folder_of(name)
        for target in sorted(targets):
            into = folder_of(target)
            if into == source:
                continue
            if source == "tui" and into not in TUI_READS:
                found.append(f"{name} -> {target}: the console reads the admin schema only")
            elif layer_of(into) >= layer_of(source):
                found.append(f"{name} -> {target}: {source} may not import {into}")
            for package, allowed in ONLY.get(source, {}).items():
                if target.startswith(package + ".") and target not in allowed:
                    found.append(f"{name} -> {target}: {source} reads {package} via {allowed}")
    return found


def test_every_part_has_a_layer(modules: dict[str, set[str]]) -> None:
    folder_of = structure().folder_of
    parts = {folder_of(name) for name in modules}
    assert len(parts) > 10
    for part in parts:
        layer_of(part)


def test_imports_point_down(modules: dict[str, set[str]]) -> None:
    assert violations(modules) == []


def test_an_upward_import_is_caught(modules: dict[str, set[str]]) -> None:
    """The check can fail: core importing the supervisor, the server a worker handle."""
    planted = {name: set(targets) for name, targets in modules.items()}
    planted["appliance.core.router"].add("appliance.pools.supervisor")
    planted["appliance.server.routes"].add("appliance.pools.worker_handle")
    planted["tui.app"].add("appliance.api")
    found = violations(planted)
    assert any("core.router -> appliance.pools.supervisor" in v for v in found)
    assert any("server.routes -> appliance.pools.worker_handle" in v for v in found)
    assert any("tui.app -> appliance.api" in v for v in found)
    assert len(found) == 3


def test_no_folder_imports_another_that_imports_it_back(modules: dict[str, set[str]]) -> None:
    module = structure()
    assert module.cycles(module.folder_graph(modules)) == []


def test_no_module_is_named_like_its_package() -> None:
    named_alike = [
        str(path.relative_to(ROOT))
        for top in ("appliance", "tui")
        for path in (ROOT / top).rglob("*.py")
        if path.stem == path.parent.name
    ]
    assert named_alike == []


@pytest.mark.process
@pytest.mark.parametrize("name", TORCH_FREE)
def test_pure_parts_load_without_torch(name: str) -> None:
    loaded = "sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3]"
    probe = f"import sys, {name}\nprint({loaded})"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{name} loads torch: {done.stdout.strip()}"


def test_the_settings_name_the_same_roles_as_the_core() -> None:
    """settings/ sits below core/, so its pool setting spells the roles itself."""
    from typing import get_args

    from appliance.core.roles import ROLES
    from appliance.settings.cluster import ClusterSettings

    annotation = ClusterSettings.model_fields["pool"].annotation
    assert get_args(annotation) == ROLES
