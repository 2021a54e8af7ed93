"""A replica: one Ray actor owning an engine loop (tokenizer, scheduler, radix cache) that
drives its TP group of rank actors one step at a time.

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
from collections.abc import AsyncIterator

from cluster.config import EngineConfig
from cluster.engine import Engine, runner_options
from cluster.kv_offload import kv_store_stats
from cluster.request import RequestOutput
from cluster.scheduler import QueueFull, RequestRejected
from workers.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)


def admission_error(rid: str | None, exc: Exception) -> RequestOutput:
    if isinstance(exc, (SamplingParamsError, RequestRejected)):
        etype, param = "invalid_request", exc.param
    elif isinstance(exc, QueueFull):
        etype, param = "queue_full", None
    else:
        etype, param = "internal", None
    return RequestOutput(rid or "", finished=True, finish_reason="error", error=str(exc),
                         error_type=etype, error_param=param)


class Replica:
    """Plain class; `cluster.launch` wraps it with `ray.remote`."""

    def __init__(self, config: EngineConfig, name: str, placement_strategy: str = "PACK",
                 nic: str | None = None, cpus_per_rank: float = 1.0):
        self.config = config
        self.name = name
        self._group_args = dict(placement_strategy=placement_strategy, nic=nic, cpus_per_rank=cpus_per_rank)
        self.healthy = False
        self.unhealthy_reason: str | None = "starting"
        self.engine: Engine | None = None
        self.started_at = time.time()
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        from workers.ray_group import RayWorkerGroup

        group = RayWorkerGroup(runner_options(self.config), self.config.tp_size, name=self.name,
                               **self._group_args)
        self.group = group
        self.engine = Engine(self.config, workers=group)
        self.engine.start()
        self.healthy, self.unhealthy_reason = True, None
        threading.Thread(target=self._monitor, args=(group,), name=f"{self.name}-monitor", daemon=True).start()

    def _monitor(self, group) -> None:
        reason = group.wait_for_death()
        if reason is None or group is not self.group:
            return
        logger.error("replica %s: %s", self.name, reason)
        self.healthy, self.unhealthy_reason = False, reason
        if self.engine is not None:
            self.engine.fail_all(f"replica {self.name} lost a worker: {reason}")
        # Self-heal: tear the group down and build a new one (with backoff between tries).
        for attempt in range(5):
            try:
                self.restart()
                return
            except Exception as exc:
                logger.exception("replica %s: restart %d failed", self.name, attempt + 1)
                self.unhealthy_reason = f"restart failed: {exc}"
                time.sleep(2.0 * (attempt + 1))

    def restart(self) -> bool:
        """Tear the TP group down and build it again (after a rank died)."""
        old = self.engine
        self.healthy, self.unhealthy_reason = False, "restarting"
        self.restarts += 1
        if old is not None:
            old.fail_all(f"replica {self.name} restarting")
            try:
                old.shutdown()
            except Exception:
                logger.exception("shutdown of the old engine failed")
        self._start()
        return True

    # ---------------- serving ----------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, rid: str | None = None,
                       is_embedding: bool = False) -> AsyncIterator[RequestOutput]:
        if not self.healthy or self.engine is None:
            yield RequestOutput(rid or "", finished=True, finish_reason="error", error_type="unavailable",
                                error=f"replica {self.name} is unhealthy: {self.unhealthy_reason}")
            return
        try:
            stream = self.engine.generate_stream(prompt, params, rid=rid, is_embedding=is_embedding)
            async for out in stream:
                out.replica = self.name
                yield out
        except (SamplingParamsError, RequestRejected, QueueFull) as exc:
            yield admission_error(rid, exc)

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
            "kvstore": kv_store_stats(eng),  # None without a KV store (cluster/kv_offload.py)
        }

    def info(self) -> dict:
        return {"name": self.name, "tp_size": self.config.tp_size, "group": self.group.describe(),
                "attention": self.group.attention, "model": self.config.model,
                "kv_pages": self.group.num_pages, "page_size": self.config.page_size,
                "max_context_len": self.engine.max_context_len if self.engine else 0,
                "vocab_size": self.engine.model_config.vocab_size if self.engine else 0,
                "is_encoder_decoder": bool(self.engine and self.engine.model_config.is_encoder_decoder),
                "matryoshka_dimensions": self.engine.model_config.matryoshka_dimensions if self.engine else None,
                "embedding_size": self.engine.model_config.hidden_size if self.engine else None}

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.healthy, self.unhealthy_reason = False, "shut down"
        if self.engine is not None:
            self.engine.fail_all(f"replica {self.name} shut down")
            self.engine.shutdown()
            self.engine = None
