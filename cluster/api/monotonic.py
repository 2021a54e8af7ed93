"""Counters exported from totals that another process reports (a replica's stats, the KV store's)
and that start again from zero when that process does (a replica rebuilds its engine after a
rank died, the store restarts): what was counted before is kept as a base, so the exported
counter only goes down when the server itself restarts."""

from __future__ import annotations


class Monotonic:
    """Totals by key (a family's name and labels, or any hashable). A reported value below the
    last one means the source began again; a restart whose new count passes the old one before
    the next report goes unseen."""

    def __init__(self) -> None:
        self._seen: dict[tuple, tuple[float, float]] = {}  # key -> (base, last reported)

    def total(self, key: tuple, value: float) -> float:
        """The counter to export for `key`, given the source's latest total `value`."""
        base, last = self._seen.get(key, (0.0, 0.0))
        if value < last:
            base += last
        self._seen[key] = (base, value)
        return base + value

    def forget(self, replica: str) -> None:
        """Drop the keys of a departed replica (keys whose labels start with its name)."""
        self._seen = {k: v for k, v in self._seen.items() if not k[1] or k[1][0] != replica}
