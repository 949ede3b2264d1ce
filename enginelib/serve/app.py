"""An OpenAI-compatible HTTP server's routes over one engine (chapter 11): :func:`build_app`.

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

What a request may say is :mod:`.protocol`'s; the answers' shapes are :mod:`.responses`'; the command line
that starts a server is :mod:`.cli`'.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from enginelib.core.llm import fan_out
from enginelib.core.prompt import refuse_long_text
from enginelib.serve.engine_client import EngineClient, EngineDead, EngineOverloaded, RequestStream
from enginelib.serve.guard import Guard
from enginelib.serve.guided import guided_field
from enginelib.serve.metrics import ServerMetrics
from enginelib.serve.openapi import openapi_schema
from enginelib.serve.protocol import (MAX_N, ApiError, ChatBody, CompletionBody, StreamOptions, _Body, echo,
                                      echoes, logprobs_asked, loads, max_tokens_asked, param, prompts_of,
                                      sampling_params, validate)
from enginelib.serve.responses import Chunks, collect, sse

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt this model's context can hold
BODY_TIMEOUT = 30.0  # seconds to receive a request's body
DRAIN_FACTOR = 8  # a refused body up to 8x the limit is read and dropped before the 413 (see _parse)


def build_app(engine: EngineClient, model_name: str, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
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
        if (why := engine.overloaded()) is not None:  # the engine's word, from its latest counters: nothing queued
            raise ApiError(503, why, headers={"Retry-After": "1"})
        request_id = uuid.uuid4().hex
        streams: list[RequestStream] = []
        try:  # all the choices or none: one refused closes (aborts) those already queued
            for i, prompt in enumerate(prompts):
                for j, sample in enumerate(fan_out(params[i], n)):
                    streams.append(await engine.add_request(prompt, sample, f"{kind}-{request_id}-{i * n + j}"))
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
        chunks = Chunks(kind, model_name, request_id, tokenizer, logprobs is not None, n,
                        sum(len(prompt) for prompt in prompts), echoed, max_tokens == 0,
                        params[0].prompt_logprobs is not None)
        if body.stream:
            options = body.stream_options or StreamOptions()
            return StreamingResponse(sse(streams, chunks, metrics, bool(options.include_usage),
                                         bool(options.continuous_usage_stats)), media_type="text/event-stream")
        return await _until_disconnected(request, collect(streams, chunks, metrics))

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
