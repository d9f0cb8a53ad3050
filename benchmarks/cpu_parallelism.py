#!/usr/bin/env python
"""How much of the CPU the attention's batched dots use, and what 2 host devices change.

Part `dots`: the attention products of a 12-head model at batch 32, one at a time, in several
layouts, with wall time, process CPU time / wall time (1.0 = one core busy) and GFLOP/s, next to
a dense [4096, 312] x [312, 1200] dot; then the same batched dot split into independent pieces
(does XLA's CPU runtime run independent dots side by side?). Run it under several
`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=...` values to compare YNNPACK with Eigen
(an empty value turns YNNPACK off).

Part `devices`: the train step of benchmarks/step_throughput.py (MiniLM-L6 teacher, 4L-312
student, batch 32, student dropout on) on a mesh of 1 host device and of 2 host devices
(`--xla_force_host_platform_device_count=2`, data-parallel: what `JTB_CPU_DEVICES=2` gives the
CLI), built in one process and timed alternating.

    .venv/bin/python benchmarks/cpu_parallelism.py --part dots
    .venv/bin/python benchmarks/cpu_parallelism.py --part devices --stages tinybert_intermediate,tinybert_pred,finetune --lengths 64,128
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax_tinybert.speed.malloc import restart_unless_set  # noqa: E402  (no JAX yet)

if __name__ == "__main__":
    restart_unless_set()
    if "devices" in sys.argv[1:] and \
            "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=2").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _time(fn, *args, reps=20):
    """-> (median wall s, process CPU s / wall s over the reps) of a jitted fn."""
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    ts, c0, w0 = [], time.process_time(), time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), (time.process_time() - c0) / (time.perf_counter() - w0)


def part_dots(B=32, T=128, H=12):
    r = np.random.RandomState(0)
    print("| product | head dim | ms | CPU / wall | GFLOP/s |\n|---|---|---|---|---|")
    for d in (26, 32):
        q, k = (jnp.asarray(r.randn(B, T, H, d), jnp.float32) for _ in range(2))
        p = jnp.asarray(r.rand(B, H, T, T), jnp.float32)
        qh, kh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        e = lambda a, b: jnp.einsum("bhqk,bhkd->bhqd", a, b)  # noqa: E731
        cases = [
            ("scores bqhd,bkhd->bhqk", lambda a, b: jnp.einsum("bqhd,bkhd->bhqk", a, b), (q, k)),
            ("scores bhqd,bhkd->bhqk", lambda a, b: jnp.einsum("bhqd,bhkd->bhqk", a, b), (qh, kh)),
            ("context bhqk,bkhd->bqhd", lambda a, b: jnp.einsum("bhqk,bkhd->bqhd", a, b), (p, k)),
            ("context bhqk,bhkd->bhqd", e, (p, kh)),
            ("context, batch in 2 independent dots", lambda a1, b1, a2, b2: (e(a1, b1), e(a2, b2)),
             (p[:B // 2], kh[:B // 2], p[B // 2:], kh[B // 2:])),
        ]
        for name, fn, args in cases:
            w, par = _time(fn, *args)
            print(f"| {name} | {d} | {w * 1e3:.2f} | {par:.2f} | {2 * B * H * T * T * d / w / 1e9:.1f} |",
                  flush=True)
    x, w_ = jnp.asarray(r.randn(4096, 312), jnp.float32), jnp.asarray(r.randn(312, 1200), jnp.float32)
    w, par = _time(lambda a, b: a @ b, x, w_)
    print(f"| dense [4096, 312] x [312, 1200] | - | {w * 1e3:.2f} | {par:.2f} | "
          f"{2 * 4096 * 312 * 1200 / w / 1e9:.1f} |", flush=True)


def part_devices(stages, lengths, rounds):
    import step_throughput as st
    from jax_tinybert.parallel import sharding as shd

    if len(jax.devices()) < 2:
        raise SystemExit("needs 2 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    tcfg, tparams = st.load_teacher("minilm")
    scfg = st.student_config("tinybert4", tcfg)
    sparams = st._random_params(scfg, 2)

    def make(stage, T, ndev):
        orig = shd.make_mesh
        shd.make_mesh = lambda axes, devices=None: orig({"data": ndev}, devices=jax.devices()[:ndev])
        try:
            case = st.Case(stage, tcfg, tparams, scfg, sparams, student_dropout=True)
        finally:
            shd.make_mesh = orig
        state, batch = case.fresh_state(), case.shard(st.make_batch(scfg, 32, T))
        compiled = case.step.lower(state, case.teacher_params, batch).compile()
        for _ in range(2):
            state, _ = compiled(state, case.teacher_params, batch)
            jax.block_until_ready(state)
        return [compiled, state, case.teacher_params, batch, []]

    print("| step (batch 32) | T | 1 host device | 2 host devices | speed-up |\n|---|---|---|---|---|")
    for stage in stages:
        for T in lengths:
            runs = {n: make(stage, T, n) for n in (1, 2)}
            for i in range(rounds):
                for n in ((1, 2) if i % 2 == 0 else (2, 1)):
                    compiled, state, tp, batch, ts = runs[n]
                    t0 = time.perf_counter()
                    state, _ = compiled(state, tp, batch)
                    jax.block_until_ready(state)
                    ts.append(time.perf_counter() - t0)
                    runs[n][1] = state
            a, b = (statistics.median(runs[n][4]) for n in (1, 2))
            print(f"| {stage} | {T} | {a:.3f} s | {b:.3f} s | {a / b:.3f}x |", flush=True)
            del runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("dots", "devices"), default="dots")
    p.add_argument("--stages", default="tinybert_intermediate,tinybert_pred,finetune")
    p.add_argument("--lengths", default="64,128")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    print(f"# {os.environ.get('XLA_FLAGS', '')}", flush=True)
    if args.part == "dots":
        part_dots()
    else:
        part_devices(args.stages.split(","), [int(x) for x in args.lengths.split(",")], args.rounds)


if __name__ == "__main__":
    main()
