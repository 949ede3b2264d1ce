"""Serving (chapter 11): the OpenAI-compatible HTTP server, the asyncio engine behind it and the
load generator that measures it. ``python -m enginelib.serve`` starts the server."""
from enginelib.serve.app import ServerProcess, build_app, engine_config, main, parse_args

__all__ = ["ServerProcess", "build_app", "engine_config", "main", "parse_args"]
