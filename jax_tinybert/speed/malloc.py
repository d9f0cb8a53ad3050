"""The allocator XLA's CPU steps run fastest under, and the restart that applies it.

- gperftools' tcmalloc, where installed (Debian/Ubuntu: libtcmalloc-minimal4, which
  `make install` adds when it can): preloaded (LD_PRELOAD), it makes XLA's compilations ~30%
  faster and the train steps 3-12% faster than glibc's malloc with the settings below (2-core
  Xeon, benchmarks/RESULTS.md#memory-allocator).
- Otherwise glibc's malloc with MALLOC_ENV: together (neither alone) they make the train steps
  12-18% faster on 2 cores (prediction and intermediate, T 64 and 128) than glibc's defaults,
  for compilations ~40% slower. They are set with tcmalloc too (then unused), so a
  child process started without the preload still gets them.

On a GPU or TPU host (`xla_flags.accelerator_possible`) MALLOC_ENV is not set: the steps run
on the accelerator, and one malloc arena serialises the host's threads: the Rust tokenizer read
SST-2's train set at 7k sentences/s through the CLI on a 16-core H200 host, against 68k without
it (and 24-28k against 57k on 2 cores). tcmalloc is still preloaded where installed.

Both are read once, at process start, so a process that lacks them restarts itself (same
interpreter, options and arguments, same PID) before anything starts threads or JAX's backend.
JTB_MALLOC=glibc: glibc's malloc with MALLOC_ENV even where tcmalloc is installed; off: no
restart at all. JTB_TCMALLOC=PATH: the tcmalloc library to preload, where it is not in a
standard folder.

Imports only the standard library, `fs` (etils) and `xla_flags`, and `jax_tinybert/__init__.py`
loads the model lazily, so a script can `from jax_tinybert import malloc` and restart before JAX
is loaded. The Makefile exports the same values (make cannot import Python; tests/test_cli.py
compares the two), and runs the test suite through `python -m jax_tinybert.speed.malloc pytest ...`.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Mapping, Optional

from jax_tinybert import fs
from jax_tinybert.speed import xla_flags

MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "17179869184",
              "MALLOC_TRIM_THRESHOLD_": "17179869184"}
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so",
                  "libtcmalloc.so")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
            "/lib/aarch64-linux-gnu", "/usr/lib64", "/lib64", "/usr/lib", "/usr/local/lib")
# RELEASE_RATE 0: freed pages stay mapped, as MALLOC_ENV keeps glibc's (tcmalloc's default
# returns them to the OS, and a step re-faults them: the fine-tuning step at T 128 took 1.71 s
# in one run of two, against 1.35-1.38 s with 0). Some builds print a "large alloc" line per
# allocation over 1 GiB (a teacher cache's buffers): the CLI's output is for the user.
TCMALLOC_ENV = {"TCMALLOC_RELEASE_RATE": "0",
                "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


def is_glibc() -> bool:
    """Whether this process runs on glibc (whose malloc reads MALLOC_ENV)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):   # not glibc, or not a POSIX confstr
        return False


