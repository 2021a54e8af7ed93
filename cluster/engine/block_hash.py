"""Chained block hashes of a token sequence: block i's hash names the whole prefix through
block i (`hash((previous, *block))`), so two sequences share block i's hash exactly when they
share that prefix. Python hashes tuples of ints the same in every process (no per-process
seed, unlike str), so a replica and the router agree on them. The router's prefix memory
(`cluster/prefix_tree.py`) and the replicas' KV events (`cluster/engine/kv_events.py`) both
name blocks this way; a partial last block has no hash."""

from __future__ import annotations


def chain_hashes(tokens: list[int] | tuple[int, ...], block: int, parent: int = 0) -> list[int]:
    """Hashes of the whole blocks of `tokens`, chained from `parent` (0: the sequence's start)."""
    out, h = [], parent
    for i in range(0, len(tokens) - len(tokens) % block, block):
        h = hash((h, *tokens[i : i + block]))
        out.append(h)
    return out


def cached_prefix_tokens(tokens: list[int], block: int, held) -> int:
    """Tokens of the longest prefix of `tokens` whose block hashes are all in `held` (any
    container of hashes: a set, a dict, an LRU)."""
    n = 0
    for h in chain_hashes(tokens, block):
        if h not in held:
            break
        n += block
    return n
