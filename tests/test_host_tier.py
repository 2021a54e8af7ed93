"""A rank's host tier (`workers.host_tier.HostTier`): least recently used rows out, pinned rows
kept, and the log of what it holds that the first rank reports to the scheduler."""

from __future__ import annotations

from workers.host_tier import HostTier


def test_eviction_skips_pinned_rows_and_the_log_says_what_it_holds_now():
    tier = HostTier(3, 8, pin=False, log_changes=True)
    rows = tier.take(3)
    tier.publish(["a", "b", "c"], rows)
    assert tier.take_changes() == (["a", "b", "c"], []) and tier.take_changes() == ([], [])
    pinned = tier.leading(["a"])  # "a" is the most recent now, and pinned
    (row,) = tier.take(1)  # evicts "b", the least recently used unpinned key
    assert tier.take_changes() == ([], ["b"])
    tier.publish(["d"], [row])
    (row,) = tier.take(1)  # "c"
    tier.publish(["c"], [row])  # evicted and published again: held, as the log says
    assert tier.take_changes() == (["d", "c"], [])
    tier.unpin(pinned)
    assert [k for k in ("a", "b", "c", "d") if tier.has(k)] == ["a", "c", "d"]


def test_only_the_logging_rank_keeps_a_log():
    tier = HostTier(2, 8, pin=False)
    tier.publish(["a"], tier.take(1))
    assert tier.take_changes() == ([], []) and tier.changes is None


def test_published_at_the_oldest_end_the_first_given_is_evicted_last():
    """A warm's pages (most valuable first) go to the least recently used end, so the
    replica's own pages and the warm's best pages outlast its least valuable ones."""
    tier = HostTier(4, 8, pin=False)
    tier.publish(["a"], tier.take(1))
    tier.publish(["best", "next"], tier.take(2), oldest=True)
    tier.publish(["last"], tier.take(1), oldest=True)
    assert list(tier.ready) == ["last", "next", "best", "a"]
    tier.take(1)  # full: evicts the least recently used
    assert "last" not in tier.ready and tier.has("best") and tier.has("a")
