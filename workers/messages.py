"""The two messages between a replica's scheduler and its TP workers.

`StepPlan` says what to run this step; `StepResult` says what came back (from rank 0). They
are plain picklable dataclasses of Python ints and lists: they cross Ray actor boundaries (or
a multiprocessing pipe) once per step, and the scheduler never reaches into a worker's objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.forward_batch import ForwardMode
from workers.kv_messages import KVLoad, KVPrefetch, KVSave
from workers.sampling_params import SamplingParams


@dataclass
class NewRequest:
    """Sent once when a request enters (or, after preemption, re-enters) the running batch."""

    rid: str
    sampling: SamplingParams
    prompt_ids: list[int]  # for the repetition penalty
    output_ids: list[int] = field(default_factory=list)  # generated before a preemption
    is_embedding: bool = False
    # Encoder-decoder: the encoder input, run once in the step that admits the request (its
    # K/V go to the encoder slots the plan's table write puts at columns 0..len-1 of its row).
    encoder_ids: list[int] | None = None


@dataclass
class ScheduledReq:
    """One request's share of this step, in batch order."""

    rid: str
    req_pool_idx: int
    input_ids: list[int]  # tokens computed this step (1 for decode)
    prefix_len: int  # tokens of this request already in the KV cache before this step
    out_cache_loc: list[int]  # KV slot of each input token; also req_to_token[row, prefix_len:]
    sample: bool = True  # False for a prefill chunk that is not the prompt's last
    # Encoder-decoder: encoder tokens cached at the start of the row; the decoder's token t is at
    # column round_up(encoder_len, page_size) + t (prefix_len and positions count decoder tokens).
    encoder_len: int = 0


@dataclass
class StepPlan:
    step_id: int
    mode: ForwardMode
    reqs: list[ScheduledReq]
    new_requests: list[NewRequest] = field(default_factory=list)
    # Requests whose worker-side state is dropped before this step (finished, aborted,
    # preempted). Their KV slots are already back in the scheduler's free lists.
    finished_rids: list[str] = field(default_factory=list)
    # (row, start, slots): req_to_token rows to fill before the forward (cached prefixes of
    # newly admitted requests; slots of the new tokens are written from out_cache_loc).
    table_writes: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # KV store orders (workers/kv_messages.py), run at the start of the step in this order.
    kv_saves: list[KVSave] = field(default_factory=list)
    kv_prefetch: list[KVPrefetch] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)


@dataclass
class OverlapCall:
    """Overlapped execution on a rank process (`workers.group.RemoteOverlap`): with a plan,
    launch it and return the result that became ready (the previous plan's, or None); without
    one, wait for the plan in flight and return its result; `discard` forgets launched plans."""

    plan: StepPlan | None = None
    discard: bool = False


@dataclass
class TokenLogprobs:
    token_logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first
    rank: int = 0  # of the token among the vocabulary (1: the best; 0: not computed)


@dataclass
class StepResult:
    step_id: int
    # One entry per request of the plan with sample=True, in batch order.
    sampled_rids: list[str] = field(default_factory=list)
    next_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Embedding requests: one pooled vector per request, in batch order.
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    # Requests that asked for prompt logprobs: (first prompt position covered, the logprob of
    # each prompt token from there, given the tokens before it) for this step's piece.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Seconds the worker spent in this step (forward + sample), for overhead accounting.
    compute_s: float = 0.0
    # KV store: pages each KVLoad put into the device pool (agreed by all ranks), by rid; and
    # each running prefetch's progress, agreed by all ranks: rid -> (pages every rank holds,
    # whether every rank's read has ended).
    kv_loaded: dict[str, int] = field(default_factory=dict)
    kv_prefetched: dict[str, tuple[int, bool]] = field(default_factory=dict)
    # The first rank's host tier since the last result: chain keys now ready, keys evicted
    # (the scheduler's picture of it: `cluster.engine.kv_offload`, admissions that load from it).
    kv_host_ready: list[str] = field(default_factory=list)
    kv_host_evicted: list[str] = field(default_factory=list)
    kv_host_warming: bool = False  # the first rank still warms its host tier (workers/host_warm.py)
