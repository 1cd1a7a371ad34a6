"""Stage stamps on a store hit's request path, for benchmarks/kv_store_breakdown.py.

Not part of the appliance: the breakdown puts this folder on the server's PYTHONPATH, so
Python imports this file at the start of every process (the supervisor and each spawned
worker), and names a folder in KV_PROBE_DIR. Where that is set, the functions below are
wrapped as their modules are imported; each call appends one line to its process's file:
`pid name start end cpu=<thread CPU ms> <details>`, start and end from time.monotonic
(CLOCK_MONOTONIC: one clock for every process on the box). Nothing else changes.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

Details = Callable[[tuple, Any], str]  # (call's arguments, its result) -> details


class Stamps:
    """One process's file of stamps."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.lock = threading.Lock()
        self.file: Any = None

    def write(self, name: str, start: float, end: float, details: str) -> None:
        with self.lock:
            if self.file is None:
                path = os.path.join(self.folder, f"p{os.getpid()}.txt")
                self.file = open(path, "a", buffering=1)
            self.file.write(f"{os.getpid()} {name} {start:.6f} {end:.6f} {details}\n")

    def wrap(self, owner: Any, attr: str, name: str, details: Details | None = None) -> None:
        """Replace owner.attr by a stamped call of it."""
        inner = getattr(owner, attr)

        @functools.wraps(inner)
        def stamped(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.monotonic(), time.thread_time()
            result = inner(*args, **kwargs)
            end, used = time.monotonic(), time.thread_time() - cpu
            said = details(args, result) if details is not None else ""
            self.write(name, start, end, f"cpu={1000 * used:.2f} {said}")
            return result

        setattr(owner, attr, stamped)


def _message(args: tuple, _result: Any) -> str:
    message = args[1]
    return f"type={type(message).__name__} rid={getattr(message, 'request_id', '')}"


def _step(_args: tuple, result: Any) -> str:
    return "outs=" + ",".join(f"{o.seq_id}:{len(o.token_ids)}:{o.cached_tokens}" for o in result)


def patches(stamps: Stamps) -> dict[str, Callable[[ModuleType], None]]:
    """The module -> what is wrapped in it."""

    def worker(module: ModuleType) -> None:
        stamps.wrap(module, "handle", "w.handle", _message)
        stamps.wrap(module, "report", "w.report")

    def store_client(module: ModuleType) -> None:
        client = module.StoreClient
        stamps.wrap(client, "load", "w.store.load", lambda a, r: f"rid={a[1]} loaded={r}")
        stamps.wrap(client, "clean_ahead", "w.store.clean_ahead", lambda a, r: f"written={r}")
        stamps.wrap(client, "_copy_out", "w.store.copy_out")

    def engine(module: ModuleType) -> None:
        stamps.wrap(module.LLMEngine, "step", "w.engine.step", _step)

    def request_flow(module: ModuleType) -> None:
        flow = module.RequestFlow
        submitted: Details = lambda a, r: f"rid={a[1].request_id} wire={a[1].wire_id}"  # noqa: E731
        stamps.wrap(flow, "submit", "s.submit", submitted)
        stamps.wrap(flow, "put", "s.put", lambda a, r: f"rid={a[1].request_id}")

    def owner(module: ModuleType) -> None:
        stamps.wrap(module.StoreOwner, "hits_for", "s.store.hits_for")
        stamps.wrap(module.StoreOwner, "stored_keys", "s.store.stored_keys")

    def outboxes(module: ModuleType) -> None:
        reader = module.OutboxReader
        init = reader.__init__

        def stamped_init(self: Any, deliver: Callable, *args: Any, **kwargs: Any) -> None:
            def delivered(message: Any) -> None:  # on the reader thread, as read
                now = time.monotonic()
                stamps.write("s.recv", now, now, f"type={type(message).__name__}")
                deliver(message)

            init(self, delivered, *args, **kwargs)

        reader.__init__ = stamped_init

    return {
        "appliance.workers.worker": worker,
        "appliance.workers.store_client": store_client,
        "appliance.engine.llm_engine": engine,
        "appliance.pools.request_flow": request_flow,
        "appliance.pools.kv_store_owner": owner,
        "appliance.workers.outboxes": outboxes,
    }


class PatchingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then wraps its functions."""

    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds the modules to wrap with the finders after it, and wraps their loaders."""

    def __init__(self, wanted: dict[str, Callable[[ModuleType], None]]) -> None:
        self.wanted = wanted

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.wanted:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = PatchingLoader(spec.loader, self.wanted[name])
                return spec
        return None


def install() -> None:
    folder = os.environ.get("KV_PROBE_DIR")
    if folder:
        sys.meta_path.insert(0, PatchingFinder(patches(Stamps(folder))))


install()