def tcmalloc_path(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The tcmalloc library to preload: $JTB_TCMALLOC (of `environ`, default os.environ) if
    that file exists, else the first of TCMALLOC_NAMES in LIB_DIRS; None if there is none."""
    named = (os.environ if environ is None else environ).get("JTB_TCMALLOC")
    if named:
        return named if os.path.isfile(named) else None
    for d in LIB_DIRS:
        for name in TCMALLOC_NAMES:
            if os.path.isfile(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


def allocator(environ: Optional[Mapping[str, str]] = None) -> str:
    """What this process's environment says it allocates with: "tcmalloc" (preloaded), or
    "glibc" (with MALLOC_ENV), or "glibc defaults"/"glibc, own settings"."""
    env = os.environ if environ is None else environ
    if "tcmalloc" in env.get("LD_PRELOAD", ""):
        return "tcmalloc"
    if all(env.get(k) == v for k, v in MALLOC_ENV.items()):
        return "glibc"
    if any(k in env for k in MALLOC_ENV) or "GLIBC_TUNABLES" in env:
        return "glibc, own settings"
    if xla_flags.accelerator_possible(env):
        return "glibc defaults (a GPU/TPU host: one arena would slow the host's threads)"
    return "glibc defaults"


def wanted(environ: Optional[Mapping[str, str]] = None, force: bool = False) -> Dict[str, str]:
    """The variables to add to `environ` (default os.environ) for the fast allocator; {} when
    it has them already. A user's own settings are kept (nothing is added): malloc variables
    other than MALLOC_ENV's values, GLIBC_TUNABLES, or an LD_PRELOAD (tcmalloc is then not
    added); `force` (benchmarks, whose numbers must come from these settings) overrides
    MALLOC_* and GLIBC_TUNABLES but still keeps an LD_PRELOAD. JTB_MALLOC=glibc: no tcmalloc.
    A GPU/TPU host gets no MALLOC_ENV (tcmalloc only, where installed)."""
    env = os.environ if environ is None else environ
    own = (any(k in env and env[k] != v for k, v in MALLOC_ENV.items())
           or "GLIBC_TUNABLES" in env)
    if own and not force:
        return {}
    # Tuned for XLA's CPU steps; on an accelerator host it only slows the host's threads.
    add = ({} if xla_flags.accelerator_possible(env)
           else {k: v for k, v in MALLOC_ENV.items() if env.get(k) != v})
    lib = (None if env.get("JTB_MALLOC", "").lower() == "glibc" or env.get("LD_PRELOAD")
           else tcmalloc_path(env))
    if lib:
        add["LD_PRELOAD"] = lib
        add.update({k: v for k, v in TCMALLOC_ENV.items() if k not in env})   # a user's own kept
    return add


def _argv() -> List[str]:
    # orig_argv keeps `-m module` and interpreter options; sys.argv[0] would be the module's file.
    orig = getattr(sys, "orig_argv", None)
    return [sys.executable] + (list(orig[1:]) if orig else list(sys.argv))


def restart(mark: str, add: Mapping[str, str]) -> None:
    """Replaces this process by itself with `add` (e.g. wanted()) and `mark`=1 added to its
    environment (the restarted process sees `mark` and does not restart again). Does not
    return."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, _argv(), dict(os.environ, **add, **{mark: "1"}))


CLI_MARK = "JTB_MALLOC_REEXEC"


def restart_unless_set(mark: str = "JTB_BENCH_REEXEC", force: bool = True) -> None:
    """Restarts with wanted(force=force) unless that is empty, this is the restarted process
    (`mark` set) or the C library is not glibc. Benchmark scripts, whose numbers must come from
    these settings exactly, call it with the default force=True."""
    if os.environ.get(mark) or not is_glibc():
        return
    add = wanted(force=force)
    if add:
        restart(mark, add)


def restart_command() -> None:
    """The CLI's restart: restart_unless_set(CLI_MARK, force=False), so a user's own malloc
    settings or LD_PRELOAD are kept; JTB_MALLOC=off never restarts. Called before JAX is
    imported: the first process then costs ~0.1 s instead of JAX's ~1 s of imports, paid again
    after the restart."""
    if not fs.env_off("JTB_MALLOC") and getattr(sys, "orig_argv", None):
        restart_unless_set(CLI_MARK, force=False)


if __name__ == "__main__":
    # `python -m jax_tinybert.speed.malloc CMD [ARGS]` runs CMD with wanted()'s variables added (the
    # Makefile's test target: the suite's in-process compiles run ~30% faster under tcmalloc);
    # alone, it prints them, KEY=VALUE one per line.
    if len(sys.argv) > 1:
        os.execvpe(sys.argv[1], sys.argv[1:], dict(os.environ, **wanted()))
    print("\n".join(f"{k}={v}" for k, v in wanted().items()))
