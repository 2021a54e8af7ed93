"""The staging areas of a rank's store client (`kvstore.client.KVStoreClient`): one registered
host buffer split into areas, each held by one data-path call (and its thread) at a time, so
several transfers run at once without sharing bytes."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger("kvstore.client")


def serialized(method):
    """A data-path call holds one of the client's staging areas for its duration: up to
    `staging_slots` calls run at once (from different threads), each in its own area. A call
    whose READ NIXL could not cancel swaps its area for a new one (`retire`): the area it
    held comes back to the pool once that transfer has ended, checked before each call."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if getattr(self._tls, "stage", None) is not None:  # nested: already holds an area
            return method(self, *args, **kwargs)
        if len(self._unreleased):
            self._unreleased.reap()
        self._tls.stage = self._free.get()
        errors = self.counters.errors
        try:
            return method(self, *args, **kwargs)
        finally:
            stage, self._tls.stage = self._tls.stage, None  # (a retired area was swapped for a new one)
            self._free.put(stage)
            failed = self.counters.errors - errors  # attributed to this call's kind, for the metrics
            if failed > 0:
                if method.__name__ in ("batch_set", "save_pages", "write_rows"):
                    self.counters.write_errors += failed
                else:
                    self.counters.read_errors += failed

    return wrapper


@dataclass(eq=False)
class Stage:
    """One staging area: `staging_pages` page buffers inside the registered buffer."""

    tensor: torch.Tensor
    np: np.ndarray


def retire(client, handles: list) -> None:
    """The calling thread's staging area may still be written by a READ NIXL could not cancel
    (`handles`): it leaves the pool until that READ ends, and the call goes on in a new
    registered area (the pool is one area larger from then on). Reusing it at once could let
    late bytes land after a later call checksummed the area, and reach the KV cache or the store
    with a matching checksum."""
    old = client._tls.stage
    client.counters.stuck_transfers += 1
    try:
        tensor = torch.zeros_like(old.tensor, pin_memory=old.tensor.is_pinned())
        client._extra_regs.append(client.agent.register_memory(tensor))
    except Exception:  # (no memory for it: the area is reused as before, rather than a call raising or waiting)
        logger.exception("kv store client: no new staging area beside one a stuck transfer may still use")
        return
    client._tls.stage = Stage(tensor, tensor.numpy())
    client._unreleased.add(client.agent, handles, functools.partial(client._free.put, old))
