"""Every attention kernel against the naive torch reference on randomly permuted paged caches.

Named batch shapes: decode-only, prefill-only, mixed, long-prefix. Tolerance: 2e-5 absolute
in float32 (the kernels differ only in summation order)."""

from __future__ import annotations

import pytest
import torch

from attention import torch_ops

ATOL = 2e-5

SHAPES = {
    # (q_lens, kv_lens)
    "decode_only": ([1, 1, 1, 1, 1], [1, 7, 33, 64, 5]),
    "prefill_only": ([5, 17, 1, 31], [5, 17, 1, 31]),
    "mixed": ([1, 9, 1, 20], [40, 9, 3, 26]),
    "long_prefix": ([3, 2], [300, 129]),
}


def paged_case(q_lens, kv_lens, heads, kv_heads, dim, page_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum((k + page_size - 1) // page_size for k in kv_lens) + 3
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # never page 0
    k_cache = torch.randn(num_pages * page_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_pages * page_size, kv_heads, dim, generator=g)
    width = max(kv_lens)
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    for i, kl in enumerate(kv_lens):
        pages = [perm.pop() for _ in range((kl + page_size - 1) // page_size)]
        for t in range(kl):
            table[i, t] = pages[t // page_size] * page_size + t % page_size
    q = torch.randn(sum(q_lens), heads, dim, generator=g)
    return q, k_cache, v_cache, table


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (6, 2, 24), (7, 1, 40)])
def test_sdpa_extend_matches_reference(shape, page_size, heads, kv_heads, dim):
    q_lens, kv_lens = SHAPES[shape]
    q, kc, vc, table = paged_case(q_lens, kv_lens, heads, kv_heads, dim, page_size)
    scale = dim**-0.5
    ref = torch_ops.paged_attention_ref(q, kc, vc, table, q_lens, kv_lens, scale)
    out = torch_ops.paged_extend_sdpa(q, kc, vc, table, q_lens, kv_lens, scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (6, 2, 24), (7, 1, 40)])
def test_sdpa_decode_matches_reference(page_size, heads, kv_heads, dim):
    q_lens, kv_lens = SHAPES["decode_only"]
    q, kc, vc, table = paged_case(q_lens, kv_lens, heads, kv_heads, dim, page_size, seed=1)
    scale = dim**-0.5
    ref = torch_ops.paged_attention_ref(q, kc, vc, table, q_lens, kv_lens, scale)
    out = torch_ops.paged_decode_sdpa(q, kc, vc, table, torch.tensor(kv_lens), max(kv_lens), scale)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_reference_is_causal_within_the_new_tokens():
    # Perturbing a later key must not change an earlier query's output.
    q, kc, vc, table = paged_case([6], [10], 2, 2, 8, 1, seed=3)
    out1 = torch_ops.paged_attention_ref(q, kc, vc, table, [6], [10], 0.3)
    kc2 = kc.clone()
    kc2[table[0, 9]] += 5.0
    out2 = torch_ops.paged_attention_ref(q, kc2, vc, table, [6], [10], 0.3)
    torch.testing.assert_close(out1[:5], out2[:5])
    assert not torch.allclose(out1[5], out2[5])


def test_ragged_self_table_attends_raw_kv():
    lens = [3, 5, 1]
    cu = torch.tensor([0, 3, 8, 9])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 2, 8, generator=g)
    k = torch.randn(9, 2, 8, generator=g)
    v = torch.randn(9, 2, 8, generator=g)
    table = torch_ops.ragged_self_table(cu, lens)
    out = torch_ops.paged_attention_ref(q, k, v, table, lens, lens, 0.35)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        single = torch_ops.paged_attention_ref(
            q[s:e], k[s:e], v[s:e], torch.arange(e - s)[None], [e - s], [e - s], 0.35
        )
        torch.testing.assert_close(out[s:e], single)
