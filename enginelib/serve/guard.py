"""The server's door: what a request must show before any route reads it.

A server on loopback is still reachable from every web page the user opens: a
page can ``fetch`` it with a ``text/plain`` body (no CORS preflight for that), and
through DNS rebinding a page can even read the answers. Three checks close that,
as vLLM and other local servers do:

- an API key (``--api-key`` or ``$ENGINELIB_API_KEY``): ``Authorization: Bearer <key>``
  on every ``/v1`` route, else 401 (``/health`` and ``/metrics`` stay open, as in vLLM);
- ``Content-Type: application/json`` on every POST to a route that reads a body, else 415 (a
  page cannot send that cross-origin without a preflight, which this server never answers);
  a POST to any other path is the app's to answer (404, or 405 for ``POST /health``): the
  wrong method is the first thing wrong with it;
- when bound to loopback, the ``Host`` header must name loopback, else 400 (a rebound
  name such as ``evil.example`` carries its own ``Host``).

It is plain ASGI middleware, not FastAPI's ``BaseHTTPMiddleware``, so that streaming
and the detection of a client that hangs up pass through untouched.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def host_name(header: str) -> str:
    """The name in a Host header, without its port: ``[::1]:8000`` -> ``::1``."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def error_object(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object, the shape every error of this server takes."""
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Guard:
    """Refuses, before the app sees it, a request without the key, JSON, or a loopback Host."""

    def __init__(self, app: ASGIApp, *, api_key: str | None = None, loopback_only: bool = False,
                 json_paths: frozenset[str] | None = None) -> None:
        """``json_paths``: the routes whose POST bodies must be JSON (None: every POST)."""
        self.app, self.api_key, self.loopback_only, self.json_paths = app, api_key, loopback_only, json_paths

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                status, message, code = refusal
                body = json.dumps(error_object(status, message, code)).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                if status == 401:
                    headers.append((b"www-authenticate", b"Bearer"))
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        """(status, message, code) for a request to turn away, or None to let it in."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.loopback_only and host_name(headers.get("host", "")) not in LOOPBACK_NAMES:
            return (400, "the Host header must name this machine (localhost, 127.0.0.1 or [::1]): the server is "
                         "bound to loopback", "invalid_host")
        path = scope.get("path", "")
        if self.api_key is not None and path.startswith("/v1"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return 401, "a valid API key is required: send the header 'Authorization: Bearer <key>'", "invalid_api_key"
        if scope.get("method") == "POST" and (self.json_paths is None or path in self.json_paths):
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return (415, f"the body must be JSON, sent with 'Content-Type: application/json' "
                             f"(got {media or 'no Content-Type'!r})", "unsupported_media_type")
        return None
