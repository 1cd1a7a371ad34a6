"""Prometheus metrics: latencies observed per request as its chunks reach the server,
and the pools' load read from their state at each scrape."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.admin.latency_window import Finished, LatencyWindow
from appliance.api import Chunk
from appliance.core.events import FAULT_KINDS
from appliance.core.request_table import Timing
from appliance.pools.pool_state import PoolState

FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class Metrics:
    """The server's metrics, in their own registry (one per app, so tests can build many)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        pools: PoolState,
        recent: LatencyWindow,
        planner_counts: Mapping[str, int] | None = None,
    ) -> None:
        """`planner_counts`: the rebalancer's decisions so far by action (move, hold)."""
        self.registry = registry
        self.recent = recent  # the last minute's requests, for the admin API

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.ttft = histogram(
            "appliance_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            FIRST_TOKEN_BUCKETS,
        )
        self.tpot = histogram(
            "appliance_time_per_output_token_seconds",
            "A finished request's mean time per token after the first.",
            PER_TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "appliance_inter_token_latency_seconds",
            "Time between successive streamed chunks of a request.",
            PER_TOKEN_BUCKETS,
        )
        self.queue_time = histogram(
            "appliance_queue_time_seconds",
            "From arrival until the first model step that ran the request.",
            FIRST_TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "appliance_e2e_request_latency_seconds",
            "From arrival to the last token.",
            REQUEST_BUCKETS,
        )
        self.handoff_latency = histogram(
            "appliance_handoff_latency_seconds",
            "Round trip of an accepted KV handoff: sent to the decode worker until copied.",
            HANDOFF_BUCKETS,
        )
        self.handoff_bytes = counter(
            "appliance_handoff_bytes", "KV bytes copied from the prefill to the decode pool."
        )
        self.prompt_tokens = counter("appliance_prompt_tokens", "Prompt tokens prefilled.")
        self.cached_prompt_tokens = counter(
            "appliance_prompt_tokens_cached",
            "Prompt tokens served from the prefix cache instead of being prefilled.",
        )
        self.computed_prompt_tokens = counter(
            "appliance_prompt_tokens_computed",
            "Prompt tokens a worker computed: neither in its pool's prefix cache nor loaded "
            "from the box's KV store.",
        )
        self.generation_tokens = counter(
            "appliance_generation_tokens", "Tokens generated (prefill's first and decoded)."
        )
        self.requests = counter(
            "appliance_requests",
            "Generations ended, by finish reason (stop, length, error, abort).",
            ("finish_reason",),
        )
        self.errors = counter(
            "appliance_error_responses",
            "Requests answered with an error, by HTTP status.",
            ("status",),
        )
        registry.register(PoolCollector(pools))
        registry.register(FaultCollector(pools))
        registry.register(SpeculationCollector(pools))
        registry.register(KVStoreCollector(pools))
        if planner_counts is not None:
            registry.register(PlannerCollector(planner_counts))

    def observe_first_token(self, seconds: float, prompt_tokens: int, cached: int = 0) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached)
        self.computed_prompt_tokens.inc(prompt_tokens - cached)

    def observe_finished(
        self, chunk: Chunk, num_tokens: int, arrival: float, first: float, last: float
    ) -> None:
        """A finished request: it arrived at `arrival`, its first and last chunks reached
        the server at `first` and `last` (monotonic seconds)."""
        self.e2e.observe(last - arrival)
        tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else None
        if tpot is not None:
            self.tpot.observe(tpot)
        self.recent.record(Finished(last, first - arrival, tpot, num_tokens))
        timing = Timing.from_dict(chunk.timing or {})
        if timing.queue_time is not None:
            self.queue_time.observe(timing.queue_time)
        if timing.handoff_latency is not None:
            self.handoff_latency.observe(timing.handoff_latency)
            self.handoff_bytes.inc(chunk.handoff_bytes)
        self.requests.labels(chunk.finish_reason or "stop").inc()


