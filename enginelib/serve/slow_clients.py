"""A deadline for every request's head, which uvicorn does not set.

uvicorn closes a connection that idles between requests (``--timeout-keep-alive``),
but a client that sends half a request line and then nothing, or one header a
minute, holds its socket for ever; enough of them fill ``--max-connections`` and
every real client gets a 503 (the "slowloris" attack). This protocol is uvicorn's
own h11 protocol plus one timer: armed when a connection opens and when a later
request's first bytes arrive, cancelled once its request line and headers are in,
and closing the connection if they are not within ``--timeout-head`` seconds.
Between requests uvicorn's keep-alive timer still decides. (The body has its
own deadline in the app; see ``BODY_TIMEOUT``.)
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def head_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a ``seconds`` deadline on each request's head, for ``uvicorn.run(http=...)``."""

    class HeadTimeout(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.head_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the first bytes of a later request on this connection: its head has the deadline too
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the head is in: the app (and its body deadline) has it
                self._disarm()

        def _arm(self) -> None:
            self._disarm()
            self.head_timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _too_slow(self) -> None:
            self.head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # no request to answer yet: closing is all HTTP allows

    return HeadTimeout
