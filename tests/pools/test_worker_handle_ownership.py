"""Who may change a WorkerHandle: its identity and lifecycle only the process manager
(and the handle's own methods), its load only the handle's methods, each named for the
event that changes it (`reported`, `sent_prompt`, `took_handoff`...). Read from the source
of appliance/: every attribute assignment (=, +=, annotated, a for or with target, del)
and every setattr of one of those fields, outside the modules that own it."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests_root import ROOT

PROCESS_MANAGER = "appliance/pools/process_manager.py"
WORKER_HANDLE = "appliance/pools/worker_handle.py"
IDENTITY = frozenset(
    {
        "worker_id",
        "role",
        "devices",
        "device_index",
        "device",
        "cores",
        "box",
        "process",
        "inbox",
        "shares_pool",
        "loaded",
        "ready",
        "alive",
        "draining",
        "stopping",
        "started",
        "restarts",
        "shard_pids",
    }
)
LOAD = frozenset(
    {
        "num_blocks",
        "num_free",
        "taken_blocks",
        "refused",
        "running",
        "queued_tokens",
        "tokens_out",
        "last_report",
        "last_work",
    }
)
OWNERS = {field: {PROCESS_MANAGER, WORKER_HANDLE} for field in IDENTITY} | {
    field: {WORKER_HANDLE} for field in LOAD
}
# Writes of these names on objects that are not WorkerHandles, by (module, the object's
# expression): the AST does not know types, so each is named here with what it is.
NOT_HANDLES = {
    ("appliance/planner/sim_run.py", "worker"): "the simulator's SimWorker",
    ("appliance/server/serve.py", "self.state"): "the server's ServerState",
    ("appliance/kv_store/disk_tier.py", "self.counters"): "the disk tier's DiskCounters",
}


@dataclass(frozen=True)
class Write:
    module: str  # relative to the repository root
    line: int
    target: str  # the object written to, as written: "worker", "self.workers[i]"
    field: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.target}.{self.field}"


class _Writes(ast.NodeVisitor):
    """Every write of a handle field's name in one module. `self.<name>` inside a class
    is that class's own attribute: only WorkerHandle's own `self` is a handle."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.found: list[Write] = []
        self._classes: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._classes.append(node.name)
        self.generic_visit(node)
        self._classes.pop()

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_AsyncFor(self, node: ast.AsyncFor) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_withitem(self, node: ast.withitem) -> None:
        if node.optional_vars is not None:
            self._target(node.optional_vars)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        """setattr(obj, "field", value), and object.__setattr__ likewise."""
        name = ast.unparse(node.func)
        if name in ("setattr", "object.__setattr__") and len(node.args) >= 2:
            field = node.args[1]
            if isinstance(field, ast.Constant) and isinstance(field.value, str):
                self._add(node, ast.unparse(node.args[0]), field.value)
        self.generic_visit(node)

    def _target(self, target: ast.expr) -> None:
        if isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                self._target(element)
        elif isinstance(target, ast.Starred):
            self._target(target.value)
        elif isinstance(target, ast.Attribute):
            self._add(target, ast.unparse(target.value), target.attr)

    def _add(self, node: ast.expr, target: str, field: str) -> None:
        if field not in OWNERS:
            return
        own_attribute = target == "self" and self._classes and self._classes[-1] != "WorkerHandle"
        if not own_attribute:
            self.found.append(Write(self.module, node.lineno, target, field))


def writes(module: str, source: str) -> list[Write]:
    """Every write of a handle field's name in `source`, as module `module`."""
    visitor = _Writes(module)
    visitor.visit(ast.parse(source))
    return visitor.found


def scan(root: Path = ROOT) -> list[Write]:
    found = []
    for path in sorted((root / "appliance").rglob("*.py")):
        module = path.relative_to(root).as_posix()
        found += writes(module, path.read_text())
    return found


def violations(found: list[Write]) -> list[str]:
    """The writes of a handle's fields by a module that does not own them."""
    return [
        f"{write}: only {sorted(OWNERS[write.field])} may write a WorkerHandle's {write.field}"
        for write in found
        if write.module not in OWNERS[write.field]
        and (write.module, write.target) not in NOT_HANDLES
    ]


@pytest.fixture(scope="module")
def scanned() -> list[Write]:
    """The writes in appliance/'s source, read once for the tests of this module."""
    return scan()


def test_only_the_owners_write_a_worker_handles_fields(scanned: list[Write]) -> None:
    assert violations(scanned) == []


def test_a_write_from_elsewhere_is_caught() -> None:
    """The check can fail: each way of writing a field, in a module that does not own it."""
    planted = (
        "def on_ready(self, worker, workers, i):\n"
        "    worker.ready = True\n"
        "    workers[i].num_free -= 1\n"
        "    setattr(worker, 'alive', False)\n"
        "    other.x, worker.refused = 1, True\n"
        "    self.draining: bool = True\n"  # a function's `self` may be anything
        "    del worker.started\n"
        "class Tracker:\n"
        "    def __init__(self):\n"
        "        self.role = 'prefill'\n"  # its own attribute: not a handle's
    )
    found = violations(writes("appliance/pools/supervisor.py", planted))
    fields = [line.split(": ")[1] for line in found]
    assert fields == [
        "worker.ready",
        "workers[i].num_free",
        "worker.alive",
        "worker.refused",
        "self.draining",
        "worker.started",
    ]
    # The process manager owns the lifecycle, not the load.
    in_manager = writes(PROCESS_MANAGER, "worker.ready = True\nworker.running = 0\n")
    assert [str(w).split(": ")[1] for w in in_manager] == ["worker.ready", "worker.running"]
    assert len(violations(in_manager)) == 1 and "worker.running" in violations(in_manager)[0]


def test_each_exemption_still_names_a_write(scanned: list[Write]) -> None:
    """An entry of NOT_HANDLES that matches nothing any more goes (it would hide one)."""
    seen = {(write.module, write.target) for write in scanned}
    assert set(NOT_HANDLES) <= seen
