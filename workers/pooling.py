"""Pooling of an embedding model: how a request's token states become one vector.

The configuration is read once from the checkpoint (`load_pooling_config`):

- A sentence-transformers checkpoint says it in `modules.json`: a `Transformer` module, then a
  `Pooling` module whose `config.json` sets exactly one `pooling_mode_*` flag (cls_token,
  mean_tokens, max_tokens, mean_sqrt_len_tokens, lasttoken), then optionally `Normalize`
  (L2). `sentence_bert_config.json`'s `max_seq_length` caps the context, as
  sentence-transformers truncates there. Other modules (Dense, LayerNorm, ...) and pooling
  options that change the math (`include_prompt: false`, weighted mean, several modes at once)
  are refused at start-up rather than silently dropped.
- Without `modules.json`, per family: an encoder (BERT) pools its [CLS] token, a decoder its
  last token (the only token that has seen the whole input under causal attention); both
  L2-normalise, as OpenAI's embeddings are unit vectors.

Pooling runs on a request's hidden states piece by piece (`PoolingState`): a chunked prefill
hands over each chunk, and the state keeps what the mode needs (a running sum, a running
max, the first or the last row). Every mode but `last` needs the states of every token, so
such a request must be computed from its first token (no prefix-cache hit): the serving mode
(`workers.model_config.serving_mode`) turns the prefix cache off for those models.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len", "last")

# sentence-transformers' Pooling config flag -> our mode.
_ST_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "last",
}
_ST_UNSUPPORTED_FLAGS = ("pooling_mode_weightedmean_tokens",)
_ST_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingConfig:
    mode: str  # one of POOLING_MODES
    normalize: bool  # L2-normalise the pooled vector
    source: str  # where the configuration came from (logged at start-up)
    max_seq_length: int | None = None  # sentence_bert_config.json; None: the model's own limit

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {POOLING_MODES}, not {self.mode!r}")

    @property
    def needs_all_tokens(self) -> bool:
        """True unless the vector depends on the last token's state alone."""
        return self.mode != "last"


def default_pooling(is_encoder: bool) -> PoolingConfig:
    if is_encoder:
        return PoolingConfig("cls", True, "default for encoders (no modules.json)")
    return PoolingConfig("last", True, "default for decoders (no modules.json)")


def _module_kind(entry: dict) -> str:
    # "sentence_transformers.models.Pooling" (and the newer ".pooling.Pooling") -> "Pooling"
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def _read_json(path: str) -> dict | list:
    with open(path) as f:
        return json.load(f)


def _st_pooling_mode(cfg: dict, where: str) -> str:
    for flag in _ST_UNSUPPORTED_FLAGS:
        if cfg.get(flag):
            raise ValueError(f"{where}: {flag} is not supported")
    if cfg.get("include_prompt", True) is False:
        raise ValueError(f"{where}: include_prompt=false (pooling that skips a prompt) is not supported")
    modes = [mode for flag, mode in _ST_FLAGS.items() if cfg.get(flag)]
    if len(modes) != 1:
        raise ValueError(f"{where}: exactly one pooling mode must be set, found {modes or 'none'}")
    return modes[0]


def load_pooling_config(model_dir: str, is_encoder: bool) -> PoolingConfig:
    """The checkpoint's pooling (see the module docstring). Raises ValueError for a
    sentence-transformers pipeline this engine cannot reproduce exactly."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return default_pooling(is_encoder)
    modules = sorted(_read_json(modules_path), key=lambda m: int(m.get("idx", 0)))
    kinds = [_module_kind(m) for m in modules]
    unknown = [k for k in kinds if k not in _ST_KNOWN_MODULES]
    if unknown:
        raise ValueError(f"{modules_path}: sentence-transformers modules {unknown} are not supported "
                         f"(only {', '.join(_ST_KNOWN_MODULES)})")
    if kinds[:2] != ["Transformer", "Pooling"] or kinds[2:] not in ([], ["Normalize"]):
        raise ValueError(f"{modules_path}: expected Transformer, Pooling[, Normalize], found {kinds}")
    pool_dir = os.path.join(model_dir, modules[1].get("path") or "")
    pool_cfg_path = os.path.join(pool_dir, "config.json")
    mode = _st_pooling_mode(_read_json(pool_cfg_path), pool_cfg_path)
    max_len = None
    sbert_path = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(sbert_path):
        value = _read_json(sbert_path).get("max_seq_length")
        max_len = int(value) if value else None
    return PoolingConfig(mode, kinds[-1] == "Normalize", f"sentence-transformers ({modules_path})", max_len)


class PoolingState:
    """What one request's pooling has accumulated so far. Feed every piece of the prompt in
    order (`add`); `done` once the last prompt token was added; then `result()`.

    The accumulators are float32 whatever the model's dtype."""

    def __init__(self, config: PoolingConfig, prompt_len: int):
        self.config = config
        self.prompt_len = prompt_len
        self.seen = 0  # prompt tokens pooled so far (or skipped over by a cached prefix: mode last)
        self.acc: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.seen >= self.prompt_len

    def add(self, hidden: torch.Tensor, start: int) -> None:
        """hidden: [n, H], the states of prompt tokens start .. start + n - 1."""
        mode = self.config.mode
        if start != self.seen and (mode != "last" or start < self.seen):
            # A cached prefix (or a repeated piece) would leave tokens out of the pool.
            raise RuntimeError(f"pooling {mode!r} got tokens from {start}, expected {self.seen}")
        h = hidden.float()
        if mode == "last":
            self.acc = h[-1]
        elif mode == "cls":
            if start == 0:
                self.acc = h[0]
        elif mode == "max":
            m = h.max(dim=0).values
            self.acc = m if self.acc is None else torch.maximum(self.acc, m)
        else:  # mean, mean_sqrt_len
            s = h.sum(dim=0)
            self.acc = s if self.acc is None else self.acc + s
        self.seen = start + hidden.shape[0]

    def result(self) -> torch.Tensor:
        """The pooled vector [H] (float32)."""
        assert self.done and self.acc is not None, "pool every prompt token first"
        v = self.acc
        if self.config.mode == "mean":
            v = v / self.prompt_len
        elif self.config.mode == "mean_sqrt_len":
            v = v / math.sqrt(self.prompt_len)
        return F.normalize(v, p=2, dim=-1) if self.config.normalize else v


def pool(hidden: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """Pool one whole sequence: hidden [T, H] -> [H] (float32)."""
    state = PoolingState(config, hidden.shape[0])
    state.add(hidden, 0)
    return state.result()
