"""An OpenAI-compatible HTTP server over one :class:`AsyncEngine` (chapter 11).

    python -m enginelib.serve --model smollm2-135m --port 8000

Endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (with
``stream: true`` as server-sent events), ``/health`` and ``/metrics``
(Prometheus). Every connection's request goes into the one engine loop, so
clients share decode steps. ``n`` choices per prompt, a list of prompts (completions)
and ``logprobs`` (``top_logprobs`` in chat) are OpenAI's; so is ``response_format``, which with vLLM's
``guided_*`` and ``structured_outputs`` fields holds the output to a schema, a regex, a choice or a grammar
(:mod:`.guided`). Bad requests get a 4xx in OpenAI's error shape; a
full waiting queue gets a 503 with ``Retry-After``; a request that fails inside
the engine gets a 500 (a stream: an error event, then ``[DONE]``) while the
others go on; a client that disconnects has its request aborted.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from enginelib.config import CompileConfig, EngineConfig, SpeculativeConfig
from enginelib.core.outputs import StreamDelta, TokenLogprob
from enginelib.serve.async_engine import (AsyncEngine, EngineDead, EngineOverloaded, RequestFailed, RequestStream,
                                          refuse_long_text)
from enginelib.serve.guard import Guard, error_object, is_loopback
from enginelib.serve.guided import guided_field
from enginelib.serve.logprobs import chat_logprobs, joined, legacy_logprobs, vllm_prompt_logprobs
from enginelib.serve.metrics import ServerMetrics
from enginelib.serve.protocol import (MAX_N, ApiError, ChatBody, CompletionBody, StreamOptions, _Body, echo,
                                      echoes, logprobs_asked, loads, max_tokens_asked, openapi_schema, param,
                                      prompts_of, sampling_params, validate)

if TYPE_CHECKING:
    import uvicorn

    from enginelib.core.engine import Engine
    from enginelib.model.transformer import Transformer
    from enginelib.serve.engine_core import EngineCoreClient

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt this model's context can hold
DEFAULT_MAX_WAITING = 256
BODY_TIMEOUT = 30.0  # seconds to receive a request's body
DRAIN_FACTOR = 8  # a refused body up to 8x the limit is read and dropped before the 413 (see _parse)


# --- the app -------------------------------------------------------------------------------

def build_app(engine: AsyncEngine, model_name: str, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              api_key: str | None = None, loopback_only: bool = False) -> FastAPI:
    """The HTTP face of ``engine``: every route validates, then streams from the one engine loop.
    ``api_key`` and ``loopback_only`` set the door's checks (:class:`Guard`)."""
    app = FastAPI(title="enginelib", description="An OpenAI-compatible server over enginelib's engine.")
    app.add_middleware(Guard, api_key=api_key, loopback_only=loopback_only,
                       json_paths=frozenset({"/v1/completions", "/v1/chat/completions"}))
    metrics = ServerMetrics(engine)
    context, tokenizer = engine.context_length, engine.tokenizer
    tokenizing = asyncio.Semaphore(1)
    created = int(time.time())
    app.state.engine, app.state.metrics = engine, metrics

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(get_openapi(title=app.title, version=app.version,
                                                            description=app.description, routes=app.routes),
                                                keyed=api_key is not None, vocab_size=engine.vocab_size,
                                                model_name=model_name)
        return app.openapi_schema
    app.openapi = openapi

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """404 (no such route), 405 (wrong method) and the like, in OpenAI's shape rather than FastAPI's."""
        message = {404: f"no route {echo(request.url.path)}: see GET /v1/models, POST /v1/completions and "
                        "POST /v1/chat/completions",
                   405: f"{request.method} is not allowed on {echo(request.url.path)}"}.get(error.status_code,
                                                                                          str(error.detail))
        return ApiError(error.status_code, message, headers=getattr(error, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return ApiError(422, f"the request is malformed: {echo(error.errors()[:1])}").response()

    @app.exception_handler(Exception)
    async def server_error(_: Request, error: Exception) -> JSONResponse:
        """A bug of ours: the client still gets OpenAI's error object (the log has the traceback)."""
        logging.getLogger("enginelib.serve").exception("unhandled error")
        return ApiError(500, f"internal error: {type(error).__name__}").response()

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return ApiError(503, f"the engine loop stopped: {engine.error!r}").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "enginelib",
             "max_model_len": context}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionBody, max_body_bytes)
        return await _answer(request, body, prompts_of(body.prompt), "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatBody, max_body_bytes)
        messages = [m.rendered(f"messages.{i}") for i, m in enumerate(body.messages)]
        try:
            prompt = tokenizer.apply_chat_template(messages)
        except ValueError as error:
            raise ApiError(400, str(error), "messages") from None
        return await _answer(request, body, [prompt], "chat")

    async def _answer(request: Request, body: _Body, prompts: list[str | list[int]], kind: str) -> Response:
        """Choice ``i * n + j`` is sample j of prompt i (as OpenAI and vLLM number them): each a request of its
        own, sampled with ``seed + j`` (as vLLM seeds its child requests). With prefix caching on, the n
        requests of one prompt share its full blocks: the scheduler hashes a block when it schedules the
        tokens that fill it, so the children admitted after the first find its blocks, even in the same step."""
        if body.model != model_name:
            raise ApiError(404, f"the model {echo(body.model)} does not exist here: use {model_name!r} "
                                "(GET /v1/models lists it)", "model", "model_not_found")
        n = 1 if body.n is None else body.n
        if not 1 <= n <= MAX_N:
            raise ApiError(400, f"n={echo(n)}: this server samples 1 to {MAX_N} choices per prompt", "n")
        logprobs = logprobs_asked(body)
        max_tokens = max_tokens_asked(body)
        # Tokenized once, here in the server's process: the engine gets token ids, and never sees a prompt that
        # the checks (in add_request, before anything is queued) refuse. One prompt at a time, in a worker thread
        # (the tokenizer lets go of the interpreter lock): a flood of long prompts takes one core at most and
        # never stalls the event loop's streams. A text far past the context is refused before any tokenizing.
        texts = list(prompts)  # what echo repeats: the text sent, or the token ids' text
        async with tokenizing:
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, str):
                    try:
                        refuse_long_text(prompt, max_tokens or 1, tokenizer, context)
                    except ValueError as error:
                        raise ApiError(400, (f"prompt {i}: " if len(prompts) > 1 else "") + str(error),
                                       param(str(error)) or "prompt") from None
                    prompts[i] = await asyncio.to_thread(tokenizer.encode, prompt)
        params = [sampling_params(body, prompt, context, logprobs) for prompt in prompts]
        request_id = uuid.uuid4().hex
        streams: list[RequestStream] = []
        try:  # all the choices or none: one refused closes (aborts) those already queued
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    streams.append(await engine.add_request(prompt, params[i].sample(j),
                                                            f"{kind}-{request_id}-{i * n + j}"))
        except (ValueError, EngineOverloaded, EngineDead) as error:
            for stream in streams:
                stream.close()
            if isinstance(error, ValueError) and str(error).startswith("structured output"):  # it did not compile
                field = guided_field(body)
                raise ApiError(400, f"{field}: {error}", field) from None
            if isinstance(error, ValueError):  # the prompt: past the context, empty, out of the vocabulary
                where = f"prompt {len(streams) // n}: " if len(prompts) > 1 else ""
                raise ApiError(400, where + str(error), param(str(error)) or "prompt") from None
            raise ApiError(503, str(error), headers={"Retry-After": "1"} if isinstance(error, EngineOverloaded)
                           else None) from None
        echoed = None
        if echoes(body):
            echoed = [(text if isinstance(text, str) else tokenizer.decode(ids), ids)
                      for text, ids in zip(texts, prompts)]
        chunks = _Chunks(kind, model_name, request_id, tokenizer, logprobs is not None, n,
                         sum(len(prompt) for prompt in prompts), echoed, max_tokens == 0,
                         params[0].prompt_logprobs is not None)
        if body.stream:
            options = body.stream_options or StreamOptions()
            return StreamingResponse(_sse(streams, chunks, metrics, bool(options.include_usage),
                                          bool(options.continuous_usage_stats)), media_type="text/event-stream")
        return await _until_disconnected(request, _collect(streams, chunks, metrics))

    return app


