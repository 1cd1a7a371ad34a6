"""Prompt tokens served from partial blocks (issue 41), per worker on /metrics: the count
each worker's prefix cache keeps travels on its step report (TokenBatch, across the box
link too) to its handle and view, and the pool collector shows it per worker. The real
server's count is in test_kv_store_server.py's chat test."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from worker_handles import worker_handle, worker_view

from appliance.cluster.wire import FROM_WORKER, Codec
from appliance.pools.worker_handle import WorkerView
from appliance.server.metrics import PoolCollector
from appliance.workers.messages import TokenBatch

NAME = "appliance_worker_prompt_tokens_cached_partial_total"


def view(worker_id: int, partial_tokens: int) -> WorkerView:
    return worker_view(worker_id, partial_tokens=partial_tokens)


class Pools:
    """The pool state the collector reads: workers' views as last reported."""

    def __init__(self, views: list[WorkerView]) -> None:
        self._views = views
        self.requests: dict[int, Any] = {}

    def views(self) -> list[WorkerView]:
        return self._views

    def pending_handoffs(self) -> int:
        return 0


def test_metrics_show_each_workers_tokens_from_partial_blocks() -> None:
    registry = CollectorRegistry()
    registry.register(PoolCollector(Pools([view(0, 7), view(1, 0)])))  # type: ignore[arg-type]

    def value(worker: str) -> float | None:
        labels = {"worker": worker, "role": "prefill", "device": "cpu"}
        return registry.get_sample_value(NAME, labels)

    assert value("0") == 7
    assert value("1") == 0  # shown at 0: a rate() over it needs no absent series


def test_a_step_report_carries_the_count_to_the_handle_and_across_the_box_link() -> None:
    handle = worker_handle(0, "prefill")
    report = TokenBatch(0, num_free_blocks=5, partial_tokens=9)
    nonce = bytes(16)
    crossed = Codec(nonce).decode(Codec(nonce).encode(report), FROM_WORKER)
    assert crossed.partial_tokens == 9
    handle.reported(crossed, now=1.0)
    assert handle.partial_tokens == 9
    handle.reported(TokenBatch(0, partial_tokens=12), now=2.0)  # totals, not increments
    assert handle.partial_tokens == 12
