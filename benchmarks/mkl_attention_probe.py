#!/usr/bin/env python
"""Would MKL's batched GEMM make the attention's products, and so the CPU step, faster? A probe.

XLA runs each of the attention's batched products ([B*H, T, d] x [B*H, d, T] and back, head dim
26 for TinyBERT4) on one core, at 60-125 GFLOP/s on a 2-core Intel Xeon, where MKL's
`cblas_sgemm_batch_strided` reaches ~240 on both cores. This script calls MKL from inside the
jitted programs through an XLA FFI custom call (a 20-line C++ handler, built here with g++
against jax.ffi.include_dir() and the given libmkl_rt), with a custom VJP whose backward is
four more such calls, and times, in one process:
  1. the products alone (scores, context, the value gradient), XLA against MKL;
  2. whole train steps (benchmarks/ab_modeling.py's, steps alternating): the working tree's
     model against the same model with both attention products through MKL.
The gradients are checked against jnp.einsum's first.

MKL is not a dependency of the project; install its wheel (~195 MB) in a scratch environment
(MKL 2025 ships lib/libmkl_rt.so.2, MKL 2026 lib/libmkl_rt.so.3):
    python3 -m venv /tmp/mkl && /tmp/mkl/bin/pip install mkl
    .venv/bin/python benchmarks/mkl_attention_probe.py --mkl_lib /tmp/mkl/lib/libmkl_rt.so.2 \
        [--threads 2] [--stages pred,cached_pred --lengths 128 --rounds 4]
--threads 1 runs MKL sequentially; with 2, KMP_BLOCKTIME=0 keeps MKL's OpenMP threads from
spinning on the cores XLA's threads need (unless KMP_BLOCKTIME is set already).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax_tinybert.speed.malloc import restart_unless_set  # noqa: E402  (no JAX yet)

HANDLER = r"""
#include <cstdint>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;
extern "C" void cblas_sgemm_batch_strided_64(int layout, int transa, int transb, int64_t m,
    int64_t n, int64_t k, float alpha, const float* a, int64_t lda, int64_t stridea,
    const float* b, int64_t ldb, int64_t strideb, float beta, float* c, int64_t ldc,
    int64_t stridec, int64_t batch);
