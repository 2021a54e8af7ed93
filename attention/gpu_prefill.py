"""Ragged prefill (extend) over the paged cache on GPU, and flash-attn's paged decode.

Semantics are those of `attention.torch_ops.paged_extend_sdpa`: request i has q_lens[i] new
queries, the *last* q_lens[i] positions of its kv_lens[i] cached keys (slots
token_table[i, :kv_lens[i]]), and a causal mask is bottom-right aligned: query r sees keys
0 .. kv_lens[i] - q_lens[i] + r.

Implementations, best first (`select_prefill` picks one per process at start-up):
- "triton_varlen" (Hopper GPUs, unless the `triton_prefill` kernel option is off; calls it does
  not take, `triton_varlen.takes`: head dims other than 128, go to what would run without it):
  `attention.triton_varlen.varlen_attention` on K/V gathered into ragged tensors, which an
  H200 ran 1.3-1.5x faster than ATen's FlashAttention at the 8B model's prompt shapes
  (BENCHMARKS.md); on other GPUs it is unmeasured, and the list below applies;
- "flash_attn": `flash_attn.flash_attn_varlen_func` on K/V gathered into ragged tensors
  (its causal mask is bottom-right aligned since flash-attn 2.1);
- "torch_varlen": `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, ATen's FlashAttention)
  on the same gathered K/V. Its signature changed between releases (is_causal -> window_size,
  enable_gqa added), so `_torch_varlen` adapts to the installed one, and `select_prefill` runs
  a two-token probe to confirm that its causal mask is bottom-right aligned for q_len < k_len
  before choosing it. Where a probe passes (`aten_flash_ok`), the ATen op under the wrapper is
  called directly instead, on GQA K/V and a strided q as they are (`_aten_flash`);
- "triton": `paged_extend_triton` below, which reads K/V straight from the paged cache
  (any dtype, any head dims, GQA);
- "sdpa": `torch_ops.paged_extend_sdpa`, one SDPA call per request.
The varlen paths need fp16/bf16, equal q/k and v head dims and head dim <= 256; other
calls go to the Triton kernel.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention import kernel_options, torch_ops, triton_varlen
from attention.triton_decode import LOG2E, compute_dtype, dot_precision, paged_decode

logger = logging.getLogger(__name__)

PREFILL_IMPLS = ("triton_varlen", "flash_attn", "torch_varlen", "triton", "sdpa")

# flash-attn 2's paged KV cache wants pages of a multiple of 256 tokens
# ("Paged KV cache block size must be divisible by 256"); smaller pages use Triton decode.
FLASH_ATTN_PAGE_MULTIPLE = 256


# ---------------------------------------------------------------------------------------------
# Availability
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except Exception:  # ImportError, or a wheel built for another torch/CUDA
        return False
    return True


@functools.lru_cache(maxsize=1)
def _torch_varlen_params() -> frozenset[str] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def torch_varlen_available() -> bool:
    return _torch_varlen_params() is not None


def flash_shapes_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, widen: bool = False) -> bool:
    """Whether both FlashAttention paths take these shapes and dtypes. `widen`: the caller
    gathers K/V and widens an FP8 cache to q's dtype (the prefill does; flash-attn's paged
    decode reads the cache as it is)."""
    d, dv = q.shape[-1], v_cache.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and (k_cache.dtype == q.dtype or widen and k_cache.dtype == torch.float8_e4m3fn)
        and d == dv == k_cache.shape[-1]
        and d <= 256
        and d % 8 == 0
        and q.shape[1] % k_cache.shape[1] == 0
    )


# ---------------------------------------------------------------------------------------------
# Ragged gather (shared by the two FlashAttention paths)
# ---------------------------------------------------------------------------------------------


@dataclass
class RaggedPlan:
    """Device tensors describing one extend batch, built once per step and reused by every
    layer (the token table and the lengths are the same for all layers of a step)."""

    cu_q: torch.Tensor  # [B+1] int32
    cu_k: torch.Tensor  # [B+1] int32
    q_lens: torch.Tensor  # [B] int32
    kv_lens: torch.Tensor  # [B] int32
    kv_slots: torch.Tensor  # [sum(kv_lens)] int64, requests concatenated in batch order
    max_q: int
    max_k: int


def build_ragged_plan(token_table: torch.Tensor, q_lens: list[int], kv_lens: list[int]) -> RaggedPlan:
    """No host sync: the totals come from the host lists, one small host-to-device copy."""
    device = token_table.device
    batch = len(q_lens)
    host = torch.zeros(4, batch + 1, dtype=torch.int32)
    host[0, 1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    host[1, 1:] = torch.tensor(kv_lens, dtype=torch.int32).cumsum(0)
    host[2, :batch] = torch.tensor(q_lens, dtype=torch.int32)
    host[3, :batch] = torch.tensor(kv_lens, dtype=torch.int32)
    dev = host.to(device, non_blocking=True)
    total_k = int(host[1, -1])
    kv_lens_dev = dev[3, :batch]
    rows = torch.repeat_interleave(torch.arange(batch, device=device), kv_lens_dev.long(), output_size=total_k)
    cols = torch.arange(total_k, device=device) - dev[1, :batch].long()[rows]
    return RaggedPlan(
        cu_q=dev[0],
        cu_k=dev[1],
        q_lens=dev[2, :batch],
        kv_lens=kv_lens_dev,
        kv_slots=token_table[rows, cols].long(),
        max_q=max(q_lens, default=0),
        max_k=max(kv_lens, default=0),
    )


class _PlanCache:
    """One-entry memo of the current step's RaggedPlan. Holds a reference to the token table it
    was built from, so identity safely says "same step" (the table cannot be freed and its
    address reused while we hold it; metadata tables are never written in place). Inference
    tensors have no version counter, so identity and the lengths are the whole key."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._table: torch.Tensor | None = None
        self._plan: RaggedPlan | None = None

    def get(self, token_table: torch.Tensor, q_lens: list[int], kv_lens: list[int]) -> RaggedPlan:
        key = (tuple(q_lens), tuple(kv_lens))
        if self._table is not token_table or self._key != key or self._plan is None:
            self._plan = build_ragged_plan(token_table, q_lens, kv_lens)
            self._table, self._key = token_table, key
        return self._plan


