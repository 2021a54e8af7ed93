"""Bring a serving cluster up on Ray and take it down again.

`ServingCluster.start()` joins (or starts) Ray, creates `replicas` replica actors — each
places its TP ranks with a placement group — waits until they are ready, logs where every
rank landed, and builds the router. A disaggregated deployment adds `prefill_replicas` and
`decode_replicas` (each side its own TP size): the router prefills a request on the one, and
the other reads the prompt's KV pages from it over NIXL and decodes (`cluster/engine/kv_handoff.py`). `shutdown()` kills every actor it created, so an
interrupted `manta serve` leaves no orphans.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from dataclasses import dataclass, field

import ray

from cluster.engine.config import PD_MEMORIES, ConfigError, EngineConfig
from cluster.kv_store_setup import ensure_kv_store
from cluster.replica import REPLICA_THREADS, Replica
from cluster.router import Router, RouterOptions

logger = logging.getLogger(__name__)

_REPLICA_ACTOR = re.compile(r"manta-replica-\d+")  # replica actors' names (rank actors add -rankN)


# The engine fields a prefill or decode side may set for itself: (EngineConfig field, the side's
# option after "prefill_" / "decode_", i.e. `--prefill-tp`, `--decode-gpus-per-rank`, ...).
SIDE_FIELDS = (("tp_size", "tp"), ("gpus_per_rank", "gpus_per_rank"), ("sm_percent", "sm_percent"))


@dataclass(frozen=True)
class ClusterOptions:
    engine: EngineConfig
    replicas: int = 1  # mixed replicas (prefill and decode on each)
    prefill_replicas: int = 0
    decode_replicas: int = 0
    prefill_tp: int | None = None  # None: engine.tp_size
    decode_tp: int | None = None
    # Each side's share of a GPU per rank (None: engine.gpus_per_rank), e.g. a prefill replica on a
    # third of a GPU beside decode ranks on 0.6 each, which then cannot land on one GPU together.
    prefill_gpus_per_rank: float | None = None
    decode_gpus_per_rank: float | None = None
    # Each side's `sm_percent` under CUDA MPS (None: engine.sm_percent), e.g. a prefill side held
    # to part of a GPU it shares with a decode side.
    prefill_sm_percent: int | None = None
    decode_sm_percent: int | None = None
    # Each prefill and decode rank's hand-off rows (workers/handoff_rows.py), and where they live.
    pd_buffer_gb: float = 1.0
    pd_memory: str = "gpu"
    router: RouterOptions = field(default_factory=RouterOptions)
    address: str | None = None  # None: start a local Ray instance (the embedded default)
    placement_strategy: str = "PACK"
    nic: str | None = None
    cpus_per_rank: float = 1.0
    namespace: str = "manta"

    def __post_init__(self) -> None:
        for name in ("replicas", "prefill_replicas", "decode_replicas"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must be >= 0")
        if self.replicas + self.prefill_replicas + self.decode_replicas < 1:
            raise ConfigError("replicas", "must be >= 1")
        if bool(self.prefill_replicas) != bool(self.decode_replicas):
            raise ConfigError("prefill_replicas" if not self.prefill_replicas else "decode_replicas",
                              "--prefill-replicas and --decode-replicas go together (both >= 1)")
        if self.pd_memory not in PD_MEMORIES:
            raise ConfigError("pd_memory", f"must be one of {PD_MEMORIES}")
        if self.pd_buffer_gb < 0 or (self.prefill_replicas and self.pd_buffer_gb == 0):
            raise ConfigError("pd_buffer_gb", "must be > 0: the hand-off rows hold the pages prefill replicas "
                              "hand to decode replicas")
        if self.prefill_replicas:
            from cluster.engine.kv_offload import MIN_PAGE_TOKENS

            if self.engine.kv_store is None:
                raise ConfigError("prefill_replicas", "prefill/decode disaggregation moves pages through the "
                                  "ranks' KV store clients: it needs the KV store (drop --no-kv-store)")
            if self.engine.page_size < MIN_PAGE_TOKENS:
                raise ConfigError("page_size", f"prefill/decode disaggregation needs --page-size >= {MIN_PAGE_TOKENS}")
        for role in ("prefill", "decode"):  # each side's engine, checked by EngineConfig, named by its flag
            try:
                self.engine_for(role)
            except ConfigError as exc:
                side = dict(SIDE_FIELDS).get(exc.field)
                raise ConfigError(f"{role}_{side}", exc.msg) if side else exc from None

    def engine_for(self, role: str) -> EngineConfig:
        """The engine config of a replica of `role` ("mixed", "prefill", "decode")."""
        sides = {field: getattr(self, f"{role}_{opt}") for field, opt in SIDE_FIELDS} if role != "mixed" else {}
        config = dataclasses.replace(self.engine, **{f: v for f, v in sides.items() if v is not None})
        # Hand-off rows for the replicas that take part: prefill and decode ones, and mixed ones
        # beside prefill replicas (they continue a request when every decode replica is full).
        rows = self.pd_buffer_gb if role != "mixed" or self.prefill_replicas else 0.0
        return dataclasses.replace(config, pd_buffer_gb=rows, pd_memory=self.pd_memory)

    def check_reshard(self) -> None:
        """Prefill and decode TP sizes that differ: an MHA page is resharded by kv head on the
        way, so both must split the kv heads evenly (MLA's latent is the same on every rank)."""
        p, d = self.engine_for("prefill").tp_size, self.engine_for("decode").tp_size
        if not self.prefill_replicas or p == d or not os.path.isfile(os.path.join(self.engine.model, "config.json")):
            return
        from workers.model_config import ModelConfig

        mc = ModelConfig.from_pretrained(self.engine.model)
        if not mc.use_mla and (mc.num_kv_heads % p or mc.num_kv_heads % d):
            raise ConfigError("prefill_tp", f"--prefill-tp {p} and --decode-tp {d}: pages move between them by kv "
                              f"head, and {mc.num_kv_heads} kv heads do not split evenly over both")

    def roles(self) -> list[str]:
        return ["mixed"] * self.replicas + ["prefill"] * self.prefill_replicas + ["decode"] * self.decode_replicas


class ServingCluster:
    def __init__(self, options: ClusterOptions, metrics=None):
        self.options = options
        self.metrics = metrics
        self.router: Router | None = None
        self.actors: dict[str, object] = {}
        self._started_ray = False
        self._next = 0
        self.kv_store = None  # the store actor, when this cluster started it (stopped at shutdown)
        self.infos: dict[str, dict] = {}  # replica name -> its info (start(), start_replica(), rebuild_router())

    def start(self) -> Router:
        opts = self.options
        opts.check_reshard()
        how = "using the Ray instance this process had already joined"
        if not ray.is_initialized():
            how = f"joined the cluster at {opts.address!r}" if opts.address else "started a local Ray instance"
            if opts.address:
                ray.init(address=opts.address, namespace=opts.namespace, log_to_driver=True)
            else:
                need = sum(opts.engine_for(r).tp_size for r in opts.roles()) * opts.cpus_per_rank
                gpus = None if opts.engine.device == "cuda" else 0
                ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), num_gpus=gpus,
                         namespace=opts.namespace, include_dashboard=False)
            self._started_ray = True
        _log_cluster(how)
        # The shared KV store before any replica: their ranks look it up by name at start.
        store, created = ensure_kv_store(opts.engine)
        self.kv_store = store if created else None
        roles = {self._new_name(): role for role in opts.roles()}
        handles = {n: self._spawn(n, role) for n, role in roles.items()}
        try:
            infos = {n: ray.get(h.info.remote()) for n, h in handles.items()}  # waits for readiness
        except Exception:
            # One replica could not start: nothing of this cluster is left behind (in a Ray
            # instance that outlives it, its names and placement groups would refuse the next).
            self.shutdown(now=True)
            raise
        for n, info in infos.items():
            _log_replica(n, info, opts.placement_strategy, opts.nic)
        _warn_shared_gpus(infos)
        logger.info("KV store: %s", _describe_kv_store())
        first = next(iter(infos.values()))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(opts.engine.tokenizer or opts.engine.model)
        self.router = Router(opts.router, self.metrics, tokenizer, opts.engine.model_name,
                             first["max_context_len"], first["vocab_size"],
                             is_encoder_decoder=first.get("is_encoder_decoder", False),
                             matryoshka_dimensions=first.get("matryoshka_dimensions"),
                             embedding_size=first.get("embedding_size"))
        for n, h in handles.items():
            self.router.add_replica(n, h, infos[n])
        self.infos = infos
        return self.router

    def _new_name(self) -> str:
        name = f"replica-{self._next}"
        self._next += 1
        return name

    def _actor_options(self, name: str) -> dict:
        """Ray options of replica `name`'s actor (a threaded actor that reserves no CPU: its
        ranks hold the group's resources)."""
        return {"name": f"manta-{name}", "num_cpus": 0, "max_concurrency": REPLICA_THREADS}

    def _spawn(self, name: str, role: str = "mixed"):
        opts = self.options
        actor = ray.remote(Replica).options(**self._actor_options(name)).remote(
            opts.engine_for(role), name, opts.placement_strategy, opts.nic, opts.cpus_per_rank, role
        )
        self.actors[name] = actor
        return actor

    def stop_replica(self, name: str) -> bool:
        """Stop a replica that is out of rotation (blocking): its engine, ranks and placement
        group. Adding one is `start_replica`; `cluster.api.admin` drains before it stops one.
        False when this cluster has no replica of that name."""
        self.infos.pop(name, None)
        actor = self.actors.pop(name, None)
        if actor is None:
            return False
        _retire_replicas({name: actor})
        logger.info("replica %s stopped", name)
        return True

    # ---------------- replacing replicas, rebuilding the router (cluster/supervisor.py) ----------------
    def restore_kv_store(self, ping_timeout_s: float = 5.0) -> bool:
        """Start the KV store again if this cluster started it and it is gone for good
        (blocking: run it off the event loop). A store whose process died is restarted by Ray
        itself (`max_restarts`); this handles one that cannot come back that way (killed with
        `ray.kill`, restarts exhausted). The new store rebuilds its index from the same
        directory, so the pages that reached its files are served again; the ranks' clients
        find it by name and register anew. True when it was started again."""
        if self.kv_store is None:
            return False
        from kvstore.actor import lookup_store

        # Asked by name first: a store killed for good has lost its name, and is never called
        # (a call to a killed restartable actor asks the GCS to restart it for lineage
        # reconstruction, a request Ray 2.60's GCS can die of).
        found = lookup_store()
        if found is not None and found._actor_id != self.kv_store._actor_id:
            self.kv_store = found  # started again by someone else: that one is the store now
            return False
        if found is not None:
            try:
                ray.get(self.kv_store.info.remote(), timeout=ping_timeout_s)
                return False  # alive (a slow answer counts as alive: a busy store is not restarted)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                return False  # busy, or Ray is restarting it
            except ray.exceptions.RayError:
                pass
        try:  # make sure the dead actor releases its name
            ray.kill(self.kv_store, no_restart=True)
        except Exception:
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            found = lookup_store()
            if found is None or found._actor_id != self.kv_store._actor_id:
                break
            time.sleep(0.1)
        store, _created = ensure_kv_store(self.options.engine)
        if store is None:
            return False  # not yet: the next check retries
        self.kv_store = store
        logger.warning("KV store: it had died; started again on %s", self.options.engine.kv_store)
        return True

    def start_replica(self, ready_timeout_s: float | None = None, role: str = "mixed") -> tuple[str, object]:
        """Spawn one more replica actor of `role` and wait until it is ready (blocking: run it
        off the event loop). The caller puts it into rotation (`router.add_replica` with
        `self.infos[name]`) on its own loop. Raises if it does not come up (nothing of it is
        left behind then)."""
        name = self._new_name()
        actor = self._spawn(name, role)
        try:
            info = ray.get(actor.info.remote(), timeout=ready_timeout_s)
        except Exception:
            self.actors.pop(name, None)
            _retire_replicas({name: actor})  # (its group may still be waiting for GPUs it would then hold)
            raise
        self.infos[name] = info
        _log_replica(name, info, self.options.placement_strategy, self.options.nic)
        _warn_shared_gpus(self.infos, name)
        return name, actor

    def forget_replica(self, name: str) -> None:
        """Drop a replica whose actor died (out of rotation already): kill what may be left,
        and remove its placement group. That group belongs to the job, not to the actor that made
        it, so it outlives the actor: left alone, Ray would re-place it on the next node with room
        and starve the replacement replica of exactly that room."""
        self.infos.pop(name, None)
        actor = self.actors.pop(name, None)
        if actor is not None:
            try:
                ray.kill(actor)
            except Exception:
                pass
        _remove_placement_group(name)

    def rebuild_router(self) -> Router:
        """A new router over the live replica actors, found by name (`manta-replica-N` in this
        namespace): what a restarted router starts from. The caller closes the old router;
        streams it had open keep running on the actors until they finish.

        The handles this cluster made are kept: a non-detached actor lives as long as its
        creator's handle, so replacing that handle by a looked-up one would let Ray reap the actor."""
        from transformers import AutoTokenizer

        found: dict[str, tuple[object, dict]] = {}
        for actor_name in sorted(ray.util.list_named_actors()):
            if not _REPLICA_ACTOR.fullmatch(actor_name):
                continue
            actor = self.actors.get(actor_name[len("manta-"):]) or ray.get_actor(actor_name)
            try:
                found[actor_name[len("manta-"):]] = (actor, ray.get(actor.info.remote(), timeout=30))
            except Exception as exc:  # dead or stuck: not part of the new router
                logger.warning("rebuild_router: %s does not answer (%s)", actor_name, type(exc).__name__)
        if not found:
            raise RuntimeError("no live replica actor to build a router over")
        opts = self.options
        first = next(iter(found.values()))[1]
        tokenizer = AutoTokenizer.from_pretrained(opts.engine.tokenizer or opts.engine.model)
        router = Router(opts.router, self.metrics, tokenizer, opts.engine.model_name,
                        first["max_context_len"], first["vocab_size"],
                             is_encoder_decoder=first.get("is_encoder_decoder", False),
                             matryoshka_dimensions=first.get("matryoshka_dimensions"),
                             embedding_size=first.get("embedding_size"))
        for name, (actor, info) in found.items():
            router.add_replica(name, actor, info)
            self.actors[name], self.infos[name] = actor, info
            self._next = max(self._next, int(name.rsplit("-", 1)[1]) + 1)
        self.router = router
        return router

    def shutdown(self, now: bool = False) -> None:
        """Stop every replica (all at once: each saves its cached KV pages for at most the
        drain timeout, under write-back store policies), then the store (it flushes its RAM
        tier to files), then Ray if this cluster started it. `now`: kill them without either
        (the operator asked twice)."""
        drain_s = self.options.engine.kv_drain_timeout_s if self.kv_store is not None else 0.0
        _retire_replicas({name: self.actors.pop(name) for name in list(self.actors)},
                         timeout_s=0 if now else 10 + drain_s)
        if self.kv_store is not None:
            _stop_actors([self.kv_store], timeout_s=0 if now else 30)
            self.kv_store = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


