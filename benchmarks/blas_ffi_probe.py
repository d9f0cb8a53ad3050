#!/usr/bin/env python
"""Would a BLAS sgemm called from inside XLA make the CPU step faster? A probe, not a feature.

On a 2-core Intel Xeon (family 6 model 207) MKL (torch) and OpenBLAS (numpy) multiply fp32
matrices of the student's shapes 1.2-1.5x faster than XLA's YNNPACK dots, called alone. This
script puts OpenBLAS (the copy numpy ships) inside jitted programs through an XLA FFI custom call
(a 20-line C++ handler, built here with g++ against jax.ffi.include_dir()) and times, XLA's dots
against the custom call, in one process:
  1. single products [M, K] x [K, N] and the two transposed forms the backward pass needs;
  2. the forward and backward of 4 feed-forward blocks (x + W2 gelu(x W1 + b1) + b2, D 312,
     d_ff 1,200: TinyBERT4's shapes), the products by the custom call with a custom VJP; and
     the same with XLA's forward products (their epilogues fused) and the custom call's
     backward products only.
Needs g++ and numpy's bundled OpenBLAS (numpy.libs/libscipy_openblas64_*.so); says so if absent.

    .venv/bin/python benchmarks/blas_ffi_probe.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax_tinybert.speed.cpu import cpu_name  # noqa: E402

HANDLER = r"""
#include <cstdint>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;
// cblas_sgemm, ILP64 (scipy-openblas's scipy_cblas_sgemm64_): row-major 101, no/trans 111/112.
typedef void (*sgemm_t)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                        const float*, int64_t, float, float*, int64_t);
static sgemm_t g_sgemm = nullptr;
extern "C" void jtb_set_sgemm(void* f) { g_sgemm = reinterpret_cast<sgemm_t>(f); }
static ffi::Error Impl(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                       ffi::ResultBuffer<ffi::F32> c, bool ta, bool tb) {
  if (!g_sgemm) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "sgemm not set");
  auto da = a.dimensions(); auto db = b.dimensions();
  int64_t m = ta ? da[1] : da[0], k = ta ? da[0] : da[1], n = tb ? db[0] : db[1];
  g_sgemm(101, ta ? 112 : 111, tb ? 112 : 111, m, n, k, 1.0f, a.typed_data(), da[1],
          b.typed_data(), db[1], 0.0f, c->typed_data(), n);
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(JtbSgemm, Impl,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>().Attr<bool>("trans_a").Attr<bool>("trans_b"));
"""


def build_ffi_library(source: str, name: str, link_args=()) -> str:
    """Compiles `source`, a C++ XLA FFI handler, with g++ against jax.ffi.include_dir() into
    lib`name`.so in a temporary folder (linked with `link_args`) -> the library's path."""
    if not shutil.which("g++"):
        sys.exit("error: needs g++ to build the FFI handler (apt-get install g++)")
    tmp = tempfile.mkdtemp(prefix=f"jtb-{name}-")
    src, so = os.path.join(tmp, name + ".cc"), os.path.join(tmp, f"lib{name}.so")
    with open(src, "w") as f:
        f.write(source)
    subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
                    f"-I{jax.ffi.include_dir()}", src, "-o", so, *link_args], check=True)
    return so


def build_and_register() -> None:
    """Builds the handler, points it at numpy's OpenBLAS and registers `jtb_sgemm` (CPU)."""
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs",
                                  "libscipy_openblas64_*.so"))
    if not libs:
        sys.exit("error: needs numpy's bundled OpenBLAS (numpy.libs/); use a numpy wheel from "
                 "PyPI")
    blas, lib = ctypes.CDLL(libs[0]), ctypes.CDLL(build_ffi_library(HANDLER, "jtbsgemm"))
    lib.jtb_set_sgemm(ctypes.cast(blas.scipy_cblas_sgemm64_, ctypes.c_void_p))
    jax.ffi.register_ffi_target("jtb_sgemm", jax.ffi.pycapsule(lib.JtbSgemm), platform="cpu")


def blas_dot(a, b, ta=False, tb=False):
    """a [M, K] (or [K, M] with ta) x b [K, N] (or [N, K] with tb) -> [M, N], by OpenBLAS."""
    m, n = (a.shape[1] if ta else a.shape[0]), (b.shape[0] if tb else b.shape[1])
    return jax.ffi.ffi_call("jtb_sgemm", jax.ShapeDtypeStruct((m, n), jnp.float32))(
        a, b, trans_a=ta, trans_b=tb)


