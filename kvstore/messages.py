"""What the KV store and its clients exchange: the store's name, page locations, and the
replies of `reserve` and `locate` (light: no Ray, no NIXL; the engine imports the name)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

STORE_NAME = "manta-kvstore"


def page_checksum(*buffers) -> int:
    """crc32 of the concatenated buffers (a page may span several slots)."""
    crc = 0
    for b in buffers:
        crc = zlib.crc32(b, crc)
    return crc


@dataclass(frozen=True)
class PageLoc:
    key: str
    size: int
    checksum: int  # crc32 of the page; 0 in a reservation (the writer computes it)
    regions: tuple[tuple[int, int], ...]  # (address, bytes) in the store's DRAM, in page order


@dataclass(frozen=True)
class ReserveReply:
    agent: str  # the store's NIXL agent name (the regions are its memory)
    lease: int  # pass to commit()
    present: list[bool]  # key already stored or being written by another client: skip it
    locs: list[PageLoc | None]  # where to write key i; None when present or refused (full)


@dataclass(frozen=True)
class LocateReply:
    agent: str
    lease: int  # release() it after the reads (it also expires after lease_s)
    locs: list[PageLoc]  # the leading requested keys that are present, in order
