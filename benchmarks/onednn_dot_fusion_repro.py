#!/usr/bin/env python
"""Minimal reproduction: XLA:CPU's oneDNN dot fusion dies with SIGILL on a dot fed by any op.

    XLA_FLAGS="--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot"

lifts a plain fp32 matmul (2048x1200x312 from 132 to 217 GFLOP/s on one Intel Xeon),
but a full train step then dies with SIGILL. The op: a `dot` whose operand is computed inside
the same jitted function (an elementwise op, a transpose of another dot, ...). oneDNN's graph
partition for that fusion fails to compile ("partition compile failed" on stderr) and the
process is killed by SIGILL instead of falling back. A dot of two entry parameters, or a dot
followed by an elementwise op, runs fine. Every train step contains the failing pattern
(e.g. the backward of any dense layer: dx = (dy * ...) @ W^T), so there is no safe route
around it: the project leaves the flag off. `--xla_cpu_use_onednn=true` alone (no dot fusion)
does not crash and did not change the matmul rate measurably on the machines tried.

Reproduced with jaxlib 0.10.2 on an AMD EPYC (Zen 4, AVX-512 + bf16) and on an Intel Xeon
(family 6 model 207, AVX-512 + bf16 + fp16): the same three cases die, the same two run. The
fusion takes the producer into the oneDNN partition (the optimised HLO shows `multiply` and
`dot` in one fusion), and putting `jax.lax.optimization_barrier` around the operand does not
keep it out: still SIGILL. `--xla_cpu_experimental_onednn_custom_call=true` (the older matmul
rewriter) leaves every dot to YNNPACK/Eigen in jaxlib 0.10.2. `benchmarks/xla_cpu_settings.py`
times the train step under each dot library. Each case runs in a child process:

    .venv/bin/python benchmarks/onednn_dot_fusion_repro.py          # prints one line per case
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

FLAGS = "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot"

CASES = {
    # name: (python expression of f, argument shapes)
    "dot of parameters: x @ w": ("lambda x, w: x @ w", [(64, 128), (128, 256)]),
    "elementwise after the dot: (x @ w) * 2": ("lambda x, w: (x @ w) * 2", [(64, 128), (128, 256)]),
    "dot fed by an elementwise op: (x * 2) @ w": ("lambda x, w: (x * 2) @ w",
                                                  [(64, 128), (128, 256)]),
    "dot fed by a dot: (x @ w).T @ x": ("lambda x, w: (x @ w).T @ x", [(32, 312), (312, 2)]),
    "dense-layer input gradient": (
        "jax.grad(lambda x, w: jnp.sum(jnp.einsum('btd,df->btf', x, w) ** 2))",
        [(8, 16, 312), (312, 1200)]),
}

_CHILD = """
import jax, jax.numpy as jnp
f = {expr}
args = [jax.random.normal(jax.random.PRNGKey(i), s) for i, s in enumerate({shapes})]
jax.block_until_ready(jax.jit(f)(*args))
"""


def run_case(expr: str, shapes, flags: str = FLAGS) -> str:
    """'ok', 'SIGILL' or another failure, for one jitted function in a child process."""
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _CHILD.format(expr=expr, shapes=shapes)],
                       env=env, capture_output=True, text=True, timeout=300)
    if r.returncode == 0:
        return "ok"
    if r.returncode in (-signal.SIGILL, 128 + signal.SIGILL):
        note = " (stderr: partition compile failed)" if "partition compile failed" in r.stderr \
            else ""
        return "SIGILL" + note
    return f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}"


def main() -> int:
    print(f"XLA_FLAGS={FLAGS}")
    crashed = 0
    for name, (expr, shapes) in CASES.items():
        res = run_case(expr, shapes)
        crashed += res.startswith("SIGILL")
        print(f"  {name:45s} {res}", flush=True)
    only = run_case(*CASES["dot fed by an elementwise op: (x * 2) @ w"],
                    flags="--xla_cpu_use_onednn=true")
    print(f"without the dot fusion (--xla_cpu_use_onednn=true only), (x * 2) @ w: {only}")
    return 0 if crashed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
