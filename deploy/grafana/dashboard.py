"""The manta Grafana dashboard, generated with grafana-foundation-sdk.

    python deploy/grafana/dashboard.py            # rewrite deploy/grafana/manta.json
    python deploy/grafana/dashboard.py --check    # exit 1 if manta.json is stale

Edit the panels here, never manta.json: tests/test_deploy.py regenerates the JSON and compares,
and checks that every metric a query names is one `manta serve` exports (or one listed there as
pending: exported by work still in progress).

Import manta.json into Grafana (Dashboards > New > Import) and pick a Prometheus data source that
scrapes the server (deploy/prometheus.yml). The `replica` variable filters the per-replica series;
request errors are counted by the HTTP server and carry no replica label.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, dashboard

OUT = Path(__file__).resolve().parent / "manta.json"

UID = "manta-serving"
DS = dashboard.DataSourceRef(type_val="prometheus", uid="${datasource}")
REPLICA = 'replica=~"$replica"'
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)


def _rate(metric: str, by: str = "", labels: str = REPLICA) -> str:
    sel = f"{metric}{{{labels}}}" if labels else metric
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({sel}[{RATE}]))"


def _ratio(hits: str, queries: str) -> str:
    """Hit fraction over the window; no data (not 0) while nothing was looked up."""
    return f"{_rate(hits)} / ({_rate(queries)} > 0)"


def _quantiles(histogram: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, {_rate(histogram + '_bucket', by='le')})", f"p{round(q * 100)}")
            for q in QUANTILES]


def _query(expr: str, legend: str, ref: str) -> prom_b.Dataquery:
    return prom_b.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range().datasource(DS)


def timeseries(title: str, description: str, queries: list[tuple[str, str]], unit: str, *,
               width: int = 8, max_val: float | None = None, stack: bool = False) -> ts_b.Panel:
    p = (ts_b.Panel().title(title).description(description).datasource(DS).unit(unit)
         .span(width).height(8).fill_opacity(10).line_width(1).show_points(common.VisibilityMode.NEVER)
         .legend(common_b.VizLegendOptions().show_legend(True).display_mode(common.LegendDisplayMode.LIST)
                 .placement(common.LegendPlacement.BOTTOM))
         .tooltip(common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                  .sort(common.SortOrder.DESCENDING)))
    if max_val is not None:
        p = p.min(0).max(max_val)
    if stack:
        p = p.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    for i, (expr, legend) in enumerate(queries):
        p = p.with_target(_query(expr, legend, chr(ord("A") + i)))
    return p


def health_stat() -> stat_b.Panel:
    """One tile per replica: green while the router routes to it, red while it is unhealthy."""
    mapping = dashboard.ValueMap(options={
        "0": dashboard.ValueMappingResult(text="unhealthy", color="red", index=0),
        "1": dashboard.ValueMappingResult(text="healthy", color="green", index=1),
    })
    steps = [dashboard.Threshold(value=None, color="red"), dashboard.Threshold(value=1, color="green")]
    return (stat_b.Panel().title("Replica health")
            .description("1 while the router routes to the replica, 0 while it is unhealthy (a rank died, "
                         "the replica is rebuilding its TP group, or its stats poll failed).")
            .datasource(DS).span(12).height(8).mappings([mapping])
            .thresholds(dash_b.ThresholdsConfig().mode(dashboard.ThresholdsMode.ABSOLUTE).steps(steps))
            .color_mode(common.BigValueColorMode.BACKGROUND).graph_mode(common.BigValueGraphMode.NONE)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            # Instant: the replicas serving now (a replaced one's series ends with it; over a range
            # its last value would stay on the tile).
            .with_target(_query(f"max by (replica) (manta:replica_healthy{{{REPLICA}}})", "{{replica}}", "A")
                         .instant()))


class _Numbered:
    """Adds rows and panels to a dashboard with ids 1, 2, ... in order (Grafana wants unique ids)."""

    def __init__(self, d: dash_b.Dashboard):
        self.d, self.ids = d, itertools.count(1)

    def row(self, title: str) -> None:
        self.d = self.d.with_row(dash_b.Row(title).id(next(self.ids)))

    def panel(self, p: ts_b.Panel | stat_b.Panel) -> None:
        self.d = self.d.with_panel(p.id(next(self.ids)))


def build() -> dash_b.Dashboard:
    d = (dash_b.Dashboard("manta serving").uid(UID).tags(["manta", "llm", "ray"])
         .description("Requests, latency, batching, KV cache and routing of a manta serving cluster.")
         .timezone("browser").refresh("10s").time("now-1h", "now").editable()
         .tooltip(dashboard.DashboardCursorSync.CROSSHAIR))
    d = d.with_variable(dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    d = d.with_variable(
        dash_b.QueryVariable("replica").label("Replica").datasource(DS)
        .query({"query": "label_values(manta:replica_healthy, replica)", "refId": "replica"})
        .refresh(dashboard.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dashboard.VariableSort.ALPHABETICAL_ASC)
        .multi(True).include_all(True).all_value(".*"))

    n = _Numbered(d)
    n.row("Traffic")
    n.panel(timeseries(
        "Request rate", "Finished requests per second, by finish reason (stop, length, abort: the server cut "
        "it short, error). Each choice of a request with n > 1 and each input of an embeddings request counts.",
        [(_rate("manta:request_finished_total", by="finish_reason"), "{{finish_reason}}")], "reqps"))
    n.panel(timeseries(
        "Errors", "HTTP error responses per second, by status code (4xx: the request; 5xx: the server; "
        "499: the client went away before its answer began). Counted by the server, so not filtered by replica.",
        [(_rate("manta:request_errors_total", by="code", labels=""), "{{code}}")], "reqps"))
    n.panel(timeseries(
        "Aborts", "Requests the server cut short per second, by why: client_gone (the client left, a stream's "
        "included), timeout (--request-timeout), error (a sibling choice failed), shutdown. Their KV pages "
        "are freed at once.",
        [(_rate("manta:request_aborts_total", by="reason", labels=""), "{{reason}}")], "reqps"))
    n.panel(timeseries(
        "Tokens/s", "Prompt tokens (once per prompt, whatever its n) and generated tokens per second, of "
        "finished requests.",
        [(_rate("manta:prompt_tokens_total"), "prompt"), (_rate("manta:generation_tokens_total"), "generated")],
        "short"))

    n.row("Latency")
    n.panel(timeseries(
        "Time to first token", "Arrival to first generated token (queueing + prefill); embeddings are not in it.",
        _quantiles("manta:time_to_first_token_seconds"), "s"))
    n.panel(timeseries(
        "Time per output token", "Mean time between generated tokens after the first, per request.",
        _quantiles("manta:time_per_output_token_seconds"), "s"))
    n.panel(timeseries(
        "Inter-token latency", "Time a stream waits between outputs carrying tokens, as they reach the HTTP "
        "server; its p99 is the stalls (prompts computed beside decodes, pauses) a mean per token hides.",
        _quantiles("manta:inter_token_latency_seconds"), "s"))
    n.panel(timeseries(
        "End-to-end latency", "Arrival to last token.", _quantiles("manta:e2e_request_latency_seconds"), "s"))
    n.panel(timeseries(
        "Engine step time p99 by kind", "The steps that make the inter-token gaps: DECODE (running requests "
        "only), MIXED (a prompt piece beside the decodes), EXTEND (prompts alone); p99 over the selected "
        "replicas, read against the ITL goal.",
        [(f"histogram_quantile(0.99, {_rate('manta:engine_step_seconds_bucket', by='le, mode')})", "{{mode}}")],
        "s"))

    n.row("Batching and KV cache")
    n.panel(timeseries(
        "Running and waiting requests", "Requests in the running batches and queued for admission, summed "
        "over the selected replicas.",
        [(f"sum(manta:num_requests_running{{{REPLICA}}})", "running"),
         (f"sum(manta:num_requests_waiting{{{REPLICA}}})", "waiting")], "short"))
    n.panel(timeseries(
        "Prompt tokens beside decodes", "The most prompt tokens a step computes while requests decode, per "
        "replica: the fixed --mixed-prefill-tokens cap, or what the --itl-target-ms budget last chose (lower: "
        "its decodes leave less of the target; back up: prompts waiting longer than --ttft-target-ms allows).",
        [(f"max by (replica) (manta:prompt_token_cap{{{REPLICA}}})", "{{replica}}")], "short"))
    n.panel(timeseries(
        "KV cache usage", "Fraction of each replica's KV cache pages in use.",
        [(f"max by (replica) (manta:kv_cache_usage_perc{{{REPLICA}}})", "{{replica}}")], "percentunit",
        max_val=1))
    n.panel(timeseries(
        "KV cache capacity", "Tokens each replica's KV cache holds, by its storage dtype (--kv-cache-dtype).",
        [(f"max by (replica, kv_cache_dtype) (manta:kv_cache_capacity_tokens{{{REPLICA}}})",
          "{{replica}} {{kv_cache_dtype}}")], "short"))
    n.panel(timeseries(
        "Prefix-cache hit rate", "Prompt tokens found in the replicas' radix caches / prompt tokens looked "
        "up (no data while nothing is looked up).",
        [(_ratio("manta:prefix_cache_hit_tokens_total", "manta:prefix_cache_query_tokens_total"), "hit rate")],
        "percentunit", max_val=1))
    n.panel(timeseries(
        "KV-store hit rate", "Pages found in the shared KV store / pages looked up there.",
        [(_ratio("manta:kvstore_hit_pages_total", "manta:kvstore_query_pages_total"), "hit rate")],
        "percentunit", max_val=1))
    n.panel(timeseries(
        "KV-store usage", "Bytes of KV pages held, by tier: ram and file (the shared store's RAM and files), "
        "host (the replicas' ranks' own host tiers, beside the store).",
        [("sum by (tier) (manta:kvstore_usage_bytes)", "{{tier}}")], "bytes"))
    n.panel(timeseries(
        "Speculative acceptance", "Draft tokens accepted by the target model / draft tokens proposed.",
        [(_ratio("manta:spec_accepted_tokens_total", "manta:spec_draft_tokens_total"), "acceptance")],
        "percentunit", max_val=1))

    n.row("Replicas and routing")
    n.panel(timeseries(
        "Load per replica", "Running + waiting requests of each replica (what least_load balances).",
        [(f"sum by (replica) (manta:num_requests_running{{{REPLICA}}} + manta:num_requests_waiting{{{REPLICA}}})",
          "{{replica}}")], "short", width=12, stack=True))
    n.panel(timeseries(
        "Router decisions", "Requests routed per second, by replica and policy (a retry on another replica "
        "counts again).",
        [(_rate("manta:router_requests_total", by="replica, policy"), "{{replica}} ({{policy}})")], "reqps",
        width=12, stack=True))
    n.panel(timeseries(
        "Router retries", "Requests moved to another replica before their first token (or later, for a "
        "response not streamed), per second, by the replica that could not serve them and why (unavailable, "
        "queue_full, replica_failed).",
        [(_rate("manta:router_retries_total", by="replica, reason"), "{{replica}} ({{reason}})")], "reqps",
        width=12, stack=True))
    n.panel(timeseries(
        "Routed prefix hits", "Prompt tokens per second that cache_aware routing found cached on the replica it "
        "chose, by replica and by where it learned it: events (the replicas' KV events) or tree (the router's "
        "memory of what it sent where, used while the events lag).",
        [(_rate("manta:router_prefix_hit_tokens_total", by="replica, source"), "{{replica}} ({{source}})")],
        "short", width=12, stack=True))
    n.panel(timeseries(
        "Routed prefix hits by tier", "Of the routed prefix hits found on KV events, prompt tokens per second "
        "by where the chosen replica held them: gpu, host (its ranks' host tier), store (the shared KV store).",
        [(_rate("manta:router_prefix_tier_tokens_total", by="replica, tier"), "{{replica}} ({{tier}})")],
        "short", width=12, stack=True))
    n.panel(timeseries(
        "KV-event lag", "Seconds since the router's index of each replica's cache was last brought up to date "
        "from its KV events (past 2 s the router routes on its memory instead; -1: never).",
        [(f"max by (replica) (manta:router_kv_event_lag_seconds{{{REPLICA}}})", "{{replica}}")], "s", width=12))
    n.panel(timeseries(
        "Shared store in the router's index", "Pages of the shared KV store the router counts on (replicas' "
        "events of pages written there, less those the store reports evicting), and pages per second it drops "
        "on those reports.",
        [("max(manta:router_store_index_pages)", "pages indexed"),
         (_rate("manta:router_store_removals_total", labels=""), "removed / s")], "short", width=12))
    n.panel(timeseries(
        "Prefill→decode transfers", "Disaggregated serving: KV bytes per second decode replicas read from "
        "prefill replicas over NIXL.",
        [(_rate("manta:pd_transfer_bytes_total", by="replica"), "{{replica}}")], "Bps", width=12))
    n.panel(timeseries(
        "Prefill→decode transfer failures", "Transfers from a prefill replica that failed per second, by kind "
        "(failed, timeout, corrupt: the decode replica computed those pages itself; stuck: NIXL could not cancel the "
        "READ, whose memory manta:pd_stuck_reads counts until it ends).",
        [(_rate("manta:pd_transfer_failures_total", by="replica, kind"), "{{replica}} {{kind}}")], "reqps",
        width=12))
    n.panel(timeseries(
        "Prefill→decode transfer wait", "How long decode requests waited for their prompt pages from the "
        "prefill replica (set aside until every rank's read ended, or the deadline): quantiles over all decode "
        "replicas.",
        _quantiles("manta:pd_transfer_wait_seconds"), "s", width=12))
    n.panel(health_stat())
    n.panel(timeseries(
        "Replica restarts", "Times each replica rebuilt its TP group after losing a rank, and replica actors "
        "replaced by new ones (they died or hung) in the dashboard's range.",
        [(f"max by (replica) (manta:replica_restarts{{{REPLICA}}})", "{{replica}}"),
         ("sum(increase(manta:replica_replacements_total[$__range]))", "replaced")], "short", width=12))
    return n.d


def render() -> str:
    """The dashboard JSON, byte-for-byte what manta.json holds."""
    model = build().build()
    return json.dumps(json.loads(json.dumps(model, cls=JSONEncoder)), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if manta.json differs from the generated JSON")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is stale: run python deploy/grafana/dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
