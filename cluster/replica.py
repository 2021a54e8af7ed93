"""A replica: one Ray actor owning an engine loop (tokenizer, scheduler, radix cache) that
drives its TP group of rank actors one step at a time.

The serving path crosses this actor in batches, so its cost does not grow with the number of
running requests (`cluster/replica_client.py` is the other end, in the HTTP server's process),
over a TCP connection per router (`cluster/replica_channel.py`), not Ray calls:
- in: one frame carrying every request a router admitted (and every abort) since its previous
  one, answered in order (`submit`);
- out: one frame with every output of the engine steps that completed since the previous one:
  the engine hands each step's outputs over in one call (`Engine.batch_sink`), so a connection
  carries at most one frame per step, never one message per token per request.
Outputs are kept per connection, so a router rebuilt beside an old one never receives the
other's outputs, and a router whose connection closes has its requests aborted at once.

Failure model: a monitor thread waits on every rank's never-returning `hold()` call; when a
rank dies the replica marks itself unhealthy at once, fails its in-flight requests with a
clean error, and refuses new ones until it is restarted (`restart()`), so the router routes
around it. Admission errors travel back as a finished `RequestOutput` with `error_type` set,
never as pickled exceptions.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from cluster.engine.config import EngineConfig
from cluster.engine.loop import Engine
from cluster.engine.ranks import runner_options
from cluster.engine.request import RequestOutput
from cluster.kv_store_setup import kv_store_stats
from cluster.replica_channel import Outboxes, ServingListener
from workers import actor_exit, gil_switch
from workers.request_errors import RequestError
from workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def admission_error(rid: str | None, exc: Exception) -> RequestOutput:
    """A refused admission as the router reads it: the `RequestError`'s kind, message and param
    (anything else is "internal")."""
    etype, param = (exc.kind, exc.param) if isinstance(exc, RequestError) else ("internal", None)
    return RequestOutput(rid or "", finished=True, finish_reason="error", error=str(exc),
                         error_type=etype, error_param=param)


@dataclass
class Admission:
    """One request a router sends to a replica (in a `submit` batch). The prompt is token ids:
    the server tokenized it once, at the edge."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    is_embedding: bool = False
    group: str | None = None  # requests that share the scheduler's fair share (one HTTP request's n)
    # Prefill/decode disaggregation (cluster/engine/kv_handoff.py): a prefill replica keeps the
    # prompt's pages for a decode replica (`hand_off`); a decode replica continues after
    # `resume_ids` (the first token, streamed by the prefill side), reading pages from `kv_source`.
    hand_off: bool = False
    resume_ids: list[int] | None = None
    kv_source: object = None


# Threads of the actor (Ray calls: `stats`, `kv_events`, `info`, `serving_channel`, `shutdown`; the
# serving path has threads of its own, `cluster/replica_channel.py`).
REPLICA_THREADS = 8