class PlannerCollector(Collector):
    """The rebalancer's decisions by action, read when Prometheus scrapes."""

    def __init__(self, counts: Mapping[str, int]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "appliance_planner_decisions",
            "The rebalancer's looks at the traffic, by action: move (recommended or made) or hold.",
            labels=["action"],
        )
        for action in ("move", "hold"):
            family.add_metric([action], self.counts.get(action, 0))
        yield family


# --- faults (issue 40): fault and recovery events by kind


class FaultCollector(Collector):
    """Fault and recovery events since the start by kind (core/events.py's FaultKind),
    read from the supervisor's event log when Prometheus scrapes; every kind is shown,
    0 until it happens, so a rate() over it needs no absent series."""

    def __init__(self, pools: PoolState) -> None:
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "appliance_fault_events",
            "Faults and recoveries (worker exits, stalls, kills, restarts, boxes lost and "
            "joined, requests run again or failed by a fault), by kind.",
            labels=["kind"],
        )
        counts = self.pools.fault_counts
        for kind in FAULT_KINDS:
            family.add_metric([kind], counts.get(kind, 0))
        yield family


# --- end faults


class PoolCollector(Collector):
    """Per-worker gauges read from the pools' state when Prometheus scrapes."""

    def __init__(self, pools: PoolState) -> None:
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "role", "device"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "waiting": GaugeMetricFamily(
                "appliance_worker_queue_depth",
                "Requests waiting at a worker: prompts not yet started, handoffs not yet taken.",
                labels=labels,
            ),
            "running": GaugeMetricFamily(
                "appliance_worker_running_sequences",
                "Sequences a worker is running.",
                labels=labels,
            ),
            "kv": GaugeMetricFamily(
                "appliance_worker_kv_usage_ratio",
                "Share of a worker's KV blocks in use.",
                labels=labels,
            ),
            "restarts": CounterMetricFamily(
                "appliance_worker_restarts",
                "Times a worker's process was restarted.",
                labels=labels,
            ),
            "partial": CounterMetricFamily(
                "appliance_worker_prompt_tokens_cached_partial",
                "Prompt tokens a worker's prefix cache served from partial blocks (a "
                "finished request's last block, from its own pool or the box's KV store, "
                "copied in): part of appliance_prompt_tokens_cached. A restarted process "
                "counts from 0.",
                labels=labels,
            ),
        }
        for view in self.pools.views():
            key = [str(view.worker_id), view.role, view.device]
            used = 1 - view.num_free_blocks / view.num_blocks if view.num_blocks else 0.0
            families["waiting"].add_metric(key, view.waiting)
            families["running"].add_metric(key, view.running)
            families["kv"].add_metric(key, used)
            families["restarts"].add_metric(key, view.restarts)
            families["partial"].add_metric(key, view.partial_tokens)
        yield from families.values()
        yield GaugeMetricFamily(
            "appliance_requests_in_flight",
            "Generations the supervisor holds.",
            value=len(self.pools.requests),
        )
        yield GaugeMetricFamily(
            "appliance_pending_handoffs",
            "Handoffs sent to a decode worker and not yet answered.",
            value=self.pools.pending_handoffs(),
        )


