"""An OpenAI-compatible HTTP server over one engine (chapter 11): its command line.

    python -m enginelib.serve --model smollm2-135m --port 8000

The flags name the engine's knobs (``EngineConfig``) and the server's limits; :func:`main` builds the engine
(in a process of its own by default: :mod:`.engine_core`), the app (:mod:`.app`) and uvicorn, and serves until
a signal, or until the engine dies (then it exits non-zero, for a supervisor to restart it).
"""
from __future__ import annotations

import argparse
import functools
import json
import signal
import threading
from dataclasses import fields
from typing import TYPE_CHECKING

import enginelib.env as env
from enginelib.config import CompileConfig, EngineConfig, SpeculativeConfig
from enginelib.serve.app import DEFAULT_MAX_BODY_BYTES, build_app
from enginelib.serve.async_engine import AsyncEngine
from enginelib.serve.engine_client import EngineClient
from enginelib.serve.guard import is_loopback
from enginelib.serve.process import exit_if_engine_dies, exit_with_parent

if TYPE_CHECKING:
    from enginelib.core.engine import Engine
    from enginelib.model.transformer import Transformer

DESCRIPTION = "An OpenAI-compatible HTTP server over one :class:`AsyncEngine` (chapter 11)."  # --help's first line
DEFAULT_MAX_WAITING = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The server's flags; ``--api-key`` defaults to ``$ENGINELIB_API_KEY`` (read in :mod:`enginelib.env`)."""
    p = argparse.ArgumentParser(prog="python -m enginelib.serve", description=DESCRIPTION)
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
    p.add_argument("--api-key", default=env.api_key(),
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


def make_engine(args: argparse.Namespace) -> EngineClient:
    """The engine behind the app: in its own process (``--engine-process``, the default), or a thread of ours."""
    if args.engine_process:
        from enginelib.serve.engine_core import EngineCoreClient

        return EngineCoreClient(functools.partial(build_engine, args), max_waiting=args.max_waiting,
                                threads=args.threads, cpus=args.engine_cpus)
    return AsyncEngine(build_engine(args), max_waiting=args.max_waiting, threads=args.threads)


def main(argv: list[str] | None = None) -> None:
    """``python -m enginelib.serve``: build the engine and the app, serve until a signal or the engine's death."""
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
        threading.Thread(target=exit_with_parent, args=(args.parent_pid, server), name="parent-watch",
                         daemon=True).start()
    threading.Thread(target=exit_if_engine_dies, args=(engine, server), name="engine-watch", daemon=True).start()
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