async def _parse(request: Request, model: type[_Body], limit: int) -> _Body:
    """Read at most ``limit`` bytes of JSON and validate it: every failure is a 4xx that says what to fix.

    A body over the limit is still read (and dropped), up to ``DRAIN_FACTOR`` times the limit, before
    the 413: answering first and closing with the body unread resets the connection, and the client
    would see a broken pipe instead of our error.
    """
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and declared.isdigit() else 0
    raw, seen = bytearray(), 0

    async def read() -> None:
        nonlocal seen
        async for chunk in request.stream():
            seen += len(chunk)
            if seen <= limit:
                raw.extend(chunk)
            elif seen > DRAIN_FACTOR * limit:
                break
    if size <= DRAIN_FACTOR * limit:
        try:  # a client that sends its body a byte a minute must not hold a connection forever
            await asyncio.wait_for(read(), BODY_TIMEOUT)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT:.0f} s") from None
    if max(size, seen) > limit:
        raise ApiError(413, f"the request body is {max(size, seen)}{'+' if seen > DRAIN_FACTOR * limit else ''} "
                            f"bytes; this server takes at most {limit} (--max-body-bytes)", code="request_too_large")
    return validate(loads(raw), model)


@dataclass
class _Chunks:
    """OpenAI's response objects for one request's choices: whole answers, stream chunks, logprobs and usage."""

    kind: str  # "completion" or "chat"
    model: str
    request_id: str  # what both kinds' ids end in
    tokenizer: Any
    logprobs: bool = False  # the request asked for logprobs
    n: int = 1  # choices per prompt: usage counts each prompt once
    prompt_tokens: int = 0  # of every prompt, each counted once (for usage while streaming)
    echo: list[tuple[str, list[int]]] | None = None  # completions' echo: each prompt's text and token ids
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the one token generated is dropped)
    prompt_logprobs: bool = False  # the choices carry vLLM's prompt_logprobs (asked, or echo with logprobs)
    created: int = field(default_factory=lambda: int(time.time()))

    def _base(self, suffix: str = "") -> dict:
        chat = self.kind == "chat"
        return {"id": ("chatcmpl-" if chat else "cmpl-") + self.request_id,
                "object": ("chat.completion" if chat else "text_completion") + suffix,
                "created": self.created, "model": self.model}

    def whole(self, answers: list[_Answer]) -> dict:
        """The whole answer: choice i is ``answers[i]``; with echo, its prompt comes first (text and logprobs)."""
        choices = []
        for index, answer in enumerate(answers):
            text, items = ("", []) if self.echo_only else ("".join(answer.texts), answer.items)
            if self.kind == "chat":
                logprobs = chat_logprobs(self.tokenizer, items) if self.logprobs else None
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": answer.last.finish_reason})
                continue
            prefix, logprobs, offset = self.echo_part(index, answer.prompt_items)
            if self.logprobs:
                logprobs = joined(logprobs, legacy_logprobs(self.tokenizer, [it.token_id for it in items], items,
                                                            offset)[0])
            extra = ({"prompt_logprobs": vllm_prompt_logprobs(self.tokenizer, answer.prompt_items or [])}
                     if self.prompt_logprobs else {})
            choices.append({"index": index, "text": prefix + text, "logprobs": logprobs,
                            "finish_reason": answer.last.finish_reason, **extra})
        whole = self._base() | {"choices": choices, "usage": self.usage([answer.last for answer in answers])}
        if self.kind == "chat" and self.prompt_logprobs:  # vLLM puts chat's beside the choices (one prompt)
            whole["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, answers[0].prompt_items or [])
        return whole

    def echo_part(self, index: int, prompt_items: list[TokenLogprob | None] | None) -> tuple[str, dict | None, int]:
        """Choice ``index``'s echoed prompt: its text, its legacy logprobs (with logprobs) and the offset after it;
        without echo, nothing."""
        if self.echo is None:
            return "", None, 0
        text, ids = self.echo[index // self.n]
        if not self.logprobs:
            return text, None, 0
        if prompt_items is None or len(prompt_items) != len(ids):
            raise ApiError(500, "the engine returned no prompt logprobs for an echo with logprobs")
        logprobs, offset = legacy_logprobs(self.tokenizer, ids, prompt_items)
        return text, logprobs, offset

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None, role: bool = False,
              logprobs: dict | None = None) -> dict:
        """One stream chunk of choice ``index``."""
        if self.kind == "chat":
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._base(".chunk") | {"choices": [choice]}
        return self._base() | {"choices": [{"index": index, "text": text or "", "logprobs": logprobs,
                                            "finish_reason": finish_reason}]}

    def usage_chunk(self, lasts: list[StreamDelta]) -> dict:
        return self._base(".chunk" if self.kind == "chat" else "") | {"choices": [], "usage": self.usage(lasts)}

    def usage_so_far(self, seen: list[StreamDelta | None]) -> dict:
        """The prompts, and the output tokens of the choices' latest deltas (a choice not yet heard from: none)."""
        prompt = self.prompt_tokens
        completion = sum(d.num_output_tokens for d in seen if d is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage(self, lasts: list[StreamDelta]) -> dict:
        """Each prompt counted once (its n choices share it), every choice's completion tokens."""
        prompt = sum(last.num_prompt_tokens for last in lasts[::self.n])
        completion = sum(last.num_output_tokens for last in lasts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def logprobs_object(self, items: list[TokenLogprob], offset: int = 0) -> tuple[dict, int]:
        """OpenAI's ``logprobs`` of these tokens (chat's, or the legacy completions shape), and the text offset
        after them (completions count ``text_offset`` from the choice's first character, across a stream)."""
        if self.kind == "chat":
            return chat_logprobs(self.tokenizer, items), offset
        return legacy_logprobs(self.tokenizer, [it.token_id for it in items], items, offset)


@dataclass
class _Answer:
    """One choice as it comes in: its text, its tokens' logprobs, its prompt's (from the first delta) and its
    last delta."""

    texts: list[str] = field(default_factory=list)
    items: list[TokenLogprob] = field(default_factory=list)
    prompt_items: list[TokenLogprob | None] | None = None
    last: StreamDelta | None = None

    def add(self, delta: StreamDelta) -> None:
        self.texts.append(delta.text)
        self.items.extend(delta.logprobs or [])
        if delta.prompt_logprobs is not None:
            self.prompt_items = delta.prompt_logprobs


def _sse_line(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


class _Merged:
    """Several choices' streams as one async iterator of ``(choice index, delta)``, in the order they come;
    the first failure raises. ``close()`` aborts every unfinished choice."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams, self.left = streams, len(streams)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                self.queue.put_nowait((index, delta))
        except Exception as error:  # noqa: BLE001 - raised in the reader: a pump that died silently would hang it
            self.queue.put_nowait((index, error))
        self.queue.put_nowait((index, None))  # this choice is done

    def __aiter__(self) -> _Merged:
        return self

    async def __anext__(self) -> tuple[int, StreamDelta]:
        while self.left:
            index, item = await self.queue.get()
            if item is None:
                self.left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return index, item
        raise StopAsyncIteration

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for stream in self.streams:
            stream.close()


async def _sse(streams: list[RequestStream], chunks: _Chunks, metrics: ServerMetrics,
               include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    """The choices' deltas as server-sent events, each chunk naming its choice's index; with ``continuous_usage``
    (vLLM's ``continuous_usage_stats``) each chunk also carries the usage so far. The stream closes (aborting
    every unfinished choice) if the client leaves, or when a choice fails."""
    merged, lasts, offsets = _Merged(streams), [None] * len(streams), [0] * len(streams)
    seen: list[StreamDelta | None] = [None] * len(streams)  # each choice's latest delta: its counts so far

    def line(chunk: dict) -> str:
        if continuous_usage:
            chunk["usage"] = chunks.usage_so_far(seen)
        return _sse_line(chunk)
    try:
        if chunks.kind == "chat":
            for index in range(len(streams)):
                yield line(chunks.chunk(index, "", role=True))
        async for index, delta in merged:
            if seen[index] is None and chunks.echo is not None:  # the choice's first chunk repeats its prompt
                text, logprobs, offsets[index] = chunks.echo_part(index, delta.prompt_logprobs)
                yield line(chunks.chunk(index, text, logprobs=logprobs))
            seen[index] = delta
            if chunks.echo_only:  # the prompt alone: the token generated to get there is not shown
                delta = replace(delta, text="", logprobs=None)
            logprobs = None
            if chunks.logprobs and delta.logprobs:
                logprobs, offsets[index] = chunks.logprobs_object(delta.logprobs, offsets[index])
            if delta.text or logprobs:
                yield line(chunks.chunk(index, delta.text, logprobs=logprobs))
            if delta.finished:
                metrics.observe(delta)
                lasts[index] = delta
                yield line(chunks.chunk(index, None if chunks.kind == "chat" else "", delta.finish_reason))
        if include_usage:
            yield _sse_line(chunks.usage_chunk(lasts))
    except EngineDead as error:  # a stream that ends in an error still ends cleanly: the error, then [DONE]
        yield _sse_line(error_object(503, str(error)))
    except RequestFailed as error:
        metrics.observe(error.delta)
        yield _sse_line(error_object(500, str(error)))
    finally:
        merged.close()
    yield _sse_line("[DONE]")


async def _collect(streams: list[RequestStream], chunks: _Chunks, metrics: ServerMetrics) -> Response:
    """The whole answer, once every choice has finished; one failed choice fails the request (a 500)."""
    merged = _Merged(streams)
    answers = [_Answer() for _ in streams]
    try:
        async for index, delta in merged:
            answers[index].add(delta)
            if delta.finished:
                metrics.observe(delta)
                answers[index].last = delta
    except EngineDead as error:
        raise ApiError(503, str(error)) from None
    except RequestFailed as error:  # this request alone: the server goes on
        metrics.observe(error.delta)
        raise ApiError(500, str(error)) from None
    finally:
        merged.close()
    if any(answer.last is None for answer in answers):
        raise ApiError(500, "the request ended without a final output")
    return JSONResponse(chunks.whole(answers))


async def _until_disconnected(request: Request, answer: Awaitable[Response]) -> Response:
    """Await ``answer``, but cancel it (aborting its request) if the client hangs up first."""
    work = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        gone.cancel()
        return work.result()
    work.cancel()
    return Response(status_code=499)  # nobody reads it: the client has gone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- the command line, and a server in a child process ----------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m enginelib.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model name or path (as enginelib.load_model takes)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for the engine loop")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in its own process, as vLLM V1 does (default); --no-engine-process "
                        "runs it in a thread of the server's process, sharing its interpreter lock")
    p.add_argument("--engine-cpus", type=lambda s: {int(c) for c in s.split(",")}, default=None, metavar="LIST",
                   help="pin the engine core's process to these CPUs, e.g. 0 or 0,1 (Linux; with --engine-process)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: from memory)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests in the running batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step at most")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--compile", action="store_true",
                   help="decode steps through torch.compile (compiled at start-up, one graph per batch size)")
    p.add_argument("--compile-batch-sizes", type=lambda s: tuple(int(b) for b in s.split(",")), default=None,
                   help="comma-separated decode batch sizes to compile (default: 1,2,4,8,16,32)")
    p.add_argument("--jump-forward", action="store_true",
                   help="structured output: append the tokens a grammar forces without sampling them (chapter 12)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests queued beyond the batch's free seats past which new ones get 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--api-key", default=os.environ.get("ENGINELIB_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1 routes (default: $ENGINELIB_API_KEY; none)")
    p.add_argument("--max-connections", type=int, default=256,
                   help="open connections at most; past it new ones get a 503 (uvicorn's limit_concurrency)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle connection stays open between requests")
    p.add_argument("--timeout-head", type=float, default=10.0,
                   help="seconds a client has to send a request's line and headers before its connection is closed")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="shut down when this process is gone (ServerProcess passes its own: a killed notebook "
                        "kernel leaves no server behind)")
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe; a bad speculative or compile setting is a ValueError naming the flag.

    ``--speculative-config`` takes SpeculativeConfig's fields, and for method "draft" a ``model`` key, as
    vLLM's does: the draft, a GGUF file (or known name) loaded as stored by :func:`quant.load_quantized`;
    by default the served model's own file, whose Q4_1 layers make it an int4 draft (chapter 15).
    The draft loads here, after every flag has been checked and before the served model.
    """

    speculative = compile_config = None
    if args.compile or args.compile_batch_sizes:
        compile_config = CompileConfig(**({"batch_sizes": args.compile_batch_sizes} if args.compile_batch_sizes else {}))
    if args.speculative_config is not None:
        spec = args.speculative_config
        keys = sorted({f.name for f in fields(SpeculativeConfig)} - {"draft_model"} | {"model"})
        if not isinstance(spec, dict) or set(spec) - set(keys):
            raise ValueError(f"--speculative-config must be a JSON object with the keys {', '.join(keys)} (any of "
                             f'them), e.g. \'{{"method": "draft", "num_speculative_tokens": 4}}\'; got {spec!r}')
        spec = dict(spec)
        draft = spec.pop("model", None)
        if draft is not None and spec.get("method") != "draft":
            raise ValueError("--speculative-config: 'model' names a draft model; it needs \"method\": \"draft\"")
        SpeculativeConfig(**{**spec, "method": "ngram"})  # every other value checked before a draft loads
        if spec.get("method") == "draft":
            spec["draft_model"] = load_draft(draft or args.model, args.device)
        speculative = SpeculativeConfig(**spec)
    return EngineConfig.from_args(block_size=args.block_size, num_blocks=args.num_blocks,
                                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_prefix_caching=args.enable_prefix_caching,
                                  enable_chunked_prefill=args.enable_chunked_prefill,
                                  speculative=speculative, compile=compile_config, jump_forward=args.jump_forward)


def load_draft(model: str, device: str | None) -> Transformer:
    """A draft model for ``--speculative-config``: a GGUF's layers as stored (int4 from Q4_1, q8_0 from Q8_0)."""
    from enginelib.speed.quant import load_quantized

    try:
        return load_quantized(model, device=device, progress=False)[0]
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"--speculative-config's draft model {model!r}: {e}") from e


def build_engine(args: argparse.Namespace) -> Engine:
    """The :class:`Engine` the flags describe (run in the engine-core process when there is one)."""
    import torch

    from enginelib.core.engine import Engine
    from enginelib.model.device import DTYPES
    from enginelib.model.weights import load_model

    dtype = DTYPES[args.dtype] if args.dtype else None
    config = engine_config(args)  # first: a bad flag fails before the model loads
    model, tokenizer = load_model(args.model, device=args.device, dtype=dtype, progress=False)
    torch.set_grad_enabled(False)
    return Engine(model, tokenizer, config)


def make_engine(args: argparse.Namespace) -> AsyncEngine | EngineCoreClient:
    """The engine behind the app: in its own process (``--engine-process``, the default), or a thread of ours."""
    if args.engine_process:
        from enginelib.serve.engine_core import EngineCoreClient

        return EngineCoreClient(functools.partial(build_engine, args), max_waiting=args.max_waiting,
                                threads=args.threads, cpus=args.engine_cpus)
    return AsyncEngine(build_engine(args), max_waiting=args.max_waiting, threads=args.threads)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from enginelib.serve.slow_clients import head_timeout_protocol

    args = parse_args(argv)
    engine = make_engine(args)
    app = build_app(engine, args.served_model_name or str(args.model), max_body_bytes=args.max_body_bytes,
                    api_key=args.api_key, loopback_only=is_loopback(args.host))
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=args.timeout_keep_alive,
        limit_concurrency=args.max_connections, http=head_timeout_protocol(args.timeout_head)))
    if args.parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(args.parent_pid, server), name="parent-watch",
                         daemon=True).start()
    threading.Thread(target=_exit_if_engine_dies, args=(engine, server), name="engine-watch", daemon=True).start()
    print(f"enginelib serving {args.served_model_name or args.model} on http://{args.host}:{args.port}/v1", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM, like Ctrl-C, raises KeyboardInterrupt
    try:
        server.run()  # on a signal: uvicorn's clean shutdown, then it raises the signal again, here
    except KeyboardInterrupt:
        print("enginelib server stopped by a signal", flush=True)
    finally:
        engine.shutdown()
    if engine.error is not None:  # a supervisor (systemd, Kubernetes) restarts a process that exits non-zero
        raise SystemExit(f"the engine loop stopped: {engine.error!r}")


def _exit_if_engine_dies(engine: AsyncEngine, server: "uvicorn.Server") -> None:
    """When the engine loop stops on an error, stop the server too (uvicorn's clean shutdown), as vLLM does:
    /health already answers 503, and a live process with a dead engine would serve only errors. ``main`` then
    exits with status 1 (not by a signal: systemd counts a death by SIGTERM as a clean exit, and would not
    restart it)."""
    engine.join()
    if engine.error is not None:
        server.should_exit = True


def _exit_with_parent(parent: int, server: "uvicorn.Server", every: float = 1.0) -> None:
    """Shut down (uvicorn's clean shutdown) once ``parent`` has exited: we were re-parented."""
    while os.getppid() == parent:
        time.sleep(every)
    server.should_exit = True


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m enginelib.serve`` in a child process on a free loopback port, for notebooks, tests and the bench.

        with ServerProcess(["--max-num-seqs", "8"]) as server:
            client = openai.OpenAI(base_url=server.url, api_key="none")
    """

    def __init__(self, args: list[str] = (), port: int | None = None, timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.args, self.timeout, self.env = list(args), timeout, env
        self.process: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        """Launch the server and wait until it is healthy."""
        return self.launch().wait_ready()

    def launch(self) -> "ServerProcess":
        """Start the child process and return at once (it loads its model meanwhile); see :meth:`wait_ready`."""
        cmd = [sys.executable, "-m", "enginelib.serve", "--port", str(self.port), "--parent-pid", str(os.getpid()),
               *self.args]
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe nobody reads would stall the server
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, **(self.env or {})})
        return self

    def wait_ready(self) -> "ServerProcess":
        """Poll /health until the launched server answers; raise with its log if it exits or takes too long."""
        if self.process is None:
            raise ValueError("the server was not launched: call launch() (or start()) first")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode} before it was ready:\n"
                                   f"{self.output()}")
            if self._healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server was not healthy within {self.timeout} s: {' '.join(self.process.args)}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url.removesuffix("/v1") + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:  # not listening yet (connection refused) or still loading the model
            return False

    def stop(self, timeout: float = 15.0) -> int | None:
        """Terminate (SIGTERM lets uvicorn shut down cleanly), then kill if it lingers; return the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def output(self) -> str:
        """What the server printed so far (its log)."""
        self.log.seek(0)
        return self.log.read()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

