"""The scheduler's side of encoder-decoder requests (BART family): admission checks and the
encoder pages of each request.

A request with `encoder_ids` keeps two page lists: `encoder_pages` (round_up(len, P) / P whole
pages, reserved at admission before any decoder token, holding the cross-attention K/V of every
decoder layer) and its `kv` (decoder tokens, as for any request). The plan writes the encoder
slots at columns 0..len-1 of its req_to_token row; the worker puts decoder token t at column
round_up(len, P) + t (workers/encoder_decoder.py).

Prefix cache: an encoder-decoder request never matches and never inserts. Its decoder K/V
depend on its encoder input, which the radix key (decoder tokens) does not contain, and every
decoder starts from the same start token: two different inputs would share a "prefix". So its
pages are freed, never cached (the engine also turns the prefix cache off for such checkpoints:
`workers.model_config.serving_mode`).

Preemption frees both lists; the request re-enters the queue with its outputs, is admitted
again as a new request (its encoder is recomputed in that step) and its decoder tokens are
recomputed as a prefill, like any preempted request.

The encoder runs whole in the admitting step, so its tokens count against that step's token
budget (`max_num_batched_tokens`), and a request whose encoder input can never fit is refused.
"""

from __future__ import annotations

from cluster.engine.kv_allocator import PageAllocator, slots_for
from cluster.engine.radix_cache import RadixCache
from cluster.engine.request import Request


def encoder_len(req: Request) -> int:
    return len(req.encoder_ids) if req.encoder_ids is not None else 0


def admission_problem(req: Request, *, max_context_len: int, max_batched_tokens: int,
                      kv_capacity_tokens: int, page_size: int) -> str | None:
    """Why an encoder-decoder request can never run (the message of a rejection of its
    prompt), or None."""
    n = encoder_len(req)
    if n == 0:
        return "the prompt (the encoder input) is empty"
    if n > max_context_len:
        return f"the prompt has {n} tokens; this model's encoder takes at most {max_context_len}"
    if n + len(req.prompt_ids) > max_batched_tokens:
        return (f"the prompt has {n} tokens; the encoder runs whole in one step, which computes at most "
                f"{max_batched_tokens} tokens")
    enc_pages = -(-n // page_size)
    dec_pages = -(-(len(req.prompt_ids) + 1) // page_size)
    if (enc_pages + dec_pages) * page_size > kv_capacity_tokens:
        return f"the prompt has {n} tokens; the KV cache holds {kv_capacity_tokens}"
    return None


def reserve_encoder(req: Request, allocator: PageAllocator, radix: RadixCache) -> list[int] | None:
    """Give `req` its encoder pages (evicting unlocked prefix-cache pages if short) and return
    the KV slots of its encoder tokens; None (and nothing taken) when memory is short."""
    n = encoder_len(req)
    need = -(-n // allocator.page_size)
    pages = allocator.alloc(need)
    if pages is None:
        radix.evict(need - allocator.num_free)
        pages = allocator.alloc(need)
        if pages is None:
            return None
    req.encoder_pages = pages
    return slots_for(pages, 0, n, allocator.page_size)


def free_encoder(req: Request, allocator: PageAllocator) -> None:
    allocator.free(req.encoder_pages)
    req.encoder_pages = []


def release(req: Request, allocator: PageAllocator) -> None:
    """Free a finished or preempted encoder-decoder request's pages (none are cached: it
    matched nothing at admission, so it owns every page of its table)."""
    kv = req.kv
    assert kv is not None and kv.num_cached_pages == 0
    allocator.free(kv.pages)
    kv.pages, kv.num_tokens, kv.num_cached_pages = [], 0, 0
    free_encoder(req, allocator)
