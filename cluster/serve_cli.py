"""`manta serve`: the cluster (Ray, replicas, router) behind the OpenAI HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import logging

logger = logging.getLogger(__name__)


def add_serve_parser(sub) -> None:
    from cluster.api.reasoning import PARSERS as REASONING_PARSERS
    from cluster.api.tools import PARSERS
    from cluster.engine.config import PD_MEMORIES
    from cluster.engine_args import add_engine_args

    p = sub.add_parser("serve", help="serve an OpenAI-compatible API from a Ray cluster")
    add_engine_args(p)
    p.add_argument("--replicas", type=int, default=None,
                   help="mixed replicas, each prefilling and decoding its requests (default 1; 0 with "
                        "--prefill-replicas/--decode-replicas)")
    p.add_argument("--prefill-replicas", type=int, default=0,
                   help="disaggregated serving: replicas that prefill prompts and hand their KV pages to ...")
    p.add_argument("--decode-replicas", type=int, default=0,
                   help="... replicas that read them over NIXL and decode (docs/deploy.md, section 12)")
    p.add_argument("--prefill-tp", type=int, default=None, help="TP size of prefill replicas (default --tp)")
    p.add_argument("--decode-tp", type=int, default=None, help="TP size of decode replicas (default --tp)")
    p.add_argument("--prefill-gpus-per-rank", type=float, default=None,
                   help="share of a GPU per prefill rank (default --gpus-per-rank)")
    p.add_argument("--decode-gpus-per-rank", type=float, default=None,
                   help="share of a GPU per decode rank (default --gpus-per-rank)")
    p.add_argument("--prefill-sm-percent", type=int, default=None,
                   help="under CUDA MPS: the SMs a prefill rank may occupy, %% (default --sm-percent)")
    p.add_argument("--decode-sm-percent", type=int, default=None,
                   help="under CUDA MPS: the SMs a decode rank may occupy, %% (default --sm-percent)")
    p.add_argument("--pd-buffer-gb", type=float, default=1.0,
                   help="disaggregated serving: each prefill and decode rank's hand-off rows, pages on their way "
                        "between them (a 2,048-token prompt of an 8B model is 256 MiB); on the GPU they come out "
                        "of --mem-fraction, before the KV pool")
    p.add_argument("--pd-memory", default="gpu", choices=PD_MEMORIES,
                   help="disaggregated serving: where hand-off pages wait and move: gpu (default: NIXL reads GPU "
                        "memory to GPU memory, CUDA IPC on one host, GPUDirect RDMA between hosts) or host (pinned "
                        "host memory: for hosts joined by a network without GPUDirect RDMA)")
    p.add_argument("--router-policy", default="cache_aware", choices=["round_robin", "least_load", "cache_aware"])
    p.add_argument("--cache-threshold", type=float, default=0.5)
    p.add_argument("--balance-abs-threshold", type=int, default=16)
    p.add_argument("--balance-rel-threshold", type=float, default=1.5)
    p.add_argument("--no-router-kv-events", dest="router_kv_events", action="store_false",
                   help="cache_aware routes on its approximate memory of what it sent where, not on the "
                        "replicas' KV events (what their prefix caches really hold)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="join this Ray cluster ('auto' on a ray up head)")
    p.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    p.add_argument("--nic", default=None, help="network interface for gloo/NCCL (multi-node)")
    p.add_argument("--cpus-per-rank", type=float, default=1.0)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not for /health)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="abort a request that runs longer than S seconds (504; its KV pages are freed)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM/SIGINT: stop admitting, let requests in flight finish for up to S seconds, "
                        "then end them and exit (a second signal ends them at once, each stream with its error event, "
                        "and exits without saving KV pages)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *PARSERS],
                   help="how tool_choice 'auto' outputs are read: the chat template's format (auto), a named "
                        "one, or none (text only)")
    p.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="reasoning models: send <think>...</think> as the message's reasoning_content")
    p.add_argument("--router-max-inflight", type=int, default=None,
                   help="requests the router holds at once before answering 503 (default: with --max-waiting W, "
                        "replicas x (max-running-requests + W); else unbounded)")
    p.add_argument("--replica-hang-timeout", type=float, default=30.0, metavar="S",  # RouterOptions.replica_hang_s
                   help="a replica actor that answers no health poll for S seconds is counted as hung: its "
                        "streams end (requests with no token yet are retried elsewhere) and it is replaced")
    # No --kv-store: <cache dir>/kvstore. Pages of 16 tokens by default: the shared KV store
    # serves pages of at least 16 (cluster/engine/kv_offload.py), and GPU kernels prefer them.
    p.set_defaults(func=cmd_serve, kv_store_embedded=True, page_size=16)


def replica_count(args: argparse.Namespace) -> int:
    """Mixed replicas: given, else 1 (0 in a disaggregated deployment)."""
    if args.replicas is not None:
        return args.replicas
    return 0 if args.prefill_replicas or args.decode_replicas else 1


def router_max_inflight(args: argparse.Namespace) -> int:
    """The router's bound (0: none): given, or what the replicas' own queues can hold."""
    if args.router_max_inflight is not None:
        return args.router_max_inflight
    if args.max_waiting > 0:
        replicas = replica_count(args) + args.prefill_replicas + args.decode_replicas
        return replicas * (args.max_running_requests + args.max_waiting)
    return 0


def cluster_options_from_args(args: argparse.Namespace):
    from cluster.engine_args import engine_config_from_args
    from cluster.launch import ClusterOptions
    from cluster.router import RouterOptions

    return ClusterOptions(
        engine=engine_config_from_args(args),
        replicas=replica_count(args),
        prefill_replicas=args.prefill_replicas,
        decode_replicas=args.decode_replicas,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_gpus_per_rank=args.prefill_gpus_per_rank,
        decode_gpus_per_rank=args.decode_gpus_per_rank,
        prefill_sm_percent=args.prefill_sm_percent,
        decode_sm_percent=args.decode_sm_percent,
        pd_buffer_gb=args.pd_buffer_gb,
        pd_memory=args.pd_memory,
        router=RouterOptions(policy=args.router_policy, cache_threshold=args.cache_threshold,
                             balance_abs_threshold=args.balance_abs_threshold,
                             balance_rel_threshold=args.balance_rel_threshold,
                             kv_events=args.router_kv_events,
                             max_inflight=router_max_inflight(args), replica_hang_s=args.replica_hang_timeout),
        address=args.address,
        placement_strategy=args.placement_strategy,
        nic=args.nic,
        cpus_per_rank=args.cpus_per_rank,
    )


def _gated_server_class():
    import uvicorn

    class GatedServer(uvicorn.Server):
        """uvicorn's server whose SIGINT/SIGTERM start the shutdown gate (`cluster.api.shutdown`)
        instead of exiting at once: uvicorn installs its own handlers while it serves, so
        this is where a signal arrives."""

        on_signal = None

        def handle_exit(self, sig, frame) -> None:  # in the main thread, from the signal handler
            if self.on_signal is None:
                super().handle_exit(sig, frame)
            else:
                self.on_signal()

    return GatedServer


def _check_checkpoint(options, local: bool) -> None:
    """Refuse, before Ray and the replicas start, a checkpoint that cannot be served (an unknown
    architecture, a quantized format it cannot load, a TP size of a side that cuts its FP8
    blocks) or, when the ranks run here (`local`), a directory that is not there (on a `ray up`
    cluster the ranks' nodes may hold it): ConfigError."""
    import os

    from cluster.engine.config import ConfigError
    from cluster.engine_args import require_checkpoint
    from workers.loader import check_quantization, check_tp_split
    from workers.model_config import ModelConfig

    model = options.engine.model
    if not local and not os.path.isfile(os.path.join(model, "config.json")):
        return
    require_checkpoint(model, options.engine.load_format)
    try:
        config = ModelConfig.from_pretrained(model, quantization=options.engine.quantization)
        check_quantization(config)
    except ValueError as exc:
        raise ConfigError("model", str(exc)) from None
    for role in dict.fromkeys(options.roles()):
        try:
            check_tp_split(config, options.engine_for(role).tp_size)
        except (ValueError, NotImplementedError) as exc:
            raise ConfigError({"mixed": "tp_size"}.get(role, f"{role}_tp"), str(exc)) from None


def _listen_socket(host: str, port: int):
    """The server's socket, bound before the cluster starts: a port already taken is a usage
    error at once, not a failure after the replicas came up (uvicorn listens on it later)."""
    import socket

    from cluster.engine.config import ConfigError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError("port", f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from cluster.api.metrics import ServerMetrics
    from cluster.api.server import build_app
    from cluster.api.shutdown import ShutdownGate
    from cluster.engine.config import ConfigError
    from cluster.launch import ServingCluster
    from workers import gil_switch, heap

    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ConfigError("request_timeout", "must be > 0 seconds")
    options = cluster_options_from_args(args)
    _check_checkpoint(options, local=options.address is None)
    sock = _listen_socket(args.host, args.port)
    gil_switch.apply()  # the event loop and Ray's thread that hands it the replicas' replies
    metrics = ServerMetrics()
    cluster = ServingCluster(options, metrics)
    gate = ShutdownGate()
    hurry = []  # a second signal came: exit without the drain
    try:
        router = cluster.start()
        app = build_app(router, metrics, api_key=args.api_key, metrics_public=args.metrics_public,
                        request_timeout_s=args.request_timeout, admin=cluster, gate=gate,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
        # The gate ends every request by the deadline; uvicorn then only closes idle connections.
        from cluster.api.http_protocol import StampedProtocol

        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", lifespan="off",
                                timeout_graceful_shutdown=2, http=StampedProtocol)
        server = _gated_server_class()(config)

        async def main() -> None:
            from cluster.supervisor import ReplicaSupervisor

            await router.start()
            supervisor = ReplicaSupervisor(cluster)  # replaces replica actors that die
            await supervisor.start()
            heap.freeze()  # the server's start-up objects: out of the collector's walks (a pause stalls every stream)
            loop = asyncio.get_running_loop()

            async def stop_when_drained() -> None:
                await gate.drained()
                server.should_exit = True

            def on_signal() -> None:
                if gate.closing:  # a second signal: now (no KV pages are saved)
                    hurry.append(True)
                    if len(hurry) == 1:  # what is in flight ends at once, each stream with its error event
                        gate.end_now()
                    else:  # a third: out, whatever is still open
                        server.should_exit = server.force_exit = True
                    return
                gate.begin(args.shutdown_timeout)
                loop.create_task(stop_when_drained())

            server.on_signal = lambda: loop.call_soon_threadsafe(on_signal)
            logger.info("serving %s on http://%s:%d/v1", router.model_name, args.host, sock.getsockname()[1])
            await server.serve(sockets=[sock])
            await supervisor.aclose()
            await router.aclose()

        asyncio.run(main())
    finally:
        sock.close()
        cluster.shutdown(now=bool(hurry))
    return 0
