"""Prometheus metrics of the serving cluster (one `ServerMetrics` per HTTP server process).

Who writes what:
- the HTTP server: `observe_finished` (latencies, token counts and finish reason of every finished
  request, labelled by the replica that served it), `record_error` (every 4xx/5xx it answers) and
  `record_aborts` (requests it cut short: client gone, timeout);
- the router: `record_route` (each routing decision), `update_replica_stats` (what it polls from
  each replica) and `remove_replica` (a replica left the cluster).

The prefix-cache counters are cumulative on the replica side; they are exported by a custom
collector from the latest polled values rather than by a prometheus `Counter` (which can only be
incremented). A replica that restarts starts again from zero, which Prometheus' `rate()` reads
as a counter reset.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.api.kvstore_metrics import KVStoreCollector
from cluster.api.monotonic import Monotonic
from cluster.api.spec_metrics import SpecCollector
from cluster.api.step_metrics import StepTimeCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# No `_created` series beside every counter and histogram (a third more series per scrape, and
# nothing a dashboard reads).
disable_created_metrics()

# Seconds. TTFT spans a cached short prompt on a GPU (ms) to a long prefill behind a queue.
# Fine enough (about 10-25% apart from 10 ms on, where GPU replicas answer) that a quantile read
# off the buckets is within a few percent of the clients' own.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045,
                0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6,
                0.7, 0.8, 0.9, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 7.0,
                8.0, 9.0, 10.0, 12.0, 14.0, 16.0, 20.0, 25.0, 30.0, 40.0, 60.0, 80.0)
# Seconds per token after the first: a few ms (GPU decode) to ~1 s (overloaded CPU replica).
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# Seconds between a stream's tokens: 2.5 ms apart through the 10-50 ms of GPU decode steps, so
# that a p99 read off the buckets tells 38 ms from 42.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.0225, 0.025, 0.0275, 0.03,
               0.0325, 0.035, 0.0375, 0.04, 0.0425, 0.045, 0.0475, 0.05, 0.055, 0.06, 0.07, 0.08, 0.09, 0.1,
               0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
# The stages of a request's wait (request_queue_time_seconds: 8 stages per replica): coarser.
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0)

# Why the router moves a request to another replica before its first token (`record_retry`).
RETRY_REASONS = ("unavailable", "queue_full", "replica_failed")
# Label values exported at 0 from start-up, so that every dashboard panel has a series (0, not
# "no data") before the first event: HTTP error codes the server answers, finish reasons, abort reasons.
ERROR_CODES = ("400", "401", "404", "413", "499", "500", "503", "504")
FINISH_REASONS = ("stop", "length", "abort", "error")
ABORT_REASONS = ("client_gone", "timeout", "error", "shutdown")
# Where a request's time to first token goes (manta:request_queue_time_seconds{stage}).
# to_engine and from_engine are each split in two where the replica is reached through Ray: the
# server's part (to the admission's `submit`; from the reply to the stream) and the transport's
# (the Ray call and the replica's threads: to the engine's queue; from its first token to the reply).
QUEUE_STAGES = ("engine", "serving_path", "to_engine", "from_engine", "to_engine_server", "to_engine_transit",
                "from_engine_transit", "from_engine_server")

# Keys of the dict a replica reports (see `update_replica_stats`).
STATS_KEYS = ("num_running", "num_waiting", "kv_usage", "prefix_hit_tokens", "prefix_query_tokens", "prompt_token_cap")


class _PolledCounters(Collector):
    """Exports the latest cumulative counts each replica reported as counters: one family per
    (metric name, help, key of the replica's stats dict). A replica's counts start again from 0
    when it rebuilds its engine (a rank died); the exported counter goes on from where it was
    (what it had counted is kept as a base), so it only goes down when the server restarts."""

    def __init__(self, families: tuple[tuple[str, str, str], ...]) -> None:
        self._lock = threading.Lock()
        self._families = families
        self._values: dict[str, dict[str, float]] = {}  # replica -> stats key -> value exported
        self._count = Monotonic()  # (checked at every poll, not only at a scrape)

    def set(self, replica: str, values: dict) -> None:
        with self._lock:
            mine = self._values.setdefault(replica, {})
            for _, _, key in self._families:
                if key in values:
                    mine[key] = self._count.total((key, (replica,)), float(values[key]))

    def remove(self, replica: str) -> None:
        with self._lock:
            self._values.pop(replica, None)
            self._count.forget(replica)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            for name, doc, key in self._families:
                fam = CounterMetricFamily(name, doc, labels=["replica"])
                for replica, values in self._values.items():
                    if key in values:
                        fam.add_metric([replica], values[key])
                yield fam

    def describe(self) -> Iterator[Metric]:
        # Registering calls describe(); returning the families (empty) keeps name clashes checked.
        return self.collect()


_PREFIX_FAMILIES = (
    ("manta:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", "prefix_hit_tokens"),
    ("manta:prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.", "prefix_query_tokens"),
)
# The serving path's messages (cluster/replica.py): they follow the engine's steps, not the
# number of requests; output_messages <= output_steps per router connected (one router: in total).
_MESSAGE_FAMILIES = (
    ("manta:replica_submit_messages", "Admission batches the replica received from routers.", "submit_calls"),
    ("manta:replica_admitted_requests", "Requests the replica admitted.", "admitted"),
    ("manta:replica_output_messages", "Output batches the replica sent to routers (one frame each).",
     "output_messages"),
    ("manta:replica_output_steps", "Engine steps (and aborts/failures) that produced outputs.", "output_steps"),
)


class ServerMetrics:
    """All `manta:*` metrics on their own registry (never the process-global default, so that
    several servers or tests in one process do not clash)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.num_requests_running = Gauge(
            "manta:num_requests_running", "Requests in the running batch.", ["replica"], registry=r
        )
        self.prompt_token_cap = Gauge(
            "manta:prompt_token_cap", "Prompt tokens a step may compute beside decoding requests: the last "
            "choice of the --itl-target-ms budget, else the fixed --mixed-prefill-tokens cap.", ["replica"],
            registry=r)
        self.num_requests_waiting = Gauge(
            "manta:num_requests_waiting", "Requests queued for admission.", ["replica"], registry=r
        )
        self.kv_cache_usage = Gauge(
            "manta:kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1).", ["replica"], registry=r
        )
        self.kv_cache_capacity = Gauge(
            "manta:kv_cache_capacity_tokens", "Tokens a replica's KV cache holds (its pages, each rank), by the "
            "cache's storage dtype (--kv-cache-dtype: an FP8 cache holds twice a 16-bit one's).",
            ["replica", "kv_cache_dtype"], registry=r
        )
        self.ttft = Histogram(
            "manta:time_to_first_token_seconds", "Time from the HTTP server receiving a request to its first token "
            "reaching the server (queueing in the server, router and replica included).",
            ["replica"], buckets=TTFT_BUCKETS, registry=r,
        )
        self.engine_ttft = Histogram(
            "manta:engine_time_to_first_token_seconds", "Time from the replica's engine receiving a request to its "
            "first token (time_to_first_token_seconds counts from the HTTP server receiving it).",
            ["replica"], buckets=TTFT_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            "manta:request_queue_time_seconds", "Time a request waits, by stage: engine (in the replica's queue "
            "before its first step), serving_path (time to first token spent outside the engine: HTTP server, "
            "router, the hops to the replica and back), and the two halves of serving_path by wall clock: "
            "to_engine (from the HTTP server to the engine) and from_engine (the first token from the engine to "
            "the stream), each split at the server's edge of the transport to a replica: to_engine_server (to "
            "the admission's submit call), to_engine_transit (from there to the engine's queue), "
            "from_engine_transit (from the engine's first token to the reply that carried it) and "
            "from_engine_server (from that reply to the stream).", ["replica", "stage"], buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "manta:time_per_output_token_seconds", "Mean time per generated token after the first.",
            ["replica"], buckets=TPOT_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "manta:inter_token_latency_seconds", "Time between successive outputs of a request that carry "
            "tokens, as they reach the HTTP server (what a stream's client waits between tokens; an output "
            "of several tokens counts once). Its tail is the stalls a mean per token "
            "(time_per_output_token_seconds) hides.", ["replica"], buckets=ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "manta:e2e_request_latency_seconds", "Time from the HTTP server receiving a request to its last token.",
            ["replica"], buckets=E2E_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter(
            "manta:prompt_tokens", "Prompt tokens of finished requests (aborted ones included).", ["replica"], registry=r
        )
        self.generation_tokens = Counter(
            "manta:generation_tokens", "Generated tokens of finished requests (aborted ones: those they had).", ["replica"], registry=r
        )
        self.requests_finished = Counter(
            "manta:request_finished", "Finished requests, by finish reason (stop, length, abort, error); "
            "abort: the server cut it short (see manta:request_aborts_total for why).",
            ["replica", "finish_reason"], registry=r,
        )
        self.router_requests = Counter(
            "manta:router_requests", "Routing decisions.", ["policy", "replica"], registry=r
        )
        self.router_retries = Counter(
            "manta:router_retries", "Requests moved to another replica before their first token (or later, "
            "for a response not streamed), by the replica that could not serve them and why (unavailable, "
            "queue_full, replica_failed).",
            ["replica", "reason"], registry=r,
        )
        self.router_prefix_hit_tokens = Counter(
            "manta:router_prefix_hit_tokens", "Prompt tokens cache_aware routing found cached on the replica it "
            "chose, by where it learned that: events (the replica's KV events) or tree (the router's "
            "approximate memory, used while events lag).",
            ["replica", "source"], registry=r,
        )
        self.router_prefix_tier_tokens = Counter(
            "manta:router_prefix_tier_tokens", "Of the prompt tokens cache_aware routing found cached (on KV "
            "events) on the replica it chose, where they were: gpu, host (its ranks' host tier) or store "
            "(the shared KV store).", ["replica", "tier"], registry=r,
        )
        self.router_kv_index_tokens = Gauge(
            "manta:router_kv_index_tokens", "Tokens of prefix the router's KV-event index says the replica has "
            "cached on its GPU.", ["replica"], registry=r,
        )
        self._kv_indexed: set[str] = set()  # replicas whose index series exist
        self.router_kv_event_lag = Gauge(
            "manta:router_kv_event_lag_seconds", "Seconds since the router's index of the replica's cache was last "
            "brought up to date from its KV events (-1: never).", ["replica"], registry=r,
        )
        self.router_store_index_pages = Gauge(
            "manta:router_store_index_pages", "Pages of the shared KV store the router's index holds (replicas' "
            "events of pages stored there, less the store's reports of pages it removed).", registry=r,
        )
        self.router_store_removals = Counter(
            "manta:router_store_removals", "Pages the router dropped from its store index on the store's reports "
            "of its evictions.", registry=r,
        )
        self.request_errors = Counter(
            "manta:request_errors", "HTTP error responses, by status code.", ["code"], registry=r
        )
        self.request_aborts = Counter(
            "manta:request_aborts", "Requests the server aborted before they finished (their KV pages freed), "
            "by reason: client_gone (disconnect), timeout (--request-timeout), error (a sibling choice failed), "
            "shutdown (the server's shutdown deadline).",
            ["reason"], registry=r,
        )
        self.replica_healthy = Gauge(
            "manta:replica_healthy", "1 while the router routes to the replica, 0 while it is unhealthy.",
            ["replica"], registry=r,
        )
        self.replica_restarts = Gauge(
            "manta:replica_restarts", "Times the replica rebuilt its TP group after losing a rank.",
            ["replica"], registry=r,
        )
        self.replica_replacements = Counter(
            "manta:replica_replacements", "Replica actors that died or hung and were replaced by new ones "
            "(the supervisor; a replacement gets a new replica name).", registry=r,
        )
        self._prefix = _PolledCounters(_PREFIX_FAMILIES)
        r.register(self._prefix)
        self._messages = _PolledCounters(_MESSAGE_FAMILIES)
        r.register(self._messages)
        self._kvstore = KVStoreCollector()  # manta:kvstore_* (cluster/api/kvstore_metrics.py)
        r.register(self._kvstore)
        self._spec = SpecCollector()  # manta:spec_* (cluster/api/spec_metrics.py)
        r.register(self._spec)
        self._steps = StepTimeCollector()  # manta:engine_step_seconds (cluster/api/step_metrics.py)
        r.register(self._steps)
        for code in ERROR_CODES:
            self.request_errors.labels(code)
        for reason in ABORT_REASONS:
            self.request_aborts.labels(reason)

    # ---------------- written by the server ----------------
    def _observe_hops(self, replica: str, out: Any, edge: Any) -> None:
        """The two hops split at the server's edge of the transport (see QUEUE_STAGES)."""
        sent, received = edge.submitted_wall, edge.received_wall
        parts = (("to_engine_server", edge.arrival_wall, sent), ("to_engine_transit", sent, out.arrival_wall),
                 ("from_engine_transit", out.first_token_wall, received),
                 ("from_engine_server", received, edge.first_token_wall))
        for stage, start, end in parts:
            if start is not None and end is not None:
                self.queue_time.labels(replica, stage).observe(max(0.0, end - start))

    def observe_finished(self, replica: str, out: Any, edge: Any = None, prompt: bool = True) -> None:
        """Record one finished request: `out` is its final `RequestOutput` (the engine's own
        timings), `edge` its `EdgeTiming` (from the moment the HTTP server received it). TTFT,
        TPOT and end-to-end latency are the edge's, what a client sees; without one (a server
        test over an engine) the engine's. `prompt`: count its prompt tokens (not for the 2nd..
        nth choice of a prompt: they share it, as the response's usage counts it once)."""
        self.requests_finished.labels(replica, out.finish_reason or "unknown").inc()
        if prompt:
            self.prompt_tokens.labels(replica).inc(max(0, out.prompt_tokens))
        self.generation_tokens.labels(replica).inc(max(0, out.completion_tokens))
        ttft = edge.ttft_s if edge is not None else out.ttft_s
        e2e = edge.e2e_s if edge is not None else out.e2e_s
        if edge is None and ttft is not None and out.completion_tokens > 0:  # else observe_first_token did
            self.ttft.labels(replica).observe(ttft)
        finisher, replica = replica, out.first_replica or replica  # the first token's, from here on
        if ttft is not None and out.completion_tokens > 0:
            if out.ttft_s is not None:
                self.engine_ttft.labels(replica).observe(out.ttft_s)
                # Outside the engine: the HTTP server, the router, the hops to the replica and back.
                self.queue_time.labels(replica, "serving_path").observe(max(0.0, ttft - out.ttft_s))
            if edge is not None and edge.arrival_wall is not None and out.arrival_wall is not None:
                # The two halves of that, by wall clock: in to the engine, and its first token out.
                self.queue_time.labels(replica, "to_engine").observe(max(0.0, out.arrival_wall - edge.arrival_wall))
                if edge.first_token_wall is not None and out.first_token_wall is not None:
                    self.queue_time.labels(replica, "from_engine").observe(
                        max(0.0, edge.first_token_wall - out.first_token_wall))
                self._observe_hops(replica, out, edge)
        if out.queue_s is not None:
            self.queue_time.labels(replica, "engine").observe(out.queue_s)
        if e2e is not None:
            self.e2e.labels(finisher).observe(e2e)
            if ttft is not None and out.completion_tokens > 1:
                tpot = (e2e - ttft) / (out.completion_tokens - 1)
                self.tpot.labels(finisher).observe(max(0.0, tpot))

    def observe_first_token(self, replica: str, ttft_s: float) -> None:
        """A request's first token reached the HTTP server `ttft_s` after the server received
        it (counted then, so requests whose client leaves early are in the histogram too)."""
        self.ttft.labels(replica).observe(ttft_s)

    def observe_token_gap(self, replica: str, gap_s: float) -> None:
        """An output brought a request tokens `gap_s` after its previous ones reached the server."""
        self.itl.labels(replica).observe(gap_s)

    def record_error(self, code: int) -> None:
        self.request_errors.labels(str(code)).inc()

    def record_aborts(self, reason: str, n: int = 1) -> None:
        self.request_aborts.labels(reason).inc(n)

    def observe_aborted(self, replica: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request the server aborted (its last output never came): finished as "abort", with
        the tokens it had (what `observe_finished` counts of one that ends)."""
        replica = replica or "unknown"
        self.requests_finished.labels(replica, "abort").inc()
        self.prompt_tokens.labels(replica).inc(max(0, prompt_tokens))
        self.generation_tokens.labels(replica).inc(max(0, completion_tokens))

    # ---------------- written by the router ----------------
    def record_route(self, policy: str, replica: str) -> None:
        self.router_requests.labels(policy, replica).inc()

    def record_prefix_route(self, replica: str, source: str, tokens: int) -> None:
        self.router_prefix_hit_tokens.labels(replica, source).inc(tokens)

    def record_prefix_tiers(self, replica: str, tiers: dict[str, int]) -> None:
        for tier, tokens in tiers.items():
            if tokens:
                self.router_prefix_tier_tokens.labels(replica, tier).inc(tokens)

    def set_kv_index(self, replica: str, tokens: int, lag_s: float) -> None:
        self.router_kv_index_tokens.labels(replica).set(tokens)
        self.router_kv_event_lag.labels(replica).set(max(0.0, lag_s) if lag_s != float("inf") else -1)

    def store_index(self, pages: int, dropped: int) -> None:
        self.router_store_index_pages.set(pages)
        if dropped > 0:
            self.router_store_removals.inc(dropped)

    def record_retry(self, replica: str, reason: str) -> None:
        self.router_retries.labels(replica, reason).inc()

    def update_replica_stats(self, replica: str, stats: dict) -> None:
        """Set a replica's polled state: num_running, num_waiting, kv_usage (0..1) and the
        cumulative prefix_hit_tokens / prefix_query_tokens. Missing keys leave values as they are;
        other keys (a replica's whole stats dict may be passed) are ignored."""
        if "num_running" in stats:
            self.num_requests_running.labels(replica).set(stats["num_running"])
        if "num_waiting" in stats:
            self.num_requests_waiting.labels(replica).set(stats["num_waiting"])
        if "kv_usage" in stats:
            self.kv_cache_usage.labels(replica).set(stats["kv_usage"])
        if "prompt_token_cap" in stats:
            self.prompt_token_cap.labels(replica).set(stats["prompt_token_cap"])
        if "healthy" in stats:
            self.replica_healthy.labels(replica).set(1.0 if stats["healthy"] else 0.0)
            self.init_replica(replica)
        if "restarts" in stats:
            self.replica_restarts.labels(replica).set(stats["restarts"])
        if "prefix_hit_tokens" in stats or "prefix_query_tokens" in stats:
            self._prefix.set(replica, {"prefix_hit_tokens": 0, "prefix_query_tokens": 0, **stats})
        if stats.get("messages"):
            self._messages.set(replica, stats["messages"])
        if stats.get("kvstore"):
            self._kvstore.set(replica, stats["kvstore"])
        if "spec_draft_tokens" in stats:
            self._spec.set(replica, stats)
        if stats.get("steps"):
            self._steps.set(replica, stats["steps"])

    def set_kv_capacity(self, replica: str, info: dict) -> None:
        """From a replica's `info()`: its KV pages (page 0 is reserved) x page size, by dtype."""
        if info.get("kv_pages") and info.get("page_size"):
            self.kv_cache_capacity.labels(replica, info.get("kv_cache_dtype") or "auto").set(
                (info["kv_pages"] - 1) * info["page_size"])

    def init_replica(self, replica: str, policy: str | None = None) -> None:
        """Export a replica's series at 0 from the start (rate() sees the first event, and the
        dashboard's panels show 0 rather than no data). Idempotent."""
        for reason in RETRY_REASONS:
            self.router_retries.labels(replica, reason)
        for reason in FINISH_REASONS:
            self.requests_finished.labels(replica, reason)
        for m in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.itl, self.e2e,
                  self.engine_ttft):
            m.labels(replica)
        for stage in QUEUE_STAGES:
            self.queue_time.labels(replica, stage)
        if policy is not None:
            self.router_requests.labels(policy, replica)
        for source in ("events", "tree"):
            self.router_prefix_hit_tokens.labels(replica, source)
        for tier in ("gpu", "host", "store"):
            self.router_prefix_tier_tokens.labels(replica, tier)
        if replica not in self._kv_indexed:  # no index yet: lag -1, as for one never pulled
            self._kv_indexed.add(replica)
            self.router_kv_index_tokens.labels(replica)
            self.router_kv_event_lag.labels(replica).set(-1)

    def remove_replica(self, replica: str) -> None:
        """Drop a departed replica's state series (gauges, polled counters, route counts).
        Latency histograms and token counters keep their history: they are server-side totals."""
        for g in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage,
                  self.replica_healthy, self.replica_restarts, self.kv_cache_capacity, self.prompt_token_cap):
            g.remove_by_labels({"replica": replica})
        self.router_requests.remove_by_labels({"replica": replica})
        self.router_retries.remove_by_labels({"replica": replica})
        for m in (self.router_prefix_hit_tokens, self.router_prefix_tier_tokens, self.router_kv_index_tokens,
                  self.router_kv_event_lag):
            m.remove_by_labels({"replica": replica})
        self._kv_indexed.discard(replica)
        self._prefix.remove(replica)
        self._messages.remove(replica)
        self._kvstore.remove(replica)
        self._spec.remove(replica)
        self._steps.remove(replica)

    # ---------------- read ----------------
    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (the body of GET /metrics)."""
        return generate_latest(self.registry)
