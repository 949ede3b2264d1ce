"""Chapter 11: a small server. One engine loop in a thread; asyncio serves the sockets; a queue per request; SSE out."""
import asyncio
import json
import queue
import threading

from .engine import MiniEngine


class TinyServer:
    """Streams your engine's answers: POST {"prompt", "max_tokens"}, read `data: {"text": ...}` lines to [DONE]."""

    def __init__(self, engine: MiniEngine, tokenizer) -> None:
        self.engine, self.tok = engine, tokenizer
        self.arrivals = queue.SimpleQueue()  # new requests, from the event loop to the engine thread
        self.streams = {}                    # request id -> [its asyncio queue, its event loop, the text sent]
        threading.Thread(target=self._engine_loop, daemon=True).start()

    def _admit(self, prompt: str, max_tokens: int, out: asyncio.Queue, loop) -> None:
        self.streams[self.engine.add(self.tok.encode(prompt), max_tokens)] = [out, loop, ""]

    def _engine_loop(self) -> None:  # the only thread that touches the engine
        while True:
            if not self.engine.has_unfinished():
                self._admit(*self.arrivals.get())  # idle: sleep until a request comes
            while not self.arrivals.empty():       # new requests join between two steps
                self._admit(*self.arrivals.get())
            plan, _ = self.engine.step()
            for work in plan.scheduled:
                request = work.request
                out, loop, sent = self.streams[request.request_id]
                text = self.tok.decode(request.output_token_ids, skip_special_tokens=True)
                if len(text) > len(sent) and (request.is_finished or not text.endswith("\ufffd")):  # whole characters
                    loop.call_soon_threadsafe(out.put_nowait, text[len(sent):])
                    self.streams[request.request_id][2] = text
                if request.is_finished:
                    loop.call_soon_threadsafe(out.put_nowait, None)
                    del self.streams[request.request_id]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = next(int(line.split(":")[1]) for line in head.split("\r\n")
                      if line.lower().startswith("content-length"))
        body = json.loads(await reader.readexactly(length))
        out = asyncio.Queue()
        self.arrivals.put((body["prompt"], body["max_tokens"], out, asyncio.get_running_loop()))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        while (text := await out.get()) is not None:
            writer.write(f"data: {json.dumps({'text': text})}\n\n".encode())
            await writer.drain()
        writer.write(b"data: [DONE]\n\n")
        writer.close()