# ---------------------------------------------------------------------------------------------
# FlashAttention paths
# ---------------------------------------------------------------------------------------------


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling, causal) -> torch.Tensor:
    """varlen_attn across its signatures: window_size=(-1, 0) or is_causal for causal; scale
    when it takes one (else q is pre-scaled); enable_gqa when it has it (else K/V heads are
    repeated)."""
    from torch.nn.attention.varlen import varlen_attn

    params = _torch_varlen_params() or frozenset()
    kwargs: dict = {}
    if causal:
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        elif "is_causal" in params:
            kwargs["is_causal"] = True
        else:
            raise RuntimeError("this torch's varlen_attn has no causal mask")
    if "scale" in params:
        kwargs["scale"] = scaling
    else:
        q = q * (scaling * q.shape[-1] ** 0.5)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _aten_flash(q, k, v, cu_q, cu_k, max_q, max_k, scaling, causal) -> torch.Tensor:
    """ATen's FlashAttention forward, which `varlen_attn` wraps, called directly: the kernel
    takes fewer K/V heads than q heads (GQA) and q's rows at a stride (a slice of the fused qkv
    product), where the wrapper of torch 2.10/2.11 insists on equal head counts, so K and V were
    repeated per q head, and q was made contiguous: three copies a layer, 2.1 ms of a
    2,048-token prefill step of the 8B shape on an H200 (BENCHMARKS.md). Used where
    `aten_flash_ok` confirmed it on this device."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                   scale=scaling)[0]


@functools.lru_cache(maxsize=4)
def aten_flash_ok(device: str) -> bool:
    """Probe `_aten_flash` once per device on what the prefill gives it: GQA heads, q a strided
    slice, two requests, each with a cached prefix (q_len < k_len, so the causal mask must be
    bottom-right aligned). False (the wrapper is used) if it fails or differs from the reference."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q_lens, kv_lens, heads, kv_heads, d = [1, 3], [2, 5], 4, 2, 64
        wide = torch.randn(sum(q_lens), heads + 1, d, generator=g).to(device, torch.bfloat16)
        q = wide[:, :heads]
        k = torch.randn(sum(kv_lens), kv_heads, d, generator=g).to(device, torch.bfloat16)
        v = torch.randn(sum(kv_lens), kv_heads, d, generator=g).to(device, torch.bfloat16)
        cu_q = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 2, 7], dtype=torch.int32, device=device)
        got = _aten_flash(q, k, v, cu_q, cu_k, 3, 5, 0.125, True).float()
        table = torch.tensor([[0, 1, 0, 0, 0], [2, 3, 4, 5, 6]], device=device)
        want = torch_ops.paged_attention_ref(q, k, v, table, q_lens, kv_lens, 0.125, True).float()
        return bool(torch.allclose(got, want, atol=2e-2, rtol=0))
    except Exception as e:  # noqa: BLE001 - any failure means "use the wrapper"
        logger.info("ATen FlashAttention called directly is not usable here (%s): varlen_attn it is", e)
        return False


def _flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling, causal) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=causal)