def _resources(res: dict) -> str:
    """CPU/GPU/memory of a Ray resource dict, readably ("CPU 8, GPU 2, memory 31.2 GiB")."""
    parts = [f"{k} {res[k]:g}" for k in ("CPU", "GPU") if k in res]
    if "memory" in res:
        parts.append(f"memory {res['memory'] / 2**30:.1f} GiB")
    return ", ".join(parts) or "none"


def _log_cluster(how: str) -> None:
    """Which cluster this process is part of, and what each node brings."""
    ctx = ray.get_runtime_context()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    logger.info("Ray cluster: %s (gcs %s, namespace %s): %d node(s), %s", how, ctx.gcs_address,
                ctx.namespace, len(nodes), _resources(ray.cluster_resources()))
    for n in nodes:
        # Ray's own metrics of the node (deploy/prometheus.yml's `ray` job scrapes them).
        port = n.get("MetricsExportPort")
        metrics = f"; Ray metrics at {n['NodeManagerAddress']}:{port}" if port else ""
        logger.info("  node %s at %s: %s%s%s", n["NodeID"][:12], n["NodeManagerAddress"],
                    _resources(n.get("Resources", {})), metrics,
                    " (this process)" if n["NodeID"] == ctx.get_node_id() else "")


def _log_replica(name: str, info: dict, strategy: str, nic: str | None) -> None:
    """Where a replica's TP ranks landed and which attention kernels they run."""
    group = info["group"]
    kv_tokens = (info["kv_pages"] - 1) * info["page_size"]  # page 0 is reserved
    logger.info("replica %s ready: tp=%d, placement %s%s, step channel %s, attention %s, KV cache %d tokens "
                "(%d pages of %d)", name, info["tp_size"], strategy, f", nic {nic}" if nic else "",
                group.get("step_channel", "in-process"), info["attention"], kv_tokens,
                info["kv_pages"] - 1, info["page_size"])
    for r in group.get("ranks", []):
        logger.info("  %s rank %d: node %s ip %s pid %s gpus %s", name, r["rank"], str(r["node_id"])[:12],
                    r["ip"], r["pid"], list(r["gpu_ids"]) or "none")


