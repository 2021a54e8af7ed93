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


def _agreement_rank(rank: int, port: int, out_dir: str) -> None:
    """Two ranks warm at their own pace: rank 1 reads "b" a step later and never reads "d"."""
    import json
    import os

    from tests.fixtures import gloo_rank
    from workers.host_warm import WarmAgreement
    from workers.parallel import TPGroup

    with gloo_rank(rank, port, 2):
        tier = HostTier(8, 8, pin=False, log_changes=rank == 0)
        agree = WarmAgreement(TPGroup(rank=rank, size=2), tier)

        def warm(keys: list[str]) -> None:
            tier.publish(keys, tier.take_free(len(keys)), oldest=True, log=False)
            agree.published(keys)

        steps = []
        warm(["a", "b", "c"] if rank == 0 else ["a", "c"])
        steps.append(agree.step(warming=True))
        if rank == 1:
            warm(["b"])
        steps.append(agree.step(warming=True))
        if rank == 0:
            warm(["d"])
        steps.append(agree.step(warming=False))  # both warms ended: "d" is never agreed
        steps.append(agree.step(warming=False))
        logged = tier.take_changes()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"steps": steps, "active": agree.active, "logged": logged}, f)


def test_warmed_pages_are_reported_once_every_rank_holds_them():
    """TP > 1 (real gloo ranks): the first rank reports a warmed page only once every rank's
    tier holds it; one a rank never read is dropped when the warms end; then the agreement
    stops on both ranks in the same step. Warmed pages are not in the tier's own log."""
    import json
    import os
    import tempfile

    import torch.multiprocessing as mp

    from tests.test_llama_model import _free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_agreement_rank, args=(_free_port(), out), nprocs=2, join=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    assert ranks[0]["steps"] == [["a", "c"], ["b"], [], []]
    assert ranks[1]["steps"] == [[], [], [], []]  # only the first rank reports
    assert not ranks[0]["active"] and not ranks[1]["active"]
    assert ranks[0]["logged"] == [[], []]
