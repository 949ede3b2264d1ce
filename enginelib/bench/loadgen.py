"""A load generator for any OpenAI-compatible server: many streams at once, timed from the client's side.

The engine's own metrics say when it produced a token; a user sees a token when
its server-sent event arrives. This module measures the second: it sends
streaming requests with the real ``openai`` client, at most ``concurrency`` at a
time (optionally at given arrival times), and stamps every chunk that carries
text on arrival. The same code measures our server, a vLLM server or llama.cpp's.

    result = run_load_sync(server.url, "smollm2-135m", prompts, 64, concurrency=32)
    print(result.summary())

Inside a notebook (an event loop is already running) ``await run_load(...)``.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import openai

try:  # the openai client is built on httpx (httpx2 in its newest releases); its pool limits come from there
    import httpx2 as httpx
except ImportError:  # pragma: no cover - depends on the installed openai
    import httpx


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (a value that was measured), or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class StreamTiming:
    """One request seen from the client: when it was sent and when each chunk with text arrived.

    Times are ``time.perf_counter()`` seconds. A chunk may carry more than one
    token (a server holds text back at a stop string or a split character), so
    TPOT divides by the token count the server reports in its usage chunk, as
    vLLM's benchmark does, and ITL is the gap between chunks.
    """

    sent: float               # when the request was sent
    token_times: list[float]  # when each streamed chunk carrying text arrived
    text: str
    finish_reason: str | None
    num_prompt_tokens: int    # from the final usage chunk (stream_options include_usage)
    num_output_tokens: int
    error: str | None = None
    due: float | None = None  # when it was ready to go: before ``sent`` if it waited for a free slot

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        """Time to first token: from sending to the first chunk with text."""
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: the mean gap, over the tokens the server counted."""
        tokens = self.num_output_tokens or len(self.token_times)
        if tokens < 2 or not self.token_times:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Every gap between two chunks with text: their tail is the stutter a reader sees."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float | None:
        """From sending to the last chunk with text."""
        return self.token_times[-1] - self.sent if self.token_times else None


async def stream_completion(client: openai.AsyncOpenAI, model: str, prompt: str | list[int], max_tokens: int,
                            temperature: float = 0.0, chat: bool = False, **extra) -> StreamTiming:
    """Stream one request and time it; an error (a 400, a dropped connection) is recorded, not raised.

    ``chat`` sends ``prompt`` as one user message to ``/chat/completions``;
    otherwise it goes to ``/completions`` as text or as token ids (which our
    server and vLLM accept). ``extra`` fields go into the JSON body as they are
    (``ignore_eos=True``, ``top_k``, ``stop``...).
    """
    if chat and not isinstance(prompt, str):
        raise ValueError("a chat request needs a text prompt: pass a str, or chat=False to send token ids")
    common = dict(model=model, max_tokens=max_tokens, temperature=temperature, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra or None)
    timing = StreamTiming(time.perf_counter(), [], "", None, 0, 0)
    parts: list[str] = []
    stream = None
    try:
        if chat:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                timing.num_prompt_tokens = chunk.usage.prompt_tokens
                timing.num_output_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text = choice.delta.content if chat else choice.text
                if text:
                    timing.token_times.append(now)
                    parts.append(text)
                if choice.finish_reason is not None:
                    timing.finish_reason = choice.finish_reason
        if timing.finish_reason is None:
            timing.error = "the stream ended without a finish_reason"
    except (openai.APIError, httpx.HTTPError) as error:  # a 4xx/5xx, a timeout, or the connection cut mid-stream
        timing.error = f"{type(error).__name__}: {error}"
    finally:
        if stream is not None:
            await stream.close()
    timing.text = "".join(parts)
    return timing


@dataclass
class LoadResult:
    """Every request of one run, and the figures a serving benchmark reports (seconds, tokens per second)."""

    timings: list[StreamTiming]
    duration: float  # from the start of the run to the end of its last request
    concurrency: int
    errors: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.errors = [t.error for t in self.timings if t.error is not None]

    @property
    def ok(self) -> list[StreamTiming]:
        return [t for t in self.timings if t.ok]

    @property
    def output_tokens(self) -> int:
        return sum(t.num_output_tokens for t in self.ok)

    @property
    def throughput(self) -> float:
        """Output tokens per second of the whole run (successful requests only)."""
        return self.output_tokens / self.duration

    @property
    def requests_per_s(self) -> float:
        return len(self.ok) / self.duration

    @property
    def ttft(self) -> list[float]:
        return [t.ttft for t in self.ok if t.ttft is not None]

    @property
    def tpot(self) -> list[float]:
        return [t.tpot for t in self.ok if t.tpot is not None]

    @property
    def itl(self) -> list[float]:
        return [gap for t in self.ok for gap in t.itl]

    @property
    def e2e(self) -> list[float]:
        return [t.e2e for t in self.ok if t.e2e is not None]

    def p50(self, metric: str) -> float | None:
        """Median of ``metric`` ("ttft", "tpot", "itl" or "e2e")."""
        return percentile(getattr(self, metric), 50)

    def p99(self, metric: str) -> float | None:
        return percentile(getattr(self, metric), 99)

    def summary(self) -> dict:
        return {"requests": len(self.timings), "errors": len(self.errors), "concurrency": self.concurrency,
                "duration_s": self.duration, "output_tokens": self.output_tokens,
                "throughput_tok_per_s": self.throughput, "requests_per_s": self.requests_per_s,
                **{f"{m}_{q}_s": getattr(self, q)(m) for m in ("ttft", "tpot", "itl", "e2e") for q in ("p50", "p99")}}


async def run_load(url: str, model: str, prompts: list[str] | list[list[int]], max_tokens: int | list[int], *,
                   concurrency: int, chat: bool = False, arrivals: list[float] | None = None,
                   timeout: float = 600, **extra) -> LoadResult:
    """Send every prompt as a streaming request, ``concurrency`` at most in flight; time each one.

    ``url`` is the server's OpenAI base URL (``http://host:port/v1``).
    ``arrivals`` (seconds from the start, one per prompt) holds each request
    back until its time; a request that finds every slot busy waits for one
    (its ``due`` time says when it was ready). ``extra`` goes into every request
    body (``ignore_eos=True`` makes each run to ``max_tokens``).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 (requests in flight at once), got {concurrency}")
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(lengths) != len(prompts):
        raise ValueError(f"max_tokens has {len(lengths)} values for {len(prompts)} prompts: give one int or one per prompt")
    if arrivals is not None and len(arrivals) != len(prompts):
        raise ValueError(f"arrivals has {len(arrivals)} times for {len(prompts)} prompts: give one per prompt")
    # One client for the run, no retries (a retried request would hide the error and double its latency),
    # and a connection pool as large as the concurrency, so no request waits for a socket.
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=concurrency,
                                                              max_keepalive_connections=concurrency))
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=timeout,
                                  http_client=http) as client:
        slots = asyncio.Semaphore(concurrency)
        start = time.perf_counter()

        async def one(i: int) -> StreamTiming:
            if arrivals is not None:
                await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            due = time.perf_counter()
            async with slots:
                timing = await stream_completion(client, model, prompts[i], lengths[i], chat=chat, **extra)
            timing.due = due
            return timing

        timings = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        duration = time.perf_counter() - start
    return LoadResult(list(timings), duration, concurrency)


def run_load_sync(*args, **kwargs) -> LoadResult:
    """:func:`run_load` for scripts; a notebook already runs an event loop, so there ``await run_load(...)``."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_load(*args, **kwargs))
    raise RuntimeError("an event loop is already running (a notebook?): use `await run_load(...)` instead")
