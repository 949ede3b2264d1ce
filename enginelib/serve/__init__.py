"""Serving (chapter 11): the OpenAI-compatible HTTP server and the engine behind it, in its own process or in a
thread (both :class:`~enginelib.serve.engine_client.EngineClient`). ``python -m enginelib.serve`` starts the server;
the load generator that measures it is :mod:`enginelib.bench.loadgen`.

- :mod:`.app`: the routes (``build_app``); :mod:`.protocol`: what a request may say; :mod:`.responses`: OpenAI's
  answers and server-sent events; :mod:`.openapi`: the schema; :mod:`.guard`, :mod:`.slow_clients`: the door;
- :mod:`.engine_client`: what the app needs of an engine; :mod:`.async_engine` (a thread) and :mod:`.engine_core`
  (a process of its own) are that, around one loop body (:mod:`.engine_loop`);
- :mod:`.cli`: the flags and ``main``; :mod:`.process`: ``ServerProcess`` and the watchers that stop a server.
"""
from enginelib.serve.app import build_app
from enginelib.serve.cli import engine_config, main, parse_args
from enginelib.serve.process import ServerProcess

__all__ = ["ServerProcess", "build_app", "engine_config", "main", "parse_args"]