def _describe_kv_store() -> str:
    """Where the cluster's shared KV store keeps its pages, or why there is none."""
    try:
        from kvstore.actor import lookup_store
    except ImportError as exc:
        return f"off (kvstore unavailable: {exc})"
    store = lookup_store()
    if store is None:
        return "off (no store actor in this cluster)"
    try:
        info = ray.get(store.info.remote(), timeout=30)
        return (f"files under {info['root']} (up to {info['file_bytes'] / 2**30:.1f} GiB), "
                f"host RAM {info['ram_bytes'] / 2**30:.2f} GiB")
    except Exception as exc:  # a log line must not stop the server: say what is known
        return f"unreachable ({type(exc).__name__}: {exc})"


def pd_sides_sharing_gpus(infos: dict[str, dict], among: str | None = None) -> list[str]:
    """Each prefill replica that shares a GPU with a decode replica (`among`: only pairs with
    that replica), said as "prefill replica P and decode replica D share GPU g of node ip" (from
    the replicas' `info()`: their role and where their ranks were placed)."""
    from workers.ray_group import placed_gpus

    def gpus(name: str) -> dict[tuple[str, str], str]:
        return {at: p["ip"] for at, p in placed_gpus(infos[name].get("group", {}).get("ranks", []))}

    def of(role: str) -> list[str]:
        return [n for n, info in infos.items() if info.get("role") == role]

    out = []
    for p in of("prefill"):
        mine = gpus(p)
        for d in of("decode"):
            both = sorted(mine.keys() & gpus(d).keys())
            if both and among in (None, p, d):
                out.append(f"prefill replica {p} and decode replica {d} share GPU {both[0][1]} of node "
                           f"{mine[both[0]]}")
    return out


