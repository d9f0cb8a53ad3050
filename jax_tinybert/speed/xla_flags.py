"""XLA flags the command line sets before JAX starts (jax_tinybert/main.py), unless told not to.

On a GPU, XLA's defaults autotune every GEMM fusion through Triton when a program compiles. A
run compiles one training program per length bucket, plus eval and teacher-pass programs, and
each took ~2 minutes that way: on one H200 (jax 0.11.2), SST-2 teacher fine-tuning through the
CLI reached its first step after 138 s, 122 s of it compiling one program, against 19 s per
program with the flags below; the whole one-epoch run took 81 s with them. The steps run as
fast at batch 32 and up to 15% slower at batch 256 (benchmarks/RESULTS.md#on-a-gpu), so a
long run at large batches may prefer XLA's defaults: JTB_GPU_AUTOTUNE=1 keeps them. The flags
are added only where a GPU can be used (`gpu_possible`): XLA_FLAGS is part of JAX's compile cache
key, so a CPU-only machine keeps its cache and its flags as they were.
"""
from __future__ import annotations

import glob
import os
import sys
from typing import Iterable, Mapping, Optional

from jax_tinybert import fs

# cuBLAS for every dot (no Triton GEMM fusions) with its heuristic's algorithm (no autotuning).
GPU_FAST_COMPILE = (("xla_gpu_enable_triton_gemm", "false"), ("xla_gpu_autotune_level", "0"))
AUTOTUNE_ENV = "JTB_GPU_AUTOTUNE"


def _parse(flags: str) -> dict:
    """XLA_FLAGS -> {name: value} (value None for a flag given without '=')."""
    out = {}
    for f in flags.split():
        if f.startswith("--"):
            name, sep, value = f[2:].partition("=")
            out[name] = value if sep else None
    return out


def wants_autotune(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment asks for XLA's own GPU defaults (JTB_GPU_AUTOTUNE set, not off)."""
    env = os.environ if environ is None else environ
    return env.get(AUTOTUNE_ENV) is not None and not fs.env_off(AUTOTUNE_ENV, env)


# Where JAX's GPU backends live: the PJRT plugins (jax-cuda12-pjrt: jax_plugins/xla_cuda12) and
# the kernels beside them (jax-cuda12-plugin: jax_cuda12_plugin), CUDA or ROCm.
_GPU_PLUGINS = ("jax_plugins/xla_cuda*", "jax_plugins/xla_rocm*", "jax_cuda*_plugin",
                "jax_rocm*_plugin")
_GPU_NAMES = ("cuda", "gpu", "rocm")   # in JAX_PLATFORMS


def _installed(patterns: Iterable[str], paths: Optional[Iterable[str]]) -> bool:
    return any(glob.glob(os.path.join(d, pattern)) for d in (sys.path if paths is None else paths)
               if d and os.path.isdir(d) for pattern in patterns)


def gpu_plugin_installed(paths: Optional[Iterable[str]] = None) -> bool:
    """Whether a JAX GPU plugin is installed in one of `paths` (default sys.path)."""
    return _installed(_GPU_PLUGINS, paths)


def _possible(names: Iterable[str], patterns: Iterable[str], environ, paths) -> bool:
    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS", "").lower()
    if platforms:
        return any(p in platforms for p in names)
    return not env.get("JTB_CPU_DEVICES") and _installed(patterns, paths)


def gpu_possible(environ: Optional[Mapping[str, str]] = None,
                 paths: Optional[Iterable[str]] = None) -> bool:
    """Whether this process may run on a GPU: JAX_PLATFORMS, when set, names cuda/gpu/rocm;
    else no simulated CPU devices (JTB_CPU_DEVICES) and a GPU plugin installed."""
    return _possible(_GPU_NAMES, _GPU_PLUGINS, environ, paths)


def accelerator_possible(environ: Optional[Mapping[str, str]] = None,
                         paths: Optional[Iterable[str]] = None) -> bool:
    """`gpu_possible`, with TPUs too: JAX_PLATFORMS naming tpu, or libtpu installed."""
    return _possible(_GPU_NAMES + ("tpu",), _GPU_PLUGINS + ("libtpu*",), environ, paths)


def with_gpu_fast_compile(flags: str, environ: Optional[Mapping[str, str]] = None,
                          paths: Optional[Iterable[str]] = None) -> str:
    """XLA_FLAGS `flags` plus each GPU_FAST_COMPILE flag they do not name already (a user's own
    value wins flag by flag); `flags` unchanged when JTB_GPU_AUTOTUNE asks for XLA's defaults or
    no GPU can be used (`gpu_possible`)."""
    if wants_autotune(environ) or not gpu_possible(environ, paths):
        return flags
    have = _parse(flags)
    add = [f"--{k}={v}" for k, v in GPU_FAST_COMPILE if k not in have]
    return " ".join([flags.strip()] + add).strip() if add else flags


def gpu_note(flags: str) -> str:
    """One line for a run's start on a GPU: which of the two compile modes XLA_FLAGS `flags` is in."""
    set_here = _parse(flags)
    if all(set_here.get(k) == v for k, v in GPU_FAST_COMPILE):
        return ("XLA GPU: fast compile (Triton GEMMs off, no autotuning: ~20 s a program "
                f"instead of ~2 min); {AUTOTUNE_ENV}=1 keeps XLA's autotuned defaults (steps up "
                "to 15% faster at batch 256)")
    return ("XLA GPU: autotuned GEMMs (XLA's defaults or your XLA_FLAGS): each program can take "
            f"~2 min to compile; unset {AUTOTUNE_ENV} for the fast-compile flags")


def backend_note(backend: str, flags: str):
    """The start-up line about XLA's compile mode on `backend` (a GPU's: `gpu_note`), or None."""
    return gpu_note(flags) if backend == "gpu" else None
