"""The tensor-parallel group of one replica, passed explicitly to every parallel layer.

`TPGroup` wraps a torch.distributed process group (gloo on CPU, NCCL on GPU). With tp_size 1
it needs no process group at all and every collective is the identity, so the same model code
runs in-process, in Ray actors, and under torch multiprocessing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (or no group at tp 1)
    # A gloo group beside an NCCL one, for the ranks' small agreements (which KV store pages
    # every rank holds): a CPU collective never waits on the GPU's queue, which under
    # overlapped steps still runs the previous step's forward. None: `group` itself (gloo).
    cpu_group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_min_int(self, value: int) -> int:
        """The minimum of an integer over ranks (e.g. how many store pages every rank has)."""
        return self.all_min_ints([value])[0]

    def all_min_ints(self, values: list[int]) -> list[int]:
        """Element-wise minimum of equally long integer lists over ranks, on the CPU group
        where there is one (no wait on the GPU)."""
        if self.size == 1 or not values:
            return list(values)
        if self.cpu_group is not None:
            t = torch.tensor(values, dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        else:
            t = torch.tensor(values, dtype=torch.int64, device=self._device())
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s x on every rank, in place; returns x."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)

    def _device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's equal shard of `total` (total must divide evenly)."""
    per = divide(total, size)
    return rank * per, (rank + 1) * per


def kv_head_placement(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first kv head, number of kv heads) that `rank` holds.

    tp <= num_kv_heads: heads are split evenly (tp must divide num_kv_heads).
    tp >  num_kv_heads: each rank holds one kv head, replicated over tp / num_kv_heads ranks
    (tp must be a multiple of num_kv_heads)."""
    if tp_size <= num_kv_heads:
        start, end = shard_range(num_kv_heads, rank, tp_size)
        return start, end - start
    replicas = divide(tp_size, num_kv_heads)
    return rank // replicas, 1
