"""The OpenAI-compatible endpoints' work, behind the HTTP app (`cluster.api.server`): per request,
parse and check the body (`cluster.api.protocol`), tokenize once (the chat template for chat),
build and validate one `SamplingParams` per choice, admit every choice (`Endpoints.open`: every
admission error surfaces there, before a byte of the answer is sent), then merge the choices'
outputs into one JSON body or one SSE stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from cluster.api import protocol as P
from cluster.api import responses as R
from cluster.api.chunks import TextChunks, usage_json
from cluster.api.deadline import RequestTimedOut, stream_within, within
from cluster.api.embeddings import EmbeddingRequest, check_dimensions, embedding_response
from cluster.api.errors import APIError, as_api_error
from cluster.api.logprobs import (
    CompletionOffsets,
    TokenPieces,
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from cluster.api.metrics import ServerMetrics
from cluster.api.reasoning import ReasoningStream, split_reasoning
from cluster.api.shutdown import ShutdownGate
from cluster.api.sse import SSE_DONE, ClientGone, SSEResponse, sse, until_disconnect
from cluster.api.structured import TokenizerSupport
from cluster.api.tool_replies import ToolReplies
from cluster.api.tools import detect_parser
from cluster.engine.client import ChoiceResult, EdgeTiming, FanOut, ServingClient
from cluster.engine.request import RequestOutput
from workers.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)


def usage_counts(choices: list[ChoiceResult], n: int) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens; prompt tokens count once per prompt (choices
    [k*n, (k+1)*n) share prompt k)."""
    firsts = choices[::n]
    return (sum(c.prompt_tokens for c in firsts), sum(c.completion_tokens for c in choices),
            sum(c.cached_tokens for c in firsts))


def usage_of(choices: list[ChoiceResult], n: int) -> R.Usage:
    return R.Usage.of(*usage_counts(choices, n))


