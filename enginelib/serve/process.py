"""The server as a process (chapter 11): :class:`ServerProcess` starts ``python -m enginelib.serve`` in a child on
a free loopback port (for notebooks, tests and the benchmark), and two watchers stop a running server when what it
serves for is gone: its parent (a killed notebook kernel) or its engine."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

    from enginelib.serve.engine_client import EngineClient


def exit_if_engine_dies(engine: EngineClient, server: uvicorn.Server) -> None:
    """When the engine loop stops on an error, stop the server too (uvicorn's clean shutdown), as vLLM does:
    /health already answers 503, and a live process with a dead engine would serve only errors. ``main`` then
    exits with status 1 (not by a signal: systemd counts a death by SIGTERM as a clean exit, and would not
    restart it)."""
    engine.join()
    if engine.error is not None:
        server.should_exit = True


def exit_with_parent(parent: int, server: uvicorn.Server, every: float = 1.0) -> None:
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