def _warn_shared_gpus(infos: dict[str, dict], among: str | None = None) -> None:
    for shared in pd_sides_sharing_gpus(infos, among):
        logger.warning("%s: every prefill stretches the decode steps beside it (on one H200, PD's ITL p99 was "
                       "2.7x its decode step with the two taking turns on the GPU, 2.2x under CUDA MPS with "
                       "--prefill-sm-percent 60 --decode-sm-percent 40 at twice the TTFT p99, 1.4x with a GPU "
                       "per side: BENCHMARKS.md, 2026-11-28); give each side GPUs of its own for latency",
                       shared)


def _remove_placement_group(replica: str) -> None:
    """Remove a replica's placement group if it is still there. It belongs to the job, not to
    the replica actor that made it, so it outlives a killed replica; left behind, it keeps its
    GPUs, and its name: a later cluster in the same Ray instance and namespace (a test's, a
    restarted `manta serve` attached to a running cluster) cannot place its replica of that name."""
    from ray.util import get_placement_group, remove_placement_group

    try:  # named by workers/ray_group.py: f"{replica name}-pg"
        remove_placement_group(get_placement_group(f"{replica}-pg"))
    except Exception:  # none left (the replica never placed one, or removed it itself)
        pass


def _retire_replicas(actors: dict[str, object], timeout_s: float = 30) -> None:
    """Stop replica actors (name -> handle; see `_stop_actors`), wait until Ray reports them
    dead, then remove their placement groups. In that order: a replica killed in its
    `__init__`, or one whose group was rebuilding, could otherwise place a group after it was
    looked for; and one killed before its own shutdown ran leaves its group behind."""
    _stop_actors(list(actors.values()), timeout_s)
    pings = []
    for actor in actors.values():
        try:
            pings.append(actor.ping.remote())  # fails once the actor is dead
        except Exception:
            pass
    if pings:
        ray.wait(pings, num_returns=len(pings), timeout=15)
    _wait_for_ranks_gone(list(actors), timeout_s=30)
    for name in actors:
        _remove_placement_group(name)