class Replica:
    """Plain class; `cluster.launch` wraps it with `ray.remote` as a threaded actor."""

    def __init__(self, config: EngineConfig, name: str, placement_strategy: str = "PACK",
                 nic: str | None = None, cpus_per_rank: float = 1.0, role: str = "mixed"):
        gil_switch.apply()  # this actor's process: the serving channel's threads beside the engine's
        actor_exit.install()  # Ray's SIGTERM at shutdown never prints a traceback into the driver's log
        self.config = config
        self.name = name
        self.role = role  # "mixed", or "prefill" / "decode" in a disaggregated deployment
        self._group_args = dict(placement_strategy=placement_strategy, nic=nic, cpus_per_rank=cpus_per_rank)
        self.healthy = False
        self.unhealthy_reason: str | None = "starting"
        self.closed = False  # shutdown() began: the group is not rebuilt from here on
        self._life = threading.Lock()  # a group rebuild (restart) and shutdown, one at a time
        self.engine: Engine | None = None
        self.started_at = time.time()
        self.restarts = 0
        self._lock = threading.Lock()
        # Messages of the serving path, for the test that they do not grow per token.
        self.counters = {"submit_calls": 0, "admitted": 0}
        self.outboxes = Outboxes(name)
        self._listener: ServingListener | None = None
        self._start()

    def _start(self) -> None:
        from workers.ray_group import RayWorkerGroup

        group = RayWorkerGroup(runner_options(self.config), self.config.tp_size, name=self.name,
                               step_timeout_s=self.config.step_timeout_s, **self._group_args)
        self.group = group
        self.engine = Engine(self.config, workers=group, batch_sink=self._on_outputs)
        self.engine.start()
        self.healthy, self.unhealthy_reason = True, None
        threading.Thread(target=self._monitor, args=(group,), name=f"{self.name}-monitor", daemon=True).start()

    def _monitor(self, group) -> None:
        reason = group.wait_for_death()
        if reason is None or group is not self.group or self.closed:
            return
        logger.error("replica %s: %s", self.name, reason)
        self.healthy, self.unhealthy_reason = False, reason
        if self.engine is not None:
            self.engine.fail_all(f"replica {self.name} lost a worker: {reason}", close=True)
        # Self-heal: tear the group down and build a new one (with backoff between tries).
        for attempt in range(5):
            try:
                self.restart()  # builds nothing (False) once the replica is shutting down
                return
            except Exception as exc:
                logger.exception("replica %s: restart %d failed", self.name, attempt + 1)
                self.unhealthy_reason = f"restart failed: {exc}"
                time.sleep(2.0 * (attempt + 1))

    def restart(self) -> bool:
        """Tear the TP group down and build it again (after a rank died). False, and nothing
        built, once the replica is shutting down."""
        with self._life:
            if self.closed:
                return False
            old = self.engine
            self.healthy, self.unhealthy_reason = False, "restarting"
            self.restarts += 1
            if old is not None:
                old.fail_all(f"replica {self.name} restarting", close=True)
                try:
                    old.shutdown()
                except Exception:
                    logger.exception("shutdown of the old engine failed")
            self._start()
            return True

    # ---------------- serving ----------------
    def serving_channel(self) -> tuple[str, int, bytes]:
        """Where a router connects for the serving path, and the token it must send first."""
        with self._lock:
            if self._listener is None:
                import ray

                self._listener = ServingListener(ray.util.get_node_ip_address(), self.outboxes,
                                                 self.submit, self.abort)
            return (*self._listener.address, self._listener.token)

    def submit(self, client: str, admissions: list[Admission], aborts: list[str]) -> list[RequestOutput | None]:
        """Admit a batch of requests and abort others; one entry per admission: None when it
        was queued, else a finished error output (invalid, queue full, replica unavailable).
        Called by the serving channel's thread of `client`'s connection."""
        replies: list[RequestOutput | None] = []
        for adm in admissions:
            engine = self.engine
            if not self.healthy or engine is None:
                replies.append(RequestOutput(adm.rid, finished=True, finish_reason="error", error_type="unavailable",
                                             error=f"replica {self.name} is unhealthy: {self.unhealthy_reason}"))
                continue
            self.outboxes.own(adm.rid, client)
            try:
                engine.add_request(adm.prompt_ids, adm.params, None, rid=adm.rid, is_embedding=adm.is_embedding,
                                   group=adm.group, resume_ids=adm.resume_ids, kv_source=adm.kv_source,
                                   hand_off=adm.hand_off)
            except Exception as exc:  # the request's own fault, or an internal error: this admission only
                if not isinstance(exc, (RequestError, ValueError)):
                    logger.exception("replica %s: admitting %s failed", self.name, adm.rid)
                self.outboxes.disown(adm.rid)
                replies.append(admission_error(adm.rid, exc))
                continue
            replies.append(None)
        for rid in aborts:  # after the admissions: a request may be admitted and aborted in one batch
            self.abort(rid)
        with self._lock:
            self.counters["submit_calls"] += 1
            self.counters["admitted"] += sum(r is None for r in replies)
        return replies

    def _on_outputs(self, outs: list[RequestOutput]) -> None:
        """The engine's batch sink: one call per step (engine thread), or one per abort/failure."""
        self.outboxes.put(outs)
        # Let a waiting writer thread take the GIL now and send these outputs on, rather than
        # after the engine thread has planned and launched its next step.
        time.sleep(0)

    def abort(self, rid: str) -> None:
        if self.engine is not None:
            self.engine.abort(rid)

    def stats(self) -> dict:
        eng = self.engine
        if eng is None:
            return {"healthy": False, "reason": self.unhealthy_reason}
        return {
            "healthy": self.healthy,
            "reason": self.unhealthy_reason,
            **eng.stats(),
            "restarts": self.restarts,
            "messages": {**self.counters, "output_messages": self.outboxes.output_messages,
                         "output_steps": self.outboxes.output_steps},
            "kvstore": kv_store_stats(eng),  # None without a KV store (cluster/kv_store_setup.py)
        }

    def kv_events(self, epoch: str | None, seq: int) -> dict | None:
        """The prefix cache's events since `seq` of `epoch` (the router's KV index); None
        while the engine is down."""
        return self.engine.kv_events(epoch, seq) if self.engine is not None else None

    def info(self) -> dict:
        return {"name": self.name, "role": self.role, "kv_source": self.kv_source(),
                "tp_size": self.config.tp_size, "group": self.group.describe(),
                "attention": self.group.attention, "model": self.config.model,
                "kv_pages": self.group.num_pages, "page_size": self.config.page_size,
                "kv_cache_dtype": self.config.kv_cache_dtype,
                "max_context_len": self.engine.max_context_len if self.engine else 0,
                "vocab_size": self.engine.model_config.vocab_size if self.engine else 0,
                "is_encoder_decoder": bool(self.engine and self.engine.model_config.is_encoder_decoder),
                "matryoshka_dimensions": self.engine.model_config.matryoshka_dimensions if self.engine else None,
                "embedding_size": self.engine.model_config.hidden_size if self.engine else None,
                "kv_store": self.kv_store()}

    def kv_store(self) -> tuple[str, str | None] | None:
        """The shared KV store's (name, namespace) this replica writes to, or None."""
        off = self.engine.kv_offload if self.engine is not None else None
        return (off.store_name, off.namespace) if off is not None else None

    def kv_source(self):
        """Where decode replicas read the prompts this replica hands off (a KVSource), or None
        when its pages cannot be lent (no KV store on it, or no hand-off rows: a mixed replica of a
        deployment without prefill replicas)."""
        from cluster.engine.kv_store_link import replica_identity
        from workers.kv_messages import KVSource

        ident = replica_identity(self.config)
        if ident is None or self.engine is None or self.engine.kv_offload is None or self.config.pd_buffer_gb <= 0:
            return None
        import ray

        return KVSource(self.name, tuple(f"manta-{self.name}-rank{i}" for i in range(self.config.tp_size)),
                        ray.get_runtime_context().namespace, self.config.tp_size, ident[1], ident[0],
                        self.config.page_size, timeout_s=self.config.pd_transfer_timeout_s)

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.closed = True
        self.healthy, self.unhealthy_reason = False, "shut down"
        if self._listener is not None:
            self._listener.close()
        with self._life:  # a rebuild under way finishes first, and its engine is shut down here
            if self.engine is not None:
                self.engine.fail_all(f"replica {self.name} shut down", close=True)
                self.engine.shutdown()
                self.engine = None