class RaggedFlashExtend:
    """extend(q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal) through a
    varlen FlashAttention (`flash_attn` or `torch_varlen`) over gathered K/V; shapes it cannot
    take go to `paged_extend_triton`.

    q: [sum(q_lens), H, D]; k_cache: [slots, Hkv, D]; v_cache: [slots, Hkv, Dv]
    returns [sum(q_lens), H, Dv]."""

    def __init__(self, impl: str, direct: bool | None = None, wide: Callable | None = None):
        """direct (torch_varlen): call `_aten_flash` instead of the wrapper; None: where
        `aten_flash_ok` says so, decided at the first call. wide (triton_varlen): the extend for
        calls `triton_varlen.takes` refuses (default: the Triton paged prefill)."""
        if impl not in ("flash_attn", "torch_varlen", "triton_varlen"):
            raise ValueError(f"not a varlen FlashAttention: {impl!r}")
        self.impl = impl
        self._wide = wide or paged_extend_triton
        self._varlen = {"flash_attn": _flash_attn_varlen, "torch_varlen": _torch_varlen,
                        "triton_varlen": triton_varlen.varlen_attention}[impl]
        self._direct = direct if impl == "torch_varlen" else False
        self._plans = _PlanCache()

    def __call__(self, q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal=True):
        if not flash_shapes_ok(q, k_cache, v_cache, widen=True) or min(kv_lens, default=1) == 0:
            return paged_extend_triton(q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal)
        plan = self._plans.get(token_table, q_lens, kv_lens)
        if self.impl == "triton_varlen" and not triton_varlen.takes(q, k_cache.shape[1], plan.max_k):
            return self._wide(q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal)
        k = k_cache[plan.kv_slots].to(q.dtype)  # (an FP8 cache widened; its scales are the caller's)
        v = v_cache[plan.kv_slots].to(q.dtype)
        if self._direct is None:
            self._direct = aten_flash_ok(str(q.device))
        if self._direct:
            return _aten_flash(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scaling, causal)
        if self.impl != "triton_varlen" and not q.is_contiguous():  # e.g. a slice of a fused qkv
            q = q.contiguous()  # projection (the Triton kernel takes it strided)
        return self._varlen(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scaling, causal)


def flash_attn_decode_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scaling: float,
    page_size: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`flash_attn_with_kvcache` over the paged cache; the arguments of
    `attention.triton_decode.paged_decode`. page_size must be a multiple of
    FLASH_ATTN_PAGE_MULTIPLE (checked by `select_kernels`, which otherwise picks Triton);
    dtypes and head dims flash-attn does not take go to the Triton kernel."""
    from flash_attn import flash_attn_with_kvcache

    if not flash_shapes_ok(q, k_cache, v_cache):
        return paged_decode(q, k_cache, v_cache, page_table, cache_seqlens, scaling, page_size, num_splits, out)

    kc = k_cache.view(-1, page_size, *k_cache.shape[1:])
    vc = v_cache.view(-1, page_size, *v_cache.shape[1:])
    o = flash_attn_with_kvcache(
        q.unsqueeze(1), kc, vc,
        cache_seqlens=cache_seqlens,
        block_table=page_table.to(torch.int32),
        softmax_scale=scaling,
        causal=False,
        num_splits=num_splits or 0,
    ).squeeze(1)
    if out is None:
        return o
    out.copy_(o)
    return out


# ---------------------------------------------------------------------------------------------
# Triton paged prefill
# ---------------------------------------------------------------------------------------------


@triton.jit
def _extend_kernel(
    Q, K, V, Out, TokenTable, CuQ, QLens, KvLens,
    sm_scale_log2,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_tb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Grid (ceil(max_q / BLOCK_M), B, H): BLOCK_M queries of one head of one request."""
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(QLens + b)
    m0 = m_block * BLOCK_M
    if m0 < q_len:
        kv_len = tl.load(KvLens + b)
        q_start = tl.load(CuQ + b)
        kvh = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        mask_dv = offs_dv < V_DIM
        tok = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            Q + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        # Query m sits at key position kv_len - q_len + m (bottom-right alignment).
        q_pos = kv_len - q_len + offs_m
        if CAUSAL:
            hi = tl.minimum(kv_len, kv_len - q_len + m0 + BLOCK_M)
        else:
            hi = kv_len
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        table_row = TokenTable + b * stride_tb
        for n0 in range(0, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slot = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(
                K + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            ).to(q.dtype)  # (an FP8 cache widened; its scales are the caller's)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
            if CAUSAL:
                keep = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            else:
                keep = mask_n[None, :]
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no visible key yet keeps m = -inf; subtract 0 there, not -inf (NaN).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V + slot[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                mask=mask_n[:, None] & mask_dv[None, :],
                other=0.0,
            ).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            Out + tok[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_dv[None, :],
        )


class TritonExtend:
    """extend(...) through `_extend_kernel`, reading K/V straight from the paged cache (no
    gather). Keeps a one-entry memo of the step's length tensors like RaggedFlashExtend."""

    def __init__(self) -> None:
        self._plans = _PlanCache()

    def __call__(self, q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal=True):
        total, heads, head_dim = q.shape
        kv_heads, v_dim = k_cache.shape[1], v_cache.shape[-1]
        out = q.new_empty(total, heads, v_dim)
        if total == 0:
            return out
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or token_table.stride(-1) != 1:
            raise ValueError("paged_extend_triton needs K/V caches and a table with a contiguous last dim")
        q = q.to(compute_dtype(q, k_cache))
        if q.stride(-1) != 1:
            q = q.contiguous()
        plan = self._plans.get(token_table, q_lens, kv_lens)
        block_d = max(16, triton.next_power_of_2(head_dim))
        block_dv = max(16, triton.next_power_of_2(v_dim))
        big = max(block_d, block_dv) > 128 or q.dtype == torch.float32
        block_m, block_n = (64, 32) if big else (64, 64)
        grid = (triton.cdiv(max(plan.max_q, 1), block_m), len(q_lens), heads)
        _extend_kernel[grid](
            q, k_cache, v_cache, out, token_table, plan.cu_q, plan.q_lens, plan.kv_lens,
            scaling * LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1),
            token_table.stride(0),
            GROUP=heads // kv_heads, HEAD_DIM=head_dim, V_DIM=v_dim, CAUSAL=bool(causal),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
            DOT_PREC=dot_precision(q.dtype),
            num_warps=4, num_stages=2,
        )
        return out


