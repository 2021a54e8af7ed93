"""The staging areas of a rank's store client (`kvstore.client.KVStoreClient`): one registered
host buffer split into areas, each held by one data-path call (and its thread) at a time, so
several transfers run at once without sharing bytes."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


def serialized(method):
    """A data-path call holds one of the client's staging areas for its duration: up to
    `staging_slots` calls run at once (from different threads), each in its own area."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if getattr(self._tls, "stage", None) is not None:  # nested: already holds an area
            return method(self, *args, **kwargs)
        stage = self._free.get()
        self._tls.stage = stage
        errors = self.counters.errors
        try:
            return method(self, *args, **kwargs)
        finally:
            self._tls.stage = None
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
