"""Every environment variable enginelib reads, read here and nowhere else: one file lists what the environment can
change. Each is read when asked, not at import, so a test or a notebook may set one late; each function returns
what the variable says; a caller with a default passes it, so the default stays next to the code it shapes."""
from __future__ import annotations

import os
from pathlib import Path

CACHE = "ENGINELIB_CACHE"                # where fetched models and built kernels live
DTYPE = "ENGINELIB_DTYPE"                # the default dtype (float32, float16, bfloat16)
THREADS = "ENGINELIB_THREADS"            # torch's CPU threads by default
API_KEY = "ENGINELIB_API_KEY"            # the server's --api-key by default
STRICT_PATHS = "ENGINELIB_STRICT_PATHS"  # a fallback from a path asked for by name raises
PATHS_LOG = "ENGINELIB_PATHS_LOG"        # a file every path event is appended to
Q8_PATH = "ENGINELIB_Q8_PATH"            # force one path of the q8 CPU kernels
CXX = "CXX"                              # the C++ compiler, as torch's builders read it


def cache_dir(default: Path) -> Path:
    """``$ENGINELIB_CACHE`` (else ``default``), its ``~`` expanded."""
    return Path(os.environ.get(CACHE, default)).expanduser()


def dtype_name(default: str) -> str:
    """``$ENGINELIB_DTYPE`` (else ``default``), stripped and in lower case: its caller, which knows the dtypes,
    checks it."""
    return os.environ.get(DTYPE, default).strip().lower()


def threads(default: int) -> int:
    """``$ENGINELIB_THREADS`` as an int (``ValueError`` for anything else), else ``default``."""
    value = os.environ.get(THREADS)
    return default if value is None else int(value)


def api_key() -> str | None:
    """``$ENGINELIB_API_KEY``: the key the server asks for when ``--api-key`` is not given (None: no key)."""
    return os.environ.get(API_KEY)


def strict_paths() -> bool:
    """Whether ``$ENGINELIB_STRICT_PATHS`` is on (1, true, yes or on, in any case)."""
    return os.environ.get(STRICT_PATHS, "").strip().lower() in ("1", "true", "yes", "on")


def paths_log() -> str | None:
    """``$ENGINELIB_PATHS_LOG``: the file to append path events to (unset or empty: None)."""
    return os.environ.get(PATHS_LOG) or None


def q8_path() -> str | None:
    """``$ENGINELIB_Q8_PATH``: the q8 kernels' path to force (unset or empty: None)."""
    return os.environ.get(Q8_PATH) or None


def cxx(default: str) -> str:
    """``$CXX`` as set, an empty value too (torch's extension builder takes it so), else ``default``."""
    return os.environ.get(CXX, default)