_triton_extend = TritonExtend()


def paged_extend_triton(q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal=True):
    """The Triton paged prefill; arguments and result as `paged_extend`."""
    return _triton_extend(q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal)


# ---------------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------------


def torch_varlen_bottom_right(device: torch.device | str) -> bool:
    """Probe: one query over two keys under a causal mask must see both (bottom-right
    alignment); a top-left mask would show it only the first. Also fails (False) when the
    kernel does not run on this device/dtype at all."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(1, 2, 64, generator=g).to(device, torch.bfloat16)
        k = torch.randn(2, 1, 64, generator=g).to(device, torch.bfloat16)
        v = torch.randn(2, 1, 64, generator=g).to(device, torch.bfloat16)
        cu_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 2], dtype=torch.int32, device=device)
        got = _torch_varlen(q, k, v, cu_q, cu_k, 1, 2, 0.125, True).float()
        table = torch.arange(2, device=device)[None, :]
        want = torch_ops.paged_attention_ref(q, k, v, table, [1], [2], 0.125, True).float()
        return bool(torch.allclose(got, want, atol=2e-2, rtol=0))
    except Exception as e:  # noqa: BLE001 - any failure means "do not use it"
        logger.warning("torch varlen_attn probe failed: %s", e)
        return False


def select_prefill(device: str, triton_prefill: bool | None = None) -> tuple[str, Callable]:
    """(name, extend callable) of the best prefill on `device`, decided once per (device,
    `triton_prefill`: the kernel option, this process's unless given)."""
    if triton_prefill is None:
        triton_prefill = kernel_options.current().triton_prefill
    return _select_prefill(device, triton_prefill)


def hopper(device: str) -> bool:
    try:
        return torch.cuda.get_device_capability(torch.device(device)) == (9, 0)
    except Exception:  # noqa: BLE001 - no such device: not one
        return False


@functools.lru_cache(maxsize=8)
def _select_prefill(device: str, triton_prefill: bool) -> tuple[str, Callable]:
    if not device.startswith("cuda"):
        return "sdpa", torch_ops.paged_extend_sdpa
    if triton_prefill and hopper(device):  # (calls it does not take: what would run without it)
        wide_name, wide = select_prefill(device, False)
        dims = "/".join(map(str, triton_varlen.MEASURED_HEAD_DIMS))
        return f"triton_varlen (head dim {dims}; others {wide_name})", RaggedFlashExtend("triton_varlen", wide=wide)
    if flash_attn_available():
        return "flash_attn", RaggedFlashExtend("flash_attn")
    if torch_varlen_available() and torch_varlen_bottom_right(device):
        return "torch_varlen", RaggedFlashExtend("torch_varlen")
    return "triton", TritonExtend()


def paged_extend(q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal=True) -> torch.Tensor:
    """Ragged prefill over the paged cache with the best implementation for q's device.

    q: [sum(q_lens), H, D]; k_cache: [slots, Hkv, D]; v_cache: [slots, Hkv, Dv];
    token_table: [B, >= max(kv_lens)] slots; q_lens/kv_lens: host lists. Returns
    [sum(q_lens), H, Dv] in q's dtype."""
    return select_prefill(str(q.device))[1](q, k_cache, v_cache, token_table, q_lens, kv_lens, scaling, causal)