// c[i] = op(a[i]) op(b[i]) for every i of the leading axis; row-major, contiguous.
static ffi::Error Bmm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                      ffi::ResultBuffer<ffi::F32> c, bool transa, bool transb) {
  auto da = a.dimensions(), db = b.dimensions();
  int64_t ar = da[1], ac = da[2], br = db[1], bc = db[2];
  int64_t m = transa ? ac : ar, k = transa ? ar : ac, n = transb ? br : bc;
  cblas_sgemm_batch_strided_64(101, transa ? 112 : 111, transb ? 112 : 111, m, n, k, 1.0f,
      a.typed_data(), ac, ar * ac, b.typed_data(), bc, br * bc, 0.0f, c->typed_data(), n,
      m * n, da[0]);
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(MklBmm, Bmm, ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>()
    .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<bool>("transa")
    .Attr<bool>("transb"));
"""

ATTENTION_PRODUCTS = ("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd")   # modeling.BertSelfAttention's
# The line of modeling.BertSelfAttention that picks its product (float32): rewritten for MKL.
EINSUM_LINE = "        return jnp.einsum(eq, a, b)"   # modeling.Products.einsum


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mkl_lib", required=True, help="path of libmkl_rt.so.2 or .so.3 (see above)")
    p.add_argument("--threads", type=int, default=2, choices=(1, 2))
    p.add_argument("--stages", default="pred,cached_pred")
    p.add_argument("--lengths", default="128")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=30, help="calls timed per product")
    return p.parse_args(argv)


def main(argv=None):
    args = _args(argv)
    if not os.path.isfile(args.mkl_lib):
        raise SystemExit(f"mkl_attention_probe: --mkl_lib {args.mkl_lib}: no such file; "
                         "install MKL's wheel in a scratch venv (python3 -m venv /tmp/mkl && "
                         "/tmp/mkl/bin/pip install mkl) and pass /tmp/mkl/lib/libmkl_rt.so.*")
    # Read by MKL when it loads: before the handler's library is opened.
    if args.threads == 1:
        os.environ["MKL_THREADING_LAYER"] = "SEQUENTIAL"
    else:
        os.environ["MKL_NUM_THREADS"] = str(args.threads)
        os.environ.setdefault("KMP_BLOCKTIME", "0")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import ab_modeling
    import step_throughput as st
    from blas_ffi_probe import build_ffi_library
    from jax_tinybert.speed.cpu import cpu_name
    from jax_tinybert.model import modeling

    lib_dir = os.path.dirname(os.path.abspath(args.mkl_lib))
    lib = ctypes.cdll.LoadLibrary(build_ffi_library(HANDLER, "mkl_bmm", (
        f"-L{lib_dir}", f"-l:{os.path.basename(args.mkl_lib)}", f"-Wl,-rpath,{lib_dir}")))
    jax.ffi.register_ffi_target("mkl_bmm", jax.ffi.pycapsule(lib.MklBmm), platform="cpu")

    def bmm(a, b, ta=False, tb=False):
        m, n = (a.shape[2] if ta else a.shape[1]), (b.shape[1] if tb else b.shape[2])
        return jax.ffi.ffi_call("mkl_bmm", jax.ShapeDtypeStruct((a.shape[0], m, n), jnp.float32))(
            a, b, transa=ta, transb=tb)

    @jax.custom_vjp
    def a_bt(a, b):   # a b^T
        return bmm(a, b, tb=True)

    a_bt.defvjp(lambda a, b: (a_bt(a, b), (a, b)),
                lambda r, g: (bmm(g, r[1]), bmm(g, r[0], ta=True)))

    @jax.custom_vjp
    def a_b(a, b):
        return bmm(a, b)

    a_b.defvjp(lambda a, b: (a_b(a, b), (a, b)),
               lambda r, g: (bmm(g, r[1], tb=True), bmm(r[0], g, ta=True)))

    def mkl_product(eq, a, b):
        """jnp.einsum for the two attention products, [B, H, ., .] operands, float32."""
        B, H = a.shape[:2]
        fn = {ATTENTION_PRODUCTS[0]: a_bt, ATTENTION_PRODUCTS[1]: a_b}[eq]
        out = fn(*(x.reshape((B * H,) + x.shape[2:]).astype(jnp.float32) for x in (a, b)))
        return out.reshape((B, H) + out.shape[1:])

    print(f"# {cpu_name()}; MKL {args.mkl_lib}, threads {args.threads}, KMP_BLOCKTIME "
          f"{os.environ.get('KMP_BLOCKTIME', '-')}", flush=True)

    # The gradients of a small attention core against jnp.einsum's.
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 3, 16, 8), np.float32)) for _ in range(3))

    def core(product):
        def f(q, k, v):
            p = jax.nn.softmax(product(ATTENTION_PRODUCTS[0], q, k), -1)
            return (product(ATTENTION_PRODUCTS[1], p, v) ** 2).sum()
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    for x, y in zip(core(jnp.einsum)(q, k, v), core(mkl_product)(q, k, v)):
        err = float(jnp.abs(x - y).max() / jnp.abs(x).max())
        if not err < 1e-5:
            raise SystemExit(f"mkl_attention_probe: the MKL gradient is off by {err:.2e}")

    def median_ms(f):
        jax.block_until_ready(f())
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3

    B, H, d = 32, 12, 26
    print("| product (batch 32, 12 heads, head dim 26) | T | XLA ms | MKL ms |\n|---|---|---|---|")
    for T in (int(x) for x in args.lengths.split(",")):
        qk = [jnp.asarray(rng.standard_normal((B * H, T, d), np.float32)) for _ in range(2)]
        p = jnp.asarray(rng.random((B * H, T, T), np.float32))
        for name, xla, mkl, operands in (
                ("scores q k^T", lambda a, b: jnp.einsum("nqd,nkd->nqk", a, b),
                 lambda a, b: bmm(a, b, tb=True), qk),
                ("context p v", lambda a, b: jnp.einsum("nqk,nkd->nqd", a, b), bmm, (p, qk[1])),
                ("value gradient p^T g", lambda a, b: jnp.einsum("nkq,nkd->nqd", a, b),
                 lambda a, b: bmm(a, b, ta=True), (p, qk[1]))):
            fx, fm = jax.jit(xla), jax.jit(mkl)
            print(f"| {name} | {T} | {median_ms(lambda: fx(*operands)):.2f} | "
                  f"{median_ms(lambda: fm(*operands)):.2f} |", flush=True)

    # The tree's model with both attention products through MKL, as the "tree" side.
    src = open(modeling.__file__).read()
    if src.count(EINSUM_LINE) != 1:
        raise SystemExit("mkl_attention_probe: modeling.py's attention product line moved; "
                         "update EINSUM_LINE here")
    mkl_model = ab_modeling._load_source("modeling_mkl", src.replace(
        EINSUM_LINE, "        return _mkl_product(eq, a, b)"))
    mkl_model._mkl_product = mkl_product
    tcfg, tparams = st.load_teacher("minilm")
    scfg = st.student_config("tinybert4", tcfg)
    sides = {"baseline": (modeling.BertForSequenceClassification, modeling.BertModel),
             "tree": (mkl_model.BertForSequenceClassification, mkl_model.BertModel)}
    print("\nsteps: baseline = XLA's products, tree = MKL's", flush=True)
    ab_modeling.alternate(sides, args.stages.split(","),
                          [int(x) for x in args.lengths.split(",")], args.rounds,
                          (tcfg, tparams, scfg, st._random_params(scfg, 2)), 32)


if __name__ == "__main__":
    restart_unless_set()
    main()
