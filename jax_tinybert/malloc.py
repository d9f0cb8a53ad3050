"""The glibc malloc settings XLA's CPU steps run fastest under, and the restart that applies them.

glibc reads them once, at process start, so a process that lacks them restarts itself (same
interpreter, options and arguments, same PID) before anything starts threads or JAX's backend.
Together (neither alone) they make the train steps 12-18% faster on 2 cores (prediction and
intermediate, T 64 and 128), for compilations ~40% slower (benchmarks/RESULTS.md, session 18).

Imports only the standard library, and `jax_tinybert/__init__.py` loads the model lazily, so a
script can `from jax_tinybert import malloc` and restart before JAX is loaded. The Makefile
exports the same values (make cannot import Python; tests/test_cli.py compares the two).
"""
from __future__ import annotations

import os
import sys
from typing import List

MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "17179869184",
              "MALLOC_TRIM_THRESHOLD_": "17179869184"}


def is_glibc() -> bool:
    """Whether this process runs on glibc (whose malloc reads MALLOC_ENV)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):   # not glibc, or not a POSIX confstr
        return False


def _argv() -> List[str]:
    # orig_argv keeps `-m module` and interpreter options; sys.argv[0] would be the module's file.
    orig = getattr(sys, "orig_argv", None)
    return [sys.executable] + (list(orig[1:]) if orig else list(sys.argv))


def restart(mark: str) -> None:
    """Replaces this process by itself with MALLOC_ENV and `mark`=1 added to its environment
    (the restarted process sees `mark` and does not restart again). Does not return."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, _argv(), dict(os.environ, **MALLOC_ENV, **{mark: "1"}))


def restart_unless_set(mark: str = "JTB_BENCH_REEXEC") -> None:
    """For benchmark scripts, whose numbers must come from these settings exactly: restarts
    unless every MALLOC_ENV variable already holds its value (or this is the restarted process)."""
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()) and not os.environ.get(mark):
        restart(mark)