class Endpoints:
    def __init__(self, client: ServingClient, metrics: ServerMetrics, gate: ShutdownGate,
                 tool_call_parser: str = "auto", reasoning_parser: str | None = None):
        self.client, self.metrics, self.gate = client, metrics, gate
        # How `tool_choice: auto` outputs are read: a named format, "auto" (the chat template's), or "none".
        self.tool_parser = (detect_parser(getattr(client.tokenizer, "chat_template", None))
                            if tool_call_parser == "auto" else None if tool_call_parser == "none" else tool_call_parser)
        self.reasoning_parser = reasoning_parser  # <think>...</think> -> reasoning_content
        self.created = int(time.time())
        self.pieces = TokenPieces(client.tokenizer)  # each token's own text and bytes (logprobs)
        self.grammars = TokenizerSupport(client.tokenizer)  # can structured outputs run on this model

    # ---------------- request preparation ----------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.client.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"'{self.client.model_name}'", param="model", code="model_not_found")

    def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return list(self.client.tokenizer(prompt).input_ids)
        vocab = self.client.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {vocab})", param=param)
        return list(prompt)

    @property
    def _encoder_decoder(self) -> bool:
        return self.client.is_encoder_decoder

    def default_max_tokens(self, n_prompt: int) -> int:
        """What a request may generate when it names no limit."""
        if self._encoder_decoder:  # the decoder starts from one token, whatever the prompt's length
            return self.client.max_context_len - 1
        return self.client.max_context_len - n_prompt

    def check_context(self, n_prompt: int, max_tokens: int | None, param: str = "max_tokens",
                      prompt_param: str = "prompt", scored: bool = False) -> None:
        """Refuse a request the context cannot hold. `scored`: the prompt is only scored (echo
        with max_tokens 0), and may fill the whole context."""
        limit = self.client.max_context_len
        if self._encoder_decoder:
            # The prompt is the encoder's input; the decoder has positions of its own.
            if n_prompt > limit:
                raise APIError(400, f"This model's encoder takes at most {limit} tokens, but the prompt has "
                               f"{n_prompt} tokens", param=prompt_param, code="context_length_exceeded")
            if max_tokens is not None and 1 + max_tokens > limit:
                raise APIError(400, f"This model's decoder context is {limit} tokens; you requested "
                               f"{max_tokens} tokens to generate after its start token", param=param,
                               code="context_length_exceeded")
            return
        if scored and n_prompt <= limit:
            return
        if n_prompt >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but the prompt "
                           f"has {n_prompt} tokens (at least one token must be generated)",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; you requested "
                           f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} to generate)",
                           param=param, code="context_length_exceeded")

    async def open(self, request: Request, jobs: list[tuple[list[int], SamplingParams]], rid: str,
                   is_embedding: bool = False, n: int = 1, stream: bool = True) -> FanOut:
        """Admit `jobs` (request ids `{rid}-{i}`); `n`: each prompt's choices, consecutive jobs
        that share it (its tokens count once in the metrics, as in the response's usage).
        `stream` False: nothing is sent before the end, so a choice whose replica fails
        mid-generation runs again on another."""
        def finished(out: RequestOutput, edge: EdgeTiming, i: int) -> None:
            self.metrics.observe_finished(out.replica, out, edge, prompt=i % n == 0)

        def first_token(out: RequestOutput, ttft_s: float) -> None:
            if out.embedding is None:  # an embedding has no first token: not a TTFT sample
                self.metrics.observe_first_token(out.replica, ttft_s)

        def token_gap(out: RequestOutput, gap_s: float) -> None:
            self.metrics.observe_token_gap(out.replica, gap_s)

        try:
            fan = await until_disconnect(request, within(request.state, FanOut.open(
                self.client, list(jobs), rid, finished, is_embedding, arrival=request.state.arrival,
                on_first_token=first_token, n=n, restart=not stream, on_token_gap=token_gap)), self.gate)
            self.gate.enter()  # left in close(): the shutdown waits for it, up to its deadline
            return fan
        except (ClientGone, RequestTimedOut) as exc:  # FanOut.open aborted what it had admitted
            self.metrics.record_aborts("client_gone" if isinstance(exc, ClientGone) else "timeout", len(jobs))
            raise

    async def close(self, request: Request, fan: FanOut, client_gone: bool = False) -> None:
        """Close `fan`, aborting its unfinished requests (their KV pages are freed at once), and
        count them in `manta:request_aborts_total` by why they were cut short."""
        if fan.closed:
            return
        unfinished = [(i, c) for i, c in enumerate(fan.choices) if c.finish_reason is None]
        if unfinished:
            reason = ("timeout" if getattr(request.state, "timed_out", False)
                      else "client_gone" if client_gone else "shutdown" if self.gate.stopped.is_set() else "error")
            self.metrics.record_aborts(reason, len(unfinished))
            for i, c in unfinished:
                self.metrics.observe_aborted(c.replica, c.prompt_tokens if i % fan.n == 0 else 0, c.completion_tokens)
        await fan.aclose()
        self.gate.leave()

    async def collect(self, request: Request, fan: FanOut) -> list[ChoiceResult]:
        """Every choice of `fan`, within the deadline and while the client waits; closes `fan`."""
        gone = False
        try:
            return await until_disconnect(request, within(request.state, fan.collect()), self.gate)
        except ClientGone:
            gone = True
            raise
        finally:
            await self.close(request, fan, gone)

    async def answer(self, request: Request, fan: FanOut, stream: bool,
                     events: Callable[[FanOut], AsyncIterator[str]],
                     build: Callable[[list[ChoiceResult]], BaseModel | dict]) -> Response:
        """Stream `events(fan)` as SSE, or collect the choices and return `build(choices)`."""
        if stream:
            return SSEResponse(self._guarded(stream_within(request.state, events(fan))),
                                functools.partial(self.close, request, fan), self.gate)
        body = build(await self.collect(request, fan))
        return Response(body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body),
                        media_type="application/json")

    async def _guarded(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """An error after the stream started is one error event, then [DONE]."""
        try:
            async with contextlib.aclosing(events) as evs:  # type: ignore[type-var]
                async for ev in evs:
                    yield ev
        except Exception as exc:
            err = as_api_error(exc)
            if err.status >= 500 and not isinstance(exc, APIError):
                logger.exception("stream failed")
            self.metrics.record_error(err.status)
            yield sse(err.body())
        yield SSE_DONE

    # ---------------- /v1/completions ----------------
    async def completions(self, request: Request, body: Any) -> Response:
        req = parse_body(P.CompletionRequest, body)
        req.check_supported()
        self.check_model(req.model)
        jobs, texts = [], []
        for prompt in req.prompts():
            full = self.prompt_ids(prompt)
            ids = req.truncate(full)
            # echo returns the prompt the model saw: as given when it is whole text, else decoded
            # (without special tokens, as text given whole shows none of those the tokenizer adds)
            text = prompt if isinstance(prompt, str) and len(ids) == len(full) else None
            for j in range(req.n):
                params = req.sampling_params(seed_offset=j).validate(self.client.vocab_size)
                if "max_tokens" not in req.model_fields_set and len(ids) < self.client.max_context_len:
                    # OpenAI's default of 16, as much of it as the context holds after the prompt
                    params = dataclasses.replace(params, max_tokens=min(params.max_tokens,
                                                                        self.default_max_tokens(len(ids))))
                self.grammars.check(params.structured)
                self.check_context(len(ids), params.max_tokens, scored=req.scores_only)
                jobs.append((ids, params))
                texts.append(text if text is not None else self.client.tokenizer.decode(ids, skip_special_tokens=True))
        cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.client.model_name
        want_lp, scores_only = req.logprobs is not None, req.scores_only
        fan = await self.open(request, jobs, cid, n=req.n, stream=req.stream)

        def echo(i: int, prompt_lps: list | None, offsets: CompletionOffsets) -> tuple[str, R.CompletionLogprobs | None]:
            """The prompt's text and logprobs, for a choice's first chunk when echoing."""
            if not req.echo:
                return "", None
            return texts[i], (echoed_prompt_logprobs(jobs[i][0], prompt_lps, self.pieces, offsets) if want_lp else None)

        def offsets_of(i: int) -> CompletionOffsets:
            return CompletionOffsets(self.pieces.special if jobs[i][1].skip_special_tokens else frozenset())

        def vllm_prompt(i: int, prompt_lps: list | None) -> list | None:
            if req.prompt_logprobs is None:
                return None
            return vllm_prompt_logprobs(jobs[i][0], prompt_lps, self.pieces)

        text_chunk = TextChunks(lambda i, text: R.CompletionChunk(
            id=cid, created=created, model=model, choices=[R.CompletionChoice(index=i, text=text)]).model_dump_json())
        plain = not (scores_only or want_lp)  # most chunks are only text (and usage, if asked)

        async def events(fan: FanOut) -> AsyncIterator[str]:
            offsets = [offsets_of(i) for i in range(len(jobs))]
            started = [False] * len(jobs)
            async for i, out in fan.outputs_ending_in_error():
                if scores_only and not out.finished:
                    out.delta_text, out.delta_token_ids, out.delta_logprobs = "", [], []
                if not (out.delta_text or out.delta_token_ids or out.finished or not started[i]):
                    continue
                if plain and started[i] and not out.finished:
                    yield text_chunk(i, out.delta_text, usage_json(*usage_counts(fan.choices, req.n))
                                     if req.continuous_usage else None)
                    continue
                head, head_lp = echo(i, out.prompt_logprobs, offsets[i]) if not started[i] else ("", None)
                prompt_lp = vllm_prompt(i, out.prompt_logprobs) if not started[i] else None
                started[i] = True
                if scores_only:
                    out.delta_text, out.delta_token_ids, out.delta_logprobs = "", [], []
                lp = None
                if want_lp:
                    lp = completion_logprobs(out.delta_token_ids, out.delta_logprobs, self.pieces, offsets[i])
                    lp = joined(head_lp, lp) if head_lp is not None else lp
                choice = R.CompletionChoice(index=i, text=head + out.delta_text, logprobs=lp, prompt_logprobs=prompt_lp,
                                            finish_reason=out.finish_reason if out.finished else None)
                usage = usage_now() if req.continuous_usage else None
                yield sse(R.CompletionChunk(id=cid, created=created, model=model, choices=[choice], usage=usage))
            if req.include_usage:
                yield sse(R.CompletionChunk(id=cid, created=created, model=model, choices=[], usage=usage_now()))

        def usage_now() -> R.Usage:
            """Scoring a prompt generates nothing the client sees: the engine's one dropped token is
            not counted (as in the non-streamed answer)."""
            u = usage_of(fan.choices, req.n)
            return R.Usage.of(u.prompt_tokens, 0, u.prompt_tokens_details.cached_tokens) if scores_only else u

        def build(choices: list[ChoiceResult]) -> R.CompletionResponse:
            out = []
            for i, c in enumerate(choices):
                if scores_only:
                    c.text, c.token_ids, c.logprobs, c.completion_tokens = "", [], [], 0
                offsets = offsets_of(i)
                head, head_lp = echo(i, c.prompt_logprobs, offsets)
                lp = completion_logprobs(c.token_ids, c.logprobs, self.pieces, offsets) if want_lp else None
                if lp is not None and head_lp is not None:
                    lp = joined(head_lp, lp)
                out.append(R.CompletionChoice(index=i, text=head + c.text, logprobs=lp, finish_reason=c.finish_reason,
                                              prompt_logprobs=vllm_prompt(i, c.prompt_logprobs)))
            return R.CompletionResponse(id=cid, created=created, model=model, choices=out,
                                        usage=usage_of(choices, req.n))

        return await self.answer(request, fan, req.stream, events, build)

    # ---------------- /v1/chat/completions ----------------
    async def chat(self, request: Request, body: Any) -> Response:
        req = parse_body(P.ChatCompletionRequest, body)
        req.check_supported()
        self.check_model(req.model)
        ids = req.truncate(P.render_chat(self.client.tokenizer, req.chat_dicts(), req.template_tools()))
        tools = ToolReplies(req, self.tool_parser)
        requested = req.requested_max_tokens()
        self.check_context(len(ids), None, prompt_param="messages")
        max_tokens = requested if requested is not None else self.default_max_tokens(len(ids))
        jobs = []
        for j in range(req.n):
            try:
                params = req.sampling_params(max_tokens, seed_offset=j).validate(self.client.vocab_size)
                self.grammars.check(params.structured)
            except SamplingParamsError as exc:
                renamed = {"max_tokens": req.max_tokens_param, "logprobs": "top_logprobs"}.get(exc.param)
                if renamed is None:
                    raise
                raise SamplingParamsError(renamed, str(exc).split(": ", 1)[-1]) from None
            jobs.append((ids, params))
        self.check_context(len(ids), max_tokens, req.max_tokens_param, "messages")
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.client.model_name
        fan = await self.open(request, jobs, cid, n=req.n, stream=req.stream)

        def chunk(choices: list[R.ChatChunkChoice], usage: R.Usage | None = None) -> str:
            return sse(R.ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, usage=usage))

        text_chunk = TextChunks(lambda i, text: R.ChatCompletionChunk(
            id=cid, created=created, model=model,
            choices=[R.ChatChunkChoice(index=i, delta=R.DeltaMessage(content=text))]).model_dump_json())
        plain = not (tools.active or self.reasoning_parser or req.logprobs)

        async def events(fan: FanOut) -> AsyncIterator[str]:
            for i in range(len(jobs)):
                yield chunk([R.ChatChunkChoice(index=i, delta=R.DeltaMessage(role="assistant", content=""))])
            streams = [tools.stream() for _ in jobs] if tools.active else None
            thinking = [ReasoningStream(self.reasoning_parser) for _ in jobs] if self.reasoning_parser else None
            async for i, out in fan.outputs_ending_in_error():
                if not (out.delta_text or out.delta_token_ids or out.finished):
                    continue
                if plain and not out.finished:  # most chunks are only text (and usage, if asked)
                    yield text_chunk(i, out.delta_text, usage_json(*usage_counts(fan.choices, req.n))
                                     if req.continuous_usage else None)
                    continue
                lp = chat_logprobs(out.delta_token_ids, out.delta_logprobs, self.pieces) if req.logprobs else None
                reason = out.finish_reason if out.finished else None
                thought, text = thinking[i].step(out.delta_text, out.finished) if thinking else ("", out.delta_text)
                delta: R.DeltaMessage | None = None
                if streams is not None:  # tool calls: content until a call may start, the calls at the end
                    delta, reason = streams[i].step(text, out.finished, out.finish_reason)
                elif text or thinking is None:
                    delta = R.DeltaMessage(content=text)
                if thought:
                    delta = (delta or R.DeltaMessage()).model_copy(update={"reasoning_content": thought})
                if delta is None and lp is None and not out.finished:
                    continue
                yield chunk([R.ChatChunkChoice(index=i, delta=delta or R.DeltaMessage(), logprobs=lp,
                                               finish_reason=reason)],
                            usage_of(fan.choices, req.n) if req.continuous_usage else None)
            if req.include_usage:
                yield chunk([], usage_of(fan.choices, req.n))

        def build(choices: list[ChoiceResult]) -> R.ChatCompletionResponse:
            out = []
            for i, c in enumerate(choices):
                thought, text = split_reasoning(self.reasoning_parser, c.text)
                message, reason = tools.message(text, c.finish_reason)
                message.reasoning_content = thought
                out.append(R.ChatChoice(index=i, message=message, finish_reason=reason,
                                        logprobs=chat_logprobs(c.token_ids, c.logprobs, self.pieces) if req.logprobs
                                        else None))
            prompt_lp = (vllm_prompt_logprobs(ids, choices[0].prompt_logprobs, self.pieces)
                         if req.prompt_logprobs is not None else None)
            return R.ChatCompletionResponse(id=cid, created=created, model=model, choices=out,
                                            usage=usage_of(choices, req.n), prompt_logprobs=prompt_lp)

        return await self.answer(request, fan, req.stream, events, build)

    # ---------------- /v1/embeddings ----------------
    async def embeddings(self, request: Request, body: Any) -> Response:
        """One embedding request per input (prefill only, pooled on the ranks)."""
        req = parse_body(EmbeddingRequest, body)
        self.check_model(req.model)
        limit, jobs = self.client.max_context_len, []
        matryoshka, size = self.client.matryoshka_dimensions, self.client.embedding_size
        if req.dimensions is not None and size is not None:  # refused before anything is computed
            check_dimensions(req.dimensions, size, matryoshka)
        params = SamplingParams(max_tokens=1).validate(self.client.vocab_size)
        for i, ids in enumerate(self.prompt_ids(x, param="input") for x in req.inputs()):
            if len(ids) > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens, but input {i} "
                               f"has {len(ids)} tokens", param="input", code="context_length_exceeded")
            jobs.append((ids, params))
        fan = await self.open(request, jobs, f"embd-{uuid.uuid4().hex}", is_embedding=True)
        choices = await self.collect(request, fan)
        out = embedding_response(req, choices, self.client.model_name, matryoshka)
        return Response(out.model_dump_json(), media_type="application/json")

    # ---------------- /generate (native) ----------------
    async def generate(self, request: Request, body: Any) -> Response:
        req = parse_body(P.GenerateRequest, body)
        try:
            params = req.params().validate(self.client.vocab_size)
        except SamplingParamsError as exc:
            if exc.param.startswith("sampling_params."):
                raise
            raise SamplingParamsError(f"sampling_params.{exc.param}", str(exc).split(": ", 1)[-1]) from None
        except TypeError as exc:  # a sampling_params value of a type SamplingParams cannot take
            raise APIError(400, f"invalid sampling_params: {exc}", param="sampling_params") from None
        self.grammars.check(params.structured)
        ids = self.prompt_ids(req.prompt())
        self.check_context(len(ids), params.max_tokens, "sampling_params.max_tokens")
        rid = req.rid or f"gen-{uuid.uuid4().hex}"
        fan = await self.open(request, [(ids, params)], rid, stream=req.stream)

        def meta(c: ChoiceResult, finish_reason: str | None) -> dict:
            m = {"id": rid, "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                 "cached_tokens": c.cached_tokens, "finish_reason": finish_reason}
            if params.logprobs is not None:
                m["output_token_logprobs"] = [[lp.token_logprob if lp else None, t]
                                              for t, lp in zip(c.token_ids, c.logprobs)]
            return m

        async def events(fan: FanOut) -> AsyncIterator[str]:
            async for _, out in fan.outputs_ending_in_error():
                if out.delta_text or out.delta_token_ids or out.finished:
                    yield sse({"text": out.delta_text, "output_ids": out.delta_token_ids,
                                "meta_info": meta(fan.choices[0], out.finish_reason if out.finished else None)})

        def build(choices: list[ChoiceResult]) -> dict:
            c = choices[0]
            return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta(c, c.finish_reason)}

        return await self.answer(request, fan, req.stream, events, build)


def parse_body(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return model.model_validate(body)  # ValidationError -> 400 naming the field (as_api_error)
