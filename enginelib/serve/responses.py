"""OpenAI's answers, made from an engine's deltas (chapter 11): the whole answer of a request's choices, or its
stream as server-sent events, with logprobs, echo and usage in OpenAI's (and vLLM's) shapes. The routes
(:mod:`.app`) validate and queue; everything a client reads back is shaped here."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi.responses import JSONResponse, Response

from enginelib.core.outputs import StreamDelta, TokenLogprob
from enginelib.serve.engine_client import EngineDead, RequestFailed, RequestStream
from enginelib.serve.guard import error_object
from enginelib.serve.logprobs import chat_logprobs, joined, legacy_logprobs, vllm_prompt_logprobs
from enginelib.serve.metrics import ServerMetrics
from enginelib.serve.protocol import ApiError


@dataclass
class Chunks:
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

    def whole(self, answers: list[Answer]) -> dict:
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
class Answer:
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


def sse_line(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


class Merged:
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

    def __aiter__(self) -> Merged:
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


async def sse(streams: list[RequestStream], chunks: Chunks, metrics: ServerMetrics,
               include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    """The choices' deltas as server-sent events, each chunk naming its choice's index; with ``continuous_usage``
    (vLLM's ``continuous_usage_stats``) each chunk also carries the usage so far. The stream closes (aborting
    every unfinished choice) if the client leaves, or when a choice fails."""
    merged, lasts, offsets = Merged(streams), [None] * len(streams), [0] * len(streams)
    seen: list[StreamDelta | None] = [None] * len(streams)  # each choice's latest delta: its counts so far

    def line(chunk: dict) -> str:
        if continuous_usage:
            chunk["usage"] = chunks.usage_so_far(seen)
        return sse_line(chunk)
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
            yield sse_line(chunks.usage_chunk(lasts))
    except EngineDead as error:  # a stream that ends in an error still ends cleanly: the error, then [DONE]
        yield sse_line(error_object(503, str(error)))
    except RequestFailed as error:
        metrics.observe(error.delta)
        yield sse_line(error_object(500, str(error)))
    finally:
        merged.close()
    yield sse_line("[DONE]")


async def collect(streams: list[RequestStream], chunks: Chunks, metrics: ServerMetrics) -> Response:
    """The whole answer, once every choice has finished; one failed choice fails the request (a 500)."""
    merged = Merged(streams)
    answers = [Answer() for _ in streams]
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