@jax.custom_vjp
def blas_matmul(x, w):
    return blas_dot(x, w)


blas_matmul.defvjp(lambda x, w: (blas_dot(x, w), (x, w)),
                   lambda res, g: (blas_dot(g, res[1], tb=True), blas_dot(res[0], g, ta=True)))


@jax.custom_vjp
def blas_backward_matmul(x, w):
    """XLA's product forward (its bias / GELU epilogues stay fused), OpenBLAS's backward."""
    return jnp.dot(x, w)


blas_backward_matmul.defvjp(lambda x, w: (jnp.dot(x, w), (x, w)),
                            lambda res, g: (blas_dot(g, res[1], tb=True),
                                            blas_dot(res[0], g, ta=True)))


def ffn_loss(params, x, dot):
    h = x
    for w1, b1, w2, b2 in params:
        h = h + dot(jax.nn.gelu(dot(h, w1) + b1, approximate=False), w2) + b2
    return jnp.sum(h * h)


def best_of(fn, args, rounds, reps):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) / reps)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    build_and_register()
    rng = np.random.RandomState(0)
    print(f"# {cpu_name()}; OpenBLAS threads: {os.environ.get('OPENBLAS_NUM_THREADS', 'default')}")
    print("| product | XLA (ms) | OpenBLAS via FFI (ms) | XLA / FFI |\n|---|---|---|---|")
    for m, k, n in [(256, 312, 1200), (256, 1200, 312), (512, 312, 1200), (2048, 312, 1200)]:
        a, b = (jnp.asarray(rng.rand(*s).astype(np.float32)) for s in [(m, k), (k, n)])
        g = jnp.asarray(rng.rand(m, n).astype(np.float32))
        cases = [(f"[{m}, {k}] x [{k}, {n}]", lambda a, b: a @ b, blas_dot, (a, b)),
                 (f"x^T g ({m} rows)", lambda a, g: a.T @ g,
                  lambda a, g: blas_dot(a, g, ta=True), (a, g)),
                 (f"g w^T ({m} rows)", lambda g, b: g @ b.T,
                  lambda g, b: blas_dot(g, b, tb=True), (g, b))]
        for name, fx, fb, xs in cases:
            fx, fb = jax.jit(fx), jax.jit(fb)
            np.testing.assert_allclose(fb(*xs), fx(*xs), rtol=1e-4, atol=1e-3)
            tx, tb = (best_of(f, xs, args.rounds, 100) for f in (fx, fb))
            print(f"| {name} | {1e3 * tx:.3f} | {1e3 * tb:.3f} | {tx / tb:.2f}x |", flush=True)
    D, F = 312, 1200
    params = [tuple(jnp.asarray(rng.randn(*s).astype(np.float32) * 0.02)
                    for s in [(D, F), (F,), (F, D), (D,)]) for _ in range(4)]
    print("\n| 4 FFN blocks, forward + backward | XLA (ms) | OpenBLAS via FFI (ms) | XLA / FFI "
          "| XLA forward, OpenBLAS backward (ms) | XLA / that |\n|---|---|---|---|---|---|")
    for m in (256, 512, 2048):
        x = jnp.asarray(rng.randn(m, D).astype(np.float32))
        fx = jax.jit(jax.grad(lambda p, x: ffn_loss(p, x, jnp.dot)))
        fb = jax.jit(jax.grad(lambda p, x: ffn_loss(p, x, blas_matmul)))
        fm = jax.jit(jax.grad(lambda p, x: ffn_loss(p, x, blas_backward_matmul)))
        for f in (fb, fm):
            for gx, gb in zip(jax.tree_util.tree_leaves(fx(params, x)),
                              jax.tree_util.tree_leaves(f(params, x))):
                np.testing.assert_allclose(gb, gx, rtol=1e-3,
                                           atol=1e-4 * float(jnp.max(jnp.abs(gx))))
        tx, tb, tm = (best_of(f, (params, x), args.rounds, 20) for f in (fx, fb, fm))
        print(f"| {m} tokens | {1e3 * tx:.2f} | {1e3 * tb:.2f} | {tx / tb:.2f}x | "
              f"{1e3 * tm:.2f} | {tx / tm:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
