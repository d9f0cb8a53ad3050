"""XLA's float32 product against its bfloat16 x bfloat16 -> float32 product on this machine, at
2048^3 and at the dense shapes of a train step (4,096 rows of the 4-layer student and of MiniLM):
whether `--config.student.dtype=bfloat16 --config.teacher.dtype=bfloat16` can pay here.

On a CPU the bf16 setting runs the products with bf16 operands and float32 sums
(`speed.dots.half_einsum`), so this times exactly that product. `cpu.fast_bf16` is the rule the
CLI's start-up note applies without timing anything; this prints its answer beside the
measurement, so a new CPU can be checked against it.

    .venv/bin/python benchmarks/matmul_dtypes.py [--repeats 10] [--shapes MxKxN,...] [--json out.json]
        [--cpuinfo FILE]   # the rule's answer for another machine's /proc/cpuinfo
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jax_tinybert.speed.cpu import PROC_CPUINFO, cpu_name, cpuinfo, fast_bf16  # noqa: E402

SHAPES = ((2048, 2048, 2048),      # the usual peak
          (4096, 312, 1200),       # student FFN in
          (4096, 1200, 312),       # student FFN out
          (4096, 312, 936),        # student fused QKV
          (4096, 384, 1536),       # MiniLM FFN in
          (4096, 1536, 384))       # MiniLM FFN out


def best_seconds(f, *args, repeats: int) -> float:
    """The fastest of `repeats` calls after one warm-up (compile) call."""
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(*args).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


RECORD_KEY = ("m", "k", "n")


def record(res: dict) -> str:
    """Merge a run's rows into benchmarks/results/matmul_dtypes-<machine>.json; the path."""
    import results

    rows = [{"m": r["m"], "k": r["k"], "n": r["n"], "f32_gflop_s": round(r["f32_gflop_s"]),
             "bf16_gflop_s": round(r["bf16_gflop_s"]),
             "bf16_over_f32": round(r["bf16_gflop_s"] / r["f32_gflop_s"], 2)}
            for r in res["rows"]]
    meta = {"cpu": res["cpu"], "jax": res["jax"],
            "note": f"cpu.fast_bf16() says: {res['cpu_fast_bf16']}."}
    return results.record("matmul_dtypes", results.machine_kind(), rows, RECORD_KEY, meta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--shapes", default="",
                    help="comma list of MxKxN (default: 2048^3 and the train step's dense shapes)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--record", action="store_true", help="merge the rows into benchmarks/results/")
    ap.add_argument("--cpuinfo", default=PROC_CPUINFO,
                    help="read the CPU's name and the bf16 rule's answer from this copy of "
                         "/proc/cpuinfo (the timings are always this machine's)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    info = cpuinfo(args.cpuinfo)
    name, rule = cpu_name(info), fast_bf16(info)
    f32 = jax.jit(lambda a, b: a @ b)
    bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    rng = np.random.default_rng(0)
    rows = []
    print(f"# {name}; jax {jax.__version__} on {jax.default_backend()}; "
          f"cpu.fast_bf16(): {rule}")
    print("| m x k x n | float32 GFLOP/s | bf16 x bf16 -> f32 GFLOP/s | bf16 / f32 |")
    print("|---|---:|---:|---:|")
    shapes = ([tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
              if args.shapes else SHAPES)
    for m, k, n in shapes:
        a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        b = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        flop = 2.0 * m * k * n
        g32 = flop / best_seconds(f32, a, b, repeats=args.repeats) / 1e9
        g16 = flop / best_seconds(bf16, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                                  repeats=args.repeats) / 1e9
        rows.append({"m": m, "k": k, "n": n, "f32_gflop_s": g32, "bf16_gflop_s": g16})
        print(f"| {m} x {k} x {n} | {g32:.0f} | {g16:.0f} | {g16 / g32:.2f}x |", flush=True)
    res = {"cpu": name, "jax": jax.__version__, "cpu_fast_bf16": rule, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.record:
        if args.cpuinfo != PROC_CPUINFO:
            ap.error("--record: --cpuinfo names another CPU than the one timed")
        print(f"recorded {os.path.relpath(record(res))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
