"""One batch of pages between a store client's registered memory (its staging area, or host
rows) and the store's DRAM tier: the control call that reserves (write) or locates (read) their
regions, one NIXL transfer (`KVStoreClient._xfer`), and the crc32s that prove each page whole.
The data path of `kvstore.client.KVStoreClient`, whose failure model holds here: every failure
counts an error and reads as a miss, never a raise."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstore.keys import store_keys
from kvstore.messages import LocateReply, ReserveReply
from kvstore.store_link import FAILED
from kvstore.transfer import checksums

if TYPE_CHECKING:
    from kvstore.client import KVStoreClient

logger = logging.getLogger("kvstore.client")


def write_areas(client: KVStoreClient, chain: Sequence[str], sizes: list[list[int]],
                areas: list[np.ndarray] | None = None, prompt: int = 0, tally: list[int] | None = None) -> bool:
    """Send pages from registered memory: page i's keys packed by `sizes[i]` from the start
    of `areas[i]` (default: the staging area, page i at i * page_bytes); pages i < `prompt`
    hold prompt tokens. `tally` ([refused, attempts before]): the pages the store refused
    are added to tally[0] rather than counted (the caller may offer them again), and a
    retry does not count the pages an attempt before it wrote as present."""
    keys = store_keys(chain, client.layout, client.tp_rank)
    staged = areas is None
    areas = client._staged(len(chain)) if staged else areas
    where = [(areas[i], sum(s[:j])) for i, s in enumerate(sizes) for j in range(len(s))]
    flat = [n for s in sizes for n in s]
    reply = client._data_call("reserve", keys, flat)
    if reply is FAILED:
        return False
    assert isinstance(reply, ReserveReply)
    local, remote, sent, views, flags = [], [], [], [], []
    for i, (key, (area, off), loc) in enumerate(zip(keys, where, reply.locs)):
        if loc is None:
            continue
        views.append(area[off : off + loc.size])
        sent.append(key)
        flags.append(i // client.kpp < prompt)
        base = area.ctypes.data
        for addr, n in loc.regions:
            local.append((base + off, n, 0))
            remote.append((addr, n, 0))
            off += n
    if not sent:
        client.link.send("release", reply.lease)
    elif not client._xfer("WRITE", local, remote, staged=staged):
        client.link.send("release", reply.lease)  # frees the reservation
        return False
    else:
        committed = client.link.call("commit", client.name, reply.lease, sent, checksums(views),
                                   *([] if client._tagless else [flags]))
        if committed is FAILED or committed != len(sent):
            if committed is not FAILED:
                client.counters.errors += 1
            return False
    client.counters.bytes_written += sum(n for _, n, _ in local)
    done = {k for k, loc in zip(keys, reply.locs) if loc is not None}
    for p in range(len(chain)):
        page = keys[p * client.kpp : (p + 1) * client.kpp]
        present = reply.present[p * client.kpp : (p + 1) * client.kpp]
        if all(k in done for k in page):
            client.counters.pages_written += 1
        elif all(present):
            client.counters.pages_present += tally is None or not tally[1]
        elif not all(k in done or here for k, here in zip(page, present)):
            if tally is None:
                client.counters.pages_refused += 1
            else:
                tally[0] += 1
    return all(p or loc is not None for p, loc in zip(reply.present, reply.locs))

def read_areas(client: KVStoreClient, chain: Sequence[str], sizes: list[list[int]],
               areas: list[np.ndarray] | None = None) -> int:
    """Read the leading stored pages into registered memory (page i's keys packed by
    `sizes[i]` from the start of `areas[i]`; default: the staging area, page i at
    i * page_bytes); returns how many arrived intact with the expected key sizes."""
    keys = store_keys(chain, client.layout, client.tp_rank)
    staged = areas is None
    areas = client._staged(len(chain)) if staged else areas
    t0 = time.perf_counter()
    reply = client._data_call("locate", keys)
    t1 = time.perf_counter()
    client.counters.read_locate_s += t1 - t0
    if reply is FAILED:
        return 0
    assert isinstance(reply, LocateReply)
    n = len(reply.locs) // client.kpp
    flat = [s for page in sizes[:n] for s in page]
    good = next((i for i, (loc, s) in enumerate(zip(reply.locs, flat)) if loc.size != s), n * client.kpp)
    if good < n * client.kpp:
        logger.warning("kv store client: %s has %d bytes, expected %d", keys[good],
                       reply.locs[good].size, flat[good])
        client.counters.errors += 1
        n = good // client.kpp
    locs = reply.locs[: n * client.kpp]
    local, remote, where = [], [], []
    for i, loc in enumerate(locs):
        page, j = divmod(i, client.kpp)
        off = sum(sizes[page][:j])
        where.append((areas[page], off))
        base = areas[page].ctypes.data
        for addr, size in loc.regions:
            local.append((base + off, size, 0))
            remote.append((addr, size, 0))
            off += size
    ok = not local or client._xfer("READ", local, remote, staged=staged)
    client.link.send("release", reply.lease)
    t2 = time.perf_counter()
    client.counters.read_transfer_s += t2 - t1
    if not ok:
        return 0
    crcs = checksums([area[off : off + loc.size] for loc, (area, off) in zip(locs, where)])
    client.counters.read_verify_s += time.perf_counter() - t2
    for i, (loc, crc) in enumerate(zip(locs, crcs)):
        if crc != loc.checksum:
            logger.warning("kv store client: checksum mismatch on %s", loc.key)
            client.counters.errors += 1
            client.counters.corrupt += 1
            client.link.send("verify", [loc.key])  # the store deletes its copy if it is bad
            n = min(n, i // client.kpp)
            break
    client.counters.bytes_read += sum(loc.size for loc in locs[: n * client.kpp])
    return n

