"""Names of KV pages in the shared store.

A page's *chain key* names the whole prefix that ends with it: a chained sha256 over whole pages
of token ids, seeded with the model fingerprint and the cache layout,

    key_0 = H(root || tokens of page 0),   key_i = H(key_{i-1} || tokens of page i),
    root  = H("manta-kv-v1" | fingerprint | layout),

so two requests share key_i exactly when they share the first i+1 pages and run the same model
with the same cache layout. A partial last page has no key (it is never stored).

A chain key becomes *store keys* per layout (contract 5 of DESIGN.md):

- ``"mha"`` (MHA/GQA): every TP rank holds its own kv-head shard, so every rank stores two keys
  per page, ``f"{chain}-r{rank}-k"`` and ``f"{chain}-r{rank}-v"``: keys_per_page == 2.
- ``"mla"``: the latent is identical on every rank, so a page is one key, ``chain`` itself, no
  rank in it (rank 0 alone writes it, every rank may read it): keys_per_page == 1.

Store keys are only ever these hex hashes: `validate_key` guards every key before it names a
file, so nothing from a request can become a path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

LAYOUTS = ("mha", "mla")
KEY_RE = re.compile(r"^[0-9a-f]{64}(-r\d+-[kv])?$")
_KEY_VERSION = b"manta-kv-v1"
# config.json fields that differ between copies of one checkpoint without changing its KV.
_VOLATILE_CONFIG_FIELDS = ("transformers_version", "_name_or_path", "_commit_hash")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def keys_per_page(layout: str) -> int:
    """Store keys one rank writes per page: 2 for "mha" (K and V), 1 for "mla" (the latent)."""
    return 2 if check_layout(layout) == "mha" else 1


def is_valid_key(key: object) -> bool:
    return isinstance(key, str) and KEY_RE.fullmatch(key) is not None


def validate_key(key: object) -> str:
    """`key` if it is a store key (64 hex digits, optionally -r<rank>-k|v); ValueError otherwise."""
    if not is_valid_key(key):
        raise ValueError(f"not a KV store key: {str(key)[:80]!r}")
    return key  # type: ignore[return-value]


def validate_keys(keys: Sequence[object]) -> list[str]:
    return [validate_key(k) for k in keys]


# ---------------------------------------------------------------------------------------------
# fingerprint


def _canonical_config(config: bytes | str | dict | os.PathLike) -> bytes:
    """config.json content (bytes, a dict, or a path to the file or its directory) as
    canonical JSON without fields that do not change the model."""
    if isinstance(config, dict):
        data = dict(config)
    else:
        if isinstance(config, bytes):
            raw = config
        else:
            path = Path(config)
            raw = (path / "config.json" if path.is_dir() else path).read_bytes()
        data = json.loads(raw)
    for name in _VOLATILE_CONFIG_FIELDS:
        data.pop(name, None)
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def weights_identity(model_dir: str | os.PathLike, cache: str | os.PathLike | None = None) -> str:
    """The identity of a checkpoint's weights: a hash of the whole content of every weight file
    (`*.safetensors`, `*.bin`). Two checkpoints of one architecture have the same config.json,
    and a fine-tune may differ from its base anywhere (past its first MiB: frozen embeddings),
    so nothing less tells their KV apart. Reading the files costs about what loading them does
    (files hashed in parallel); `cache`: a JSON file that keeps each file's digest by path,
    size, mtime and inode, so a restart on the same files reads nothing."""
    files = sorted(p for pattern in ("*.safetensors", "*.bin") for p in Path(model_dir).glob(pattern))
    digests = _file_digests(files, Path(cache) if cache is not None else None)
    h = hashlib.sha256()
    for path, digest in zip(files, digests):
        h.update(path.name.encode() + b"\0" + digest.encode() + b"\0")
    return h.hexdigest()


def _file_digests(files: list[Path], cache: Path | None) -> list[str]:
    from concurrent.futures import ThreadPoolExecutor

    def stamp(path: Path) -> str:
        st = path.stat()
        return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"

    def digest(path: Path) -> str:
        with open(path, "rb") as f:  # (hashlib lets go of the GIL while it hashes a chunk)
            return hashlib.file_digest(f, "sha256").hexdigest()

    known: dict[str, str] = {}
    if cache is not None:
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
    stamps = [stamp(p) for p in files]
    todo = [(i, p) for i, p in enumerate(files) if stamps[i] not in known]
    if todo:
        with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
            for (i, _), d in zip(todo, pool.map(digest, [p for _, p in todo])):
                known[stamps[i]] = d
        if cache is not None:
            try:  # (another process may write it at once: the last whole file wins, both right)
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(known, sort_keys=True))
                os.replace(tmp, cache)
            except OSError:
                pass
    return [known[s] for s in stamps]


def model_fingerprint(
    config: bytes | str | dict | os.PathLike,
    dtype: str,
    page_size: int,
    tp_size: int,
    layout: str,
    weights_id: str = "",
) -> str:
    """sha256 (hex) of what decides the bytes of a page: the model config, the KV dtype, the
    page size and the TP layout of the cache.

    MHA: the tp size is part of it (a rank's head shard depends on it). MLA: the latent does not
    depend on the tp size, so its layout is "replicated" and replicas of any tp share pages.
    `weights_id` tells checkpoints with one config apart (see `weights_identity`); a string
    `config` is a path, pass bytes for the content itself."""
    check_layout(layout)
    if page_size <= 0 or tp_size <= 0:
        raise ValueError(f"page_size {page_size} and tp_size {tp_size} must be positive")
    tp_layout = f"tp{tp_size}" if layout == "mha" else "replicated"
    h = hashlib.sha256(_KEY_VERSION)
    h.update(b"|config|" + _canonical_config(config))
    fields = (
        f"|weights|{weights_id}|dtype|{str(dtype).removeprefix('torch.')}"
        f"|page_size|{page_size}|layout|{layout}|tp|{tp_layout}"
    )
    h.update(fields.encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# chain keys


def root_key(fingerprint: str, layout: str) -> str:
    check_layout(layout)
    return hashlib.sha256(_KEY_VERSION + b"|" + fingerprint.encode() + b"|" + layout.encode()).hexdigest()


def chain_keys(
    token_ids: Sequence[int],
    page_size: int,
    fingerprint: str,
    layout: str,
    parent: str | None = None,
) -> list[str]:
    """Chain keys of the whole pages of `token_ids` (a partial last page gets none).

    parent: the chain key of the page just before token_ids[0], to extend a chain computed
    earlier (token_ids must then start at a page boundary); None starts at the root."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    prev = validate_key(parent) if parent is not None else root_key(fingerprint, layout)
    n = len(token_ids) // page_size
    tokens = np.asarray(token_ids[: n * page_size], dtype="<i8").reshape(n, page_size)
    out: list[str] = []
    for i in range(n):
        h = hashlib.sha256(bytes.fromhex(prev))
        h.update(tokens[i].tobytes())
        prev = h.hexdigest()
        out.append(prev)
    return out


def rank_keys(chain_key: str, layout: str, tp_rank: int) -> list[str]:
    """Store keys of one page for one rank, in the order they are laid out in a page buffer."""
    if check_layout(layout) == "mla":
        return [chain_key]
    return [f"{chain_key}-r{tp_rank}-k", f"{chain_key}-r{tp_rank}-v"]


def chain_of(key: str) -> str:
    """The chain key a store key belongs to (`rank_keys` appends "-r<rank>-k|v" for MHA; an MLA
    key is its chain key)."""
    return key[:64]


def store_keys(chain: Sequence[str], layout: str, tp_rank: int) -> list[str]:
    """Store keys of pages `chain` for one rank, page-major (a page's keys are consecutive)."""
    return [k for c in chain for k in rank_keys(c, layout, tp_rank)]


def replica_keys(chain: Sequence[str], layout: str, tp_size: int) -> list[str]:
    """Store keys every rank of a replica needs, page-major: a page is present for the
    replica when all keys_per_replica_page(layout, tp_size) of its keys are."""
    if check_layout(layout) == "mla":
        return list(chain)
    return [k for c in chain for r in range(tp_size) for k in rank_keys(c, layout, r)]


def keys_per_replica_page(layout: str, tp_size: int) -> int:
    return 1 if check_layout(layout) == "mla" else keys_per_page(layout) * tp_size


def leading_pages(present: Sequence[bool], per_page: int) -> int:
    """Number of leading pages whose `per_page` consecutive keys are all present.

    `per_page` is the denominator contract 5 is about: 1 for an MLA page, 2 for an MHA page of
    one rank (2 * tp for all ranks of a replica). Swapping them halves or doubles the count."""
    if per_page <= 0:
        raise ValueError(f"per_page must be positive, got {per_page}")
    n = 0
    for i in range(len(present) // per_page):
        if not all(present[i * per_page : (i + 1) * per_page]):
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# model tags: whose pages a store holds (a restarted replica warms its host tier with its own)

TAG_RE = re.compile(r"^(?:[0-9a-f]{16})?$")


def model_tag(fingerprint: str) -> str:
    """The store's name for a model (and cache layout): the first 16 hex digits of its
    fingerprint. The store keeps it with every page a client of that model writes (in the
    page file's header too), so a replica started again finds its pages (`KVStore.recent`)."""
    return validate_tag(fingerprint[:16])


def validate_tag(tag: object) -> str:
    """`tag` if it is a model tag ("" is: unknown); ValueError otherwise."""
    if not isinstance(tag, str) or TAG_RE.fullmatch(tag) is None:
        raise ValueError(f"not a model tag: {str(tag)[:40]!r}")
    return tag


def recent_pages(index: dict, lrus: Sequence, tag: str, tp_size: int | None, limit: int) -> list[str]:
    """Chain keys of up to `limit` whole pages in `index` (store key -> an entry with a `tag`
    and a `prompt` flag) of model `tag`: MHA pages of a TP group of `tp_size` (all 2 x tp_size
    keys there), or MLA pages (None: one key, no rank). Pages that hold prompt tokens first (a
    prefix is what the next request asks for), then the others, each by recency of its most
    recent key in the LRU orders `lrus` (each oldest first; the more recent tier first). Every
    rank of a replica gets the same list from the same index, so their host tiers agree."""
    ranked: tuple[list[str], list[str]] = ([], [])
    seen: set[str] = set()
    for lru in lrus:
        for key in reversed(lru):
            chain = chain_of(key)
            if chain in seen or (tp_size is None) != (len(key) == 64):
                continue
            seen.add(chain)
            entry = index.get(key)
            if entry is None or entry.tag != tag:
                continue
            if tp_size is not None and not all(
                    k in index for r in range(tp_size) for k in rank_keys(chain, "mha", r)):
                continue
            ranked[0 if entry.prompt else 1].append(chain)
            if len(ranked[0]) == limit:
                return ranked[0]
    return (ranked[0] + ranked[1])[:limit]