def _wait_for_ranks_gone(replicas: list[str], timeout_s: float) -> None:
    """Wait until no rank actor of these replicas (`manta-<replica>-rank<i>`) is still named:
    Ray kills a dead replica's ranks with it, but a moment later, and a named rank left alive
    refuses the next cluster's rank of that name (CI, 2026-11-29: `manta-replica-1-rank0` still
    listed right after a failed start; again at stop 62, after this waited 15 s).

    A rank still named after a second is killed by name, and the listing must stay empty for
    half a second: a replica killed while it was creating a rank can leave that rank's
    registration in flight, to appear after a first empty listing."""
    prefixes = tuple(f"manta-{name}-rank" for name in replicas)
    start = time.monotonic()
    killed: set[str] = set()
    left: list[str] = []
    empty_since = None
    while time.monotonic() - start < timeout_s:
        try:
            left = [a for a in ray.util.list_named_actors() if a.startswith(prefixes)]
        except Exception:
            return
        now = time.monotonic()
        if not left:
            empty_since = empty_since or now
            if now - empty_since >= 0.5:
                return
        else:
            empty_since = None
            if now - start >= 1.0:
                for name in set(left) - killed:
                    killed.add(name)
                    try:
                        ray.kill(ray.get_actor(name), no_restart=True)
                    except Exception:  # gone between the listing and the lookup
                        pass
        time.sleep(0.1)
    logger.warning("rank actors still named %.0f s after their replicas stopped: %s", timeout_s,
                   ", ".join(sorted(left)))


def _stop_actors(actors: list, timeout_s: float = 30) -> None:
    """Ask every actor to shut down at once, wait for them together (at most `timeout_s`),
    then kill them."""
    refs = []
    for actor in actors if timeout_s > 0 else ():
        try:
            refs.append(actor.shutdown.remote())
        except Exception:
            pass
    if refs:
        try:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        except Exception:
            pass
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:
            pass
