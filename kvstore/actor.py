"""The KV store as a named Ray actor: create it (on the head node, restarted by Ray), find it."""

from __future__ import annotations

from kvstore.messages import STORE_NAME
from kvstore.store import KVStore

# A resource Ray gives the head node alone.
HEAD_NODE_RESOURCE = "node:__internal_head__"


def get_or_create_store(root: str, *, name: str = STORE_NAME, namespace: str | None = None,
                        detached: bool = False, **kwargs):
    """The cluster's store actor, created with `kwargs` (KVStore's) if it does not exist yet.

    An existing actor of that name is returned as is (its root and sizes win). Ray restarts it
    whenever its process dies. The actor takes
    no CPU from the scheduler's view (num_cpus=0): it mostly waits on memory copies. It runs on
    the head node (Ray's `node:__internal_head__` resource): losing a worker node, which the
    autoscaler does routinely, then never takes the store and its file tier with it; the head's
    loss ends the cluster anyway."""
    import ray

    cls = ray.remote(KVStore)
    # max_restarts: a store whose process dies (killed, OOM) is started again by Ray under the
    # same name and handle; __init__ rebuilds the index from its files, and each client
    # registers its NIXL agent with the new instance at its next call.
    # max_concurrency: calls run on a few threads (KVStore locks its state and does its file
    # I/O outside the lock), so one client's file reads never queue another's calls.
    return cls.options(name=name, namespace=namespace, get_if_exists=True, num_cpus=0, max_restarts=-1,
                       max_concurrency=8,
                       resources={HEAD_NODE_RESOURCE: 0.001},
                       lifetime="detached" if detached else None).remote(root, **kwargs)


def in_ray_cluster() -> bool:
    """Whether this process is part of a Ray cluster (and so can reach a store actor)."""
    import ray

    return ray.is_initialized()


def lookup_store(name: str = STORE_NAME, namespace: str | None = None):
    """The named store actor's handle, or None when there is none."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
