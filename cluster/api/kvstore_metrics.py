"""Prometheus export of the shared KV store's counters, from what replicas report.

A replica's `stats()["kvstore"]` (cluster/kv_store_setup.py `kv_store_stats`) carries
cumulative counters: the scheduler's (pages looked up in the store, pages loaded), every rank's
client and host tier, and the store's usage. Like the prefix-cache counters they are exported
from the latest polled values by a custom collector. A replica that rebuilds its engine (a rank
died) or a store that restarts counts from zero again; the exported counters go on from where
they were (`cluster.api.monotonic`), so they only go down when the server restarts.

    manta:kvstore_pages_written_total{replica,layout,tp_rank}  pages a rank wrote into the store
    manta:kvstore_pages_read_total{replica,layout,tp_rank}     pages a rank read from the store
    manta:kvstore_hit_pages_total{replica}     pages loaded into the device pool from the store
    manta:kvstore_query_pages_total{replica}   pages past the radix-cache match looked up
    manta:kvstore_bytes_total{replica,direction}   bytes moved, direction "write" | "read"
    manta:kvstore_errors_total{replica,op}     failed store operations: op "probe" (lookups), "write"
                                               and "read" (the ranks' transfers), "file_write" (the
                                               store's file tier, replica "store")
    manta:kvstore_dropped_pages_total{replica} saves dropped: a rank's host tier was full, or the
                                               store refused them (its RAM full of pages not yet
                                               written to files: the store is slower than the saves)
    manta:kvstore_usage_bytes{tier}            "ram" and "file" (the store), "host" (ranks' host tiers),
                                               "handoff" (prefill/decode ranks' hand-off rows)
    manta:kvstore_host_admissions_total{replica}  requests admitted at once on pages their replica's
                                               host tier held (no store lookup; their pages count in hit_pages)
    manta:kvstore_warm_pages_total{replica}    pages the ranks read from the store into their host tiers
                                               at start (workers/host_warm.py)
    manta:kvstore_warming{replica}             ranks of the replica still warming their host tiers

Prefill/decode disaggregation (cluster/engine/kv_handoff.py, workers/kv_peer.py), on the decode
replica that pulls pages unless said otherwise:

    manta:pd_handed_off_total{replica}         requests a prefill replica kept pages for
    manta:pd_transfers_total{replica}          requests that read their prompt from a prefill replica
    manta:pd_transfer_pages_total{replica}     pages every rank read intact (loaded)
    manta:pd_transfer_bytes_total{replica}     bytes read over NIXL (all ranks)
    manta:pd_transfer_seconds_total{replica}   the ranks' read time (locate, transfer, checksums),
                                               summed over the ranks
    manta:pd_transfer_wait_seconds{replica}    histogram: each request's wait on its prompt's pages,
                                               from being set aside to every rank's read ending (or
                                               the deadline): the latency a transfer adds, p50/p99
    manta:pd_transfer_failures_total{replica,kind}  "failed" (dead peer, NIXL error), "timeout"
                                               (the deadline: the rest is computed), "corrupt" (crc),
                                               "stuck" (a READ NIXL could not cancel)
    manta:pd_stuck_reads{replica}              of those stuck READs, the ones whose memory is still held
                                               (given back when the READ ends: kvstore.transfer.Unreleased)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.api.monotonic import Monotonic
from cluster.api.polled_histograms import PolledHistograms
from cluster.engine.kv_handoff import WAIT_BUCKETS


class KVStoreCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = Monotonic()
        self._replicas: dict[str, dict] = {}
        # Every replica polls the one shared store on its own; each one's latest view, in the
        # order they arrived (None: that replica could not reach the store at its last poll).
        self._stores: dict[str, dict | None] = {}
        self._pd_wait = PolledHistograms("manta:pd_transfer_wait_seconds",
                                         "How long a decode request waited for its prompt's pages from a prefill "
                                         "replica (to every rank's read ending, or the deadline).", ["replica"],
                                         WAIT_BUCKETS)

    def set(self, replica: str, report: dict) -> None:
        with self._lock:
            self._replicas[replica] = report
            self._stores.pop(replica, None)
            self._stores[replica] = report.get("store")
        wait = (report.get("handoff") or {}).get("wait")
        if wait is not None:
            self._pd_wait.set((replica,), wait)

    def remove(self, replica: str) -> None:
        with self._lock:
            self._replicas.pop(replica, None)
            self._stores.pop(replica, None)
            self._count.forget(replica)
        self._pd_wait.remove(replica)

    def _store(self) -> dict | None:
        """The store's usage: the latest that a replica reached. One replica's timed-out poll
        (a busy or restarting store) does not hide what another just read; once no replica
        reaches the store (dead), its bytes are not reported."""
        return next((s for s in reversed(self._stores.values()) if s is not None), None)

    def collect(self) -> Iterator[Metric]:
        written = CounterMetricFamily("manta:kvstore_pages_written", "Pages a rank wrote into the shared KV store.",
                                      labels=["replica", "layout", "tp_rank"])
        read = CounterMetricFamily("manta:kvstore_pages_read", "Pages a rank read from the shared KV store.",
                                   labels=["replica", "layout", "tp_rank"])
        hits = CounterMetricFamily("manta:kvstore_hit_pages",
                                   "Prompt pages loaded from the KV store instead of computed.", labels=["replica"])
        queries = CounterMetricFamily("manta:kvstore_query_pages",
                                      "Prompt pages past the prefix-cache match looked up in the KV store.",
                                      labels=["replica"])
        nbytes = CounterMetricFamily("manta:kvstore_bytes", "Bytes moved between ranks and the KV store.",
                                     labels=["replica", "direction"])
        errors = CounterMetricFamily("manta:kvstore_errors",
                                     "KV store failures (timeouts, unreachable store, failed transfers, bad "
                                     "checksums, failed file writes); each is a miss or a page not saved, never a "
                                     "failed request.", labels=["replica", "op"])
        dropped = CounterMetricFamily("manta:kvstore_dropped_pages",
                                      "Pages not saved to the KV store because a rank's host tier had no room or the "
                                      "store refused them (the store is slower than the saves).", labels=["replica"])
        usage = GaugeMetricFamily("manta:kvstore_usage_bytes",
                                  "Bytes of KV pages held, by tier: ram and file (the shared store's RAM and "
                                  "files), host (the replicas' ranks' own host tiers, beside the store), handoff "
                                  "(prefill and decode ranks' hand-off rows: pages on their way between them).",
                                  labels=["tier"])
        host_adm = CounterMetricFamily("manta:kvstore_host_admissions",
                                       "Requests admitted at once on prompt pages their replica's host tier held.",
                                       labels=["replica"])
        warm = CounterMetricFamily("manta:kvstore_warm_pages",
                                   "Pages read from the KV store into the ranks' host tiers at start.",
                                   labels=["replica"])
        warming = GaugeMetricFamily("manta:kvstore_warming",
                                    "Ranks still warming their host tier from the KV store.", labels=["replica"])
        pd = {name: CounterMetricFamily(f"manta:pd_{name}", text, labels=["replica"]) for name, text in (
            ("handed_off", "Requests a prefill replica kept the prompt's pages for (disaggregated serving)."),
            ("transfers", "Requests that read their prompt's pages from a prefill replica."),
            ("transfer_pages", "Prompt pages read from a prefill replica and loaded."),
            ("transfer_bytes", "Bytes read from prefill replicas over NIXL."),
            ("transfer_seconds", "Seconds the ranks spent reading pages from prefill replicas."))}
        pd_fail = CounterMetricFamily("manta:pd_transfer_failures",
                                      "Page transfers from a prefill replica that failed (the decode replica "
                                      "computed the rest).", labels=["replica", "kind"])
        stuck = GaugeMetricFamily("manta:pd_stuck_reads", "READs from a prefill replica that NIXL could not "
                                  "cancel whose memory is still held (given back when they end).", labels=["replica"])

        def count(family: CounterMetricFamily, labels: list[str], value: float) -> None:
            family.add_metric(labels, self._count.total((family.name, tuple(labels)), value))

        with self._lock:
            host = handoff = 0
            for replica, rep in self._replicas.items():
                count(hits, [replica], rep.get("hit_pages", 0))
                count(queries, [replica], rep.get("query_pages", 0))
                count(host_adm, [replica], rep.get("host_admissions", 0))
                ranks = rep.get("ranks", [])
                count(errors, [replica, "probe"], rep.get("probe_errors", 0))
                count(errors, [replica, "write"], sum(r.get("write_errors", 0) for r in ranks))
                count(errors, [replica, "read"], sum(r.get("read_errors", 0) for r in ranks))
                count(dropped, [replica], sum(r.get("offload_dropped_pages", 0) + r.get("pages_refused", 0)
                                              for r in ranks))
                wbytes = rbytes = 0
                for r in ranks:
                    labels = [replica, str(r.get("layout", rep.get("layout", ""))), str(r.get("tp_rank", 0))]
                    count(written, labels, r.get("pages_written", 0))
                    count(read, labels, r.get("pages_read", 0))
                    wbytes += r.get("bytes_written", 0)
                    rbytes += r.get("bytes_read", 0)
                    host += r.get("host", {}).get("used_bytes", 0)
                    handoff += r.get("handoff", {}).get("used_bytes", 0)
                count(warm, [replica], sum(r.get("offload_warm_pages", 0) for r in ranks))
                warming.add_metric([replica], sum(r.get("offload_warming", 0) for r in ranks))
                count(nbytes, [replica, "write"], wbytes)
                count(nbytes, [replica, "read"], rbytes)
                ho = rep.get("handoff") or {}
                count(pd["handed_off"], [replica], ho.get("handed_off", 0))
                count(pd["transfers"], [replica], ho.get("fetches", 0))
                count(pd["transfer_pages"], [replica], ho.get("fetched_pages", 0))
                count(pd["transfer_bytes"], [replica], sum(r.get("pd_bytes", 0) for r in ranks))
                count(pd["transfer_seconds"], [replica], sum(r.get("pd_transfer_s", 0.0) for r in ranks))
                stuck.add_metric([replica], sum(r.get("pd_stuck", 0) - r.get("pd_stuck_freed", 0) for r in ranks))
                for kind in ("failures", "timeouts", "corrupt", "stuck"):
                    count(pd_fail, [replica, {"failures": "failed", "timeouts": "timeout"}.get(kind, kind)],
                          sum(r.get(f"pd_{kind}", 0) for r in ranks))
            store = self._store()
            if store is not None:
                usage.add_metric(["ram"], store.get("ram_used_bytes", 0))
                usage.add_metric(["file"], store.get("file_used_bytes", 0))
                count(errors, ["store", "file_write"], store.get("file_write_errors", 0))
            if self._replicas:
                usage.add_metric(["host"], host)
                usage.add_metric(["handoff"], handoff)
        yield from (written, read, hits, queries, nbytes, errors, dropped, usage, host_adm, warm, warming,
                    *pd.values(), pd_fail, stuck, self._pd_wait.family())

    def describe(self) -> Iterator[Metric]:
        return self.collect()