class SpeculationCollector(Collector):
    """Speculative decoding per worker (vLLM's spec_decode_* names), from the totals each
    worker reports with its steps: counters, and the acceptance rate and mean accepted
    length they give (0 until the worker has verified a draft)."""

    def __init__(self, pools: PoolState) -> None:
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "role", "device"]
        drafts = CounterMetricFamily(
            "appliance_spec_decode_num_drafts",
            "Verify steps: sequence-steps that verified draft tokens.",
            labels=labels,
        )
        draft_tokens = CounterMetricFamily(
            "appliance_spec_decode_num_draft_tokens",
            "Draft tokens proposed and verified.",
            labels=labels,
        )
        accepted = CounterMetricFamily(
            "appliance_spec_decode_num_accepted_tokens",
            "Draft tokens the target model kept.",
            labels=labels,
        )
        rate = GaugeMetricFamily(
            "appliance_spec_decode_acceptance_rate",
            "Draft tokens kept per draft token verified, since the worker started.",
            labels=labels,
        )
        length = GaugeMetricFamily(
            "appliance_spec_decode_mean_accepted_length",
            "Tokens a verify step made on average: its kept drafts and the target's own "
            "token after them (1 + kept drafts per verify step, as vLLM's).",
            labels=labels,
        )
        model = {
            "steps": "Forward passes of the worker's draft model (method draft; 0 otherwise).",
            "proposed": "Draft tokens the draft model handed the scheduler.",
            "accepted": "Draft model tokens that a verify step then kept.",
        }
        own = {
            name: CounterMetricFamily(
                f"appliance_spec_decode_draft_model_{name}", doc, labels=labels
            )
            for name, doc in model.items()
        }
        for view in self.pools.views():
            key = [str(view.worker_id), view.role, view.device]
            counts = view.speculation
            drafts.add_metric(key, counts.verify_steps)
            draft_tokens.add_metric(key, counts.drafted)
            accepted.add_metric(key, counts.accepted)
            rate.add_metric(key, counts.rate)
            length.add_metric(key, counts.mean_emitted)
            own["steps"].add_metric(key, counts.draft_steps)
            own["proposed"].add_metric(key, counts.draft_proposed)
            own["accepted"].add_metric(key, counts.draft_accepted)
        yield from (drafts, draft_tokens, accepted, rate, length, *own.values())


# --- kv store (issue 41): the box's KV store, read from the supervisor's owner at each scrape


class KVStoreCollector(Collector):
    """The box's KV store: blocks served and bytes moved per tier, lookups that missed,
    occupancy. Nothing while the store is off (or not open: no worker has loaded)."""

    def __init__(self, pools: PoolState) -> None:
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        figures = self.pools.kv_store_figures
        if figures is None:
            return
        tier = ["tier"]
        by_tier: list[tuple[str, str, Mapping[str, int], bool]] = [
            ("hits", "Blocks workers copied from the store into their pools.", figures.hits, True),
            ("read_bytes", "Bytes of the blocks served.", figures.bytes_read, True),
            ("written_bytes", "Bytes put into each tier.", figures.bytes_written, True),
            ("blocks", "Blocks held now.", figures.blocks, False),
            ("used_bytes", "Bytes the blocks held take.", figures.used_bytes, False),
            ("capacity_bytes", "Each tier's capacity.", figures.capacity_bytes, False),
        ]
        for name, doc, values, counts in by_tier:
            kind = CounterMetricFamily if counts else GaugeMetricFamily
            family = kind(f"appliance_kv_store_{name}", f"{doc} By tier (host, disk).", labels=tier)
            for label, value in values.items():
                family.add_metric([label], value)
            yield family
        single = [
            ("lookups", "Prompts looked up in the store.", figures.lookups),
            ("misses", "Lookups whose stored prefix ended short of the prompt.", figures.misses),
            ("refused", "Disk blocks that failed their checks: recomputed.", figures.refused),
            ("dropped", "Blocks pushed out of the store altogether.", figures.dropped),
            ("put_blocks", "Blocks the workers sent (one held already too).", figures.put_blocks),
            (
                "put_in_place_bytes",
                "Bytes of the blocks workers wrote straight into reserved arena slots.",
                figures.put_in_place_bytes,
            ),
            (
                "put_piped_bytes",
                "Bytes of the blocks workers sent through their pipe (no reserved slot left).",
                figures.put_piped_bytes,
            ),
        ]
        for name, doc, value in single:
            yield CounterMetricFamily(f"appliance_kv_store_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "appliance_kv_store_reserved_slots",
            "Arena slots handed to workers for their next blocks, not yet filled.",
            value=figures.reserved_slots,
        )


# --- end kv store
