"""Fair sharing of a scheduler's running slots between groups of requests.

The n choices of one HTTP request form a group; every other request is its own. Each group's
share is max_running / the number of groups with running or waiting requests. When a group
below its share waits and no slot is free, the newest requests of the groups furthest over
their share are preempted (at most `FAIR_PREEMPT_PER_STEP` a step; their K/V stays in the
prefix cache), and over-share groups are passed over at admission until the others have their
share (`cluster.engine.scheduler.Scheduler.schedule`).
"""

from __future__ import annotations

import collections

# Requests preempted per step to give waiting groups their fair share of running slots.
FAIR_PREEMPT_PER_STEP = 16


def group_of(req) -> str:
    return req.group or req.rid


def fair_share(sched) -> tuple[int, collections.Counter, set[str]]:
    """(share, running requests per group, groups waiting below their share) for the plan that
    `sched` builds now; preempts over-share requests as the module docstring says."""
    counts: collections.Counter = collections.Counter()
    if not sched.waiting:
        return sched.max_running, counts, set()
    counts.update(group_of(r) for r in sched.running)
    groups = set(counts) | {group_of(r) for r in sched.waiting}
    if len(groups) < 2:
        return sched.max_running, counts, set()
    share = max(1, sched.max_running // len(groups))
    starved = {group_of(r) for r in sched.waiting
               if not r.pending and r.rid not in sched._discard and counts[group_of(r)] < share}
    if starved and not sched._free_rows:
        for _ in range(min(len(starved), FAIR_PREEMPT_PER_STEP)):
            over = max(counts, key=lambda g: counts[g])
            if counts[over] <= share:
                break
            victim = next(r for r in reversed(sched.running) if group_of(r) == over)
            sched._preempt(victim)
            counts[over] -= 1
            sched.stats.fair_preemptions += 1
    return share, counts, starved
