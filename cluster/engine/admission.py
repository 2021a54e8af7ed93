"""Whether a request can ever run on this engine: the checks the scheduler makes before it
queues one (`Scheduler.add_request`). A request that fails one is refused at once, with the
field at fault named for the HTTP layer's 400, rather than queued to fail later."""

from __future__ import annotations

from cluster.engine import encoder_decoder as encdec
from cluster.engine.request import Request
from workers.request_errors import InvalidRequest


class RequestRejected(InvalidRequest):
    """A request that can never run (too long for the context or the KV cache). `param` names
    the offending field for the HTTP layer."""

    def __init__(self, param: str, message: str):
        super().__init__(message, param)


def rejection(req: Request, *, max_context_len: int, kv_capacity_tokens: int, max_batched_tokens: int,
              chunked: bool, page_size: int) -> RequestRejected | None:
    """Why `req` can never run here (None: it can): an encoder input that does not fit, an
    empty prompt, a prompt that leaves no room in the context or the KV cache for a generated
    token, or one longer than a step computes when prompts are not chunked."""
    n = len(req.prompt_ids)
    if req.encoder_ids is not None:
        problem = encdec.admission_problem(req, max_context_len=max_context_len, max_batched_tokens=max_batched_tokens,
                                           kv_capacity_tokens=kv_capacity_tokens, page_size=page_size)
        if problem is not None:
            return RequestRejected("prompt", problem)
    if n == 0:
        return RequestRejected("prompt", "the prompt is empty")
    # A prompt may fill the context when it is only scored (its prompt logprobs, one token
    # sampled from the whole window and dropped by the server): no token needs a position.
    scored = req.params.max_tokens == 1 and req.params.prompt_logprobs is not None
    if n > max_context_len or n == max_context_len and not (req.is_embedding or scored):
        generated = "" if req.is_embedding else " including at least one generated token"
        return RequestRejected("prompt", f"the prompt has {n} tokens; this model's context is {max_context_len} "
                                         f"tokens{generated}")
    if n + (0 if req.is_embedding else 1) > kv_capacity_tokens:
        return RequestRejected("prompt", f"the prompt has {n} tokens; the KV cache holds {kv_capacity_tokens}")
    if not chunked and n > max_batched_tokens:
        return RequestRejected("prompt", f"the prompt has {n} tokens; with chunked prefill off a step computes at "
                                         f"most {max_batched_tokens}")
    return None
